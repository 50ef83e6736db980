"""Image classification (ViT): labelled images -> class logits, scored by accuracy.

Data (``ExperimentConfig.dataset``): ``"digits"`` (scikit-learn's 8x8 digits, offline;
splits ``train``/``test``), a TFDS image dataset by name (``"cifar10"``,
``"imagenet2012"``: ``image`` and ``label`` features) or an ``hf:`` dataset with an image
and a ``ClassLabel`` column (``"hf:uoft-cs/cifar10"``, local parquet files); see
:mod:`transformer_jax.data.images` for preprocessing, batching and resume. Batches:
``{"images": float32 (B, S, S, C), "labels": int32 (B,), "weights": float32 (B,)}``.

The data fixes the model's ``num_classes`` and ``num_channels``; the images are resized
and cropped to the model's ``image_size`` (the preset's, ``model.image_size=...``, or the
task option ``image_size``, which also sets the model's). Loss: cross-entropy with the
run's ``label_smoothing``, through the shared ``token_loss`` (one "token" per image), so
the train and eval metrics include ``accuracy`` (``eval_accuracy``: top-1 on the eval
split).

Options (``--set task.NAME=value``):
  image_size     the side S images are resized/cropped to (default: the model's)
  augment        random crops (pad S//8) and, where ``flip``, mirroring in training
  flip           mirror as augmentation (default: False for digits, True for TFDS photos)
  test_fraction  digits only: the share held out as ``test`` (default 0.2)
  split_seed     digits only: the seed of that fixed train/test partition (default 0)
  num_samples    predictions vs labels printed at each eval (default 8; 0 = none)
  pretrained     start from a HF ViT ``save_pretrained`` directory or a transformer_jax
                 workdir: the position table is resized to S, the head re-initialised
                 when the class counts differ
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from .. import storage
from ..data import images as image_data
from ..errors import UserError
from ..losses import token_loss
from ..models import FAMILIES, build_model, model_from_config
from ..models.vit import adapt_pretrained
from ..train.checkpoint import load_params
from .base import Task, register_task


def image_classification_loss(apply_fn, params, batch, rngs, deterministic: bool,
                              smoothing: float):
    """``batch = {"images": (B, H, W, C), "labels": (B,) int, "weights": (B,)}`` -> (loss_sum, sums)."""
    logits = apply_fn({"params": params}, batch["images"], deterministic=deterministic, rngs=rngs)
    return token_loss(logits, batch["labels"], batch.get("weights"), smoothing)


@register_task
class ImageClassificationTask(Task):
    """ViT image classification; options in the module docstring."""
    name = "image_classification"
    MODELS = ("vit",)
    OPTIONS = {"image_size": None, "augment": False, "flip": None, "test_fraction": 0.2,
               "split_seed": 0, "num_samples": 8, "pretrained": None}
    loss_fn = staticmethod(image_classification_loss)
    ID_FIELDS = {"labels": "num_classes"}
    BATCH = {"images": ("float32", ("H", "W", "C")), "labels": ("int32", ()),
             "weights": ("float32", ())}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        if spec is not None:
            self.info = image_data.DatasetInfo.from_spec(spec)
        else:
            if cfg.dataset == "python_stdlib":
                raise UserError("task 'image_classification' needs an image dataset; set "
                                "dataset=digits (offline), cifar10 or imagenet2012")
            self.info = image_data.dataset_info(cfg.dataset, data_dir=cfg.data_dir)
            if not self.info.num_classes:
                raise UserError(f"dataset {cfg.dataset!r} has no label column to classify by "
                                "(image-caption pairs?); train task=contrastive on it, or use a "
                                "dataset with a ClassLabel column")
        self.model_config = self._model_config()
        self.image_size = self.model_config.image_size
        self._predict = None

    @classmethod
    def check_data(cls, cfg) -> None:
        """The train and eval splits opened and their first image decoded, no empty cell,
        the eval split's string labels among the train split's
        (:func:`~transformer_jax.data.images.check_image_split`)."""
        cls.task_options(cfg)
        train = image_data.check_image_split(cfg.dataset, "train")
        names = () if train is None else train.label_names()
        if cfg.eval_split != "train":
            image_data.check_image_split(cfg.dataset, cfg.eval_split, label_names=names)

    # -- model ---------------------------------------------------------------------
    def _model_config(self):
        cfg = self.cfg
        if cfg.model not in FAMILIES:
            raise UserError(f"unknown model family {cfg.model!r}; choose one of {sorted(FAMILIES)}")
        if not hasattr(FAMILIES[cfg.model][0], "patch_size"):
            raise UserError(f"task 'image_classification' needs an image model (model='vit'), "
                            f"got model={cfg.model!r}")
        size = self.options["image_size"]
        given = cfg.model_overrides.get("image_size")
        if size is not None and given is not None and size != given:
            raise UserError(f"task.image_size={size} and model.image_size={given} disagree; set one")
        for field, need in (("num_classes", self.info.num_classes),
                            ("num_channels", self.info.num_channels)):
            have = cfg.model_overrides.get(field)
            if have is not None and have != need:
                raise UserError(f"model.{field}={have} but dataset {cfg.dataset!r} has {need}; "
                                f"drop model.{field} (the task sets it)")
        model_cfg, _ = build_model(cfg.model, cfg.model_preset,
                                   {**self.model_overrides(), **cfg.model_overrides})
        return model_cfg

    def model_overrides(self) -> dict:
        out = {"num_classes": self.info.num_classes, "num_channels": self.info.num_channels}
        if self.options["image_size"] is not None:
            out["image_size"] = int(self.options["image_size"])
        return out

    def spec(self) -> dict:
        return {**self.info.to_spec(), "image_size": self.image_size}

    @classmethod
    def planned_spec(cls, cfg) -> dict | None:
        """The classes and channels of the model config (``model.num_classes`` and
        ``model.num_channels``, else the preset's: ViT-B/16's 1000 and 3 are ImageNet's),
        not the dataset's metadata. None for the digits (their facts need no data) and for
        a config the task refuses anyway."""
        family = FAMILIES.get(cfg.model)
        if (not isinstance(cfg.dataset, str) or cfg.dataset in ("digits", "python_stdlib")
                or family is None or not hasattr(family[0], "patch_size")):
            return None
        model_cfg, _ = build_model(cfg.model, cfg.model_preset, cfg.model_overrides)
        if not model_cfg.num_classes:
            raise UserError("task 'image_classification' needs classes: model.num_classes=0 "
                            "builds a ViT without a head; drop it (the dataset sets it)")
        return image_data.configured_info(cfg.dataset, model_cfg.num_classes,
                                          model_cfg.num_channels).to_spec()

    def batch_dims(self) -> dict[str, int]:
        return {"H": self.image_size, "W": self.image_size, "C": self.info.num_channels}

    def init_args(self):
        s, c = self.image_size, self.info.num_channels
        return (jnp.zeros((1, s, s, c), jnp.float32),)

    # -- data ----------------------------------------------------------------------
    def make_iterator(self, split, process_index, process_count, *, train: bool):
        cfg, opt = self.cfg, self.options
        return image_data.make_image_iterator(
            cfg.dataset, split, image_size=self.image_size, batch_size=cfg.batch_size,
            seed=cfg.seed, shuffle=train, repeat=train, augment=bool(opt["augment"]) and train,
            flip=opt["flip"], data_dir=cfg.data_dir, process_index=process_index,
            process_count=process_count, test_fraction=opt["test_fraction"],
            split_seed=opt["split_seed"], info=self.info,
            workers=cfg.data_workers)

    # -- accounting ----------------------------------------------------------------
    def tokens_per_step(self) -> int:
        """Tokens of one global batch: (patches + 1) per image."""
        return self.cfg.batch_size * self.model_config.seq_len

    def flops_per_step(self, model_cfg, adapted: tuple[int, int] | None = None) -> float:
        """``batch_size`` x the model's training FLOPs per image (``Task.flops_per_step``;
        the head runs once per image)."""
        frozen = adapted is not None
        return (self.cfg.batch_size * model_cfg.flops_per_image(frozen_base=frozen)
                + self.adapter_flops(adapted, head_uses=self.cfg.batch_size))

    # -- pretrained start ------------------------------------------------------------
    def init_params(self, params):
        path = self.options["pretrained"]
        if not path:
            return params
        path = storage.path(path)
        config_json = path / "config.json"
        if config_json.is_file() and "model_type" in json.loads(config_json.read_text()):
            from ..interop.hf import from_hf  # loads every family's converter: only when asked

            module, loaded = from_hf(path, drop_pooler=True)
        elif (path / "checkpoints").is_dir():
            run_config, loaded = load_params(path)
            _, module = model_from_config(run_config["family"], run_config["model"])
        else:
            raise UserError(f"task.pretrained={str(path)!r} is neither a Hugging Face "
                            "save_pretrained directory (config.json with a model_type) nor a "
                            "transformer_jax workdir (with checkpoints/)")
        return adapt_pretrained(params, self.model_config, loaded, module.config)

    # -- samples -------------------------------------------------------------------
    def sample(self, model, params, step):
        n = int(self.options["num_samples"])
        if n <= 0:
            return None
        batch = next(iter(self.eval_batches(0, 1)))
        if self._predict is None:
            self._predict = jax.jit(lambda p, x: jnp.argmax(model.apply({"params": p}, x), -1))
        preds = np.asarray(self._predict(params, batch["images"]))
        names = self.info.label_names
        rows = [i for i in range(len(preds)) if batch["weights"][i] > 0][:n]
        parts = [f"{names[preds[i]]}/{names[batch['labels'][i]]}"
                 + ("" if preds[i] == batch["labels"][i] else "*") for i in rows]
        return "prediction/label (* = wrong): " + " ".join(parts)
