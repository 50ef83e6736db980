"""LoRA adapters on Dense layers (``layers/lora.py``): identity at init, merge, which Dense
layers a targets regex picks in each model family, config validation, logical axes,
bf16, and remat / scanned stacks against the plain forward (outputs and adapter grads).

Parity with Hugging Face PEFT is in ``tests/interop/test_peft.py``.
"""
import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import traverse_util

from transformer_jax.errors import UserError
from transformer_jax.interop.common import flatten_params
from transformer_jax.layers import lora as lora_lib
from transformer_jax.layers.lora import LoraConfig
from transformer_jax.layers.stack import convert_layout
from transformer_jax.models import bert, gpt, t5, transformer, vit

GPT_TINY = dict(vocab_size=37, max_len=16, num_layers=2, num_heads=2, d_model=16, mlp_dim=24,
                dropout_rate=0.0, attention_dropout_rate=0.0)
LORA = dict(rank=3, alpha=6.0, targets="attn/(query|value|out)|mlp/wi")


def gpt_module(**overrides):
    lora = overrides.pop("lora", LORA)
    return gpt.GPT(gpt.GPTConfig.from_dict({**GPT_TINY, "lora": lora, **overrides}))


def init(module, seed=0):
    return importlib.import_module(type(module).__module__).init_params(
        module, jax.random.PRNGKey(seed))


def adapter_paths(module) -> set[str]:
    """The Dense paths that get lora_a, from an abstract init."""
    tree = jax.eval_shape(lambda: init(module))
    return {"/".join(p[:-1]) for p in flatten_params(tree) if p[-1] == "lora_a"}


def with_random_b(params, seed=1, scale=0.2):
    rng = np.random.default_rng(seed)
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({
        k: jnp.asarray(scale * rng.normal(size=v.shape), v.dtype) if k[-1] == "lora_b" else v
        for k, v in flat.items()})


def without_adapters(params):
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: v for k, v in flat.items()
                                         if k[-1] not in lora_lib.ADAPTER_NAMES})


IDS = jnp.asarray(np.random.default_rng(0).integers(0, GPT_TINY["vocab_size"], (2, 7)), jnp.int32)
W = jnp.asarray(np.random.default_rng(1).normal(size=(2, 7, GPT_TINY["vocab_size"])), jnp.float32)


@pytest.fixture(scope="module")
def gpt_setup():
    adapted = gpt_module()
    plain = gpt_module(lora=None)
    params = init(adapted)
    return adapted, plain, params, jax.jit(adapted.apply), jax.jit(plain.apply)


# ----------------------------------------------------------------------------- forward

def test_zero_b_leaves_outputs_unchanged_exactly(gpt_setup):
    adapted, plain, params, run_adapted, run_plain = gpt_setup
    lora_b = [v for k, v in traverse_util.flatten_dict(params).items() if k[-1] == "lora_b"]
    assert lora_b and all(not np.asarray(b).any() for b in lora_b)
    lora_a = [v for k, v in traverse_util.flatten_dict(params).items() if k[-1] == "lora_a"]
    assert all(np.asarray(a).any() for a in lora_a)                      # A random, B zero
    np.testing.assert_array_equal(run_adapted({"params": params}, IDS),
                                  run_plain({"params": without_adapters(params)}, IDS))


def test_merge_equals_adapted_forward(gpt_setup):
    adapted, plain, params, run_adapted, run_plain = gpt_setup
    params = with_random_b(params)
    out = np.asarray(run_adapted({"params": params}, IDS))
    base = np.asarray(run_plain({"params": without_adapters(params)}, IDS))
    assert np.abs(out - base).max() > 1e-2                               # B non-zero acts
    merged = lora_lib.merge(params, adapted.config.lora)
    assert not any(k[-1] in lora_lib.ADAPTER_NAMES for k in traverse_util.flatten_dict(merged))
    np.testing.assert_allclose(run_plain({"params": merged}, IDS), out, atol=1e-5, rtol=0)
    # the merged kernel: kernel + a @ b * alpha / r (query: (D, R) @ (R, N, H))
    q = params["h_0"]["self_attn"]["query"]
    expected = q["kernel"] + np.einsum("dr,rnh->dnh", q["lora_a"], q["lora_b"]) * 6.0 / 3
    np.testing.assert_allclose(merged["h_0"]["self_attn"]["query"]["kernel"], expected, atol=1e-6)
    # scanned params merge to the stacked merged params
    scanned = convert_layout(params, adapted.config.layer_stacks, scanned=True)
    merged_scanned = lora_lib.merge(scanned, adapted.config.lora)
    restacked = convert_layout(merged, adapted.config.layer_stacks, scanned=True)
    for path, leaf in traverse_util.flatten_dict(restacked).items():
        np.testing.assert_allclose(traverse_util.flatten_dict(merged_scanned)[path], leaf,
                                   atol=1e-6, err_msg=str(path))


def test_rslora_scaling():
    assert LoraConfig(rank=4, alpha=8).scaling == 2.0
    assert LoraConfig(rank=4, alpha=8, use_rslora=True).scaling == 4.0


# ----------------------------------------------------------------------------- targets

FAMILY_MODULES = {
    "gpt": lambda lora: gpt.GPT(gpt.GPTConfig.from_dict({**GPT_TINY, "lora": lora})),
    "bert": lambda lora: bert.Bert(bert.BertConfig.preset(
        "tiny", num_layers=2, d_model=16, num_heads=2, lora=lora)),
    "t5": lambda lora: t5.T5(t5.T5Config.preset(
        "tiny", num_layers=1, num_decoder_layers=1, d_model=16, num_heads=2, head_dim=8, lora=lora)),
    "vit": lambda lora: vit.ViT(vit.ViTConfig.preset(
        "tiny", num_layers=1, d_model=16, num_heads=2, lora=lora)),
    "transformer": lambda lora: transformer.Transformer(transformer.TransformerConfig.preset(
        "tiny", num_layers=1, d_model=16, num_heads=2, lora=lora)),
}

TARGET_CASES = [
    ("gpt", "attn/(query|value)",
     {f"h_{i}/self_attn/{p}" for i in (0, 1) for p in ("query", "value")}),
    ("gpt", "mlp/", {f"h_{i}/mlp/{p}" for i in (0, 1) for p in ("wi", "wo")}),
    ("gpt", "^h_1/self_attn/out$", {"h_1/self_attn/out"}),
    ("bert", "attn/(query|value)",
     {f"bert/layer_{i}/self_attn/{p}" for i in (0, 1) for p in ("query", "value")}),
    ("bert", "pooler|transform|^nsp$", {"bert/pooler", "mlm/transform", "nsp"}),
    ("t5", "attn/(query|value)",
     {"encoder/layers_0/self_attn/query", "encoder/layers_0/self_attn/value",
      "decoder/layers_0/self_attn/query", "decoder/layers_0/self_attn/value",
      "decoder/layers_0/cross_attn/query", "decoder/layers_0/cross_attn/value"}),
    ("t5", "cross_attn/key|mlp/wo",
     {"decoder/layers_0/cross_attn/key", "encoder/layers_0/mlp/wo", "decoder/layers_0/mlp/wo"}),
    ("vit", "attn/(query|value)",
     {"encoderblock_0/self_attn/query", "encoderblock_0/self_attn/value"}),
    ("vit", "^(embedding|head)$", {"embedding", "head"}),
    ("transformer", "self_attn/key",
     {"encoder/layers_0/self_attn/key", "decoder/layers_0/self_attn/key"}),
]


@pytest.mark.parametrize("family,targets,expected", TARGET_CASES)
def test_targets_select_expected_dense_layers(family, targets, expected):
    assert adapter_paths(FAMILY_MODULES[family](dict(rank=2, targets=targets))) == expected


def test_no_lora_no_adapters():
    for family, build in FAMILY_MODULES.items():
        assert adapter_paths(build(None)) == set(), family


def test_targets_match_scanned_paths():
    """Scanned stacks name their layers ``h`` (no index): the adapters get a leading L axis."""
    tree = jax.eval_shape(lambda: init(gpt_module(scan_layers=True)))
    shapes = {"/".join(p): x.shape for p, x in flatten_params(tree).items()
              if p[-1] in lora_lib.ADAPTER_NAMES}
    assert shapes["h/self_attn/query/lora_a"] == (2, 16, 3)
    assert shapes["h/self_attn/query/lora_b"] == (2, 3, 2, 8)
    assert shapes["h/self_attn/out/lora_a"] == (2, 2, 8, 3)
    assert shapes["h/self_attn/out/lora_b"] == (2, 3, 16)
    assert len(shapes) == 8


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("field,value,match", [
    ("rank", 0, "rank must be an integer >= 1"),
    ("rank", 2.0, "rank must be an integer >= 1"),
    ("rank", True, "rank must be an integer >= 1"),
    ("alpha", 0, "alpha must be a number > 0"),
    ("alpha", float("nan"), "alpha must be a number > 0"),
    ("alpha", "16", "alpha must be a number > 0"),
    ("dropout", 1.0, r"dropout must be a number in \[0, 1\)"),
    ("dropout", -0.1, r"dropout must be a number in \[0, 1\)"),
    ("use_rslora", 1, "use_rslora must be True or False"),
    ("targets", "", "targets must be a non-empty regex"),
    ("targets", "attn/(query", "not a valid regex"),
    ("quantize", "int4", "quantize='int4' is unknown"),
    ("quantize_block", 63, "quantize_block must be an even integer"),
    ("double_quant", "yes", "double_quant must be True or False"),
])
def test_config_validation(field, value, match):
    with pytest.raises(UserError, match=match):
        LoraConfig(**{field: value})


def test_config_from_value():
    assert LoraConfig.from_value(None) is None
    config = LoraConfig(rank=2)
    assert LoraConfig.from_value(config) is config
    assert LoraConfig.from_value({"rank": 2, "alpha": 4}) == LoraConfig(rank=2, alpha=4)
    with pytest.raises(UserError, match=r"unknown LoraConfig field\(s\) \['rnak'\]"):
        LoraConfig.from_value({"rnak": 2})
    with pytest.raises(UserError, match="lora must be None or a dict"):
        LoraConfig.from_value(8)
    # a model config turns the dict into a LoraConfig, and replace() keeps it
    cfg = gpt.GPTConfig.from_dict({**GPT_TINY, "lora": {"rank": 2}})
    assert cfg.lora == LoraConfig(rank=2)
    assert cfg.replace(num_layers=1).lora == LoraConfig(rank=2)
    with pytest.raises(UserError, match="rank must be"):
        gpt.GPTConfig.from_dict({**GPT_TINY, "lora": {"rank": -1}})


# ----------------------------------------------------------------------------- axes

@pytest.mark.parametrize("scan", [False, True])
def test_adapters_carry_the_kernels_logical_axes(scan):
    module = gpt_module(scan_layers=scan)
    boxed = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), IDS))["params"]
    specs = {p: tuple(s) for p, s in flatten_params(nn.get_partition_spec(boxed)).items()}
    stack = ("h",) if scan else ("h_0",)
    lead = ("layers",) if scan else ()
    checked = 0
    for path in [stack + ("self_attn", "query"), stack + ("self_attn", "out"),
                 stack + ("mlp", "wi")]:
        kernel = specs[path + ("kernel",)]
        a, b = specs[path + ("lora_a",)], specs[path + ("lora_b",)]
        in_axes = len(a) - 1 - len(lead)
        assert a == kernel[:len(lead) + in_axes] + (None,), path
        assert b == lead + (None,) + kernel[len(lead) + in_axes:], path
        checked += 1
    assert specs[stack + ("self_attn", "out", "lora_a")] == lead + ("heads", "head_dim", None)
    assert specs[stack + ("self_attn", "query", "lora_b")] == lead + (None, "heads", "head_dim")
    assert checked == 3


# ----------------------------------------------------------------------------- dtypes, layouts

def test_bf16_compute_close_to_fp32(gpt_setup):
    adapted, _, params, run_adapted, _ = gpt_setup
    params = with_random_b(params)
    ref = np.asarray(run_adapted({"params": params}, IDS))
    bf16 = gpt_module(dtype="bfloat16")
    out = bf16.apply({"params": params}, IDS)
    assert out.dtype == jnp.float32                                      # logits in fp32
    err = float(np.abs(np.asarray(out) - ref).max())
    assert 0 < err <= 0.05 * float(np.abs(ref).max()), err


def _loss_and_grad(module):
    def loss(adapters, frozen):
        params = traverse_util.unflatten_dict({**frozen, **adapters})
        logits = module.apply({"params": params}, IDS)
        return jnp.sum(logits * W), logits
    return jax.jit(jax.grad(loss, has_aux=True))


def _split(params):
    flat = traverse_util.flatten_dict(params)
    return ({k: v for k, v in flat.items() if k[-1] in lora_lib.ADAPTER_NAMES},
            {k: v for k, v in flat.items() if k[-1] not in lora_lib.ADAPTER_NAMES})


@pytest.fixture(scope="module")
def plain_reference(gpt_setup):
    adapted, _, params, _, _ = gpt_setup
    params = with_random_b(params)
    grads, logits = _loss_and_grad(adapted)(*_split(params))
    return params, grads, logits


@pytest.mark.parametrize("remat,scan", [(True, False), (False, True), (True, True)])
def test_remat_and_scan_equal_plain_forward_and_adapter_grads(plain_reference, remat, scan):
    params, ref_grads, ref_logits = plain_reference
    module = gpt_module(remat=remat, scan_layers=scan)
    stacks = module.config.layer_stacks
    laid_out = convert_layout(params, stacks, scanned=scan)
    grads, logits = _loss_and_grad(module)(*_split(laid_out))
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
    grads = convert_layout(traverse_util.unflatten_dict(grads), stacks, scanned=False)
    flat = traverse_util.flatten_dict(grads)
    assert set(flat) == set(ref_grads)
    for k, g in ref_grads.items():
        assert float(jnp.abs(g).max()) > 1e-4, k                         # not vacuous
        np.testing.assert_allclose(flat[k], g, atol=1e-5, rtol=1e-5, err_msg=str(k))


def test_dropout_needs_rng_only_in_training(gpt_setup):
    """LoRA dropout draws from the ``dropout`` rng in training; eval needs none and equals
    the dropout-free model."""
    adapted, _, params, run_adapted, _ = gpt_setup
    params = with_random_b(params)
    module = gpt_module(lora={**LORA, "dropout": 0.5})
    run = jax.jit(module.apply, static_argnames="deterministic")
    eval_out = np.asarray(run_adapted({"params": params}, IDS))
    np.testing.assert_array_equal(run({"params": params}, IDS), eval_out)
    trained = run({"params": params}, IDS, deterministic=False,
                  rngs={"dropout": jax.random.PRNGKey(0)})
    assert float(np.abs(np.asarray(trained) - eval_out).max()) > 1e-3


def test_config_is_a_frozen_dataclass():
    config = LoraConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rank = 2
    assert hash(config) == hash(LoraConfig())
