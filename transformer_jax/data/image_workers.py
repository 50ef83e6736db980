"""Decoding and augmenting image batches in worker processes (:class:`BatchPool`).

The parent decides everything that orders or seeds the data: which example ids a batch
holds and in which rows, the epoch, the augmentation seed. A worker only runs the pure
per-example function ``images.prepare_row`` (the same one the in-process path runs) on the
rows it is handed and writes the float32 images straight into a shared-memory slot of
the batch (a file in ``/dev/shm`` both sides map), so no image is pickled. A batch is
split into chunks across the workers; the parent waits for the chunks of the oldest batch
first, so batches come out in order and each row's image depends only on
``(seed, epoch, index)``: never on the worker, the chunking or the worker count.

Workers start from a ``forkserver`` (a clean process that imported this module once): not
``fork``, which is unsafe once JAX's threads run, and not ``spawn``, which would import
the package again in every worker.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import multiprocessing
import os
import pickle
import tempfile
from typing import Any

import numpy as np

from transformer_jax.errors import UserError

__all__ = ["BatchPool", "host_cores", "worker_context"]


def host_cores() -> int:
    """The cores this process may run on (its affinity mask, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # pragma: no cover - not Linux
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- worker side

_WORKER: dict[str, Any] = {}


def _init_worker(source, prepare, params: dict) -> None:
    from transformer_jax.host_memory import tune_malloc

    tune_malloc(warn=False)   # keep each image's freed buffers: no page faults per image
    _WORKER.update(source=source, prepare=prepare, params=params, maps={})


def _slot(path: str, shape: tuple[int, ...]) -> np.ndarray:
    maps = _WORKER["maps"]
    if path not in maps:
        maps[path] = np.memmap(path, dtype=np.float32, mode="r+", shape=shape)
    return maps[path]


def _fill(path: str, shape: tuple[int, ...], rows: list[int], ids: list[int],
          epoch: int) -> list[dict]:
    """Writes the images of examples ``ids`` into rows ``rows`` of the slot at ``path``;
    returns each example without its image (labels, captions) for the parent."""
    from transformer_jax.data.sources import read_examples

    out, rest = _slot(path, shape), []
    for row, i, example in zip(rows, ids, read_examples(_WORKER["source"], ids)):
        out[row] = _WORKER["prepare"](example, i, epoch, _WORKER["params"])
        rest.append({k: v for k, v in example.items() if k != "image"})
    return rest


# ----------------------------------------------------------------------------- parent side

def worker_context():
    """The multiprocessing context of the workers: a forkserver that preloaded this module."""
    ctx = multiprocessing.get_context("forkserver")
    # the server imports these once (workers fork from it); not the parent's __main__
    ctx.set_forkserver_preload([__name__, "transformer_jax.data.images"])
    return ctx


class BatchPool:
    """``workers`` processes that fill batches of ``batch_size`` images of ``shape`` (S, S,
    C), up to ``depth`` batches in flight; ``prepare(example, index, epoch, params)`` (a
    module-level function: it is pickled by name) makes one row.

    ``submit(key, ids, epoch)`` queues the batch whose row r holds example ``ids[r]``;
    ``take()`` returns ``(key, images, rests)`` of the oldest queued batch (images a fresh
    float32 (len(ids), S, S, C) array, rests each example without its image).
    ``discard()`` drops all queued batches; ``close()`` stops the workers.
    """

    def __init__(self, source, prepare, params: dict, *, workers: int, batch_size: int,
                 shape: tuple[int, int, int], depth: int = 3):
        if workers < 1:
            raise ValueError(f"workers={workers} must be >= 1")
        try:
            pickle.dumps(source)
        except Exception as e:   # noqa: BLE001 - any failure to pickle means the same here
            raise UserError(f"the {params['name']!r} image source ({type(source).__name__}) "
                            f"cannot be sent to worker processes ({e}); set data_workers=0 to "
                            "preprocess in the training process") from e
        self.workers, self.depth = workers, max(1, depth)
        self._shape = (batch_size, *shape)
        self._chunk = max(1, -(-batch_size // (2 * workers)))   # two chunks per worker a batch
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._paths = []
        for _ in range(self.depth):
            fd, path = tempfile.mkstemp(prefix="transformer_jax_batch_", dir=shm)
            os.ftruncate(fd, int(np.prod(self._shape)) * 4)
            os.close(fd)
            self._paths.append(path)
        self._free = collections.deque(range(self.depth))
        self._queued: collections.deque = collections.deque()
        self._executor = cf.ProcessPoolExecutor(workers, mp_context=worker_context(),
                                                initializer=_init_worker,
                                                initargs=(source, prepare, params))

    def full(self) -> bool:
        return not self._free

    def __len__(self) -> int:
        return len(self._queued)

    def submit(self, key: Any, ids: np.ndarray, epoch: int) -> None:
        slot = self._free.popleft()
        ids = [int(i) for i in ids]
        futures = [self._executor.submit(_fill, self._paths[slot], self._shape,
                                         list(range(lo, min(lo + self._chunk, len(ids)))),
                                         ids[lo:lo + self._chunk], int(epoch))
                   for lo in range(0, len(ids), self._chunk)]
        self._queued.append((key, slot, len(ids), futures))

    def take(self) -> tuple[Any, np.ndarray, list[dict]]:
        key, slot, n, futures = self._queued.popleft()
        try:
            rests = [r for f in futures for r in f.result()]
            view = np.memmap(self._paths[slot], dtype=np.float32, mode="r", shape=self._shape)
            images = np.array(view[:n])
            del view
        except cf.process.BrokenProcessPool as e:
            raise RuntimeError("an image worker process died (out of memory?); rerun with "
                               "--set data_workers=0 to preprocess in the training process") from e
        finally:
            for f in futures:
                f.cancel()
            cf.wait(futures)
            self._free.append(slot)
        return key, images, rests

    def discard(self) -> None:
        """Drops the queued batches (waiting for chunks already running: their slots)."""
        while self._queued:
            _, slot, _, futures = self._queued.popleft()
            for f in futures:
                f.cancel()
            cf.wait(futures)
            self._free.append(slot)

    def close(self) -> None:
        executor, self._executor = getattr(self, "_executor", None), None
        if executor is not None:
            self._queued.clear()
            executor.shutdown(wait=True, cancel_futures=True)
        for path in getattr(self, "_paths", []):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths = []

    def __del__(self):
        try:
            self.close()
        except Exception:   # noqa: BLE001 - interpreter shutdown
            pass
