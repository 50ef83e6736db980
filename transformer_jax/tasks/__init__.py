"""Tasks: data + loss for each kind of training run, chosen by ``ExperimentConfig.task``.

  lm   next-token language modelling (GPT)

Each task module registers itself; importing this package registers them all.
"""
from .base import TASKS, Task, make_task, register_task
from . import lm  # noqa: F401  (registers "lm")

__all__ = ["TASKS", "Task", "make_task", "register_task"]
