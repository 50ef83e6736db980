"""Resuming a run from its workdir: which checkpoint, whether it fits, what it restores.

A training run (``transformer_jax.run.setup``) asks this module, before it writes
anything, for the checkpoint it continues from (:func:`restore`): none for a fresh run; a
refusal when the workdir holds checkpoints and ``resume`` is off, or when the checkpoint
was saved by another config (the fields in ``_RESUME_FIXED`` and the model's); the latest
readable step otherwise (an unreadable one moves to ``<step>.corrupt``). ``--resume-from
STEP`` restores that step and moves the later ones to ``<step>.superseded``
(:func:`set_aside_newer`). :func:`resume_settings` gives the settings ``transformer-jax
train --resume`` starts from: the run's own ``config.json``. :class:`NothingToDo` says a
resumed run is already done.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
from jax.experimental.multihost_utils import sync_global_devices

from .. import storage
from ..errors import UserError
from .checkpoint import CheckpointManager
from .config import ExperimentConfig
from .distributed import Placement, broadcast_json, is_main, warn

# Fields that must not change when resuming: they fix the model and the data stream.
_RESUME_FIXED = ("task", "task_options", "model", "model_preset", "dataset", "tokenizer", "seq_len",
                 "batch_size", "seed")


class NothingToDo(Exception):
    """``--resume`` of a run whose checkpoint is already at (or past) ``cfg.steps``."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


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


def check_resume_compatible(saved: dict, run_config: dict) -> None:
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


def write_config(workdir, run_config: dict) -> None:
    storage.makedirs(workdir)
    storage.write_text(workdir / "config.json", json.dumps(run_config, indent=2) + "\n")


def resume_settings(cfg: ExperimentConfig, workdir: str | Path, *,
                    experiment: str | None = None) -> ExperimentConfig:
    """The settings ``transformer-jax train --resume`` starts from: every field of the run's
    ``config.json`` (learning rate, schedule, warm-up, batch, model, tokenizer, init-from,
    ...), on which ``--set`` and ``--steps`` then apply; ``cfg`` (the experiment's) when the
    workdir holds no run config. ``experiment``: the ``--experiment`` given, which must be
    the run's own (by its config name). With several processes, process 0 reads the file."""
    workdir = storage.path(workdir)
    saved = saved_run_config(workdir) if is_main() else None
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


def saved_run_config(workdir) -> dict | None:
    """The run config a workdir's earlier run wrote (config.json), or None."""
    path = workdir / "config.json"
    if not storage.is_file(path):
        return None
    try:
        return json.loads(storage.read_text(path))
    except ValueError:
        return None


def restore(workdir: Path, placement: Placement, run_config: dict, resume: bool,
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
                warn(f"--resume: {workdir} holds no checkpoint, so this run starts from step 0 "
                      "(check the --workdir if you meant to continue a run)")
            return None
        if not resume:
            raise UserError(f"{workdir} already holds checkpoints (latest step {steps[-1]}); pass "
                            "--resume to continue that run, or choose another --workdir")
        step, state, _, data_state = reader.restore_readable(
            resume_from, target=placement.restore_target(),
            check_config=lambda saved: check_resume_compatible(saved, run_config),
            set_aside=is_main(), warn=warn)
    finally:
        if reader is not None:
            reader.close()
    if jax.process_count() > 1:   # process 0 may have moved unreadable steps aside
        sync_global_devices("transformer_jax:restored")
    return step, state, data_state


def set_aside_newer(workdir: Path, step: int) -> None:
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
            warn(f"--resume-from {step}: moved the later checkpoints aside: {', '.join(moved)}")
    if jax.process_count() > 1:
        sync_global_devices("transformer_jax:set_aside")
