"""Checkpointing: one wrapper around ``orbax.checkpoint.CheckpointManager``.

The directory may be local or in a bucket (``gs://...``); paths come from
:mod:`transformer_jax.storage`, which also points orbax's tensorstore at a GCS emulator.
The errors a failed save or restore raises, and the diagnosis of a broken step, are in
``train/checkpoint_errors.py``; which orbax log records are hidden, in
``train/orbax_logs.py``. :func:`load_params` and :func:`read_config` read a finished run
(``transformer_jax/workdir.py`` rebuilds its model and task on top of them).

A checkpoint *step* is a single orbax composite checkpoint with three items:

``state``
    The train state: any pytree of arrays (a ``flax.training.TrainState``, a
    dict of params and optimizer state, ...), written with orbax's
    ``StandardSave`` (tensorstore; every dtype incl. bfloat16, sharded arrays).
``config``
    The model/run configuration as a JSON dict, so that a tool can rebuild the
    model from a work directory alone (see :func:`read_config`).
``data``
    The data-iterator position as a JSON dict (e.g. epoch, example offset,
    RNG seed), so that training resumes on the exact next batch.

Orbax also stores the optional eval ``metrics`` next to them; they drive the
"keep the best checkpoint" policy and survive restarts.

Guarantees relied on (verified by ``tests/train/test_checkpoint.py``):

* **Atomic saves.** Orbax writes a step into
  ``<step>.orbax-checkpoint-tmp/`` and renames it to ``<step>/``
  only once everything, including the commit marker, is on disk. Steps are
  discovered by their final names only, so a process killed mid-save leaves the
  previous checkpoints intact and :meth:`CheckpointManager.latest_step` /
  :meth:`CheckpointManager.restore` never see the incomplete one. A writing
  manager deletes such leftover temporary directories when it is created; a
  ``read_only`` manager leaves them alone (they may belong to a live writer).
* **Async by default.** :meth:`CheckpointManager.maybe_save` returns once the
  arrays have been copied off the accelerator; files are written by a
  background thread. :meth:`CheckpointManager.wait` (and ``close()``, and
  leaving a ``with`` block) block until the checkpoint is committed.
* **Retention.** The last ``keep`` steps are kept, plus (``keep_best``) the
  step with the lowest ``metrics[best_metric]``; everything else is deleted
  after each successful save.
* **Fallback.** :meth:`CheckpointManager.restore_readable` restores the newest
  step that reads: a step with a broken file (array data, metadata, the
  data-iterator state, the config) is reported in one line naming the step and
  the file, and optionally moved aside to ``<step>.corrupt`` (orbax lists only
  integer-named directories, so moved steps are kept but never restored).
* **Failed saves.** A save that cannot be written (a full or read-only disk)
  raises :class:`CheckpointWriteError` naming the path and the OS error; orbax
  has then written only ``<step>.orbax-checkpoint-tmp``, so the previous
  checkpoint is intact and is what ``--resume`` restores.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import sys
from typing import Any, Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocp_policies

from .. import storage
from ..errors import UserError
from .checkpoint_errors import (CheckpointWriteError, UnreadableCheckpoint, describe_unreadable,
                                os_reason)
from .orbax_logs import hide_read_only_notices

__all__ = ["CheckpointManager", "CheckpointWriteError", "UnreadableCheckpoint", "describe_unreadable",
           "read_config", "load_params"]

logger = logging.getLogger(__name__)

_STATE, _CONFIG, _DATA = "state", "config", "data"


hide_read_only_notices()


def _json_default(obj: Any) -> Any:
    """``json.dumps`` fallback for numpy/JAX scalars and arrays, paths, dataclasses."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (np.ndarray, jax.Array)):
        return np.asarray(obj).tolist()
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def _to_json(obj: Any, what: str) -> dict:
    """Returns a plain-JSON deep copy of the dict ``obj``.

    Copying up front (instead of letting orbax serialise ``obj`` later on its
    background thread) reports errors at the call site and makes the saved
    value independent of later mutations by the caller.
    """
    if not isinstance(obj, dict):
        raise TypeError(f"{what} must be a dict, got {type(obj).__name__}")
    try:
        return json.loads(json.dumps(obj, default=_json_default))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable: {e}") from None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _as_path(directory: os.PathLike | str) -> epath.Path:
    """``epath.Path`` for ``directory`` from the storage layer (local made absolute, gs:// kept)."""
    return storage.path(directory)


class CheckpointManager:
    """Periodic, atomic, (by default) asynchronous checkpoints of a training run.

    Example::

        with CheckpointManager(workdir / "checkpoints", save_every=1000) as ckpt:
            if ckpt.latest_step() is not None:
                state, config, data_state = ckpt.restore(target=state)
            for step in range(start, num_steps + 1):
                state = train_step(state, batch)
                ckpt.maybe_save(step, state, config=config,
                                data_state=loader.state(),
                                metrics={"eval_loss": eval_loss} if evaluated else None)
            ckpt.maybe_save(num_steps, state, config=config,
                            data_state=loader.state(), force=True)

    Args:
      directory: root directory; step ``N`` lives in ``directory/N``.
      save_every: :meth:`maybe_save` saves when ``step % save_every == 0``.
      keep: number of most recent steps to keep (``None`` keeps all).
      keep_best: additionally keep the step with the lowest
        ``metrics[best_metric]`` (lower is better). Steps saved without that
        metric, or with a non-finite value, never count as best.
      best_metric: name of the metric that ranks checkpoints.
      async_save: write checkpoints on a background thread.
      read_only: open an existing directory for reading only: saving raises,
        nothing is created or cleaned up. Use it to inspect the directory of a
        run that may still be writing to it.
    """

    def __init__(
        self,
        directory: os.PathLike | str,
        *,
        save_every: int = 1000,
        keep: Optional[int] = 3,
        keep_best: bool = True,
        best_metric: str = "eval_loss",
        async_save: bool = True,
        read_only: bool = False,
    ):
        if save_every < 1:
            raise UserError(f"save_every must be >= 1, got {save_every}")
        if keep is not None and keep < 1:
            raise UserError(f"keep must be >= 1 or None, got {keep}")
        self._directory = _as_path(directory)
        self._save_every = int(save_every)
        self._keep = keep
        self._keep_best = keep_best
        self._best_metric = best_metric
        self._read_only = read_only
        self._pending: Optional[int] = None   # the step an async save is writing

        policies: list[Any] = [ocp_policies.LatestN(n=keep)]
        if keep_best:
            policies.append(
                ocp_policies.BestN(
                    get_metric_fn=self._metric_value,
                    reverse=True,  # sorted high -> low; BestN keeps the tail
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        options = ocp.CheckpointManagerOptions(
            # Orbax only writes/reads the per-step ``metrics`` item when a
            # ``best_fn`` is set, so set it even if metrics do not affect
            # retention (keep_best=False): they stay available via metrics().
            best_fn=self._metric_value,
            best_mode="min",
            preservation_policy=ocp_policies.AnyPreservationPolicy(policies),
            enable_async_checkpointing=async_save,
            # Saves are decided by ``maybe_save``; 0 also keeps orbax from
            # warning about the interval of read-only managers.
            save_interval_steps=0 if read_only else 1,
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self._manager = ocp.CheckpointManager(
            self._directory,
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _CONFIG: ocp.JsonCheckpointHandler(),
                _DATA: ocp.JsonCheckpointHandler(),
            },
            options=options,
        )

    # -- properties ----------------------------------------------------------

    @property
    def directory(self) -> epath.Path:
        """Root directory of the checkpoints."""
        return self._directory

    @property
    def save_every(self) -> int:
        return self._save_every

    # -- saving --------------------------------------------------------------

    def _metric_value(self, metrics: Any) -> float:
        """Ranking value of a step's metrics: lower is better, +inf if absent."""
        try:
            value = float(metrics[self._best_metric])
        except (KeyError, TypeError, ValueError):
            return math.inf
        return value if math.isfinite(value) else math.inf

    def should_save(self, step: int) -> bool:
        """Whether :meth:`maybe_save` (without ``force``) saves at ``step``."""
        return step % self._save_every == 0

    def maybe_save(
        self,
        step: int,
        state: Any,
        *,
        config: dict,
        data_state: dict,
        metrics: Optional[dict] = None,
        force: bool = False,
    ) -> bool:
        """Saves a checkpoint if ``step`` is a multiple of ``save_every`` or ``force``.

        ``state`` is saved as it is (NaNs included; deciding whether a
        diverged state is worth saving is the trainer's job). With
        ``async_save`` the call returns once device arrays have been copied to
        host memory; numpy arrays in ``state`` must not be modified in place
        until :meth:`wait` returns.

        Args:
          step: the training step (number of updates applied to ``state``).
          state: pytree of arrays to save.
          config: JSON-serialisable model/run configuration.
          data_state: JSON-serialisable data-iterator position.
          metrics: optional JSON-serialisable metrics, e.g.
            ``{"eval_loss": 2.1}``; ``metrics[best_metric]`` ranks checkpoints.
          force: save even if ``step`` is not a multiple of ``save_every``.

        Returns:
          True if a save was started; False if none was due, or ``step`` is
          already the latest checkpoint (e.g. a forced final save right after
          the periodic one).

        Raises:
          UserError: if ``step`` is older than the latest checkpoint.
          TypeError: if ``config``, ``data_state`` or ``metrics`` is not a
            JSON-serialisable dict.
          RuntimeError: on a ``read_only`` manager.
        """
        if self._read_only:
            raise RuntimeError(f"CheckpointManager({self._directory}) is read-only")
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                logger.info("Step %d is already checkpointed; not saving again.", step)
                return False
            raise UserError(
                f"Cannot save step {step}: {self._directory} already holds the "
                f"newer step {latest}. Resume from the latest step, or delete the "
                "newer checkpoints / use a fresh directory to branch off."
            )
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.StandardSave(state),
                _CONFIG: ocp.args.JsonSave(_to_json(config, "config")),
                _DATA: ocp.args.JsonSave(_to_json(data_state, "data_state")),
            }
        )
        saved = self._manager.save(
            step,
            args=args,
            # An empty dict rather than None: orbax warns on every save
            # without metrics; {} simply never ranks as best.
            metrics=_to_json({} if metrics is None else metrics, "metrics"),
            # The save decision is made above; orbax's own policy would also
            # save the very first step it sees.
            force=True,
        )
        if saved:
            self._pending = step
            logger.info("Started checkpoint save of step %d to %s", step, self._directory)
        return bool(saved)

    def _write_error(self, exc: BaseException) -> BaseException:
        """``exc`` from a background save as a :class:`CheckpointWriteError` when an OS error
        (a full or read-only disk, no permission) caused it; other errors stay as they are."""
        reason = os_reason(exc)
        if not any(os.strerror(code) == reason for code in storage.WRITE_ERRNOS):
            return exc
        step, self._pending = self._pending, None
        try:
            self._manager.reload()
            intact = [s for s in self.all_steps() if s != step]
        except Exception:  # noqa: BLE001 - the directory itself may be unreadable now
            intact = []
        kept = (f"the previous checkpoint, step {intact[-1]}, is intact: free space (or choose a "
                "--workdir on a disk with room) and continue with --resume" if intact else
                "no earlier checkpoint exists: free space (or choose another --workdir) and "
                "start again")
        return CheckpointWriteError(f"could not write the checkpoint of step {step} to "
                                    f"{self._directory} ({reason}); {kept}")

    # -- restoring -----------------------------------------------------------

    def _resolve_step(self, step: Optional[int]) -> int:
        # A step still being written asynchronously is listed already, but
        # cannot be read before it is committed.
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise UserError(f"No checkpoint found in {self._directory}; train into its "
                                "workdir first, or give the workdir of a run that saved one")
        elif step not in self.all_steps():
            raise UserError(
                f"No checkpoint for step {step} in {self._directory}; "
                f"available steps: {self.all_steps()}; pick one of them"
            )
        return int(step)

    def restore(
        self, step: Optional[int] = None, *, target: Any = None
    ) -> tuple[Any, dict, dict]:
        """Restores ``(state, config, data_state)`` of ``step`` (default: latest).

        Args:
          step: step to restore; ``None`` for the latest.
          target: optional pytree giving the structure, dtypes and placement
            of the result: concrete arrays, or abstract ones
            (``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape``). Leaves
            with a ``sharding`` are restored with that sharding; leaves
            without one get the sharding they were saved with. Custom pytree
            nodes (e.g. ``TrainState``) come back as the same type. Without a
            target the state comes back as nested dicts/lists, with arrays of
            the kind that was saved (jax arrays as ``jax.Array`` with the saved
            sharding - or on the first local device if that sharding does not
            exist on this host - numpy arrays as ``np.ndarray``, Python scalars
            as Python scalars).

        Raises:
          UserError: if there is no (such) checkpoint.
        """
        step = self._resolve_step(step)
        if target is None:
            state_args = ocp.args.StandardRestore(
                fallback_sharding=jax.sharding.SingleDeviceSharding(
                    jax.local_devices()[0]
                )
            )
        else:
            state_args = ocp.args.StandardRestore(target)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    _STATE: state_args,
                    _CONFIG: ocp.args.JsonRestore(),
                    _DATA: ocp.args.JsonRestore(),
                }
            ),
        )
        return restored[_STATE], restored[_CONFIG], restored[_DATA]

    def restore_readable(
        self,
        step: Optional[int] = None,
        *,
        target: Any = None,
        check_config: Optional[Callable[[dict], None]] = None,
        set_aside: bool = False,
        warn: Callable[[str], None] = _warn,
    ) -> tuple[int, Any, dict, dict]:
        """``(step, state, config, data_state)`` of the newest step that reads (or of ``step``).

        A step whose files do not read (see :func:`describe_unreadable`) is reported with
        one ``warn`` line naming the step and the file, moved to ``<step>.corrupt`` when
        ``set_aside``, and the next older step is tried. ``check_config(config)`` runs on
        each candidate's config before its state is read (it raises to refuse). With an
        explicit ``step`` nothing else is tried.

        Raises:
          UserError: no checkpoint, or the train state does not fit ``target``.
          UnreadableCheckpoint: no step reads.
        """
        self.wait()
        steps = [self._resolve_step(step)] if step is not None else self.all_steps()[::-1]
        if not steps:
            self._resolve_step(None)   # raises: no checkpoint
        failures = []
        for i, candidate in enumerate(steps):
            try:
                config = self.restore_config(candidate)
                if check_config is not None:
                    check_config(config)
                state, _, data_state = self.restore(candidate, target=target)
                return candidate, state, config, data_state
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - sorted into corruption, mismatch or bug
                reason = self._unreadable(candidate, e)
            failures.append(f"step {candidate} ({reason})")
            if step is not None:
                break
            moved = ""
            if set_aside:
                moved = f"; moved it to {self.set_aside(candidate, 'corrupt')}"
            following = (f"; restoring step {steps[i + 1]} instead" if i + 1 < len(steps)
                         else "")
            warn(f"checkpoint step {candidate} in {self._directory} is unreadable: {reason}"
                 f"{moved}{following}")
        if step is not None:
            raise UnreadableCheckpoint(
                f"checkpoint step {step} in {self._directory} is unreadable: {failures[0]}; "
                f"pick another step ({', '.join(map(str, self.all_steps()))})")
        raise UnreadableCheckpoint(
            f"no checkpoint in {self._directory} reads: {'; '.join(failures)}. The run cannot "
            "continue from them; start again in a new --workdir")

    def _unreadable(self, step: int, exc: Exception) -> str:
        """Why ``step`` failed to restore, when a broken file explains it; re-raises otherwise
        (a train state that does not fit the target is a UserError, anything else a bug)."""
        reason = describe_unreadable(self._directory / str(step), exc)
        if reason is not None:
            return reason
        if "tree structures do not match" in str(exc):
            raise UserError(
                f"the train state in checkpoint step {step} of {self._directory} does not fit "
                "this run's model and optimizer (their parameter trees differ, e.g. clip_norm "
                "or weight_decay switched on or off); resume with the config the run was "
                "started with, or start in a new --workdir") from exc
        raise exc

    def set_aside(self, step: int, suffix: str) -> epath.Path:
        """Renames step ``step`` to ``<step>.<suffix>`` (kept, but no longer a step orbax
        lists or restores) and returns the new path. Allowed on a ``read_only`` manager too:
        it is how a run that only reads so far moves a broken step out of its way."""
        self.wait()
        target = self._directory / f"{step}.{suffix}"
        n = 1
        while target.exists():
            target, n = self._directory / f"{step}.{suffix}{n}", n + 1
        (self._directory / str(step)).rename(target)
        self._manager.reload()
        return target

    def reload(self) -> None:
        """Re-reads the list of steps (after another process moved some aside)."""
        self._manager.reload()

    def restore_config(self, step: Optional[int] = None) -> dict:
        """The ``config`` dict of ``step`` (default: latest), without the state."""
        step = self._resolve_step(step)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()})
        )
        return restored[_CONFIG]

    # -- bookkeeping ---------------------------------------------------------

    def latest_step(self) -> Optional[int]:
        """Latest committed (or, with async saving, in-flight) step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """All retained steps, ascending."""
        return sorted(self._manager.all_steps())

    def metrics(self, step: int) -> Optional[dict]:
        """The metrics saved with ``step`` (``{}`` if saved without metrics)."""
        self.wait()
        return self._manager.metrics(step)

    def best_step(self) -> Optional[int]:
        """Retained step with the lowest finite ``metrics[best_metric]``, or None."""
        self.wait()
        best, best_value = None, math.inf
        for step in self.all_steps():
            value = self._metric_value(self._manager.metrics(step) or {})
            if value <= best_value and math.isfinite(value):
                best, best_value = step, value
        return best

    def wait(self) -> None:
        """Blocks until pending asynchronous saves (and deletions) are committed.

        Re-raises an error of a failed background save.
        """
        self._finishing(lambda: (self._manager.wait_until_finished(),
                                 self._manager.check_for_errors()))
        self._pending = None

    def close(self) -> None:
        """Waits for pending saves, then releases orbax's resources."""
        self._finishing(self._manager.close)

    def _finishing(self, finish: Callable[[], Any]) -> None:
        """``finish()``, with the OS error of a failed background save raised as a
        :class:`CheckpointWriteError` (other errors as they are)."""
        try:
            finish()
        except Exception as e:  # noqa: BLE001 - sorted by _write_error
            error = self._write_error(e)
            if error is e:
                raise
            raise error from e

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self._directory)!r}, save_every={self._save_every}, "
            f"keep={self._keep}, keep_best={self._keep_best}, "
            f"best_metric={self._best_metric!r}, read_only={self._read_only})"
        )


def read_config(directory: os.PathLike | str, step: Optional[int] = None) -> dict:
    """The ``config`` dict stored with the latest (or given) checkpoint.

    Lets tools rebuild the model from a work directory alone, before they know
    the structure of the train state. Opens the directory read-only, so it is
    safe to call while a training run is writing to it.

    Raises:
      UserError: if ``directory`` holds no (such) checkpoint.
    """
    manager = CheckpointManager(directory, read_only=True, async_save=False)
    try:
        return manager.restore_config(step)
    finally:
        manager.close()


def load_params(workdir: os.PathLike | str, step: Optional[int] = None) -> tuple[dict, Any]:
    """``(run_config, params)`` from the latest (or given) checkpoint of a training workdir.

    ``run_config`` is the dict the run stored with it (``family``, ``model``,
    ``experiment``, ``task_spec``); ``params`` are arrays on the first local device (a
    fine-tuning run's trainable and frozen parameters together). This is
    how tasks and tools read a finished run without importing the training loop. An
    unreadable latest step is reported in one warning line and the newest readable one is
    used; nothing in the workdir is moved.
    """
    ckpt_dir = _as_path(workdir) / "checkpoints"
    if not ckpt_dir.is_dir():
        raise UserError(f"{workdir} has no checkpoints/ directory; give the workdir of a "
                        "`transformer-jax train` run, or train into it first")
    manager = CheckpointManager(ckpt_dir, read_only=True)
    try:
        if manager.latest_step() is None:
            raise UserError(f"{ckpt_dir} holds no complete checkpoint; let the run save one "
                            "(it saves every save_every steps and at the end)")
        _, state, run_config, _ = manager.restore_readable(step)
    finally:
        manager.close()
    params = state["params"]
    if state.get("frozen"):          # a fine-tuning run's frozen base (train/step.py)
        from .step import combine
        params = combine(params, state["frozen"])
    return run_config, jax.tree_util.tree_map(jax.numpy.asarray, params)
