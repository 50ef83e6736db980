"""A training run, wired: the task, the model, the fine-tuning start, then the loop.

``train(cfg, workdir)`` runs an :class:`~transformer_jax.train.config.ExperimentConfig`:
:func:`setup` builds the pieces of a :class:`~transformer_jax.train.loop.Run` and
:func:`~transformer_jax.train.loop.run_loop` steps it (the files a run writes, and how it
stops and resumes, are in ``train/loop.py``'s docstring).

This module sits above both ``train/`` (the loop, the step, checkpoints, resuming) and
``tasks/`` (data, loss, evals per task): it is where a task meets the loop, so ``train/``
never imports ``tasks/``. Everything about starting from pretrained weights
(``init_from``: the source, its config, which task it fits, the adapters and which
parameters train) happens here, in :func:`setup` and the ``_fine_tuning_*`` helpers, with
the mechanics in ``train/finetune.py``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
from jax.experimental.multihost_utils import sync_global_devices

from . import sharding as sh
from . import storage
from .data.hf_datasets import is_hf_dataset, progress_bars
from .errors import UserError
from .layers.attention_dispatch import decode_implementation, resolve_implementation, tpu_generation
from .layers.lora import LoraConfig
from .models import build_model
from .models.base import attention_plan, describe_attention_plan
from .tasks import TASKS, check_data, make_task, tasks_for
from .train import finetune
from .train.checkpoint import CheckpointManager
from .train.config import ExperimentConfig, experiments_for
from .train.distributed import Placement, is_main, local_data_state, main_first, make_placement, warn
from .train.health import LossWatch
from .train.loop import LogCallback, Prefetcher, Run, run_loop
from .train.monitor import MetricsWriter, peak_flops_per_device
from .train.optim import make_optimizer, make_schedule
from .train.resume import NothingToDo, restore, saved_run_config, set_aside_newer, write_config
from .train.wandb_log import WandbLog, wandb_run_mode
from .train.step import (LossScale, compile_train_step, create_train_state, eval_step,
                         make_train_step)

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
    """``(optimizer, learning-rate schedule)`` of the run (``d_model`` sets the Noam schedule's scale)."""
    schedule = make_schedule(cfg.schedule, **cfg.schedule_kwargs(model_cfg.d_model))
    tx = make_optimizer(schedule=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)
    return tx, schedule


def make_loss_scale(cfg: ExperimentConfig, model_cfg) -> LossScale | None:
    """The run's initial :class:`LossScale`, or None when it does not scale its loss."""
    if not cfg.dynamic_loss_scale(str(getattr(model_cfg, "dtype", "float32"))):
        return None
    return LossScale.create(cfg.loss_scale_init, cfg.loss_scale_growth_interval)


def _describe_placement(placement: Placement) -> None:
    notes = placement.notes
    print(f"{placement.describe()}; replicated (indivisible) parameter dims:\n  "
          + "\n  ".join(notes[:8]) + (f"\n  ... and {len(notes) - 8} more" if len(notes) > 8 else ""),
          flush=True)


def _platform() -> str:
    """"cpu", "gpu" or "tpu": the platform this process runs its steps on."""
    backend = jax.default_backend()
    return backend if backend in ("gpu", "tpu") else "cpu"


def _say_attention(plan: dict, model_cfg) -> None:
    """The attention line of a run's start (``describe_attention_plan``), and one more where
    a forced kernel ("splash", "pallas") leaves KV-cache sampling to the decode path's own
    implementation (``attention_dispatch.decode_implementation``: "auto")."""
    print(describe_attention_plan(plan, model_cfg), flush=True)
    impl = model_cfg.attention_impl
    if getattr(model_cfg, "attention", "softmax") == "linear" or decode_implementation(impl) == impl:
        return
    step = resolve_implementation(decode_implementation(impl), _platform(), q_len=1,
                                  dtype=model_cfg.dtype, head_dim=model_cfg.head_dim,
                                  tpu_generation=tpu_generation())
    print(f"attention: {impl} for training and the eval loss; KV-cache sampling (samples at "
          f"eval, generate) takes the decode path's own: auto -> {step} (one query row a step)",
          flush=True)


def setup(cfg: ExperimentConfig, workdir: str | Path, *, resume: bool = False,
          progress: bool = True, resume_from: int | None = None,
          stop_at: int | None = None, given_model: frozenset[str] | None = None) -> Run:
    """Everything a run needs: task, model, placement, checkpoints, state, compiled steps.
    ``given_model``: the model settings given for an ``init_from`` start, the only ones
    reported where they do not apply (None: all of ``cfg``'s; ``finetune.resolve``).

    Everything that can refuse the run (the workdir, the config, the data: every split it
    reads, :meth:`~transformer_jax.tasks.base.Task.check_data`; the checkpoint's
    compatibility, ``--steps`` against the checkpoint) is checked before the run writes
    anything into ``workdir``; :class:`NothingToDo` when the checkpoint is already done.
    """
    workdir = storage.path(workdir)
    resume = resume or resume_from is not None
    storage.check_workdir(workdir)
    wandb_mode = _check_early(cfg)
    cfg, source, saved = _fine_tuning_config(cfg, workdir, resume, given_model)
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
        _say_attention(plan, model_cfg)
    train_it = main_first(lambda: task.train_iterator(placement.data_index, placement.data_count),
                          "transformer_jax:data")
    rng = jax.random.PRNGKey(cfg.seed)
    init_args = task.init_args()
    abstract = _abstract_params(model, rng, init_args)
    if getattr(model_cfg, "lora", None) is not None:
        finetune.check_adapters(model_cfg, abstract())   # targets that match no Dense
    pretrained, split = _fine_tuning_start(cfg, source, saved, model_cfg, abstract, run_config)
    if source is not None and source.stored is not None:
        _check_whole_tree_free(task, abstract())
    create_state = lambda: create_train_state(  # noqa: E731
        model, tx, rng, *init_args, loss_scale=loss_scale,
        partition=None if split is None else split.split)
    placement.setup(create_state, lambda: model.init(rng, *init_args))
    restored = restore(workdir, placement, run_config, resume, resume_from)
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
        create_trainable = lambda: create_train_state(  # noqa: E731
            model, tx, rng, *init_args, loss_scale=loss_scale,
            partition=lambda p: (split.trainable(p), None))
        state = _initial_state(cfg, placement, task, tx, (create_state, create_trainable),
                               pretrained, split, lambda source: finetune.Start.plan(
                                   source, model_cfg, abstract()))
    else:
        _, state, data_state = restored
        train_it.set_state(local_data_state(data_state))
        state = placement.from_checkpoint(state)
        if resume_from is not None:
            set_aside_newer(workdir, resume_from)
    if is_main() and split is not None:
        print(finetune.describe_trainable(split, abstract()), flush=True)
    if is_main():
        write_config(workdir, run_config)
    ckpt = CheckpointManager(workdir / "checkpoints", save_every=cfg.save_every, keep=cfg.keep)
    train_step = compile_train_step(placement, make_train_step(
        loss_fn=task.loss_fn, label_smoothing=cfg.label_smoothing, accum_steps=cfg.accum_steps,
        schedule=schedule, axis_name=placement.axis_name, loss_chunk=cfg.loss_chunk))
    resumed = restored is not None
    wandb = (WandbLog.open(cfg.log, workdir, run_config, resumed=resumed, mode=wandb_mode)
             if cfg.log.wandb and is_main() else None)
    return Run(cfg=cfg, workdir=workdir, placement=placement, task=task, model=model,
               run_config=run_config, ckpt=ckpt, batches=Prefetcher(train_it, placement.put_batch),
               train_step=train_step,
               eval_fn=placement.eval_fn(lambda p, b: eval_step(p, b, model.apply, task.loss_fn)),
               writer=MetricsWriter(workdir, resume_step=start if resumed else None,
                                    enabled=is_main(), wandb=wandb),
               state=state, start=start, resumed=resumed, tokens_per_step=task.tokens_per_step(),
               flops_per_step=_flops_per_step(task, model_cfg, split, abstract),
               peak_flops=peak_flops_per_device(),
               watch=LossWatch(cfg.loss_spike_factor, cfg.loss_spike_window, warn=warn))


def _check_early(cfg: ExperimentConfig) -> str | None:
    """What refuses a run from its settings and its data alone, before pretrained weights
    are read and before the task writes anything (a tokenizer) into the workdir. Returns the
    W&B mode the run logs in (``wandb_log.wandb_run_mode``: the package, and the server
    asked once where the mode is online), None without W&B."""
    wandb_mode = wandb_run_mode(cfg.log, is_main(), say=warn)
    make_schedule(cfg.schedule, **cfg.schedule_kwargs(d_model=1))   # e.g. warmup >= steps
    # every split the run reads, opened and its rows checked (process 0 first: it may
    # prepare the dataset)
    main_first(lambda: check_data(cfg), "transformer_jax:check_data")
    return wandb_mode


def _flops_per_step(task, model_cfg, split, abstract) -> float:
    """The model FLOPs of a step, for MFU: a frozen base's weights at 4 a token, what
    trains at 6 (``Task.flops_per_step``)."""
    shapes = abstract() if split is not None else {}
    return task.flops_per_step(model_cfg, finetune.trainable_counts(split, shapes))


def _initial_state(cfg, placement, task, tx, create, pretrained, split, plan):
    """The train state of a run that starts: a fresh init (``create[0]``) with the
    pretrained weights put in; or, for a QLoRA start whose base was streamed stored, that
    base as the frozen part and only what trains initialised (``create[1]``). ``plan``:
    source -> Start, for a resumed run that saved nothing yet (its source is read now)."""
    create_state, create_trainable = create
    if pretrained is None and cfg.init_from is not None:   # resumed, but nothing saved yet
        pretrained = plan(finetune.load_source(cfg.init_from, **_source_placement(cfg)))
    if pretrained is not None and is_main():
        print(pretrained.describe(), flush=True)
    if pretrained is not None and pretrained.source.stored is not None:     # QLoRA, streamed
        return placement.init_frozen_state(create_trainable, pretrained.frozen_params(split))
    adjust = task.init_params
    if pretrained is not None:
        adjust = lambda p: task.init_params(pretrained.fill(p))  # noqa: E731
    return placement.init_state(create_state, tx, adjust, split)


def _abstract_params(model, rng, init_args) -> Callable[[], Any]:
    """A function giving the model's parameter shapes, traced on the first call only."""
    shapes: dict = {}

    def abstract():
        if "params" not in shapes:
            shapes["params"] = jax.eval_shape(
                lambda: nn.meta.unbox(model.init(rng, *init_args)["params"]))
        return shapes["params"]
    return abstract


def _fine_tuning_config(cfg: ExperimentConfig, workdir: Path, resume: bool,
                        given_model: frozenset[str] | None = None):
    """``(cfg, source, saved run config)``: with ``init_from``, ``cfg`` takes the model and
    tokenizer of the pretrained weights (``source``), or, resuming such a run, those its
    config.json recorded (``saved``; nothing is re-read)."""
    source, saved = None, saved_run_config(workdir) if resume else None
    if saved is not None:
        _check_same_start(cfg, saved, workdir)
    if saved is not None and saved.get("init_from"):
        cfg = finetune.resumed_config(cfg, saved, say=warn)
    elif cfg.init_from is not None:
        source = finetune.load_source(cfg.init_from, **_source_placement(cfg))
        check_task(cfg, source)
        cfg = finetune.resolve(cfg, source, say=warn, given=given_model)
    return cfg, source, saved


def _source_placement(cfg: ExperimentConfig) -> dict[str, Any]:
    """How ``load_source`` streams an HF directory for this run: in the run's
    ``param_dtype`` and, under ``--parallelism jit``, sharded over the run's mesh; with
    QLoRA (``lora.quantize``) its base stored quantized, in the run's layer layout."""
    out: dict[str, Any] = {"param_dtype": cfg.model_overrides.get("param_dtype")}
    if cfg.parallelism == "jit":
        out["mesh"] = sh.make_mesh(cfg.mesh)
    lora = LoraConfig.from_value(cfg.model_overrides.get("lora"))
    if lora is not None and lora.quantize is not None:
        out.update(quantize=lora, scan_layers=cfg.model_overrides.get("scan_layers"))
    return out


def _check_whole_tree_free(task, shapes) -> None:
    """A QLoRA start never builds the whole parameter tree: refuse a task that edits it
    (``task.pretrained`` of a classifier loads an encoder over it)."""
    if task.init_params(shapes) is not shapes:
        raise UserError("task.pretrained and --init-from with lora.quantize both load "
                        "pretrained weights; drop task.pretrained (--init-from already loads "
                        "the model), or lora.quantize")


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


def train(cfg: ExperimentConfig, workdir: str | Path, *, resume: bool = False,
          progress: bool = True, on_log: LogCallback | None = None,
          on_eval: LogCallback | None = None, stop_at: int | None = None,
          resume_from: int | None = None,
          given_model: frozenset[str] | None = None) -> dict[str, Any]:
    """Train (or resume) a run; returns a summary dict. See ``train/loop.py``'s docstring.

    ``on_log(step, row)`` gets every logged row (also written to metrics.jsonl) and
    ``on_eval(step, metrics)`` every eval, on every process. ``stop_at``: save a
    checkpoint at that step and return (``summary["paused"]``); ``resume=True`` continues
    from the latest checkpoint, ``resume_from=STEP`` from that one (the later ones move to
    ``<step>.superseded``). A resumed run already at ``cfg.steps`` returns at once with
    ``summary["nothing_to_do"]`` (a message) and writes nothing. ``given_model``: the model
    settings given for an ``init_from`` start (the CLI's ``--set model.*``), the only ones
    reported where they do not apply (None: all of ``cfg``'s).
    """
    with progress_bars(progress or not is_hf_dataset(cfg.dataset)):   # datasets' own bars
        try:
            run = setup(cfg, workdir, resume=resume, progress=progress, resume_from=resume_from,
                        stop_at=stop_at, given_model=given_model)
        except NothingToDo as done:
            return {"workdir": str(storage.path(workdir)), "start_step": done.step,
                    "final_step": done.step, "nothing_to_do": str(done), "interrupted": None,
                    "paused": False}
        return run_loop(run, progress=progress, on_log=on_log, on_eval=on_eval, stop_at=stop_at)
