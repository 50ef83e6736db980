"""The two language-model iterators behind :func:`transformer_jax.data.make_lm_iterator`,
one class per mode (see :mod:`transformer_jax.data.pipeline` for the packing, the modes and
their states):

* :class:`MemoryLMIterator`: windows of a token stream held in memory, shuffled per epoch;
  state ``{"mode": "memory", "epoch", "index"}``.
* :class:`StreamingLMIterator`: documents read, tokenized and packed as it goes; state
  ``{"mode": "stream", "epoch", "doc_pos", "token_offset", "process_index",
  "process_count"}``.

Both derive from :class:`LMIterator`, which holds the shared settings, the per-epoch order
and the validation common to ``set_state``.  The states are those the single ``LMIterator``
class saved before the split, so checkpoints taken then resume.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from transformer_jax.data.packing import Batch, batch_from_windows, gather_windows, num_windows
from transformer_jax.data.shuffle import RESUME_HINT, shuffled
from transformer_jax.data.sources import READ_CHUNK, iter_text_chunks
from transformer_jax.data.tokenizers import Tokenizer
from transformer_jax.errors import UserError

__all__ = ["LMIterator", "MemoryLMIterator", "StreamingLMIterator"]


def _check_int(state: dict, key: str, minimum: int = 0) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UserError(f"iterator state field {key!r} must be an int >= {minimum}, got "
                        f"{value!r}.{RESUME_HINT}")
    return value


class LMIterator(Iterator[Batch], abc.ABC):
    """Iterator of packed LM batches with a saveable position (the base of both modes).

    Build one with :func:`~transformer_jax.data.make_lm_iterator`.  ``next(it)`` returns a
    dict with ``inputs`` and ``targets`` int32 (B, T) and ``weights`` float32 (B, T), where
    B = ``batch_size`` (this process's rows) and T = ``seq_len``.

    ``get_state()`` returns a JSON-serialisable dict; after ``set_state(s)`` the iterator
    yields exactly the batches that followed when ``s`` was taken.

    Attributes:
      batch_size: rows per batch on this process (global batch / process_count).
      global_batch_size: rows per batch over all processes.
      seq_len: T.
      mode: ``"memory"`` or ``"stream"``.
      num_documents: documents in the split.
      num_windows: windows per epoch (memory mode; None in stream mode).
      batches_per_epoch: batches per epoch, or per pass in eval (memory mode; None in
        stream mode).
    """

    mode: str = ""

    def __init__(self, *, name: str, split: str, tokenizer: Tokenizer, seq_len: int,
                 batch_size: int, seed: int, shuffle: bool, repeat: bool, process_index: int,
                 process_count: int, num_documents: int, packing: str = "concatenate"):
        self.name, self.split = name, split
        self.packing = packing
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.global_batch_size = batch_size
        self.batch_size = batch_size // process_count
        self.seed, self.shuffle, self.repeat = seed, shuffle, repeat
        self.process_index, self.process_count = process_index, process_count
        self.num_documents = num_documents
        self.num_windows: int | None = None
        self.batches_per_epoch: int | None = None
        if num_documents == 0:
            raise UserError(
                f"dataset {name!r} split {split!r} is empty (0 documents); "
                "prepare the dataset again or choose another dataset/split."
            )

    def _batch(self, windows: np.ndarray, lengths: np.ndarray) -> Batch:
        """The batch of windows (B, T+1) with ``lengths`` (B,) real tokens each."""
        if self.packing == "document":
            return batch_from_windows(windows, self.tokenizer.pad_id,
                                      eos_id=self.tokenizer.eos_id, lengths=lengths)
        return batch_from_windows(windows, self.tokenizer.pad_id)

    def _describe(self) -> str:
        return f"dataset {self.name!r} split {self.split!r}"

    def _items(self, epoch: int, n: int, positions: np.ndarray) -> np.ndarray:
        """The items (windows or documents) at ``positions`` of the epoch's order of ``n``:
        looked up one by one (:func:`~transformer_jax.data.shuffle.shuffled`), O(1) each."""
        return shuffled(positions, n, self.seed, epoch) if self.shuffle else positions

    def __iter__(self) -> LMIterator:
        return self

    @abc.abstractmethod
    def __next__(self) -> Batch:
        """The next batch (see the class docstring)."""

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Returns the position of the next batch as a JSON-serialisable dict."""

    @abc.abstractmethod
    def _restore(self, state: dict[str, Any]) -> None:
        """Moves to ``state``, whose ``mode`` is already checked."""

    def set_state(self, state: dict[str, Any]) -> None:
        """Moves to a position returned by :meth:`get_state`.

        Raises UserError if the state belongs to another mode or, in stream mode, to
        another process layout, or does not fit this data.
        """
        if not isinstance(state, dict) or state.get("mode") != self.mode:
            raise UserError(
                f"cannot restore {state!r}: this iterator is in {self.mode!r} mode.{RESUME_HINT}"
            )
        self._restore(state)


class MemoryLMIterator(LMIterator):
    """Batches of windows of a token stream held in memory (``mode="memory"``).

    Windows are shuffled per epoch; process ``p`` of ``P`` yields rows ``[p B/P,
    (p+1) B/P)`` of every global batch.  State ``{"mode", "epoch", "index"}``, the same for
    every process.
    """

    mode = "memory"

    def __init__(self, stream: np.ndarray, **settings):
        super().__init__(**settings)
        self._stream = stream
        if len(stream) < 2:
            raise UserError(
                f"{self._describe()} is empty: its {self.num_documents} documents "
                "hold no text. Use a dataset/split with text."
            )
        self.num_windows = num_windows(len(stream), self.seq_len, not self.repeat)
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

    def __next__(self) -> Batch:
        if not self.repeat and self._index >= self.batches_per_epoch:
            raise StopIteration
        b = self.batch_size
        first = self._index * self.global_batch_size + self.process_index * b
        positions = np.arange(first, first + b)
        window_ids = self._items(self._epoch, self.num_windows,
                                 positions[positions < self.num_windows])
        windows = np.full((b, self.seq_len + 1), self.tokenizer.pad_id, np.int32)
        windows[: len(window_ids)] = gather_windows(
            self._stream, window_ids, self.seq_len, self.tokenizer.pad_id
        )
        lengths = np.zeros((b,), np.int64)
        lengths[: len(window_ids)] = np.clip(
            len(self._stream) - np.asarray(window_ids, np.int64) * self.seq_len, 0, self.seq_len + 1)
        self._index += 1
        if self.repeat and self._index == self.batches_per_epoch:
            self._epoch, self._index = self._epoch + 1, 0
        return self._batch(windows, lengths)

    def get_state(self) -> dict[str, Any]:
        return {"mode": "memory", "epoch": self._epoch, "index": self._index}

    def _restore(self, state: dict[str, Any]) -> None:
        epoch, index = _check_int(state, "epoch"), _check_int(state, "index")
        if index > self.batches_per_epoch or (self.repeat and index == self.batches_per_epoch):
            raise UserError(
                f"iterator state index {index} is out of range for "
                f"{self.batches_per_epoch} batches per epoch.{RESUME_HINT}"
            )
        self._epoch, self._index = epoch, index


@dataclasses.dataclass
class _Segment:
    """Unconsumed tokens of one document: its (epoch, doc_pos) and offset."""

    epoch: int
    doc_pos: int
    offset: int
    tokens: np.ndarray



class StreamingLMIterator(LMIterator):
    """Batches packed from documents read and tokenized as it goes (``mode="stream"``), for
    splits too big to tokenize up front.

    Documents are shuffled per epoch; process ``p`` of ``P`` reads the documents at permuted
    positions ``p, p+P, ...`` and packs them into batches of ``B/P`` consecutive windows.
    State: the first token not yet consumed, ``{"mode", "epoch", "doc_pos",
    "token_offset", "process_index", "process_count"}``.
    """

    mode = "stream"

    def __init__(self, source: Any, *, text_key: str, **settings):
        super().__init__(num_documents=len(source), **settings)
        self._source = source
        self.text_key = text_key
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

    def _shard(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Documents ``start:stop`` of this process's share of the epoch, in reading order
        (the documents at permuted positions ``p, p+P, ...``)."""
        stop = min(stop, self._shard_size)
        positions = self.process_index + self.process_count * np.arange(start, max(start, stop))
        return self._items(epoch, self.num_documents, positions)

    def _read_documents(self, epoch: int, doc_pos: int, token_offset: int):
        """Yields a _Segment per non-empty document from (epoch, doc_pos) on."""
        eos = np.array([self.tokenizer.eos_id], dtype=np.int32)
        while True:
            tokens_read = 0
            start_pos = doc_pos
            for chunk_start in range(doc_pos, self._shard_size, READ_CHUNK):
                chunk = self._shard(epoch, chunk_start, chunk_start + READ_CHUNK)
                texts = [text for texts in iter_text_chunks(self._source, self.text_key, chunk)
                         for text in texts]
                for pos, ids in enumerate(self.tokenizer.encode_batch(texts), chunk_start):
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
                    f"{self._shard_size} documents hold no text. Use a dataset/split with text."
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

    def __next__(self) -> Batch:
        b, t = self.batch_size, self.seq_len
        needed = b * t + 1
        self._fill(needed)
        if self._buffered >= needed:
            tokens = self._take(needed, b * t)
            real = needed
        elif not self.repeat and self._buffered >= 2:
            tokens = np.full((needed,), self.tokenizer.pad_id, np.int32)
            rest = self._take(self._buffered, self._buffered)
            tokens[: len(rest)] = rest
            real = len(rest)
        else:
            if self._head == (0, 0, 0) and self._buffered == 0:
                raise UserError(
                    f"{self._describe()} is empty: process {self.process_index}'s "
                    "documents hold no text. Use a dataset/split with text."
                )
            raise StopIteration
        windows = np.lib.stride_tricks.sliding_window_view(tokens, t + 1)[::t]
        return self._batch(windows, np.clip(real - t * np.arange(b), 0, t + 1))

    def get_state(self) -> dict[str, Any]:
        epoch, doc_pos, offset = self._head
        return {
            "mode": "stream",
            "epoch": int(epoch),
            "doc_pos": int(doc_pos),
            "token_offset": int(offset),
            "process_index": self.process_index,
            "process_count": self.process_count,
        }

    def _restore(self, state: dict[str, Any]) -> None:
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
