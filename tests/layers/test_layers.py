"""Golden values and equivalences for the pure functions and the linen building blocks."""
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import (
    EncoderBlock, DecoderBlock, FeedForward, LayerNorm, MultiHeadAttention, RMSNorm, apply_rope,
    causal_mask, combine_masks, dot_product_attention, key_padding_mask, padding_mask_from_ids,
    padding_mask_from_lengths, query_key_mask, sinusoidal_table, sliding_window_mask)

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
# bf16 has an 8-bit mantissa: inputs, weights and outputs are each rounded to ~3e-3 relative.
# With fp32 softmax and fp32 accumulation, attention outputs of unit-scale inputs stay
# within 2e-2 absolute of the fp32 result; this is the library's documented bf16 tolerance.
BF16_ATOL = 2e-2


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


# --------------------------------------------------------------------------- masks

def test_causal_mask_golden():
    np.testing.assert_array_equal(causal_mask(4)[0, 0].astype(int),
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    # two new queries after 3 cached keys (KV-cache decoding), 6 cache slots
    np.testing.assert_array_equal(causal_mask(2, 6, offset=3)[0, 0].astype(int),
                                  [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]])


def test_sliding_window_golden():
    np.testing.assert_array_equal(sliding_window_mask(5, window=2)[0, 0].astype(int),
                                  [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                                   [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(sliding_window_mask(4, window=2, causal=False)[0, 0].astype(int),
                                  [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]])
    with pytest.raises(ValueError, match="window"):
        sliding_window_mask(4, window=0)


def test_padding_masks_golden():
    m = padding_mask_from_lengths(jnp.array([2, 4]), 4)
    assert m.shape == (2, 1, 1, 4)
    np.testing.assert_array_equal(m[:, 0, 0].astype(int), [[1, 1, 0, 0], [1, 1, 1, 1]])
    ids = jnp.array([[5, 7, 0, 0], [3, 0, 9, 1]])
    np.testing.assert_array_equal(padding_mask_from_ids(ids, pad_id=0)[:, 0, 0].astype(int),
                                  [[1, 1, 0, 0], [1, 0, 1, 1]])
    np.testing.assert_array_equal(key_padding_mask(ids != 0), padding_mask_from_ids(ids))
    qk = query_key_mask(jnp.array([[1, 0]]), jnp.array([[1, 1, 0]]))
    np.testing.assert_array_equal(qk[0, 0].astype(int), [[1, 1, 0], [0, 0, 0]])
    both = combine_masks(causal_mask(4), padding_mask_from_lengths(jnp.array([3]), 4))
    np.testing.assert_array_equal(both[0, 0].astype(int),
                                  [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    assert combine_masks(None, None) is None
    with pytest.raises(ValueError, match="2-D"):
        padding_mask_from_ids(jnp.zeros((2, 3, 4), jnp.int32))


# --------------------------------------------------------------------------- positions

def test_sinusoidal_table_golden():
    pe = np.asarray(sinusoidal_table(3, 4))
    expected = np.array([
        [0.0, 1.0, 0.0, 1.0],
        [math.sin(1.0), math.cos(1.0), math.sin(0.01), math.cos(0.01)],
        [math.sin(2.0), math.cos(2.0), math.sin(0.02), math.cos(0.02)],
    ])
    np.testing.assert_allclose(pe, expected, rtol=0, atol=1e-6)
    # the formula for a wider table: PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(.)
    pe = np.asarray(sinusoidal_table(50, 16), np.float64)
    pos, i = np.arange(50)[:, None], np.arange(8)[None, :]
    angle = pos / 10000 ** (2 * i / 16)
    np.testing.assert_allclose(pe[:, 0::2], np.sin(angle), atol=2e-5)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(angle), atol=2e-5)


def test_rope_golden_and_relative():
    x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    out = np.asarray(apply_rope(x, jnp.array([[1]])))[0, 0, 0]
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    np.testing.assert_allclose(out, [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2],
                               atol=1e-6)
    out_i = np.asarray(apply_rope(x, jnp.array([[1]]), interleaved=True))[0, 0, 0]
    np.testing.assert_allclose(out_i, [1 * c1 - 2 * s1, 2 * c1 + 1 * s1, 3 * c2 - 4 * s2, 4 * c2 + 3 * s2],
                               atol=1e-6)
    # q.k after RoPE depends only on the relative offset
    q, k = rand(0, (1, 1, 1, 8)), rand(1, (1, 1, 1, 8))
    dot = lambda i, j: float(jnp.sum(apply_rope(q, jnp.array([[i]])) * apply_rope(k, jnp.array([[j]]))))
    assert dot(5, 2) == pytest.approx(dot(13, 10), abs=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, jnp.array([[7]]))), jnp.linalg.norm(q), rtol=1e-6)


# --------------------------------------------------------------------------- attention

def test_attention_golden_by_hand():
    q = jnp.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    k = jnp.array([[1.0, 0.0], [0.0, 1.0]]).reshape(1, 2, 1, 2)
    v = jnp.array([[1.0, 2.0], [3.0, 4.0]]).reshape(1, 2, 1, 2)
    w0 = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)   # softmax([1/sqrt2, 0])[0]
    out, weights = dot_product_attention(q, k, v, return_weights=True)
    np.testing.assert_allclose(weights[0, 0, 0], [w0, 1 - w0], atol=1e-6)
    np.testing.assert_allclose(out[0, 0, 0], [w0 * 1 + (1 - w0) * 3, w0 * 2 + (1 - w0) * 4], atol=1e-6)
    # mask 1 = may attend: blocking key 0 sends all weight to key 1
    out = dot_product_attention(q, k, v, mask=jnp.array([[0, 1]]))
    np.testing.assert_allclose(out[0, 0, 0], [3.0, 4.0], atol=1e-6)
    # an additive bias shifts the logits
    out, weights = dot_product_attention(q, k, v, bias=jnp.array([[0.0, 1 / math.sqrt(2)]]),
                                         return_weights=True)
    np.testing.assert_allclose(weights[0, 0, 0], [0.5, 0.5], atol=1e-6)


def _attention_inputs(n=8, kv=2, t=37, s=53, h=16):
    q, k, v = rand(0, (2, t, n, h)), rand(1, (2, s, kv, h)), rand(2, (2, s, kv, h))
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (2, 1, t, s))
    bias = rand(4, (1, n, t, s))
    return q, k, v, mask, bias


@pytest.mark.parametrize("impl", ["xla", "jax", "chunked"])
@pytest.mark.parametrize("causal", [False, True])
def test_implementations_agree_forward_and_grad(impl, causal):
    # reference: "xla" over the whole (T, S) square (q_chunk=T);
    # impl="xla" with q_chunk=16 is the causal query-blocked path (blocks 16, 16, 5)
    q, k, v, mask, bias = _attention_inputs()
    ref = dot_product_attention(q, k, v, mask=mask, bias=bias, causal=causal, q_chunk=q.shape[1])
    kw = dict(mask=mask, bias=bias, causal=causal, q_chunk=16, kv_chunk=16)
    out = dot_product_attention(q, k, v, implementation=impl, **kw)
    np.testing.assert_allclose(out, ref, **FP32_TOL)

    ct = rand(5, ref.shape)
    def loss(impl, **chunks):
        return lambda q, k, v, b: jnp.sum(dot_product_attention(
            q, k, v, mask=mask, bias=b, causal=causal, implementation=impl, **chunks) * ct)
    g_ref = jax.grad(loss("xla", q_chunk=q.shape[1]), argnums=(0, 1, 2, 3))(q, k, v, bias)
    g = jax.grad(loss(impl, q_chunk=16, kv_chunk=16), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_handles_uneven_blocks_and_fully_masked_rows():
    q, k, v, _, _ = _attention_inputs(n=4, kv=4, t=9, s=11)
    mask = jnp.ones((1, 1, 9, 11), bool).at[:, :, 3].set(False)   # query 3 sees nothing
    ref = dot_product_attention(q, k, v, mask=mask)
    out = dot_product_attention(q, k, v, mask=mask, implementation="chunked", q_chunk=4, kv_chunk=3)
    np.testing.assert_allclose(out, ref, **FP32_TOL)
    # a fully blocked row averages the values (no NaN)
    np.testing.assert_allclose(ref[:, 3], jnp.mean(v, axis=1), atol=1e-5)


@pytest.mark.parametrize("t, s", [(40, 40), (40, 29), (29, 40)])
def test_xla_causal_query_blocks_equal_the_whole_square(t, s):
    """Causal "xla" attention in query blocks (keys up to each block's last row) == the
    whole (T, S) computation (``return_weights`` never blocks): GQA, a T5-style bias
    broadcast over the batch, a padding mask with a query that sees no key (it must still
    average all S values), T != S both ways; outputs and gradients."""
    q, k, v, _, bias = _attention_inputs(n=4, kv=2, t=t, s=s)
    mask = jnp.ones((2, 1, t, s), bool).at[0, :, 20, :].set(False).at[1, :, :, 3:7].set(False)
    ct = rand(5, (2, t, 4, 16))

    def run(block):
        def f(q, k, v, b):
            out = dot_product_attention(q, k, v, mask=mask, bias=b, causal=True, q_chunk=block)
            return jnp.sum(out * ct), out
        return jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)

    g_ref, ref = run(t)             # one block: the whole square
    whole, _ = dot_product_attention(q, k, v, mask=mask, bias=bias, causal=True, return_weights=True)
    np.testing.assert_allclose(ref, whole, **FP32_TOL)
    for block in (8, 13, 16):
        g, out = run(block)
        np.testing.assert_allclose(out, ref, **FP32_TOL)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[0, 20], jnp.repeat(jnp.mean(v[0], axis=0), 2, axis=0), atol=1e-5)


def _plain_attention(q, k, v, mask, bias, causal):
    """softmax(Q K^T / sqrt(H) + bias) V written with plain einsums (GQA by repeating K/V),
    for comparing against the library's matmuls and their written-out JVPs."""
    n, kv, h = q.shape[2], k.shape[2], q.shape[3]
    k, v = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k, precision=hi) / math.sqrt(h) + bias
    allowed = mask & jnp.tril(jnp.ones(logits.shape[-2:], bool)) if causal else mask
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v, precision=hi)


@pytest.mark.parametrize("causal", [False, True])
def test_xla_attention_derivatives_equal_the_plain_formula_to_every_order(causal):
    """The reference path's two matmuls carry written-out JVPs (their reverse mode contracts
    a materialised transpose). Values, gradients, forward-mode tangents, a second
    derivative and a vmapped gradient all equal those of the plain formula: GQA, bias,
    padding mask, causal query blocks of 16 over T=37."""
    q, k, v, mask, bias = _attention_inputs()
    ct = rand(5, q.shape)
    ours = lambda q, k, v: dot_product_attention(q, k, v, mask=mask, bias=bias,  # noqa: E731
                                                 causal=causal, q_chunk=16)
    plain = lambda q, k, v: _plain_attention(q, k, v, mask, bias, causal)  # noqa: E731
    np.testing.assert_allclose(ours(q, k, v), plain(q, k, v), **FP32_TOL)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) * ct)  # noqa: E731
    grads = [jax.grad(loss(f), (0, 1, 2))(q, k, v) for f in (ours, plain)]
    for a, b in zip(*grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    tangents = (rand(6, q.shape), rand(7, k.shape), rand(8, v.shape))
    np.testing.assert_allclose(jax.jvp(ours, (q, k, v), tangents)[1],
                               jax.jvp(plain, (q, k, v), tangents)[1], rtol=1e-4, atol=1e-5)
    # d/dq of |d loss / dk|^2: reverse over reverse through both written-out rules
    def second(f):
        return jax.grad(lambda q: jnp.sum(jax.grad(loss(f), 1)(q, k, v) ** 2))(q)
    np.testing.assert_allclose(second(ours), second(plain), rtol=1e-3, atol=1e-4)
    vs = jnp.stack([v, 2 * v])
    batched = jax.vmap(jax.grad(loss(ours), 2), in_axes=(None, None, 0))(q, k, vs)
    np.testing.assert_allclose(batched[1], jax.grad(loss(ours), 2)(q, k, 2 * v), rtol=1e-6)


def _row_contracting_batched_dots(causal):
    """Batched dots in the compiled attention gradient that contract the rows (axis 2) of
    both rank-4 operands, the form XLA:CPU gives to Eigen rather than YNNPACK."""
    q, k, v, _, _ = _attention_inputs(n=4, kv=4, t=48, s=48)
    f = lambda q, k, v: jnp.sum(jnp.sin(dot_product_attention(q, k, v, causal=causal,  # noqa: E731
                                                              q_chunk=16)))
    text = jax.jit(jax.grad(f, (0, 1, 2))).lower(q, k, v).compile().as_text()
    return len(re.findall(r"dot\([^\n]*lhs_batch_dims=\{0,1\}, lhs_contracting_dims=\{2\}, "
                          r"rhs_batch_dims=\{0,1\}, rhs_contracting_dims=\{2\}", text))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the dot forms are XLA:CPU's choice")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_key_and_value_gradients_contract_a_transposed_operand(monkeypatch, causal):
    """dK and dV contract over the query rows. With the plain einsums XLA:CPU computes them
    as dots over the rows of both operands (2 per query block: 6 causal with blocks of
    16 over 48 rows, 2 over the whole square); with the written-out JVPs none is left."""
    from transformer_jax.layers import attention
    assert _row_contracting_batched_dots(causal) == 0
    plain_scores = lambda q, k, precision: attention._matmul(precision)(  # noqa: E731
        "BKRH,BKSH->BKRS", q, k)
    plain_weigh = lambda p, v, precision: attention._matmul(precision)(  # noqa: E731
        "BKRS,BKSH->BKRH", p, v)
    monkeypatch.setattr(attention, "_scores", plain_scores)
    monkeypatch.setattr(attention, "_weigh_values", plain_weigh)
    assert _row_contracting_batched_dots(causal) == (6 if causal else 2)


def test_bf16_within_documented_tolerance():
    q, k, v, mask, _ = _attention_inputs()
    ref = dot_product_attention(q, k, v, mask=mask, causal=True)
    for impl in ("xla", "jax", "chunked"):
        out = dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                    mask=mask, causal=True, implementation=impl, q_chunk=16, kv_chunk=16)
        assert out.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        assert err < BF16_ATOL, (impl, err)
    _, w = dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                 return_weights=True)
    assert w.dtype == jnp.float32  # softmax in fp32
    np.testing.assert_allclose(jnp.sum(w, -1), 1.0, atol=1e-6)


def test_attention_dropout():
    q, k, v, _, _ = _attention_inputs(n=2, kv=2, t=16, s=16)
    rng = jax.random.PRNGKey(7)
    _, w_clean = dot_product_attention(q, k, v, return_weights=True)
    _, w = dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng, deterministic=False,
                                 return_weights=True)
    kept = w != 0
    assert 0.65 < float(kept.mean()) < 0.85
    np.testing.assert_allclose(w[kept], (w_clean / 0.75)[kept], rtol=1e-6)
    a = dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng, deterministic=False,
                              implementation="chunked", q_chunk=4, kv_chunk=4)
    b = dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng, deterministic=False,
                              implementation="chunked", q_chunk=4, kv_chunk=4)
    np.testing.assert_array_equal(a, b)   # the same rng gives the same mask
    assert float(jnp.abs(a - dot_product_attention(q, k, v)).max()) > 1e-2
    with pytest.raises(ValueError, match="dropout_rng"):
        dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="no attention dropout"):
        dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=rng, deterministic=False,
                              implementation="jax")


def test_attention_bad_input():
    q, k, v = rand(0, (2, 5, 4, 8)), rand(1, (2, 6, 4, 8)), rand(2, (2, 6, 4, 8))
    with pytest.raises(ValueError, match="head dim"):
        dot_product_attention(q, rand(1, (2, 6, 4, 16)), v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        dot_product_attention(q, rand(1, (2, 6, 3, 8)), rand(2, (2, 6, 3, 8)))
    with pytest.raises(ValueError, match=r"does not broadcast .* \(2, 4, 5, 6\)"):
        dot_product_attention(q, k, v, mask=jnp.ones((5, 5), bool))
    with pytest.raises(ValueError, match="4-D"):
        dot_product_attention(q[0], k, v)
    with pytest.raises(ValueError, match="unknown attention implementation"):
        dot_product_attention(q, k, v, implementation="flash9000")
    with pytest.raises(ValueError, match="return_weights"):
        dot_product_attention(q, k, v, return_weights=True, implementation="chunked")


# --------------------------------------------------------------------------- modules

def test_mha_matches_manual_math():
    x = rand(0, (2, 5, 16))
    mha = MultiHeadAttention(num_heads=4)
    p = nn.meta.unbox(mha.init(jax.random.PRNGKey(1), x))["params"]
    q = jnp.einsum("BTD,DNH->BTNH", x, p["query"]["kernel"]) + p["query"]["bias"]
    k = jnp.einsum("BSD,DNH->BSNH", x, p["key"]["kernel"]) + p["key"]["bias"]
    v = jnp.einsum("BSD,DNH->BSNH", x, p["value"]["kernel"]) + p["value"]["bias"]
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(4)
    logits = jnp.where(causal_mask(5), logits, -jnp.inf)
    ctx = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits), v)
    expected = jnp.einsum("BTNH,NHD->BTD", ctx, p["out"]["kernel"]) + p["out"]["bias"]
    np.testing.assert_allclose(mha.apply({"params": p}, x, causal=True), expected, **FP32_TOL)


def test_gqa_equals_mha_with_repeated_kv_heads():
    x = rand(0, (2, 6, 32))
    gqa = MultiHeadAttention(num_heads=8, num_kv_heads=2)
    p = nn.meta.unbox(gqa.init(jax.random.PRNGKey(1), x))["params"]
    full = MultiHeadAttention(num_heads=8)
    rep = lambda a: jnp.repeat(a, 4, axis=-2)   # kv head k serves query heads 4k..4k+3
    pf = dict(p, key={"kernel": rep(p["key"]["kernel"]), "bias": rep(p["key"]["bias"])},
              value={"kernel": rep(p["value"]["kernel"]), "bias": rep(p["value"]["bias"])})
    np.testing.assert_allclose(gqa.apply({"params": p}, x, causal=True),
                               full.apply({"params": pf}, x, causal=True), **FP32_TOL)
    assert p["key"]["kernel"].shape == (32, 2, 4)


@pytest.mark.parametrize("rope", [None, 10000.0])
def test_kv_cache_decode_equals_full_pass(rope):
    x = rand(0, (2, 7, 32))
    mha = MultiHeadAttention(num_heads=4, num_kv_heads=2, rope_base=rope)
    p = nn.meta.unbox(mha.init(jax.random.PRNGKey(1), x))["params"]
    full = mha.apply({"params": p}, x, causal=True)
    cache = mha.init(jax.random.PRNGKey(1), x, decode=True)["cache"]
    cache = jax.tree_util.tree_map(jnp.zeros_like, cache)
    outs = []
    for lo, hi in [(0, 3), (3, 4), (4, 5), (5, 7)]:   # a prefill of 3, then 1, 1 and 2 tokens
        y, state = mha.apply({"params": p, "cache": cache}, x[:, lo:hi], causal=True, decode=True,
                             mutable=["cache"])
        cache = state["cache"]
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **FP32_TOL)
    assert int(cache["cache_index"]) == 7


def test_mha_bad_input():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        MultiHeadAttention(num_heads=5).init(jax.random.PRNGKey(0), jnp.ones((1, 3, 32)))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiHeadAttention(num_heads=4, num_kv_heads=3).init(jax.random.PRNGKey(0), jnp.ones((1, 3, 32)))
    with pytest.raises(ValueError, match="does not broadcast"):
        MultiHeadAttention(num_heads=4).init(jax.random.PRNGKey(0), jnp.ones((1, 3, 32)),
                                             mask=jnp.ones((1, 1, 3, 4)))


def test_norms_golden():
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    ln = LayerNorm(eps=0.0)
    y = ln.apply(ln.init(jax.random.PRNGKey(0), x), x)
    np.testing.assert_allclose(y[0], np.array([-3, -1, 1, 3]) / math.sqrt(5), atol=1e-6)
    rms = RMSNorm(eps=0.0)
    y = rms.apply(rms.init(jax.random.PRNGKey(0), x), x)
    np.testing.assert_allclose(y[0], np.array([1, 2, 3, 4]) / math.sqrt(7.5), atol=1e-6)
    xb = x.astype(jnp.bfloat16)
    assert LayerNorm(dtype=jnp.bfloat16).apply(ln.init(jax.random.PRNGKey(0), x), xb).dtype == jnp.bfloat16


def _plain_standardise(x, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(jnp.mean((x - mean) ** 2, axis=-1, keepdims=True) + eps)


def test_layernorm_written_out_derivative_equals_autodiff():
    """LayerNorm's custom_jvp rule gives the derivatives that autodiff of the plain formula
    gives: forward mode, reverse mode and second order."""
    from transformer_jax.layers.norms import standardise as fast
    x, dx, ct = rand(1, (3, 5, 16)) * 2 + 0.5, rand(2, (3, 5, 16)), rand(3, (3, 5, 16))
    with jax.default_matmul_precision("highest"):
        y, jv = jax.jvp(lambda a: fast(a, 1e-5), (x,), (dx,))
        y_ref, jv_ref = jax.jvp(lambda a: _plain_standardise(a, 1e-5), (x,), (dx,))
        np.testing.assert_allclose(y, y_ref, **FP32_TOL)
        np.testing.assert_allclose(jv, jv_ref, **FP32_TOL)
        g = jax.grad(lambda a: jnp.sum(fast(a, 1e-5) * ct))(x)
        g_ref = jax.grad(lambda a: jnp.sum(_plain_standardise(a, 1e-5) * ct))(x)
        np.testing.assert_allclose(g, g_ref, **FP32_TOL)
        hv = jax.jvp(jax.grad(lambda a: jnp.sum(fast(a, 1e-5) * ct)), (x,), (dx,))[1]
        hv_ref = jax.jvp(jax.grad(lambda a: jnp.sum(_plain_standardise(a, 1e-5) * ct)), (x,), (dx,))[1]
        np.testing.assert_allclose(hv, hv_ref, rtol=1e-4, atol=1e-4)
    # the rows are standardised: zero mean, unit mean square (eps aside)
    np.testing.assert_allclose(jnp.mean(y, -1), 0.0, atol=1e-6)
    np.testing.assert_allclose(jnp.mean(y ** 2, -1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("act,golden", [("relu", 1.0), ("gelu", 0.8413447460685429),
                                        ("gelu_tanh", 0.8411919906082768), ("silu", 0.7310585786300049)])
def test_feedforward_activations(act, golden):
    ff = FeedForward(mlp_dim=1, activation=act, use_bias=False)
    x = jnp.ones((1, 1, 1))
    p = {"wi": {"kernel": jnp.ones((1, 1))}, "wo": {"kernel": jnp.ones((1, 1))}}
    np.testing.assert_allclose(ff.apply({"params": p}, x)[0, 0, 0], golden, rtol=1e-6)
    gated = FeedForward(mlp_dim=1, activation=act, gated=True, use_bias=False)
    pg = {"wi_0": {"kernel": jnp.ones((1, 1))}, "wi_1": {"kernel": 2 * jnp.ones((1, 1))},
          "wo": {"kernel": jnp.ones((1, 1))}}
    np.testing.assert_allclose(gated.apply({"params": pg}, x)[0, 0, 0], 2 * golden, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown activation"):
        FeedForward(mlp_dim=1, activation="swishy").init(jax.random.PRNGKey(0), x)


def test_store_gradient_once_is_the_identity_to_every_order():
    """Values, gradients, tangents and second derivatives through ``store_gradient_once``
    equal those of the plain function bitwise, also under vmap, with NaN inputs, for an
    empty array and for integer inputs (float0 tangents)."""
    from transformer_jax.layers.blocks import store_gradient_once as sgo
    x, dx = rand(1, (3, 4, 8)), rand(2, (3, 4, 8))
    f = lambda a: jnp.sum(jnp.sin(sgo(a) * 1.5) ** 2)      # noqa: E731
    ref = lambda a: jnp.sum(jnp.sin(a * 1.5) ** 2)         # noqa: E731
    np.testing.assert_array_equal(sgo(x), x)
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(x), jax.jit(jax.grad(ref))(x))
    np.testing.assert_array_equal(jax.jvp(f, (x,), (dx,))[1], jax.jvp(ref, (x,), (dx,))[1])
    hv = jax.jvp(jax.grad(f), (x,), (dx,))[1]
    np.testing.assert_array_equal(hv, jax.jvp(jax.grad(ref), (x,), (dx,))[1])
    np.testing.assert_array_equal(jax.vmap(jax.grad(f))(x), jax.vmap(jax.grad(ref))(x))
    xn = x.at[0, 0, 0].set(jnp.nan)
    np.testing.assert_array_equal(jax.grad(f)(xn), jax.grad(ref)(xn))
    assert jax.grad(lambda a: jnp.sum(sgo(a)))(jnp.zeros((0, 3))).shape == (0, 3)
    ints = jnp.arange(6)
    primal, tangent = jax.jvp(sgo, (ints,), (np.zeros(6, jax.dtypes.float0),))
    np.testing.assert_array_equal(primal, ints)
    assert tangent.dtype == jax.dtypes.float0


class _PreNormStack(nn.Module):
    layers: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.layers):
            x = EncoderBlock(num_heads=2, mlp_dim=48)(x)
        return x


def _grad_hlo_facts(layers):
    """(conditionals, the most operands of any activation-shaped fusion) in the compiled
    parameter gradient of a pre-norm stack, x (2, 8, 24)."""
    x = rand(0, (2, 8, 24))
    model = _PreNormStack(layers)
    params = model.init(jax.random.PRNGKey(1), x)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, x) ** 2)))
    text = grad.lower(params).compile().as_text()
    operands = [line.split("=", 1)[1].split("metadata")[0].count("%") - 1
                for line in text.splitlines()
                if re.match(r"\s*(ROOT )?%\w*fusion[.\d]* = f32\[(2,8,24|16,24)\]", line)]
    return text.count(" conditional("), max(operands)


def test_store_gradient_once_is_the_same_program_on_every_backend():
    """The model code has no platform branch: the GPT gradient lowered for CPU, CUDA and
    TPU (cross-platform lowering, no device needed) has the same StableHLO op sequence,
    with one conditional per sublayer. (Lowering shows ``lax.platform_dependent``
    branches; choices made in Python at trace time from ``jax.default_backend()``, like
    attention's cuDNN check for ``attention_impl="jax"``, are outside what it sees.)"""
    from transformer_jax.models import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=32, max_len=8, num_layers=2, num_heads=2, d_model=16)
    model, ids = GPT(cfg), jnp.zeros((1, 8), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), ids)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply(p, ids) ** 2)))
    texts = {plat: grad.trace(params).lower(lowering_platforms=(plat,)).as_text()
             for plat in ("cpu", "cuda", "tpu")}
    # 2 layers x 2 sublayers; the first one's gradient feeds the embedding table's
    assert {plat: t.count("stablehlo.case") for plat, t in texts.items()} == \
        {"cpu": 4, "cuda": 4, "tpu": 4}
    ops = {plat: re.findall(r"= (\w+\.[\w.]+)", t) for plat, t in texts.items()}
    assert len(ops["cpu"]) > 100 and ops["cpu"] == ops["cuda"] == ops["tpu"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the compiled HLO is XLA:CPU's")
def test_pre_norm_residual_gradient_is_stored_once_per_sublayer_on_cpu():
    """XLA:CPU would otherwise recompute the residual stream's gradient chain inside every
    layer's backward fusion (the largest fusion read 27 operands at 2 layers and 124 at 8
    without ``store_gradient_once``). With it: one conditional per sublayer survives
    compilation (the very first one's gradient, w.r.t. the input, is not needed), and the
    fusions don't grow with depth."""
    conds2, ops2 = _grad_hlo_facts(2)
    conds8, ops8 = _grad_hlo_facts(8)
    assert (conds2, conds8) == (2 * 2 - 1, 2 * 8 - 1)
    assert ops8 == ops2 <= 12, (ops2, ops8)
    # vmap keeps the conditional (its predicate doesn't depend on the batched values)
    from transformer_jax.layers.blocks import store_gradient_once as sgo
    grads = jax.jit(jax.vmap(jax.grad(lambda a: jnp.sum(jnp.sin(sgo(a)) ** 2))))
    assert grads.lower(rand(0, (4, 3, 8))).compile().as_text().count(" conditional(") == 1


def test_wide_gradient_is_the_identity_to_every_order():
    """Values, gradients, tangents and second derivatives through ``wide_gradient`` equal
    those of the plain matmul (fp32, highest precision), for tall and wide operands."""
    from transformer_jax.layers.dense import wide_gradient
    hi = jax.lax.Precision.HIGHEST
    for k, n in [(24, 8), (8, 24), (12, 12)]:
        x, w, g = rand(0, (32, k)), rand(1, (k, n)), rand(2, (32, n))
        dw = rand(3, (k, n))
        def f(a, b, through=wide_gradient):
            return jnp.vdot(jnp.tanh(jnp.dot(a, through(b), precision=hi)), g)
        ref = functools.partial(f, through=lambda b: b)
        np.testing.assert_array_equal(wide_gradient(w), w)
        np.testing.assert_array_equal(f(x, w), ref(x, w))
        grads = [jax.jit(jax.grad(fn, (0, 1)))(x, w) for fn in (f, ref)]
        for got, want in zip(*grads):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(jax.jvp(lambda b: f(x, b), (w,), (dw,))[1],
                                   jax.jvp(lambda b: ref(x, b), (w,), (dw,))[1], rtol=1e-6)
        hvp = lambda fn: jax.jvp(jax.grad(lambda b: fn(x, b)), (w,), (dw,))[1]  # noqa: E731
        np.testing.assert_allclose(hvp(f), hvp(ref), rtol=1e-5, atol=1e-6)
    for bad in (lambda a: wide_gradient(a), jax.grad(lambda a: jnp.sum(wide_gradient(a)))):
        with pytest.raises(ValueError,
                           match=r"2-D matmul operand \(K, N\), got shape \(2, 3, 4\)"):
            bad(jnp.ones((2, 3, 4)))


def _weight_gradient_dots():
    """Output shapes, as laid out in memory (row-major), of the dots that contract the rows
    (the weight gradients) in the compiled parameter gradient of Dense(48 -> 16) followed
    by a tied read-out (V=64)."""
    from transformer_jax.layers import dense

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return dense.Embed(64, 16).attend(dense.Dense(16)(x))
    x = rand(0, (4, 8, 48))
    params = Net().init(jax.random.PRNGKey(1), x)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(Net().apply(p, x)))))
    text = grad.lower(params).compile().as_text()
    shapes = []
    for m in re.finditer(r"= f32\[(\d+),(\d+)\]\{(\d),(\d)\} dot\([^\n]*lhs_contracting_dims=\{0\}",
                         text):
        a, b, minor = int(m.group(1)), int(m.group(2)), m.group(3)
        shapes.append((a, b) if minor == "1" else (b, a))      # as laid out in memory
    return sorted(shapes)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the layouts are XLA:CPU's choice")
def test_weight_gradients_are_computed_with_the_longer_axis_last(monkeypatch):
    """Dense's (48, 16) kernel and the (64, 16) read-out table get their gradients as
    (16, 48) and (16, 64) products (XLA:CPU's faster orientation), transposed afterwards;
    without ``wide_gradient`` XLA writes them as (48, 16) and (64, 16)."""
    from transformer_jax.layers import dense
    assert _weight_gradient_dots() == [(16, 48), (16, 64)]
    monkeypatch.setattr(dense, "wide_gradient", lambda w: w)
    assert _weight_gradient_dots() == [(48, 16), (64, 16)]


@pytest.mark.parametrize("pre_norm", [True, False])
def test_encoder_block_composition(pre_norm):
    """The block equals its sublayers composed by hand (pre: x + f(norm x); post: norm(x + f(x)))."""
    x = rand(0, (2, 5, 16))
    mask = padding_mask_from_lengths(jnp.array([5, 3]), 5)
    blk = EncoderBlock(num_heads=4, mlp_dim=32, pre_norm=pre_norm)
    p = nn.meta.unbox(blk.init(jax.random.PRNGKey(1), x))["params"]
    mha, ff, ln = MultiHeadAttention(num_heads=4), FeedForward(mlp_dim=32), LayerNorm()
    attn = lambda h: mha.apply({"params": p["self_attn"]}, h, mask=mask)
    mlp = lambda h: ff.apply({"params": p["mlp"]}, h)
    n1 = lambda h: ln.apply({"params": p["norm1"]}, h)
    n2 = lambda h: ln.apply({"params": p["norm2"]}, h)
    if pre_norm:
        h = x + attn(n1(x))
        expected = h + mlp(n2(h))
    else:
        h = n1(x + attn(x))
        expected = n2(h + mlp(h))
    np.testing.assert_allclose(blk.apply({"params": p}, x, mask), expected, **FP32_TOL)


def test_decoder_block_cross_attention_uses_memory():
    x, mem = rand(0, (2, 4, 16)), rand(1, (2, 6, 16))
    blk = DecoderBlock(num_heads=4, mlp_dim=32, pre_norm=False)
    p = nn.meta.unbox(blk.init(jax.random.PRNGKey(1), x, mem))["params"]
    assert set(p) == {"self_attn", "cross_attn", "mlp", "norm1", "norm2", "norm3"}
    y1 = blk.apply({"params": p}, x, mem)
    y2 = blk.apply({"params": p}, x, mem.at[:, -1].set(0.0))
    masked = blk.apply({"params": p}, x, mem.at[:, -1].set(0.0),
                       cross_mask=padding_mask_from_lengths(jnp.array([5, 5]), 6))
    masked_ref = blk.apply({"params": p}, x, mem, cross_mask=padding_mask_from_lengths(jnp.array([5, 5]), 6))
    assert float(jnp.abs(y1 - y2).max()) > 1e-3
    np.testing.assert_allclose(masked, masked_ref, **FP32_TOL)   # masked memory slots are ignored
    # causality: changing a later target token does not change earlier outputs
    y3 = blk.apply({"params": p}, x.at[:, -1].set(5.0), mem)
    np.testing.assert_allclose(y3[:, :-1], y1[:, :-1], **FP32_TOL)
    with pytest.raises(ValueError, match="memory"):
        blk.apply({"params": p}, x)
