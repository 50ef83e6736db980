"""Attention masks as pure functions.

Convention (the tutorial's convention): a mask entry of 1/True means *may attend*, 0/False
means *blocked*. Every mask here is boolean and broadcastable to the attention logits'
shape (B, N, T, S):

  B batch, N heads, T query length, S key length.

PyTorch's own modules use other conventions (``nn.MultiheadAttention``: True = *blocked*,
or an additive float mask); the converters in :mod:`transformer_jax.interop` translate.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

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
    return AttentionPattern(kind="window", size=window).mask(q_len, k_len, causal=causal,
                                                             offset=offset)


def strided_mask(q_len: int, k_len: int | None = None, *, stride: int, causal: bool = True,
                 offset: int | Array = 0) -> Array:
    """Child et al. (2019)'s "strided" sparse pattern, both of its heads merged into one,
    (1, 1, T, S) bool: query i sees key j when ``|i - j| < stride`` (the local part) or
    ``(i - j) % stride == 0`` (every stride-th earlier key); causal: only j <= i."""
    return AttentionPattern(kind="strided", size=stride).mask(q_len, k_len, causal=causal,
                                                              offset=offset)


def fixed_mask(q_len: int, k_len: int | None = None, *, stride: int, summary: int = 1,
               causal: bool = True, offset: int | Array = 0) -> Array:
    """Child et al. (2019)'s "fixed" sparse pattern, (1, 1, T, S) bool: query i sees key j
    when both lie in the same block of ``stride`` positions (``i // stride == j // stride``)
    or j is one of the last ``summary`` positions of its block (``j % stride >= stride -
    summary``, the "summary" columns every later query reads); causal: only j <= i."""
    return AttentionPattern(kind="fixed", size=stride, summary=summary).mask(
        q_len, k_len, causal=causal, offset=offset)


PATTERN_KINDS = ("window", "strided", "fixed")


@dataclasses.dataclass(frozen=True)
class AttentionPattern:
    """A static rule for which (query i, key j) pairs may meet, for self-attention with
    aligned positions (query i and key i are the same token).

      ``window``   ``|i - j| < size``: the ``size`` nearest keys on each side, itself
                   included (Longformer, Mistral's sliding window; causal: the ``size``
                   most recent keys, ``sliding_window_mask``).
      ``strided``  ``|i - j| < size`` or ``(i - j) % size == 0`` (``strided_mask``).
      ``fixed``    ``i // size == j // size`` or ``j % size >= size - summary``
                   (``fixed_mask``).

    Causality is separate (the ``causal`` flag of the attention call) and is ANDed in.
    Being hashable and static, a pattern lets the block implementations (``"chunked"``,
    ``"pallas"``) skip every key block that holds no allowed pair: for a window, time and
    memory grow as O(T W) instead of O(T^2). ``parse`` reads the configs' string form.
    """
    kind: str
    size: int
    summary: int = 1

    def __post_init__(self):
        if self.kind not in PATTERN_KINDS:
            raise UserError(f"unknown attention pattern {self.kind!r}; choose one of "
                            f"{PATTERN_KINDS}")
        if not isinstance(self.size, int) or self.size < 1:
            raise UserError(f"attention pattern {self.kind!r}: the size must be an integer "
                            f">= 1, got {self.size!r}")
        if self.kind == "fixed" and not (isinstance(self.summary, int)
                                         and 1 <= self.summary <= self.size):
            raise UserError(f"fixed attention pattern: summary must be an integer in [1, "
                            f"stride={self.size}], got {self.summary!r}")

    @classmethod
    def parse(cls, text: str) -> "AttentionPattern":
        """``"strided:128"`` or ``"fixed:128:16"`` (stride, summary columns)."""
        parts = str(text).split(":")
        try:
            numbers = [int(x) for x in parts[1:]]
        except ValueError:
            numbers = []
        if parts[0] == "strided" and len(numbers) == 1:
            return cls("strided", numbers[0])
        if parts[0] == "fixed" and len(numbers) in (1, 2):
            return cls("fixed", *numbers)
        raise UserError(f"attention sparsity {text!r} is not understood; write 'strided:STRIDE' "
                        "(e.g. 'strided:128') or 'fixed:STRIDE:SUMMARY' (e.g. 'fixed:128:16')")

    def allowed(self, q_pos: Array, k_pos: Array) -> Array:
        """Elementwise rule for broadcasting position arrays (causality not included)."""
        # positions are >= 0; lax.div/rem (C semantics) lower inside Pallas kernels too
        d = q_pos - k_pos
        near = jnp.abs(d) < self.size
        if self.kind == "window":
            return near
        if self.kind == "strided":
            return near | (lax.rem(d, self.size) == 0)
        return (lax.div(q_pos, self.size) == lax.div(k_pos, self.size)) | (
            lax.rem(k_pos, self.size) >= self.size - self.summary)

    def mask(self, q_len: int, k_len: int | None = None, *, causal: bool,
             offset: int | Array = 0) -> Array:
        """(1, 1, T, S) bool with causality when ``causal``; query i sits at ``offset + i``."""
        k_len = q_len if k_len is None else k_len
        q_pos = jnp.arange(q_len)[:, None] + offset
        k_pos = jnp.arange(k_len)[None, :]
        allowed = self.allowed(q_pos, k_pos)
        if causal:
            allowed = allowed & (k_pos <= q_pos)
        return allowed[None, None]

    # -- block ranges: tiles of queries [qa, qe) x keys [ka, ke), end exclusive ------------

    def key_span(self, qa, qe, causal: bool):
        """Keys [lo, hi) that queries [qa, qe) may see under a window (all for the others,
        hi None = up to the end; causal caps hi at qe)."""
        lo = jnp.maximum(qa - self.size + 1, 0) if self.kind == "window" else 0
        hi = qe if causal else (qe + self.size - 1 if self.kind == "window" else None)
        return lo, hi

    def query_span(self, ka, ke, causal: bool):
        """Queries [lo, hi) that may see keys [ka, ke) (hi None = up to the end)."""
        lo = ka if causal else (jnp.maximum(ka - self.size + 1, 0) if self.kind == "window"
                                else 0)
        hi = ke + self.size - 1 if self.kind == "window" else None
        return lo, hi

    def tile_live(self, qa, qe, ka, ke, causal: bool):
        """Whether the tile may hold an allowed pair (never False when it does); the
        window's tiles are all live inside its spans."""
        if self.kind == "window":
            return jnp.asarray(True)
        l, div = self.size, lax.div
        if self.kind == "strided":
            dmin, dmax = qa - (ke - 1), (qe - 1) - ka
            if causal:
                dmin = jnp.maximum(dmin, 0)
            near = (dmin < l) & (dmax > -l) & (dmin <= dmax)
            shift = (2**30 // l) * l          # a multiple of l making both ends >= 0
            return near | (div(dmax + shift, l) * l - shift >= dmin)
        j_hi = jnp.minimum(ke, qe) if causal else ke            # keys [ka, j_hi) may be seen
        same = (div(ka, l) <= div(qe - 1, l)) & (div(qa, l) <= div(ke - 1, l)) & (ka < j_hi)
        first = jnp.where(lax.rem(ka, l) >= l - self.summary, ka,
                          div(ka, l) * l + l - self.summary)
        return same | (first < j_hi)


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


def segment_ids_pair(segment_ids, t: int, s: int) -> tuple[Array, Array] | None:
    """Checked ``(q_segment_ids (B, T), kv_segment_ids (B, S))`` int32 from ``segment_ids``:
    one (B, T) array for self-attention (T = S), or a pair; None stays None."""
    if segment_ids is None:
        return None
    pair = tuple(segment_ids) if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
    if len(pair) != 2:
        raise UserError(f"segment_ids must be one (B, T) array or a pair (q (B, T), kv (B, S)); "
                        f"got {len(pair)} arrays")
    q_ids, kv_ids = (jnp.asarray(x) for x in pair)
    if q_ids.ndim != 2 or kv_ids.ndim != 2 or q_ids.shape[0] != kv_ids.shape[0] or (
            q_ids.shape[1], kv_ids.shape[1]) != (t, s):
        raise UserError(f"segment_ids must be (B, T) for the queries and (B, S) for the keys "
                        f"(T={t}, S={s}); got {q_ids.shape} and {kv_ids.shape}. A single array "
                        "serves self-attention only (T = S)")
    if not (jnp.issubdtype(q_ids.dtype, jnp.integer) and jnp.issubdtype(kv_ids.dtype, jnp.integer)):
        raise UserError(f"segment_ids must be integers (one id per document); got "
                        f"{q_ids.dtype} and {kv_ids.dtype}")
    return q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)


def segment_mask(q_segment_ids: Array, kv_segment_ids: Array) -> Array:
    """Packed documents: query i may attend key j iff both carry the same segment id;
    (B, T), (B, S) ints -> (B, 1, T, S) bool."""
    return (jnp.asarray(q_segment_ids)[:, None, :, None]
            == jnp.asarray(kv_segment_ids)[:, None, None, :])


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
