"""Batches made on a background thread, so that reading, tokenizing and packing the next
batches overlaps the training step (:class:`Background`).

The wrapped iterator is used by one thread at a time: the producer thread calls its
``next`` and ``get_state`` (in that order, per batch) and puts ``(batch, state)`` into a
queue of at most ``depth`` items; ``set_state`` stops the producer before it touches the
iterator. So the state the consumer sees is exactly the plain iterator's state after the
batches the consumer took, and checkpoint/resume stays exact.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["Background"]

# How often (seconds) a producer blocked on a full queue looks whether it should stop.
_POLL_S = 0.05


class _End:
    """Put by the producer after the wrapped iterator's last batch."""


class _Failed:
    """Put by the producer when the wrapped iterator raised: the consumer re-raises it."""

    def __init__(self, error: BaseException):
        self.error = error


def _put(items: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Puts ``item``, waiting while the queue is full; False if told to stop meanwhile."""
    while not stop.is_set():
        try:
            items.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(iterator: Any, items: queue.Queue, stop: threading.Event, stateful: bool) -> None:
    """The producer thread: ``(batch, state after it)`` per batch, then an end or a failure.

    A plain function (not a method) so that the thread holds no reference to the
    :class:`Background`, which can then be collected (and its producer stopped)."""
    try:
        while not stop.is_set():
            try:
                batch = next(iterator)
            except StopIteration:
                _put(items, _End(), stop)
                return
            state = iterator.get_state() if stateful else None
            if not _put(items, (batch, state), stop):
                return
    except BaseException as e:   # noqa: BLE001 - handed to the consumer, which re-raises it
        _put(items, _Failed(e), stop)


class Background(Iterator[dict]):
    """``iterator``'s batches, produced on a daemon thread up to ``depth`` batches ahead.

    * ``next()`` returns the same batches in the same order as the plain iterator; an
      exception the iterator raised on the producer thread is re-raised here.
    * ``get_state()`` is the iterator's state after the last batch ``next()`` returned (not
      the producer's position, which is ahead); ``set_state(s)`` stops the producer, moves
      the iterator to ``s`` and continues from there. Both need the iterator to have them.
    * The producer starts at the first ``next()``, so a ``set_state`` right after building
      (a resumed run) reads nothing twice. ``close()`` stops it; so does garbage collection.

    ``depth`` >= 1 is the queue's size.
    """

    def __init__(self, iterator: Iterator[dict], depth: int = 2):
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1 (batches made ahead)")
        self.iterator, self.depth = iterator, depth
        self._stateful = hasattr(iterator, "get_state")
        self._state = iterator.get_state() if self._stateful else None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._items: queue.Queue = queue.Queue(maxsize=depth)
        self._finished = False

    def _start(self) -> None:
        self._stop = threading.Event()
        self._items = queue.Queue(maxsize=self.depth)
        self._thread = threading.Thread(
            target=_produce, args=(self.iterator, self._items, self._stop, self._stateful),
            name="transformer_jax-batches", daemon=True)
        self._thread.start()

    def __iter__(self) -> Background:
        return self

    def __next__(self) -> dict:
        if self._finished:
            raise StopIteration
        if self._thread is None:
            self._start()
        item = self._items.get()
        if isinstance(item, _End):
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._finished = True
            raise item.error
        batch, self._state = item
        return batch

    def get_state(self) -> Any:
        """The wrapped iterator's state after the last batch taken (a copy)."""
        if not self._stateful:
            raise AttributeError(f"{type(self.iterator).__name__} has no get_state")
        return copy.deepcopy(self._state)

    def set_state(self, state: Any) -> None:
        """Stops the producer, restores ``state`` into the iterator; the next ``next()``
        starts a producer from there."""
        self.close()
        self.iterator.set_state(state)
        self._state = self.iterator.get_state()
        self._finished = False

    def close(self) -> None:
        """Stops the producer thread and waits for it (it finishes the batch in hand)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join()

    def __del__(self):
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    def __getattr__(self, name: str):
        """Other attributes (``batch_size``, ``mode``...) are the wrapped iterator's."""
        if name == "iterator":
            raise AttributeError(name)
        return getattr(self.iterator, name)
