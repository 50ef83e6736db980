"""The interface every tokenizer shares (:class:`Tokenizer`; see ``data/tokenizers.py``),
in a module of its own so that the tokenizers in other files (``hf_tokenizer.py``) and the
spec parser (``tokenizers.get_tokenizer``) import it without importing each other."""
from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np


def ids_as_list(ids: Any) -> list[int]:
    """Converts a list, tuple, NumPy or JAX array of ids into a flat list."""
    return np.asarray(ids, dtype=np.int64).reshape(-1).tolist()


class Tokenizer(abc.ABC):
    """The interface shared by all tokenizers (see the module docstring)."""

    pad_id: int | None = 0
    eos_id: int | None = 1
    unk_id: int | None = 2
    bos_id: int | None = None
    cls_id: int | None = None
    sep_id: int | None = None
    mask_id: int | None = None
    decoder_start_id: int | None = None
    sentinel_ids: tuple[int, ...] = ()

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; every id produced by ``encode`` is below it."""

    @property
    @abc.abstractmethod
    def cache_key(self) -> str:
        """A short string identifying this tokenizer's exact id mapping."""

    @abc.abstractmethod
    def encode(self, text: str | bytes, add_eos: bool = False) -> list[int]:
        """Returns the ids of ``text``, followed by ``eos_id`` if ``add_eos``."""

    @abc.abstractmethod
    def decode(self, ids: Any) -> str:
        """Returns the text of ``ids``, dropping pad, eos and unknown ids."""

    def encode_array(self, text: str | bytes, add_eos: bool = False) -> np.ndarray:
        """Returns ``encode(text, add_eos)`` as a 1-D int32 array."""
        return np.asarray(self.encode(text, add_eos=add_eos), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """Returns ``[encode_array(t) for t in texts]``: the same ids, which a tokenizer with a
        batch API (SentencePiece's threads, ``tokenizers``' ``encode_batch``) computes in one
        call. This default is the loop."""
        return [self.encode_array(text) for text in texts]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
