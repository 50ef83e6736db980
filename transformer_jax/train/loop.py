"""The training loop: data -> compiled train step -> logs, evals, samples and checkpoints.

:func:`run_loop` steps a :class:`Run` that ``transformer_jax.run.setup`` built (the task,
the model, the placement, the restored or fresh state, the compiled step); the whole
route of a run is ``transformer_jax.run.train`` = ``setup`` + :func:`run_loop`. This
module takes the task as a value and never imports ``tasks/``. Everything a run produces
lives in ``workdir``:

  config.json      the resolved run config (also stored inside every checkpoint)
  checkpoints/N/   orbax checkpoints: train state + config + data-iterator position
  metrics.jsonl    one JSON object per logged step ({"step", "loss", ...}) and per eval
  tb/              TensorBoard event files
  samples.txt      text generated at each eval
  loss.png         the loss curve, written at the end
  wandb/           with ``log.wandb``: the W&B run's files, and ``run_id``, the W&B run a
                   resumed run continues (``train/wandb_log.py``)

Per step, :func:`run_loop` calls :func:`_advance` (the next batch, already on the devices,
through the compiled step: ``train/step.py``), :meth:`MetricsLog.record` (logging),
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
``resume=True`` restores the latest checkpoint (``train/resume.py``), including the data
position, the dropout key and the loss scale, so the resumed run computes exactly the
losses the uninterrupted run would have (``resume_from=STEP``: any kept checkpoint). A
step is saved only while the loss is healthy (finite, no spike: ``train/health.py``); a
non-finite loss stops the run and moves the checkpoints saved as the loss rose to
``<step>.diverged``, so that a resume starts from before the blow-up. An unreadable
checkpoint is moved to ``<step>.corrupt`` and the newest readable one restored. A run
that is refused (bad workdir, checkpoint of another config, nothing left to do) writes
nothing.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import storage
from ..errors import UserError
from ..losses import metric_names
from .checkpoint import CheckpointManager
from .config import ExperimentConfig
from .distributed import Placement, any_process, broadcast_json, gather_data_state, is_main, warn
from .health import LossWatch, last_good_step
from .monitor import MetricsWriter, plot_loss
from .step import eval_step

if TYPE_CHECKING:   # the loop takes a task as a value; tasks/ sits above train/
    from ..tasks import Task

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
    for metric, name in task.PERPLEXITY.items():   # only the token cross-entropies the task names
        out[f"eval_{name}"] = math.exp(min(out[f"eval_{metric}"], 50.0))
    out["eval_tokens"] = weight
    if model is not None:
        local_params = params if local_params is None else local_params
        extras = task.extra_eval(model, local_params) if (is_main() or not multi) else None
        if multi:
            extras = broadcast_json(extras)
        out.update({f"eval_{k}": v for k, v in extras.items()})
    return out


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
            warn(f"step {step} not saved, nor any later step until the loss is healthy again: "
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


def run_loop(run: Run, *, progress: bool = True, on_log: LogCallback | None = None,
             on_eval: LogCallback | None = None, stop_at: int | None = None) -> dict[str, Any]:
    """Step ``run`` to ``run.cfg.steps`` (or ``stop_at``); returns the run's summary dict.

    ``transformer_jax.run.train`` builds the run and calls this; the arguments are its
    (see there and the module docstring). The checkpoints and the metrics files are closed
    on the way out, whatever stops the loop.
    """
    cfg = run.cfg
    bar = log = png = None
    step, eval_row, stop, done = run.start, None, _StopRequest(), False
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
        if run.main:
            run.writer.flush()            # the plot reads metrics.jsonl
            png = plot_loss(run.workdir)
            run.writer.image("loss_curve", png)
        done = True
    finally:
        if bar is not None:
            bar.close()
        run.ckpt.close()   # waits for pending async saves
        run.writer.close(failed=not done)
    summary.update(final_step=step, loss=log.last_loss, seconds=time.perf_counter() - log.t_start,
                   **(eval_row or {}))
    if run.main:
        summary["loss_png"] = str(png) if png else None
    return summary
