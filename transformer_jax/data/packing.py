"""Packing tokenized documents into language-model windows and batches (the layout is
described in :mod:`transformer_jax.data.pipeline`): every non-empty document followed by
``eos``, concatenated into one stream; window ``k`` is ``s[k*T : k*T+T+1]``; a batch splits
windows (B, T+1) into ``inputs``/``targets``/``weights`` (B, T).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from transformer_jax.data.sources import READ_CHUNK
from transformer_jax.data.tokenizers import Tokenizer
from transformer_jax.errors import UserError

__all__ = ["Batch", "batch_from_windows", "gather_windows", "num_windows", "pack_documents",
           "token_stream"]

#: A batch: ``inputs``/``targets`` int32 (B, T), ``weights`` float32 (B, T).
Batch = dict[str, np.ndarray]


def token_stream(texts: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenates ``ids(doc) + [eos]`` over the non-empty documents; (N,) int32.

    The texts are encoded ``READ_CHUNK`` at a time with the tokenizer's ``encode_batch``."""
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    parts, texts = [], iter(texts)
    while chunk := list(itertools.islice(texts, READ_CHUNK)):
        for ids in tokenizer.encode_batch(chunk):
            if ids.size:
                parts.extend((ids, eos))
    if not parts:
        return np.zeros((0,), dtype=np.int32)
    return np.concatenate(parts).astype(np.int32, copy=False)


def num_windows(num_tokens: int, seq_len: int, pad_final: bool) -> int:
    """Windows of ``seq_len + 1`` tokens (overlapping by one) in a stream of ``num_tokens``:
    the full ones, plus the last partial one with ``pad_final``."""
    if num_tokens < 2:
        return 0
    full, rest = divmod(num_tokens - 1, seq_len)
    return full + int(pad_final and rest > 0)


def gather_windows(
    stream: np.ndarray, window_ids: np.ndarray, seq_len: int, pad_id: int
) -> np.ndarray:
    """Rows ``stream[k*T : k*T+T+1]`` for each k in window_ids, padded past the end.

    Returns int32 (len(window_ids), T+1).
    """
    positions = np.asarray(window_ids, dtype=np.int64)[:, None] * seq_len + np.arange(
        seq_len + 1
    )
    inside = positions < len(stream)
    rows = np.asarray(stream)[np.where(inside, positions, 0)].astype(np.int32)
    rows[~inside] = pad_id
    return rows


def pack_documents(
    token_docs: Iterable[Sequence[int]],
    seq_len: int,
    *,
    eos_id: int = 1,
    pad_id: int = 0,
    pad_final: bool = False,
) -> np.ndarray:
    """Packs tokenized documents into windows of ``seq_len + 1`` tokens.

    Each non-empty document is followed by ``eos_id`` and all are concatenated
    into a stream ``s``; window ``k`` is ``s[k*T : k*T+T+1]``.  With
    ``pad_final`` the last partial window is kept, padded with ``pad_id``;
    otherwise it is dropped.

    Returns:
      int32 array (W, T+1); ``W = (N-1) // T`` (or ``ceil((N-1) / T)`` with
      ``pad_final``) for a stream of ``N`` tokens.
    """
    if seq_len < 1:
        raise UserError(f"seq_len must be >= 1, got {seq_len}")
    eos = np.array([eos_id], dtype=np.int32)
    parts = []
    for doc in token_docs:
        ids = np.asarray(doc, dtype=np.int32).reshape(-1)
        if ids.size:
            parts.extend((ids, eos))
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    count = num_windows(len(stream), seq_len, pad_final)
    return gather_windows(stream, np.arange(count), seq_len, pad_id)


def batch_from_windows(windows: np.ndarray, pad_id: int) -> Batch:
    """Splits windows (B, T+1) into inputs/targets/weights, each (B, T)."""
    inputs = np.ascontiguousarray(windows[:, :-1], dtype=np.int32)
    targets = np.ascontiguousarray(windows[:, 1:], dtype=np.int32)
    return {
        "inputs": inputs,
        "targets": targets,
        "weights": (targets != pad_id).astype(np.float32),
    }
