"""Tokenizers with one small common interface.

Every tokenizer has:

* ``encode(text, add_eos=False) -> list[int]``: ids of ``text`` (``str``, or
  ``bytes`` holding UTF-8); an eos id is appended only if ``add_eos``.
* ``encode_array(text, add_eos=False) -> np.ndarray``: the same ids as a 1-D
  int32 array (fast path used by the data pipeline).
* ``encode_batch(texts) -> list[np.ndarray]``: ``encode_array`` of each text, in one call
  of the tokenizer's batch API where it has one (SentencePiece, ``tokenizers``).
* ``decode(ids) -> str``: the text of a sequence of ids (a list, a NumPy or a
  JAX array).  Pad and eos ids are dropped, as are ids outside the vocabulary,
  so a padded or packed row can be decoded as it is.
* ``vocab_size``, ``pad_id``, ``eos_id``, ``unk_id`` (byte and SentencePiece: 0, 1, 2).
* ``bos_id``, ``cls_id``, ``sep_id``, ``mask_id``, ``decoder_start_id``: the
  tokenizer's own special ids, None where it has none (byte and SentencePiece
  have none), and ``sentinel_ids`` (T5's ``<extra_id_N>``; ``()`` without).
  Tasks use them when present (see tasks/lm.py, mlm.py, seq2seq.py).
* ``cache_key``: a short string that identifies the tokenizer's exact mapping,
  used to key cached token streams.

Three tokenizers are provided:

* :class:`ByteTokenizer` (the default): UTF-8 bytes with the ByT5 convention:
  pad 0, eos 1, unk 2, byte ``b`` -> ``b + 3``, ``vocab_size`` 259.
* :class:`SentencePieceTokenizer`: a SentencePiece model, e.g. one trained
  locally on a corpus with :func:`train_sentencepiece` (pad 0, eos 1, unk 2).
* :class:`~transformer_jax.data.hf_tokenizer.HFTokenizer`: the tokenizer a
  Hugging Face checkpoint was saved with (``"hf:DIR"``: its tokenizer.json or
  spiece.model, and its special tokens).

:func:`get_tokenizer` builds any of them from a short spec string;
:func:`with_special_ids` gives a tokenizer other eos/pad ids (what a task packs with).
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from transformer_jax import storage
from transformer_jax.data.tokenizer_base import Tokenizer, ids_as_list
from transformer_jax.errors import UserError

__all__ = [
    "ENCODE_THREADS",
    "Tokenizer",
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "SpecialIdsView",
    "canonical_spec",
    "get_tokenizer",
    "train_sentencepiece",
    "with_special_ids",
]

#: Threads a batch API may encode with (SentencePiece's ``num_threads``); the ids do not
#: depend on it.
ENCODE_THREADS = min(8, os.cpu_count() or 1)


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer with the ByT5 id layout.

    ``pad_id`` = 0, ``eos_id`` = 1, ``unk_id`` = 2; the UTF-8 byte ``b`` has id
    ``b + 3``; ``vocab_size`` = 259.  For example ``"Hi"`` -> ``[75, 108]``.

    ``decode`` drops pad and eos ids and ids outside ``[0, 259)`` (a model's
    output layer may be larger than the vocabulary), turns ``unk_id`` into
    U+FFFD, and decodes the bytes as UTF-8 with ``errors="replace"``, so a
    sequence cut inside a multi-byte character still decodes.
    """

    BYTE_OFFSET = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.BYTE_OFFSET

    @property
    def cache_key(self) -> str:
        return "byte"

    def encode(self, text: str | bytes, add_eos: bool = False) -> list[int]:
        return self.encode_array(text, add_eos=add_eos).tolist()

    def encode_array(self, text: str | bytes, add_eos: bool = False) -> np.ndarray:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.empty(len(data) + int(add_eos), dtype=np.int32)
        ids[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        ids[: len(data)] += self.BYTE_OFFSET
        if add_eos:
            ids[-1] = self.eos_id
        return ids

    def decode(self, ids: Any) -> str:
        out = bytearray()
        replacement = "\ufffd".encode("utf-8")
        for i in ids_as_list(ids):
            if self.BYTE_OFFSET <= i < self.vocab_size:
                out.append(i - self.BYTE_OFFSET)
            elif i == self.unk_id:
                out += replacement
        return out.decode("utf-8", errors="replace")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model behind the common tokenizer interface.

    Args:
      model: path of a ``.model`` file (local or ``gs://``), or the serialized model as
        ``bytes``.

    The model must use pad id 0 and eos id 1 (as :func:`train_sentencepiece`
    sets); otherwise a ``ValueError`` is raised.  ``decode`` drops pad and eos
    ids and ids outside the vocabulary; SentencePiece itself renders the unk
    piece as `` ⁇ ``.
    """

    def __init__(self, model: str | os.PathLike | bytes):
        import sentencepiece as spm  # Imported here: optional dependency.

        if isinstance(model, (bytes, bytearray)):
            proto = bytes(model)
            self.model_path: str | None = None
        else:
            self.model_path = os.fspath(model)
            if not storage.is_file(self.model_path):
                raise UserError(
                    f"SentencePiece model file {self.model_path!r} does not exist; give "
                    "the path of a .model file (e.g. the spm.model a run trained into its workdir)."
                )
            proto = storage.read_bytes(self.model_path)
        self._processor = spm.SentencePieceProcessor(model_proto=proto)
        self._cache_key = "spm-" + hashlib.sha256(proto).hexdigest()[:16]
        self.unk_id = self._processor.unk_id()
        if self._processor.pad_id() != 0 or self._processor.eos_id() != 1:
            raise UserError(
                "SentencePiece model must have pad_id=0 and eos_id=1, got "
                f"pad_id={self._processor.pad_id()} eos_id={self._processor.eos_id()}; "
                "train it with transformer_jax.data.train_sentencepiece."
            )

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    @property
    def cache_key(self) -> str:
        return self._cache_key

    def encode(self, text: str | bytes, add_eos: bool = False) -> list[int]:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        ids = self._processor.encode(text, out_type=int)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """The ids of each text, as ``encode_array``; SentencePiece encodes the list on
        ``ENCODE_THREADS`` threads."""
        texts = [bytes(t).decode("utf-8", errors="replace") if isinstance(t, (bytes, bytearray))
                 else t for t in texts]
        if not texts:
            return []
        batch = self._processor.encode(texts, out_type=int, num_threads=ENCODE_THREADS)
        return [np.asarray(ids, dtype=np.int32) for ids in batch]

    def decode(self, ids: Any) -> str:
        kept = [
            i
            for i in ids_as_list(ids)
            if 0 <= i < self.vocab_size and i not in (self.pad_id, self.eos_id)
        ]
        return self._processor.decode(kept)

    def __repr__(self) -> str:
        where = self.model_path or "<bytes>"
        return f"SentencePieceTokenizer({where!r}, vocab_size={self.vocab_size})"


def _training_sentences(texts: Iterable[str | bytes], max_chunk_chars: int):
    """Yields each text cut at line ends into chunks of about max_chunk_chars.

    SentencePiece trains on "sentences"; cutting documents at line boundaries
    (keeping the newline characters) keeps newlines and indentation in the
    training data while bounding the sentence length.
    """
    for text in texts:
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        chunk: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            chunk.append(line)
            size += len(line)
            if size >= max_chunk_chars:
                yield "".join(chunk)
                chunk, size = [], 0
        if chunk:
            yield "".join(chunk)


def train_sentencepiece(
    texts: Iterable[str | bytes],
    vocab_size: int,
    model_path: str | os.PathLike,
    *,
    model_type: str = "unigram",
    max_chunk_chars: int = 2000,
    num_threads: int | None = None,
) -> SentencePieceTokenizer:
    """Trains a SentencePiece model on ``texts`` and writes it to ``model_path``.

    The model keeps text exactly: no normalisation, no dummy prefix, spaces and
    indentation preserved, newline and tab as single pieces, and byte fallback
    so that any character can be encoded.  ``decode(encode(s)) == s`` for any
    string that does not contain U+2581 (SentencePiece's own space marker,
    which decodes as a space).

    Ids: pad 0, eos 1, unk 2, no bos.  ``vocab_size`` is a soft limit (a small
    corpus may give fewer pieces) and must be at least 300, because the 256
    byte-fallback pieces are part of the vocabulary.

    Args:
      texts: the training documents.
      vocab_size: the requested number of pieces.
      model_path: where to write the model (e.g. ``".../spm.model"``, local or
        ``gs://``); parent directories are created.
      model_type: ``"unigram"`` or ``"bpe"``.
      max_chunk_chars: documents are cut at line ends into training sentences of
        about this many characters.
      num_threads: trainer threads (default: the CPU count, at most 8).

    Returns:
      A :class:`SentencePieceTokenizer` for the written model.
    """
    import sentencepiece as spm  # Imported here: optional dependency.

    if vocab_size < 300:
        raise UserError(
            f"vocab_size must be at least 300 (256 byte pieces + specials), got {vocab_size}."
        )
    sentences = _training_sentences(texts, max_chunk_chars)
    first = next(sentences, None)
    if first is None:
        raise UserError("train_sentencepiece got no non-empty text to train on.")

    def all_sentences():
        yield first
        yield from sentences

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=all_sentences(),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["\n", "\t"],
        character_coverage=1.0,
        hard_vocab_limit=False,
        # In bytes: room for 4-byte characters and a line longer than a chunk;
        # longer sentences would be skipped by the trainer.
        max_sentence_length=max(16 * max_chunk_chars, 4192),
        num_threads=num_threads or min(os.cpu_count() or 1, 8),
        minloglevel=2,
    )
    model_path = os.fspath(model_path)
    storage.write_bytes(model_path, model.getvalue())   # replaced at once, never seen half written
    return SentencePieceTokenizer(model_path)


#: the special-id attributes a tokenizer has (``Tokenizer``'s class attributes)
SPECIAL_ID_ATTRS = ("pad_id", "eos_id", "unk_id", "bos_id", "cls_id", "sep_id", "mask_id",
                    "decoder_start_id")


class SpecialIdsView(Tokenizer):
    """``base`` with some special ids replaced; everything else is ``base``'s.

    What a task packs a tokenizer's text with: e.g. BERT's WordPiece has no eos, so masked-LM
    packing ends each document with its ``[SEP]``. ``encode(text, add_eos=True)`` appends
    the view's eos. ``cache_key`` adds the eos when it differs (the cached token streams of
    the data pipeline hold the encoded ids and eos, never a pad).
    """

    def __init__(self, base: Tokenizer, **ids: int | None):
        unknown = sorted(set(ids) - set(SPECIAL_ID_ATTRS))
        if unknown:
            raise TypeError(f"not special-id attributes: {unknown}")
        self.base = base
        for name in SPECIAL_ID_ATTRS:
            setattr(self, name, ids[name] if name in ids else getattr(base, name, None))
        self.sentinel_ids = tuple(getattr(base, "sentinel_ids", ()))

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def cache_key(self) -> str:
        key = self.base.cache_key
        return key if self.eos_id == self.base.eos_id else f"{key}-eos{self.eos_id}"

    def encode(self, text: str | bytes, add_eos: bool = False) -> list[int]:
        ids = list(self.base.encode(text))
        return ids + [self.eos_id] if add_eos else ids

    def encode_array(self, text: str | bytes, add_eos: bool = False) -> np.ndarray:
        ids = self.base.encode_array(text)
        return np.append(ids, np.int32(self.eos_id)).astype(np.int32) if add_eos else ids

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return self.base.encode_batch(texts)

    def decode(self, ids: Any) -> str:
        return self.base.decode(ids)

    def __getattr__(self, name: str):
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    def __repr__(self) -> str:
        changed = {n: getattr(self, n) for n in SPECIAL_ID_ATTRS
                   if getattr(self, n) != getattr(self.base, n, None)}
        return f"SpecialIdsView({self.base!r}, {changed})"


def with_special_ids(tokenizer: Tokenizer, **ids: int | None) -> Tokenizer:
    """``tokenizer`` itself when ``ids`` (e.g. ``eos_id=..., pad_id=...``) are its own, else a
    :class:`SpecialIdsView` with them."""
    if all(getattr(tokenizer, name, None) == value for name, value in ids.items()):
        return tokenizer
    base = tokenizer.base if isinstance(tokenizer, SpecialIdsView) else tokenizer
    merged = {n: getattr(tokenizer, n, None) for n in SPECIAL_ID_ATTRS}
    return SpecialIdsView(base, **{**merged, **ids})


def canonical_spec(spec: str) -> str:
    """``spec`` as a task records it: a local ``hf:DIR`` made absolute (a run is loaded again
    from another working directory); every other spec as it is."""
    if isinstance(spec, str) and spec.startswith("hf:") and not storage.is_remote(spec[3:]):
        return "hf:" + os.path.abspath(os.path.expanduser(spec[3:]))
    return spec


def get_tokenizer(spec: str | Tokenizer | None = "byte") -> Tokenizer:
    """Returns a tokenizer from a spec.

    Args:
      spec: ``"byte"`` (the default; also ``None``, ``"bytes"``, ``"byt5"``),
        ``"sentencepiece:PATH"`` (or ``"spm:PATH"``), the path of an existing
        ``.model`` file, ``"hf:DIR"`` (a Hugging Face model or tokenizer directory:
        :class:`~transformer_jax.data.hf_tokenizer.HFTokenizer`), or a
        :class:`Tokenizer`, returned as it is.
    """
    if isinstance(spec, Tokenizer):
        return spec
    if spec is None or spec in ("byte", "bytes", "byt5"):
        return ByteTokenizer()
    if not isinstance(spec, str):
        raise TypeError(f"tokenizer spec must be a str or a Tokenizer, got {spec!r}")
    for prefix in ("sentencepiece:", "spm:"):
        if spec.startswith(prefix):
            return SentencePieceTokenizer(spec[len(prefix) :])
    if spec.startswith("hf:"):
        if not spec[3:]:
            raise UserError("tokenizer 'hf:' names no directory; use 'hf:DIR' with the "
                            "directory a Hugging Face model or tokenizer was saved to")
        from transformer_jax.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(spec[3:])
    if spec.endswith(".model") and storage.is_file(spec):
        return SentencePieceTokenizer(spec)
    raise UserError(
        f"unknown tokenizer {spec!r}: use 'byte', 'sentencepiece:PATH', 'hf:DIR' (a "
        "Hugging Face model or tokenizer directory) or the path of a SentencePiece "
        ".model file."
    )
