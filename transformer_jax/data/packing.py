"""Packing tokenized documents into language-model windows and batches (the layout is
described in :mod:`transformer_jax.data.pipeline`): every non-empty document followed by
``eos``, concatenated into one stream; window ``k`` is ``s[k*T : k*T+T+1]``; a batch splits
windows (B, T+1) into ``inputs``/``targets``/``weights`` (B, T).

``packing="document"`` (:func:`document_fields`) adds ``segment_ids`` and ``positions`` so
that attention and positions stay within each document: a document is its ids plus its
eos; an input token's segment is its document's index within the window (from 1; padding
0), its position counts from 0 at the first token of its document's piece in the window,
and its weight is 1 only when its target belongs to the same document (an input eos, whose
target starts the next document, weighs 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from transformer_jax.data.sources import READ_CHUNK
from transformer_jax.data.tokenizers import Tokenizer
from transformer_jax.errors import UserError

__all__ = ["Batch", "PACKINGS", "batch_from_windows", "check_packing", "document_fields", "gather_windows",
           "num_windows", "pack_documents", "pack_examples", "token_stream"]

#: A batch: ``inputs``/``targets`` int32 (B, T), ``weights`` float32 (B, T); with
#: ``packing="document"`` also ``segment_ids``/``positions`` int32 (B, T).
Batch = dict[str, np.ndarray]

#: ``"concatenate"``: documents joined by eos, attention crosses them (the default);
#: ``"document"``: each window carries segment ids and positions per document.
PACKINGS = ("concatenate", "document")


def check_packing(packing: str, name: str = "packing") -> str:
    """``packing`` if it is one of :data:`PACKINGS`, else a UserError naming it ``name``."""
    if packing not in PACKINGS:
        raise UserError(f"{name}={packing!r} is unknown; choose 'concatenate' (documents "
                        "joined by eos, attention across them) or 'document' (segment ids and "
                        "positions per document)")
    return packing


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


def document_fields(windows: np.ndarray, eos_id: int, lengths: np.ndarray) -> Batch:
    """``segment_ids``, ``positions`` (int32) and ``weights`` (float32), each (B, T), of
    windows (B, T+1) whose first ``lengths[b]`` tokens are real (the rest padding); see the
    module docstring. Vectorised, O(B T)."""
    b, t = windows.shape[0], windows.shape[1] - 1
    index = np.arange(t + 1, dtype=np.int32)
    lengths = np.asarray(lengths)
    full = bool(np.all(lengths >= t + 1))        # training: no padding, no masks to apply
    valid = None if full else index[None, :] < lengths[:, None]      # (B, T+1)
    ends = windows[:, :-1] == eos_id                                  # input t ends a document
    if not full:
        ends &= valid[:, :-1]
    # a piece of a document starts at each row's first token and after each eos; g counts
    # the starts up to each token over the flattened batch (one cumsum for both outputs)
    starts = np.zeros((b, t), bool)
    starts[:, 0] = True
    starts[:, 1:] = ends[:, :-1]
    g = np.cumsum(starts.reshape(-1), dtype=np.int32)
    first = np.flatnonzero(starts).astype(np.int32)[g - 1].reshape(b, t)   # its start (flat)
    positions = np.arange(b * t, dtype=np.int32).reshape(b, t) - first
    g = g.reshape(b, t)
    segments = g - g[:, :1] + 1
    weights = ~ends if full else valid[:, 1:] & ~ends
    if not full:
        segments[~valid[:, :-1]] = 0
        positions[~valid[:, :-1]] = 0
    return {"segment_ids": segments, "positions": positions,
            "weights": weights.astype(np.float32)}


def batch_from_windows(windows: np.ndarray, pad_id: int, *, eos_id: int | None = None,
                       lengths: np.ndarray | None = None) -> Batch:
    """Splits windows (B, T+1) into inputs/targets/weights, each (B, T).

    With ``eos_id`` (``packing="document"``) the batch also holds ``segment_ids`` and
    ``positions``, and the weights follow the documents (:func:`document_fields`);
    ``lengths`` (B,) counts the real tokens of each window (default: those != pad_id).
    """
    inputs = np.ascontiguousarray(windows[:, :-1], dtype=np.int32)
    targets = np.ascontiguousarray(windows[:, 1:], dtype=np.int32)
    batch = {"inputs": inputs, "targets": targets,
             "weights": (targets != pad_id).astype(np.float32)}
    if eos_id is not None:
        if lengths is None:
            lengths = np.sum(windows != pad_id, axis=1)
        batch.update(document_fields(windows, eos_id, lengths))
    return batch


def pack_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, *,
                  eos_id: int, pad_id: int = 0, pack: bool = True) -> Batch:
    """Prompt/completion examples as rows of ``seq_len`` tokens, loss on the completions.

    Example ``k`` is the tokens ``s = prompt + completion + [eos]``: inputs ``s[:-1]``,
    targets ``s[1:]``, weight 1 where the target is a completion token or the eos (never on
    a prompt token's prediction of another prompt token). With ``pack`` the examples go
    whole, in order, into the first row with room for them (greedy first fit; never split),
    each with its own segment id (1, 2, ... within its row) and positions from 0; without,
    one example per row. Padding: ``pad_id``, segment 0, weight 0.

    Returns ``inputs``, ``targets``, ``segment_ids``, ``positions`` int32 and ``weights``
    float32, each (R, T); R is the number of rows used.
    """
    if seq_len < 1:
        raise UserError(f"seq_len must be >= 1, got {seq_len}")
    rows: list[list[np.ndarray]] = []     # per row: the examples' token arrays (len L + 1)
    room: list[int] = []                  # input slots left in each row
    prompts: list[list[int]] = []
    for k, (prompt, completion) in enumerate(examples):
        prompt = np.asarray(prompt, np.int32).reshape(-1)
        tokens = np.concatenate([prompt, np.asarray(completion, np.int32).reshape(-1),
                                 np.array([eos_id], np.int32)])
        need = len(tokens) - 1
        if need > seq_len:
            raise UserError(f"example {k} has {need + 1} tokens (prompt, completion and eos), "
                            f"more than fit a row of seq_len + 1 = {seq_len + 1}; raise seq_len "
                            "or shorten/drop the example (examples are never split)")
        if need == 0:
            continue
        row = next((i for i, r in enumerate(room) if r >= need), None) if pack else None
        if row is None:
            rows.append([]), room.append(seq_len), prompts.append([])
            row = len(rows) - 1
        rows[row].append(tokens)
        prompts[row].append(len(prompt))
        room[row] -= need
    shape = (len(rows), seq_len)
    out = {"inputs": np.full(shape, pad_id, np.int32), "targets": np.full(shape, pad_id, np.int32),
           "segment_ids": np.zeros(shape, np.int32), "positions": np.zeros(shape, np.int32),
           "weights": np.zeros(shape, np.float32)}
    for r, (row, lengths) in enumerate(zip(rows, prompts)):
        start = 0
        for segment, (tokens, prompt_len) in enumerate(zip(row, lengths), 1):
            n = len(tokens) - 1
            span = slice(start, start + n)
            out["inputs"][r, span], out["targets"][r, span] = tokens[:-1], tokens[1:]
            out["segment_ids"][r, span], out["positions"][r, span] = segment, np.arange(n)
            # target j is token j + 1: a completion token (or the eos) from j = prompt_len - 1
            out["weights"][r, span] = np.arange(n) >= max(prompt_len - 1, 0)
            start += n
    return out
