"""What a TPU and a GPU would run, checked from this CPU host by lowering.

``jax.jit(step).trace(...).lower(lowering_platforms=("tpu",))`` (or ``"cuda"``) gives the
program a TPU (GPU) would compile, with the Pallas kernels as Mosaic (Triton) custom calls
and cuDNN attention as its own. For GPT, BERT, T5, ViT and Gemma the whole train step (forward,
backward, AdamW) is lowered with the families' default ``attention_impl="auto"``, in bf16
and fp32, and the text must hold the expected attention kernel in every attention call and
none of the CPU tuning (no conditional, no optimization barrier). Mosaic asks for a TPU
generation, which a test takes from a TPU topology's device (libtpu installed) or
registers for this host; cuDNN asks the CUDA plugin for its
version, which a test answers (this host has no plugin). Nothing here runs on a device.
"""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.layers import attention, attention_dispatch, resolve_implementation
from transformer_jax.layers.flash_attention import flash_attention
from transformer_jax.layers.masks import AttentionPattern
from transformer_jax.models import (Bert, BertConfig, Gemma, GemmaConfig, GPT, GPTConfig, T5,
                                    T5Config, ViT, ViTConfig)
from transformer_jax.train.optim import make_optimizer
from transformer_jax.train.step import create_train_state, make_train_step

from .helpers import custom_calls, lowered_text

MOSAIC = "tpu_custom_call"
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture
def tpu_generation(monkeypatch):
    """Mosaic asks for the TPU generation it lowers for: a v5e. With the TPU compiler
    (libtpu) installed, a v5e device of JAX's topology, through the abstract mesh that
    Mosaic (and ``attention_dispatch.tpu_generation``) read; without it, a v5e registered for this
    host's device kind."""
    if importlib.util.find_spec("libtpu") is not None:
        from transformer_jax.tpu import TpuSlice
        devices = TpuSlice.parse("v5e-4").jax_devices()
        with jax.sharding.use_abstract_mesh(_abstract_mesh(devices, (4,), ("data",))):
            yield devices                 # the 4 devices of a v5e-4, for a test's own mesh
        return
    from jax._src.pallas.mosaic import tpu_info
    kind = tpu_info.get_device_kind()
    monkeypatch.setitem(tpu_info.registry, kind,
                        lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1))
    yield None


def _abstract_mesh(devices, shape, names):
    """The abstract mesh of ``devices`` (a TPU topology's) laid out as ``shape``; Auto axes."""
    from jax.sharding import AxisType, Mesh
    return Mesh(np.array(devices).reshape(shape), names,
                axis_types=(AxisType.Auto,) * len(names)).abstract_mesh


@pytest.fixture
def cudnn_present(monkeypatch):
    """JAX asks the CUDA plugin for the cuDNN version and the GPU for its compute capability
    when it builds a cuDNN call; answer as an H200 with cuDNN 9.10 would."""
    from jax._src.cudnn import fused_attention_stablehlo as fas
    monkeypatch.setattr(fas, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fas, "check_compute_capability", lambda capability: True)


def _xent(logits, labels, weights):
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return jnp.sum(losses * weights), {"weight": jnp.sum(weights), "nll": jnp.sum(losses * weights)}


def _gpt(dtype, **settings):
    cfg = GPTConfig(vocab_size=512, max_len=256, num_layers=2, num_heads=4, num_kv_heads=2,
                    d_model=256, dropout_rate=0.0, attention_dropout_rate=0.0, dtype=dtype,
                    **settings)
    ids = jnp.zeros((2, 256), jnp.int32)

    def loss(apply_fn, params, batch, rngs, deterministic, smoothing):
        logits = apply_fn({"params": params}, batch["ids"], deterministic=deterministic, rngs=rngs)
        return _xent(logits, batch["ids"], jnp.ones(batch["ids"].shape))
    return GPT(cfg), (ids,), {"ids": ids}, loss


def _gemma(dtype):
    """Gemma 3: local (a window of 64 of the 256 tokens), local, global."""
    cfg = GemmaConfig(vocab_size=512, max_len=256, num_layers=3, num_heads=4, num_kv_heads=2,
                      head_dim=64, d_model=256, mlp_dim=512, sliding_window=64,
                      sliding_window_pattern=3, dtype=dtype)
    model, init_args, batch, loss = _gpt(dtype)
    return Gemma(cfg), init_args, batch, loss


def _bert(dtype):
    cfg = BertConfig(vocab_size=512, max_len=256, num_layers=2, num_heads=4, d_model=256,
                     head="mlm", dropout_rate=0.0, attention_dropout_rate=0.0, dtype=dtype)
    ids = jnp.zeros((2, 256), jnp.int32)
    mask = jnp.ones((2, 256), jnp.int32).at[1, 200:].set(0)           # a padding mask

    def loss(apply_fn, params, batch, rngs, deterministic, smoothing):
        logits = apply_fn({"params": params}, batch["ids"], None, batch["mask"],
                          deterministic=deterministic, rngs=rngs)
        return _xent(logits, batch["ids"], batch["mask"])
    return Bert(cfg), (ids,), {"ids": ids, "mask": mask}, loss


def _t5(dtype):
    cfg = T5Config(vocab_size=512, d_model=256, num_heads=4, head_dim=64, mlp_dim=512,
                   num_layers=2, dropout_rate=0.0, dtype=dtype)
    src, tgt = jnp.zeros((2, 128), jnp.int32), jnp.zeros((2, 64), jnp.int32)
    mask = jnp.ones((2, 128), jnp.int32).at[0, 100:].set(0)

    def loss(apply_fn, params, batch, rngs, deterministic, smoothing):
        logits = apply_fn({"params": params}, batch["src"], batch["tgt"], batch["mask"],
                          deterministic=deterministic, rngs=rngs)
        return _xent(logits, batch["tgt"], jnp.ones(batch["tgt"].shape))
    return T5(cfg), (src, tgt), {"src": src, "tgt": tgt, "mask": mask}, loss


def _vit(dtype):
    cfg = ViTConfig(image_size=64, patch_size=4, num_classes=10, num_layers=2, num_heads=4,
                    d_model=256, dtype=dtype)
    images = jnp.zeros((2, 64, 64, 3), jnp.float32)                   # 256 patches + CLS

    def loss(apply_fn, params, batch, rngs, deterministic, smoothing):
        logits = apply_fn({"params": params}, batch["images"], deterministic=deterministic,
                          rngs=rngs)
        return _xent(logits, batch["labels"], jnp.ones(batch["labels"].shape))
    return ViT(cfg), (images,), {"images": images, "labels": jnp.zeros((2,), jnp.int32)}, loss


def _qwen3(dtype):
    """The Llama-style GPT as Qwen 3 (q/k RMSNorm, head size 128 != D / N = 64) with
    Llama 3's RoPE scaling (64 original positions < 256 tokens)."""
    return _gpt(dtype, position="rope", norm="rmsnorm", gated_mlp=True, activation="silu",
                use_bias=False, qk_norm=True, head_size=128,
                rope_scaling=dict(kind="llama3", original_max_len=64))


FAMILIES = {"gpt": _gpt, "qwen3": _qwen3, "bert": _bert, "t5": _t5, "vit": _vit, "gemma": _gemma}
# attention calls per train step (2 layers each): GPT, BERT, ViT self-attention; T5 encoder
# self-attention and decoder self- and cross-attention; Gemma's 3 layers
ATTENTION_CALLS = {"gpt": 2, "qwen3": 2, "bert": 2, "t5": 6, "vit": 2, "gemma": 3}
# of which carry T5's position bias (its gradient is one more kernel on TPU)
BIASED = {"gpt": 0, "qwen3": 0, "bert": 0, "t5": 4, "vit": 0, "gemma": 0}


def _train_step_text(family, dtype, platform):
    model, init_args, batch, loss = FAMILIES[family](dtype)
    tx = make_optimizer(schedule=1e-3)
    state = jax.eval_shape(lambda: create_train_state(model, tx, jax.random.PRNGKey(0),
                                                      *init_args))
    step = make_train_step(loss_fn=loss)
    return lowered_text(step, (state, batch), platform)


def _no_cpu_tuning(text):
    assert "stablehlo.case" not in text, "a conditional (CPU tuning) in the lowered step"
    assert "optimization_barrier" not in text, "an optimization barrier (CPU tuning)"


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_step_lowered_for_tpu_uses_the_mosaic_kernel(family, dtype, tpu_generation):
    """Each attention call is one Mosaic kernel forward and two backward (dK/dV, dQ), plus
    one for the gradient of T5's position bias."""
    text = _train_step_text(family, dtype, "tpu")
    _no_cpu_tuning(text)
    calls = ATTENTION_CALLS[family]
    assert custom_calls(text).count(MOSAIC) == 3 * calls + BIASED[family]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_step_lowered_for_cuda_uses_cudnn_in_bf16_and_triton_in_fp32(family, cudnn_present):
    """bf16: every attention call is a cuDNN fused attention, forward and backward (ViT's
    257 tokens are odd, which cuDNN's backward does not take: Triton). fp32 (which cuDNN's
    flash attention does not take): the Pallas kernel through Triton."""
    calls = ATTENTION_CALLS[family]
    bf16_text = _train_step_text(family, "bfloat16", "cuda")
    _no_cpu_tuning(bf16_text)
    bf16 = custom_calls(bf16_text)
    if family == "vit":
        assert bf16.count(TRITON) == 3 * calls and not any(c.startswith("__cudnn") for c in bf16)
        return
    fwd = [c for c in bf16 if c.startswith("__cudnn$fmha") and not c.endswith("Backward")]
    bwd = [c for c in bf16 if c.startswith("__cudnn$fmha") and c.endswith("Backward")]
    assert (len(fwd), len(bwd)) == (calls, calls), bf16
    assert TRITON not in bf16
    fp32_text = _train_step_text(family, "float32", "cuda")
    _no_cpu_tuning(fp32_text)
    fp32 = custom_calls(fp32_text)
    assert fp32.count(TRITON) == 3 * calls + BIASED[family]
    assert not any(c.startswith("__cudnn") for c in fp32)


def test_without_cudnn_the_gpu_takes_the_triton_kernel():
    """A jaxlib without the CUDA plugin (this host) lowers "auto" for CUDA to the Pallas
    kernel in bf16 too, and says so."""
    assert not attention_dispatch.cudnn_available()
    assert resolve_implementation("auto", "gpu", dtype=jnp.bfloat16, head_dim=64) == "pallas"
    q = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
    f = jax.grad(lambda q: jnp.sum(attention.dot_product_attention(q, q, q, causal=True)
                                   .astype(jnp.float32)))
    assert custom_calls(lowered_text(f, (q,), "cuda")).count(TRITON) == 3


def test_cpu_lowering_keeps_the_reference_and_its_tuning():
    """On the CPU "auto" is the reference attention with its tuned derivatives."""
    text = _train_step_text("gpt", "float32", "cpu")
    assert MOSAIC not in text and TRITON not in text and "__cudnn" not in text
    assert "stablehlo.optimization_barrier" in text and "stablehlo.case" in text


def test_resolve_implementation_table():
    """The choice "auto" makes, per platform and call."""
    r = resolve_implementation
    assert r("auto", "tpu") == "splash"
    assert r("auto", "tpu", bias=True) == "pallas"
    assert r("auto", "cpu") == "xla"
    assert r("auto", "cpu", q_len=8192, kv_len=8192) == "chunked"
    for platform in ("cpu", "gpu", "tpu"):
        assert r("auto", platform, dropout=True) == "xla"
        assert r("auto", platform, return_weights=True) == "xla"
        assert r("auto", platform, q_len=1, kv_len=1024) == "xla"      # a decode step
        assert r("chunked", platform) == "chunked"
    assert r("jax", "cpu") == "xla"
    window, strided = AttentionPattern("window", 256), AttentionPattern("strided", 64)
    assert r("auto", "cpu", q_len=2048, kv_len=2048, pattern=window) == "chunked"
    assert r("auto", "cpu", q_len=512, kv_len=512, pattern=window) == "xla"
    assert r("auto", "cpu", q_len=2048, kv_len=2048, pattern=strided) == "xla"
    assert r("auto", "tpu", pattern=strided) == "pallas"
    with pytest.raises(ValueError, match="attention_impl='linear' is not an implementation"):
        r("linear", "tpu")
    with pytest.raises(ValueError, match="unknown attention_impl"):
        r("flash", "tpu")
    with pytest.raises(ValueError, match="unknown platform"):
        r("auto", "ipu")


def test_attention_plan_of_a_run():
    """What a run prints and writes into config.json: GPT-2 124M in bf16 on a TPU takes the
    splash kernel, unless attention dropout forces the reference while training; T5 (its
    relative position bias) our Pallas kernel; each with the reason."""
    from transformer_jax.models.base import attention_plan, describe_attention_plan
    cfg = GPTConfig.preset("gpt2", dtype="bfloat16", attention_dropout_rate=0.0)
    plan = attention_plan(cfg, 1024, "tpu")
    why = ("no bias, a mask it expresses (causal or not, key padding, segment ids): "
           "MaxText's default")
    assert plan == {"attention_impl": "auto", "platform": "tpu", "train": "splash",
                    "eval": "splash", "why": why}
    assert describe_attention_plan(plan, cfg) == f"attention: auto -> splash (tpu: {why})"
    dropped = cfg.replace(attention_dropout_rate=0.1)
    plan = attention_plan(dropped, 1024, "tpu")
    assert (plan["train"], plan["eval"]) == ("xla", "splash")
    assert describe_attention_plan(plan, dropped) == (
        "attention: auto -> xla while training (tpu: attention dropout 0.1 needs it; set it to 0 "
        f"for splash), splash at eval: {why}")
    t5 = T5Config.preset("tiny", dropout_rate=0.0)
    assert describe_attention_plan(attention_plan(t5, 512, "tpu", 5), t5) == (
        "attention: auto -> pallas (tpu v5: an additive bias (T5 relative positions))")
    vit = ViTConfig.preset("B/16")                       # 197 tokens: its own length
    assert attention_plan(vit, 1024, "cpu")["train"] == "xla"
    assert attention_plan(GPTConfig(attention_impl="chunked"), 64, "gpu")["eval"] == "chunked"


def test_resolve_implementation_on_a_gpu_with_cudnn(cudnn_present):
    r = resolve_implementation
    assert r("auto", "gpu", dtype=jnp.bfloat16, head_dim=64) == "cudnn"
    assert r("auto", "gpu", dtype=jnp.float32, head_dim=64) == "pallas"      # fp32
    assert r("auto", "gpu", dtype=jnp.bfloat16, head_dim=80 + 4) == "pallas"  # not a multiple of 8
    assert r("auto", "gpu", dtype=jnp.bfloat16, q_len=197, kv_len=197) == "pallas"  # odd length
    assert r("jax", "gpu", dtype=jnp.bfloat16) == "cudnn"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_pallas_kernel_lowers_for_tpu_and_gpu_from_128_to_8192_tokens(head_dim, tpu_generation):
    """The flash kernel alone, causal, bf16, forward + backward: one Mosaic (Triton) call
    forward and two backward at every length."""
    for t in (128, 512, 2048, 8192):
        q = jax.ShapeDtypeStruct((1, t, 2, head_dim), jnp.bfloat16)
        for platform, target, kernel_platform in (("tpu", MOSAIC, "tpu"), ("cuda", TRITON, "gpu")):
            def loss(q, k, v):
                out = flash_attention(q, k, v, causal=True, platform=kernel_platform)
                return jnp.sum(out.astype(jnp.float32))
            text = lowered_text(jax.grad(loss, (0, 1, 2)), (q, q, q), platform)
            assert custom_calls(text).count(target) == 3, (t, platform)


@pytest.mark.parametrize("pattern,segments", [(AttentionPattern("window", 256), False),
                                              (AttentionPattern("fixed", 128, 8), False),
                                              (None, True)],
                         ids=["window", "fixed", "segment_ids"])
def test_pattern_kernels_lower_for_tpu_and_gpu(pattern, segments, tpu_generation):
    """The block-skipping kernels (key-block ranges from the program id, a conditional per
    tile for sparse patterns) and the kernels comparing segment ids (their own inputs,
    with a (1, N, T, S) bias) lower to Mosaic and Triton: one call forward, two backward,
    one more for the bias gradient."""
    q = jax.ShapeDtypeStruct((1, 1024, 2, 64), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
    bias = jax.ShapeDtypeStruct((1, 2, 1024, 1024), jnp.float32) if segments else None
    for platform, target, kernel_platform in (("tpu", MOSAIC, "tpu"), ("cuda", TRITON, "gpu")):
        def loss(q, k, v, ids, bias):
            out = flash_attention(q, k, v, causal=True, platform=kernel_platform,
                                  pattern=pattern, bias=bias,
                                  segment_ids=(ids, ids) if segments else None)
            return jnp.sum(out.astype(jnp.float32))
        text = lowered_text(jax.grad(loss, (0, 1, 2, 4) if segments else (0, 1, 2)),
                            (q, q, q, ids, bias), platform)
        assert custom_calls(text).count(target) == 3 + segments, platform


def test_kernel_operands_are_each_devices_share_under_a_mesh(tpu_generation):
    """Under a data x tensor mesh the Mosaic kernel (splash) sees this device's rows and
    heads: its query, key and value operands are (B / data, N / tensor, T, H) in the
    kernel's (B, N, T, H) layout (after its block tables), so nothing of Q, K or V is
    gathered to feed it. (The mesh is abstract: a v5e-4's devices
    from JAX's TPU topology, or none.)"""
    import flax.linen as nn
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

    from transformer_jax.sharding import LOGICAL_AXIS_RULES
    names = ("data", "fsdp", "tensor")
    mesh = (AbstractMesh((2, 1, 2), names, axis_types=(AxisType.Auto,) * 3)
            if tpu_generation is None else _abstract_mesh(tpu_generation, (2, 1, 2), names))
    q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(("data", "fsdp"), None, "tensor")))
    loss = lambda q, k, v: jnp.sum(attention.dot_product_attention(  # noqa: E731
        q, k, v, causal=True).astype(jnp.float32))
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(LOGICAL_AXIS_RULES):
        text = lowered_text(jax.grad(loss, (0, 1, 2)), (q, q, q), "tpu")
    shapes = re.findall(r"custom_call @tpu_custom_call\(([^)]*)\)[^\n]*: \(([^)]*)\)", text)
    assert len(shapes) == 3
    for _, operand_types in shapes:
        # fp32: under conftest's "highest" default precision splash computes in fp32
        # (the backward's also take the row statistics, (B / data, N / tensor, 8, T))
        floats = [t for t in operand_types.split(", ") if t.endswith(("bf16>", "f32>"))]
        assert floats.count("tensor<4x2x256x64xf32>") >= 3, operand_types
        assert all(t.startswith("tensor<4x2x") for t in floats), operand_types
