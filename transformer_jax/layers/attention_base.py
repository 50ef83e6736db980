"""What every attention implementation shares: argument checks, head grouping, padding.

Shape legend (used in every einsum of the library):
  B batch, T query length, S key length, D model width, N query heads,
  K key/value heads (grouped-query attention: N = K * G), G query heads per kv head,
  H head dim.

Masks follow the PyTorch tutorial's convention (1/True = may attend). Blocked logits are set to
``NEG``, the most negative fp32 number, rather than -inf, so that a row whose keys are all
blocked gives the mean of V instead of NaN (PyTorch gives NaN there).

The implementations (``attention_reference.py``, ``chunked_attention.py``,
``flash_attention.py``) import from here; nothing here imports them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..errors import UserError
from .masks import AttentionPattern, as_4d, causal_mask

Array = jax.Array

NEG = float(jnp.finfo(jnp.float32).min)


def check_qkv(q: Array, k: Array, v: Array) -> tuple[int, int, int, int, int, int]:
    """Validate (B, T, N, H), (B, S, K, H), (B, S, K, Hv); return (B, T, S, N, K, H)."""
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim != 4:
            raise UserError(f"{name} must be 4-D (B, T|S, N|K, H); got shape {x.shape}")
    b, t, n, h = q.shape
    _, s, kh, hk = k.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise UserError(f"batch sizes differ: query {q.shape}, key {k.shape}, value {v.shape}")
    if hk != h:
        raise UserError(f"query head dim {h} != key head dim {hk} (query {q.shape}, key {k.shape}); "
                        "queries and keys must share the head dim")
    if v.shape[1] != s or v.shape[2] != kh:
        raise UserError(f"key {k.shape} and value {v.shape} must agree on (B, S, K)")
    if n % kh:
        raise UserError(f"query heads N={n} must be a multiple of key/value heads K={kh} "
                        "(grouped-query attention)")
    return b, t, s, n, kh, h


def check_broadcast(x: Array | None, name: str, shape: tuple[int, int, int, int]) -> Array | None:
    """Lift a 2/3/4-D mask or bias to 4-D and check it broadcasts to (B, N, T, S)."""
    if x is None:
        return None
    x = as_4d(x, name)
    if any(d not in (1, want) for d, want in zip(x.shape, shape)):
        raise UserError(f"{name} of shape {x.shape} does not broadcast to the attention "
                        f"logits (B, N, T, S) = {shape}")
    return x


def group_heads(x: Array, k_heads: int, groups: int) -> Array:
    """(b, n|1, T, S) -> (b, K|1, G|1, T, S) with head n = k * G + g (HF's repeat_kv order)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], k_heads, groups, *x.shape[2:])


def block(x: Array | None, axis: int, start, size: int) -> Array | None:
    """``size`` entries of ``axis`` from ``start``; None and broadcast (size-1) axes pass."""
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def pad_axis(x: Array, axis: int, size: int, value=0, *, keep_broadcast: bool = True,
             mode: str = "constant") -> Array:
    """Pad ``axis`` at the end to ``size`` with ``value`` (``mode="edge"``: repeating the
    last entry); a size-1 (broadcast) axis is left alone unless ``keep_broadcast=False``."""
    extra = size - x.shape[axis]
    if extra <= 0 or (keep_broadcast and x.shape[axis] == 1):
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    if mode == "edge":
        return jnp.pad(x, pad, mode="edge")
    return jnp.pad(x, pad, constant_values=value)


def empty_rows(mask: Array, t: int, s: int, causal: bool = True,
               pattern: AttentionPattern | None = None) -> Array:
    """(Bm, Nm, T) bool: rows in which ``mask``, causality and the pattern leave no key."""
    mask = jnp.broadcast_to(mask, mask.shape[:3] + (s,)).astype(bool)
    rows = jnp.arange(t)
    if mask.shape[2] == 1 and pattern is None:   # one key mask for all queries: O(T + S)
        first = jnp.argmax(mask[:, :, 0], axis=-1)[..., None]      # first allowed key
        has_any = jnp.any(mask[:, :, 0], axis=-1)[..., None]
        return ~(has_any & (first <= rows)) if causal else ~has_any
    if mask.shape[2] == 1 and pattern.kind == "window":   # allowed keys in each row's window
        count = jnp.concatenate([jnp.zeros(mask.shape[:2] + (1,), jnp.int32),
                                 jnp.cumsum(mask[:, :, 0], axis=-1, dtype=jnp.int32)], axis=-1)
        lo, hi = pattern.key_span(rows, rows + 1, causal)     # a window's span: both ends
        lo, hi = jnp.clip(lo, 0, s), jnp.clip(hi, 0, s)
        return count[..., hi] - count[..., lo] == 0
    allowed = (causal_mask(t, s)[0, 0] if causal else True)
    if pattern is not None:
        allowed = allowed & pattern.mask(t, s, causal=False)[0, 0]
    return ~jnp.any(mask & allowed, axis=-1)


def key_block_range(pattern: AttentionPattern | None, causal: bool, qa, qc: int, kc: int,
                    nk: int):
    """Key blocks [first, end) that the query rows [qa, qa + qc) may see: all, up to the
    causal diagonal, or (a pattern) inside its span."""
    lo, hi = pattern.key_span(qa, qa + qc, causal) if pattern else (0, qa + qc if causal else None)
    end = nk if hi is None else jnp.minimum(nk, jax.lax.div(hi + kc - 1, kc))
    return jax.lax.div(lo, kc) if pattern else 0, end


def query_block_range(pattern: AttentionPattern | None, causal: bool, ka, kc: int, qc: int,
                      nq: int):
    """Query blocks [first, end) that may see the key rows [ka, ka + kc)."""
    lo, hi = pattern.query_span(ka, ka + kc, causal) if pattern else (ka if causal else 0, None)
    end = nq if hi is None else jnp.minimum(nq, jax.lax.div(hi + qc - 1, qc))
    return jax.lax.div(lo, qc) if (pattern or causal) else 0, end


def visit(pattern: AttentionPattern | None, causal: bool, tile, body, carry):
    """``body(carry)`` on a tile (qa, qe, ka, ke) the pattern may reach, else ``carry``:
    sparse patterns skip the dead tiles inside their block ranges."""
    if pattern is None or pattern.kind == "window":
        return body(carry)
    return jax.lax.cond(pattern.tile_live(*tile, causal), body, lambda c: c, carry)


def fill_empty_rows(out: Array, value: Array, mask: Array, t: int, s: int, causal: bool = True,
                    pattern: AttentionPattern | None = None) -> Array:
    """Give rows without any allowed key (mask + causality + pattern) the mean of V, as the
    reference does.

    Block-skipping implementations never visit the key blocks past the causal diagonal
    (or outside a pattern's span), so in such (degenerate) rows they would average over
    the visited keys only.
    """
    empty = empty_rows(mask, t, s, causal, pattern).transpose(0, 2, 1)[..., None]  # (Bm,T,Nm,1)
    return fill_rows(out, value, empty)


def fill_rows(out: Array, value: Array, empty: Array) -> Array:
    """``out`` (B, T, N, Hv) with the mean of V in the rows ``empty`` (broadcasting to
    (B, T, N, 1)) marks: what the reference gives a row whose keys are all blocked."""
    n, kh = out.shape[2], value.shape[2]
    mean_v = jnp.mean(value.astype(jnp.float32), axis=1)                     # (B, K, Hv)
    mean_v = jnp.repeat(mean_v, n // kh, axis=1)[:, None]                    # (B, 1, N, Hv)
    return jnp.where(empty, mean_v.astype(out.dtype), out)
