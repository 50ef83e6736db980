"""Converters between transformer_jax and PyTorch / Hugging Face models.

The public functions are loaded lazily, on first attribute access, so ``import
transformer_jax.interop`` costs nothing and imports neither torch nor transformers:

  * ``from_torch``, ``to_torch_state_dict`` (:mod:`transformer_jax.interop.torch`): PyTorch
    modules both ways -- ``torch.nn``'s Transformer modules (``MultiheadAttention``,
    ``TransformerEncoderLayer`` ... ``Transformer``) and the tutorial's PyTorch modules
    (attention, blocks, embeddings, the whole Transformer, BERT, GPT);
  * ``from_hf``, ``to_hf``, ``to_hf_numpy``, ``hf_config`` (:mod:`transformer_jax.interop.hf`):
    Hugging Face GPT-2, Llama, Mistral, BERT, T5, ViT and CLIP, dispatching on the HF
    ``model_type``;
  * ``to_peft``, ``load_peft`` (:mod:`transformer_jax.interop.peft`): LoRA adapters as
    Hugging Face PEFT adapter directories, both ways (``from_hf(..., adapter=dir)`` too).

Layout::

    torch.py        from_torch, to_torch_state_dict: torch.nn's built-ins first, then the
                    tutorial's modules
    torch_nn/       torch.nn's Transformer modules: convert.py (converters and the torch
                    readers both kinds share), modules.py (the Flax mirrors)
    tutorial/       the tutorial's PyTorch modules: convert.py (the rules, in the order they
                    are tried, and the whole models), layers.py, detect.py, modules.py (mirrors)
    hf/             Hugging Face: convert.py (from_hf, to_hf, to_hf_numpy, hf_config),
                    registry.py, one module per family: gpt2.py, llama.py, mistral.py,
                    qwen2.py, qwen3.py, bert.py, t5.py, vit.py, clip.py
    peft/           PEFT adapter directories: lora.py (LoRA save/load), sites.py (which HF
                    module holds which Dense), prefix.py (prefix tuning)
    common.py       the key tables (TensorMap) and the checked state-dict reader every
                    converter uses
    torch_train.py  PyTorch twins of a training run (model, loss, AdamW groups, schedule) for
                    ``transformer-jax compare-torch``
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
