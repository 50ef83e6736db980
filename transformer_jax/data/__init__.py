"""Data: tokenizers (bytes, SentencePiece, a Hugging Face checkpoint's own ``hf:DIR``), the
embedded ``python_stdlib`` TFDS dataset, LM batches.

Importing this package is cheap: it imports neither TensorFlow nor TFDS.  TFDS
is imported when a dataset is opened, and :mod:`.stdlib_corpus` (which defines
the TFDS builder) when one of its names is first used.

Typical use::

    from transformer_jax import data

    it = data.make_lm_iterator("python_stdlib", "train", tokenizer="byte",
                               seq_len=256, batch_size=32, seed=0)
    batch = next(it)          # inputs/targets int32 (32, 256), weights float32
    state = it.get_state()    # JSON-serialisable; it.set_state(state) resumes
"""

from transformer_jax.data.lm_iterators import LMIterator, MemoryLMIterator, StreamingLMIterator
from transformer_jax.data.packing import Batch, check_packing, pack_documents
from transformer_jax.data.pipeline import make_lm_iterator
from transformer_jax.data.shuffle import permutation
from transformer_jax.data.sources import default_data_dir, load_texts, open_source
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    SpecialIdsView,
    Tokenizer,
    canonical_spec,
    get_tokenizer,
    train_sentencepiece,
    with_special_ids,
)

# Names served lazily from .stdlib_corpus, whose import pulls in TFDS.
_STDLIB_NAMES = (
    "PythonStdlib",
    "STDLIB_FILES",
    "TRAIN_FILES",
    "VALIDATION_FILES",
    "file_list_digest",
)

__all__ = [
    "Batch",
    "ByteTokenizer",
    "HFTokenizer",
    "LMIterator",
    "MemoryLMIterator",
    "SentencePieceTokenizer",
    "SpecialIdsView",
    "StreamingLMIterator",
    "Tokenizer",
    "canonical_spec",
    "default_data_dir",
    "get_tokenizer",
    "load_texts",
    "make_lm_iterator",
    "open_source",
    "check_packing",
    "pack_documents",
    "permutation",
    "train_sentencepiece",
    "with_special_ids",
    *_STDLIB_NAMES,
]


def __getattr__(name: str):
    if name in _STDLIB_NAMES:
        from transformer_jax.data import stdlib_corpus

        return getattr(stdlib_corpus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
