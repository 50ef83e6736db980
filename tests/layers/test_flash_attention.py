"""The block-wise attention paths against the ``"xla"`` reference.

``"pallas"`` runs its kernels in interpret mode here (CPU), so shapes are small and the
block sizes (16) are chosen to give several query and key blocks with ragged ends.
Tolerances: fp32 outputs 1e-5 (as the other implementations, tests/layers/test_layers.py),
gradients 1e-4 (sums over up to S products); bf16 within the library's 2e-2.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import dot_product_attention, relative_position_bias
from transformer_jax.layers.chunked_attention import (_chunk_forward, _chunked_core, _Chunking,
                                                      chunked_attention)
from transformer_jax.layers.flash_attention import BlockSizes, flash_attention
from transformer_jax.layers.masks import AttentionPattern, segment_mask
from transformer_jax.models import GPT, GPTConfig

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_ATOL = 2e-2
BLOCKS = dict(q_chunk=16, kv_chunk=16)


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


def _grads(impl, q, k, v, ct, argnums=(0, 1, 2), **kw):
    """Output and gradients of sum(attention * ct) with respect to ``argnums``."""
    extra = {name: kw.pop(name) for name in ("bias", "table") if name in kw}

    def loss(q, k, v, extra):
        if "table" in extra:
            extra = dict(bias=relative_position_bias(extra["table"], q.shape[1], k.shape[1],
                                                     bidirectional=False, max_distance=16))
        out = dot_product_attention(q, k, v, attention_impl=impl, **BLOCKS, **extra, **kw)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))(
        q, k, v, extra)
    return out, grads


def _assert_parity(impl, q, k, v, argnums=(0, 1, 2, 3), **kw):
    ct = rand(9, q.shape[:3] + v.shape[-1:])
    out, grads = _grads(impl, q, k, v, ct, argnums, **dict(kw))
    ref, ref_grads = _grads("xla", q, k, v, ct, argnums, **dict(kw))
    np.testing.assert_allclose(out, ref, **FP32_TOL)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, **GRAD_TOL)
    return out, grads


# --------------------------------------------------------------------------- pallas

def test_pallas_causal_gqa_key_padding():
    """Causal self-attention, 8 query heads on 2 kv heads, right padding, T=S=40 (ragged)."""
    q, k, v = rand(0, (2, 40, 8, 16)), rand(1, (2, 40, 2, 16)), rand(2, (2, 40, 2, 16))
    lengths = jnp.array([40, 27])
    mask = (jnp.arange(40)[None, :] < lengths[:, None])[:, None, None, :]      # (B, 1, 1, S)
    _assert_parity("pallas", q, k, v, argnums=(0, 1, 2), mask=mask, causal=True)


def test_pallas_cross_attention_mask_and_bias():
    """T != S, a full (B, 1, T, S) mask and a learned (1, N, T, S) bias, whose gradient
    comes from the separate dS kernel."""
    q, k, v = rand(0, (2, 24, 4, 16)), rand(1, (2, 40, 4, 16)), rand(2, (2, 40, 4, 8))
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (2, 1, 24, 40))
    _assert_parity("pallas", q, k, v, mask=mask, bias=rand(4, (1, 4, 24, 40)))


def test_pallas_t5_relative_bias_gradient():
    """T5's decoder self-attention: causal plus a bucketed relative bias; the bias table's
    gradient (a scatter of dS) matches the reference."""
    q, k, v = rand(0, (1, 32, 4, 16)), rand(1, (1, 32, 2, 16)), rand(2, (1, 32, 2, 16))
    table = rand(5, (8, 4))
    _, grads = _assert_parity("pallas", q, k, v, causal=True, table=table)
    assert float(jnp.abs(grads[3]["table"]).max()) > 1e-2


def test_pallas_rows_without_keys_and_bf16():
    q, k, v = rand(0, (1, 20, 2, 16)), rand(1, (1, 20, 2, 16)), rand(2, (1, 20, 2, 16))
    # query 3 may attend nothing; under causal its row gets the mean of V, as in "xla"
    mask = jnp.ones((1, 1, 20, 20), bool).at[:, :, 3].set(False)
    for causal in (False, True):
        out = dot_product_attention(q, k, v, mask=mask, causal=causal, attention_impl="pallas",
                                    **BLOCKS)
        np.testing.assert_allclose(out, dot_product_attention(q, k, v, mask=mask, causal=causal),
                                   **FP32_TOL)
        np.testing.assert_allclose(out[:, 3], jnp.mean(v, axis=1), atol=1e-5)
    ref = dot_product_attention(q, k, v, causal=True)
    out = dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=True,
                                attention_impl="pallas", **BLOCKS)
    assert out.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) < BF16_ATOL


def test_pallas_in_gpt():
    """A tiny GPT (explicit causal mask + causal=True) gives the same logits with the kernels."""
    cfg = GPTConfig.preset("tiny", num_layers=1, max_len=32)
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 24), 0, cfg.vocab_size)
    params = GPT(cfg).init(jax.random.PRNGKey(1), ids)
    ref = GPT(cfg).apply(params, ids)
    out = GPT(GPTConfig.preset("tiny", num_layers=1, max_len=32, attention_impl="pallas")).apply(
        params, ids)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_pallas_errors():
    q = k = v = rand(0, (1, 16, 2, 16))
    rng = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="no attention dropout.*'chunked'"):
        dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=rng, deterministic=False,
                              attention_impl="pallas")
    with pytest.raises(ValueError, match="return_weights=True needs attention_impl='xla'"):
        dot_product_attention(q, k, v, return_weights=True, attention_impl="pallas")
    with pytest.raises(ValueError, match="powers of two"):
        dot_product_attention(q, k, v, attention_impl="pallas", q_chunk=48)
    with pytest.raises(ValueError, match="powers of two"):
        BlockSizes(block_q=128, block_k=96)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        flash_attention(rand(0, (1, 16, 3, 16)), k, v)
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="interpret=True"):
            flash_attention(q, k, v, interpret=False)
        with pytest.raises(ValueError, match="needs a GPU.*attention_impl='auto'"):
            dot_product_attention(q, k, v, attention_impl="cudnn")


# --------------------------------------------------------------------------- chunked

def test_chunked_causal_skipping_is_exact():
    """Skipping the key blocks past the diagonal gives bit-identical outputs and gradients
    to visiting them (their probabilities are exact zeros), rows without keys included."""
    q, k, v = rand(0, (2, 45, 4, 16)), rand(1, (2, 45, 2, 16)), rand(2, (2, 45, 2, 16))
    mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.8, (2, 1, 45, 45)).at[:, :, 5].set(False)
    bias = rand(4, (1, 4, 45, 45))
    ct = rand(5, (2, 45, 4, 16))

    def run(skip):
        def loss(q, k, v, bias):
            out = chunked_attention(q, k, v, mask, bias, 0.25, True, 0.0, None, True, None,
                                     16, 8, skip_masked_blocks=skip)
            return jnp.sum(out * ct), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)

    (_, out), grads = run(True)
    (_, out_all), grads_all = run(False)
    np.testing.assert_array_equal(out, out_all)
    for a, b in zip(grads, grads_all):
        np.testing.assert_array_equal(a, b)
    ref = dot_product_attention(q, k, v, mask=mask, bias=bias, causal=True, scale=0.25)
    np.testing.assert_allclose(out, ref, **FP32_TOL)


def test_chunked_custom_vjp_matches_autodiff_with_dropout():
    """The hand-written backward (recomputed probabilities, regenerated dropout masks, bias
    gradient) equals JAX's autodiff of the same blocked forward pass."""
    b, t, s, kh, g, h = 2, 24, 20, 2, 2, 8
    q, k, v = rand(0, (b, t, kh, g, h)), rand(1, (b, s, kh, h)), rand(2, (b, s, kh, h))
    bias = rand(3, (1, kh * g, t, s))
    mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.8, (b, 1, t, s))
    c = _Chunking(scale=0.3, causal=True, t=t, s=s, qc=8, kc=4, nq=3, nk=5, dropout_rate=0.25,
                  skip=False, precision=None)
    rng, ct = jax.random.PRNGKey(7), rand(5, (b, t, kh, g, h))

    def loss(fn):
        return lambda q, k, v, bias: jnp.sum(fn(q, k, v, bias) * ct)
    custom = jax.jit(jax.grad(loss(lambda *a: _chunked_core(*a, mask, rng, None, c)[0]),
                              argnums=(0, 1, 2, 3)))
    autodiff = jax.jit(jax.grad(loss(lambda *a: _chunk_forward(c, *a, mask, rng)[0]),
                                argnums=(0, 1, 2, 3)))
    for got, want in zip(custom(q, k, v, bias), autodiff(q, k, v, bias)):
        np.testing.assert_allclose(got, want, **GRAD_TOL)


def test_chunked_memory_grows_linearly():
    """Compiled fwd+bwd scratch memory (memory_analysis) from T=1024 to 2048: chunked within
    the issue's 2.2x bound (measured 1.2x), and far below the reference, which holds
    (B, N, T, T) logits (on XLA:CPU its temp is only a lower bound: library fusions'
    intermediates are not counted, so its growth is not asserted)."""
    def temp(impl, seq):
        x = jnp.zeros((1, seq, 2, 32))
        f = jax.grad(lambda q, k, v: jnp.sum(dot_product_attention(
            q, k, v, causal=True, attention_impl=impl, q_chunk=256, kv_chunk=256)),
            argnums=(0, 1, 2))
        analysis = jax.jit(f).lower(x, x, x).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        return analysis.temp_size_in_bytes

    chunked_2k = temp("chunked", 2048)
    assert chunked_2k / temp("chunked", 1024) <= 2.2
    assert chunked_2k < temp("xla", 2048) / 8


# --------------------------------------------------------------------------- segment ids

def _packed_ids(b, length, seed):
    """(b, length) ids of packed documents, not sorted: runs of random lengths whose ids
    (0..3) repeat and go down as well as up."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, 4, (b, length // 4 + 1)).repeat(4, axis=1)[:, :length]
                       if seed % 2 else np.sort(rng.integers(0, 4, (b, length)), axis=1),
                       dtype=jnp.int32)


@pytest.mark.parametrize("path", ["chunked", "pallas"])
@pytest.mark.parametrize("case", ["causal_gqa_bias", "window_key_padding", "cross_empty_rows"])
def test_native_segment_ids_equal_the_folded_mask(path, case):
    """Segment ids compared per tile inside the kernels (no (T, S) mask) give the outputs
    and gradients of the reference with the ids folded into a mask: grouped heads, lengths
    that are not multiples of the blocks (45, 37), with a T5-style (1, N, T, S) bias and its
    gradient, a causal window, a key-padding mask, cross-attention whose kv ids lack some
    query ids (rows without any key: the mean of V, as the reference gives)."""
    if case == "causal_gqa_bias":
        q, k, v = rand(0, (2, 45, 4, 16)), rand(1, (2, 45, 2, 16)), rand(2, (2, 45, 2, 16))
        ids = _packed_ids(2, 45, 1)
        _assert_parity(path, q, k, v, causal=True, bias=rand(4, (1, 4, 45, 45)),
                       segment_ids=ids)
    elif case == "window_key_padding":
        q, k, v = rand(0, (2, 45, 2, 16)), rand(1, (2, 45, 2, 16)), rand(2, (2, 45, 2, 8))
        lengths = jnp.array([45, 30])
        mask = (jnp.arange(45)[None, :] < lengths[:, None])[:, None, None, :]
        _assert_parity(path, q, k, v, argnums=(0, 1, 2), causal=True, mask=mask,
                       pattern=AttentionPattern("window", 8), segment_ids=_packed_ids(2, 45, 2))
    else:
        q, k, v = rand(0, (2, 21, 4, 16)), rand(1, (2, 37, 2, 16)), rand(2, (2, 37, 2, 16))
        q_ids = jnp.asarray(np.tile(np.arange(21) % 5, (2, 1)), jnp.int32)    # ids 0..4
        kv_ids = _packed_ids(2, 37, 3) % 4                                   # no 4 among keys
        for causal in (False, True):
            out, _ = _assert_parity(path, q, k, v, argnums=(0, 1, 2), causal=causal,
                                    segment_ids=(q_ids, kv_ids))
            np.testing.assert_allclose(out[:, 4], jnp.repeat(jnp.mean(v, axis=1), 2, axis=1),
                                       atol=1e-5)


def _avals(jaxpr):
    """Every variable's shape in a jaxpr and the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        for var in (*eqn.invars, *eqn.outvars):
            if hasattr(var, "aval") and hasattr(var.aval, "shape"):
                yield var.aval.shape
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _avals(inner)


@pytest.mark.parametrize("path", ["chunked", "pallas"])
def test_native_segment_ids_build_no_t_by_s_array(path):
    """Forward and backward with segment ids hold no array with both a T (=96) and an
    S (=80) axis, where the folded mask was (B, 1, T, S)."""
    t, s = 96, 80
    q, k, v = rand(0, (1, t, 2, 16)), rand(1, (1, s, 2, 16)), rand(2, (1, s, 2, 16))
    ids = (_packed_ids(1, t, 4), _packed_ids(1, s, 6))

    def loss(q, k, v, segment_ids):
        return jnp.sum(dot_product_attention(q, k, v, attention_impl=path, causal=True,
                                             segment_ids=segment_ids, q_chunk=16, kv_chunk=16))
    shapes = list(_avals(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v, ids).jaxpr))
    assert len(shapes) > 100
    assert not [x for x in shapes if t in x and s in x]
    folded = jax.make_jaxpr(lambda a, b: segment_mask(a, b))(*ids).jaxpr
    assert (1, 1, t, s) in list(_avals(folded))           # what the fold would have built


def test_native_segment_ids_memory_is_linear():
    """Compiled fwd+bwd scratch of "chunked" at T = 4,096 on the CPU: what segment ids add
    to the call without them is under an eighth of what folding them into a (B, 1, T, T)
    mask (16 MiB of bools) adds (measured 2026-12-07: 8.2 MB without, +2.1 MB native,
    +26.4 MB folded)."""
    t = 4096
    x = jnp.zeros((1, t, 2, 32))
    ids = jnp.asarray(np.repeat(np.arange(8), t // 8)[None], jnp.int32)

    def temp(how):
        def loss(q, k, v, ids):
            kw = dict(segment_ids=ids) if how == "native" else (
                dict(mask=segment_mask(ids, ids)) if how == "folded" else {})
            return jnp.sum(dot_product_attention(q, k, v, causal=True, attention_impl="chunked",
                                                 q_chunk=512, kv_chunk=512, **kw))
        analysis = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x, ids).compile(
            ).memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        return analysis.temp_size_in_bytes

    native, folded, plain = temp("native"), temp("folded"), temp("none")
    assert native - plain < (folded - plain) / 8
