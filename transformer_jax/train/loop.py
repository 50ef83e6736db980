"""The training loop: data -> jitted train step -> logs, evals, samples and checkpoints.

``train(cfg, workdir)`` runs an :class:`~transformer_jax.train.config.ExperimentConfig`.
Everything a run produces lives in ``workdir``:

  config.json      the resolved run config (also stored inside every checkpoint)
  checkpoints/N/   orbax checkpoints: train state + config + data-iterator position
  metrics.jsonl    one JSON object per logged step ({"step", "loss", ...}) and per eval
  tb/              TensorBoard event files
  samples.txt      text generated at each eval
  loss.png         the loss curve, written at the end

The loop (:func:`train`) is :func:`setup`, then per step :func:`_advance` (the next batch,
already on the devices, through the jitted step), :meth:`MetricsLog.record` (logging),
:func:`_evaluate` (evals and samples), :func:`_save` (checkpoints) and :func:`_stopping`
(signals). ``on_log(step, row)`` and ``on_eval(step, metrics)`` see every logged row and
eval; ``stop_at=N`` saves a checkpoint at step N and returns, and ``resume=True`` continues
it with exactly the losses of an uninterrupted run.

No host sync per step: a step's metrics stay on the devices until a log step, whose copy
to the host starts at once and is read after the next step has been dispatched; the next
batches are placed on the devices ahead of use (:class:`Prefetcher`). The loss of every
step is still checked, at each log step and before every save, so a non-finite loss
stops the run (:class:`NonFiniteLossError`) and a non-finite state is never saved.

Devices: ``cfg.parallelism`` ("jit": one jitted step sharded over the ``cfg.mesh`` of
data/fsdp/tensor axes; "pmap": replicated data parallelism) picks a
:class:`~transformer_jax.train.distributed.Placement`; with several processes (see
``distributed.initialize``) each reads its rows of every batch, process 0 alone writes the
files above, and all of them write the sharded checkpoints. Checkpoints hold global
arrays and are restored into the current run's shardings, so a run resumes on another
mesh, another device count or the other parallelism.

Reliability: SIGTERM/SIGINT finish the current step, save a checkpoint and stop;
``resume=True`` restores the latest checkpoint, including the data position, the dropout
key and the loss scale, so the resumed run computes exactly the losses the uninterrupted
run would have (``resume_from=STEP``: any kept checkpoint). A step is saved only while the
loss is healthy (finite, no spike: ``train/health.py``); a non-finite loss stops the run
and moves the checkpoints saved as the loss rose to ``<step>.diverged``, so that a resume
starts from before the blow-up. An unreadable checkpoint is moved to ``<step>.corrupt``
and the newest readable one restored. A run that is refused (bad workdir, checkpoint of
another config, nothing left to do) writes nothing.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.multihost_utils import sync_global_devices

from .. import storage
from ..errors import UserError
from ..losses import metric_names
from ..models import build_model, model_from_config
from ..layers.attention_dispatch import tpu_generation
from ..models.base import attention_plan, describe_attention_plan
from ..tasks import TASKS, Task, make_task, tasks_for
from . import finetune
from .checkpoint import CheckpointManager, load_params
from .config import ExperimentConfig, experiments_for
from .distributed import (Placement, any_process, broadcast_json, gather_data_state, is_main,
                          local_data_state, main_first, make_placement)
from .health import LossWatch, last_good_step
from .monitor import MetricsWriter, peak_flops_per_device, plot_loss
from .optim import make_optimizer, make_schedule
from .step import LossScale, create_train_state, eval_step, make_train_step

# Fields that must not change when resuming: they fix the model and the data stream.
_RESUME_FIXED = ("task", "task_options", "model", "model_preset", "dataset", "tokenizer", "seq_len",
                 "batch_size", "seed")

LogCallback = Callable[[int, dict[str, float]], None]


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf; the run stopped and kept its last good checkpoint."""


class _StopRequest:
    """Turns SIGTERM/SIGINT into a flag checked between steps."""

    def __init__(self):
        self.signal: int | None = None

    def __call__(self, signum, frame):
        self.signal = signum

    @contextlib.contextmanager
    def installed(self):
        previous = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self)
        except ValueError:  # not the main thread: leave signals alone
            pass
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# ----------------------------------------------------------------------------- pieces

def build(cfg: ExperimentConfig, task_overrides: dict[str, Any]):
    """``(model_config, model)``: preset + experiment overrides + what the task's data fixes."""
    overrides = dict(cfg.model_overrides)
    vocab = task_overrides.get("vocab_size")
    if vocab is not None and overrides.get("vocab_size", vocab) < vocab:
        raise UserError(_vocab_message(cfg, overrides["vocab_size"], vocab))
    for key, value in task_overrides.items():
        overrides.setdefault(key, value)
    model_cfg, model = build_model(cfg.model, cfg.model_preset, overrides)
    max_len = getattr(model_cfg, "max_len", None)
    if max_len is not None and cfg.seq_len > max_len:
        raise UserError(f"seq_len={cfg.seq_len} exceeds the model's max_len={max_len}; "
                        f"lower seq_len or set model.max_len>={cfg.seq_len}")
    return model_cfg, model


def _vocab_message(cfg: ExperimentConfig, size: int, vocab: int) -> str:
    """Why the model's vocab_size is too small for the run's tokenizer, and what to set."""
    tokenizer = f"tokenizer={cfg.tokenizer!r}"
    if cfg.tokenizer in ("byte", "bytes", "byt5"):
        tokenizer += (" (the default: the checkpoint brings no tokenizer files)"
                      if cfg.init_from is not None else " (256 bytes and 3 special ids)")
    if cfg.init_from is not None:   # the model, vocab_size included, is the checkpoint's
        return (f"the checkpoint {cfg.init_from} has vocab_size={size}, smaller than the "
                f"{vocab} ids of the run's tokenizer, {tokenizer}; give the tokenizer its "
                "weights were trained with as --set tokenizer=hf:DIR (a directory with its "
                f"tokenizer.json), or use a checkpoint with vocab_size >= {vocab}")
    return (f"model.vocab_size={size} is smaller than the {vocab} ids of the run's tokenizer, "
            f"{tokenizer}; drop the override (the task sets vocab_size from the tokenizer) or "
            f"set it to at least {vocab}")


def make_tx(cfg: ExperimentConfig, model_cfg):
    schedule = make_schedule(cfg.schedule, **cfg.schedule_kwargs(model_cfg.d_model))
    tx = make_optimizer(schedule=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)
    return tx, schedule


def make_loss_scale(cfg: ExperimentConfig, model_cfg) -> LossScale | None:
    """The run's initial :class:`LossScale`, or None when it does not scale its loss."""
    if not cfg.dynamic_loss_scale(str(getattr(model_cfg, "dtype", "float32"))):
        return None
    return LossScale.create(cfg.loss_scale_init, cfg.loss_scale_growth_interval)


def evaluate(params, apply_fn, task: Task, eval_fn=None, model=None, *,
             placement: Placement | None = None, local_params=None) -> dict[str, float]:
    """Per-weight means over the first ``eval_batches`` eval batches, plus the task's extras.

    The batches' sums stay on the devices until the last batch and reach the host together.
    With a ``placement`` the batches are global arrays on its mesh (each process reads its
    rows; processes stop together when any runs out) and ``params`` are its global
    parameters; ``local_params`` (default ``params``) feed the task's ``extra_eval``, which
    runs on process 0 and is shared with the others.
    """
    cfg = task.cfg
    step = lambda p, b: eval_step(p, b, apply_fn, task.loss_fn)  # noqa: E731
    if placement is None:
        index, count = jax.process_index(), jax.process_count()
        eval_fn = eval_fn or jax.jit(step)
    else:
        index, count = placement.data_index, placement.data_count
        eval_fn = eval_fn or placement.eval_fn(step)
    multi = jax.process_count() > 1
    sums = []
    batches = iter(task.eval_batches(index, count))
    for _ in range(cfg.eval_batches):
        batch = next(batches, None)
        if any_process(batch is None) if multi else batch is None:
            break
        sums.append(eval_fn(params, batch))
    totals: dict[str, float] = {}
    for row in jax.device_get(sums):   # added up in float64 on the host
        for k, v in row.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    weight = totals.get("weight", 0.0)
    if weight <= 0:
        raise UserError(f"the eval split {cfg.eval_split!r} of {cfg.dataset!r} gave no tokens to "
                        "score; choose another eval_split or raise eval_batches")
    # each sum per its weight (``weight``, or ``X_weight`` for ``X_*``: losses.metric_names)
    out = {f"eval_{metric}": totals[k] / totals[w] if totals[w] > 0 else 0.0
           for k, (metric, w) in metric_names(totals).items()}
    out["eval_ppl"] = math.exp(min(out["eval_loss"], 50.0))
    out["eval_tokens"] = weight
    if model is not None:
        local_params = params if local_params is None else local_params
        extras = task.extra_eval(model, local_params) if (is_main() or not multi) else None
        if multi:
            extras = broadcast_json(extras)
        out.update({f"eval_{k}": v for k, v in extras.items()})
    return out


def _differences(then: dict, now: dict, prefix: str = "") -> dict[str, tuple]:
    """``{field: (then, now)}`` for the fields of two config dicts that differ; fields of a
    nested dict on both sides (``lora``) are named ``lora.rank``."""
    diff = {}
    for key in list(now) + [k for k in then if k not in now]:
        a, b = then.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diff.update(_differences(a, b, f"{prefix}{key}."))
        elif a != b:
            diff[f"{prefix}{key}"] = (a, b)
    return diff


def _check_resume_compatible(saved: dict, run_config: dict) -> None:
    problems = []
    if saved.get("model") != run_config["model"]:
        diff = _differences(saved.get("model") or {}, run_config["model"])
        problems.append(f"model config differs (field: (checkpoint, now)) {diff}")
    for key in _RESUME_FIXED:
        a, b = saved.get("experiment", {}).get(key), run_config["experiment"].get(key)
        if a != b:
            problems.append(f"{key}: checkpoint has {a!r}, config has {b!r}")
    scaled = saved.get("loss_scaling", False)
    if scaled != run_config["loss_scaling"]:
        problems.append(f"loss scaling: checkpoint {'has' if scaled else 'has none'}, config "
                        f"{'scales' if run_config['loss_scaling'] else 'does not'} (loss_scale)")
    if problems:
        raise UserError("the checkpoint in this workdir does not match the config: "
                        + "; ".join(problems)
                        + ". Resume without the setting that changes it (the CLI's --resume "
                        "takes the run's settings from its config.json), or start in a new "
                        "--workdir.")


# ----------------------------------------------------------------------------- files

def _write_config(workdir, run_config: dict) -> None:
    storage.makedirs(workdir)
    storage.write_text(workdir / "config.json", json.dumps(run_config, indent=2) + "\n")


def _append_sample(workdir, step: int, eval_loss: float, text: str) -> None:
    storage.append_text(workdir / "samples.txt",
                        f"=== step {step} (eval loss {eval_loss:.3f})\n{text}\n")


# ----------------------------------------------------------------------------- the run

class Prefetcher:
    """The train batches, placed on the devices ``depth`` batches ahead of use.

    ``position()`` is the data-iterator state after the last batch handed out (what a
    checkpoint must store: the iterator itself has read ``depth`` batches further).
    """

    def __init__(self, iterator, put: Callable[[Any], Any], depth: int = 2):
        self.iterator, self.put, self.depth = iterator, put, depth
        self.queue: collections.deque = collections.deque()
        self._position = iterator.get_state()

    def __iter__(self):
        return self

    def __next__(self):
        while len(self.queue) <= self.depth:
            batch = next(self.iterator)
            self.queue.append((self.put(batch), self.iterator.get_state()))
        batch, self._position = self.queue.popleft()
        return batch

    def position(self) -> dict:
        return self._position


@dataclasses.dataclass
class Run:
    """The pieces of one training run, as :func:`setup` builds them."""
    cfg: ExperimentConfig
    workdir: Path
    placement: Placement
    task: Task
    model: Any
    run_config: dict
    ckpt: CheckpointManager
    batches: Prefetcher
    train_step: Callable
    eval_fn: Callable
    writer: MetricsWriter
    state: Any
    start: int
    resumed: bool
    tokens_per_step: int
    flops_per_step: float
    peak_flops: tuple[float, str]
    watch: LossWatch
    spike_warned: int | None = None   # the run of spikes whose skipped save was reported
    main: bool = dataclasses.field(default_factory=is_main)
    multi: bool = dataclasses.field(default_factory=lambda: jax.process_count() > 1)


def _describe_placement(placement: Placement) -> None:
    notes = placement.notes
    print(f"{placement.describe()}; replicated (indivisible) parameter dims:\n  "
          + "\n  ".join(notes[:8]) + (f"\n  ... and {len(notes) - 8} more" if len(notes) > 8 else ""),
          flush=True)


def _platform() -> str:
    """"cpu", "gpu" or "tpu": the platform this process runs its steps on."""
    backend = jax.default_backend()
    return backend if backend in ("gpu", "tpu") else "cpu"


class NothingToDo(Exception):
    """``--resume`` of a run whose checkpoint is already at (or past) ``cfg.steps``."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def setup(cfg: ExperimentConfig, workdir: str | Path, *, resume: bool = False,
          progress: bool = True, resume_from: int | None = None,
          stop_at: int | None = None) -> Run:
    """Everything a run needs: task, model, placement, checkpoints, state, compiled steps.

    Everything that can refuse the run (the workdir, the config, the checkpoint's
    compatibility, ``--steps`` against the checkpoint) is checked before the run writes
    anything into ``workdir``; :class:`NothingToDo` when the checkpoint is already done.
    """
    workdir = storage.path(workdir)
    resume = resume or resume_from is not None
    storage.check_workdir(workdir)
    make_schedule(cfg.schedule, **cfg.schedule_kwargs(d_model=1))   # refuses e.g. warmup >= steps early
    cfg, source, saved = _fine_tuning_config(cfg, workdir, resume)
    placement = make_placement(cfg.parallelism, cfg.mesh, cfg.batch_size, cfg.accum_steps)
    # with several processes, process 0 prepares first (tokenizer, dataset), the others reuse it
    task = main_first(lambda: make_task(cfg, workdir), "transformer_jax:task")
    model_cfg, model = build(cfg, task.model_overrides())
    tx, schedule = make_tx(cfg, model_cfg)
    loss_scale = make_loss_scale(cfg, model_cfg)
    plan = attention_plan(model_cfg, cfg.seq_len, _platform(), tpu_generation())
    run_config = {"experiment": cfg.to_dict(), "family": cfg.model, "model": model_cfg.to_dict(),
                  "task": cfg.task, "task_spec": task.spec(), "loss_scaling": loss_scale is not None,
                  "attention": plan}
    if is_main():
        print(describe_attention_plan(plan, model_cfg), flush=True)
    train_it = main_first(lambda: task.train_iterator(placement.data_index, placement.data_count),
                          "transformer_jax:data")
    rng = jax.random.PRNGKey(cfg.seed)
    init_args = task.init_args()
    abstract = _abstract_params(model, rng, init_args)
    if getattr(model_cfg, "lora", None) is not None:
        finetune.check_adapters(model_cfg, abstract())   # targets that match no Dense
    pretrained, split = _fine_tuning_start(cfg, source, saved, model_cfg, abstract, run_config)
    create_state = lambda: create_train_state(  # noqa: E731
        model, tx, rng, *init_args, loss_scale=loss_scale,
        partition=None if split is None else split.split)
    placement.setup(create_state, lambda: model.init(rng, *init_args))
    restored = _restore(workdir, placement, run_config, resume, resume_from)
    start = 0 if restored is None else restored[0]
    if start >= cfg.steps:
        raise NothingToDo(f"nothing to do: the checkpoint in {workdir / 'checkpoints'} is at step "
                          f"{start}, and steps={cfg.steps}; give --steps above {start} to train "
                          "further", start)
    if stop_at is not None and stop_at <= start:
        raise UserError(f"stop_at={stop_at} is not after the step this run starts from "
                        f"({start}); give a later step")
    # ---- nothing was written before this line
    if jax.process_count() > 1:   # every process has looked at checkpoints/ before any writes
        sync_global_devices("transformer_jax:checked")
    if is_main() and placement.notes and progress:
        _describe_placement(placement)
    if restored is None:
        adjust = task.init_params
        if pretrained is None and cfg.init_from is not None:   # resumed, but nothing saved yet
            pretrained = finetune.Start.plan(finetune.load_source(cfg.init_from), model_cfg,
                                             abstract())
        if pretrained is not None:
            if is_main():
                print(pretrained.describe(), flush=True)
            adjust = lambda p: task.init_params(pretrained.fill(p))  # noqa: E731
        state = placement.init_state(create_state, tx, adjust, split)
    else:
        _, state, data_state = restored
        train_it.set_state(local_data_state(data_state))
        state = placement.from_checkpoint(state)
        if resume_from is not None:
            _set_aside_newer(workdir, resume_from)
    if is_main() and split is not None:
        print(finetune.describe_trainable(split, abstract()), flush=True)
    if is_main():
        _write_config(workdir, run_config)
    ckpt = CheckpointManager(workdir / "checkpoints", save_every=cfg.save_every, keep=cfg.keep)
    train_step = placement.compile(make_train_step(
        loss_fn=task.loss_fn, label_smoothing=cfg.label_smoothing, accum_steps=cfg.accum_steps,
        schedule=schedule, axis_name=placement.axis_name))
    resumed = restored is not None
    return Run(cfg=cfg, workdir=workdir, placement=placement, task=task, model=model,
               run_config=run_config, ckpt=ckpt, batches=Prefetcher(train_it, placement.put_batch),
               train_step=train_step,
               eval_fn=placement.eval_fn(lambda p, b: eval_step(p, b, model.apply, task.loss_fn)),
               writer=MetricsWriter(workdir, resume_step=start if resumed else None, enabled=is_main()),
               state=state, start=start, resumed=resumed, tokens_per_step=task.tokens_per_step(),
               flops_per_step=task.flops_per_step(model_cfg), peak_flops=peak_flops_per_device(),
               watch=LossWatch(cfg.loss_spike_factor, cfg.loss_spike_window, warn=_warn))


def _abstract_params(model, rng, init_args) -> Callable[[], Any]:
    """A function giving the model's parameter shapes, traced on the first call only."""
    shapes: dict = {}

    def abstract():
        if "params" not in shapes:
            shapes["params"] = jax.eval_shape(
                lambda: nn.meta.unbox(model.init(rng, *init_args)["params"]))
        return shapes["params"]
    return abstract


def _fine_tuning_config(cfg: ExperimentConfig, workdir: Path, resume: bool):
    """``(cfg, source, saved run config)``: with ``init_from``, ``cfg`` takes the model and
    tokenizer of the pretrained weights (``source``), or, resuming such a run, those its
    config.json recorded (``saved``; nothing is re-read)."""
    source, saved = None, _saved_run_config(workdir) if resume else None
    if saved is not None:
        _check_same_start(cfg, saved, workdir)
    if saved is not None and saved.get("init_from"):
        cfg = finetune.resumed_config(cfg, saved, say=_warn)
    elif cfg.init_from is not None:
        source = finetune.load_source(cfg.init_from)
        check_task(cfg, source)
        cfg = finetune.resolve(cfg, source, say=_warn)
    return cfg, source, saved


def check_task(cfg: ExperimentConfig, source: finetune.Source) -> None:
    """Refuse a source whose family cannot train the experiment's task (a BERT checkpoint
    under the default GPT language-model experiment), naming the experiments that fit it."""
    task = TASKS.get(cfg.task)
    if task is None or source.family in task.MODELS:
        return
    fits = tasks_for(source.family)
    what = (f"task {source.task!r}" if source.kind == "workdir" and source.task
            else source.task or "no task recorded")
    experiments = experiments_for(fits)
    choose = (f"choose an experiment for it (--experiment {' or '.join(experiments)})"
              if experiments else "choose an experiment for it")
    raise UserError(f"--init-from {source.path} is a {source.family} checkpoint ({what}), but "
                    f"experiment {cfg.name!r} trains task {cfg.task!r}, which needs a "
                    f"{' or '.join(task.MODELS)} model; a {source.family} model trains "
                    + " or ".join(repr(t) for t in fits)
                    + f": {choose}, or --set task="
                    + (source.task if source.task in fits else fits[0]))


def _check_same_start(cfg: ExperimentConfig, saved: dict, workdir: Path) -> None:
    """A resume with ``init_from`` continues the run that started from it: refuse another
    source, or one given for a run that started from scratch."""
    if cfg.init_from is None:
        return
    record = saved.get("init_from") or {}
    given = saved.get("experiment", {}).get("init_from")
    started = record.get("path") or given
    if cfg.init_from in (started, given) or (
            started is not None and os.path.abspath(cfg.init_from) == started):
        return
    began = f"started from {started}" if started else "did not start from pretrained weights"
    raise UserError(f"--init-from {cfg.init_from}: the run in {workdir} {began} "
                    f"({workdir / 'config.json'}); --resume continues from its own checkpoint: "
                    "drop --init-from, or start a new run in another --workdir")


def _fine_tuning_start(cfg: ExperimentConfig, source, saved, model_cfg, abstract, run_config):
    """``(Start or None, ParamSplit or None)``: how the fresh parameters (``abstract()``:
    their shapes) take the source's weights, recorded in ``run_config["init_from"]``; and
    which of them train (adapters, a fresh head) when the model has adapters."""
    pretrained, head = None, None
    if source is not None:
        pretrained = finetune.Start.plan(source, model_cfg, abstract())
        pretrained.check()
        run_config["init_from"] = pretrained.record()
        head = pretrained.fresh_head
    elif cfg.init_from is not None:    # resumed: the start its config.json recorded
        run_config["init_from"] = saved["init_from"]
        head = saved["init_from"]["fresh"]
    return pretrained, finetune.make_split(model_cfg, head, cfg.model)


def resume_settings(cfg: ExperimentConfig, workdir: str | Path, *,
                    experiment: str | None = None) -> ExperimentConfig:
    """The settings ``transformer-jax train --resume`` starts from: every field of the run's
    ``config.json`` (learning rate, schedule, warm-up, batch, model, tokenizer, init-from,
    ...), on which ``--set`` and ``--steps`` then apply; ``cfg`` (the experiment's) when the
    workdir holds no run config. ``experiment``: the ``--experiment`` given, which must be
    the run's own (by its config name). With several processes, process 0 reads the file."""
    workdir = storage.path(workdir)
    saved = _saved_run_config(workdir) if is_main() else None
    if jax.process_count() > 1:
        saved = broadcast_json(saved)
    if not isinstance(saved, dict) or not isinstance(saved.get("experiment"), dict):
        return cfg
    settings = ExperimentConfig.from_dict(saved["experiment"])
    if experiment is not None and cfg.name != settings.name:
        raise UserError(f"--experiment {experiment} is {cfg.name!r}, but {workdir} holds a run of "
                        f"{settings.name!r}; drop --experiment (--resume takes the run's settings "
                        f"from {workdir / 'config.json'}; --set changes them), or choose another "
                        "--workdir")
    return settings


def _saved_run_config(workdir) -> dict | None:
    """The run config a workdir's earlier run wrote (config.json), or None."""
    path = workdir / "config.json"
    if not storage.is_file(path):
        return None
    try:
        return json.loads(storage.read_text(path))
    except ValueError:
        return None


def _warn(message: str) -> None:
    if is_main():
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _restore(workdir: Path, placement: Placement, run_config: dict, resume: bool,
             resume_from: int | None):
    """``(step, state, data_state)`` of the checkpoint a run continues from, or None for a
    fresh run. Refuses checkpoints without ``resume`` and ones that do not match the
    config; an unreadable step is moved aside (``<step>.corrupt``) and the next older one
    restored. Only reads, unless a step is unreadable."""
    directory = workdir / "checkpoints"
    reader = CheckpointManager(directory, read_only=True) if storage.is_dir(directory) else None
    try:
        steps = reader.all_steps() if reader is not None else []
        if not steps:
            if resume_from is not None:
                raise UserError(f"--resume-from {resume_from}: {directory} holds no checkpoint; "
                                "give the --workdir of a run that saved one")
            if resume:
                _warn(f"--resume: {workdir} holds no checkpoint, so this run starts from step 0 "
                      "(check the --workdir if you meant to continue a run)")
            return None
        if not resume:
            raise UserError(f"{workdir} already holds checkpoints (latest step {steps[-1]}); pass "
                            "--resume to continue that run, or choose another --workdir")
        step, state, _, data_state = reader.restore_readable(
            resume_from, target=placement.restore_target(),
            check_config=lambda saved: _check_resume_compatible(saved, run_config),
            set_aside=is_main(), warn=_warn)
    finally:
        if reader is not None:
            reader.close()
    if jax.process_count() > 1:   # process 0 may have moved unreadable steps aside
        sync_global_devices("transformer_jax:restored")
    return step, state, data_state


def _set_aside_newer(workdir: Path, step: int) -> None:
    """``--resume-from STEP``: the steps after it move to ``<step>.superseded`` (kept; the
    resumed run saves its own)."""
    if is_main():
        manager = CheckpointManager(workdir / "checkpoints", read_only=True)
        try:
            newer = [s for s in manager.all_steps() if s > step]
            moved = [str(manager.set_aside(s, "superseded")) for s in newer]
        finally:
            manager.close()
        if moved:
            _warn(f"--resume-from {step}: moved the later checkpoints aside: {', '.join(moved)}")
    if jax.process_count() > 1:
        sync_global_devices("transformer_jax:set_aside")


# ----------------------------------------------------------------------------- metrics

def fetch(tree):
    """The loop's one copy of step metrics from the devices to the host (log steps, and the
    loss check before a save)."""
    return jax.device_get(tree)


class MetricsLog:
    """Step metrics on their way to the host, at log steps only.

    ``record`` keeps each step's loss on the device. At a log step it stacks the losses
    since the last check with that step's metrics and starts their copy to the host; the
    copy is read (``finish``) when the next step has been dispatched, or earlier when an
    eval, a save or the end needs it. Reading checks every loss: the first non-finite one
    raises. ``check`` does the same for the losses since the last log step (before a save).
    """

    def __init__(self, run: Run, on_log: LogCallback | None, bar=None):
        self.run, self.on_log, self.bar = run, on_log, bar
        self.unchecked: list[tuple[int, jax.Array]] = []   # (step, loss) not yet on the host
        self.pending: tuple[int, list[int], Any] | None = None
        self.last_loss: float | None = None
        self.t_start = time.perf_counter()
        self.clock = (self.t_start, run.start)   # (time, step) that tokens/s counts from

    def record(self, step: int, metrics: dict, log_now: bool) -> None:
        if self.pending is not None:
            self.finish()
        self.unchecked.append((step, metrics["loss"]))
        if log_now:
            steps, payload = self._take(metrics)
            self._start_copy(payload)
            self.pending = (step, steps, payload)

    @staticmethod
    def _start_copy(payload) -> None:
        """Start copying a log step's metrics to the host; :func:`fetch` reads them later."""
        for leaf in jax.tree_util.tree_leaves(payload):
            leaf.copy_to_host_async()

    def _take(self, metrics: dict | None = None):
        steps = [s for s, _ in self.unchecked]
        losses = jnp.stack([loss for _, loss in self.unchecked])
        self.unchecked = []
        return steps, (metrics, losses)

    def _check_losses(self, steps: list[int], losses) -> None:
        for s, loss in zip(steps, np.asarray(losses).tolist()):
            if not math.isfinite(loss):
                raise _non_finite(self.run, s, loss)
            self.run.watch.add(s, loss)
        self.last_loss = float(losses[-1])

    def finish(self) -> None:
        """Read the pending log step: check its losses, write its row, call ``on_log``."""
        if self.pending is None:
            return
        step, steps, payload = self.pending
        self.pending = None
        metrics, losses = fetch(payload)
        self._check_losses(steps, losses)
        row = {k: float(v) for k, v in metrics.items()}
        now = time.perf_counter()
        t0, step0 = self.clock
        if step > step0:
            dt, n = now - t0, step - step0
            row.update(tokens_per_s=n * self.run.tokens_per_step / dt,
                       mfu=n * self.run.flops_per_step / dt / (self.run.peak_flops[0] * jax.device_count()))
        row["elapsed_s"] = now - self.t_start
        self.clock = (now, step)
        self.run.writer.write(step, row)
        if self.bar is not None and "mfu" in row:
            self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                                 mfu=f"{row['mfu']:.0%}")
        if self.on_log is not None:
            self.on_log(step, row)

    def check(self) -> None:
        """Every loss so far on the host and finite (raises otherwise): before a save."""
        self.finish()
        if self.unchecked:
            steps, (_, losses) = self._take()
            self._check_losses(steps, fetch(losses))

    def restart_clock(self, step: int) -> None:
        """Time from now on: the first step's compile and evals don't count in tokens/s."""
        self.clock = (time.perf_counter(), step)


def _non_finite(run: Run, step: int, loss: float) -> NonFiniteLossError:
    """The error that stops a run whose loss turned non-finite at ``step``. The checkpoints
    saved after the blow-up began (the spikes before ``step``, see ``train/health.py``) move
    to ``<step>.diverged``, so that ``--resume`` restores one from before it."""
    run.ckpt.wait()
    blowup = run.watch.blowup_start() or step
    rise = f" ({run.watch.describe_spike()})" if run.watch.blowup_start() else ""
    good = last_good_step(run.ckpt.all_steps(), blowup)
    later = [s for s in run.ckpt.all_steps() if good is None or s > good]
    moved = ""
    if later:
        if run.main:
            moved = ", ".join(str(run.ckpt.set_aside(s, "diverged")) for s in later)
        else:
            moved = ", ".join(f"{s}.diverged" for s in later)
        moved = f"; the checkpoints saved as it rose were moved aside ({moved})"
    directory = run.workdir / "checkpoints"
    if good is None:
        where = (f"no checkpoint from before the blow-up exists{moved}; lower learning_rate (or "
                 "clip_norm) and start again: the same --workdir works, without --resume")
    else:
        where = (f"checkpoint step {good} in {directory} is from before the blow-up{moved}; "
                 f"lower learning_rate (or clip_norm) and continue with --resume (it restores "
                 f"step {good}; --resume-from {good} says the same)")
    return NonFiniteLossError(f"loss became {loss} at step {step}{rise}; the run stopped without "
                              f"saving this state; {where}.")


# ----------------------------------------------------------------------------- the loop

def _advance(run: Run) -> dict:
    """One train step: the next batch (on the devices already) through the compiled step.
    Nothing here waits for the devices or copies from them."""
    run.state, metrics = run.train_step(run.state, next(run.batches))
    return metrics


def _evaluate(run: Run, step: int, log: MetricsLog, on_eval: LogCallback | None) -> dict:
    """Eval metrics (written as a row), the task's sample (samples.txt), ``on_eval``."""
    log.finish()   # the train row of this step comes first
    local = run.placement.local_params(run.state)   # a collective with several processes
    metrics = evaluate(run.placement.eval_params(run.state), run.model.apply, run.task, run.eval_fn,
                       run.model, placement=run.placement, local_params=local)
    run.writer.write(step, metrics)
    text = run.task.sample(run.model, local, step) if run.main else None
    if text is not None:
        _append_sample(run.workdir, step, metrics["eval_loss"], text)
        run.writer.text("sample", step, text)
    if on_eval is not None:
        on_eval(step, metrics)
    log.restart_clock(step)
    return metrics


def _save(run: Run, step: int, log: MetricsLog, metrics: dict | None, force: bool) -> None:
    """A checkpoint of this step when one is due (or ``force``), after every loss so far
    was found finite. Every process takes part (sharded arrays, gathered data positions)."""
    if not (force or run.ckpt.should_save(step)):
        return
    log.check()
    if not run.watch.healthy:
        if run.spike_warned != run.watch.blowup_start():   # once per run of spikes
            run.spike_warned = run.watch.blowup_start()
            latest = run.ckpt.latest_step()
            _warn(f"step {step} not saved, nor any later step until the loss is healthy again: "
                  f"{run.watch.describe_spike()}; "
                  + ("no checkpoint was saved yet" if latest is None else
                     f"checkpoint step {latest} stays the latest"))
        return
    run.writer.flush()   # the rows up to this step are stored before the checkpoint that covers them
    position = run.batches.position()
    data_state = gather_data_state(position) if run.multi else position
    run.ckpt.maybe_save(step, run.placement.to_checkpoint(run.state), config=run.run_config,
                        data_state=data_state, metrics=metrics, force=force)


def _stopping(run: Run, stop: _StopRequest, log_now: bool) -> bool:
    """Whether a signal asks to stop. A signal may reach only some processes: with several
    they agree at each log step (a collective)."""
    if run.multi:
        return any_process(stop.signal is not None) if log_now else False
    return stop.signal is not None


def _progress_bar(run: Run, progress: bool):
    if not (progress and run.main):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=run.cfg.steps, initial=run.start, desc=run.cfg.name, dynamic_ncols=True,
                mininterval=1.0)


def _last_step(run: Run, stop_at: int | None) -> int:
    return run.cfg.steps if stop_at is None else min(stop_at, run.cfg.steps)


def _summary(run: Run, end: int) -> dict[str, Any]:
    peak, source = run.peak_flops
    return {"workdir": str(run.workdir), "start_step": run.start, "interrupted": None,
            "paused": end < run.cfg.steps, "peak_flops": peak, "peak_source": source,
            "parallelism": run.placement.parallelism, "mesh": dict(run.placement.mesh.shape),
            "processes": jax.process_count()}


def train(cfg: ExperimentConfig, workdir: str | Path, *, resume: bool = False,
          progress: bool = True, on_log: LogCallback | None = None,
          on_eval: LogCallback | None = None, stop_at: int | None = None,
          resume_from: int | None = None) -> dict[str, Any]:
    """Train (or resume) a run; returns a summary dict. See the module docstring.

    ``on_log(step, row)`` gets every logged row (also written to metrics.jsonl) and
    ``on_eval(step, metrics)`` every eval, on every process. ``stop_at``: save a
    checkpoint at that step and return (``summary["paused"]``); ``resume=True`` continues
    from the latest checkpoint, ``resume_from=STEP`` from that one (the later ones move to
    ``<step>.superseded``). A resumed run already at ``cfg.steps`` returns at once with
    ``summary["nothing_to_do"]`` (a message) and writes nothing.
    """
    try:
        run = setup(cfg, workdir, resume=resume, progress=progress, resume_from=resume_from,
                    stop_at=stop_at)
    except NothingToDo as done:
        return {"workdir": str(storage.path(workdir)), "start_step": done.step,
                "final_step": done.step, "nothing_to_do": str(done), "interrupted": None,
                "paused": False}
    bar = log = None
    step, eval_row, stop = run.start, None, _StopRequest()
    try:
        end = _last_step(run, stop_at)
        summary = _summary(run, end)
        bar = _progress_bar(run, progress)
        log = MetricsLog(run, on_log, bar)
        with stop.installed():
            while step < end:
                metrics = _advance(run)
                step += 1
                log_now = step % cfg.log_every == 0 or step == cfg.steps
                log.record(step, metrics, log_now)
                if step == run.start + 1:   # the first step compiles: keep it out of tokens/s
                    jax.block_until_ready(metrics)
                    log.restart_clock(step)
                if bar is not None:
                    bar.update(1)
                eval_metrics = None
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    eval_row = eval_metrics = _evaluate(run, step, log, on_eval)
                _save(run, step, log, eval_metrics, force=step == end)
                if _stopping(run, stop, log_now):
                    _save(run, step, log, eval_metrics, force=True)
                    summary.update(interrupted=signal.Signals(stop.signal or signal.SIGTERM).name,
                                   paused=False)
                    break
            log.finish()
    finally:
        if bar is not None:
            bar.close()
        run.ckpt.close()   # waits for pending async saves
        run.writer.close()
    summary.update(final_step=step, loss=log.last_loss, seconds=time.perf_counter() - log.t_start,
                   **(eval_row or {}))
    if run.main:
        png = plot_loss(run.workdir)
        summary["loss_png"] = str(png) if png else None
    return summary


# ----------------------------------------------------------------------------- workdir tools

def load_run(workdir: str | Path, step: int | None = None):
    """Rebuild ``(run_config, model, params, task)`` from a workdir alone."""
    run_config, params = load_params(workdir, step)
    _, model = model_from_config(run_config["family"], run_config["model"])
    cfg = ExperimentConfig.from_dict(run_config["experiment"])
    task = make_task(cfg, workdir, spec=run_config["task_spec"])
    return run_config, model, params, task


def run_costs(workdir: str | Path) -> dict[str, float]:
    """What a run costs, from its config.json: parameters (total, and non-embedding, which
    the scaling laws count), tokens and training FLOPs per step (``Task.flops_per_step``;
    GPT: 6 N + 12 L D T per token, N counting the read-out)."""
    run_config = json.loads(storage.read_text(storage.path(workdir) / "config.json"))
    model_cfg, _ = model_from_config(run_config["family"], run_config["model"])
    task = make_task(ExperimentConfig.from_dict(run_config["experiment"]), workdir,
                     spec=run_config["task_spec"])
    try:
        non_embedding = model_cfg.num_params(non_embedding=True)
    except TypeError:   # a family without embedding tables to leave out (ViT)
        non_embedding = model_cfg.num_params()
    return {"params": model_cfg.num_params(), "non_embedding_params": non_embedding,
            "tokens_per_step": task.tokens_per_step(), "flops_per_step": task.flops_per_step(model_cfg)}


def evaluate_workdir(workdir: str | Path, *, batches: int | None = None) -> dict[str, float]:
    _, model, params, task = load_run(workdir)
    if batches:
        task.cfg = task.cfg.replace(eval_batches=batches)
    return evaluate(params, model.apply, task, model=model)
