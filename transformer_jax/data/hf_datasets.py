"""Hugging Face ``datasets`` as a document source: ``dataset="hf:PATH_OR_REPO[:CONFIG]"``.

``PATH_OR_REPO`` is one of

* a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a
  ``DatasetDict`` of splits), read with ``load_from_disk``;
* a data file (``.parquet``, ``.arrow``, ``.json``/``.jsonl``, ``.csv``, ``.txt``): its
  one split is ``train``;
* a directory of data files (a downloaded Hub repository, e.g. its parquet files):
  ``datasets`` names the splits from the file names (``train-*.parquet``,
  ``data/validation-*``, ...); ``CONFIG`` is a subdirectory (``glue``'s ``sst2``);
* a Hub repository, ``owner/name`` (``CONFIG`` its configuration), downloaded once into
  the ``datasets`` cache (``$HF_HOME``); this needs a network.

The split is a ``datasets.Dataset``: Arrow files, memory-mapped, read by index, so it is
random access like a TFDS data source and the LM pipeline's memory and stream modes and
exact resume work on it unchanged. Streaming from the Hub (an ``IterableDataset``) is not
supported: download the split (or the files) first. No TensorFlow is needed.
"""
from __future__ import annotations

import os
import types
from typing import Any, Sequence

from transformer_jax.errors import UserError

__all__ = ["HFImageSource", "HFSource", "image_columns", "is_hf_dataset", "open_hf_source",
           "parse_hf_spec"]

PREFIX = "hf:"
_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json",
                  ".csv": "csv", ".txt": "text"}


def is_hf_dataset(dataset: Any) -> bool:
    """Is ``dataset`` an ``hf:...`` name?"""
    return isinstance(dataset, str) and dataset.startswith(PREFIX)


def parse_hf_spec(dataset: str) -> tuple[str, str | None]:
    """``"hf:PATH_OR_REPO[:CONFIG]"`` -> ``(PATH_OR_REPO, CONFIG or None)``."""
    rest = dataset[len(PREFIX):]
    path, sep, config = rest.rpartition(":")
    if not sep or "/" in config or not path:
        path, config = rest, ""
    if not path:
        raise UserError(f"dataset {dataset!r} names no data: use hf:OWNER/NAME[:CONFIG] (a Hub "
                        "repository) or hf:LOCAL_PATH (a save_to_disk directory or data files)")
    return path, config or None


class HFSource:
    """A split of a ``datasets.Dataset``: ``len()``, indexing (rows as dicts) and
    ``__getitems__``; ``features`` are the dataset's, ``dataset_info.full_name`` names the
    split's content (for the token-stream cache)."""

    def __init__(self, dataset, name: str, split: str):
        self.dataset, self.name, self.split = dataset, name, split
        self.features = dataset.features
        fingerprint = getattr(dataset, "_fingerprint", None) or "unknown"
        self.dataset_info = types.SimpleNamespace(full_name=f"{name}@{fingerprint}")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.dataset[int(i)]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return list(self.dataset.__getitems__([int(i) for i in indices]))


def _pick_split(splits, dataset: str, split: str):
    if split not in splits:
        raise UserError(f"dataset {dataset!r} has splits {sorted(splits)}, not {split!r}; set "
                        "eval_split (or the split) to one of them")
    return splits[split]


def _load(dataset: str, split: str):
    import datasets

    path, config = parse_hf_spec(dataset)
    local = os.path.expanduser(path)
    if os.path.isdir(local) and any(os.path.exists(os.path.join(local, f)) for f in
                                    ("dataset_dict.json", "state.json")):
        if config is not None:
            raise UserError(f"dataset {dataset!r}: a save_to_disk directory has no "
                            f"configurations; drop ':{config}'")
        loaded = datasets.load_from_disk(local)
        return _pick_split(loaded, dataset, split) if isinstance(loaded, dict) else (
            _pick_split({"train": loaded}, dataset, split))
    if os.path.isfile(local):
        suffix = os.path.splitext(local)[1].lower()
        if suffix not in _FILE_BUILDERS:
            raise UserError(f"dataset {dataset!r}: cannot read {suffix or 'extensionless'} files; "
                            f"use one of {sorted(_FILE_BUILDERS)} or a save_to_disk directory")
        _pick_split({"train": None}, dataset, split)
        return datasets.load_dataset(_FILE_BUILDERS[suffix], data_files={"train": local},
                                     split="train")
    if os.path.isdir(local):
        if config is not None and not os.path.isdir(os.path.join(local, config)):
            have = sorted(e.name for e in os.scandir(local) if e.is_dir())
            raise UserError(f"dataset {dataset!r}: {local} has no subdirectory {config!r}; "
                            f"name one of {have} or drop ':{config}'")
        try:
            loaded = datasets.load_dataset(local, data_dir=config)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"dataset {dataset!r}: no data files that `datasets` can read in "
                            f"{local} ({str(e).splitlines()[0]})") from None
        return _pick_split(loaded, dataset, split)
    if path.startswith(("/", ".", "~")) or path.count("/") != 1:
        raise UserError(f"dataset {dataset!r}: {path} is neither a local file or directory nor "
                        "a Hub repository (owner/name)")
    try:
        loaded = datasets.load_dataset(path, config)
    except Exception as e:   # no network, unknown repo or config: one line, with the fix
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"dataset {dataset!r}: cannot load it from the Hugging Face Hub "
                        f"({type(e).__name__}: {first[:200]}); check the name, config and "
                        "network, or download it where there is one (save_to_disk, or the "
                        "repository's parquet files) and use dataset=hf:LOCAL_PATH") from None
    return _pick_split(loaded, dataset, split)


def open_hf_source(dataset: str, split: str) -> HFSource:
    """The ``split`` of an ``hf:...`` dataset (module docstring) as an :class:`HFSource`."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise UserError(f"dataset {dataset!r} needs the `datasets` package: "
                        "pip install 'transformer-jax[hf]' (or `pip install datasets`)") from None
    return HFSource(_load(dataset, split), dataset, split)


# ----------------------------------------------------------------------------- images

def image_columns(source: HFSource) -> tuple[str, str | None]:
    """The image column (``image``, else the first ``Image`` feature) and the label column
    (``label``, else the first ``ClassLabel``; None when there is none) of an image set."""
    import datasets

    features = source.features
    images = [k for k, f in features.items() if isinstance(f, datasets.Image)]
    labels = [k for k, f in features.items() if isinstance(f, datasets.ClassLabel)]
    if not images:
        raise UserError(f"dataset {source.name!r} has no image column (columns: "
                        f"{sorted(features)}); use a dataset with an Image feature")
    image = "image" if "image" in images else images[0]
    label = "label" if "label" in labels else (labels[0] if labels else None)
    return image, label


class HFImageSource:
    """An image split of an ``hf:`` dataset as the examples the image pipeline reads:
    ``{"image": uint8 (h, w, C), "label": int, ...the other columns}``, the image decoded by
    PIL and converted to the split's mode (that of its first image: ``L``, C = 1, else
    ``RGB``, C = 3), so a few grayscale or CMYK photos among RGB ones still stack."""

    def __init__(self, source: HFSource):
        self.source = source
        self.image_key, self.label_key = image_columns(source)
        if not len(source):
            raise UserError(f"dataset {source.name!r} split {source.split!r} is empty")
        first = source[0][self.image_key]
        self.mode = "L" if getattr(first, "mode", "RGB") in ("L", "1", "I;16") else "RGB"
        self.num_channels = 1 if self.mode == "L" else 3

    def __len__(self) -> int:
        return len(self.source)

    def _example(self, row: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        out = {k: v for k, v in row.items() if k not in (self.image_key, self.label_key)}
        image = row[self.image_key]
        out["image"] = np.asarray(image.convert(self.mode) if hasattr(image, "convert")
                                  else image, dtype=np.uint8)
        if self.label_key is not None:
            out["label"] = int(row[self.label_key])
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._example(self.source[i])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self._example(row) for row in self.source.__getitems__(indices)]

    def label_names(self) -> tuple[str, ...]:
        """The label column's class names (empty without one)."""
        if self.label_key is None:
            return ()
        return tuple(self.source.features[self.label_key].names)
