"""Linear attention (Katharopoulos et al. 2020, "Transformers are RNNs") as pure functions.

The softmax kernel exp(q·k) is replaced by a positive feature map φ(x) = elu(x) + 1, so
the attention of query i over its allowed keys j factorises:

  out_i = φ(q_i)ᵀ Σ_j φ(k_j) v_jᵀ / (φ(q_i)ᵀ Σ_j φ(k_j) + eps)

Shape legend (as in ``attention_base.py``): B batch, T query length, S key length,
N query heads, K key/value heads, G = N / K query heads per kv head (head n = k * G + g,
as ``group_heads``), H head dim, V the value head dim (Hv); inside a chunk Q and C are
the query and key positions of the chunk.

* Bidirectional: the sums run over all (unmasked) keys: one state KV = Σ φ(k) vᵀ
  (B, K, H, V) and normaliser z = Σ φ(k) (B, K, H), so time and memory are O(T + S);
  no (T, S) matrix is ever formed.
* Causal (T == S): query i sums over keys j <= i. The sequence is cut into chunks of C
  positions and ``lax.scan`` carries (state, norm) from chunk to chunk; inside a chunk
  the causal part is the masked (C, C) product (φ(Q)φ(K)ᵀ ⊙ tril) V (its row sums for
  the normaliser), plus φ(Q)·state from the earlier chunks. Memory is O(T), also under
  autodiff: the scan saves one carry per chunk, and the backward pass recomputes each
  chunk's (C, C) scores instead of storing them.
* Decoding: the causal sums are a recurrence, so (state, norm) is a constant-size cache:
  :func:`linear_attention_step` appends T >= 1 new positions (a prompt prefill is one
  call, then one token per call) and gives what the full causal pass gives.

Masks: only key masks (1/True = may attend), broadcastable to (B, 1|N, 1, S); a masked
key contributes nothing (φ(k) and v are zeroed). A row without any allowed key gives
0 (the softmax paths give the mean of V). A general (T, S) mask would need the O(T·S)
weights, which linear attention exists to avoid: use softmax attention for it.

All the math is fp32 (``precision`` is passed to every einsum); the output is in v's
dtype.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..errors import UserError
from .attention_base import check_broadcast, check_qkv, pad_axis
from .masks import as_4d

Array = jax.Array

DEFAULT_CHUNK = 64      # 64 beat 128 by 1.3x at T = 16k (docs/performance.md, 2026-12-02)


def feature_map(x: Array) -> Array:
    """φ(x) = elu(x) + 1 in fp32: positive, so the normaliser never vanishes."""
    return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def init_linear_state(batch: int, kv_heads: int, head_dim: int, value_dim: int,
                      dtype: Any = jnp.float32) -> tuple[Array, Array]:
    """Empty decoding cache: state (B, K, H, V) = Σ φ(k) vᵀ and norm (B, K, H) = Σ φ(k)."""
    return (jnp.zeros((batch, kv_heads, head_dim, value_dim), dtype),
            jnp.zeros((batch, kv_heads, head_dim), dtype))


def _key_mask(mask: Array | None, b: int, t: int, s: int, n: int) -> Array | None:
    """A key mask as (B|1, S, 1|N) bool; any other mask is a UserError."""
    if mask is None:
        return None
    lifted = as_4d(mask, "mask")
    if lifted.shape[2] != 1:
        read_as = " (a 2-D mask reads as (T, S))" if jnp.ndim(mask) == 2 else ""
        raise UserError(
            f"linear attention takes key-padding masks only, of shape (B|1, 1|N, 1, S) "
            f"(a (B, S) padding mask as (B, 1, 1, S)); got a mask of shape {jnp.shape(mask)}"
            f"{read_as}. A general (T, S) mask would need the O(T·S) attention weights that "
            "linear attention avoids: use softmax attention (attention='softmax') "
            "for it")
    mask = check_broadcast(lifted, "mask", (b, n, t, s))
    return jnp.broadcast_to(mask[:, :, 0], mask.shape[:2] + (s,)).astype(bool).transpose(0, 2, 1)


def _prepare(q: Array, k: Array, v: Array, key_ok: Array | None):
    """φ(q) (B, T, K, G, H), masked φ(k) (B, S, K, H), masked fp32 v (B, S, K, V).

    A per-query-head key mask (B, S, N) with K < N repeats k and v to N kv heads (G = 1).
    """
    n, kh = q.shape[2], k.shape[2]
    if key_ok is not None and key_ok.shape[2] == n and kh != n:
        k, v = jnp.repeat(k, n // kh, axis=2), jnp.repeat(v, n // kh, axis=2)
        kh = n
    kf, vf = feature_map(k), v.astype(jnp.float32)
    if key_ok is not None:
        kf = jnp.where(key_ok[..., None], kf, 0.0)
        vf = jnp.where(key_ok[..., None], vf, 0.0)
    qf = feature_map(q).reshape(q.shape[0], q.shape[1], kh, n // kh, q.shape[3])
    return qf, kf, vf


def _bidirectional(qf: Array, kf: Array, vf: Array, eps: float, precision) -> Array:
    """(B, T, K, G, V) fp32 from one state over all keys: O(T + S)."""
    ein = dict(precision=precision, preferred_element_type=jnp.float32)
    kv = jnp.einsum("BSKH,BSKV->BKHV", kf, vf, **ein)
    z = jnp.sum(kf, axis=1)                                                  # (B, K, H)
    num = jnp.einsum("BTKGH,BKHV->BTKGV", qf, kv, **ein)
    den = jnp.einsum("BTKGH,BKH->BTKG", qf, z, **ein)
    return num / (den[..., None] + eps)


def _to_chunks(x: Array, c: int) -> Array:
    """(B, nc * C, ...) -> (nc, B, C, ...): the scan's leading axis."""
    x = x.reshape(x.shape[0], x.shape[1] // c, c, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _causal_chunks(qf: Array, kf: Array, vf: Array, state: Array, norm: Array, *,
                   chunk: int, eps: float, precision) -> tuple[Array, tuple[Array, Array]]:
    """Causal linear attention from an initial carry: (B, T, K, G, V) fp32 and the final
    (state (B, K, H, V), norm (B, K, H)) in fp32, which then also sum these T keys.

    T is padded to a multiple of the chunk C = min(chunk, T); padded keys are zero, so
    they change neither the real rows nor the final carry.
    """
    if chunk < 1:
        raise UserError(f"chunk must be >= 1, got chunk={chunk}")
    t = qf.shape[1]
    c = min(chunk, t)
    tp = -(-t // c) * c
    xs = tuple(_to_chunks(pad_axis(x, 1, tp, keep_broadcast=False), c) for x in (qf, kf, vf))
    tril = jnp.tril(jnp.ones((c, c), jnp.float32))
    ein = dict(precision=precision, preferred_element_type=jnp.float32)

    def step(carry, blk):
        st, nm = carry
        q_c, k_c, v_c = blk
        scores = jnp.einsum("BQKGH,BCKH->BKGQC", q_c, k_c, **ein) * tril
        num = (jnp.einsum("BKGQC,BCKV->BQKGV", scores, v_c, **ein)
               + jnp.einsum("BQKGH,BKHV->BQKGV", q_c, st, **ein))
        den = (jnp.sum(scores, axis=-1).transpose(0, 3, 1, 2)
               + jnp.einsum("BQKGH,BKH->BQKG", q_c, nm, **ein))
        st = st + jnp.einsum("BCKH,BCKV->BKHV", k_c, v_c, **ein)
        nm = nm + jnp.sum(k_c, axis=1)
        return (st, nm), num / (den[..., None] + eps)

    carry = (state.astype(jnp.float32), norm.astype(jnp.float32))
    # the backward pass recomputes each chunk's (C, C) scores from its inputs and the carry
    # instead of saving them: 20% less memory at 64k, ~5% more time (docs/performance.md)
    carry, out = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), carry, xs)
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(out.shape[0], tp, *out.shape[3:])[:, :t], carry


def linear_attention(q: Array, k: Array, v: Array, *, mask: Array | None = None,
                     causal: bool = False, chunk: int = DEFAULT_CHUNK, eps: float = 1e-6,
                     precision=None) -> Array:
    """Linear attention: q (B, T, N, H), k (B, S, K, H), v (B, S, K, V) -> (B, T, N, V).

    ``mask``: a key mask broadcastable to (B, 1|N, 1, S), 1 = may attend; anything else
    raises UserError. ``causal`` needs T == S and runs the chunked scan (``chunk``
    positions per step); otherwise one O(T + S) pass. ``eps`` keeps the normaliser away
    from 0 (rows whose keys are all masked give 0). Output in v's dtype.
    """
    b, t, s, n, _, _ = check_qkv(q, k, v)
    if causal and t != s:
        raise UserError(
            f"causal linear attention needs as many queries as keys (T == S); got T={t}, S={s}. "
            "To attend after a summarised prefix, carry (state, norm) with "
            "linear_attention_step")
    qf, kf, vf = _prepare(q, k, v, _key_mask(mask, b, t, s, n))
    if causal:
        state, norm = init_linear_state(b, kf.shape[2], kf.shape[3], vf.shape[3])
        out, _ = _causal_chunks(qf, kf, vf, state, norm, chunk=chunk, eps=eps,
                                precision=precision)
    else:
        out = _bidirectional(qf, kf, vf, eps, precision)
    return out.reshape(b, t, n, vf.shape[3]).astype(v.dtype)


def linear_attention_step(q: Array, k: Array, v: Array, state: Array, norm: Array, *,
                          key_valid: Array | None = None, eps: float = 1e-6,
                          precision=None) -> tuple[Array, Array, Array]:
    """Decode T >= 1 new positions after those summarised in (state, norm).

    q (B, T, N, H), k (B, T, K, H), v (B, T, K, V); state (B, K, H, V), norm (B, K, H)
    from :func:`init_linear_state` or the previous call. The new positions attend
    causally among themselves and to everything before, so a prompt prefill followed by
    one call per token gives ``linear_attention(..., causal=True)``. ``key_valid`` (B, T)
    bool marks the new keys that count (False: left padding). Returns (out (B, T, N, V)
    in v's dtype, state, norm) with the new keys added, in the cache's dtype.
    """
    b, t, s, n, kh, h = check_qkv(q, k, v)
    if t != s:
        raise UserError(f"linear_attention_step appends the same T positions to queries and "
                        f"keys; got query {q.shape}, key {k.shape}")
    hv = v.shape[3]
    if state.shape != (b, kh, h, hv) or norm.shape != (b, kh, h):
        raise UserError(f"linear attention cache must be state (B, K, H, V) = {(b, kh, h, hv)} "
                        f"and norm (B, K, H) = {(b, kh, h)}; got {state.shape}, {norm.shape}")
    key_ok = None
    if key_valid is not None:
        if jnp.shape(key_valid) != (b, t):
            raise UserError(f"key_valid must be (B, T) = {(b, t)}; got {jnp.shape(key_valid)}")
        key_ok = jnp.asarray(key_valid).astype(bool)[:, :, None]
    qf, kf, vf = _prepare(q, k, v, key_ok)
    out, (new_state, new_norm) = _causal_chunks(qf, kf, vf, state, norm, chunk=DEFAULT_CHUNK,
                                                eps=eps, precision=precision)
    return (out.reshape(b, t, n, hv).astype(v.dtype), new_state.astype(state.dtype),
            new_norm.astype(norm.dtype))
