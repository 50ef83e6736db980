"""Attention masks as pure functions.

Convention (the seeds' convention): a mask entry of 1/True means *may attend*, 0/False
means *blocked*. Every mask here is boolean and broadcastable to the attention logits'
shape (B, N, T, S):

  B batch, N heads, T query length, S key length.

PyTorch's own modules use other conventions (``nn.MultiheadAttention``: True = *blocked*,
or an additive float mask); the converters in :mod:`transformer_jax.interop` translate.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..errors import UserError

Array = jnp.ndarray


def causal_mask(q_len: int, k_len: int | None = None, *, offset: int | Array = 0) -> Array:
    """Lower-triangular mask, (1, 1, T, S) bool: query i may attend key j iff j <= i + offset.

    ``offset`` is the absolute position of the first query, which is what a decoder
    needs when T new queries are appended after ``offset`` cached keys (KV-cache decoding).
    With ``k_len = None`` the mask is square (S = T).

    >>> causal_mask(3).astype(int)[0, 0]
    [[1 0 0]
     [1 1 0]
     [1 1 1]]
    """
    k_len = q_len if k_len is None else k_len
    q_pos = jnp.arange(q_len)[:, None] + offset
    k_pos = jnp.arange(k_len)[None, :]
    return (k_pos <= q_pos)[None, None]


def sliding_window_mask(q_len: int, k_len: int | None = None, *, window: int,
                        causal: bool = True, offset: int | Array = 0) -> Array:
    """Local attention, (1, 1, T, S) bool.

    Causal: query i sees keys j with ``i - window < j <= i`` (``window`` keys, itself
    included). Bidirectional (``causal=False``): keys with ``|i - j| < window``.
    """
    if window < 1:
        raise UserError(f"sliding window must be >= 1, got window={window}")
    k_len = q_len if k_len is None else k_len
    q_pos = jnp.arange(q_len)[:, None] + offset
    k_pos = jnp.arange(k_len)[None, :]
    dist = q_pos - k_pos
    if causal:
        allowed = (dist >= 0) & (dist < window)
    else:
        allowed = jnp.abs(dist) < window
    return allowed[None, None]


def padding_mask_from_lengths(lengths: Array, max_len: int) -> Array:
    """Key padding mask from valid lengths: (B,) ints -> (B, 1, 1, S) bool, S = max_len.

    Position j of row b is valid iff j < lengths[b] (right padding).
    """
    lengths = jnp.asarray(lengths)
    if lengths.ndim != 1:
        raise UserError(f"lengths must be 1-D (B,), got shape {lengths.shape}")
    valid = jnp.arange(max_len)[None, :] < lengths[:, None]
    return valid[:, None, None, :]


def padding_mask_from_ids(ids: Array, pad_id: int = 0) -> Array:
    """Key padding mask from token ids: (B, S) -> (B, 1, 1, S) bool, True where ids != pad_id."""
    ids = jnp.asarray(ids)
    if ids.ndim != 2:
        raise UserError(f"ids must be 2-D (B, S), got shape {ids.shape}")
    return (ids != pad_id)[:, None, None, :]


def key_padding_mask(valid: Array) -> Array:
    """(B, S) validity (1 = real token, e.g. HF's ``attention_mask``) -> (B, 1, 1, S) bool."""
    valid = jnp.asarray(valid)
    if valid.ndim != 2:
        raise UserError(f"a key padding mask must be 2-D (B, S), got shape {valid.shape}")
    return valid.astype(bool)[:, None, None, :]


def query_key_mask(q_valid: Array, k_valid: Array) -> Array:
    """Pairwise mask from query and key validity: (B, T), (B, S) -> (B, 1, T, S) bool."""
    q_valid = jnp.asarray(q_valid).astype(bool)
    k_valid = jnp.asarray(k_valid).astype(bool)
    return (q_valid[:, None, :, None] & k_valid[:, None, None, :])


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of masks that broadcast together; ``None`` entries are ignored.

    Returns ``None`` when every entry is ``None`` (no masking at all).
    """
    present = [jnp.asarray(m).astype(bool) for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


def as_4d(mask: Array, name: str = "mask") -> Array:
    """Lift a 2-D (T, S) or 3-D (B, T, S) mask to 4-D (B|1, N|1, T, S); 4-D passes through."""
    mask = jnp.asarray(mask)
    if mask.ndim == 2:
        return mask[None, None]
    if mask.ndim == 3:
        return mask[:, None]
    if mask.ndim == 4:
        return mask
    raise UserError(
        f"{name} must be 2-D (T, S), 3-D (B, T, S) or 4-D (B, N, T, S); got shape {mask.shape}")
