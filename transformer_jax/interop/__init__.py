"""Converters between transformer_jax and PyTorch / Hugging Face models.

The public functions are loaded lazily, on first attribute access, so ``import
transformer_jax.interop`` costs nothing and imports neither torch nor transformers:

  * ``from_torch``, ``to_torch_state_dict`` (:mod:`transformer_jax.interop.torch`): the
    tutorial modules and ``torch.nn``'s Transformer modules, both ways;
  * ``from_hf``, ``to_hf``, ``to_hf_numpy``, ``hf_config`` (:mod:`transformer_jax.interop.hf`):
    Hugging Face GPT-2, Llama, Mistral, BERT, T5, ViT and CLIP, dispatching on the HF
    ``model_type`` (one module per family under ``hf/``, over ``hf/registry.py`` and the
    shared ``common``);
  * ``to_peft``, ``load_peft`` (:mod:`transformer_jax.interop.peft`): LoRA adapters as
    Hugging Face PEFT adapter directories, both ways (``from_hf(..., adapter=dir)`` too).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "from_torch": "torch",
    "to_torch_state_dict": "torch",
    "from_hf": "hf",
    "to_hf": "hf",
    "to_hf_numpy": "hf",
    "hf_config": "hf",
    "to_peft": "peft",
    "load_peft": "peft",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    value = getattr(module, name)
    globals()[name] = value          # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
