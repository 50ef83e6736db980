"""T5-style relative position buckets and the additive attention bias built from them.

Pure functions (the bias table itself is a parameter owned by the model). Legend: T query
length, S key length, N heads, R number of buckets.

Buckets (Mesh TensorFlow / T5). The relative position of key j seen from query i is
``j - i`` (positive = the key lies in the future). With ``bidirectional=True`` (encoder)
half of the R buckets hold keys in the future and half keys in the past or present; with
``bidirectional=False`` (causal decoder) every future key shares bucket 0 with the present
one and all R buckets hold the past. Within the R' buckets of one direction (R' = R/2
bidirectional, R causal), with ``n = |j - i|``:

  * the first ``m = R'/2`` buckets are exact: ``n`` for ``n < m``;
  * the others are logarithmic up to ``max_distance``:
    ``m + floor(log(n / m) / log(max_distance / m) * (R' - m))``, capped at ``R' - 1``,
    so every distance beyond ``max_distance`` shares the last bucket.

Bidirectional buckets add ``R/2`` for future keys (``j - i > 0``). The logarithm is
evaluated in fp32 with the same operation order as Hugging Face's
``T5Attention._relative_position_bucket`` so the two agree bucket for bucket.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..errors import UserError

Array = jax.Array


def relative_position_bucket(relative_position: Array, *, bidirectional: bool = True,
                             num_buckets: int = 32, max_distance: int = 128) -> Array:
    """Bucket ids (int32, same shape) for relative positions ``key - query`` (ints)."""
    need = 4 if bidirectional else 2
    if num_buckets < need:
        raise UserError(f"relative position buckets: num_buckets={num_buckets} is too small "
                        f"(need >= {need} {'bidirectional' if bidirectional else 'causal'})")
    if bidirectional and num_buckets % 2:
        raise UserError(f"relative position buckets: bidirectional buckets split in two halves; "
                        f"num_buckets={num_buckets} must be even")
    rel = jnp.asarray(relative_position).astype(jnp.int32)
    buckets = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).astype(jnp.int32) * num_buckets
        dist = jnp.abs(rel)
    else:
        dist = -jnp.minimum(rel, 0)
    max_exact = num_buckets // 2
    if max_distance <= max_exact:
        raise UserError(f"relative position buckets: max_distance={max_distance} must exceed the "
                        f"{max_exact} exact buckets")
    is_small = dist < max_exact
    # log(dist / m) only matters where dist >= m; clamp so the discarded lanes stay finite.
    ratio = jnp.maximum(dist, max_exact).astype(jnp.float32) / jnp.float32(max_exact)
    scaled = (jnp.log(ratio) / jnp.float32(math.log(max_distance / max_exact))
              * jnp.float32(num_buckets - max_exact))
    large = jnp.minimum(max_exact + scaled.astype(jnp.int32), num_buckets - 1)
    return buckets + jnp.where(is_small, dist, large)


def relative_position_bias(table: Array, q_len: int, k_len: int, *, bidirectional: bool,
                           max_distance: int = 128, q_offset: int | Array = 0,
                           q_positions: Array | None = None,
                           k_positions: Array | None = None) -> Array:
    """Additive attention bias (1, N, T, S) fp32 from a bucket table (R, N).

    Query ``i`` sits at absolute position ``q_offset + i`` (a decode step passes the number
    of cached positions) and key ``j`` at position ``j``; the bias of the pair is
    ``table[bucket(j - (q_offset + i))]``. Given per-row positions ``q_positions`` (B, T)
    and ``k_positions`` (B, S) (packed documents: they restart at each document), the pair's
    bias is ``table[bucket(k_positions[b, j] - q_positions[b, i])]``, (B, N, T, S).
    """
    if table.ndim != 2:
        raise UserError(f"relative position bias table must be (num_buckets, heads); got {table.shape}")
    if (q_positions is None) != (k_positions is None):
        raise UserError("relative_position_bias needs both q_positions and k_positions, or "
                        "neither")
    if q_positions is not None:
        q_pos = jnp.asarray(q_positions, jnp.int32)[:, :, None]            # (B, T, 1)
        k_pos = jnp.asarray(k_positions, jnp.int32)[:, None, :]            # (B, 1, S)
    else:
        q_pos = jnp.arange(q_len, dtype=jnp.int32)[:, None] + jnp.asarray(q_offset, jnp.int32)
        k_pos = jnp.arange(k_len, dtype=jnp.int32)[None, :]
    buckets = relative_position_bucket(k_pos - q_pos, bidirectional=bidirectional,
                                       num_buckets=table.shape[0], max_distance=max_distance)
    values = jnp.take(table.astype(jnp.float32), buckets, axis=0)          # ([B,] T, S, N)
    if q_positions is not None:
        return jnp.transpose(values, (0, 3, 1, 2))                         # (B, N, T, S)
    return jnp.transpose(values, (2, 0, 1))[None]                          # (1, N, T, S)
