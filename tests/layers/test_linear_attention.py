"""Linear attention (``layers/linear_attention.py``) against its explicit O(T·S) formula.

``reference`` forms the full (T, S) matrix φ(Q)φ(K)ᵀ, masks it (key mask, causal), and
divides (masked matrix) V by its row sums plus eps. fp32 outputs and gradients (of
sum(out * ct) for a fixed random ct) agree within ``TOL`` (sums of at most S = 37
positive products); bf16 inputs agree with the fp32 inputs' result within
``BF16_ATOL`` (measured 7e-3).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.layers.linear_attention import (feature_map, init_linear_state,
                                                      linear_attention, linear_attention_step)

jax.config.update("jax_default_matmul_precision", "highest")

TOL = dict(rtol=1e-5, atol=1e-5)
BF16_ATOL = 3e-2
HIGHEST = jax.lax.Precision.HIGHEST


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape, dtype)


def reference(q, k, v, mask=None, causal=False, eps=1e-6):
    """(A ⊙ M) V / (rowsum(A ⊙ M) + eps), A = φ(Q)φ(K)ᵀ, M the key and causal masks."""
    n, kh = q.shape[2], k.shape[2]
    kf = jnp.repeat(feature_map(k), n // kh, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), n // kh, axis=2)
    a = jnp.einsum("BTNH,BSNH->BNTS", feature_map(q), kf, precision=HIGHEST)
    t, s = q.shape[1], k.shape[1]
    allowed = jnp.ones((1, 1, t, s), bool)
    if causal:
        allowed = allowed & jnp.tril(jnp.ones((t, s), bool))
    if mask is not None:
        allowed = allowed & mask.astype(bool)
    a = jnp.where(allowed, a, 0.0)
    num = jnp.einsum("BNTS,BSNV->BTNV", a, vf, precision=HIGHEST)
    den = jnp.sum(a, axis=-1).transpose(0, 2, 1)[..., None]
    return (num / (den + eps)).astype(v.dtype)


def qkv(b=2, t=37, s=None, n=2, kh=None, h=8, hv=None, dtype=jnp.float32, seed=0):
    s, kh, hv = s or t, kh or n, hv or h
    return (rand(seed, (b, t, n, h), dtype), rand(seed + 1, (b, s, kh, h), dtype),
            rand(seed + 2, (b, s, kh, hv), dtype))


def out_and_grads(fn, q, k, v):
    """fn(q, k, v) and the gradients of sum(fn * ct) w.r.t. q, k, v (one jit)."""
    ct = rand(99, (q.shape[0], q.shape[1], q.shape[2], v.shape[3]))

    def loss(q, k, v):
        out = fn(q, k, v)
        return jnp.sum(out * ct), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def assert_matches_reference(q, k, v, mask=None, causal=False, chunk=8):
    got = out_and_grads(lambda q, k, v: linear_attention(q, k, v, mask=mask, causal=causal,
                                                         chunk=chunk), q, k, v)
    want = out_and_grads(lambda q, k, v: reference(q, k, v, mask, causal), q, k, v)
    np.testing.assert_allclose(got[0], want[0], **TOL)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(g, w, **TOL)


def test_feature_map_is_elu_plus_one_in_fp32():
    x = jnp.array([-3.0, -0.5, 0.0, 2.0], jnp.bfloat16)
    y = feature_map(x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, np.where(x > 0, x + 1, np.exp(np.float32(x))), rtol=1e-6)
    assert bool(jnp.all(y > 0))


@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_explicit_formula(causal):
    """T = 37 with chunk 8: four full chunks and a padded one."""
    assert_matches_reference(*qkv(), causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_attention(causal):
    q, k, v = qkv(n=4, kh=2, hv=6, t=19)
    assert_matches_reference(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_key_padding_mask(causal, per_head):
    """Right padding in row 0, left padding in row 1; a per-query-head mask with GQA."""
    q, k, v = qkv(n=4, kh=2, t=21)
    valid = jnp.stack([jnp.arange(21) < 15, jnp.arange(21) >= 4])         # (B, S)
    mask = valid[:, None, None, :]
    if per_head:
        mask = mask & (jnp.arange(4)[:, None] != jnp.arange(21) % 4)[None, :, None, :]
    assert_matches_reference(q, k, v, mask=mask, causal=causal)


def test_masked_keys_contribute_nothing_even_if_not_finite():
    q, k, v = qkv(t=9)
    mask = (jnp.arange(9) < 6)[None, None, None, :]
    k_bad = k.at[:, 6:].set(jnp.inf)
    v_bad = v.at[:, 6:].set(jnp.nan)
    for causal in (False, True):
        run = jax.jit(lambda q, k, v: linear_attention(q, k, v, mask=mask, causal=causal, chunk=4))
        got = run(q, k_bad, v_bad)
        np.testing.assert_allclose(got, reference(q, k, v, mask, causal), **TOL)


def test_cross_attention():
    q, k, v = qkv(t=5, s=23, hv=4)
    mask = (jnp.arange(23) < jnp.array([23, 11])[:, None])[:, None, None, :]
    assert_matches_reference(q, k, v, mask=mask)


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_inputs_are_close_to_fp32(causal):
    q, k, v = qkv(n=4, kh=2)
    q16, k16, v16 = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = linear_attention(q16, k16, v16, causal=causal, chunk=8)
    assert got.dtype == jnp.bfloat16
    want = linear_attention(q, k, v, causal=causal, chunk=8)
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=BF16_ATOL, rtol=0)


def _decode(q, k, v, splits, key_valid=None):
    """Run linear_attention_step over consecutive pieces of the sequence (lengths ``splits``)."""
    state, norm = init_linear_state(k.shape[0], k.shape[2], k.shape[3], v.shape[3])
    step = jax.jit(linear_attention_step)
    outs, start = [], 0
    for size in splits:
        part = slice(start, start + size)
        kv = None if key_valid is None else key_valid[:, part]
        out, state, norm = step(q[:, part], k[:, part], v[:, part], state, norm, key_valid=kv)
        outs.append(out)
        start += size
    return jnp.concatenate(outs, axis=1), state, norm


@pytest.mark.parametrize("splits", [[1] * 12, [7, 1, 1, 3]], ids=["token_by_token", "prefill"])
def test_decoding_equals_the_causal_pass(splits):
    q, k, v = qkv(t=12, n=4, kh=2, hv=5)
    full = linear_attention(q, k, v, causal=True, chunk=4)
    got, state, norm = _decode(q, k, v, splits)
    np.testing.assert_allclose(got, full, **TOL)
    kf = feature_map(k)                                    # the cache sums all 12 keys
    np.testing.assert_allclose(state, jnp.einsum("BSKH,BSKV->BKHV", kf, v, precision=HIGHEST),
                               **TOL)
    np.testing.assert_allclose(norm, kf.sum(1), **TOL)


def test_decoding_with_left_padding():
    q, k, v = qkv(t=10)
    valid = jnp.stack([jnp.ones(10, bool), jnp.arange(10) >= 3])
    full = linear_attention(q, k, v, mask=valid[:, None, None, :], causal=True, chunk=4)
    got, _, _ = _decode(q, k, v, [6, 1, 1, 1, 1], key_valid=valid)
    np.testing.assert_allclose(got, full, **TOL)


def test_errors():
    q, k, v = qkv(t=6)
    with pytest.raises(UserError, match="key-padding masks only.*attention='softmax'"):
        linear_attention(q, k, v, mask=jnp.tril(jnp.ones((6, 6), bool)))
    with pytest.raises(UserError, match="key-padding masks only"):
        linear_attention(q, k, v, mask=jnp.ones((2, 6), bool))       # (B, S): use (B, 1, 1, S)
    q2, k2, v2 = qkv(t=4, s=6)
    with pytest.raises(UserError, match=r"needs as many queries as keys \(T == S\)"):
        linear_attention(q2, k2, v2, causal=True)
    state, norm = init_linear_state(2, 2, 8, 4)
    with pytest.raises(UserError, match="cache must be state"):
        linear_attention_step(q, k, v, state, norm)


def test_causal_memory_grows_linearly():
    """Forward + backward of the chunked scan: compiled temp memory about doubles with T."""
    def temp_bytes(t):
        q, k, v = (jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32) for _ in range(3))

        def loss(q, k, v):
            return jnp.sum(linear_attention(q, k, v, causal=True, chunk=128))

        fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return fn.lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(2048), temp_bytes(4096)
    assert large / small < 2.3, (small, large)
