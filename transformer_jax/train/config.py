"""Experiment configs: one frozen dataclass per run, files in ``experiments/``, CLI overrides.

An experiment file is a Python module defining ``get_config() -> ExperimentConfig``; its
docstring gives the command, the runtime and the metric it reaches. ``--set key=value``
overrides any field; ``--set model.FIELD=value`` overrides a field of the model config,
``--set log.FIELD=value`` one of the logging config (:class:`LogConfig`).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import traceback
from pathlib import Path
from typing import Any, ClassVar

from ..errors import UserError
from ..models import FAMILIES
from ..models.base import PresetConfig, RelationError
from ..sharding import parse_mesh
from .optim import SCHEDULES

Field = dataclasses.field

#: Model fields a task may fix from its data (``Task.model_overrides``: the tokenizer's
#: vocabulary and special ids, the classes, the image size and channels, BERT's head). A
#: model relation that involves one of them, unless ``model.FIELD`` sets it, is checked when
#: the run builds the model after making the task; every other model mistake when the
#: ExperimentConfig is made.
TASK_MODEL_FIELDS = frozenset({"vocab_size", "pad_token_id", "eos_token_id",
                               "decoder_start_token_id", "num_classes", "num_channels",
                               "image_size", "head"})


#: the W&B modes ``LogConfig.wandb_mode`` takes (None: chosen when the run starts)
WANDB_MODES = ("online", "offline")


@dataclasses.dataclass(frozen=True)
class LogConfig(PresetConfig):
    """Where a run logs besides metrics.jsonl and TensorBoard (``--set log.FIELD=value``).

    ``wandb``: also to Weights & Biases (``train/wandb_log.py``; the ``wandb`` extra), in
    the project ``wandb_project``, as ``wandb_run_name`` (None: the workdir's name), in
    ``wandb_mode`` "online" or "offline" (None: ``$WANDB_MODE``, else online where an API
    key is set up and W&B's server answers, offline otherwise). None of it changes what the
    run computes.
    """
    wandb: bool = False
    wandb_project: str = "transformer_jax"
    wandb_run_name: str | None = None
    wandb_mode: str | None = None

    def __post_init__(self):
        self._require_bools("wandb")
        self._require_str("wandb_project")
        self._require_str("wandb_run_name", allow_none=True)
        if self.wandb_mode is not None and self.wandb_mode not in WANDB_MODES:
            raise UserError(f"LogConfig.wandb_mode={self.wandb_mode!r} is unknown; choose "
                            "'online', 'offline' or None (online with an API key, else offline)")


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
    # fine-tuning: start from pretrained weights (an HF save_pretrained directory or a
    # transformer_jax workdir); its model config and tokenizer replace the experiment's
    # (train/finetune.py). LoRA: model.lora (``--set lora.rank=8``), prefix tuning:
    # model.prefix_tokens; then only the adapters (and a fresh task head) train.
    init_from: str | None = None
    # data
    dataset: str = "python_stdlib"
    eval_split: str = "validation"
    # "byte", "sentencepiece" (trained into the workdir), "sentencepiece:PATH", or "hf:DIR"
    # (the tokenizer a Hugging Face model or tokenizer directory was saved with)
    tokenizer: str = "byte"
    sentencepiece_vocab_size: int = 8192
    data_dir: str | None = None
    seq_len: int = 128
    batch_size: int = 32               # global batch (all devices, all micro-batches)
    # image tasks: processes that decode and augment images (None: the host's cores, but 0
    # for in-memory arrays such as digits; 0: in the training process). docs/performance.md
    data_workers: int | None = None
    # optimisation
    steps: int = 600
    accum_steps: int = 1
    # warmup_cosine | warmup_times_cosine | warmup_rsqrt | noam | constant (train/optim.py)
    schedule: str = "warmup_cosine"
    learning_rate: float = 2e-3        # peak (noam: the scale factor)
    warmup_steps: int = 50
    end_learning_rate: float = 0.0
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.01
    clip_norm: float | None = 1.0
    label_smoothing: float = 0.0
    # the training loss reads out loss_chunk positions of every row at a time, (B, loss_chunk,
    # V) float32 logits (losses.chunked_cross_entropy): the (B, T, V) logits and their
    # gradient never exist whole. 0: the plain loss.
    # Tasks with a vocabulary read-out (lm, mlm, seq2seq, pretrain) use it; the others ignore it.
    loss_chunk: int = 0
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
    # a checkpoint is saved only while the loss is healthy: finite, and not above
    # loss_spike_factor x the median of the last loss_spike_window healthy losses (and one
    # nat above it); None: only non-finite losses block saves. See train/health.py.
    loss_spike_factor: float | None = 3.0
    loss_spike_window: int = 100
    sample_prompt: str = "def "
    sample_tokens: int = 96
    # logging beyond metrics.jsonl and TensorBoard (W&B): ``--set log.wandb=true``
    log: LogConfig = Field(default_factory=LogConfig)

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    def __post_init__(self):
        """Every field on its own, then the relations between fields, then the model as far
        as it is known before the task fixes the fields its data decides (:meth:`_check_model`).
        Each mistake is a UserError naming ``ExperimentConfig.FIELD``, the value and what is
        allowed. ``log`` may be given as a dict of :class:`LogConfig` fields (as JSON holds it)."""
        if isinstance(self.log, dict):
            object.__setattr__(self, "log", LogConfig.from_dict(self.log))
        elif not isinstance(self.log, LogConfig):
            raise self._bad("log", "a LogConfig or a dict of its fields")
        self._check_fields()
        self._check_relations()
        self._check_model()

    def _check_fields(self) -> None:
        for name in ("name", "task", "eval_split", "model_preset"):
            self._require_str(name)
        if not (isinstance(self.dataset, (str, list, tuple)) and self.dataset):   # name or documents
            raise self._bad("dataset", "a dataset name (a non-empty string) or a non-empty "
                                       "list/tuple of in-memory documents")
        self._require_str("data_dir", allow_none=True)
        self._require_str("init_from", allow_none=True)
        if not isinstance(self.sample_prompt, str):
            raise self._bad("sample_prompt", "a string")
        for name in ("task_options", "model_overrides"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise self._bad(name, "a dict whose keys are names (str)")
        self._require_choice("model", FAMILIES)
        self._check_tokenizer()
        self._require_number("sentencepiece_vocab_size", integer=True, minimum=300,
                             hint=" (256 byte pieces + specials)")
        self._require_positive("seq_len", "batch_size", "steps", "accum_steps", "log_every",
                               "eval_every", "eval_batches", "save_every", "keep",
                               "loss_scale_growth_interval", "loss_spike_window")
        self._require_choice("schedule", SCHEDULES)
        self._require_number("learning_rate", minimum=0, exclusive_min=True,
                             hint=" (the peak; noam: its scale factor)")
        self._require_number("warmup_steps", integer=True, minimum=0)
        self._require_number("data_workers", integer=True, minimum=0, allow_none=True,
                             hint=" (0: preprocess in the training process; None: the host's cores)")
        self._require_number("end_learning_rate", minimum=0)
        for name in ("b1", "b2"):
            self._require_number(name, minimum=0, maximum=1, exclusive_max=True)
        self._require_number("eps", minimum=0, exclusive_min=True)
        self._require_number("weight_decay", minimum=0)
        self._require_number("clip_norm", minimum=0, exclusive_min=True, allow_none=True,
                             hint=" (None: no clipping)")
        self._require_number("label_smoothing", minimum=0, maximum=1)
        self._require_number("loss_chunk", integer=True, minimum=0,
                             hint=" (positions of each row per chunk of the loss's read-out; "
                                  "0: the plain loss)")
        self._require_number("seed", integer=True, minimum=0, maximum=2 ** 63 - 1)
        if not isinstance(self.loss_scale, str) or self.loss_scale not in ("auto", "dynamic", "none"):
            raise UserError(f"loss_scale={self.loss_scale!r} is unknown; choose 'auto' (dynamic "
                            "for model.dtype=float16), 'dynamic' or 'none'")
        self._require_number("loss_scale_init")             # a finite number, and then > 0:
        if not self.loss_scale_init > 0:
            raise UserError(f"ExperimentConfig.loss_scale_init={self.loss_scale_init!r} must be > 0 "
                            "(e.g. 2**15)")
        self._require_number("loss_spike_factor", minimum=1, allow_none=True,
                             hint=" (None: no spike detection)")
        if not isinstance(self.parallelism, str) or self.parallelism not in ("jit", "pmap"):
            raise UserError(f"ExperimentConfig.parallelism must be 'jit' or 'pmap', got {self.parallelism!r}")
        parse_mesh(self.mesh)   # syntax only; the device count is checked when the run starts
        self._require_number("sample_tokens", integer=True, minimum=0, hint=" (0: no samples)")

    def _check_tokenizer(self) -> None:
        """The forms ``data.get_tokenizer`` reads, and "sentencepiece" (trained into the workdir):
        "hf:DIR" (a Hugging Face model or tokenizer directory) is accepted here by its form; the
        directory and its files are read, and checked, when the task builds the tokenizer."""
        tok = self.tokenizer
        prefix, _, path = tok.partition(":") if isinstance(tok, str) else ("", "", "")
        if not isinstance(tok, str) or not (tok in ("byte", "bytes", "byt5", "sentencepiece")
                                            or (prefix in ("sentencepiece", "spm", "hf") and path)
                                            or tok.endswith(".model")):
            raise UserError(f"ExperimentConfig.tokenizer={tok!r} is unknown; use 'byte', "
                            "'sentencepiece' (trained into the workdir), 'sentencepiece:PATH' or "
                            "the path of a SentencePiece .model file")

    def _check_relations(self) -> None:
        """Batch vs micro-batches; warm-up and end rate vs the schedule.

        Warm-up vs steps: a warm-up longer than the run is fine for "constant",
        "warmup_rsqrt" and "noam" (the run ends on the ramp: a short probe, or a run resumed
        later with more steps). "warmup_cosine" needs warmup_steps < steps, but that is
        left to ``optim.warmup_cosine`` when the run builds its schedule (a UserError before
        config.json or a checkpoint is written): configs are made with the default
        warmup_steps and a small ``steps``, then given their warmup_steps by ``replace``
        (colab/02_train_gpt.ipynb does)."""
        self._require_relation(self.batch_size % self.accum_steps == 0, ("batch_size", "accum_steps"),
                               f"is not divisible by accum_steps={self.accum_steps}; choose a "
                               "batch_size that is a multiple of it")
        if self.schedule in ("noam", "warmup_rsqrt"):
            self._require_relation(self.warmup_steps >= 1, ("warmup_steps", "schedule"),
                                   f"must be >= 1 for schedule={self.schedule!r} (its decay is "
                                   "relative to the end of the warm-up)")
        if self.schedule == "warmup_times_cosine":
            self._require_relation(self.end_learning_rate == 0, ("end_learning_rate", "schedule"),
                                   "must be 0 for schedule='warmup_times_cosine' (its cosine ends "
                                   "at 0); use schedule='warmup_cosine' for another end rate")
        if self.schedule == "warmup_cosine":
            self._require_relation(self.end_learning_rate <= self.learning_rate,
                                   ("end_learning_rate", "learning_rate"),
                                   f"must be <= learning_rate={self.learning_rate!r} (the cosine "
                                   "decays from learning_rate to end_learning_rate)")

    def _check_model(self) -> None:
        """The family's preset, each ``model.FIELD`` value and the model's relations, unless
        a relation involves a field that the task may still fix from its data
        (:data:`TASK_MODEL_FIELDS`) and ``model_overrides`` does not set; and seq_len against
        the model's max_len. Names the family does not have are left to the run (which
        refuses them when it builds the model): tasks are made from such configs."""
        config_cls = FAMILIES[self.model][0]
        names = {f.name for f in dataclasses.fields(config_cls)}
        known = {k: v for k, v in self.model_overrides.items() if k in names}
        try:
            model_cfg = config_cls.preset(self.model_preset, **known)
        except RelationError as e:
            if set(e.fields) & (TASK_MODEL_FIELDS - set(known)):
                return            # checked again when the run builds the model
            raise
        max_len = getattr(model_cfg, "max_len", None)
        self._require_relation(max_len is None or self.seq_len <= max_len, ("seq_len",),
                               f"exceeds the model's max_len={max_len}; lower seq_len or set "
                               f"model.max_len>={self.seq_len}")

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
        if self.schedule == "warmup_times_cosine":
            return dict(peak_lr=self.learning_rate, warmup_steps=self.warmup_steps,
                        total_steps=self.steps)
        if self.schedule == "warmup_rsqrt":
            return dict(peak_lr=self.learning_rate, warmup_steps=self.warmup_steps)
        if self.schedule == "noam":
            return dict(d_model=d_model, warmup_steps=self.warmup_steps, scale=self.learning_rate)
        # "constant": construction refuses a name that optim.SCHEDULES does not have
        return dict(lr=self.learning_rate, warmup_steps=self.warmup_steps)


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

    ``model.FIELD`` goes into ``model_overrides``, ``task.OPTION`` into ``task_options`` and
    ``log.FIELD`` into ``log`` (:class:`LogConfig`); ``model_overrides={...}`` /
    ``task_options={...}`` / ``log={...}`` merge a dict into them; ``lora.FIELD``
    sets one field of the model's LoRA config (``model.lora``, a dict of
    :class:`~transformer_jax.layers.lora.LoraConfig` fields).
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
    log: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(ExperimentConfig)}
    model_keys: list[str] = []          # the model fields named here: refused now if unknown
    for key, value in items:
        if not isinstance(key, str):
            raise UserError(f"override key {key!r} is not a field name (str)")
        if key.startswith("model."):
            model_overrides[key[len("model."):]] = value
            model_keys.append(key[len("model."):])
        elif key.startswith("task."):
            task_options[key[len("task."):]] = value
        elif key.startswith("lora."):
            lora = model_overrides.get("lora")
            lora = dict(lora) if isinstance(lora, dict) else {}
            lora[key[len("lora."):]] = value
            model_overrides["lora"] = lora
            model_keys.append("lora")
        elif key.startswith("log."):
            log[key[len("log."):]] = value
        elif key == "log":
            if not isinstance(value, dict):
                raise UserError(f"log must be a dict (e.g. log={{'wandb': True}}), got {value!r}; "
                                "or set one field as log.FIELD=value")
            log.update(value)
        elif key in ("model_overrides", "task_options"):
            if not isinstance(value, dict):
                raise UserError(f"{key} must be a dict (e.g. {key}={{'num_layers': 2}}), got "
                                f"{value!r}; or set one entry as "
                                f"{'model.FIELD' if key == 'model_overrides' else 'task.OPTION'}=value")
            (model_overrides if key == "model_overrides" else task_options).update(value)
            model_keys += list(value) if key == "model_overrides" else []
        elif key in names:
            _check_type(key, value)
            changes[key] = value
        else:
            hint = difflib.get_close_matches(key, names, n=1)
            raise UserError(f"unknown config field {key!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                            + "; model fields are set as model.FIELD=value, task options as "
                            "task.OPTION=value, logging as log.FIELD=value")
    family = changes.get("model", cfg.model)
    if model_keys and isinstance(family, str) and family in FAMILIES:
        FAMILIES[family][0].require_known_fields(dict.fromkeys(model_keys))
    LogConfig.require_known_fields(log)
    return cfg.replace(**changes, model_overrides=model_overrides, task_options=task_options,
                       log={**cfg.log.to_dict(), **log})


def named_model_fields(overrides: list[str]) -> frozenset[str]:
    """The model fields ``key=value`` strings set, as :func:`apply_overrides` reads them:
    ``model.FIELD``, ``lora.FIELD`` (the field ``lora``), the keys of ``model_overrides={...}``."""
    out: set[str] = set()
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.strip()
        if key.startswith("model."):
            out.add(key[len("model."):])
        elif key.startswith("lora."):
            out.add("lora")
        elif key == "model_overrides" and isinstance(parsed := parse_value(value), dict):
            out.update(parsed)
    return frozenset(out)


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


def experiment_path(name_or_path: str) -> Path:
    """The file of an experiment given by name (looked up in :func:`experiment_dirs`) or path."""
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
    return path.resolve()


def _experiment_error(path: Path, what: str, error: Exception) -> UserError:
    """A UserError naming the experiment file and the line of it where ``error`` arose
    (a syntax error: its own file and line; otherwise the innermost line of ``path`` in
    the traceback)."""
    if isinstance(error, SyntaxError):
        where = f"{error.filename or path}, line {error.lineno}"
        text = (error.text or "").strip()
        detail = f"{type(error).__name__}: {error.msg}" + (f" ({text!r})" if text else "")
    else:
        lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
                 if Path(frame.filename) == path]
        where = f"{path}" + (f", line {lines[-1]}" if lines else "")
        detail = f"{what} raised {type(error).__name__}: {error}"
    return UserError(f"experiment file {where}: {detail}; fix the file, or give another "
                     "--experiment (`transformer-jax experiments` lists them)")


def experiment_call(module, name: str, *args):
    """``module.name(*args)`` (``get_config``, ``get_sweep``): an exception other than a
    UserError in the experiment's own code becomes a UserError naming its file and line."""
    try:
        return getattr(module, name)(*args)
    except UserError:
        raise
    except Exception as e:   # noqa: BLE001 - the user's file: named, not a traceback
        raise _experiment_error(Path(module.__file__), f"{name}()", e) from None


def experiment_module(name_or_path: str):
    """The experiment file, imported (it must define ``get_config()``). A syntax error, a
    failed import or any other exception while the file runs is a UserError naming the
    file and the line."""
    path = experiment_path(name_or_path)
    spec = importlib.util.spec_from_file_location(f"_experiment_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except UserError:
        raise
    except Exception as e:   # noqa: BLE001 - SyntaxError, ImportError, NameError, ...
        raise _experiment_error(path, "importing it", e) from None
    if not hasattr(module, "get_config"):
        raise UserError(f"experiment file {path} defines no get_config(); add one that "
                        "returns an ExperimentConfig")
    return module


def load_experiment(name_or_path: str | None) -> ExperimentConfig:
    """The default config (``None``), an experiment by name, or a path to an experiment file."""
    if name_or_path is None:
        return ExperimentConfig()
    module = experiment_module(name_or_path)
    cfg = experiment_call(module, "get_config")
    if not isinstance(cfg, ExperimentConfig):
        raise UserError(f"{module.__file__}: get_config() must return an ExperimentConfig, got "
                        f"{type(cfg).__name__}")
    return cfg


def experiments_for(tasks) -> list[str]:
    """The experiments (:func:`available_experiments`) whose task is one of ``tasks``; an
    experiment file that does not load is left out."""
    names = []
    for name in available_experiments():
        try:
            if load_experiment(name).task in tasks:
                names.append(name)
        except UserError:
            continue
    return names
