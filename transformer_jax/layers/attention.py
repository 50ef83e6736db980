"""Scaled dot-product attention (pure functions) and the MultiHeadAttention module.

Shape legend (used in every einsum of the library):
  B batch, T query length, S key length, D model width, N query heads,
  K key/value heads (grouped-query attention: N = K * G), G query heads per kv head,
  H head dim.

``dot_product_attention`` computes ``softmax(Q K^T / sqrt(H) + bias) V`` with the seeds'
mask convention (1/True = may attend). Blocked logits are set to the most negative fp32
number rather than -inf, so a row whose keys are all blocked gives the mean of V instead
of NaN (PyTorch gives NaN there). Logits and softmax are always fp32, also under bf16.

One signature, several implementations (``implementation=``):
  * ``"xla"``     the plain reference: materialises the (B, N, T, S) weights (causal
                  attention in query blocks that skip the keys past the diagonal);
                  supports everything (dropout, returned weights).
  * ``"jax"``     ``jax.nn.dot_product_attention``: cuDNN flash attention on a GPU when cuDNN
                  can run the call (fp16/bf16, head dim a multiple of 8 and <= 128, or 256
                  on Hopper, ...), XLA's path otherwise. No dropout, no returned weights.
  * ``"cudnn"``   the same, but insists on cuDNN: a ValueError lists what prevents it.
  * ``"chunked"`` memory-efficient exact attention in plain XLA: queries in blocks, keys in
                  blocks with an online softmax; with ``causal`` the key blocks past the
                  diagonal are skipped. A custom VJP saves only the output and the softmax
                  statistics and recomputes the probabilities block by block in the
                  backward pass (FlashAttention-2), so memory grows linearly with T and S.
                  Supports dropout (an independent stream per block pair), not returned
                  weights.
  * ``"pallas"``  the same algorithm as Pallas kernels (``flash_attention.py``): Triton on
                  GPU, Mosaic on TPU, interpret mode (slow, for tests) elsewhere. No dropout,
                  no returned weights.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .dense import Dense, Initializer, canonical_dtype, default_kernel_init
from .embeddings import apply_rope
from .masks import as_4d, causal_mask, combine_masks

Array = jax.Array

IMPLEMENTATIONS = ("xla", "jax", "cudnn", "chunked", "pallas")
_NEG = float(jnp.finfo(jnp.float32).min)


# ----------------------------------------------------------------------------- checks

def _check_qkv(q: Array, k: Array, v: Array) -> tuple[int, int, int, int, int, int]:
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, T|S, N|K, H); got shape {x.shape}")
    b, t, n, h = q.shape
    _, s, kh, hk = k.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: query {q.shape}, key {k.shape}, value {v.shape}")
    if hk != h:
        raise ValueError(f"query head dim {h} != key head dim {hk} (query {q.shape}, key {k.shape}); "
                         "queries and keys must share the head dim")
    if v.shape[1] != s or v.shape[2] != kh:
        raise ValueError(f"key {k.shape} and value {v.shape} must agree on (B, S, K)")
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh} "
                         "(grouped-query attention)")
    return b, t, s, n, kh, h


def _check_broadcast(x: Array | None, name: str, shape: tuple[int, int, int, int]) -> Array | None:
    """Lift a 2/3/4-D mask or bias to 4-D and check it broadcasts to (B, N, T, S)."""
    if x is None:
        return None
    x = as_4d(x, name)
    if any(d not in (1, want) for d, want in zip(x.shape, shape)):
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to the attention "
                         f"logits (B, N, T, S) = {shape}")
    return x


def _group_heads(x: Array, k_heads: int, groups: int) -> Array:
    """(b, n|1, T, S) -> (b, K|1, G|1, T, S) with head n = k * G + g (HF's repeat_kv order)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], k_heads, groups, *x.shape[2:])


# ----------------------------------------------------------------------------- reference

# Causal attention in the reference path splits the queries into blocks; block i attends
# only to the keys up to its last row, so the score and PV matmuls skip most of the upper
# triangle (25% fewer attention FLOPs at 2 blocks, 37.5% at 4, 44% at 8). Each block still
# gets one exact softmax over all its keys (no online rescaling), so the result equals the
# whole-square computation up to fp32 rounding. Blocks of 64 queries, at most 8 blocks
# (unrolled): measured fastest here for T = 128 ... 1024 (fwd+bwd, 1.3-1.6x the whole
# square); a ``q_chunk`` argument overrides it.
XLA_CAUSAL_MIN_BLOCK = 64
XLA_CAUSAL_MAX_BLOCKS = 8


def _causal_query_block(t: int) -> int:
    return max(XLA_CAUSAL_MIN_BLOCK, -(-t // XLA_CAUSAL_MAX_BLOCKS))


def _block(x: Array | None, axis: int, start, size: int) -> Array | None:
    """``size`` entries of ``axis`` from ``start``; None and broadcast (size-1) axes pass."""
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _causal_blocks(t: int, s: int, block: int) -> list[tuple[int, int, int]]:
    """(first query, end query, number of keys) of each query block; keys are top-left
    aligned (query i sees keys j <= i), so block [a, e) needs keys [0, min(e, s))."""
    return [(a, min(a + block, t), min(a + block, t, s)) for a in range(0, t, block)]


def _unnormalised_softmax(logits, bias, mask, dropout_rate, dropout_rng):
    """exp(logits + bias - max) with blocked entries at 0, dropout applied, and the row sums
    (before dropout). The normalisation is left to the caller's output: exp goes into the
    PV matmul and the row sums divide its (B, K, G, T, Hv) result, which saves a pass over
    the (B, K, G, T, S) weights forward and backward."""
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, _NEG)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.exp(logits - top)                                                 # fp32
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    return p, denom


# The two matmuls of the reference path, with their gradients' orientation fixed. Reverse
# mode differentiates ``P V`` into ``dV = P^T dO`` and ``Q K^T`` into ``dK = dS^T Q``:
# contractions over the query rows, the leading axis of both operands. XLA:CPU hands those
# to Eigen, which ran these small batched matmuls (48 of (S, 64) x (64, 64) per query block
# of the GPT 6L/384 step) barely faster on two cores than on one (S=256: 62 vs 57
# GFLOP/s; YNNPACK's (S, R) x (R, H) form 102 vs 77). Here the JVP of each matmul
# writes that term with the (S, R) operand transposed behind an ``optimization_barrier``,
# so that the transposed matrix is materialised once and the gradient is an ordinary
# (S, R) x (R, H) product, which runs in YNNPACK. Train steps, alternating medians against
# the plain einsums (2026-11-30): GPT 6L/384 1,049 -> 1,035 ms (a prototype: 1,068 ->
# 1,043), GPT 4L/128 187 -> 178 ms; BERT 6L/384, T5 4+4L and ViT 12L within +-0.6%.
# GPT at T=512 and T=1024 (query blocks of 64 and 128 rows) 1% and 1.5% faster. What it
# costs: attention forward + backward timed alone got slower at most shapes (B=1, N=4,
# T=2048 causal 76 -> 82 ms; B=16, N=6, T=128 25 -> 28 ms) and the plain path's temporary
# memory grew ~25% (T=2048: 97 -> 121 MiB), as the transposed copies are extra buffers;
# inside the train steps above the step got no slower. Forward-mode tangents use the same
# rule; values and tangents are the plain products'. Other backends pay the same extra
# transposes (the barrier only keeps XLA from folding them into the dots).

def _matmul(precision):
    return functools.partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)


def _t(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _scores(q: Array, k: Array, precision) -> Array:
    """Logits (B, K, R, S) fp32 of queries (B, K, R, H) against keys (B, K, S, H)."""
    return _matmul(precision)("BKRH,BKSH->BKRS", q, k)


@_scores.defjvp
def _scores_jvp(precision, primals, tangents):
    (q, k), (dq, dk) = primals, tangents
    dot = _matmul(precision)
    # the dk term as (B, K, S, R), transposed after the barrier: its transpose in reverse
    # mode transposes the (R, S) cotangent first, then contracts it with q as (S, R) x (R, H)
    dk_term = _t(jax.lax.optimization_barrier(dot("BKSH,BKRH->BKSR", dk, q)))
    return _scores(q, k, precision), dot("BKRH,BKSH->BKRS", dq, k) + dk_term


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _weigh_values(p: Array, v: Array, precision) -> Array:
    """Weights (B, K, R, S) times values (B, K, S, Hv): (B, K, R, Hv) fp32."""
    return _matmul(precision)("BKRS,BKSH->BKRH", p, v)


@_weigh_values.defjvp
def _weigh_values_jvp(precision, primals, tangents):
    (p, v), (dp, dv) = primals, tangents
    dot = _matmul(precision)
    # p transposed behind the barrier (computed with the forward pass, kept for reverse
    # mode): XLA folds the outer transpose into the dot, so dV = (p^T) dO reads p^T rows
    p_rows = _t(jax.lax.optimization_barrier(_t(p)))
    tangent = dot("BKRS,BKSH->BKRH", dp, v) + dot("BKRS,BKSH->BKRH", p_rows, dv)
    return _weigh_values(p, v, precision), tangent


def _attend_rows(precision, qt, kt, vt, scale, bias, mask, dropout_rate, dropout_rng):
    """Queries (B, K, G, T, H) over keys (B, K, S, H) and values (B, K, S, Hv): returns the
    unnormalised weights p and row sums ``_unnormalised_softmax`` gives, and the output
    (B, K, G, T, Hv). Both matmuls see the G query groups folded into their rows,
    (B, K, G*T, .): XLA:CPU ran a causal layer's attention forward + backward (B=8, N=6,
    T=256, H=64) ~1.5x faster this way than over (B, K, G, T, .) operands, G = 1 included."""
    b, kh, g, t, h = qt.shape
    s, hv = kt.shape[2], vt.shape[3]
    logits = _scores(qt.reshape(b, kh, g * t, h), kt, precision).reshape(b, kh, g, t, s)
    p, denom = _unnormalised_softmax(logits * scale, bias, mask, dropout_rate, dropout_rng)
    out = _weigh_values(p.astype(vt.dtype).reshape(b, kh, g * t, s), vt, precision)
    return p, denom, out.reshape(b, kh, g, t, hv) / denom


def _xla_attention(q, k, v, mask, bias, scale, causal, dropout_rate, dropout_rng,
                   deterministic, precision, return_weights, query_block=None):
    """The reference path. Returns (out (B, T, N, Hv), weights (B, N, T, S) or None);
    ``weights`` are the normalised ones, dropout included.

    Layout: queries go to (B, K, G, T, H), keys and values to (B, K, S, H), and both
    matmuls run over (B, K, G*T, .) rows (``_attend_rows``): leading batch dimensions and
    rank-4 operands. (XLA:CPU ran the contractions with the heads between T and H about
    1.3x slower, and over rank-5 (B, K, G, T, .) operands ~1.3x slower at 2k-4k tokens,
    forward + backward.) Causal attention is computed in blocks of ``query_block`` queries
    unless the weights are returned. A single query row (a KV-cache decode step) keeps the (B, T, K, G) order:
    its transposes would be free, but XLA:CPU then lays the (B, S, K, H) cache out worse
    for the two dots (~10% fewer tokens/s at batch 16).
    """
    b, t, s, n, kh, h = _check_qkv(q, k, v)
    g = n // kh
    hv = v.shape[-1]
    user_mask = mask
    mask = None if mask is None else _group_heads(mask, kh, g)                # (B, K, G, T, S)
    bias = None if bias is None else _group_heads(bias, kh, g)
    # the mask of the whole (T, S) square, for the paths that compute all of it
    square_mask = combine_masks(mask, causal_mask(t, s)[:, :, None]) if causal else mask
    use_dropout = not deterministic and dropout_rate > 0.0
    rng = dropout_rng if use_dropout else None
    dot = _matmul(precision)

    if t == 1:
        logits = dot("BTKGH,BSKH->BKGTS", q.reshape(b, t, kh, g, h), k) * scale
        p, denom = _unnormalised_softmax(logits, bias, square_mask,
                                         dropout_rate, rng)
        # v as the first operand: XLA:CPU then lays a (B, S, K, H) KV cache out as
        # (B, K, S, H) (contiguous H rows) instead of (B, K, H, S), a 2.5x cheaper copy per
        # decoded token.
        out = dot("BSKH,BKGTS->BTKGH", v, p.astype(v.dtype)) / jnp.moveaxis(denom, 3, 1)
        weights = (p / denom).reshape(b, n, t, s) if return_weights else None
        return out.reshape(b, t, n, hv).astype(v.dtype), weights

    qt = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)                   # (B, K, G, T, H)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)                     # (B, K, S, H/Hv)
    query_block = query_block or _causal_query_block(t)
    blocked = causal and not return_weights and t > query_block
    if not blocked:
        p, denom, out = _attend_rows(precision, qt, kt, vt, scale, bias, square_mask,
                                     dropout_rate, rng)
        weights = (p / denom).reshape(b, n, t, s) if return_weights else None
    else:
        outs = []
        for i, (a, e, keys) in enumerate(_causal_blocks(t, s, query_block)):
            blk_mask = combine_masks(_block(_block(mask, 3, a, e - a), 4, 0, keys),
                                     causal_mask(e - a, keys, offset=a)[:, :, None])
            blk_bias = _block(_block(bias, 3, a, e - a), 4, 0, keys)
            outs.append(_attend_rows(precision, qt[:, :, :, a:e], kt[:, :, :keys], vt[:, :, :keys],
                                     scale, blk_bias, blk_mask, dropout_rate,
                                     None if rng is None else jax.random.fold_in(rng, i))[2])
        out, weights = jnp.concatenate(outs, axis=3), None
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv).astype(v.dtype)
    if blocked and user_mask is not None:
        # a row that the mask and causality leave without keys averages V over all S keys
        # in the whole-square computation; its block saw only the keys up to the block end
        out = _fill_empty_rows(out, v, user_mask, t, s)
    return out, weights


# ----------------------------------------------------------------------------- chunked

def _pad_axis(x: Array, axis: int, size: int, value) -> Array:
    extra = size - x.shape[axis]
    if extra == 0 or x.shape[axis] == 1:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def _empty_rows(mask: Array, t: int, s: int) -> Array:
    """(Bm, Nm, T) bool: rows in which ``mask`` and the causal mask leave no key at all."""
    mask = jnp.broadcast_to(mask, mask.shape[:3] + (s,)).astype(bool)
    if mask.shape[2] == 1:     # one key mask for every query: linear in T + S
        first = jnp.argmax(mask[:, :, 0], axis=-1)[..., None]      # first allowed key
        has_any = jnp.any(mask[:, :, 0], axis=-1)[..., None]
        return ~(has_any & (first <= jnp.arange(t)))
    return ~jnp.any(mask & causal_mask(t, s)[0, 0], axis=-1)


def _fill_empty_rows(out: Array, value: Array, mask: Array, t: int, s: int) -> Array:
    """Give rows without any allowed key (causal + mask) the mean of V, as ``"xla"`` does.

    Block-skipping implementations never visit the key blocks past the causal diagonal,
    so in such (degenerate) rows they would average over the visited keys only.
    """
    n, kh = out.shape[2], value.shape[2]
    empty = _empty_rows(mask, t, s).transpose(0, 2, 1)[..., None]           # (Bm, T, Nm, 1)
    mean_v = jnp.mean(value.astype(jnp.float32), axis=1)                     # (B, K, Hv)
    mean_v = jnp.repeat(mean_v, n // kh, axis=1)[:, None]                    # (B, 1, N, Hv)
    return jnp.where(empty, mean_v.astype(out.dtype), out)


@dataclasses.dataclass(frozen=True)
class _Chunking:
    """Static settings of the chunked kernel (hashable: a custom_vjp non-diff argument)."""
    scale: float
    causal: bool
    t: int
    s: int
    qc: int
    kc: int
    nq: int
    nk: int
    dropout_rate: float        # 0.0: no dropout
    skip: bool                 # skip key blocks past the causal diagonal
    precision: Any


def _chunk_upper(c: _Chunking, qi):
    """Key blocks visited by query block ``qi``: all, or up to the causal diagonal."""
    if not (c.causal and c.skip):
        return c.nk
    return jnp.minimum(c.nk, (qi * c.qc + c.qc + c.kc - 1) // c.kc)


def _chunk_lower(c: _Chunking, ki):
    """First query block that sees key block ``ki``."""
    return (ki * c.kc) // c.qc if (c.causal and c.skip) else 0


def _chunk_scores(c: _Chunking, q_blk, k_blk, qi, ki, bias, mask):
    """fp32 logits (B, K, G, qc, kc) of one block pair, disallowed entries at NEG.

    Returns (logits, allowed, key_ok); ``key_ok`` (kc,) marks real (unpadded) keys, which
    alone enter the softmax sum, also in rows whose real keys are all masked.
    """
    kh, g = k_blk.shape[2], q_blk.shape[3]
    logits = jnp.einsum("BQKGH,BCKH->BKGQC", q_blk, k_blk, precision=c.precision,
                        preferred_element_type=jnp.float32) * c.scale
    if bias is not None:
        blk = _block(_block(bias, 2, qi * c.qc, c.qc), 3, ki * c.kc, c.kc)
        logits = logits + _group_heads(blk, kh, g).astype(jnp.float32)
    q_pos = qi * c.qc + jnp.arange(c.qc)
    k_pos = ki * c.kc + jnp.arange(c.kc)
    key_ok = k_pos < c.s
    allowed = key_ok[None, :]
    if c.causal:
        allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
    allowed = allowed[None, None, None]
    if mask is not None:
        blk = _block(_block(mask, 2, qi * c.qc, c.qc), 3, ki * c.kc, c.kc)
        allowed = allowed & _group_heads(blk, kh, g)
    return jnp.where(allowed, logits, _NEG), allowed, key_ok


def _chunk_keep(c: _Chunking, rng, qi, ki, shape):
    """Dropout keep-mask of block pair (qi, ki): the same stream forward and backward."""
    key = jax.random.fold_in(jax.random.fold_in(rng, qi), ki)
    return jax.random.bernoulli(key, 1.0 - c.dropout_rate, shape)


def _chunk_forward(c: _Chunking, q, k, v, bias, mask, rng):
    """q (B, Tp, K, G, H), k (B, Sp, K, H), v (B, Sp, K, Hv) -> out (B, Tp, K, G, Hv) and
    the softmax statistics m, l (nq, B, K, G, qc) per query block."""
    b, _, kh, g, _ = q.shape
    hv = v.shape[-1]

    def query_block(qi):
        q_blk = jax.lax.dynamic_slice_in_dim(q, qi * c.qc, c.qc, 1)

        def key_step(ki, carry):
            acc, m, l = carry                         # (B,K,G,qc,Hv), (B,K,G,qc), (B,K,G,qc)
            k_blk = jax.lax.dynamic_slice_in_dim(k, ki * c.kc, c.kc, 1)
            logits, _, key_ok = _chunk_scores(c, q_blk, k_blk, qi, ki, bias, mask)
            m_new = jnp.maximum(m, logits.max(axis=-1))
            p = jnp.where(key_ok, jnp.exp(logits - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(axis=-1)
            if c.dropout_rate:
                keep = _chunk_keep(c, rng, qi, ki, p.shape)
                p = jnp.where(keep, p / (1.0 - c.dropout_rate), 0.0)
            v_blk = jax.lax.dynamic_slice_in_dim(v, ki * c.kc, c.kc, 1)
            pv = jnp.einsum("BKGQC,BCKH->BKGQH", p.astype(v.dtype), v_blk, precision=c.precision,
                            preferred_element_type=jnp.float32)
            return acc * correction[..., None] + pv, m_new, l

        init = (jnp.zeros((b, kh, g, c.qc, hv), jnp.float32),
                jnp.full((b, kh, g, c.qc), _NEG, jnp.float32),
                jnp.zeros((b, kh, g, c.qc), jnp.float32))
        acc, m, l = jax.lax.fori_loop(0, _chunk_upper(c, qi), key_step, init)
        return (acc / l[..., None]).astype(v.dtype), m, l

    out, m, l = jax.lax.map(query_block, jnp.arange(c.nq))          # out (nq, B, K, G, qc, Hv)
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, c.nq * c.qc, kh, g, hv)
    return out, m, l


def _chunk_backward(c: _Chunking, q, k, v, bias, mask, rng, out, m, l, d_out):
    """FlashAttention-2 style backward: probabilities recomputed from (m, l), one pass over
    query blocks for dQ, one over key blocks for dK/dV, one more for dBias (only when a
    bias is given; XLA removes it when that gradient is unused)."""
    b, tp, kh, g, h = q.shape
    sp, hv = k.shape[1], v.shape[-1]
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # (B,Tp,K,G)
    delta = delta.reshape(b, c.nq, c.qc, kh, g).transpose(1, 0, 3, 4, 2)           # (nq,B,K,G,qc)

    def pair(qi, ki, q_blk, k_blk, v_blk, do_blk):
        """(probabilities after dropout, dLogits) of block pair (qi, ki)."""
        logits, allowed, key_ok = _chunk_scores(c, q_blk, k_blk, qi, ki, bias, mask)
        p = jnp.exp(logits - m[qi][..., None]) / l[qi][..., None]
        p = jnp.where(key_ok, p, 0.0)
        dp = jnp.einsum("BQKGH,BCKH->BKGQC", do_blk, v_blk, precision=c.precision,
                        preferred_element_type=jnp.float32)
        p_used = p
        if c.dropout_rate:
            keep = _chunk_keep(c, rng, qi, ki, p.shape)
            p_used = jnp.where(keep, p / (1.0 - c.dropout_rate), 0.0)
            dp = jnp.where(keep, dp / (1.0 - c.dropout_rate), 0.0)
        ds = jnp.where(allowed, p * (dp - delta[qi][..., None]), 0.0)
        return p_used, ds

    def q_slices(qi):
        return (jax.lax.dynamic_slice_in_dim(q, qi * c.qc, c.qc, 1),
                jax.lax.dynamic_slice_in_dim(d_out, qi * c.qc, c.qc, 1))

    def kv_slices(ki):
        return (jax.lax.dynamic_slice_in_dim(k, ki * c.kc, c.kc, 1),
                jax.lax.dynamic_slice_in_dim(v, ki * c.kc, c.kc, 1))

    def dq_block(qi):
        q_blk, do_blk = q_slices(qi)

        def step(ki, dq):
            k_blk, v_blk = kv_slices(ki)
            _, ds = pair(qi, ki, q_blk, k_blk, v_blk, do_blk)
            return dq + jnp.einsum("BKGQC,BCKH->BQKGH", ds.astype(k.dtype), k_blk,
                                   precision=c.precision, preferred_element_type=jnp.float32)

        dq = jax.lax.fori_loop(0, _chunk_upper(c, qi), step, jnp.zeros(q_blk.shape, jnp.float32))
        return (dq * c.scale).astype(q.dtype)

    def dkdv_block(ki):
        k_blk, v_blk = kv_slices(ki)

        def step(qi, carry):
            dk, dv = carry
            q_blk, do_blk = q_slices(qi)
            p, ds = pair(qi, ki, q_blk, k_blk, v_blk, do_blk)
            dv = dv + jnp.einsum("BKGQC,BQKGH->BCKH", p.astype(d_out.dtype), do_blk,
                                 precision=c.precision, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("BKGQC,BQKGH->BCKH", ds.astype(q.dtype), q_blk,
                                 precision=c.precision, preferred_element_type=jnp.float32)
            return dk, dv

        init = (jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32))
        dk, dv = jax.lax.fori_loop(_chunk_lower(c, ki), c.nq, step, init)
        return (dk * c.scale).astype(k.dtype), dv.astype(v.dtype)

    dq = jax.lax.map(dq_block, jnp.arange(c.nq))                    # (nq, B, qc, K, G, H)
    dq = dq.swapaxes(0, 1).reshape(b, tp, kh, g, h)
    dk, dv = jax.lax.map(dkdv_block, jnp.arange(c.nk))              # (nk, B, kc, K, H|Hv)
    dk = dk.swapaxes(0, 1).reshape(b, sp, kh, h)
    dv = dv.swapaxes(0, 1).reshape(b, sp, kh, hv)

    d_bias = None
    if bias is not None:
        bb, nb, tb, sb = bias.shape

        def dbias_block(qi):
            q_blk, do_blk = q_slices(qi)
            rows = c.qc if tb > 1 else 1
            cols = sp if sb > 1 else 1

            def step(ki, acc):
                k_blk, v_blk = kv_slices(ki)
                _, ds = pair(qi, ki, q_blk, k_blk, v_blk, do_blk)
                ds = ds.reshape(b, kh * g, c.qc, c.kc)               # head n = k * G + g
                axes = tuple(a for a, size in enumerate((bb, nb, tb, sb)) if size == 1)
                ds = jnp.sum(ds, axis=axes, keepdims=True)
                if sb == 1:
                    return acc + ds
                return jax.lax.dynamic_update_slice_in_dim(acc, ds, ki * c.kc, 3)

            init = jnp.zeros((bb, nb, rows, cols), jnp.float32)
            return jax.lax.fori_loop(0, _chunk_upper(c, qi), step, init)

        d_bias = jax.lax.map(dbias_block, jnp.arange(c.nq))         # (nq, Bb, Nb, qc|1, Sp|1)
        if tb > 1:
            d_bias = d_bias.transpose(1, 2, 0, 3, 4).reshape(bb, nb, c.nq * c.qc, -1)
        else:
            d_bias = d_bias.sum(axis=0)
        d_bias = d_bias.astype(bias.dtype)
    return dq, dk, dv, d_bias


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _chunked_core(q, k, v, bias, mask, rng, c: _Chunking):
    return _chunk_forward(c, q, k, v, bias, mask, rng)[0]


def _chunked_core_fwd(q, k, v, bias, mask, rng, c):
    out, m, l = _chunk_forward(c, q, k, v, bias, mask, rng)
    return out, (q, k, v, bias, mask, rng, out, m, l)


def _chunked_core_bwd(c, residuals, d_out):
    q, k, v, bias, mask, rng, out, m, l = residuals
    dq, dk, dv, d_bias = _chunk_backward(c, q, k, v, bias, mask, rng, out, m, l, d_out)
    return dq, dk, dv, d_bias, None, None


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def _chunked_attention(q, k, v, mask, bias, scale, causal, dropout_rate, dropout_rng,
                       deterministic, precision, q_chunk, kv_chunk, skip_masked_blocks=True):
    """Exact attention in (q_chunk, kv_chunk) blocks with an online softmax (module doc).

    ``skip_masked_blocks=False`` visits every key block also under ``causal`` (the blocks
    past the diagonal then contribute exact zeros): a reference for the skipping path.
    """
    b, t, s, n, kh, h = _check_qkv(q, k, v)
    g = n // kh
    qc, kc = min(q_chunk, t), min(kv_chunk, s)
    tp, sp = -(-t // qc) * qc, -(-s // kc) * kc
    use_dropout = (not deterministic) and dropout_rate > 0.0
    c = _Chunking(scale=float(scale), causal=causal, t=t, s=s, qc=qc, kc=kc, nq=tp // qc,
                  nk=sp // kc, dropout_rate=float(dropout_rate) if use_dropout else 0.0,
                  skip=skip_masked_blocks, precision=precision)
    qg = _pad_axis(q, 1, tp, 0).reshape(b, tp, kh, g, h)
    kp, vp = _pad_axis(k, 1, sp, 0), _pad_axis(v, 1, sp, 0)
    mask_p = None if mask is None else _pad_axis(
        _pad_axis(mask.astype(bool), 3, sp, False), 2, tp, True)
    if bias is not None:
        bias = _pad_axis(_pad_axis(bias, 3, sp, 0), 2, tp, 0)
    out = _chunked_core(qg, kp, vp, bias, mask_p, dropout_rng if use_dropout else None, c)
    out = out.reshape(b, tp, n, v.shape[-1])[:, :t]
    if causal and mask is not None:
        out = _fill_empty_rows(out, v, mask, t, s)
    return out


# ----------------------------------------------------------------------------- cudnn

def _cudnn_problems(q: Array, k: Array, v: Array, has_bias_or_mask: bool) -> list[str]:
    """Why cuDNN flash attention (via ``jax.nn.dot_product_attention``) cannot run here."""
    if jax.default_backend() != "gpu":
        return [f"it needs a GPU (the backend is {jax.default_backend()!r})"]
    problems = []
    if q.dtype not in (jnp.float16, jnp.bfloat16) or not q.dtype == k.dtype == v.dtype:
        problems.append(f"it needs fp16/bf16 query, key and value of one dtype (got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}; e.g. a model with dtype='bfloat16')")
    cc = getattr(jax.devices()[0], "compute_capability", None)
    try:
        cc = tuple(int(x) for x in str(cc).split("."))
    except ValueError:
        cc = None
    if cc is not None and cc < (8, 0):
        problems.append(f"it needs compute capability >= 8.0 (Ampere); this GPU has {cc}")
    h_max = 256 if cc is not None and cc >= (9, 0) else 128
    h = q.shape[-1]
    if h % 8 or h > h_max:
        problems.append(f"the head dim must be a multiple of 8 and <= {h_max}; got {h}")
    if v.shape[-1] != h:
        problems.append(f"value head dim {v.shape[-1]} must equal the query/key head dim {h}")
    if has_bias_or_mask and (q.shape[1] % 2 or k.shape[1] % 2):
        problems.append(f"with a bias or mask the lengths must be even (T={q.shape[1]}, "
                        f"S={k.shape[1]}) for its backward pass")
    return problems


def _jax_attention(q, k, v, mask, bias, scale, causal, implementation):
    """``jax.nn.dot_product_attention``: cuDNN when asked (errors naming the problem when it
    cannot run), or, for ``"jax"``, when it can run (XLA's path otherwise)."""
    problems = _cudnn_problems(q, k, v, mask is not None or bias is not None)
    if implementation == "cudnn" and problems:
        raise ValueError("implementation='cudnn' cannot run: " + "; ".join(problems)
                         + ". Use implementation='jax' (cuDNN where possible, XLA otherwise), "
                         "'pallas', 'chunked' or 'xla'")
    use_cudnn = not problems
    b, t, s, n = q.shape[0], q.shape[1], k.shape[1], q.shape[2]
    if use_cudnn:
        # cuDNN takes masks as an additive bias of full (T, S) extent in the input dtype.
        if bias is not None:
            bias = jnp.broadcast_to(bias, bias.shape[:2] + (t, s)).astype(q.dtype)
        if mask is not None:
            mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=None if mask is None else mask.astype(bool), scale=scale,
        is_causal=causal, implementation="cudnn" if use_cudnn else "xla")


# ----------------------------------------------------------------------------- public

def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    implementation: str = "xla",
    precision: Any = None,
    q_chunk: int | None = None,
    kv_chunk: int | None = None,
):
    """``softmax(Q K^T * scale + bias, masked) V`` for every head.

    Args:
      query: (B, T, N, H).  key: (B, S, K, H).  value: (B, S, K, Hv).  N must be a multiple
        of K (grouped-query attention; K = N is ordinary multi-head attention).
      mask: bool/int, broadcastable to (B, N, T, S) (2-D (T, S) and 3-D (B, T, S) are
        accepted); 1 = may attend.
      bias: float, broadcastable to (B, N, T, S), added to the logits (e.g. T5's relative
        position bias or an ALiBi table).
      causal: also apply a causal mask aligned at the top-left (query i sees keys j <= i).
      scale: defaults to 1/sqrt(H).
      dropout_rate, dropout_rng, deterministic: dropout on the attention weights.
      return_weights: also return the (B, N, T, S) fp32 weights (``"xla"`` only).
      implementation: one of ``IMPLEMENTATIONS`` (module docstring).
      q_chunk, kv_chunk: query/key block sizes of ``"chunked"`` (default 512) and of
        ``"pallas"`` (powers of two; default per platform, ``flash_attention.BlockSizes``);
        ``q_chunk`` is also the query block of causal ``"xla"`` attention (default 64, or
        T / 8 beyond T = 512; a value >= T computes the whole (T, S) square).

    Returns:
      (B, T, N, Hv) in value's dtype, or ``(out, weights)`` when ``return_weights``.
    """
    b, t, s, n, _, h = _check_qkv(query, key, value)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"choose one of {IMPLEMENTATIONS}")
    shape = (b, n, t, s)
    mask = _check_broadcast(mask, "mask", shape)
    bias = _check_broadcast(bias, "bias", shape)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    if not deterministic and dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("attention dropout is on (deterministic=False, dropout_rate>0) "
                         "but no dropout_rng was given")

    if implementation == "xla":
        out, weights = _xla_attention(query, key, value, mask, bias, scale, causal, dropout_rate,
                                      dropout_rng, deterministic, precision, return_weights,
                                      q_chunk)
        return (out, weights) if return_weights else out

    if return_weights:
        raise ValueError(f"return_weights=True needs implementation='xla' (the {implementation!r} "
                         "path never materialises the weights)")
    if implementation == "chunked":
        return _chunked_attention(query, key, value, mask, bias, scale, causal, dropout_rate,
                                  dropout_rng, deterministic, precision, q_chunk or 512,
                                  kv_chunk or 512)

    if not deterministic and dropout_rate > 0.0:
        raise ValueError(f"implementation={implementation!r} has no attention dropout; "
                         "use implementation='xla' or 'chunked', or dropout_rate=0")
    if implementation == "pallas":
        from .flash_attention import BlockSizes, flash_attention  # imports this module
        blocks = None
        if q_chunk or kv_chunk:
            blocks = BlockSizes(block_q=q_chunk or 128, block_k=kv_chunk or 128)
        return flash_attention(query, key, value, bias=bias, mask=mask, causal=causal,
                               scale=scale, block_sizes=blocks)
    return _jax_attention(query, key, value, mask, bias, scale, causal, implementation)


# ----------------------------------------------------------------------------- module

class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention owning the Q/K/V/O projections.

    Self-attention when ``inputs_kv`` is None, cross-attention otherwise; ``inputs_v``
    optionally feeds the value projection from a separate tensor (PyTorch's distinct
    ``key``/``value`` arguments; it defaults to ``inputs_kv``). Parameters:
      query (D, N, H), key (Dkv, K, H), value (Dkv, K, H), out (N, H, D) kernels, each with
      a bias when ``use_bias``; logical axes ('embed', 'heads'|'kv_heads', 'head_dim').

    KV cache (``decode=True``, self-attention only): a ``cache`` collection holds
    ``cached_key``/``cached_value`` of shape (B, S_max, K, H) and ``cache_index``. Initialise
    it by calling ``init`` with ``decode=True`` on inputs of the full length S_max; each
    later call appends its T new positions and attends over the filled cache. With
    ``causal=True`` query i (absolute position index + i) sees cached keys <= its position.
    """
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    implementation: str = "xla"
    rope_base: float | None = None
    rope_interleaved: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    out_kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    precision: Any = None

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_kv: Array | None = None, *,
                 inputs_v: Array | None = None,
                 mask: Array | None = None, bias: Array | None = None, causal: bool = False,
                 positions: Array | None = None, deterministic: bool = True,
                 decode: bool = False, return_weights: bool = False):
        """inputs_q (B, T, D), inputs_kv (B, S, Dkv) [, inputs_v (B, S, Dv)] -> (B, T, D)
        [, weights (B, N, T, S)]."""
        self_attention = inputs_kv is None
        if self_attention and inputs_v is not None:
            raise ValueError(f"{self.name}: inputs_v needs inputs_kv (separate values are a "
                             "cross-attention feature)")
        inputs_kv = inputs_q if self_attention else inputs_kv
        inputs_v = inputs_kv if inputs_v is None else inputs_v
        if inputs_q.ndim != 3 or inputs_kv.ndim != 3 or inputs_v.ndim != 3:
            raise ValueError(f"{self.name}: inputs must be (B, T, D); got query {inputs_q.shape}, "
                             f"key {inputs_kv.shape}, value {inputs_v.shape}")
        if inputs_v.shape[:2] != inputs_kv.shape[:2]:
            raise ValueError(f"{self.name}: key {inputs_kv.shape} and value {inputs_v.shape} "
                             "inputs must agree on (B, S)")
        d = inputs_q.shape[-1]
        n = self.num_heads
        kh = self.num_kv_heads or n
        if self.head_dim is None and d % n:
            raise ValueError(f"{self.name}: d_model={d} is not divisible by num_heads={n}; "
                             "pick a divisor or set head_dim explicitly")
        h = self.head_dim or d // n
        if n % kh:
            raise ValueError(f"{self.name}: num_heads={n} must be a multiple of num_kv_heads={kh}")

        def proj(heads, axes, name):
            return Dense((heads, h), use_bias=self.use_bias, kernel_axes=axes, dtype=self.dtype,
                         param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                         bias_init=self.bias_init, precision=self.precision, name=name)

        q = proj(n, ("embed", "heads", "head_dim"), "query")(inputs_q)          # (B, T, N, H)
        k = proj(kh, ("embed", "kv_heads", "head_dim"), "key")(inputs_kv)       # (B, S, K, H)
        v = proj(kh, ("embed", "kv_heads", "head_dim"), "value")(inputs_v)      # (B, S, K, H)

        rope = self.rope_base is not None and self_attention
        if decode and self_attention:
            cached = self.has_variable("cache", "cached_key")
            cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
            cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
            cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            if cached:
                idx = cache_index.value
                t = q.shape[1]
                if rope:
                    pos = idx + jnp.arange(t) if positions is None else positions
                    q = apply_rope(q, pos, base=self.rope_base, interleaved=self.rope_interleaved)
                    k = apply_rope(k, pos, base=self.rope_base, interleaved=self.rope_interleaved)
                    rope = False  # done: cached keys are stored rotated
                k = jax.lax.dynamic_update_slice(cached_key.value, k.astype(cached_key.value.dtype),
                                                 (0, idx, 0, 0))
                v = jax.lax.dynamic_update_slice(cached_value.value, v.astype(cached_value.value.dtype),
                                                 (0, idx, 0, 0))
                cached_key.value, cached_value.value = k, v
                cache_index.value = idx + t
                s_max = k.shape[1]
                if causal:
                    filled = causal_mask(t, s_max, offset=idx)
                else:
                    filled = (jnp.arange(s_max) < idx + t)[None, None, None, :]
                if mask is not None:
                    mask = _check_broadcast(mask, "mask", (q.shape[0], n, t, s_max))
                mask = combine_masks(mask, filled)
                causal = False
        if rope:
            pos = jnp.arange(q.shape[1]) if positions is None else positions
            q = apply_rope(q, pos, base=self.rope_base, interleaved=self.rope_interleaved)
            k = apply_rope(k, pos, base=self.rope_base, interleaved=self.rope_interleaved)

        dropout_rng = None
        if not deterministic and self.dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        result = dot_product_attention(
            q, k, v, mask=mask, bias=bias, causal=causal, dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng, deterministic=deterministic, return_weights=return_weights,
            implementation=self.implementation, precision=self.precision)
        out, weights = result if return_weights else (result, None)
        out = nn.with_logical_constraint(out, ("act_batch", "act_length", "act_heads", "act_head_dim"))
        y = Dense(self.out_features or d, in_axes=2, use_bias=self.use_bias,
                  kernel_axes=("heads", "head_dim", "embed"), dtype=self.dtype,
                  param_dtype=self.param_dtype, kernel_init=self.out_kernel_init or self.kernel_init,
                  bias_init=self.bias_init, precision=self.precision, name="out")(out)
        return (y, weights) if return_weights else y
