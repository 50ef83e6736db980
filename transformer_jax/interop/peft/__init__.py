"""Hugging Face PEFT adapter directories <-> this library's parameter-efficient fine-tuning.

  * :mod:`~transformer_jax.interop.peft.lora`: LoRA adapters (``layers/lora.py``) as PEFT
    LoRA adapter directories, both ways: ``to_peft``, ``load_peft`` (``from_hf(...,
    adapter=dir)`` too); its docstring has the tensor layout, packed sites and ranks;
  * :mod:`~transformer_jax.interop.peft.sites`: which Hugging Face module holds which of our
    Dense layers (the LoRA sites), read off each family's key table;
  * :mod:`~transformer_jax.interop.peft.prefix`: a GPT's prefix-tuning parameters
    (``GPTConfig.prefix_tokens``) as PEFT ``PREFIX_TUNING`` directories: ``prefix_to_peft``,
    ``prefix_from_peft``.

Torch is never imported.
"""
from __future__ import annotations

from .lora import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, KEY_PREFIX, add_adapters, load_peft,
                   peft_adapter, read_adapter, to_peft)
from .prefix import prefix_from_peft, prefix_to_peft
from .sites import lora_sites, tensor_maps

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "KEY_PREFIX", "add_adapters", "load_peft",
           "lora_sites", "peft_adapter", "prefix_from_peft", "prefix_to_peft", "read_adapter",
           "tensor_maps", "to_peft"]
