"""T5 without torch: relative-position buckets (golden values), presets, structure, the
unscaled attention, KV-cache decoding, one training step, and clear errors.

HF parity (forward, gradients, beam search) lives in tests/interop/test_hf_t5.py.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.beam_search import init_decoder_cache
from transformer_jax.layers.relative import relative_position_bias, relative_position_bucket
from transformer_jax.models import FAMILIES, build_model
from transformer_jax.layers.multi_head import MultiHeadAttention
from transformer_jax.models.t5 import T5, T5Config, block_fields, init_params, shift_right
from transformer_jax.tasks.seq2seq import seq2seq_loss
from transformer_jax.train.step import create_train_state, make_train_step
from transformer_jax.errors import UserError

from ..helpers import assert_encoder_decoder_packed

TINY = dict(vocab_size=40, d_model=32, num_heads=4, head_dim=8, mlp_dim=48, num_layers=1,
            num_decoder_layers=2, relative_attention_num_buckets=8,
            relative_attention_max_distance=20, dropout_rate=0.0)


# ----------------------------------------------------------------------------- buckets (golden)

# Hand-computed from the formula in layers/relative.py. Bidirectional, R=32, max 128: 16
# buckets per direction, 8 exact; n >= 8 -> 8 + floor(ln(n/8) / ln(16) * 8), capped at 15;
# future keys +16. E.g. n=12: 8 + floor(1.170) = 9; n=30: 8 + floor(3.814) = 11.
BIDIRECTIONAL_32_128 = {0: 0, -1: 1, -7: 7, -8: 8, -12: 9, -16: 10, -30: 11, -127: 15,
                        -128: 15, -1000: 15, 1: 17, 8: 24, 16: 26, 200: 31}
# Causal, R=32, max 128: future -> 0; 16 exact; n >= 16 -> 16 + floor(ln(n/16) / ln(8) * 16).
CAUSAL_32_128 = {5: 0, 0: 0, -1: 1, -15: 15, -16: 16, -30: 20, -127: 31, -128: 31}
# Bidirectional, R=8, max 20: 4 per direction, 2 exact; n >= 2 -> 2 + floor(ln(n/2)/ln(10)*2).
# n=6: 2 + floor(0.954) = 2; n=7: 2 + floor(1.088) = 3.
BIDIRECTIONAL_8_20 = {0: 0, -1: 1, -2: 2, -5: 2, -6: 2, -7: 3, -20: 3, 1: 5, 2: 6, 7: 7, 30: 7}


@pytest.mark.parametrize("golden,bidirectional,num_buckets,max_distance", [
    (BIDIRECTIONAL_32_128, True, 32, 128), (CAUSAL_32_128, False, 32, 128),
    (BIDIRECTIONAL_8_20, True, 8, 20)])
def test_relative_position_bucket_golden(golden, bidirectional, num_buckets, max_distance):
    rel = jnp.asarray(list(golden))
    bucket = jax.jit(relative_position_bucket, static_argnames=("bidirectional", "num_buckets",
                                                                "max_distance"))
    got = bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                 max_distance=max_distance)
    assert got.dtype == jnp.int32
    assert dict(zip(golden, np.asarray(got).tolist())) == golden


def test_relative_position_bias_lookup_and_offset():
    table = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), jnp.float32)
    full = relative_position_bias(table, 6, 6, bidirectional=False, max_distance=20)
    assert full.shape == (1, 3, 6, 6) and full.dtype == jnp.float32
    # query 4, key 1: relative position -3 -> causal bucket 3 (exact)
    np.testing.assert_array_equal(np.asarray(full[0, :, 4, 1]), np.asarray(table[3]))
    # a decode step at absolute position 4 sees row 4 of the full table
    step = relative_position_bias(table, 1, 6, bidirectional=False, max_distance=20, q_offset=4)
    np.testing.assert_array_equal(np.asarray(step[0, :, 0]), np.asarray(full[0, :, 4]))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_buckets=7, bidirectional=True), "even"),
    (dict(num_buckets=2, bidirectional=True), "too small"),
    (dict(num_buckets=32, max_distance=8), "max_distance=8 must exceed"),
])
def test_relative_position_bucket_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        relative_position_bucket(jnp.arange(3), **kwargs)


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("name,count", [
    ("t5-small", 60_506_624), ("t5-base", 222_903_552), ("t5-large", 737_668_096),
    ("t5-v1_1-small", 76_961_152), ("t5-v1_1-base", 247_577_856)])
def test_preset_parameter_counts(name, count):
    """HF T5ForConditionalGeneration's counts (checked against HF itself in the parity tests)."""
    cfg = T5Config.preset(name)
    assert cfg.num_params() == count
    assert cfg.flops_per_example(32, 16) > 6 * cfg.num_params(non_embedding=True) * 16


def test_registered_family_and_presets():
    assert FAMILIES["t5"] == (T5Config, T5)
    cfg, model = build_model("t5", "t5-v1_1-small")
    assert isinstance(model, T5) and cfg.gated_mlp and not cfg.tie_embeddings
    assert cfg.activation == "gelu_tanh" and not cfg.scales_output


@pytest.mark.parametrize("field,value,match", [
    ("activation", "swiglu", "activation='swiglu' is unknown"),
    ("relative_attention_num_buckets", 9, "even"),
    ("relative_attention_max_distance", 4, "must exceed"),
    ("eos_token_id", 40, "outside the vocabulary"),
    ("num_decoder_layers", 0, "num_decoder_layers"),
    ("attention_impl", "flash", "attention_impl"),
    ("dtype", "float33", "dtype"),
])
def test_bad_config_raises(field, value, match):
    with pytest.raises(ValueError, match=match):
        T5Config(**{**TINY, field: value})


def test_unknown_preset_and_field_raise():
    with pytest.raises(ValueError, match="Did you mean 't5-small'"):
        T5Config.preset("t5-smal")
    with pytest.raises(ValueError, match="d_ff"):
        T5Config.preset("t5-small", d_ff=10)


# ----------------------------------------------------------------------------- model

@functools.lru_cache(maxsize=None)
def forward(model):
    """One jitted forward per model (compiled once per input shapes)."""
    return jax.jit(lambda p, *args: model.apply({"params": p}, *args))


@functools.lru_cache(maxsize=None)
def decode_step(model):
    return jax.jit(lambda p, cache, *args: model.apply(
        {"params": p, "cache": cache}, *args, decode=True, method="decode", mutable=["cache"]))


@pytest.fixture(scope="module")
def tiny():
    cfg = T5Config(**TINY)
    model = T5(cfg)
    return model, jax.jit(lambda rng: init_params(model, rng))(jax.random.PRNGKey(0))


def batch(seed=0, b=3, s=9, t=6, vocab=40):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, (b, s)).astype(np.int32)
    mask = np.ones((b, s), np.int32)
    mask[1, 5:] = 0
    ids[mask == 0] = 0
    dec = rng.integers(0, vocab, (b, t)).astype(np.int32)
    return ids, mask, dec


def test_structure_no_biases_one_table_per_stack(tiny):
    model, params = tiny
    cfg = model.config
    assert set(params) == {"shared", "encoder", "decoder"}          # tied: no lm_head
    for stack, layers in (("encoder", 1), ("decoder", 2)):
        assert params[stack]["relative_attention_bias"].shape == (8, 4)
        assert sorted(k for k in params[stack] if k.startswith("layers_")) == \
            [f"layers_{i}" for i in range(layers)]
    leaves = jax.tree_util.tree_leaves_with_path(params)
    names = {jax.tree_util.keystr(p).split("'")[-2] for p, _ in leaves}
    assert names == {"embedding", "relative_attention_bias", "kernel", "scale"}   # no bias
    dec0 = params["decoder"]["layers_0"]
    assert set(dec0) == {"norm1", "self_attn", "norm2", "cross_attn", "norm3", "mlp"}
    assert dec0["self_attn"]["query"]["kernel"].shape == (32, 4, 8)
    assert dec0["self_attn"]["out"]["kernel"].shape == (4, 8, 32)
    total = sum(x.size for _, x in leaves)
    assert total == cfg.num_params()


def test_attention_has_no_sqrt_scaling():
    """T5's attention is the shared MultiHeadAttention with scale 1 and no biases."""
    fields = block_fields(T5Config(**TINY))
    assert fields["attention_scale"] == 1.0 and fields["use_bias"] is False
    attn = MultiHeadAttention(num_heads=2, head_dim=4, use_bias=False, scale=1.0)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, 8)), jnp.float32)
    bias = jnp.asarray(np.random.default_rng(1).normal(size=(1, 2, 5, 5)), jnp.float32)
    p = nn.meta.unbox(jax.jit(attn.init)(jax.random.PRNGKey(0), x)["params"])
    q = jnp.einsum("BTD,DNH->BTNH", x, p["query"]["kernel"])
    k = jnp.einsum("BTD,DNH->BTNH", x, p["key"]["kernel"])
    v = jnp.einsum("BTD,DNH->BTNH", x, p["value"]["kernel"])
    w = jax.nn.softmax(jnp.einsum("BTNH,BSNH->BNTS", q, k) + bias, axis=-1)   # no 1/sqrt(H)
    want = jnp.einsum("BNTS,BSNH,NHD->BTD", w, v, p["out"]["kernel"])
    np.testing.assert_allclose(np.asarray(jax.jit(attn.apply)({"params": p}, x, bias=bias)),
                               np.asarray(want), rtol=1e-5, atol=1e-6)


def test_output_scaling_follows_tying_and_padding_is_masked(tiny):
    model, params = tiny
    ids, mask, dec = batch()
    changed = np.array(ids)
    changed[1, 5:] = 7                                # different tokens under the padding
    plain_model = T5(model.config.replace(scale_decoder_output=False))
    scaled = np.asarray(forward(model)(params, ids, dec, mask))
    masked = np.asarray(forward(model)(params, changed, dec, mask))
    plain = np.asarray(forward(plain_model)(params, ids, dec, mask))
    assert scaled.dtype == np.float32 and scaled.shape == (3, 6, 40)
    np.testing.assert_allclose(scaled, plain * 32 ** -0.5, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(masked, scaled, rtol=1e-6, atol=1e-6)


def test_untied_gated_variant_builds_lm_head():
    cfg = T5Config(**{**TINY, "activation": "gelu_tanh", "gated_mlp": True, "tie_embeddings": False})
    params = jax.eval_shape(lambda: init_params(T5(cfg), jax.random.PRNGKey(1)))
    assert params["lm_head"]["kernel"].shape == (32, 40)
    assert set(params["encoder"]["layers_0"]["mlp"]) == {"wi_0", "wi_1", "wo"}
    assert sum(x.size for x in jax.tree_util.tree_leaves(params)) == cfg.num_params()


def test_kv_cache_decode_equals_full_pass(tiny):
    model, params = tiny
    ids, mask, dec = batch(seed=3)
    full = np.asarray(forward(model)(params, ids, dec, mask))
    encoded = jax.jit(lambda p: model.apply({"params": p}, ids, mask, method="encode"))(params)
    cache = jax.jit(lambda p: init_decoder_cache(model, p, encoded, mask, 6))(params)
    cross = cache["decoder"]["layers_0"]["cross_attn"]
    assert cross["cached_key"].shape == (3, 4, 9, 8)                # cached once (B, N, S, H)
    steps, pos = [], 0
    for width in (3, 1, 1, 1):                        # a 3-token prefill, then single steps
        logits, state = decode_step(model)(params, cache, dec[:, pos:pos + width], encoded, mask)
        cache, pos = state["cache"], pos + width
        steps.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-5)
    assert int(cache["decoder"]["position_index"]) == 6


def test_shift_right():
    labels = jnp.asarray([[5, 6, -100, -100], [7, 1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(shift_right(labels, 0)), [[0, 5, 6, 0], [0, 7, 1, 0]])


def test_one_training_step_learns(tiny):
    model, _ = tiny
    ids, mask, dec = batch(seed=4)
    labels = np.concatenate([dec[:, 1:], np.ones((3, 1), np.int32)], axis=1)
    data = {"inputs": ids, "input_mask": mask, "targets": dec, "labels": labels,
            "weights": np.ones(dec.shape, np.float32)}
    state = jax.jit(lambda rng: create_train_state(model, optax.adam(3e-3), rng, ids, dec))(
        jax.random.PRNGKey(0))
    step = jax.jit(make_train_step(loss_fn=seq2seq_loss))
    losses = []
    for _ in range(3):
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    assert float(metrics["grad_norm"]) > 0 and float(metrics["tokens"]) == 18


@pytest.mark.parametrize("call,match", [
    (lambda m, p, i, k, d: m.apply({"params": p}, i[None], d, k), "input_ids must be"),
    (lambda m, p, i, k, d: m.apply({"params": p}, i.astype(np.float32), d, k), "integer"),
    (lambda m, p, i, k, d: m.apply({"params": p}, i, d, k[:, :4]), "attention_mask must have"),
    (lambda m, p, i, k, d: m.apply({"params": p}, i, d[:2], k), "different batch sizes"),
    (lambda m, p, i, k, d: m.apply({"params": p}, d, i, method="decode"), "encoded must be"),
])
def test_bad_inputs_raise(tiny, call, match):
    model, params = tiny
    ids, mask, dec = batch()
    with pytest.raises(ValueError, match=match):
        call(model, params, ids, mask, dec)


def test_decode_mode_rejects_a_decoder_mask(tiny):
    model, params = tiny
    ids, mask, dec = batch()
    encoded = np.zeros((3, 9, 32), np.float32)
    with pytest.raises(ValueError, match="decoder_attention_mask is not supported with decode"):
        model.apply({"params": params}, dec, encoded, mask, np.ones_like(dec), decode=True,
                    method="decode", mutable=["cache"])


# one path per family here (every path: test_attention.py and test_gpt.py)
@pytest.mark.parametrize("impl", ["xla"])
def test_packed_documents_equal_documents_alone(impl):
    # two source/target pairs packed into one row each: encoder self-attention, causal decoder
    # self-attention and cross-attention stay within each pair; positions restart per document
    model = T5(T5Config(**TINY, attention_impl=impl))
    params = jax.jit(lambda rng: init_params(model, rng))(jax.random.PRNGKey(2))
    assert_encoder_decoder_packed(model, params, 40)


def test_relative_position_bias_from_per_row_positions():
    # positions restarting at each packed document: each document's block of the (B, N, T, S)
    # bias is the bias of the document alone; a second row with other positions differs
    table = jax.random.normal(jax.random.PRNGKey(0), (8, 2))
    pos = jnp.array([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    bias = relative_position_bias(table, 5, 5, bidirectional=True, max_distance=20,
                                  q_positions=pos, k_positions=pos)
    alone = functools.partial(relative_position_bias, table, bidirectional=True, max_distance=20)
    np.testing.assert_array_equal(bias[0, :, :3, :3], alone(3, 3)[0])
    np.testing.assert_array_equal(bias[0, :, 3:, 3:], alone(2, 2)[0])
    np.testing.assert_array_equal(bias[1], alone(5, 5)[0])
    with pytest.raises(UserError, match="needs both q_positions and k_positions"):
        relative_position_bias(table, 5, 5, bidirectional=True, q_positions=pos)
