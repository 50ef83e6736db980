"""Experiment configs: one frozen dataclass per run, files in ``experiments/``, CLI overrides.

An experiment file is a Python module defining ``get_config() -> ExperimentConfig``; its
docstring gives the command, the runtime and the metric it reaches. ``--set key=value``
overrides any field; ``--set model.FIELD=value`` overrides a field of the model config.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
from pathlib import Path
from typing import Any, ClassVar

from ..errors import UserError
from ..models.base import PresetConfig
from ..sharding import parse_mesh

Field = dataclasses.field


@dataclasses.dataclass(frozen=True)
class ExperimentConfig(PresetConfig):
    """Everything a training run needs, JSON-serialisable (it is saved in every checkpoint)."""
    name: str = "stdlib_gpt"
    task: str = "lm"                   # see transformer_jax.tasks (lm, ...)
    task_options: dict = Field(default_factory=dict)
    # model: a family, a preset of that family's config, and field overrides
    model: str = "gpt"
    model_preset: str = "tiny"
    model_overrides: dict = Field(default_factory=lambda: dict(
        num_layers=4, d_model=128, num_heads=4, max_len=256, dropout_rate=0.0,
        attention_dropout_rate=0.0))
    # data
    dataset: str = "python_stdlib"
    eval_split: str = "validation"
    tokenizer: str = "byte"            # "byte", "sentencepiece" (trained into the workdir), or "sentencepiece:PATH"
    sentencepiece_vocab_size: int = 8192
    data_dir: str | None = None
    seq_len: int = 128
    batch_size: int = 32               # global batch (all devices, all micro-batches)
    # optimisation
    steps: int = 600
    accum_steps: int = 1
    schedule: str = "warmup_cosine"    # warmup_cosine | warmup_rsqrt | noam | constant
    learning_rate: float = 2e-3        # peak (noam: the scale factor)
    warmup_steps: int = 50
    end_learning_rate: float = 0.0
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.01
    clip_norm: float | None = 1.0
    label_smoothing: float = 0.0
    seed: int = 0
    # dynamic loss scaling: "auto" (on for model.dtype=float16, off otherwise), "dynamic",
    # "none"; the scale starts at loss_scale_init and doubles after that many finite steps
    loss_scale: str = "auto"
    loss_scale_init: float = 2.0 ** 15
    loss_scale_growth_interval: int = 2000
    # devices: "jit" (sharded by the mesh) or "pmap" (replicated, data parallel); the mesh
    # as "data=N,fsdp=N,tensor=N" (omitted axes 1, one may be -1; None: all devices on data).
    # Neither is part of the model: a checkpoint resumes under any parallelism and mesh.
    parallelism: str = "jit"
    mesh: str | None = None
    # bookkeeping
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 16
    save_every: int = 100
    keep: int = 2
    sample_prompt: str = "def "
    sample_tokens: int = 96

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    def __post_init__(self):
        for name in ("steps", "seq_len", "batch_size", "accum_steps", "log_every", "eval_every",
                     "save_every", "loss_scale_growth_interval"):
            if getattr(self, name) < 1:
                raise UserError(f"ExperimentConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.parallelism not in ("jit", "pmap"):
            raise UserError(f"ExperimentConfig.parallelism must be 'jit' or 'pmap', got {self.parallelism!r}")
        parse_mesh(self.mesh)   # syntax only; the device count is checked when the run starts
        if self.batch_size % self.accum_steps:
            raise UserError(f"batch_size={self.batch_size} is not divisible by "
                            f"accum_steps={self.accum_steps}; choose a batch_size that is a multiple of it")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise UserError(f"label_smoothing={self.label_smoothing} must be in [0, 1]")
        if self.loss_scale not in ("auto", "dynamic", "none"):
            raise UserError(f"loss_scale={self.loss_scale!r} is unknown; choose 'auto' (dynamic "
                            "for model.dtype=float16), 'dynamic' or 'none'")
        if not self.loss_scale_init > 0:
            raise UserError(f"loss_scale_init={self.loss_scale_init} must be > 0 (e.g. 2**15)")

    def dynamic_loss_scale(self, compute_dtype: str) -> bool:
        """Whether the run scales its loss: ``loss_scale``, with "auto" on for float16 only."""
        if self.loss_scale == "auto":
            return compute_dtype in ("float16", "fp16", "half")
        return self.loss_scale == "dynamic"

    def schedule_kwargs(self, d_model: int) -> dict[str, Any]:
        """Keyword arguments of ``optim.make_schedule(self.schedule, ...)``."""
        if self.schedule == "warmup_cosine":
            return dict(peak_lr=self.learning_rate, warmup_steps=self.warmup_steps,
                        total_steps=self.steps, end_lr=self.end_learning_rate)
        if self.schedule == "warmup_rsqrt":
            return dict(peak_lr=self.learning_rate, warmup_steps=self.warmup_steps)
        if self.schedule == "noam":
            return dict(d_model=d_model, warmup_steps=self.warmup_steps, scale=self.learning_rate)
        if self.schedule == "constant":
            return dict(lr=self.learning_rate, warmup_steps=self.warmup_steps)
        raise UserError(f"unknown schedule {self.schedule!r}; choose warmup_cosine, "
                        "warmup_rsqrt, noam or constant")


# ----------------------------------------------------------------------------- overrides

def parse_value(text: str) -> Any:
    """``"3"`` -> 3, ``"1e-3"`` -> 0.001, ``"true"`` -> True, ``"none"`` -> None, else the string."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "dict": (dict,)}


def _check_type(name: str, value: Any) -> None:
    """A UserError unless ``value`` fits the annotation of ``ExperimentConfig.name``."""
    annotation = {f.name: f.type for f in dataclasses.fields(ExperimentConfig)}[name]
    parts = [p.strip() for p in str(annotation).split("|")]
    if value is None and "None" in parts:
        return
    allowed = tuple(t for p in parts for t in _TYPES.get(p, ()))
    if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
        raise UserError(f"{name}={value!r} must be of type {annotation} (e.g. --set {name}="
                        f"{getattr(ExperimentConfig, name, None)!r})")


def apply_overrides(cfg: ExperimentConfig, overrides: list[str] | dict[str, Any]) -> ExperimentConfig:
    """Apply ``key=value`` strings (or a dict).

    ``model.FIELD`` goes into ``model_overrides`` and ``task.OPTION`` into ``task_options``;
    ``model_overrides={...}`` / ``task_options={...}`` merge a dict into them.
    """
    if isinstance(overrides, dict):
        items = list(overrides.items())
    else:
        items = []
        for item in overrides:
            if "=" not in item:
                raise UserError(f"override {item!r} is not of the form key=value (e.g. --set steps=100)")
            key, value = item.split("=", 1)
            items.append((key.strip(), parse_value(value)))
    changes: dict[str, Any] = {}
    model_overrides = dict(cfg.model_overrides)
    task_options = dict(cfg.task_options)
    names = {f.name for f in dataclasses.fields(ExperimentConfig)}
    for key, value in items:
        if key.startswith("model."):
            model_overrides[key[len("model."):]] = value
        elif key.startswith("task."):
            task_options[key[len("task."):]] = value
        elif key in ("model_overrides", "task_options"):
            if not isinstance(value, dict):
                raise UserError(f"{key} must be a dict (e.g. {key}={{'num_layers': 2}}), got "
                                f"{value!r}; or set one entry as "
                                f"{'model.FIELD' if key == 'model_overrides' else 'task.OPTION'}=value")
            (model_overrides if key == "model_overrides" else task_options).update(value)
        elif key in names:
            _check_type(key, value)
            changes[key] = value
        else:
            hint = difflib.get_close_matches(key, names, n=1)
            raise UserError(f"unknown config field {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                            + "; model fields are set as model.FIELD=value, task options as task.OPTION=value")
    return cfg.replace(**changes, model_overrides=model_overrides, task_options=task_options)


# ----------------------------------------------------------------------------- experiments

def experiment_dirs() -> list[Path]:
    """Where experiment names are looked up: $TRANSFORMER_JAX_EXPERIMENTS, ./experiments, the repo's."""
    dirs = []
    if os.environ.get("TRANSFORMER_JAX_EXPERIMENTS"):
        dirs.append(Path(os.environ["TRANSFORMER_JAX_EXPERIMENTS"]))
    dirs.append(Path.cwd() / "experiments")
    dirs.append(Path(__file__).resolve().parents[2] / "experiments")
    seen, out = set(), []
    for d in dirs:
        if d.resolve() not in seen:
            seen.add(d.resolve())
            out.append(d)
    return out


def available_experiments() -> list[str]:
    names = set()
    for d in experiment_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.py") if not p.stem.startswith("_"))
    return sorted(names)


def load_experiment(name_or_path: str | None) -> ExperimentConfig:
    """The default config (``None``), an experiment by name, or a path to an experiment file."""
    if name_or_path is None:
        return ExperimentConfig()
    path = Path(name_or_path)
    if path.suffix != ".py":
        path = next((d / f"{name_or_path}.py" for d in experiment_dirs()
                     if (d / f"{name_or_path}.py").is_file()), None)
        if path is None:
            names = available_experiments()
            hint = difflib.get_close_matches(name_or_path, names, n=1)
            raise UserError(f"unknown experiment {name_or_path!r}"
                            + (f" (did you mean {hint[0]!r}?)" if hint else "")
                            + f"; available: {', '.join(names) or 'none found'} "
                            f"(searched {', '.join(str(d) for d in experiment_dirs())})")
    if not path.is_file():
        raise UserError(f"experiment file {path} does not exist; give an experiment name "
                        "(`transformer-jax experiments` lists them) or the path of a .py file")
    spec = importlib.util.spec_from_file_location(f"_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise UserError(f"experiment file {path} defines no get_config(); add one that "
                        "returns an ExperimentConfig")
    cfg = module.get_config()
    if not isinstance(cfg, ExperimentConfig):
        raise UserError(f"{path}: get_config() must return an ExperimentConfig, got {type(cfg).__name__}")
    return cfg
