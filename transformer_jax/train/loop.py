"""The training loop: data -> jitted train step -> logs, evals, samples and checkpoints.

``train(cfg, workdir)`` runs an :class:`~transformer_jax.train.config.ExperimentConfig`.
Everything a run produces lives in ``workdir``:

  config.json      the resolved run config (also stored inside every checkpoint)
  checkpoints/N/   orbax checkpoints: train state + config + data-iterator position
  metrics.jsonl    one JSON object per logged step ({"step", "loss", ...}) and per eval
  tb/              TensorBoard event files
  samples.txt      text generated at each eval
  loss.png         the loss curve, written at the end

Devices: ``cfg.parallelism`` ("jit": one jitted step sharded over the ``cfg.mesh`` of
data/fsdp/tensor axes; "pmap": replicated data parallelism) picks a
:class:`~transformer_jax.train.distributed.Placement`; with several processes (see
``distributed.initialize``) each reads its rows of every batch, process 0 alone writes the
files above, and all of them write the sharded checkpoints. Checkpoints hold global
arrays and are restored into the current run's shardings, so a run resumes on another
mesh, another device count or the other parallelism.

Reliability: SIGTERM/SIGINT finish the current step, save a checkpoint and stop; a
non-finite loss stops the run without saving the bad state; ``resume=True`` restores the
latest checkpoint, including the data position and dropout key, so the resumed run
computes exactly the losses the uninterrupted run would have.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..models import build_model, model_from_config
from ..tasks import Task, make_task
from .checkpoint import CheckpointManager
from .config import ExperimentConfig
from .distributed import (Placement, any_process, broadcast_json, gather_data_state, is_main,
                          local_data_state, main_first, make_placement)
from .monitor import MetricsWriter, peak_flops_per_device, plot_loss
from .optim import make_optimizer, make_schedule
from .step import create_train_state, eval_step, make_train_step

# Fields that must not change when resuming: they fix the model and the data stream.
_RESUME_FIXED = ("task", "task_options", "model", "model_preset", "dataset", "tokenizer", "seq_len",
                 "batch_size", "seed")


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
        raise ValueError(f"model.vocab_size={overrides['vocab_size']} is smaller than the "
                         f"tokenizer's vocabulary ({vocab})")
    for key, value in task_overrides.items():
        overrides.setdefault(key, value)
    model_cfg, model = build_model(cfg.model, cfg.model_preset, overrides)
    max_len = getattr(model_cfg, "max_len", None)
    if max_len is not None and cfg.seq_len > max_len:
        raise ValueError(f"seq_len={cfg.seq_len} exceeds the model's max_len={max_len}; "
                         f"lower seq_len or set model.max_len>={cfg.seq_len}")
    return model_cfg, model


def make_tx(cfg: ExperimentConfig, model_cfg):
    schedule = make_schedule(cfg.schedule, **cfg.schedule_kwargs(model_cfg.d_model))
    tx = make_optimizer(schedule=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)
    return tx, schedule


def evaluate(params, apply_fn, task: Task, eval_fn=None, model=None, *,
             placement: Placement | None = None, local_params=None) -> dict[str, float]:
    """Per-weight means over the first ``eval_batches`` eval batches, plus the task's extras.

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
    totals: dict[str, float] = {}
    batches = iter(task.eval_batches(index, count))
    for _ in range(cfg.eval_batches):
        batch = next(batches, None)
        if any_process(batch is None) if multi else batch is None:
            break
        for k, v in eval_fn(params, batch).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    weight = totals.pop("weight", 0.0)
    if weight <= 0:
        raise ValueError(f"the eval split {cfg.eval_split!r} of {cfg.dataset!r} gave no tokens to score")
    out = {f"eval_{'accuracy' if k == 'correct' else k}": v / weight for k, v in totals.items()}
    out["eval_ppl"] = math.exp(min(out["eval_loss"], 50.0))
    out["eval_tokens"] = weight
    if model is not None:
        local_params = params if local_params is None else local_params
        extras = task.extra_eval(model, local_params) if (is_main() or not multi) else None
        if multi:
            extras = broadcast_json(extras)
        out.update({f"eval_{k}": v for k, v in extras.items()})
    return out


def _check_resume_compatible(saved: dict, run_config: dict) -> None:
    problems = []
    if saved.get("model") != run_config["model"]:
        diff = {k: (saved.get("model", {}).get(k), v) for k, v in run_config["model"].items()
                if saved.get("model", {}).get(k) != v}
        problems.append(f"model config differs (field: (checkpoint, now)) {diff}")
    for key in _RESUME_FIXED:
        a, b = saved.get("experiment", {}).get(key), run_config["experiment"].get(key)
        if a != b:
            problems.append(f"{key}: checkpoint has {a!r}, config has {b!r}")
    if problems:
        raise ValueError("the checkpoint in this workdir does not match the config: "
                         + "; ".join(problems)
                         + ". Resume with the original config, or start in a new --workdir.")


# ----------------------------------------------------------------------------- loop

def train(cfg: ExperimentConfig, workdir: str | Path, *, resume: bool = False,
          progress: bool = True) -> dict[str, Any]:
    """Train (or resume) a run; returns a summary dict. See the module docstring."""
    workdir = Path(workdir)
    placement = make_placement(cfg.parallelism, cfg.mesh, cfg.batch_size, cfg.accum_steps)
    multi = jax.process_count() > 1
    # with several processes, process 0 prepares first (tokenizer, dataset), the others reuse it
    task = main_first(lambda: make_task(cfg, workdir), "transformer_jax:task")
    model_cfg, model = build(cfg, task.model_overrides())
    tx, schedule = make_tx(cfg, model_cfg)
    run_config = {"experiment": cfg.to_dict(), "family": cfg.model, "model": model_cfg.to_dict(),
                  "task": cfg.task, "task_spec": task.spec()}

    ckpt = CheckpointManager(workdir / "checkpoints", save_every=cfg.save_every, keep=cfg.keep)
    latest = ckpt.latest_step()
    if latest is not None and not resume:
        ckpt.close()
        raise ValueError(f"{workdir} already holds checkpoints (latest step {latest}); pass "
                         "--resume to continue that run, or choose another --workdir")
    main = is_main()
    if main:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "config.json").write_text(json.dumps(run_config, indent=2) + "\n")

    train_it = main_first(lambda: task.train_iterator(placement.data_index, placement.data_count),
                          "transformer_jax:data")
    rng = jax.random.PRNGKey(cfg.seed)
    init_args = task.init_args()
    create_state = lambda: create_train_state(model, tx, rng, *init_args)  # noqa: E731
    placement.setup(create_state, lambda: model.init(rng, *init_args))
    if main and placement.notes and progress:
        print(f"{placement.describe()}; replicated (indivisible) parameter dims:\n  "
              + "\n  ".join(placement.notes[:8])
              + (f"\n  ... and {len(placement.notes) - 8} more" if len(placement.notes) > 8 else ""),
              flush=True)
    if latest is not None:
        _check_resume_compatible(ckpt.restore_config(), run_config)
        # Restore straight into *this* run's shardings: a checkpoint moves between meshes.
        state, _, data_state = ckpt.restore(target=placement.restore_target())
        state = placement.from_checkpoint(state)
        train_it.set_state(local_data_state(data_state))
        start = placement.step_of(state)
    else:
        state = placement.init_state(create_state, tx, task.init_params)
        start = 0

    train_step = placement.compile(make_train_step(
        loss_fn=task.loss_fn, label_smoothing=cfg.label_smoothing, accum_steps=cfg.accum_steps,
        schedule=schedule, axis_name=placement.axis_name))
    eval_fn = placement.eval_fn(lambda p, b: eval_step(p, b, model.apply, task.loss_fn))
    writer = MetricsWriter(workdir, resume_step=start if latest is not None else None, enabled=main)
    peak, peak_source = peak_flops_per_device()
    flops_per_step = task.flops_per_step(model_cfg)
    tokens_per_step = task.tokens_per_step()
    peak_total = peak * jax.device_count()

    summary: dict[str, Any] = {"workdir": str(workdir), "start_step": start, "interrupted": None,
                               "peak_flops": peak, "peak_source": peak_source,
                               "parallelism": placement.parallelism,
                               "mesh": dict(placement.mesh.shape), "processes": jax.process_count()}
    last_loss = eval_row = None
    stop = _StopRequest()
    bar = None
    if progress and main:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=start, desc=cfg.name, dynamic_ncols=True, mininterval=1.0)
    t_start = time.perf_counter()
    t_log, steps_since_log = time.perf_counter(), 0
    step = start

    def save(step, metrics, force):
        # every process takes part (sharded arrays, gathered data positions)
        if force or ckpt.should_save(step):
            data_state = gather_data_state(train_it.get_state()) if multi else train_it.get_state()
            ckpt.maybe_save(step, placement.to_checkpoint(state), config=run_config,
                            data_state=data_state, metrics=metrics, force=force)

    try:
        with stop.installed():
            while step < cfg.steps:
                batch = next(train_it)
                state, metrics = train_step(state, batch)
                step += 1
                steps_since_log += 1
                loss = float(metrics["loss"])
                if not math.isfinite(loss):
                    ckpt.wait()
                    good = ckpt.latest_step()
                    raise NonFiniteLossError(
                        f"loss became {loss} at step {step}; the run stopped without saving this "
                        f"state. The last good checkpoint is step {good} in {workdir / 'checkpoints'}"
                        " — lower learning_rate or clip_norm and resume with --resume.")
                last_loss = loss
                if step == start + 1:   # the first step compiles: keep it out of tokens/s
                    t_log, steps_since_log = time.perf_counter(), 0
                log_now = step % cfg.log_every == 0 or step == cfg.steps
                if log_now:
                    dt = time.perf_counter() - t_log
                    row = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    if steps_since_log:
                        tok_s = steps_since_log * tokens_per_step / dt
                        row.update(tokens_per_s=tok_s, mfu=steps_since_log * flops_per_step / dt / peak_total)
                    row["elapsed_s"] = time.perf_counter() - t_start
                    writer.write(step, row)
                    if bar is not None and "mfu" in row:
                        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                                        mfu=f"{row['mfu']:.0%}")
                    t_log, steps_since_log = time.perf_counter(), 0
                if bar is not None:
                    bar.update(1)
                eval_metrics = None
                if step % cfg.eval_every == 0 or step == cfg.steps:
                    local = placement.local_params(state)   # a collective with several processes
                    eval_metrics = evaluate(placement.eval_params(state), model.apply, task, eval_fn,
                                            model, placement=placement, local_params=local)
                    eval_row = eval_metrics
                    writer.write(step, eval_metrics)
                    text = task.sample(model, local, step) if main else None
                    if text is not None:
                        with (workdir / "samples.txt").open("a") as f:
                            f.write(f"=== step {step} (eval loss {eval_metrics['eval_loss']:.3f})\n{text}\n")
                        writer.text("sample", step, text)
                    del local
                    t_log = time.perf_counter()  # evals don't count against tokens/s
                save(step, eval_metrics, force=step == cfg.steps)
                # A signal may reach only some processes: they agree at each log step.
                stopping = (any_process(stop.signal is not None) if log_now else False) if multi \
                    else stop.signal is not None
                if stopping:
                    save(step, eval_metrics, force=True)
                    summary["interrupted"] = signal.Signals(stop.signal or signal.SIGTERM).name
                    break
    finally:
        if bar is not None:
            bar.close()
        ckpt.close()   # waits for pending async saves
        writer.close()
    summary.update(final_step=step, loss=last_loss, seconds=time.perf_counter() - t_start,
                   **(eval_row or {}))
    if main:
        png = plot_loss(workdir)
        summary["loss_png"] = str(png) if png else None
    return summary


# ----------------------------------------------------------------------------- workdir tools

def load_run(workdir: str | Path, step: int | None = None):
    """Rebuild ``(run_config, model, params, task)`` from a workdir alone."""
    workdir = Path(workdir)
    ckpt_dir = workdir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise ValueError(f"{workdir} has no checkpoints/ directory; train into it first")
    mgr = CheckpointManager(ckpt_dir, read_only=True)
    try:
        if mgr.latest_step() is None:
            raise ValueError(f"{ckpt_dir} holds no complete checkpoint")
        run_config = mgr.restore_config(step)
        _, model = model_from_config(run_config["family"], run_config["model"])
        state, _, _ = mgr.restore(step)
    finally:
        mgr.close()
    params = jax.tree_util.tree_map(jnp.asarray, state["params"])
    cfg = ExperimentConfig.from_dict(run_config["experiment"])
    task = make_task(cfg, workdir, spec=run_config["task_spec"])
    return run_config, model, params, task


def evaluate_workdir(workdir: str | Path, *, batches: int | None = None) -> dict[str, float]:
    _, model, params, task = load_run(workdir)
    if batches:
        task.cfg = task.cfg.replace(eval_batches=batches)
    return evaluate(params, model.apply, task, model=model)
