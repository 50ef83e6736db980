"""Language-model input pipeline: TFDS documents -> packed, sharded batches.

Documents come from a source of :mod:`transformer_jax.data.sources` (a TFDS
dataset, the embedded ``python_stdlib``, or any in-memory sequence of strings).

Packing.  Every non-empty document is tokenized and followed by ``eos_id``;
documents are concatenated, in order, into one token stream ``s`` of length
``N``.  Window ``k`` is ``s[k*T : k*T + T + 1]`` (``T`` = ``seq_len``), so
consecutive windows overlap by one token and every token after the first is a
target exactly once.  A batch of ``B`` windows ``w`` (shape ``(B, T+1)``) is::

    {"inputs":  w[:, :-1]            int32   (B, T)
     "targets": w[:, 1:]             int32   (B, T)   # inputs shifted by one
     "weights": targets != pad_id    float32 (B, T)}  # 1.0 on real tokens

Training (``repeat=True``) uses full windows only (the last ``< T`` tokens of
the stream are not used).  Evaluation (``repeat=False``) is one pass that loses
nothing: the last partial window is padded with ``pad_id`` and the last partial
batch is filled with all-padding rows; padding has weight 0.  Attention is not
masked between packed documents; ``eos`` marks where one ends.

``packing="document"`` keeps the documents apart: each batch also holds ``segment_ids``
and ``positions`` int32 (B, T) (the document of each input token within its window, from
1, padding 0; its position from 0 at the start of its document's piece in the window), and
an input eos, whose target starts the next document, weighs 0
(:func:`transformer_jax.data.packing.document_fields`). The windows, the order and the
iterator states are those of the default ``packing="concatenate"``.

Two modes, one iterator class each (:mod:`transformer_jax.data.lm_iterators`), share one
iterator API (:class:`~transformer_jax.data.lm_iterators.LMIterator`):

* ``"memory"``: the whole split is tokenized once into an int32 token stream,
  cached as ``.npy`` under ``<data_dir>/transformer_jax_cache/`` (keyed by
  dataset, version, split, its size, and the tokenizer) and memory-mapped (read
  whole when ``data_dir`` is a bucket, ``gs://...``).
  Windows are shuffled per epoch by a permutation that is a pure function of
  ``(seed, epoch)``.  ``batch_size`` is the *global* batch; process ``p`` of
  ``P`` yields rows ``[p*B/P, (p+1)*B/P)`` of every global batch, so the
  processes' batches stacked in process order are exactly the single-process
  batches.  (Each process reads and tokenizes the whole split, which is
  small in this mode, and keeps only its rows.)  Training drops each epoch's
  last ``W mod B`` windows (a different
  set each epoch when shuffling).  State: ``{"mode", "epoch", "index"}``; it
  does not depend on the process, so it can be restored with another
  ``process_count``.
* ``"stream"``: for splits too big to tokenize up front (``lm1b``'s 30M
  sentences).  *Documents* are shuffled per epoch by the same kind of
  permutation; process ``p`` reads only the documents at permuted positions
  ``p, p+P, p+2P, ...`` (a disjoint shard, covering the split with the other
  processes) and packs them on the fly into batches of ``B/P`` consecutive
  windows (so the rows of one batch are neighbouring text, and only the
  document order is random).  In training the stream runs on across epoch
  boundaries, so no token is dropped.  The state is the position of the
  first token not yet consumed, ``{"mode", "epoch", "doc_pos",
  "token_offset", "process_index", "process_count"}``; restoring re-reads one
  document, so it costs O(1) reads (each document's place in the epoch's
  order is computed on its own, with no sort of the split).  In eval,
  processes may yield different numbers of batches.

``mode="auto"`` picks ``"memory"`` for splits of up to 1,000,000 documents and
``"stream"`` above.

Shuffling looks each position up in a keyed bijection of ``(seed, epoch)``
(:func:`transformer_jax.data.shuffle.shuffled`, O(1) per index, never an argsort
of the split), the same on every platform and NumPy version.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from typing import Any

import numpy as np

from transformer_jax import storage
from transformer_jax.data.lm_iterators import LMIterator, MemoryLMIterator, StreamingLMIterator
from transformer_jax.data.packing import check_packing, token_stream
from transformer_jax.data.sources import default_data_dir, iter_text_chunks, iter_texts, open_source
from transformer_jax.data.tokenizers import Tokenizer, get_tokenizer
from transformer_jax.errors import UserError

__all__ = ["MAX_IN_MEMORY_DOCUMENTS", "make_lm_iterator"]

#: ``mode="auto"`` packs splits with at most this many documents in memory.
MAX_IN_MEMORY_DOCUMENTS = 1_000_000


# --------------------------------------------------------------------------
# Token-stream cache for memory mode.


def _cache_path(source: Any, name: str, split: str, tokenizer: Tokenizer,
                text_key: str, data_dir: str) -> str:
    info = getattr(source, "dataset_info", None)
    full_name = getattr(info, "full_name", None)
    full_name = full_name if isinstance(full_name, str) else name
    num_bytes = None
    try:
        num_bytes = info.splits[split].num_bytes
    except (AttributeError, KeyError, TypeError, ValueError):
        pass
    num_bytes = num_bytes if isinstance(num_bytes, int) else "unknown"
    key = "|".join(
        ["v1", full_name, split, str(len(source)), str(num_bytes),
         tokenizer.cache_key, text_key]
    )
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{full_name}-{split}-{tokenizer.cache_key}")
    return os.path.join(data_dir, "transformer_jax_cache", f"{readable}-{digest}.npy")


def _load_or_build_stream(source, name, split, tokenizer, text_key, data_dir, cache):
    if not cache:
        return token_stream(iter_texts(source, text_key), tokenizer)
    path = _cache_path(source, name, split, tokenizer, text_key, data_dir)
    remote = storage.is_remote(path)   # a bucket cannot be memory-mapped: read it whole
    if storage.exists(path):
        return np.load(io.BytesIO(storage.read_bytes(path))) if remote else np.load(path, mmap_mode="r")
    stream = token_stream(iter_texts(source, text_key), tokenizer)
    if remote:
        npy = io.BytesIO()
        np.save(npy, stream)
        storage.write_bytes(path, npy.getvalue())
        return stream
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp_path = f"{path[:-4]}.tmp{os.getpid()}.npy"
    np.save(tmp_path, stream)
    os.replace(tmp_path, path)
    return stream


def _first_tokens(source, name, split, tokenizer, text_key, data_dir, cache,
                  max_tokens: int) -> np.ndarray:
    """The first ``max_tokens`` tokens of the split's stream: from the (cached) whole
    stream of a split that fits in memory, else read a chunk of documents at a time until
    there are enough (the same tokens either way)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 2:
        raise UserError(f"max_tokens={max_tokens!r} must be an int >= 2 (the training subset's "
                        "size in tokens), or None for the whole split")
    if cache:
        stream = _load_or_build_stream(source, name, split, tokenizer, text_key, data_dir, True)
    else:
        parts, count = [], 0
        for texts in iter_text_chunks(source, text_key):
            part = token_stream(texts, tokenizer)
            parts.append(part)
            count += len(part)
            if count >= max_tokens:
                break
        stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    if len(stream) < max_tokens:
        raise UserError(f"dataset {name!r} split {split!r} holds {len(stream)} tokens, fewer than "
                        f"the {max_tokens} asked for; lower the subset size (task.train_tokens) "
                        "or use a larger dataset")
    return np.array(stream[:max_tokens], dtype=np.int32)


def make_lm_iterator(
    dataset: Any = "python_stdlib",
    split: str = "train",
    *,
    tokenizer: str | Tokenizer = "byte",
    seq_len: int,
    batch_size: int,
    seed: int = 0,
    shuffle: bool = True,
    repeat: bool = True,
    data_dir: str | None = None,
    process_index: int = 0,
    process_count: int = 1,
    text_key: str = "text",
    mode: str = "auto",
    cache: bool = True,
    max_tokens: int | None = None,
    packing: str = "concatenate",
) -> LMIterator:
    """Returns an iterator of packed language-model batches.

    Args:
      dataset: TFDS name (``"python_stdlib"``, ``"lm1b"``, ...) or an in-memory
        sequence of documents (see :func:`open_source`).
      split: split name.
      tokenizer: a :class:`Tokenizer` or a spec for :func:`get_tokenizer`.
      seq_len: T, tokens per row.
      batch_size: global rows per step; must be divisible by
        ``process_count``; each process yields ``batch_size // process_count``.
      seed: shuffling seed; the order of an epoch is a function of (seed, epoch).
      shuffle: shuffle windows (memory mode) or documents (stream mode).
      repeat: True: endless, over epochs (training); False: one pass, padded
        to whole batches (evaluation).
      data_dir: TFDS data directory, also holding the token-stream cache
        (default :func:`default_data_dir`).
      process_index, process_count: this process's place among the data-loading
        processes (usually ``jax.process_index()``, ``jax.process_count()``).
      text_key: name of the text feature in the dataset's examples.
      mode: ``"memory"``, ``"stream"`` or ``"auto"`` (see the module docstring).
      cache: in memory mode, cache the token stream of a TFDS split on disk.
      max_tokens: use only the first ``max_tokens`` tokens of the split's token
        stream (its documents in the source's order, each followed by eos), in
        memory mode: nested subsets of one corpus, for data-scaling studies.
      packing: ``"concatenate"`` (attention crosses documents) or ``"document"`` (the
        batches also hold ``segment_ids`` and ``positions``; see the module docstring).

    Returns:
      An :class:`LMIterator` yielding ``{"inputs", "targets": int32 (B, T),
      "weights": float32 (B, T)}`` (``packing="document"``: also ``"segment_ids",
      "positions": int32 (B, T)``) with ``B = batch_size // process_count``.

    Raises:
      UserError: bad arguments, or an empty split / one too small for a batch.
    """
    if seq_len < 1 or batch_size < 1:
        raise UserError(f"seq_len and batch_size must be >= 1, got {seq_len}, {batch_size}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise UserError(
            f"need 0 <= process_index < process_count, got {process_index}, {process_count}"
        )
    if batch_size % process_count:
        raise UserError(
            f"batch_size {batch_size} is not divisible by process_count {process_count}"
        )
    if mode not in ("auto", "memory", "stream"):
        raise UserError(f"mode must be 'auto', 'memory' or 'stream', got {mode!r}")
    check_packing(packing)
    tokenizer = get_tokenizer(tokenizer)
    data_dir = data_dir or default_data_dir()
    source, name = open_source(dataset, split, data_dir=data_dir)
    cache = cache and isinstance(dataset, str)
    if mode == "auto":
        mode = "memory" if len(source) <= MAX_IN_MEMORY_DOCUMENTS else "stream"
    stream = None
    if max_tokens is not None:
        stream = _first_tokens(source, name, split, tokenizer, text_key, data_dir,
                               cache and mode == "memory", max_tokens)
        mode = "memory"
    elif mode == "memory" and len(source):
        stream = _load_or_build_stream(source, name, split, tokenizer, text_key, data_dir, cache)
    settings = dict(name=name, split=split, tokenizer=tokenizer, seq_len=seq_len,
                    batch_size=batch_size, seed=seed, shuffle=shuffle, repeat=repeat,
                    process_index=process_index, process_count=process_count,
                    packing=packing)
    if mode == "memory":
        return MemoryLMIterator(stream, num_documents=len(source), **settings)
    return StreamingLMIterator(source, text_key=text_key, **settings)
