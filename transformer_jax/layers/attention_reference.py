"""The reference softmax attention: ``dot_product_attention(..., attention_impl="xla")``.

``xla_attention`` materialises the (B, N, T, S) weights in fp32 (causal attention in query
blocks that skip the keys past the diagonal); it supports everything (dropout, returned
weights) and is what every other implementation is tested against. Shapes and the mask
convention are in ``attention_base.py``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .attention_base import NEG, block, check_qkv, fill_empty_rows, group_heads
from .cpu_tuning import attention_scores, attention_values, matmul
from .masks import causal_mask, combine_masks

Array = jax.Array

# Causal attention in the reference path splits the queries into blocks; block i attends
# only to the keys up to its last row, so the score and PV matmuls skip most of the upper
# triangle (25% fewer attention FLOPs at 2 blocks, 37.5% at 4, 44% at 8). Each block still
# gets one exact softmax over all its keys, so the result equals the whole-square
# computation up to fp32 rounding. Blocks of 64 queries, at most 8 (unrolled); a
# ``q_chunk`` argument overrides it.
XLA_CAUSAL_MIN_BLOCK = 64
XLA_CAUSAL_MAX_BLOCKS = 8


def _causal_query_block(t: int) -> int:
    return max(XLA_CAUSAL_MIN_BLOCK, -(-t // XLA_CAUSAL_MAX_BLOCKS))


def _causal_blocks(t: int, s: int, size: int) -> list[tuple[int, int, int]]:
    """(first query, end query, number of keys) of each query block; keys are top-left
    aligned (query i sees keys j <= i), so block [a, e) needs keys [0, min(e, s))."""
    return [(a, min(a + size, t), min(a + size, t, s)) for a in range(0, t, size)]


def _unnormalised_softmax(logits, bias, mask, dropout_rate, dropout_rng):
    """exp(logits + bias - max) with blocked entries at 0, dropout applied, and the row sums
    (before dropout). The caller divides the PV product by the row sums, which saves a pass
    over the (B, K, G, T, S) weights forward and backward."""
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, NEG)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.exp(logits - top)                                                 # fp32
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    return p, denom


def _attend_rows(precision, cpu_tuning, qt, kt, vt, scale, bias, mask, dropout_rate,
                 dropout_rng):
    """Queries (B, K, G, T, H) over keys (B, K, S, H) and values (B, K, S, Hv): the
    unnormalised weights, their row sums and the output (B, K, G, T, Hv). Both matmuls see
    the G query groups folded into their rows, (B, K, G*T, .)."""
    b, kh, g, t, h = qt.shape
    s, hv = kt.shape[2], vt.shape[3]
    logits = attention_scores(qt.reshape(b, kh, g * t, h), kt, precision, cpu_tuning)
    p, denom = _unnormalised_softmax(logits.reshape(b, kh, g, t, s) * scale, bias, mask,
                                     dropout_rate, dropout_rng)
    out = attention_values(p.astype(vt.dtype).reshape(b, kh, g * t, s), vt, precision,
                           cpu_tuning)
    return p, denom, out.reshape(b, kh, g, t, hv) / denom


def _single_query(q, k, v, mask, bias, scale, dropout_rate, rng, precision, return_weights):
    """One query row (a KV-cache decode step), kept in (B, T, K, G) order: XLA:CPU then lays
    a (B, S, K, H) cache out with contiguous H rows for both dots."""
    b, t, n, h = q.shape
    kh, hv = k.shape[2], v.shape[-1]
    g = n // kh
    dot = matmul(precision)
    logits = dot("BTKGH,BSKH->BKGTS", q.reshape(b, t, kh, g, h), k) * scale
    p, denom = _unnormalised_softmax(logits, bias, mask, dropout_rate, rng)
    out = dot("BSKH,BKGTS->BTKGH", v, p.astype(v.dtype)) / jnp.moveaxis(denom, 3, 1)
    weights = (p / denom).reshape(b, n, t, -1) if return_weights else None
    return out.reshape(b, t, n, hv).astype(v.dtype), weights


def xla_attention(q, k, v, mask, bias, scale, causal, dropout_rate=0.0, dropout_rng=None,
                  precision=None, return_weights=False, query_block=None, cpu_tuning=True):
    """The reference. q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv); mask and bias 4-D.

    Returns (out (B, T, N, Hv), weights (B, N, T, S) or None); ``weights`` are the
    normalised ones, dropout included. Queries go to (B, K, G, T, H), keys and values to
    (B, K, S, H). Causal attention is computed in blocks of ``query_block`` queries unless
    the weights are returned. ``dropout_rng`` None: no dropout.
    """
    b, t, s, n, kh, h = check_qkv(q, k, v)
    g, hv = n // kh, v.shape[-1]
    user_mask = mask
    mask = None if mask is None else group_heads(mask, kh, g)                 # (B, K, G, T, S)
    bias = None if bias is None else group_heads(bias, kh, g)
    square_mask = combine_masks(mask, causal_mask(t, s)[:, :, None]) if causal else mask
    if t == 1:
        return _single_query(q, k, v, square_mask, bias, scale, dropout_rate, dropout_rng,
                             precision, return_weights)

    qt = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)                   # (B, K, G, T, H)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)                     # (B, K, S, H/Hv)
    query_block = query_block or _causal_query_block(t)
    blocked = causal and not return_weights and t > query_block
    weights = None
    if not blocked:
        p, denom, out = _attend_rows(precision, cpu_tuning, qt, kt, vt, scale, bias,
                                     square_mask, dropout_rate, dropout_rng)
        weights = (p / denom).reshape(b, n, t, s) if return_weights else None
    else:
        outs = []
        for i, (a, e, keys) in enumerate(_causal_blocks(t, s, query_block)):
            blk_mask = combine_masks(block(block(mask, 3, a, e - a), 4, 0, keys),
                                     causal_mask(e - a, keys, offset=a)[:, :, None])
            blk_bias = block(block(bias, 3, a, e - a), 4, 0, keys)
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
            outs.append(_attend_rows(precision, cpu_tuning, qt[:, :, :, a:e], kt[:, :, :keys],
                                     vt[:, :, :keys], scale, blk_bias, blk_mask, dropout_rate,
                                     rng)[2])
        out = jnp.concatenate(outs, axis=3)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv).astype(v.dtype)
    if blocked and user_mask is not None:
        # a row that the mask and causality leave without keys averages V over all S keys
        # in the whole-square computation; its block saw only the keys up to the block end
        out = fill_empty_rows(out, v, user_mask, t, s)
    return out, weights
