"""Deterministic orders: the SplitMix64 hash, the per-epoch order of ``range(n)`` that is a
pure function of ``(seed, epoch)`` (:func:`shuffled` looks positions up one by one, O(1)
each; :func:`permutation` is the whole order), and :class:`EpochIterator`, the
batches of ``n`` indexed examples over shuffled epochs that the example tasks build on
(classification, seq2seq, pretraining pairs, images).

Orders are the same on every platform and NumPy version.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from transformer_jax.errors import UserError

__all__ = ["EpochIterator", "FEISTEL_ROUNDS", "RESUME_HINT", "fold_key", "grid_hashes",
           "hash_order", "hash_uniform", "permutation", "shuffled", "splitmix64",
           "splitmix64_array"]

#: Appended to errors about a saved data position that does not fit the data.
RESUME_HINT = (" The checkpoint's data position does not fit this data: resume with the "
               "run's original dataset, split and batch settings.")

MASK64 = (1 << 64) - 1


def splitmix64(z: int) -> int:
    """The SplitMix64 finaliser of one integer (arithmetic mod 2**64): a well-mixed 64-bit hash."""
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


_GAMMA, _MUL1, _MUL2 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                               0x94D049BB133111EB))
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


def splitmix64_array(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over a uint64 array (arithmetic wraps mod 2**64)."""
    z = z + _GAMMA
    z ^= z >> _S30
    z *= _MUL1
    z ^= z >> _S27
    z *= _MUL2
    z ^= z >> _S31
    return z


#: Feistel rounds of :func:`shuffled`; 4 make a pseudo-random permutation (Luby-Rackoff), a
#: few more mix small domains better.
FEISTEL_ROUNDS = 6


def _round_keys(seed: int, epoch: int) -> tuple[np.uint64, ...]:
    key = splitmix64(splitmix64(seed & MASK64) ^ (epoch & MASK64))
    return tuple(np.uint64(splitmix64(key ^ r)) for r in range(FEISTEL_ROUNDS))


def _feistel(x: np.ndarray, keys: tuple[np.uint64, ...], half_bits: int) -> np.ndarray:
    """One pass of the balanced Feistel network on uint64 ``x`` < 2**(2*half_bits): a
    bijection of that domain (each round maps (L, R) to (R, L ^ F(R)))."""
    shift = np.uint64(half_bits)
    mask = np.uint64((1 << half_bits) - 1)
    left, right = x >> shift, x & mask
    for k in keys:
        mixed = splitmix64_array(right + k)
        mixed &= mask
        mixed ^= left
        left, right = right, mixed
    left <<= shift
    left |= right
    return left


def shuffled(positions: Any, n: int, seed: int, epoch: int) -> np.ndarray:
    """The items at ``positions`` of the ``(seed, epoch)`` permutation of ``range(n)``: a
    keyed bijection computed per index, O(1) each, never materialising the permutation.

    The bijection is a balanced Feistel network (``FEISTEL_ROUNDS`` rounds of a SplitMix64
    round function, keyed by ``(seed, epoch)``) on ``[0, 2**b)``, ``b`` the smallest even
    number with ``2**b >= n`` (so ``2**b < 4n``); "cycle walking" applies it again to an
    output >= n until it falls inside ``[0, n)``, which restricts the bijection to
    ``range(n)`` (at most four passes on average). The kind of keyed index shuffle grain's
    ``index_shuffle`` offers (grain is not a dependency), in NumPy; identical on every
    platform and NumPy version.

    ``positions``: ints in ``[0, n)``, any shape; returns int64 of the same shape.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if n < 1 or positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must lie in [0, n) for n={n}")
    half_bits = max(1, -(-(n - 1).bit_length() // 2))
    keys = _round_keys(seed, epoch)
    x = _feistel(positions.astype(np.uint64).reshape(-1), keys, half_bits)
    outside = np.flatnonzero(x >= np.uint64(n))
    while outside.size:
        x[outside] = _feistel(x[outside], keys, half_bits)
        outside = outside[x[outside] >= np.uint64(n)]
    return x.astype(np.int64).reshape(positions.shape)


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """Returns the permutation of ``range(n)`` that depends only on (seed, epoch): item
    ``permutation(...)[p]`` is at position ``p``; ``shuffled(range(n), n, seed, epoch)``.

    For small ``n``; iterators look positions up with :func:`shuffled`. Shape ``(n,)``, int64.
    """
    return shuffled(np.arange(n), n, seed, epoch) if n else np.zeros((0,), np.int64)


def hash_order(n: int, seed: int) -> np.ndarray:
    """A fixed order of ``range(n)``: the stable argsort of SplitMix64 hashes of
    ``(seed, i)``, O(n log n). What :func:`permutation` was before it became a per-index
    bijection, kept for partitions that must not move (the digits test split)."""
    key = splitmix64(splitmix64(seed & MASK64) ^ 0)
    hashes = splitmix64_array(np.arange(n, dtype=np.uint64) + np.uint64(key))
    return np.argsort(hashes, kind="stable")


class EpochIterator(Iterator[dict]):
    """Batches of ``n`` indexed examples: a fresh :func:`permutation` per epoch (``shuffle``)
    and endless epochs (``repeat``, the last partial batch dropped), or one ordered pass
    whose last batch is filled with invalid rows.

    Process ``p`` of ``P`` yields rows ``[p B/P, (p+1) B/P)`` of every global batch of ``B``
    rows. State ``{"epoch", "index"}`` (the process count does not enter: rows are global).
    Subclasses turn row indices into arrays in :meth:`make_batch`.
    """

    kind = "epoch"     # names the iterator in state errors

    def __init__(self, n: int, *, batch_size: int, seed: int, shuffle: bool, repeat: bool,
                 process_index: int, process_count: int, describe: str):
        if batch_size % process_count:
            raise UserError(f"batch_size={batch_size} is not divisible by {process_count} processes")
        self.n = n
        self.global_batch, self.batch_size = batch_size, batch_size // process_count
        self.seed, self.shuffle, self.repeat = seed, shuffle, repeat
        self.process_index = process_index
        if n == 0:
            raise UserError(f"{describe} has no examples")
        if repeat:
            self.batches_per_epoch = n // batch_size
            if self.batches_per_epoch == 0:
                raise UserError(f"{describe} has {n} examples, fewer than one batch of "
                                f"{batch_size}; lower batch_size")
        else:
            self.batches_per_epoch = -(-n // batch_size)
        self.epoch = self.index = 0

    @abc.abstractmethod
    def make_batch(self, rows: np.ndarray, valid: np.ndarray) -> dict[str, np.ndarray]:
        """``rows`` (B/P,) example indices (0 where not ``valid``) -> the batch arrays."""

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if not self.repeat and self.index >= self.batches_per_epoch:
            raise StopIteration
        first = self.index * self.global_batch + self.process_index * self.batch_size
        pos = np.arange(first, first + self.batch_size)
        valid = pos < self.n
        pos = np.where(valid, pos, 0)
        rows = shuffled(pos, self.n, self.seed, self.epoch) if self.shuffle else pos
        batch = self.make_batch(rows, valid)
        self.index += 1
        if self.repeat and self.index == self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def get_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"epoch", "index"}:
            raise UserError(f"not a {self.kind} iterator state: {state!r}.{RESUME_HINT}")
        if not 0 <= int(state["index"]) < max(self.batches_per_epoch, 1):
            raise UserError(f"{self.kind} iterator state index {state['index']} is out of range "
                            f"for {self.batches_per_epoch} batches per epoch.{RESUME_HINT}")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


# ----------------------------------------------------------------------------- keyed hashes

def fold_key(seed: int | Sequence[int]) -> int:
    """Fold an int or a sequence of ints into one 64-bit key."""
    key = 0x5EED
    for s in ([seed] if isinstance(seed, (int, np.integer)) else list(seed)):
        key = splitmix64(key ^ (int(s) & MASK64))
    return key


def grid_hashes(key: int, stream: int, shape: tuple[int, int], row_offset: int) -> np.ndarray:
    """uint64 (B, T): SplitMix64 of (key, stream, global row, position)."""
    base = np.uint64(splitmix64(key ^ splitmix64(stream)))
    rows = (np.arange(shape[0], dtype=np.uint64) + np.uint64(row_offset))[:, None]
    cols = np.arange(shape[1], dtype=np.uint64)[None, :]
    return splitmix64_array(base + (rows << np.uint64(32)) + cols)


def hash_uniform(h: np.ndarray) -> np.ndarray:
    """uint64 hashes -> float64 uniforms in [0, 1) (their top 53 bits)."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
