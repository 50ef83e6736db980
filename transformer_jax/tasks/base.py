"""What a training run needs from a task, and the registry the CLI uses.

A task turns an :class:`~transformer_jax.train.config.ExperimentConfig` into data and a
loss: it builds its tokenizer (or label set), the training iterator (with a savable
position), the eval batches, the arguments for ``model.init``, and the loss function the
train step differentiates. Optional hooks add task metrics (accuracy from decoding, BLEU)
and samples shown at eval time. ``ExperimentConfig.task`` picks the task by name and
``ExperimentConfig.task_options`` holds its options (unknown options are an error).
"""
from __future__ import annotations

import abc
import difflib
import reprlib
from pathlib import Path
from typing import Any, ClassVar, Iterable

from .. import storage
from ..data.background import Background
from ..data.sources import check_split
from ..errors import UserError
from ..losses import LossFn
from ..models import FAMILIES
from ..models.base import check_id_range

#: what to do when the data's ids do not fit the model, by the config field they index
DATA_ADVICE = {
    "vocab_size": "the tokenizer{tokenizer} yields ids the model does not have: the tokenizer and "
                  "the model's vocab_size disagree (the model must be built for this tokenizer: "
                  "drop a model.vocab_size override that is too small, or fix a tokenizer whose "
                  "vocab_size undercounts its ids)",
    "type_vocab_size": "the data's token type ids and the model's type_vocab_size disagree",
    "num_classes": "the dataset's labels and the model's num_classes disagree (drop a "
                   "model.num_classes override, or relabel the data)",
}


class CheckedBatches:
    """The batches of ``batches`` (an iterator, e.g. with ``get_state``/``set_state``,
    which pass through), each checked on the host before it is handed out: the arrays
    under ``limits``' keys must hold ids inside the model's tables (``Task.ID_FIELDS``)."""

    def __init__(self, batches: Iterable[dict], limits: dict[str, tuple[Any, str, str]],
                 describe: str):
        self.batches, self.limits, self.describe = batches, limits, describe
        self._it = iter(batches)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self._it)
        for key, (config, field, advice) in self.limits.items():
            if key in batch:
                try:      # a min and a max per array when all is well
                    check_id_range(key, batch[key], config, field, advice=advice)
                except UserError as e:
                    raise UserError(f"{self.describe}: {e}") from None
        return batch

    def __getattr__(self, name: str):
        if name in ("batches", "limits", "describe", "_it"):
            raise AttributeError(name)
        return getattr(self.batches, name)


class Task(abc.ABC):
    """Base class; subclasses set ``name``, ``OPTIONS`` and implement the data methods."""
    name: ClassVar[str] = ""
    #: the model families (``ExperimentConfig.model``) that train this task
    MODELS: ClassVar[tuple[str, ...]] = ()
    OPTIONS: ClassVar[dict[str, Any]] = {}   # option name -> default
    #: batch keys that hold ids -> the model config field that sizes their table
    #: ("vocab_size", "type_vocab_size", "num_classes"). ``train_iterator`` and
    #: ``eval_batches`` check every batch against the model the run builds (on the host,
    #: before the batch reaches a device): an id outside is a UserError naming the
    #: dataset, split, batch key, position, id and table size.
    ID_FIELDS: ClassVar[dict[str, str]] = {}
    #: eval metrics that are a token-level cross-entropy (nats per token of a language
    #: model: next token, masked token, target token) -> the name of their perplexity; the
    #: eval reports ``eval_<name> = exp(eval_<metric>)``. Empty (no perplexity) where the
    #: loss is no such cross-entropy: classes, image-caption pairs, a sum of two losses.
    PERPLEXITY: ClassVar[dict[str, str]] = {}
    #: train batches made this many ahead on a background thread, overlapping the step
    #: (0: made when asked for, on the caller's thread)
    BACKGROUND_DEPTH: ClassVar[int] = 2

    #: the options naming fields every example must hold, as text (``text_key``) and as a
    #: class (``label_key``): what :meth:`check_split` checks by default
    TEXT_FIELDS: ClassVar[tuple[str, ...]] = ()
    LABEL_FIELDS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg, workdir: str | Path, *, spec: dict | None = None):
        self.cfg = cfg
        self.workdir = storage.path(workdir)   # local or gs://: files go through the storage layer
        self.options = self.task_options(cfg)
        self.saved_spec = spec

    @classmethod
    def task_options(cls, cfg) -> dict[str, Any]:
        """The options: ``OPTIONS``' defaults, then ``cfg.task_options`` (an unknown one is
        refused)."""
        unknown = sorted(set(cfg.task_options) - set(cls.OPTIONS))
        if unknown:
            hints = {u: difflib.get_close_matches(u, cls.OPTIONS, n=1) for u in unknown}
            raise UserError(
                f"unknown option(s) for task {cls.name!r}: "
                + ", ".join(f"{u!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for u, h in hints.items())
                + f"; valid options: {sorted(cls.OPTIONS) or 'none'}")
        return {**cls.OPTIONS, **cfg.task_options}

    # -- the data, checked before a run starts -----------------------------------------
    @classmethod
    def check_data(cls, cfg) -> None:
        """Refuses data a run of ``cfg`` could not read, before the run writes anything: every
        split it reads (``train`` and ``eval_split``) is opened, holds a row, and holds the
        fields the task reads (:meth:`check_split`). A classmethod: it runs before the task
        is built, which may train a tokenizer into the workdir."""
        options = cls.task_options(cfg)
        for split in dict.fromkeys(("train", cfg.eval_split)):
            cls.check_split(cfg, options, split)

    @classmethod
    def check_split(cls, cfg, options: dict[str, Any], split: str) -> None:
        """One split of ``cfg.dataset``, opened and its rows checked for the fields the
        options in ``TEXT_FIELDS`` and ``LABEL_FIELDS`` name
        (:func:`~transformer_jax.data.sources.check_split`); nothing to check without
        them. A task whose data is read otherwise (TFDS builders, images) overrides it."""
        if not (cls.TEXT_FIELDS or cls.LABEL_FIELDS):
            return
        named = lambda keys: {options[k]: f"task.{k}" for k in keys  # noqa: E731
                              if isinstance(options[k], str)}   # else refused by the task
        check_split(cfg.dataset, split, texts=named(cls.TEXT_FIELDS),
                    labels=named(cls.LABEL_FIELDS), data_dir=cfg.data_dir)

    # -- required -----------------------------------------------------------------
    loss_fn: LossFn

    @abc.abstractmethod
    def spec(self) -> dict:
        """JSON: what rebuilds this task's preprocessing later (tokenizer spec, labels...)."""

    def model_overrides(self) -> dict[str, Any]:
        """Model config fields the data fixes (e.g. ``vocab_size``, ``num_classes``)."""
        return {}

    @classmethod
    def planned_spec(cls, cfg) -> dict | None:
        """The spec that builds this task from ``cfg`` alone, opening no dataset (what
        ``transformer-jax compile`` plans a slice with, on any host), where building it
        normally would read the data's metadata; None: the task reads none to be built."""
        return None

    def generation_ids(self) -> dict[str, Any]:
        """The special ids a model of this task generates with, which ``export`` writes into
        ``config.json`` and ``generation_config.json`` (``bos_token_id``, ``eos_token_id``,
        ``pad_token_id``, ``decoder_start_token_id``); empty for a task that generates
        nothing (its model config holds what ids it has)."""
        return {}

    @abc.abstractmethod
    def make_iterator(self, split: str, process_index: int, process_count: int, *, train: bool):
        """This process's batches of ``split``: with ``train``, an endless shuffled iterator
        with ``get_state()`` / ``set_state()``; otherwise one finite pass."""

    def train_iterator(self, process_index: int, process_count: int):
        """Endless iterator of numpy batches with ``get_state()`` / ``set_state()``, their
        ids checked (``ID_FIELDS``), made ``BACKGROUND_DEPTH`` batches ahead on a background
        thread (:class:`~transformer_jax.data.background.Background`)."""
        batches = self.checked_batches(
            self.make_iterator("train", process_index, process_count, train=True), "train")
        return Background(batches, self.BACKGROUND_DEPTH) if self.BACKGROUND_DEPTH else batches

    def eval_batches(self, process_index: int, process_count: int) -> Iterable[dict]:
        """A finite iterable of eval batches (at most ``cfg.eval_batches`` are used), their
        ids checked (``ID_FIELDS``)."""
        split = self.cfg.eval_split
        return self.checked_batches(
            self.make_iterator(split, process_index, process_count, train=False), split)

    # -- id checks ------------------------------------------------------------------
    def run_model_config(self):
        """The model config the run builds from this config (preset, then the task's
        ``model_overrides``, then the experiment's, which win), or None for an unknown family."""
        family = FAMILIES.get(self.cfg.model)
        if family is None:
            return None
        overrides = {**self.model_overrides(), **self.cfg.model_overrides}
        return family[0].preset(self.cfg.model_preset, **overrides)

    def id_advice(self, field: str) -> str:
        """What to do when the data's ids do not fit ``field`` (``DATA_ADVICE``)."""
        spec = getattr(self, "tokenizer_spec", None)
        tokenizer = f" ({spec!r})" if isinstance(spec, str) else ""
        return DATA_ADVICE.get(field, "the data and the model disagree").format(tokenizer=tokenizer)

    def checked_batches(self, batches: Iterable[dict], split: str):
        """``batches`` with every batch's ``ID_FIELDS`` checked against the run's model.
        Unchecked when this config builds no model (a run stops earlier, in the loop's
        ``build``, with that error; a task on its own still gives its batches)."""
        try:
            config = self.run_model_config() if self.ID_FIELDS else None
        except UserError:
            config = None
        limits = {key: (config, field, self.id_advice(field))
                  for key, field in self.ID_FIELDS.items()
                  if getattr(config, field, None) is not None}
        if not limits:
            return batches
        dataset = self.cfg.dataset
        shown = repr(dataset) if isinstance(dataset, str) else reprlib.repr(dataset)
        describe = f"task {self.name!r}, dataset {shown}, split {split!r}"
        return CheckedBatches(batches, limits, describe)

    def check_prompt_ids(self, ids, model_config) -> None:
        """The token ids of a prompt (B, T) against ``model_config.vocab_size``, on the host
        before anything runs; the error names the tokenizer. Unchecked for a config
        without ``vocab_size``."""
        if getattr(model_config, "vocab_size", None) is not None:
            check_id_range("prompt", ids, model_config, advice=self.id_advice("vocab_size"))

    @abc.abstractmethod
    def init_args(self) -> tuple:
        """Positional arguments for ``model.init(rng, *args)``."""

    #: batch key -> (dtype, trailing dims: "T" seq_len, "S"/"T" of a seq2seq task, ...),
    #: as every batch of the task holds them; read by :meth:`batch_shapes`
    BATCH: ClassVar[dict[str, tuple[str, tuple[str, ...]]]] = {}

    def batch_dims(self) -> dict[str, int]:
        """The sizes the names in ``BATCH`` stand for (default: T = ``seq_len``)."""
        return {"T": self.cfg.seq_len}

    def batch_shapes(self, batch_size: int | None = None) -> dict[str, Any]:
        """``jax.ShapeDtypeStruct`` of each array of a global batch (``batch_size`` rows,
        default the config's), from the config alone: what ahead-of-time compilation
        (``transformer-jax compile``) traces the train step with, no data read."""
        import jax
        import numpy as np

        b = self.cfg.batch_size if batch_size is None else batch_size
        dims = self.batch_dims()
        return {key: jax.ShapeDtypeStruct((b, *(dims[d] for d in trailing)), np.dtype(dtype))
                for key, (dtype, trailing) in self.BATCH.items()}

    # -- optional -----------------------------------------------------------------
    def init_params(self, params):
        """Adjust freshly initialised params (e.g. load a pretrained encoder); default: unchanged."""
        return params

    def tokens_per_step(self) -> int:
        """Tokens (or patches) one global batch holds, for tokens/s."""
        return self.cfg.batch_size * self.cfg.seq_len

    def flops_per_step(self, model_cfg, adapted: tuple[int, int] | None = None) -> float:
        """Model FLOPs of one training step, for MFU: 6 N + attention per token (PaLM
        convention). ``adapted``: (head, adapters), the parameters that train over a frozen
        base (``finetune.trainable_counts``; None: every parameter trains): then the base's
        N weights cost 4 each per token (forward and input gradient, no weight gradient),
        the head's (a part of N) and the adapters' 6 (:meth:`adapter_flops`)."""
        flops = model_cfg.flops_per_token(self.cfg.seq_len, frozen_base=adapted is not None)
        return flops * self.tokens_per_step() + self.adapter_flops(adapted)

    def adapter_flops(self, adapted: tuple[int, int] | None, head_uses: int | None = None) -> float:
        """What the trained parameters over a frozen base add to its 4 per weight use:
        2 more per use of a head weight (``head_uses`` a step; default: every token, as
        N counts it per token) and 6 per use of an adapter weight (every token)."""
        if adapted is None:
            return 0.0
        head, adapters = adapted
        tokens = self.tokens_per_step()
        return 2.0 * head * (tokens if head_uses is None else head_uses) + 6.0 * adapters * tokens

    def extra_eval(self, model, params) -> dict[str, float]:
        """Metrics beyond the loss (e.g. exact match or BLEU from decoding)."""
        return {}

    def sample(self, model, params, step: int) -> str | None:
        """Text shown at each eval (a sampled continuation, translations, predictions)."""
        return None

    def generate_text(self, model, params, prompt: str, **kw) -> str:
        raise UserError(f"task {self.name!r} has no text generation; "
                        "`transformer-jax generate` works for language-model and seq2seq runs")


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


def tasks_for(family: str) -> list[str]:
    """The tasks a model family trains (each task's ``MODELS``)."""
    return sorted(name for name, cls in TASKS.items() if family in cls.MODELS)


def task_class(name: str) -> type[Task]:
    """The registered task ``name``; an unknown one is refused, with the nearest name."""
    if name not in TASKS:
        hint = difflib.get_close_matches(name, TASKS, n=1)
        raise UserError(f"unknown task {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f"; choose one of {sorted(TASKS)}")
    return TASKS[name]


def make_task(cfg, workdir: str | Path, *, spec: dict | None = None, plan: bool = False) -> Task:
    """The task of ``cfg``: from a saved ``spec``, or with ``plan`` from the config alone
    (:meth:`Task.planned_spec`: no dataset opened), or from the data."""
    cls = task_class(cfg.task)
    return cls(cfg, workdir, spec=cls.planned_spec(cfg) if plan and spec is None else spec)


def check_data(cfg) -> None:
    """The data of a run of ``cfg``, checked before it starts (:meth:`Task.check_data`)."""
    task_class(cfg.task).check_data(cfg)
