"""Hugging Face ``datasets`` as a document source: ``dataset="hf:PATH_OR_REPO[:CONFIG]"``.

``PATH_OR_REPO`` is one of

* a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a
  ``DatasetDict`` of splits), read with ``load_from_disk``;
* a data file (``.parquet``, ``.arrow``, ``.json``/``.jsonl``, ``.csv``, ``.txt``): its
  one split is ``train``;
* a directory of data files (a downloaded Hub repository, e.g. its parquet files):
  ``datasets`` names the splits from the file names (``train-*.parquet``,
  ``data/validation-*``, ...); ``CONFIG`` is a configuration its ``README.md`` declares,
  or a subdirectory (``glue``'s ``sst2``); with several, one must be named;
* a Hub repository, ``owner/name`` (``CONFIG`` its configuration), downloaded once into
  the ``datasets`` cache (``$HF_HOME``); this needs a network.

The split is a ``datasets.Dataset``: Arrow files, memory-mapped, read by index, so it is
random access like a TFDS data source and the LM pipeline's memory and stream modes and
exact resume work on it unchanged. Streaming from the Hub (an ``IterableDataset``) is not
supported: download the split (or the files) first. No TensorFlow is needed.

Opening a split refuses in one line, naming the file or split and the fix, what
``datasets`` would trip over or silently get wrong: a split the dataset lacks, a file or
split without rows, a missing file taken for a Hub name, configurations left unnamed.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import types
from typing import Any, Sequence

from transformer_jax.errors import UserError

__all__ = ["HFImageSource", "HFSource", "image_columns", "is_hf_dataset", "open_hf_source",
           "parse_hf_spec", "progress_bars"]

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

    def null_row(self, field: str) -> int | None:
        """The first row whose ``field`` is null (an empty cell), or None: from Arrow's null
        counts, so a column without one costs no read. (None also for a field that is no
        column, or rows reordered by an indices mapping.)"""
        table = self.dataset.data
        if getattr(self.dataset, "_indices", None) is not None or field not in table.column_names:
            return None
        column = table.column(field)
        if not column.null_count:
            return None
        import pyarrow.compute as pc
        return int(pc.index(pc.is_null(column), True).as_py())

    def refuse_empty_cells(self, fields) -> None:
        """A UserError naming the first row with an empty cell (:meth:`null_row`) in any of
        ``fields``, and the fix; nothing where every cell holds a value."""
        for field in fields:
            row = self.null_row(field)
            if row is not None:
                raise UserError(f"dataset {self.name!r} split {self.split!r} row {row} has no "
                                f"{field!r} (an empty cell); drop the rows with empty cells, or "
                                "fill them")

    def label_strings(self, field: str) -> tuple[str, ...] | None:
        """For a label column of strings, its distinct strings, sorted: the classes
        ``datasets``' ``class_encode_column`` makes of them, id = place in this list. None
        for any other column (a ``ClassLabel``'s rows are ids already)."""
        if not self.holds_strings(field):
            return None
        return tuple(sorted(v for v in self.dataset.unique(field) if v is not None))

    def refuse_unknown_labels(self, field: str, classes: Sequence[str]) -> None:
        """A UserError where this split's string labels in ``field`` include some outside
        ``classes`` (the train split's), naming them and the fix; nothing otherwise."""
        unknown = sorted(set(self.label_strings(field) or ()) - set(classes))
        if unknown:
            raise UserError(f"dataset {self.name!r} split {self.split!r} has labels {unknown[:5]} "
                            f"that the train split lacks (its classes: {list(classes)[:10]}); "
                            "drop those rows or relabel them")

    def holds_strings(self, field: str) -> bool:
        """Whether ``field`` is a column of strings."""
        import datasets

        feature = self.features.get(field)
        return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")


def _pick_split(splits, dataset: str, split: str, hint: str = ""):
    """``splits[split]``, or a refusal that lists the splits there are and says what to set:
    the run trains on ``train`` and evaluates on ``eval_split``."""
    if split in splits:
        return splits[split]
    have = sorted(str(s) for s in splits)
    if split == "train":
        raise UserError(f"dataset {dataset!r} has no train split (its splits: {have}); the run "
                        "trains on the split named train: name the training rows' split (or "
                        "file, train-*.parquet) train")
    raise UserError(f"dataset {dataset!r} has no {split!r} split to evaluate on (its splits: "
                    f"{have}); set --set eval_split=NAME to one of them (eval_split=train scores "
                    f"the training rows), or give the held-out rows a split of their own{hint}")


#: where the refusal of a missing eval split points a single data file
_FILE_HINT = " (a directory with train.parquet and validation.parquet, as hf:DIR)"


def _holds_rows(path: str) -> bool:
    """Whether a data file holds a row, from its metadata (parquet, Arrow) or its first
    64 KiB (text formats: not blank; a CSV: more than its header line; JSON: not ``[]``)."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        return pq.ParquetFile(path).metadata.num_rows > 0
    if suffix == ".arrow":
        import pyarrow as pa
        with pa.memory_map(path) as f:
            try:
                return pa.ipc.open_stream(f).read_all().num_rows > 0
            except pa.ArrowInvalid:
                return pa.ipc.open_file(f).read_all().num_rows > 0
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    if len(head) == 1 << 16:
        return True
    lines = [line for line in head.splitlines() if line.strip()]
    if suffix == ".csv":
        return len(lines) > 1
    return bool(lines) and head.strip() not in (b"[]", b"{}")


def _read_error(dataset: str, files: dict, error: Exception) -> UserError:
    """Why ``datasets`` could not build the splits of ``files`` (split -> paths): a split
    whose files hold no rows, else the innermost error's first line."""
    for split, paths in files.items():
        if paths and not any(_holds_rows(p) for p in paths):
            what = (paths[0] if len(paths) == 1 else
                    f"the {len(paths)} files of split {split!r} ({paths[0]}, ...)")
            fix = "give it rows" if len(files) == 1 else "give it rows, or remove it"
            return UserError(f"dataset {dataset!r}: {what} holds no rows, so split {split!r} is "
                             f"empty; {fix}")
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return UserError(f"dataset {dataset!r}: `datasets` cannot read its data files "
                     f"({type(error).__name__}: {first[:200]}); check them (an empty or "
                     "malformed file?)")


def _check_rows(dataset: str, split: str, loaded, where: str):
    """``loaded`` when it holds a row; else a refusal naming the split and ``where``."""
    if len(loaded):
        return loaded
    advice = ("give it rows" if split == "train" else
              "give it rows, or set --set eval_split=NAME to a split that has some")
    raise UserError(f"dataset {dataset!r} split {split!r} is empty (no rows in {where}); "
                    f"{advice}")


def _load_saved(dataset: str, local: str, split: str):
    """A ``save_to_disk`` directory's ``split``: only that split is read (``datasets`` cannot
    load a ``DatasetDict`` with an empty split at all)."""
    import datasets

    if not os.path.exists(os.path.join(local, "dataset_dict.json")):
        _pick_split({"train": None}, dataset, split, _FILE_HINT)
        return _check_rows(dataset, split, datasets.load_from_disk(local), local)
    with open(os.path.join(local, "dataset_dict.json")) as f:
        names = json.load(f)["splits"]
    folder = os.path.join(local, _pick_split({n: n for n in names}, dataset, split,
                                             " (a DatasetDict holding it, saved again)"))
    with open(os.path.join(folder, "state.json")) as f:
        empty = not json.load(f).get("_data_files")   # which load_from_disk cannot read
    return _check_rows(dataset, split, () if empty else datasets.load_from_disk(folder), folder)


def _load_file(dataset: str, local: str, split: str):
    """A single data file: its one split, ``train``."""
    import datasets

    suffix = os.path.splitext(local)[1].lower()
    if suffix not in _FILE_BUILDERS:
        raise UserError(f"dataset {dataset!r}: cannot read {suffix or 'extensionless'} files; "
                        f"use one of {sorted(_FILE_BUILDERS)} or a save_to_disk directory")
    _pick_split({"train": None}, dataset, split, _FILE_HINT)
    try:
        loaded = datasets.load_dataset(_FILE_BUILDERS[suffix], data_files={"train": local},
                                       split="train")
    except Exception as e:   # an empty or malformed file: one line naming it
        raise _read_error(dataset, {"train": [local]}, e) from None
    return _check_rows(dataset, split, loaded, local)


def _config_folders(local: str, files: dict) -> list[str]:
    """The subfolders of ``local`` whose files one split takes together (config folders of a
    repository without a README that declares them), or [] when every split's files lie in
    one folder."""
    mixed: set[str] = set()
    for paths in files.values():
        tops = {os.path.relpath(p, local).split(os.sep)[0] for p in paths
                if os.sep in os.path.relpath(p, local)}
        if len(tops) > 1:
            mixed |= tops
    return sorted(mixed)


def _load_dir(dataset: str, local: str, config: str | None, split: str):
    """A directory of data files: a downloaded Hub repository, ``config`` one of its README's
    configurations or a subfolder."""
    import datasets

    declared = [c for c in datasets.get_dataset_config_names(local) if c != "default"]
    kwargs: dict[str, Any] = {}
    if config in declared:
        kwargs["name"] = config
    elif config is not None:
        if not os.path.isdir(os.path.join(local, config)):
            have = declared or sorted(e.name for e in os.scandir(local) if e.is_dir())
            raise UserError(f"dataset {dataset!r}: {local} has no configuration or subdirectory "
                            f"{config!r}; name one of {have} or drop ':{config}'")
        kwargs["data_dir"] = config
    try:
        builder = datasets.load_dataset_builder(local, **kwargs)
    except (FileNotFoundError, ValueError) as e:
        if declared and config is None:
            raise UserError(f"dataset {dataset!r} has configurations {declared} (its README.md); "
                            f"name one: dataset=hf:{local}:{declared[0]}") from None
        raise UserError(f"dataset {dataset!r}: no data files that `datasets` can read in "
                        f"{local} ({str(e).splitlines()[0]})") from None
    files = {str(k): list(v) for k, v in (builder.config.data_files or {}).items()}
    folders = [] if declared or config is not None else _config_folders(local, files)
    if folders:
        raise UserError(f"dataset {dataset!r}: the subfolders {folders} look like configurations "
                        "(no README.md declares any), and without one named their data files "
                        f"would train as one split; name one: dataset=hf:{local}:{folders[0]}")
    _pick_split(files, dataset, split, f" (data files named {split}.parquet or "
                f"{split}-*.parquet beside the train ones)")
    try:
        loaded = datasets.load_dataset(local, split=split, **kwargs)
    except Exception as e:   # an empty or malformed file: one line naming it
        raise _read_error(dataset, files, e) from None
    return _check_rows(dataset, split, loaded, f"{len(files[split])} data file(s) in {local}")


def _load(dataset: str, split: str):
    import datasets

    path, config = parse_hf_spec(dataset)
    local = os.path.expanduser(path)
    if os.path.isdir(local) and any(os.path.exists(os.path.join(local, f)) for f in
                                    ("dataset_dict.json", "state.json")):
        if config is not None:
            raise UserError(f"dataset {dataset!r}: a save_to_disk directory has no "
                            f"configurations; drop ':{config}'")
        return _load_saved(dataset, local, split)
    if os.path.isfile(local):
        return _load_file(dataset, local, split)
    if os.path.isdir(local):
        return _load_dir(dataset, local, config, split)
    if os.path.splitext(local)[1].lower() in _FILE_BUILDERS:
        raise UserError(f"dataset {dataset!r}: there is no file {os.path.abspath(local)}; "
                        "check the path (a relative one starts in the current directory, "
                        f"{os.getcwd()})")
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
    return _check_rows(dataset, split, _pick_split(loaded, dataset, split),
                       f"the Hub's {path}")


@contextlib.contextmanager
def progress_bars(enabled: bool):
    """``datasets``' progress bars (preparing a split, loading one from disk) on or, for
    ``--no-progress``, off for the block (as they were after it)."""
    if enabled or importlib.util.find_spec("datasets") is None:
        yield
        return
    import datasets

    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


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
    (``label``, else the first ``ClassLabel``, else a column of strings named ``label``;
    None when there is none) of an image set."""
    import datasets

    features = source.features
    images = [k for k, f in features.items() if isinstance(f, datasets.Image)]
    labels = [k for k, f in features.items() if isinstance(f, datasets.ClassLabel)]
    if not images:
        raise UserError(f"dataset {source.name!r} has no image column (columns: "
                        f"{sorted(features)}); use a dataset with an Image feature")
    image = "image" if "image" in images else images[0]
    if not labels and source.holds_strings("label"):
        labels = ["label"]
    label = "label" if "label" in labels else (labels[0] if labels else None)
    return image, label


class HFImageSource:
    """An image split of an ``hf:`` dataset as the examples the image pipeline reads:
    ``{"image": uint8 (h, w, C), "label": int, ...the other columns}``, the image decoded by
    PIL and converted to the split's mode (that of its first image: ``L``, C = 1, else
    ``RGB``, C = 3), so a few grayscale or CMYK photos among RGB ones still stack. A label
    column of strings is mapped to ids by ``label_names`` (the run's classes: default this
    split's distinct labels, sorted, as ``datasets``' ``class_encode_column``)."""

    def __init__(self, source: HFSource, label_names: Sequence[str] = ()):
        self.source = source
        self.image_key, self.label_key = image_columns(source)
        if not len(source):
            raise UserError(f"dataset {source.name!r} split {source.split!r} is empty")
        strings = None if self.label_key is None else source.label_strings(self.label_key)
        self.names = tuple(label_names) or strings
        self.ids = None if strings is None else {name: i for i, name in enumerate(self.names)}
        try:
            first = source[0][self.image_key]
        except Exception as e:   # PIL cannot read it: a corrupt or non-image file
            raise UserError(f"dataset {source.name!r} split {source.split!r} row 0: its "
                            f"{self.image_key!r} does not decode as an image ({type(e).__name__}:"
                            f" {str(e)[:120]}); fix or drop the row") from None
        self.mode = "L" if getattr(first, "mode", "RGB") in ("L", "1", "I;16") else "RGB"
        self.num_channels = 1 if self.mode == "L" else 3

    def __len__(self) -> int:
        return len(self.source)

    def _label(self, value: Any, row: int) -> int:
        if self.ids is None:
            return int(value)
        if value not in self.ids:
            raise UserError(f"dataset {self.source.name!r} split {self.source.split!r} row {row} "
                            f"has label {value!r}, not one of the run's classes {list(self.names)}"
                            " (the train split's labels); drop those rows or relabel them")
        return self.ids[value]

    def _example(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        import numpy as np

        out = {k: v for k, v in row.items() if k not in (self.image_key, self.label_key)}
        image = row[self.image_key]
        out["image"] = np.asarray(image.convert(self.mode) if hasattr(image, "convert")
                                  else image, dtype=np.uint8)
        if self.label_key is not None:
            out["label"] = self._label(row[self.label_key], index)
        return out

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self._example(self.source[i], int(i))

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        return [self._example(row, int(i))
                for i, row in zip(indices, self.source.__getitems__(indices))]

    def label_names(self) -> tuple[str, ...]:
        """The class names: the label column's ``ClassLabel`` names, or the strings mapped
        to ids (empty without a label column)."""
        if self.label_key is None:
            return ()
        if self.ids is not None:
            return self.names
        return tuple(self.source.features[self.label_key].names)
