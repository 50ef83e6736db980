"""Tasks: data + loss for each kind of training run, chosen by ``ExperimentConfig.task``.

  lm                     next-token language modelling (GPT)
  image_classification   images -> classes, accuracy (ViT)
  mlm                    masked-LM pretraining, 80/10/10 masking (BERT)
  classify               sequence classification: stdlib line roles, glue/sst2 (BERT)

Each task module registers itself; importing this package registers them all.
"""
from .base import TASKS, Task, make_task, register_task
from . import lm  # noqa: F401  (registers "lm")
from . import image_classification  # noqa: F401,E402  (registers "image_classification")
from . import classify, mlm  # noqa: F401,E402  (registers "classify", "mlm")

__all__ = ["TASKS", "Task", "make_task", "register_task"]
