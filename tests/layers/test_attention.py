"""dot_product_attention's implementations against the reference and by hand; MultiHeadAttention."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import MultiHeadAttention, causal_mask, dot_product_attention

from ..helpers import BF16_ATOL, FP32_TOL, attention_inputs, rand

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab


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


@pytest.mark.parametrize("impl", ["xla", "jax", "chunked"])
@pytest.mark.parametrize("causal", [False, True])
def test_implementations_agree_forward_and_grad(impl, causal):
    # reference: "xla" over the whole (T, S) square (q_chunk=T);
    # impl="xla" with q_chunk=16 is the causal query-blocked path (blocks 16, 16, 5)
    q, k, v, mask, bias = attention_inputs()
    ref = dot_product_attention(q, k, v, mask=mask, bias=bias, causal=causal, q_chunk=q.shape[1])
    kw = dict(mask=mask, bias=bias, causal=causal, q_chunk=16, kv_chunk=16)
    out = dot_product_attention(q, k, v, attention_impl=impl, **kw)
    np.testing.assert_allclose(out, ref, **FP32_TOL)

    ct = rand(5, ref.shape)
    def loss(impl, **chunks):
        return lambda q, k, v, b: jnp.sum(dot_product_attention(
            q, k, v, mask=mask, bias=b, causal=causal, attention_impl=impl, **chunks) * ct)
    g_ref = jax.jit(jax.grad(loss("xla", q_chunk=q.shape[1]), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    g = jax.jit(jax.grad(loss(impl, q_chunk=16, kv_chunk=16), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_handles_uneven_blocks_and_fully_masked_rows():
    q, k, v, _, _ = attention_inputs(n=4, kv=4, t=9, s=11)
    mask = jnp.ones((1, 1, 9, 11), bool).at[:, :, 3].set(False)   # query 3 sees nothing
    ref = dot_product_attention(q, k, v, mask=mask)
    out = dot_product_attention(q, k, v, mask=mask, attention_impl="chunked", q_chunk=4, kv_chunk=3)
    np.testing.assert_allclose(out, ref, **FP32_TOL)
    # a fully blocked row averages the values (no NaN)
    np.testing.assert_allclose(ref[:, 3], jnp.mean(v, axis=1), atol=1e-5)


@pytest.mark.parametrize("t, s", [(40, 40), (40, 29), (29, 40)])
def test_xla_causal_query_blocks_equal_the_whole_square(t, s):
    """Causal "xla" attention in query blocks (keys up to each block's last row) == the
    whole (T, S) computation (``return_weights`` never blocks): GQA, a T5-style bias
    broadcast over the batch, a padding mask with a query that sees no key (it must still
    average all S values), T != S both ways; outputs and gradients."""
    q, k, v, _, bias = attention_inputs(n=4, kv=2, t=t, s=s)
    mask = jnp.ones((2, 1, t, s), bool).at[0, :, 20, :].set(False).at[1, :, :, 3:7].set(False)
    ct = rand(5, (2, t, 4, 16))

    def run(block):
        def f(q, k, v, b):
            out = dot_product_attention(q, k, v, mask=mask, bias=b, causal=True, q_chunk=block)
            return jnp.sum(out * ct), out
        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)

    g_ref, ref = run(t)             # one block: the whole square
    whole, _ = dot_product_attention(q, k, v, mask=mask, bias=bias, causal=True, return_weights=True)
    np.testing.assert_allclose(ref, whole, **FP32_TOL)
    for block in (8, 13, 16):
        g, out = run(block)
        np.testing.assert_allclose(out, ref, **FP32_TOL)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[0, 20], jnp.repeat(jnp.mean(v[0], axis=0), 2, axis=0), atol=1e-5)


def test_bf16_within_documented_tolerance():
    q, k, v, mask, _ = attention_inputs()
    ref = dot_product_attention(q, k, v, mask=mask, causal=True)
    for impl in ("xla", "jax", "chunked"):
        out = dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                    mask=mask, causal=True, attention_impl=impl, q_chunk=16, kv_chunk=16)
        assert out.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
        assert err < BF16_ATOL, (impl, err)
    _, w = dot_product_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                                 return_weights=True)
    assert w.dtype == jnp.float32  # softmax in fp32
    np.testing.assert_allclose(jnp.sum(w, -1), 1.0, atol=1e-6)


def test_attention_dropout():
    q, k, v, _, _ = attention_inputs(n=2, kv=2, t=16, s=16)
    rng = jax.random.PRNGKey(7)
    _, w_clean = dot_product_attention(q, k, v, return_weights=True)
    _, w = dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng, deterministic=False,
                                 return_weights=True)
    kept = w != 0
    assert 0.65 < float(kept.mean()) < 0.85
    np.testing.assert_allclose(w[kept], (w_clean / 0.75)[kept], rtol=1e-6)
    a = dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng, deterministic=False,
                              attention_impl="chunked", q_chunk=4, kv_chunk=4)
    b = dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng, deterministic=False,
                              attention_impl="chunked", q_chunk=4, kv_chunk=4)
    np.testing.assert_array_equal(a, b)   # the same rng gives the same mask
    assert float(jnp.abs(a - dot_product_attention(q, k, v)).max()) > 1e-2
    with pytest.raises(ValueError, match="dropout_rng"):
        dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=False)
    with pytest.raises(ValueError, match="no attention dropout"):
        dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=rng, deterministic=False,
                              attention_impl="jax")


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
    with pytest.raises(ValueError, match="unknown attention_impl"):
        dot_product_attention(q, k, v, attention_impl="flash9000")
    with pytest.raises(ValueError, match="return_weights"):
        dot_product_attention(q, k, v, return_weights=True, attention_impl="chunked")


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


@pytest.mark.parametrize("impl", ["xla", "chunked", "pallas", "jax"])
def test_packed_documents_attend_as_if_alone(impl):
    # three documents (lengths 5, 7, 4) and padding (id 0) in one row of 20, grouped heads:
    # every document's outputs and gradients equal those of the document alone
    lengths = (5, 7, 4)
    ids = np.zeros((1, 20), np.int32)
    ids[0, :16] = np.repeat([1, 2, 3], lengths)
    q, k, v = rand(0, (1, 20, 4, 8)), rand(1, (1, 20, 2, 8)), rand(2, (1, 20, 2, 8))
    ct = rand(3, (1, 20, 4, 8))
    kw = dict(causal=True, attention_impl=impl, q_chunk=8, kv_chunk=8)

    def loss(q, k, v, ct, segment_ids=None):
        return jnp.sum(dot_product_attention(q, k, v, segment_ids=segment_ids, **kw) * ct)
    attend = jax.jit(lambda q, k, v, segment_ids=None: dot_product_attention(
        q, k, v, segment_ids=segment_ids, **kw))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    out = attend(q, k, v, segment_ids=jnp.asarray(ids))
    grads = grad(q, k, v, ct, segment_ids=jnp.asarray(ids))
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = attend(q[:, part], k[:, part], v[:, part])
        np.testing.assert_allclose(out[:, part], alone, **FP32_TOL)
        g_alone = grad(q[:, part], k[:, part], v[:, part], ct[:, part])
        for g, ga in zip(grads, g_alone):
            np.testing.assert_allclose(g[:, part], ga, rtol=1e-5, atol=1e-5)
        start += n


def test_packed_documents_in_a_block_and_refusals():
    # a decoder-only block over two packed documents equals the block over each alone
    from transformer_jax.layers.blocks import DecoderBlock
    block = DecoderBlock(num_heads=2, mlp_dim=16, cross_attention=False, rope_base=10000.0)
    x = rand(0, (1, 9, 8))
    params = jax.jit(block.init)(jax.random.PRNGKey(0), x)
    apply = jax.jit(block.apply)
    ids = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 2]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    packed = apply(params, x, positions=pos, segment_ids=ids)
    np.testing.assert_allclose(packed[:, :4], apply(params, x[:, :4]), **FP32_TOL)
    np.testing.assert_allclose(packed[:, 4:], apply(params, x[:, 4:]), **FP32_TOL)
    with pytest.raises(ValueError, match="segment_ids must be"):
        dot_product_attention(x.reshape(1, 9, 2, 4), x.reshape(1, 9, 2, 4),
                              x.reshape(1, 9, 2, 4), segment_ids=ids[:, :5])
