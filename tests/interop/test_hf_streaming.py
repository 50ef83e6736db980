"""Streaming a save_pretrained directory (interop/hf/stream.py): tensor by tensor into
``param_dtype``, quantized (QLoRA) and placed, equal to the whole-tree conversion.

The reference is the whole-tree path (``from_hf_state_dict`` over the same lazy directory
mapping, no ``LoadTarget``): what ``from_hf(dir)`` returned before the streaming path.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.interop.common import ConversionError
from transformer_jax.interop.hf import convert, from_hf
from transformer_jax.layers.lora import LoraConfig
from transformer_jax.layers.quant import quantize_params
from transformer_jax.models import GPTConfig

from .conftest import gpt2_model, perturbed, torch, transformers

LLAMA = dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
             eos_token_id=None, pad_token_id=None)
WORKER = Path(__file__).with_name("stream_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _llama(seed=0):
    config = transformers.LlamaConfig(**LLAMA)
    return perturbed(lambda: transformers.LlamaForCausalLM(config), seed)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """``{name: directory}``: bf16 checkpoints saved sharded (16 KB shards, an index), and
    fp32 ones."""
    root = tmp_path_factory.mktemp("stream")
    out = {}
    for family, build in (("llama", _llama), ("gpt2", gpt2_model)):
        model = build()
        out[f"{family}-fp32"] = str(root / f"{family}-fp32")
        model.save_pretrained(out[f"{family}-fp32"])
        out[f"{family}-bf16"] = str(root / f"{family}-bf16")
        model.to(torch.bfloat16).save_pretrained(out[f"{family}-bf16"], max_shard_size="16KB")
    return out


def whole_tree(directory, **overrides):
    """The whole-tree conversion (the reference)."""
    config, state_dict = convert._load_local_dir(directory)
    return convert.from_hf_state_dict(config, state_dict, **overrides)[1]


def flat(tree):
    return {"/".join(str(k.key) for k in p): x
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_bits_equal(got, want):
    got, want = flat(got), flat(want)
    assert sorted(got) == sorted(want)
    for key in want:
        a, b = np.asarray(got[key]), np.asarray(want[key])
        assert (a.dtype, a.shape) == (b.dtype, b.shape), key
        assert a.tobytes() == b.tobytes(), key


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("scan", [False, True])
def test_a_bf16_directory_streams_into_bf16_params_bit_for_bit(dirs, family, scan):
    directory = dirs[f"{family}-bf16"]
    index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) >= 3          # really sharded
    _, params = from_hf(directory, param_dtype="bfloat16", scan_layers=scan)
    old = whole_tree(directory, scan_layers=scan)                # fp32, as before
    assert {np.asarray(x).dtype for x in jax.tree_util.tree_leaves(old)} == {np.dtype("float32")}
    assert_bits_equal(params, jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), old))
    # from_hf(dir) without param_dtype keeps giving the fp32 params of before
    assert_bits_equal(from_hf(directory, scan_layers=scan)[1], old)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float32_directory_equals_the_whole_tree_path(dirs, family, dtype):
    directory = dirs[f"{family}-fp32"]
    _, params = from_hf(directory, param_dtype=dtype, scan_layers=True)
    assert_bits_equal(params, whole_tree(directory, param_dtype=dtype, scan_layers=True))


@pytest.mark.parametrize("fields", [dict(quantize="int8"), dict(quantize="nf4"),
                                    dict(quantize="nf4", double_quant=True)],
                         ids=["int8", "nf4", "nf4-dq"])
@pytest.mark.parametrize("family,scan", [("gpt2", False), ("llama", True)])
def test_the_streamed_qlora_base_equals_quantize_params(dirs, fields, family, scan):
    lora = LoraConfig(**fields)
    directory = dirs[f"{family}-bf16"]
    _, params = from_hf(directory, param_dtype="bfloat16", scan_layers=scan, quantize=lora)
    want = quantize_params(whole_tree(directory, param_dtype="bfloat16", scan_layers=scan), lora)
    assert_bits_equal(params, want)
    stored = [k for k in flat(params) if k.endswith("kernel_q")]
    assert len(stored) == (7 if family == "llama" else 6) * (1 if scan else 2)


def test_a_live_model_is_quantized_and_placed_after_conversion(dirs):
    lora = LoraConfig(quantize="nf4")
    model = _llama()
    _, params = from_hf(model, quantize=lora, shardings=jax.sharding.SingleDeviceSharding(
        jax.devices()[0]))
    assert_bits_equal(params, quantize_params(from_hf(model)[1], lora))


def test_what_a_streamed_load_refuses(dirs):
    directory = dirs["llama-bf16"]
    with pytest.raises(UserError, match="give mesh or shardings to load the params, not both"):
        from_hf(directory, mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",)),
                shardings=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(UserError, match="quantize= loads a frozen base"):
        from_hf(directory, quantize=LoraConfig(quantize="nf4"), lora=LoraConfig(rank=4))
    with pytest.raises(UserError, match="quantize takes a LoraConfig with quantize='int8' or"):
        from_hf(directory, quantize=LoraConfig(rank=4))


def _rewrite(directory, out, edit):
    """``directory``'s fp32 model.safetensors with ``edit(tensors)`` applied, into ``out``."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(out)
    tensors = edit(load_file(os.path.join(directory, "model.safetensors")))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(directory, "config.json")) as f, \
            open(os.path.join(out, "config.json"), "w") as g:
        g.write(f.read())
    return out


def test_missing_unexpected_and_misshaped_keys_are_named(dirs, tmp_path):
    src = dirs["llama-fp32"]
    key = "model.layers.1.mlp.up_proj.weight"
    cases = {
        "missing": (lambda t: {k: v for k, v in t.items() if k != key},
                    f"expected key {key!r} is missing"),
        "extra": (lambda t: {**t, "model.layers.1.mlp.extra": np.zeros(3, np.float32)},
                  "unexpected key(s) that no mapping consumes: ['model.layers.1.mlp.extra']"),
        "shape": (lambda t: {**t, key: t[key][:, :-1].copy()},
                  f"{key!r} has shape (128, 63), expected (128, 64)"),
    }
    for name, (edit, message) in cases.items():
        directory = _rewrite(src, str(tmp_path / name), edit)
        for scan in (False, True):
            with pytest.raises(ConversionError) as e:
                from_hf(directory, param_dtype="bfloat16", scan_layers=scan,
                        quantize=LoraConfig(quantize="int8"))
            assert message in str(e.value)


def _worker(*args, devices=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    if devices:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={devices}").strip()
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_mesh_load_carries_the_training_loops_fsdp_shardings(dirs):
    out = _worker("mesh", dirs["llama-bf16"], devices=4)
    assert out["devices"] == 4
    assert out["same_shardings"] == out["paths"]                  # sharding.param_shardings
    assert out["equal"] == out["paths"]                           # == the unsharded load
    # FSDP splits the embed axis (D = 64) over the 4 devices: each holds a quarter
    assert out["specs"]["h/mlp/wi_0/kernel"] == "P(None, 'fsdp', 'tensor')"
    assert out["shard_rows"]["h/mlp/wi_0/kernel"] == [[2, 16, 128]] * 4
    assert out["shard_rows"]["wte/embedding"] == [[101, 16]] * 4


def _write_bf16_llama(directory, cfg):
    """A Llama directory of random bf16 weights with the real HF key names (shards of 64 MB)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.load_memory import write_checkpoint
    return write_checkpoint(directory, cfg, shard_bytes=64 << 20)


def test_peak_host_memory_of_a_streamed_bf16_load(tmp_path):
    # 8 layers, D 768, vocab 32000 (untied), F 2048: 101M parameters, 202 MB of bf16
    cfg = GPTConfig.preset("llama-tiny").replace(
        vocab_size=32000, d_model=768, num_heads=12, num_kv_heads=4, mlp_dim=2048,
        num_layers=8, tie_embeddings=False)
    total = _write_bf16_llama(tmp_path / "ckpt", cfg)
    assert total == 2 * cfg.num_params()
    out = _worker("memory", str(tmp_path / "ckpt"))
    assert out["params_bytes"] == total                           # bf16 params, on the CPU device
    # the params themselves (host memory on the CPU backend) plus about one tensor: the
    # largest, an embedding (V, D) of 49 MB, read, transposed and placed (3 copies); the
    # float32 copy of before alone would be 2 x total
    largest = 2 * 32000 * 768
    assert out["growth"] < total + 3 * largest + (32 << 20), out
    assert out["growth"] < 0.75 * (2 * total), out
