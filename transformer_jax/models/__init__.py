"""Model families. Each family is one file: config + presets + linen module.

Token ids are checked. Every entry point that takes ids (``GPT``, ``Bert``, ``T5`` and
``Transformer`` ``__call__``/``encode``/``decode``; ``CLIP`` ``__call__``/``encode_text``)
raises a ``UserError`` naming the first id outside the table, its position, how many
there are and the table's size when the ids are concrete (``model.apply`` outside ``jax.jit``)::

    input_ids[1, 7] = 50300 is outside the vocabulary [0, 50257) of GPTConfig.vocab_size
    (bad ids in input_ids: 1 of 16); token ids must come from the tokenizer ...

(BERT's ``token_type_ids`` against ``type_vocab_size`` and learned ``position_ids`` against
``max_len`` likewise). Under ``jax.jit`` the ids are traced and nothing is checked: the
compiled program is exactly the unchecked one. To check jitted calls, wrap the function
in :func:`checked` (``jax.experimental.checkify``) before jitting it; it returns
``(error, out)`` and ``error.throw()`` raises the same message::

    err, logits = jax.jit(checked(model.apply))(variables, input_ids)
    err.throw()

:func:`check_id_range` is the host-side check (numpy) the data pipeline, ``generate`` and
the searches run before anything is compiled.
"""
from __future__ import annotations

from typing import Any

from ..errors import UserError
from .base import PresetConfig, check_id_range, check_id_values, checked
from .bert import Bert, BertConfig
from .clip import CLIP, CLIPConfig
from .gemma import Gemma, GemmaConfig
from .gpt import GPT, GPTConfig
from .t5 import T5, T5Config
from .transformer import Transformer, TransformerConfig
from .vit import ViT, ViTConfig

# family name -> (config class, module class); the training CLI builds models through this table.
FAMILIES: dict[str, tuple[type, type]] = {
    "gpt": (GPTConfig, GPT),
    "bert": (BertConfig, Bert),
    "vit": (ViTConfig, ViT),
    "t5": (T5Config, T5),
    "transformer": (TransformerConfig, Transformer),
    "clip": (CLIPConfig, CLIP),
    "gemma": (GemmaConfig, Gemma),
}


def build_model(family: str, preset: str, overrides: dict[str, Any] | None = None):
    """``(config, module)`` for a family, a named preset and field overrides."""
    if family not in FAMILIES:
        raise UserError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    config_cls, module_cls = FAMILIES[family]
    config = config_cls.preset(preset, **(overrides or {}))
    return config, module_cls(config)


def model_from_config(family: str, config: dict[str, Any]):
    """Rebuild ``(config, module)`` from a saved ``config.to_dict()``."""
    if family not in FAMILIES:
        raise UserError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    config_cls, module_cls = FAMILIES[family]
    cfg = config_cls.from_dict(config)
    return cfg, module_cls(cfg)


__all__ = ["FAMILIES", "GPT", "GPTConfig", "PresetConfig", "build_model", "model_from_config",
           "ViT", "ViTConfig", "Bert", "BertConfig",
           "T5", "T5Config", "Transformer", "TransformerConfig", "CLIP", "CLIPConfig",
           "Gemma", "GemmaConfig",
           "check_id_range", "check_id_values", "checked"]
