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
from pathlib import Path
from typing import Any, ClassVar, Iterable

from .. import storage
from ..errors import UserError
from ..losses import LossFn


class Task(abc.ABC):
    """Base class; subclasses set ``name``, ``OPTIONS`` and implement the data methods."""
    name: ClassVar[str] = ""
    OPTIONS: ClassVar[dict[str, Any]] = {}   # option name -> default

    def __init__(self, cfg, workdir: str | Path, *, spec: dict | None = None):
        self.cfg = cfg
        self.workdir = storage.path(workdir)   # local or gs://: files go through the storage layer
        unknown = sorted(set(cfg.task_options) - set(self.OPTIONS))
        if unknown:
            hints = {u: difflib.get_close_matches(u, self.OPTIONS, n=1) for u in unknown}
            raise UserError(
                f"unknown option(s) for task {self.name!r}: "
                + ", ".join(f"{u!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for u, h in hints.items())
                + f"; valid options: {sorted(self.OPTIONS) or 'none'}")
        self.options = {**self.OPTIONS, **cfg.task_options}
        self.saved_spec = spec

    # -- required -----------------------------------------------------------------
    loss_fn: LossFn

    @abc.abstractmethod
    def spec(self) -> dict:
        """JSON: what rebuilds this task's preprocessing later (tokenizer spec, labels...)."""

    def model_overrides(self) -> dict[str, Any]:
        """Model config fields the data fixes (e.g. ``vocab_size``, ``num_classes``)."""
        return {}

    @abc.abstractmethod
    def make_iterator(self, split: str, process_index: int, process_count: int, *, train: bool):
        """This process's batches of ``split``: with ``train``, an endless shuffled iterator
        with ``get_state()`` / ``set_state()``; otherwise one finite pass."""

    def train_iterator(self, process_index: int, process_count: int):
        """Endless iterator of numpy batches with ``get_state()`` / ``set_state()``."""
        return self.make_iterator("train", process_index, process_count, train=True)

    def eval_batches(self, process_index: int, process_count: int) -> Iterable[dict]:
        """A finite iterable of eval batches (at most ``cfg.eval_batches`` are used)."""
        return self.make_iterator(self.cfg.eval_split, process_index, process_count, train=False)

    @abc.abstractmethod
    def init_args(self) -> tuple:
        """Positional arguments for ``model.init(rng, *args)``."""

    # -- optional -----------------------------------------------------------------
    def init_params(self, params):
        """Adjust freshly initialised params (e.g. load a pretrained encoder); default: unchanged."""
        return params

    def tokens_per_step(self) -> int:
        """Tokens (or patches) one global batch holds, for tokens/s."""
        return self.cfg.batch_size * self.cfg.seq_len

    def flops_per_step(self, model_cfg) -> float:
        """Model FLOPs of one training step (6N + attention, PaLM convention), for MFU."""
        return model_cfg.flops_per_token(self.cfg.seq_len) * self.tokens_per_step()

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


def make_task(cfg, workdir: str | Path, *, spec: dict | None = None) -> Task:
    if cfg.task not in TASKS:
        hint = difflib.get_close_matches(cfg.task, TASKS, n=1)
        raise UserError(f"unknown task {cfg.task!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                        + f"; choose one of {sorted(TASKS)}")
    return TASKS[cfg.task](cfg, workdir, spec=spec)
