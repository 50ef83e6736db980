"""Image-classification input pipeline: labelled images -> preprocessed, sharded batches.

Datasets:

* ``"digits"``: scikit-learn's ``load_digits`` (1797 grayscale 8x8 images of the digits
  0-9, pixel values 0..16), shipped inside the ``scikit-learn`` package, so it works
  offline. There is no official split: a fixed permutation (``split_seed``) puts
  ``test_fraction`` of the images (360 of 1797 at 0.2) in ``"test"`` and the rest in
  ``"train"``.
* any TFDS dataset with ``image`` and ``label`` features read through
  ``tfds.data_source`` (array_record, no TensorFlow), e.g. ``"cifar10"`` (train/test) or
  ``"imagenet2012"`` (train/validation). These are downloaded and prepared by TFDS on
  first use (tests use ``tfds.testing.mock_data``); without TensorFlow only an already
  prepared one (:func:`~transformer_jax.data.sources.check_tfds_dataset`).
* ``"hf:PATH_OR_REPO[:CONFIG]"``: a Hugging Face dataset with an ``Image`` column and
  (for classification) a ``ClassLabel`` column, e.g. ``"hf:uoft-cs/cifar10"`` (columns
  ``img``, ``label``) or local parquet files
  (:class:`~transformer_jax.data.hf_datasets.HFImageSource`).

Preprocessing (one function, :func:`preprocess_image`), to ``image_size`` S:

  1. scale pixel values to [-1, 1] (``x / max_value * 2 - 1``; max_value 16 for digits,
     255 for uint8 images), as HF ViT's processor (mean = std = 0.5) and big_vision;
  2. resize the shorter side to S (bilinear, antialiased when shrinking: PIL) and take
     the central S x S crop (a no-op for square images already of size S);
  3. with ``augment`` (training only): pad by S // 8 pixels with the background value
     (-1) and take a random S x S crop, then, with ``flip``, mirror left-right with
     probability 1/2. The random numbers of an example depend only on
     ``(seed, epoch, example index)``, so a resumed run sees the same augmentations.

Batches (``B = batch_size // process_count`` rows on each process)::

    {"images":  float32 (B, S, S, C)   NHWC
     "labels":  int32   (B,)           -1 for a dataset without labels (image-caption pairs)
     "weights": float32 (B,)}          1.0, or 0.0 on rows that pad the last eval batch

Order. Training iterates endlessly over epochs; epoch e visits the examples in the order
``permutation(n, seed, e)`` (:func:`transformer_jax.data.shuffle.permutation`) and drops
its last ``n mod batch_size`` examples. Process p of P takes rows [p B/P, (p+1) B/P) of
every global batch. The position is ``{"mode": "images", "epoch", "index"}``
(:meth:`ImageIterator.get_state`); ``set_state`` resumes exactly. Evaluation is one
in-order pass that keeps every example (the last batch padded with weight-0 rows).

Workers. With ``workers`` > 0 (``ExperimentConfig.data_workers``) worker processes decode
and preprocess the rows (:mod:`transformer_jax.data.image_workers`), up to 3 batches
ahead; the batches are identical to the in-process ones and the state is the same, so a
checkpoint resumes under any worker count. By default (:func:`default_workers`) an
in-memory array source (digits) stays in this process and any other uses the host's cores.
``annotate`` then runs in this process on the example without its ``"image"``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from transformer_jax.data.image_workers import BatchPool, host_cores
from transformer_jax.data.shuffle import hash_order, shuffled
from transformer_jax.data.hf_datasets import HFImageSource, is_hf_dataset, open_hf_source
from transformer_jax.data.sources import (base_name, check_tfds_dataset, default_data_dir,
                                          open_source, read_examples)
from transformer_jax.errors import UserError

__all__ = ["DatasetInfo", "ImageIterator", "check_image_split", "configured_info", "dataset_info",
           "default_workers",
           "digits_split", "load_digits_arrays", "make_image_iterator", "open_image_source",
           "prepare_row", "preprocess_image"]

DIGITS_SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the model and the preprocessing need to know about a dataset."""
    name: str
    num_classes: int
    num_channels: int
    max_value: float                 # the pixel value that maps to +1
    label_names: tuple[str, ...]
    flip: bool                       # is left-right mirroring a label-preserving augmentation?

    def to_spec(self) -> dict:
        """Its JSON in a task's spec (:meth:`from_spec` reads it back)."""
        return {"dataset": self.name, "num_classes": self.num_classes,
                "num_channels": self.num_channels, "max_value": self.max_value,
                "label_names": list(self.label_names), "flip": self.flip}

    @classmethod
    def from_spec(cls, spec: dict) -> "DatasetInfo":
        """The inverse of :meth:`to_spec` (the spec may hold other keys too)."""
        return cls(spec["dataset"], spec["num_classes"], spec["num_channels"], spec["max_value"],
                   tuple(spec["label_names"]), spec["flip"])


# ----------------------------------------------------------------------------- digits

def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: images float32 (1797, 8, 8, 1) in [0, 16], labels int32 (1797,)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError("the 'digits' dataset comes from scikit-learn; install it with "
                          "`pip install scikit-learn`") from e
    digits = load_digits()
    return (digits.images.astype(np.float32)[..., None], digits.target.astype(np.int32))


class ArraySource:
    """In-memory random-access source of ``{"image", "label"}`` examples."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        if len(images) != len(labels):
            raise UserError(f"{len(images)} images but {len(labels)} labels")
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": self.images[i], "label": self.labels[i]}


def digits_split(split: str, *, test_fraction: float = 0.2, split_seed: int = 0) -> ArraySource:
    """The ``"train"`` or ``"test"`` part of the digits (a fixed, seeded partition)."""
    if split not in DIGITS_SPLITS:
        raise UserError(f"the 'digits' dataset has splits {DIGITS_SPLITS}, not {split!r} "
                        "(set eval_split='test')")
    if not 0.0 < test_fraction < 1.0:
        raise UserError(f"test_fraction must be in (0, 1), got {test_fraction}")
    images, labels = load_digits_arrays()
    order = hash_order(len(labels), split_seed)
    n_test = int(round(test_fraction * len(labels)))
    rows = np.sort(order[:n_test] if split == "test" else order[n_test:])
    return ArraySource(images[rows], labels[rows])


# ----------------------------------------------------------------------------- sources

def open_image_source(dataset: str, split: str, *, data_dir: str | None = None,
                      test_fraction: float = 0.2, split_seed: int = 0,
                      label_names: tuple[str, ...] = ()):
    """Random-access source of ``{"image": (h, w, c), "label": int}`` examples; an ``hf:``
    set's labels that are strings become the ids of ``label_names`` (the run's classes)."""
    if dataset == "digits":
        return digits_split(split, test_fraction=test_fraction, split_seed=split_seed)
    if is_hf_dataset(dataset):
        return HFImageSource(open_hf_source(dataset, split), label_names)
    source, _ = open_source(dataset, split, data_dir=data_dir or default_data_dir())
    return source


def check_image_split(dataset: str, split: str, *, label_names: tuple[str, ...] = (),
                      caption_keys: tuple[str, ...] = ()) -> HFImageSource | None:
    """Refuses, before a run writes anything, an image split it could not read: a digits
    split that is not ``train`` or ``test``; an ``hf:`` split that is missing or empty,
    without an image column or whose first image does not decode, with an empty cell in
    its image, label or caption columns (``caption_keys``, those it has), or with string
    labels outside ``label_names`` (the train split's). Returns the ``hf:`` split's
    source (None for the others: TFDS reads its own)."""
    if dataset == "digits" and split not in DIGITS_SPLITS:
        digits_split(split)   # refused, naming the splits
    if not is_hf_dataset(dataset):
        return None
    source = HFImageSource(open_hf_source(dataset, split), label_names)
    columns = [source.image_key, source.label_key, *(k.split("/")[0] for k in caption_keys)]
    source.source.refuse_empty_cells(dict.fromkeys(c for c in columns if c is not None))
    if label_names and source.ids is not None:
        source.source.refuse_unknown_labels(source.label_key, label_names)
    return source


def dataset_info(dataset: str, *, data_dir: str | None = None) -> DatasetInfo:
    """Classes, channels and value range of ``"digits"``, a TFDS image dataset (no data read)
    or an ``hf:`` one (its train split's first image read); a dataset without labels (image
    captions) has 0 classes."""
    if dataset == "digits":
        return DatasetInfo("digits", 10, 1, 16.0, tuple(str(i) for i in range(10)), False)
    if is_hf_dataset(dataset):
        source = HFImageSource(open_hf_source(dataset, "train"))
        names = source.label_names()
        return DatasetInfo(dataset, len(names), source.num_channels, 255.0, names, True)
    check_tfds_dataset(dataset, data_dir)
    import tensorflow_datasets as tfds

    try:
        features = tfds.builder(dataset, data_dir=data_dir or default_data_dir()).info.features
    except tfds.core.registered.DatasetNotFoundError as e:
        raise UserError(f"unknown image dataset {dataset!r}: use 'digits' or a TFDS name such as "
                        "'cifar10' or 'imagenet2012'") from e
    if "image" not in features or "label" not in features:
        raise UserError(f"dataset {dataset!r} is not an image-classification dataset: it needs "
                        f"'image' and 'label' features (it has {sorted(features)}); try "
                        "'digits', 'cifar10' or 'imagenet2012'")
    label, image = features["label"], features["image"]
    names = tuple(getattr(label, "names", None) or (str(i) for i in range(label.num_classes)))
    channels = image.shape[-1] or 3
    return DatasetInfo(base_name(dataset), int(label.num_classes), int(channels), 255.0, names, True)


def configured_info(dataset: str, num_classes: int, num_channels: int) -> DatasetInfo:
    """What :func:`dataset_info` says of ``dataset``, with the classes and channels given
    (the model config's) instead of read: nothing is opened, no TFDS metadata, no ``hf:``
    file. What ``transformer-jax compile`` plans with, on a host that may not hold (or be
    able to read) the data; the digits' facts need no data and are their own."""
    if dataset == "digits":
        return dataset_info("digits")
    name = dataset if is_hf_dataset(dataset) else base_name(dataset)
    return DatasetInfo(name, num_classes, num_channels, 255.0,
                       tuple(str(i) for i in range(num_classes)), True)


# ----------------------------------------------------------------------------- preprocessing

def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of a float32 (h, w, c) image, per channel through PIL ("F" mode)."""
    from PIL import Image

    if image.shape[:2] == (height, width):
        return image
    channels = [np.asarray(Image.fromarray(np.ascontiguousarray(image[..., k]), mode="F")
                           .resize((width, height), Image.BILINEAR))
                for k in range(image.shape[-1])]
    return np.stack(channels, axis=-1)


def preprocess_image(image: np.ndarray, image_size: int, *, max_value: float = 255.0,
                     augment: bool = False, flip: bool = False,
                     rng: np.random.Generator | None = None) -> np.ndarray:
    """One (h, w, c) image -> float32 (S, S, c) in [-1, 1] (module docstring, steps 1-3)."""
    image = np.asarray(image)
    if image.ndim == 2:
        image = image[..., None]
    if image.ndim != 3:
        raise UserError(f"expected an (h, w, c) image, got shape {image.shape}")
    x = image.astype(np.float32) * (2.0 / max_value) - 1.0
    h, w = x.shape[:2]
    s = image_size
    scale = s / min(h, w)
    nh, nw = max(s, round(h * scale)), max(s, round(w * scale))
    x = _resize(x, nh, nw)
    top, left = (nh - s) // 2, (nw - s) // 2
    x = x[top:top + s, left:left + s]
    if augment:
        if rng is None:
            raise UserError("augment=True needs an rng")
        pad = s // 8
        if pad:
            x = np.pad(x, ((pad, pad), (pad, pad), (0, 0)), constant_values=-1.0)
            dy, dx = rng.integers(0, 2 * pad + 1, size=2)
            x = x[dy:dy + s, dx:dx + s]
        if flip and rng.random() < 0.5:
            x = x[:, ::-1]
    return np.ascontiguousarray(x, dtype=np.float32)


def prepare_row(example: dict, index: int, epoch: int, params: dict) -> np.ndarray:
    """One example's preprocessed image: a function of the example and ``(seed, epoch,
    index)`` only (``params``: the iterator's image_size, max_value, augment, flip, seed,
    num_channels, name). The in-process path and the workers both run this."""
    rng = np.random.default_rng([params["seed"], epoch, index]) if params["augment"] else None
    image = preprocess_image(example["image"], params["image_size"],
                             max_value=params["max_value"], augment=params["augment"],
                             flip=params["flip"], rng=rng)
    if image.shape[-1] != params["num_channels"]:
        raise UserError(f"dataset {params['name']!r} example {index} has {image.shape[-1]} "
                        f"channels, expected {params['num_channels']}")
    return image


# ----------------------------------------------------------------------------- iterator

class ImageIterator:
    """Batches of preprocessed images with a savable position (module docstring).

    Attributes: ``num_examples``, ``batches_per_epoch`` (per pass in eval),
    ``global_batch_size``, ``batch_size`` (this process's rows). ``workers`` > 0: that many
    processes preprocess (started at the first batch; :meth:`close` stops them).
    """

    def __init__(self, source, *, name: str, split: str, image_size: int, num_channels: int,
                 max_value: float, batch_size: int, seed: int, shuffle: bool, repeat: bool,
                 augment: bool = False, flip: bool = False, process_index: int = 0,
                 process_count: int = 1,
                 annotate: Callable[[Any, int, int], dict[str, np.ndarray]] | None = None,
                 workers: int = 0):
        if image_size < 1:
            raise UserError(f"image_size must be >= 1, got {image_size}")
        if batch_size < 1 or batch_size % process_count:
            raise UserError(f"batch_size {batch_size} must be >= 1 and divisible by "
                            f"process_count {process_count}")
        self._source = source
        self.name, self.split = name, split
        self.image_size, self.num_channels, self.max_value = image_size, num_channels, max_value
        self.global_batch_size = batch_size
        self.batch_size = batch_size // process_count
        self.seed, self.shuffle, self.repeat = seed, shuffle, repeat
        self.augment, self.flip = augment, flip
        self.process_index, self.process_count = process_index, process_count
        self.annotate = annotate
        if not isinstance(workers, int) or workers < 0:
            raise UserError(f"data_workers must be an integer >= 0 (0: in this process), got "
                            f"{workers!r}")
        self.workers = workers
        self._pool: BatchPool | None = None
        self.num_examples = len(source)
        if self.num_examples == 0:
            raise UserError(f"dataset {name!r} split {split!r} is empty (0 examples); prepare the "
                            "dataset again or choose another dataset/split")
        if repeat:
            self.batches_per_epoch = self.num_examples // batch_size
            if self.batches_per_epoch == 0:
                raise UserError(f"dataset {name!r} split {split!r} has {self.num_examples} "
                                f"examples, fewer than one batch of {batch_size}; lower batch_size")
        else:
            self.batches_per_epoch = -(-self.num_examples // batch_size)
        self._epoch, self._index = 0, 0

    def __iter__(self) -> ImageIterator:
        return self

    @property
    def _params(self) -> dict[str, Any]:
        """What :func:`prepare_row` needs."""
        return {"seed": self.seed, "image_size": self.image_size, "max_value": self.max_value,
                "augment": self.augment, "flip": self.flip,
                "num_channels": self.num_channels, "name": self.name}

    def _ids(self, epoch: int, index: int) -> np.ndarray:
        """The example ids of this process's rows of batch ``index`` of ``epoch``."""
        first = index * self.global_batch_size + self.process_index * self.batch_size
        positions = np.arange(first, first + self.batch_size)
        ids = positions[positions < self.num_examples]
        return shuffled(ids, self.num_examples, self.seed, epoch) if self.shuffle else ids

    def _advance(self, epoch: int, index: int) -> tuple[int, int]:
        index += 1
        return (epoch + 1, 0) if self.repeat and index == self.batches_per_epoch else (epoch, index)

    def _exhausted(self, index: int) -> bool:
        return not self.repeat and index >= self.batches_per_epoch

    def __next__(self) -> dict[str, np.ndarray]:
        if self._exhausted(self._index):
            raise StopIteration
        if self.workers:
            images, rests = self._next_from_workers()
        else:
            ids = self._ids(self._epoch, self._index)
            rests = [dict(example, _id=int(i)) for i, example
                     in zip(ids, read_examples(self._source, ids))]
            params = self._params
            images = np.stack([prepare_row(r, r["_id"], self._epoch, params) for r in rests]
                              ) if rests else None
        batch = self._assemble(images, rests)
        self._epoch, self._index = self._advance(self._epoch, self._index)
        return batch

    def _next_from_workers(self) -> tuple[np.ndarray, list[dict]]:
        """The current batch from the pool, which it keeps ``depth`` batches ahead."""
        if self._pool is None:
            self._pool = BatchPool(self._source, prepare_row, self._params,
                                   workers=self.workers, batch_size=self.batch_size,
                                   shape=(self.image_size, self.image_size, self.num_channels))
            self._ahead = (self._epoch, self._index)
        while not self._pool.full() and not self._exhausted(self._ahead[1]):
            ids = self._ids(*self._ahead)
            self._pool.submit((*self._ahead, ids), ids, self._ahead[0])
            self._ahead = self._advance(*self._ahead)
        (epoch, index, ids), images, rests = self._pool.take()
        assert (epoch, index) == (self._epoch, self._index), "pool out of step"
        for i, r in zip(ids, rests):
            r["_id"] = int(i)
        return images, rests

    def _assemble(self, images: np.ndarray | None, rests: list[dict]) -> dict[str, np.ndarray]:
        """The batch dict from the rows' images and examples (``_id`` their index)."""
        b, s = self.batch_size, self.image_size
        if images is not None and len(images) == b:   # a full batch: its array as it is
            out = images
        else:
            out = np.zeros((b, s, s, self.num_channels), np.float32)
            if rests:
                out[:len(rests)] = images
        labels = np.zeros((b,), np.int32)
        weights = np.zeros((b,), np.float32)
        extras: dict[str, np.ndarray] = {}
        for row, example in enumerate(rests):
            i = example.pop("_id")
            weights[row] = 1.0
            labels[row] = int(example["label"]) if "label" in example else -1
            if self.annotate is not None:
                for key, value in self.annotate(example, i, self._epoch).items():
                    value = np.asarray(value)
                    if key not in extras:
                        extras[key] = np.zeros((b,) + value.shape, value.dtype)
                    extras[key][row] = value
        return {"images": out, "labels": labels, "weights": weights, **extras}

    def close(self) -> None:
        """Stops the worker processes (a later batch starts them again)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __del__(self):
        if getattr(self, "_pool", None) is not None:
            self.close()

    def get_state(self) -> dict[str, Any]:
        """The position of the next batch, JSON-serialisable (independent of the process)."""
        return {"mode": "images", "epoch": int(self._epoch), "index": int(self._index)}

    def set_state(self, state: dict[str, Any]) -> None:
        """Move to a position returned by :meth:`get_state`."""
        if not isinstance(state, dict) or state.get("mode") != "images":
            raise UserError(f"cannot restore {state!r}: not an image-iterator state")
        epoch, index = state.get("epoch"), state.get("index")
        if not isinstance(epoch, int) or not isinstance(index, int) or epoch < 0 or index < 0:
            raise UserError(f"image-iterator state needs non-negative integer epoch and index, "
                            f"got {state!r}")
        if index > self.batches_per_epoch or (self.repeat and index == self.batches_per_epoch):
            raise UserError(f"image-iterator state index {index} is out of range for "
                            f"{self.batches_per_epoch} batches per epoch")
        if self._pool is not None:
            self._pool.discard()
            self._ahead = (epoch, index)
        self._epoch, self._index = epoch, index


def make_image_iterator(dataset: str, split: str, *, image_size: int, batch_size: int,
                        seed: int = 0, shuffle: bool = True, repeat: bool = True,
                        augment: bool = False, flip: bool | None = None,
                        data_dir: str | None = None, process_index: int = 0,
                        process_count: int = 1, test_fraction: float = 0.2, split_seed: int = 0,
                        info: DatasetInfo | None = None,
                        annotate: Callable[[Any, int, int], dict[str, np.ndarray]] | None = None,
                        workers: int | None = None) -> ImageIterator:
    """An :class:`ImageIterator` over ``dataset``'s ``split`` (module docstring).

    ``flip`` defaults to the dataset's (False for digits, True for TFDS photos);
    ``augment`` applies only where ``repeat`` (training). ``annotate(example, index, epoch)``
    adds arrays to each row (the contrastive task's tokenized caption); rows that pad the
    last eval batch hold zeros there. ``workers``: processes that decode and augment
    (:func:`default_workers` when None; 0: in this process).
    """
    if process_count < 1 or not 0 <= process_index < process_count:
        raise UserError(f"need 0 <= process_index < process_count, got {process_index}, "
                        f"{process_count}")
    info = info or dataset_info(dataset, data_dir=data_dir)
    source = open_image_source(dataset, split, data_dir=data_dir, test_fraction=test_fraction,
                               split_seed=split_seed, label_names=info.label_names)
    return ImageIterator(source, name=dataset, split=split, image_size=image_size,
                         num_channels=info.num_channels, max_value=info.max_value,
                         batch_size=batch_size, seed=seed, shuffle=shuffle, repeat=repeat,
                         augment=augment and repeat, flip=info.flip if flip is None else flip,
                         process_index=process_index, process_count=process_count,
                         annotate=annotate, workers=default_workers(source, workers))


def default_workers(source, requested: int | None = None) -> int:
    """``requested``, or where None: 0 for an in-memory array source (digits: an epoch
    costs 0.2 CPU s here, less than starting a pool, and each image 12% more CPU through a
    worker), else the host's cores (decoding and resizing a photo costs ~5 CPU ms).
    Measurements: docs/performance.md, 2026-12-07."""
    if requested is not None:
        return requested
    return 0 if isinstance(source, ArraySource) else host_cores()

