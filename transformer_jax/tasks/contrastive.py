"""Contrastive image-text training (CLIP): matched pairs in, a symmetric cross-entropy out.

Data (``ExperimentConfig.dataset``), as images plus one caption per image:

  * a labelled image dataset (``"digits"`` offline, or a TFDS classification set such as
    ``"cifar10"``): the caption is a template filled with the class name ("a photo of the
    digit seven." with :data:`DIGIT_TEMPLATES` for the digits, "a photo of a cat." with
    :data:`TEMPLATES` for the others; ``task.templates`` replaces them). Training draws one of the templates per example and epoch (a hash of
    ``(seed, epoch, index)``, so a resumed run sees the same captions); eval uses template
    ``index mod M``.
  * a TFDS image-caption dataset (an ``image`` feature and a caption feature, e.g.
    ``coco_captions``, whose ``captions/text`` holds several captions per image: one is drawn
    as above). Option ``caption_key`` names the feature (``"captions/text"``, ``"caption"``).
  * an ``hf:`` dataset (:mod:`~transformer_jax.data.hf_datasets`) with an image column and a
    ``ClassLabel`` column (as a labelled set) or a caption column (``caption`` or ``text``: a
    string or a list of them), e.g. local parquet files.

Captions are tokenized with the run's tokenizer (``byte``, or a checkpoint's ``hf:DIR``, whose
own ``[bos] ... [eos]`` post-processing is kept) and end with the tokenizer's end-of-text id,
where the model pools (``CLIPConfig.eos_token_id``); longer ones are cut to ``seq_len`` with
the end-of-text kept. Batches::

    {"images": float32 (B, S, S, C), "input_ids": int32 (B, T), "attention_mask": int32 (B, T),
     "labels": int32 (B,) (class, -1 without labels), "weights": float32 (B,)}

Loss (:func:`symmetric_contrastive_loss`). With unit image and text embeddings I, X (B, E) and
the model's temperature ``s = exp(logit_scale)``, ``logits = s I X^T`` (B, B); row i's target
is column i, and the loss is the mean of the cross-entropy over rows (image -> text) and over
columns (text -> image): HF ``CLIPModel(return_loss=True)`` and open_clip's ``ClipLoss``. It is
a loss over the **global** batch: every image against every caption of the step.

  * Under ``jit`` on a data/fsdp mesh the step is written for the global batch and XLA
    gathers the sharded embeddings where the (B, B) logits need them.
  * Under ``pmap`` each device holds B/n rows: it gathers every device's embeddings with
    ``lax.all_gather`` (whose transpose, a reduce-scatter, carries the gradient back to the
    device that made them, as open_clip's ``gather_with_grad``), scores its own rows against
    all columns, and the step's ``psum`` adds the devices' shares. Loss and gradients equal
    one device's (the ``clip`` cases of ``tests/test_sharding.py``, on 8 devices).

Gradient accumulation would shrink the negatives to a micro-batch, so ``accum_steps`` must be
1. Rows of weight 0 (the padding of the last eval batch) are neither queries nor negatives.

``accuracy`` (train and eval) is the in-batch image -> text recall@1: the share of images
whose nearest caption in the batch is their own, or, with labels, one of their class.

Eval metrics beyond the loss (``extra_eval``, on up to ``eval_images`` held-out images):

  * ``zero_shot_accuracy``: classes predicted from text alone, by prompt ensembling: each
    class's embedding is the normalised mean of its M templates' unit embeddings (Radford et
    al. 2021, sec. 3.1.4); labelled datasets only;
  * ``i2t_recall_at_1`` / ``t2i_recall_at_1``: the nearest caption of each image (the nearest
    image of each caption) among all the held-out pairs is a right one: the image's own, or,
    in a labelled dataset where many captions are equal, one of the same class.

Options (``--set task.NAME=value``): ``image_size``, ``augment``, ``flip``, ``test_fraction``,
``split_seed`` (as ``image_classification``), ``templates`` (a list of strings with one
``{}``), ``caption_key``, ``eval_images`` (default 1024).
"""
from __future__ import annotations

import dataclasses
import string
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import data as data_lib
from ..data import images as image_data
from ..data.hf_datasets import is_hf_dataset, open_hf_source
from ..data.hf_tokenizer import HFTokenizer
from ..data.sources import base_name
from ..data.shuffle import splitmix64
from ..errors import UserError
from ..models import build_model
from ..models.clip import l2_normalize
from .base import Task, register_task

Array = jax.Array

#: The caption templates of a labelled dataset; ``{}`` is the class name (CLIP's ImageNet
#: prompts, shortened).
TEMPLATES: tuple[str, ...] = (
    "a photo of a {}.",
    "a blurry photo of a {}.",
    "a close-up photo of a {}.",
    "a photo of the {}.",
    "a drawing of a {}.",
)

#: The digits' templates.
DIGIT_TEMPLATES: tuple[str, ...] = (
    "a photo of the digit {}.",
    "a handwritten {}.",
    "a blurry photo of the number {}.",
    "a drawing of a {}.",
    "the digit {}, written by hand.",
)

#: How the digits' classes are named in captions.
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

CAPTION_KEYS = ("caption", "captions/text", "text")


# ============================================================================ the loss

def _row_cross_entropy(logits: Array, targets: Array, valid: Array, smoothing: float):
    """Per-row ``(loss, nll, best column)`` of (b, C) fp32 logits over the ``valid`` columns (C,)."""
    masked = jnp.where(valid[None, :], logits, -jnp.inf)
    lse = jax.nn.logsumexp(masked, axis=-1)
    target = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0]
    nll = lse - target
    loss = nll
    if smoothing:
        count = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
        mean = jnp.sum(jnp.where(valid[None, :], logits, 0.0), axis=-1) / count
        loss = (1.0 - smoothing) * nll + smoothing * (lse - mean)
    return loss, nll, jnp.argmax(masked, axis=-1)


def symmetric_contrastive_loss(image_embeds: Array, text_embeds: Array, logit_scale: Array,
                               weights: Array | None = None, smoothing: float = 0.0,
                               axis_name: str | None = None, labels: Array | None = None):
    """CLIP's loss as sums: ``(loss_sum, {"weight", "nll", "correct"})``.

    Args:
      image_embeds, text_embeds: (b, E) unit vectors of matched pairs (row i with row i).
      logit_scale: the temperature applied, ``exp(logit_scale)`` (a scalar).
      weights: (b,) 1 for a real pair, 0 for padding (default: all real).
      smoothing: label smoothing of both cross-entropies (over the real columns).
      axis_name: under ``pmap``, the mapped axis: the rows are this device's share of the
        batch, and every device's embeddings are gathered (with their gradient) as the
        columns. ``None``: the rows are the whole batch.
      labels: (b,) classes, -1 where unknown: a caption of the image's class counts as
        found (template captions repeat within a batch); they do not change the loss.

    ``loss_sum / weight`` is the mean over real pairs of ``(CE(image -> texts) + CE(text ->
    images)) / 2``; ``correct`` counts the images whose nearest caption is their own (or,
    with a label, one of its class).
    """
    img = image_embeds.astype(jnp.float32)
    txt = text_embeds.astype(jnp.float32)
    b = img.shape[0]
    w = jnp.ones((b,), jnp.float32) if weights is None else weights.astype(jnp.float32)
    if axis_name is None:
        gather = lambda x: x  # noqa: E731
        offset = 0
    else:
        gather = lambda x: jax.lax.all_gather(x, axis_name, tiled=True)  # noqa: E731
        offset = jax.lax.axis_index(axis_name) * b
    all_img, all_txt, all_w = gather(img), gather(txt), gather(w)
    scale = jnp.asarray(logit_scale, jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    valid = all_w > 0
    targets = offset + jnp.arange(b)
    i2t = scale * jnp.einsum("be,ce->bc", img, all_txt, precision=hi)      # (b, B) image rows
    t2i = scale * jnp.einsum("be,ce->bc", txt, all_img, precision=hi)      # (b, B) text rows
    loss_i, nll_i, best = _row_cross_entropy(i2t, targets, valid, smoothing)
    loss_t, nll_t, _ = _row_cross_entropy(t2i, targets, valid, smoothing)
    hit_i = best == targets
    if labels is not None:
        labels = labels.astype(jnp.int32)
        hit_i |= (labels >= 0) & (gather(labels)[best] == labels)
    real = w > 0
    pick = lambda x: jnp.sum(jnp.where(real, w * x, 0.0))  # noqa: E731  (NaN-safe on padding)
    return pick(0.5 * (loss_i + loss_t)), {
        "weight": jnp.sum(w), "nll": jax.lax.stop_gradient(pick(0.5 * (nll_i + nll_t))),
        "correct": pick(hit_i.astype(jnp.float32))}


def contrastive_loss(apply_fn, params, batch, rngs, deterministic: bool, smoothing: float,
                     axis_name: str | None = None):
    """The train step's loss (:data:`~transformer_jax.losses.LossFn`) for a CLIP model."""
    out = apply_fn({"params": params}, batch["input_ids"], batch["images"],
                   batch["attention_mask"], deterministic=deterministic, rngs=rngs)
    return symmetric_contrastive_loss(out["image_embeds"], out["text_embeds"], out["logit_scale"],
                                      batch.get("weights"), smoothing, axis_name,
                                      batch.get("labels"))


contrastive_loss.global_batch = True      # make_gradient_sums passes the pmap axis name


# ============================================================================ captions

def class_names(info: image_data.DatasetInfo) -> tuple[str, ...]:
    """The words a caption uses for each class: the digits' spelled out, else the
    dataset's label names with underscores as spaces."""
    if info.name == "digits":
        return DIGIT_NAMES
    return tuple(name.replace("_", " ") for name in info.label_names)


def _draw(seed: int, epoch: int, index: int, n: int) -> int:
    """A deterministic choice among ``n``, a hash of (seed, epoch, index)."""
    h = splitmix64(splitmix64(splitmix64(0xC11F ^ seed) ^ epoch) ^ index)
    return h % n


def _one_slot(template: Any) -> bool:
    """Whether ``template`` is a string with exactly one ``{}`` and no other field."""
    if not isinstance(template, str):
        return False
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError:
        return False
    return fields == [""]


def encode_captions(tokenizer, texts: Sequence[str], seq_len: int) -> dict[str, np.ndarray]:
    """``{"input_ids", "attention_mask"}`` int32 (len(texts), seq_len) for the text tower.

    Each caption is the tokenizer's ids (an ``hf:DIR`` tokenizer's with its own special
    tokens, e.g. CLIP's ``<|startoftext|> ... <|endoftext|>``) ending with its end-of-text
    id, cut to ``seq_len`` with that id kept last, and padded with the pad id (the eos id
    where the tokenizer has no pad).
    """
    eos = tokenizer.eos_id
    if eos is None:
        raise UserError(f"tokenizer {tokenizer!r} has no end-of-text id, where the CLIP text "
                        "tower pools; use a tokenizer with an eos token (byte, or hf:DIR of a CLIP "
                        "checkpoint)")
    if seq_len < 2:
        raise UserError(f"seq_len={seq_len} leaves no room for a caption and its end-of-text")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else eos
    ids = np.full((len(texts), seq_len), pad, np.int32)
    mask = np.zeros((len(texts), seq_len), np.int32)
    hf = isinstance(tokenizer, HFTokenizer)          # an hf:DIR tokenizer: its own specials
    for row, text in enumerate(texts):
        tokens = (tokenizer.encode(text, add_special=True) if hf else tokenizer.encode(text))
        if not tokens or tokens[-1] != eos:
            tokens = list(tokens) + [eos]
        if len(tokens) > seq_len:
            tokens = list(tokens[:seq_len - 1]) + [eos]
        ids[row, :len(tokens)] = tokens
        mask[row, :len(tokens)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _caption_field(example: Mapping[str, Any], key: str):
    """``example[key]`` where ``key`` may be nested: ``"captions/text"``."""
    value: Any = example
    for part in key.split("/"):
        if not isinstance(value, Mapping) or part not in value:
            have = sorted(example) if isinstance(example, Mapping) else type(example).__name__
            raise UserError(f"example has no caption field {key!r} (fields: {have}); set "
                            "task.caption_key to the feature holding the captions")
        value = value[part]
    return value


def _as_texts(value: Any) -> list[str]:
    """One caption or several (bytes, str, or an array of them) as a list of str."""
    items = np.asarray(value, dtype=object).reshape(-1).tolist()
    out = [x.decode("utf-8", errors="replace") if isinstance(x, (bytes, bytearray)) else str(x)
           for x in items]
    if not out:
        raise UserError("an example has no caption (an empty caption list)")
    return out


# ============================================================================ zero-shot

def class_embeddings(encode_text, tokenizer, names: Sequence[str], templates: Sequence[str],
                     seq_len: int) -> np.ndarray:
    """(K, E) unit class embeddings from text alone, by prompt ensembling: the normalised mean
    of each class's template embeddings. ``encode_text(input_ids, attention_mask)`` -> (n, E)."""
    texts = [t.format(name) for name in names for t in templates]
    enc = encode_captions(tokenizer, texts, seq_len)
    emb = l2_normalize(jnp.asarray(encode_text(enc["input_ids"], enc["attention_mask"])))
    emb = emb.reshape(len(names), len(templates), -1).mean(axis=1)
    return np.asarray(l2_normalize(emb))


def recall_at_1(similarity: np.ndarray, labels: np.ndarray | None = None) -> float:
    """Share of rows whose best column is a right one: column i for row i, or, with
    ``labels`` (one per row and column, all >= 0), any column of row i's label."""
    best = np.argmax(similarity, axis=1)
    if labels is not None and np.all(labels >= 0):
        return float(np.mean(labels[best] == labels))
    return float(np.mean(best == np.arange(len(best))))


# ============================================================================ the task

def _spec(tokenizer_spec, info: image_data.DatasetInfo, caption_key: str | None) -> dict:
    """The task's spec: the tokenizer, the image facts and the caption feature."""
    return {"tokenizer": tokenizer_spec, **info.to_spec(), "caption_key": caption_key}


@register_task
class ContrastiveTask(Task):
    """CLIP contrastive pretraining on image-caption pairs (module docstring)."""
    name = "contrastive"
    MODELS = ("clip",)
    OPTIONS = {"image_size": None, "augment": False, "flip": None, "test_fraction": 0.2,
               "split_seed": 0, "templates": None, "caption_key": None, "eval_images": 1024}
    loss_fn = staticmethod(contrastive_loss)
    ID_FIELDS = {"input_ids": "vocab_size"}
    BATCH = {"images": ("float32", ("H", "W", "C")), "input_ids": ("int32", ("T",)),
             "attention_mask": ("int32", ("T",)), "labels": ("int32", ()),
             "weights": ("float32", ())}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        if cfg.model != "clip":
            raise UserError(f"task 'contrastive' trains a CLIP model (image and text towers); "
                            f"set model=clip (got model={cfg.model!r})")
        if cfg.accum_steps != 1:
            raise UserError(f"task 'contrastive' scores every image against every caption of "
                            f"the batch; accum_steps={cfg.accum_steps} would shrink that to a "
                            "micro-batch. Set accum_steps=1 (shard the batch over a mesh instead)")
        if cfg.dataset == "python_stdlib":
            raise UserError("task 'contrastive' needs images; set dataset=digits (offline), a TFDS "
                            "image-classification set (cifar10) or an image-caption set")
        if not isinstance(cfg.dataset, str):
            raise UserError("task 'contrastive' reads a dataset by name: 'digits', a TFDS image "
                            "dataset or hf:PATH_OR_REPO, not an in-memory "
                            f"{type(cfg.dataset).__name__}")
        limit = self.options["eval_images"]
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise UserError(f"task.eval_images={limit!r} must be an integer >= 1 (the held-out "
                            "images that zero-shot accuracy and recall are measured on)")
        templates = self.options["templates"]
        if templates is None:
            templates = DIGIT_TEMPLATES if cfg.dataset == "digits" else TEMPLATES
        if isinstance(templates, str) or not templates or not all(map(_one_slot, templates)):
            raise UserError(f"task.templates must be a list of strings with one '{{}}' each (the "
                            f"class name), got {templates!r}")
        self.templates = tuple(templates)
        if spec is not None:
            self.tokenizer_spec = spec["tokenizer"]
            self.info = image_data.DatasetInfo.from_spec(spec)
            self.caption_key = spec["caption_key"]
        else:
            if cfg.tokenizer == "sentencepiece":
                raise UserError("task 'contrastive' does not train a SentencePiece model on "
                                "captions; use tokenizer=byte or a checkpoint's hf:DIR")
            self.tokenizer_spec = data_lib.canonical_spec(cfg.tokenizer)
            self.info, self.caption_key = self._dataset_info()
        self.tokenizer = data_lib.get_tokenizer(self.tokenizer_spec)
        self.names = class_names(self.info) if self.info.num_classes else ()
        self.model_config = self.run_model_config()
        self.image_size = self.model_config.image_size
        if cfg.seq_len > self.model_config.max_len:
            raise UserError(f"seq_len={cfg.seq_len} is longer than the text tower's max_len="
                            f"{self.model_config.max_len}; lower seq_len")
        self._check_template_lengths()
        self._encoders = None

    @classmethod
    def check_data(cls, cfg) -> None:
        """The train and eval splits opened and their first image decoded, no empty cell in
        the image, label or caption columns, the eval split's string labels among the train
        split's (:func:`~transformer_jax.data.images.check_image_split`)."""
        key = cls.task_options(cfg)["caption_key"]
        if not isinstance(cfg.dataset, str):
            return   # refused when the task is built
        train = image_data.check_image_split(cfg.dataset, "train")
        labelled = train is not None and train.label_key is not None and not key
        captions = () if train is None or labelled else (key,) if key else CAPTION_KEYS
        names = train.label_names() if labelled else ()
        for split in dict.fromkeys(("train", cfg.eval_split)):
            image_data.check_image_split(cfg.dataset, split, label_names=names,
                                         caption_keys=captions)

    def _check_template_lengths(self) -> None:
        """Every template caption must fit: a cut one could read like another class's."""
        if not self.names:
            return
        texts = [t.format(n) for t in self.templates for n in self.names]
        lengths = encode_captions(self.tokenizer, texts, 10_000)["attention_mask"].sum(axis=1)
        longest, need = texts[int(np.argmax(lengths))], int(lengths.max())
        if need > self.cfg.seq_len:
            raise UserError(f"the caption {longest!r} takes {need} tokens with its end of text, "
                            f"more than seq_len={self.cfg.seq_len}; raise seq_len (and "
                            "model.max_len) or shorten task.templates")

    def _dataset_info(self) -> tuple[image_data.DatasetInfo, str | None]:
        """The image facts, and the caption feature (None: captions from the labels)."""
        cfg, key = self.cfg, self.options["caption_key"]
        if cfg.dataset == "digits":
            if key is not None:
                raise UserError("the digits have no captions; drop task.caption_key (captions "
                                "come from task.templates and the class names)")
            return image_data.dataset_info("digits"), None
        if is_hf_dataset(cfg.dataset):
            return self._hf_dataset_info(key)
        import tensorflow_datasets as tfds

        from ..data.sources import check_tfds_dataset, default_data_dir
        check_tfds_dataset(cfg.dataset, cfg.data_dir)
        try:
            features = tfds.builder(cfg.dataset, data_dir=cfg.data_dir or
                                    default_data_dir()).info.features
        except tfds.core.registered.DatasetNotFoundError as e:
            raise UserError(f"unknown dataset {cfg.dataset!r}: use 'digits' or a TFDS image "
                            "dataset") from e
        if "image" not in features:
            raise UserError(f"dataset {cfg.dataset!r} has no 'image' feature (it has "
                            f"{sorted(features)})")
        if key is None and "label" in features:
            return image_data.dataset_info(cfg.dataset, data_dir=cfg.data_dir), None
        flat = set(features.keys())
        for name, feature in features.items():
            if hasattr(feature, "feature") and hasattr(feature.feature, "keys"):
                flat |= {f"{name}/{k}" for k in feature.feature.keys()}
        key = key or next((k for k in CAPTION_KEYS if k in flat), None)
        if key is None or key not in flat:
            raise UserError(f"dataset {cfg.dataset!r} has neither labels nor a caption feature "
                            f"({sorted(flat)}); set task.caption_key")
        channels = features["image"].shape[-1] or 3
        return image_data.DatasetInfo(base_name(cfg.dataset), 0, int(channels), 255.0, (), True), key

    def _hf_dataset_info(self, key: str | None) -> tuple[image_data.DatasetInfo, str | None]:
        """An ``hf:`` set: labelled (captions from the templates) unless ``caption_key`` is
        set or it has no ClassLabel column; then the caption column (``CAPTION_KEYS``)."""
        info = image_data.dataset_info(self.cfg.dataset)
        if key is None and info.num_classes:
            return info, None
        columns = set(image_data.HFImageSource(
            open_hf_source(self.cfg.dataset, "train")).source.features)
        key = key or next((k for k in CAPTION_KEYS if k in columns), None)
        if key is None or key.split("/")[0] not in columns:
            raise UserError(f"dataset {self.cfg.dataset!r} has neither a label nor a caption "
                            f"column ({sorted(columns)}); set task.caption_key")
        return dataclasses.replace(info, num_classes=0, label_names=()), key

    def spec(self) -> dict:
        return _spec(self.tokenizer_spec, self.info, self.caption_key)

    @classmethod
    def planned_spec(cls, cfg) -> dict | None:
        """The channels of the model config (``model.num_channels``, else the preset's),
        not the dataset's metadata, and no classes (the zero-shot labels need the data).
        None for the digits (their facts need no data) and for a config the task refuses."""
        if (cfg.model != "clip" or not isinstance(cfg.dataset, str)
                or cfg.dataset in ("digits", "python_stdlib") or cfg.tokenizer == "sentencepiece"):
            return None
        model_cfg, _ = build_model(cfg.model, cfg.model_preset, cfg.model_overrides)
        info = image_data.configured_info(cfg.dataset, 0, model_cfg.num_channels)
        return _spec(data_lib.canonical_spec(cfg.tokenizer), info,
                     cfg.task_options.get("caption_key"))

    def model_overrides(self) -> dict:
        tok = self.tokenizer
        out = {"vocab_size": tok.vocab_size, "eos_token_id": tok.eos_id,
               "pad_token_id": tok.pad_id if tok.pad_id is not None else tok.eos_id,
               "num_channels": self.info.num_channels}
        if self.options["image_size"] is not None:
            out["image_size"] = int(self.options["image_size"])
        return out

    def batch_dims(self) -> dict[str, int]:
        return {"H": self.image_size, "W": self.image_size, "C": self.info.num_channels,
                "T": self.cfg.seq_len}

    def init_args(self):
        s, c = self.image_size, self.info.num_channels
        return (jnp.zeros((1, self.cfg.seq_len), jnp.int32), jnp.zeros((1, s, s, c), jnp.float32))

    # -- data ----------------------------------------------------------------------
    def caption(self, example: Mapping[str, Any], index: int, epoch: int, train: bool) -> str:
        """The caption of one example: a template with its class name, or one of its
        captions; drawn by (seed, epoch, index) in training, fixed in eval."""
        if self.caption_key is None:
            name = self.names[int(example["label"])]
            pick = (_draw(self.cfg.seed, epoch, index, len(self.templates)) if train
                    else index % len(self.templates))
            return self.templates[pick].format(name)
        texts = _as_texts(_caption_field(example, self.caption_key))
        return texts[_draw(self.cfg.seed, epoch, index, len(texts)) if train else 0]

    def make_iterator(self, split, process_index, process_count, *, train: bool):
        cfg, opt = self.cfg, self.options

        def annotate(example, index, epoch):
            enc = encode_captions(self.tokenizer, [self.caption(example, index, epoch, train)],
                                  cfg.seq_len)
            return {k: v[0] for k, v in enc.items()}

        return image_data.make_image_iterator(
            cfg.dataset, split, image_size=self.image_size, batch_size=cfg.batch_size,
            seed=cfg.seed, shuffle=train, repeat=train, augment=bool(opt["augment"]) and train,
            flip=opt["flip"], data_dir=cfg.data_dir, process_index=process_index,
            process_count=process_count, test_fraction=opt["test_fraction"],
            split_seed=opt["split_seed"], info=self.info,
            workers=cfg.data_workers, annotate=annotate)

    # -- accounting ----------------------------------------------------------------
    def tokens_per_step(self) -> int:
        """Image tokens (patches + 1) and caption tokens of one global batch."""
        return self.cfg.batch_size * (self.model_config.vision_config.seq_len + self.cfg.seq_len)

    def flops_per_step(self, model_cfg, adapted: tuple[int, int] | None = None) -> float:
        """``batch_size`` pairs (``Task.flops_per_step``; an adapter counts every image
        and caption token)."""
        frozen = adapted is not None
        return (self.cfg.batch_size * model_cfg.flops_per_example(self.cfg.seq_len,
                                                                  frozen_base=frozen)
                + self.adapter_flops(adapted))

    # -- evaluation ----------------------------------------------------------------
    def _jitted(self, model):
        if self._encoders is None or self._encoders[0] is not model:
            image = jax.jit(lambda p, x: model.apply({"params": p}, x, method="encode_image"))
            text = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m,
                                                       method="encode_text"))
            self._encoders = (model, image, text)
        return self._encoders[1:]

    def embed_eval_split(self, model, params, limit: int | None = None):
        """Unit embeddings of the held-out pairs: ``(images (n, E), captions (n, E), labels (n,))``
        over the first ``limit`` (default the ``eval_images`` option) examples."""
        limit = int(self.options["eval_images"]) if limit is None else limit
        encode_image, encode_text = self._jitted(model)
        imgs, txts, labels, seen = [], [], [], 0
        for batch in self.make_iterator(self.cfg.eval_split, 0, 1, train=False):
            keep = batch["weights"] > 0
            imgs.append(np.asarray(l2_normalize(encode_image(params, batch["images"])))[keep])
            txts.append(np.asarray(l2_normalize(encode_text(params, batch["input_ids"],
                                                     batch["attention_mask"])))[keep])
            labels.append(batch["labels"][keep])
            seen += int(keep.sum())
            if seen >= limit:
                break
        return (np.concatenate(imgs)[:limit], np.concatenate(txts)[:limit],
                np.concatenate(labels)[:limit])

    def zero_shot_classifier(self, model, params) -> np.ndarray:
        """(K, E) class embeddings from the templates alone (prompt ensembling)."""
        if not self.names:
            raise UserError(f"dataset {self.info.name!r} has no classes to name: zero-shot "
                            "classification needs a labelled dataset")
        _, encode_text = self._jitted(model)
        return class_embeddings(lambda i, m: encode_text(params, i, m), self.tokenizer,
                                self.names, self.templates, self.cfg.seq_len)

    def extra_eval(self, model, params) -> dict[str, float]:
        images, texts, labels = self.embed_eval_split(model, params)
        sim = images @ texts.T
        out = {"i2t_recall_at_1": recall_at_1(sim, labels),
               "t2i_recall_at_1": recall_at_1(sim.T, labels)}
        if self.names:
            pred = np.argmax(images @ self.zero_shot_classifier(model, params).T, axis=1)
            out["zero_shot_accuracy"] = float(np.mean(pred == labels))
        return out

    def sample(self, model, params, step):
        """Zero-shot predictions for the first held-out images."""
        if not self.names:
            return None
        images, _, labels = self.embed_eval_split(model, params, limit=12)
        pred = np.argmax(images @ self.zero_shot_classifier(model, params).T, axis=1)
        parts = [f"{self.names[p]}/{self.names[y]}" + ("" if p == y else "*")
                 for p, y in zip(pred, labels)]
        return "zero-shot prediction/label (* = wrong): " + " ".join(parts)

