"""Model families. Each family is one file: config + presets + linen module."""
from __future__ import annotations

from typing import Any

from ..errors import UserError
from .base import PresetConfig
from .bert import Bert, BertConfig
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
           "T5", "T5Config", "Transformer", "TransformerConfig"]
