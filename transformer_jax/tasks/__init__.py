"""Tasks: data + loss for each kind of training run, chosen by ``ExperimentConfig.task``.

  lm   next-token language modelling (GPT)
  image_classification   images -> classes, accuracy (ViT)
  mlm   masked-LM pretraining, 80/10/10 masking (BERT)
  pretrain   BERT pretraining: masked LM + next-sentence prediction on line-chunk pairs
  classify   sequence classification: stdlib line roles, glue/sst2 (BERT)
  seq2seq   text -> text, exact match by decoding: stdlib identifiers, wmt14 (T5, Transformer)
  contrastive   image-caption pairs, CLIP's symmetric loss, zero-shot accuracy (CLIP)

Each task module registers itself; importing this package registers them all.
"""
from .base import TASKS, Task, check_data, make_task, register_task, tasks_for
from . import lm  # noqa: F401  (registers "lm")
from . import image_classification  # noqa: F401,E402  (registers "image_classification")
from . import classify, mlm  # noqa: F401,E402  (registers "classify", "mlm")
from . import seq2seq  # noqa: F401,E402  (registers "seq2seq")
from . import contrastive  # noqa: F401,E402  (registers "contrastive")
from . import pretrain  # noqa: F401,E402  (registers "pretrain")

__all__ = ["TASKS", "Task", "check_data", "make_task", "register_task", "tasks_for"]
