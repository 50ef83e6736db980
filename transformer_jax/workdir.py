"""Reading a finished (or paused) run back from its workdir.

:func:`load_run` rebuilds ``(run_config, model, params, task)`` from a workdir alone,
:func:`run_costs` says what the run costs (parameters, tokens and FLOPs per step) and
:func:`evaluate_workdir` evaluates its latest checkpoint. :func:`load_params` (the run
config and parameters only, no task) lives in ``train/checkpoint.py`` and is re-exported
here: tasks use it from there, below them.

These build the run's task, so this module sits above ``tasks/`` (with
``transformer_jax.run``), and ``train/`` never imports it.
"""
from __future__ import annotations

import json
from pathlib import Path

from . import storage
from .models import model_from_config
from .tasks import make_task
from .train.checkpoint import load_params
from .train.config import ExperimentConfig
from .train.loop import evaluate

__all__ = ["evaluate_workdir", "load_params", "load_run", "run_costs"]


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
    """The eval metrics of the run's latest checkpoint (``batches``: eval batches instead of
    the run's ``eval_batches``)."""
    _, model, params, task = load_run(workdir)
    if batches:
        task.cfg = task.cfg.replace(eval_batches=batches)
    return evaluate(params, model.apply, task, model=model)
