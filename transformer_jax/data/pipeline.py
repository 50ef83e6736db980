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

Two modes share one iterator API (:class:`LMIterator`):

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
  document, so it costs O(1) reads, plus one permutation (a sort of the
  split's document count) per epoch.  In eval, processes may yield different
  numbers of batches.

``mode="auto"`` picks ``"memory"`` for splits of up to 1,000,000 documents and
``"stream"`` above.

Shuffling uses :func:`transformer_jax.data.shuffle.permutation`, the same on every
platform and NumPy version.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from transformer_jax import storage
from transformer_jax.data.shuffle import RESUME_HINT, permutation
from transformer_jax.data.sources import READ_CHUNK, default_data_dir, iter_texts, open_source
from transformer_jax.data.tokenizers import Tokenizer, get_tokenizer
from transformer_jax.errors import UserError

__all__ = [
    "LMIterator",
    "Batch",
    "make_lm_iterator",
    "pack_documents",
]

#: A batch: ``inputs``/``targets`` int32 (B, T), ``weights`` float32 (B, T).
Batch = dict[str, np.ndarray]

#: ``mode="auto"`` packs splits with at most this many documents in memory.
MAX_IN_MEMORY_DOCUMENTS = 1_000_000


# --------------------------------------------------------------------------
# Packing.


def _token_stream(texts: Iterable[str], tokenizer: Tokenizer) -> np.ndarray:
    """Concatenates ``ids(doc) + [eos]`` over the non-empty documents; (N,) int32."""
    eos = np.array([tokenizer.eos_id], dtype=np.int32)
    parts = []
    for text in texts:
        ids = tokenizer.encode_array(text)
        if ids.size:
            parts.extend((ids, eos))
    if not parts:
        return np.zeros((0,), dtype=np.int32)
    return np.concatenate(parts).astype(np.int32, copy=False)


def _num_windows(num_tokens: int, seq_len: int, pad_final: bool) -> int:
    if num_tokens < 2:
        return 0
    full, rest = divmod(num_tokens - 1, seq_len)
    return full + int(pad_final and rest > 0)


def _gather_windows(
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
    count = _num_windows(len(stream), seq_len, pad_final)
    return _gather_windows(stream, np.arange(count), seq_len, pad_id)


def _batch_from_windows(windows: np.ndarray, pad_id: int) -> Batch:
    """Splits windows (B, T+1) into inputs/targets/weights, each (B, T)."""
    inputs = np.ascontiguousarray(windows[:, :-1], dtype=np.int32)
    targets = np.ascontiguousarray(windows[:, 1:], dtype=np.int32)
    return {
        "inputs": inputs,
        "targets": targets,
        "weights": (targets != pad_id).astype(np.float32),
    }


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
        return _token_stream(iter_texts(source, text_key), tokenizer)
    path = _cache_path(source, name, split, tokenizer, text_key, data_dir)
    remote = storage.is_remote(path)   # a bucket cannot be memory-mapped: read it whole
    if storage.exists(path):
        return np.load(io.BytesIO(storage.read_bytes(path))) if remote else np.load(path, mmap_mode="r")
    stream = _token_stream(iter_texts(source, text_key), tokenizer)
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
    stream of a split that fits in memory, else read document by document until there
    are enough (the same tokens either way)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 2:
        raise UserError(f"max_tokens={max_tokens!r} must be an int >= 2 (the training subset's "
                        "size in tokens), or None for the whole split")
    if cache:
        stream = _load_or_build_stream(source, name, split, tokenizer, text_key, data_dir, True)
    else:
        parts, count = [], 0
        for text in iter_texts(source, text_key):
            part = _token_stream([text], tokenizer)
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


# --------------------------------------------------------------------------
# The iterator.


@dataclasses.dataclass
class _Segment:
    """Unconsumed tokens of one document: its (epoch, doc_pos) and offset."""

    epoch: int
    doc_pos: int
    offset: int
    tokens: np.ndarray


def _check_int(state: dict, key: str, minimum: int = 0) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"iterator state field {key!r} must be an int >= {minimum}, got "
                        f"{value!r}.{RESUME_HINT}")
    return value


class LMIterator(Iterator[Batch]):
    """Iterator of packed LM batches with a saveable position.

    Build it with :func:`make_lm_iterator`.  ``next(it)`` returns a dict with
    ``inputs`` and ``targets`` int32 (B, T) and ``weights`` float32 (B, T),
    where B = ``batch_size`` (this process's rows) and T = ``seq_len``.

    ``get_state()`` returns a JSON-serialisable dict; after ``set_state(s)``
    the iterator yields exactly the batches that followed when ``s`` was
    taken.  See the module docstring for the two modes.

    Attributes:
      batch_size: rows per batch on this process (global batch / process_count).
      global_batch_size: rows per batch over all processes.
      seq_len: T.
      mode: ``"memory"`` or ``"stream"``.
      num_documents: documents in the split.
      num_windows: windows per epoch (memory mode; None in stream mode).
      batches_per_epoch: batches per epoch, or per pass in eval (memory mode;
        None in stream mode).
    """

    def __init__(
        self,
        source: Any,
        *,
        name: str,
        split: str,
        tokenizer: Tokenizer,
        seq_len: int,
        batch_size: int,
        seed: int,
        shuffle: bool,
        repeat: bool,
        process_index: int,
        process_count: int,
        text_key: str,
        mode: str,
        stream: np.ndarray | None = None,
    ):
        self.name, self.split = name, split
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = batch_size
        self.batch_size = batch_size // process_count
        self.seed, self.shuffle, self.repeat = seed, shuffle, repeat
        self.process_index, self.process_count = process_index, process_count
        self.text_key = text_key
        self.mode = mode
        self.num_documents = len(source)
        self._source = source
        self._order_cache: tuple[int, np.ndarray] | None = None
        self.num_windows: int | None = None
        self.batches_per_epoch: int | None = None
        if self.num_documents == 0:
            raise UserError(
                f"dataset {name!r} split {split!r} is empty (0 documents); "
                "prepare the dataset again or choose another dataset/split."
            )
        if mode == "memory":
            self._init_memory(stream)
        else:
            self._init_stream()

    def _describe(self) -> str:
        return f"dataset {self.name!r} split {self.split!r}"

    def _order(self, epoch: int, n: int) -> np.ndarray:
        """The epoch's order of n items (windows or documents), cached."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            order = permutation(n, self.seed, epoch) if self.shuffle else np.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    # ---- memory mode -----------------------------------------------------

    def _init_memory(self, stream: np.ndarray) -> None:
        self._stream = stream
        if len(stream) < 2:
            raise UserError(
                f"{self._describe()} is empty: its {self.num_documents} documents "
                "hold no text. Use a dataset/split with text."
            )
        self.num_windows = _num_windows(len(stream), self.seq_len, not self.repeat)
        if self.repeat:
            self.batches_per_epoch = self.num_windows // self.global_batch_size
            if self.batches_per_epoch == 0:
                raise UserError(
                    f"{self._describe()} is too small: its {len(stream)} tokens pack "
                    f"into {self.num_windows} windows of seq_len+1={self.seq_len + 1} "
                    f"tokens, fewer than one batch of {self.global_batch_size}. Use a "
                    "smaller seq_len or batch_size, or a larger dataset/split."
                )
        else:
            self.batches_per_epoch = -(-self.num_windows // self.global_batch_size)
        self._epoch = 0
        self._index = 0

    def _next_memory(self) -> Batch:
        if not self.repeat and self._index >= self.batches_per_epoch:
            raise StopIteration
        order = self._order(self._epoch, self.num_windows)
        b = self.batch_size
        first = self._index * self.global_batch_size + self.process_index * b
        positions = np.arange(first, first + b)
        window_ids = order[positions[positions < self.num_windows]]
        windows = np.full((b, self.seq_len + 1), self.tokenizer.pad_id, np.int32)
        windows[: len(window_ids)] = _gather_windows(
            self._stream, window_ids, self.seq_len, self.tokenizer.pad_id
        )
        self._index += 1
        if self.repeat and self._index == self.batches_per_epoch:
            self._epoch, self._index = self._epoch + 1, 0
        return _batch_from_windows(windows, self.tokenizer.pad_id)

    # ---- stream mode -----------------------------------------------------

    def _init_stream(self) -> None:
        self._shard_size = len(range(self.process_index, self.num_documents, self.process_count))
        if self._shard_size == 0:
            raise UserError(
                f"{self._describe()} has {self.num_documents} documents, too few to "
                f"give process {self.process_index} of {self.process_count} any; use "
                "fewer processes or mode='memory'."
            )
        self._seek(0, 0, 0)

    def _seek(self, epoch: int, doc_pos: int, token_offset: int) -> None:
        self._segments: collections.deque[_Segment] = collections.deque()
        self._buffered = 0
        self._head = (epoch, doc_pos, token_offset)
        self._reader = self._read_documents(epoch, doc_pos, token_offset)

    def _shard(self, epoch: int) -> np.ndarray:
        """Indices of this process's documents in the epoch, in reading order."""
        order = self._order(epoch, self.num_documents)
        return order[self.process_index :: self.process_count]

    def _read_documents(self, epoch: int, doc_pos: int, token_offset: int):
        """Yields a _Segment per non-empty document from (epoch, doc_pos) on."""
        eos = np.array([self.tokenizer.eos_id], dtype=np.int32)
        while True:
            shard = self._shard(epoch)
            tokens_read = 0
            start_pos = doc_pos
            for chunk_start in range(doc_pos, len(shard), READ_CHUNK):
                chunk = shard[chunk_start : chunk_start + READ_CHUNK]
                for pos, text in enumerate(
                    iter_texts(self._source, self.text_key, chunk), chunk_start
                ):
                    ids = self.tokenizer.encode_array(text)
                    if not ids.size:
                        continue
                    ids = np.concatenate([ids, eos])
                    offset = token_offset if pos == start_pos else 0
                    tokens_read += len(ids) - offset
                    yield _Segment(epoch, pos, offset, ids[offset:])
            if not self.repeat:
                return
            if start_pos == 0 and tokens_read == 0:
                raise UserError(
                    f"{self._describe()} is empty: process {self.process_index}'s "
                    f"{len(shard)} documents hold no text. Use a dataset/split with text."
                )
            epoch, doc_pos, token_offset = epoch + 1, 0, 0

    def _fill(self, count: int) -> None:
        while self._buffered < count:
            segment = next(self._reader, None)
            if segment is None:
                return
            self._segments.append(segment)
            self._buffered += len(segment.tokens)

    def _take(self, count: int, consume: int) -> np.ndarray:
        """Returns the first ``count`` buffered tokens and drops ``consume`` of them."""
        parts, needed = [], count
        for segment in self._segments:
            parts.append(segment.tokens[:needed])
            needed -= len(parts[-1])
            if needed == 0:
                break
        last = self._segments[0]
        while consume:
            segment = self._segments[0]
            if len(segment.tokens) <= consume:
                consume -= len(segment.tokens)
                self._buffered -= len(segment.tokens)
                last = self._segments.popleft()
            else:
                segment.tokens = segment.tokens[consume:]
                segment.offset += consume
                self._buffered -= consume
                consume = 0
        if self._segments:
            first = self._segments[0]
            self._head = (first.epoch, first.doc_pos, first.offset)
        else:
            self._head = (last.epoch, last.doc_pos + 1, 0)
        return np.concatenate(parts)

    def _next_stream(self) -> Batch:
        b, t = self.batch_size, self.seq_len
        needed = b * t + 1
        self._fill(needed)
        if self._buffered >= needed:
            tokens = self._take(needed, b * t)
        elif not self.repeat and self._buffered >= 2:
            tokens = np.full((needed,), self.tokenizer.pad_id, np.int32)
            rest = self._take(self._buffered, self._buffered)
            tokens[: len(rest)] = rest
        else:
            if self._head == (0, 0, 0) and self._buffered == 0:
                raise UserError(
                    f"{self._describe()} is empty: process {self.process_index}'s "
                    "documents hold no text. Use a dataset/split with text."
                )
            raise StopIteration
        windows = np.lib.stride_tricks.sliding_window_view(tokens, t + 1)[::t]
        return _batch_from_windows(windows, self.tokenizer.pad_id)

    # ---- public API --------------------------------------------------------

    def __iter__(self) -> LMIterator:
        return self

    def __next__(self) -> Batch:
        if self.mode == "memory":
            return self._next_memory()
        return self._next_stream()

    def get_state(self) -> dict[str, Any]:
        """Returns the position of the next batch as a JSON-serialisable dict."""
        if self.mode == "memory":
            return {"mode": "memory", "epoch": self._epoch, "index": self._index}
        epoch, doc_pos, offset = self._head
        return {
            "mode": "stream",
            "epoch": int(epoch),
            "doc_pos": int(doc_pos),
            "token_offset": int(offset),
            "process_index": self.process_index,
            "process_count": self.process_count,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Moves to a position returned by :meth:`get_state`.

        Raises UserError if the state belongs to another mode or, in stream
        mode, to another process layout.
        """
        if not isinstance(state, dict) or state.get("mode") != self.mode:
            raise UserError(
                f"cannot restore {state!r}: this iterator is in {self.mode!r} mode.{RESUME_HINT}"
            )
        if self.mode == "memory":
            epoch, index = _check_int(state, "epoch"), _check_int(state, "index")
            if index > self.batches_per_epoch or (self.repeat and index == self.batches_per_epoch):
                raise UserError(
                    f"iterator state index {index} is out of range for "
                    f"{self.batches_per_epoch} batches per epoch.{RESUME_HINT}"
                )
            self._epoch, self._index = epoch, index
            return
        if (state.get("process_index"), state.get("process_count")) != (
            self.process_index, self.process_count
        ):
            raise UserError(
                "stream-mode state was saved by process "
                f"{state.get('process_index')} of {state.get('process_count')}, "
                f"but this is process {self.process_index} of {self.process_count}."
            )
        epoch, doc_pos = _check_int(state, "epoch"), _check_int(state, "doc_pos")
        offset = _check_int(state, "token_offset")
        if doc_pos > self._shard_size:
            raise UserError(
                f"iterator state doc_pos {doc_pos} is beyond this process's "
                f"{self._shard_size} documents.{RESUME_HINT}"
            )
        self._seek(epoch, doc_pos, offset)


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

    Returns:
      An :class:`LMIterator` yielding ``{"inputs", "targets": int32 (B, T),
      "weights": float32 (B, T)}`` with ``B = batch_size // process_count``.

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
    return LMIterator(
        source,
        name=name,
        split=split,
        tokenizer=tokenizer,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        shuffle=shuffle,
        repeat=repeat,
        process_index=process_index,
        process_count=process_count,
        text_key=text_key,
        mode=mode,
        stream=stream,
    )
