"""Document sources: TensorFlow Datasets *data sources* (``tfds.data_source``, random access
over the ``array_record`` file format; reading needs no TensorFlow), Hugging Face
``datasets`` (``"hf:PATH_OR_REPO[:CONFIG]"``, :mod:`transformer_jax.data.hf_datasets`), the
embedded ``python_stdlib`` dataset (built locally on first use, see
:mod:`transformer_jax.data.stdlib_corpus`), or any in-memory sequence of documents; and
reading them: :func:`read_examples` (in one call where the source allows),
:func:`document_text`, :func:`iter_texts`, :func:`load_texts`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from transformer_jax.errors import UserError

__all__ = ["READ_CHUNK", "base_name", "check_split", "check_tfds_dataset", "default_data_dir",
           "document_text", "is_stdlib", "iter_text_chunks", "iter_texts", "load_texts",
           "open_source", "read_examples"]

#: Documents read per data-source call.
READ_CHUNK = 512


def default_data_dir() -> str:
    """TFDS's default data directory: ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``."""
    return os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")


#: TFDS names (with or without the config) -> a dataset that needs no TensorFlow.
NO_TENSORFLOW_ALTERNATIVES = {
    "lm1b": "hf:Salesforce/wikitext:wikitext-103-raw-v1 (no TensorFlow needed)",
    "cifar10": "hf:uoft-cs/cifar10 (no TensorFlow needed)",
    "glue/sst2": "hf:nyu-mll/glue:sst2 (no TensorFlow needed)",
    "wmt14_translate/de-en": "hf:wmt/wmt14:de-en (no TensorFlow needed)",
    "imagenet2012": "hf:DIR (ImageNet as parquet files with image and label columns)",
    "coco_captions": "hf:DIR (parquet files with image and caption columns)",
}


def base_name(dataset: str) -> str:
    """A TFDS name without its config and version (``glue/sst2:2.0.0`` -> ``glue``)."""
    return dataset.split("/")[0].split(":")[0]


def is_stdlib(dataset: Any) -> bool:
    """Whether ``dataset`` is the embedded corpus, ``python_stdlib`` (any config or version)."""
    return isinstance(dataset, str) and base_name(dataset) == "python_stdlib"


def check_tfds_dataset(dataset: str, data_dir: str | None = None) -> None:
    """Refuses, up front, a TFDS dataset that cannot be read here: one that is not prepared
    under ``data_dir`` while TensorFlow (which TFDS's builders need to prepare them) is not
    installed (prepared: a ``dataset_info.json`` under ``data_dir/NAME[/CONFIG]/VERSION``,
    looked for without TFDS's builders, which import TensorFlow). ``python_stdlib`` prepares
    without TensorFlow; under ``tfds.testing.mock_data`` nothing is prepared."""
    if base_name(dataset) == "python_stdlib" or importlib.util.find_spec("tensorflow"):
        return
    import tensorflow_datasets as tfds

    prepare = tfds.core.dataset_builder.DatasetBuilder.download_and_prepare
    if prepare.__qualname__ != "DatasetBuilder.download_and_prepare":   # mock_data
        return
    data_dir = data_dir or default_data_dir()
    from etils import epath

    folder = epath.Path(data_dir) / dataset.split(":")[0]
    if any(True for pattern in ("*/dataset_info.json", "*/*/dataset_info.json")
           for _ in folder.glob(pattern)):
        return   # prepared (TFDS reads it, or says which version or format it lacks)
    config = dataset.split(":")[0]
    alternative = NO_TENSORFLOW_ALTERNATIVES.get(config) or NO_TENSORFLOW_ALTERNATIVES.get(
        base_name(dataset))
    use = f"use dataset={alternative}, or " if alternative else ""
    raise UserError(
        f"dataset {dataset!r} is not prepared in {data_dir}, and TFDS needs TensorFlow (not "
        f"installed) to find or prepare it: {use}run `tfds build {config} "
        f"--file_format=array_record` where TensorFlow is installed and copy its "
        f"{base_name(dataset)}/ folder into {data_dir} (or set data_dir=gs://BUCKET/DIR); "
        "see docs/datasets.md")


def open_source(dataset: Any, split: str, *, data_dir: str | None = None):
    """Returns ``(source, name)``: a random-access document source and its name.

    Args:
      dataset: a TFDS dataset name (``"python_stdlib"``, ``"lm1b"``, optionally
        with ``/config:version``), an ``"hf:PATH_OR_REPO[:CONFIG]"`` Hugging Face
        dataset (:mod:`~transformer_jax.data.hf_datasets`), or an in-memory sequence of
        documents (str, UTF-8 bytes, or dicts with a text field).
      split: the split name, e.g. ``"train"``, ``"validation"``, ``"test"``.
      data_dir: TFDS data directory (default :func:`default_data_dir`).

    The source supports ``len()`` and indexing.  A TFDS dataset that is not
    prepared yet is prepared first, in the ``array_record`` format:
    ``python_stdlib`` locally, others by TFDS, which downloads them (and, for
    ``lm1b``, needs TensorFlow to prepare it; reading needs none): without
    TensorFlow an unprepared one is refused (:func:`check_tfds_dataset`).  A dataset
    already prepared in another format (TFRecord) must be prepared again with
    ``tfds build NAME --file_format=array_record``.
    """
    if not isinstance(dataset, str):
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                "dataset must be a TFDS name or a sequence of documents, got "
                f"{type(dataset).__name__}."
            )
        return dataset, f"<in-memory {type(dataset).__name__}>"
    if dataset.startswith("hf:"):
        from transformer_jax.data.hf_datasets import open_hf_source

        return open_hf_source(dataset, split), dataset
    check_tfds_dataset(dataset, data_dir)

    import tensorflow_datasets as tfds

    # Random access (and reading without TensorFlow) needs array_record files;
    # TFDS only picks that format by itself when no data_dir is given.
    kwargs: dict[str, Any] = {"builder_kwargs": {"file_format": "array_record"}}
    if is_stdlib(dataset):
        # Registers the builder with TFDS; it needs no download, nor GCS.
        from transformer_jax.data import stdlib_corpus  # noqa: F401

        kwargs["download_and_prepare_kwargs"] = {
            "download_config": tfds.download.DownloadConfig(try_download_gcs=False)
        }
    try:
        source = tfds.data_source(
            dataset, split=split, data_dir=data_dir or default_data_dir(), **kwargs
        )
    except tfds.core.registered.DatasetNotFoundError as e:
        raise UserError(
            f"dataset {dataset!r} is not a TFDS dataset: use 'python_stdlib' (offline) or a "
            "name from tfds.list_builders() such as 'lm1b'"
        ) from e
    except ValueError as e:
        if "split" not in str(e).lower():
            raise
        raise UserError(f"dataset {dataset!r}: {e} Set eval_split (or the split) to one of them.") from e
    return source, dataset


def document_text(example: Any, text_key: str, option: str = "task.text_key") -> str:
    """The text of one example: the example itself (str or UTF-8 bytes) or its ``text_key``
    field (a dict's); a clear error for anything else (``option`` is the setting that names
    the field)."""
    if isinstance(example, dict):
        if text_key not in example:
            texts = [k for k, v in example.items() if isinstance(v, (str, bytes))]
            field = texts[0] if len(texts) == 1 else "FIELD"
            raise UserError(f"document has no field {text_key!r} (fields: {sorted(example)}); "
                            f"name its text field with --set {option}={field}")
        example = example[text_key]
    if isinstance(example, np.ndarray) and example.shape == ():
        example = example.item()
    if isinstance(example, (bytes, bytearray)):
        return bytes(example).decode("utf-8", errors="replace")
    if isinstance(example, str):
        return example
    if example is None:
        raise UserError("document has no text (None: an empty cell?); drop the rows without "
                        "text or fill them (with '')")
    raise UserError(f"document text must be str or bytes, got {type(example).__name__}")


def check_split(dataset: Any, split: str, *, texts: dict[str, str] | None = None,
                labels: dict[str, str] | None = None, data_dir: str | None = None):
    """Refuses, before a run writes anything, a split it could not read: opens it (a missing
    split or file, an empty one, a repository's configurations: :func:`open_source` and
    :mod:`~transformer_jax.data.hf_datasets` refuse those) and checks its rows hold the
    fields the task reads, ``texts`` and ``labels`` (field -> the option that names it,
    e.g. ``{"text": "task.text_key"}``): the first row's (a text is str or bytes; a label
    an int or a string), and in an ``hf:`` split every row's (no empty cell, from Arrow's
    null counts). Returns the opened source."""
    source, name = open_source(dataset, split, data_dir=data_dir)
    where = f"dataset {name!r} split {split!r}"
    if not len(source):
        raise UserError(f"{where} is empty (no rows); give it rows" + (
            "" if split == "train" else ", or set --set eval_split=NAME to a split that has some"))
    first = read_examples(source, [0])[0]
    for field, option in {**(texts or {}), **(labels or {})}.items():
        if hasattr(source, "refuse_empty_cells"):     # an hf: split, from Arrow's null counts
            source.refuse_empty_cells([field])
        try:
            if field in (texts or {}):
                document_text(first, field, option)
            else:
                _check_label(first, field, option)
        except UserError as e:
            raise UserError(f"{where} row 0: {e}") from None
    return source


def _check_label(example: Any, field: str, option: str) -> None:
    """An example's ``field`` is a class: an int (a ``ClassLabel``'s id) or a string."""
    if not isinstance(example, dict) or field not in example:
        have = sorted(example) if isinstance(example, dict) else type(example).__name__
        raise UserError(f"document has no field {field!r} (fields: {have}); name its label "
                        f"field with --set {option}=FIELD")
    value = example[field]
    value = value.item() if isinstance(value, np.ndarray) and value.shape == () else value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, str)):
        raise UserError(f"label {value!r} in {field!r} is no class (an int or a string); "
                        f"name the label field with --set {option}=FIELD")


def read_examples(source: Any, indices: Sequence[int]) -> list[Any]:
    """Reads the examples at ``indices``, in one call when the source allows."""
    indices = [int(i) for i in indices]
    if hasattr(source, "__getitems__"):
        try:
            return list(source.__getitems__(indices))
        except TypeError:
            # tfds.testing.mock_data's data source defines __getitems__ with a
            # wrong signature; reading one record at a time gives the same
            # examples (and re-raises any genuine error).
            pass
    return [source[i] for i in indices]


def iter_text_chunks(source: Any, text_key: str, indices: Iterable[int] | None = None):
    """Yields the texts of the documents at ``indices`` (default: all, in order) as lists of
    up to ``READ_CHUNK``, one read each (what a tokenizer's batch API encodes at once)."""
    indices = range(len(source)) if indices is None else list(indices)
    for start in range(0, len(indices), READ_CHUNK):
        examples = read_examples(source, indices[start : start + READ_CHUNK])
        texts = []
        for i, example in zip(indices[start : start + READ_CHUNK], examples):
            try:
                texts.append(document_text(example, text_key))
            except UserError as e:
                raise UserError(f"row {i}: {e}") from None
        yield texts


def iter_texts(source: Any, text_key: str, indices: Iterable[int] | None = None):
    """Yields the texts of the documents at ``indices`` (default: all, in order), read
    ``READ_CHUNK`` at a time."""
    for chunk in iter_text_chunks(source, text_key, indices):
        yield from chunk


def load_texts(
    dataset: Any = "python_stdlib",
    split: str = "train",
    *,
    data_dir: str | None = None,
    text_key: str = "text",
    max_documents: int | None = None,
) -> list[str]:
    """Returns the raw texts of a split, in the source's order.

    Used to show samples, to seed generation, and to train a SentencePiece
    model (:func:`transformer_jax.data.train_sentencepiece`).  ``dataset``,
    ``split`` and ``data_dir`` are as in :func:`open_source`; ``text_key`` is
    the text feature; ``max_documents`` limits how many are read.
    """
    source, _ = open_source(dataset, split, data_dir=data_dir)
    n = len(source) if max_documents is None else min(len(source), max_documents)
    return list(iter_texts(source, text_key, range(n)))
