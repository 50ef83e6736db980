"""Hugging Face checkpoints <-> transformer_jax models, one module per family.

  * :mod:`~transformer_jax.interop.hf.convert`: the entry points ``from_hf``, ``to_hf``,
    ``to_hf_numpy``, ``hf_config`` (and ``from_hf_state_dict``), dispatching on the HF
    ``model_type`` (its docstring has the table of families and HF classes);
  * :mod:`~transformer_jax.interop.hf.registry`: ``HFFamily``, what a family module exports,
    and the registry the entry points read;
  * the families: :mod:`~transformer_jax.interop.hf.gpt2`, :mod:`~transformer_jax.interop.hf.llama`,
    :mod:`~transformer_jax.interop.hf.mistral` (Llama's layout plus a sliding window),
    :mod:`~transformer_jax.interop.hf.qwen2`, :mod:`~transformer_jax.interop.hf.qwen3` (Llama's
    layout plus q/k/v biases, or q/k norms),
    :mod:`~transformer_jax.interop.hf.gemma` (Gemma 3 text, a family of its own),
    :mod:`~transformer_jax.interop.hf.bert`, :mod:`~transformer_jax.interop.hf.t5`,
    :mod:`~transformer_jax.interop.hf.vit`, :mod:`~transformer_jax.interop.hf.clip`.

Importing this package imports every family module (numpy, jax, flax), never torch nor
transformers.
"""
from __future__ import annotations

from .convert import from_hf, from_hf_state_dict, hf_config, to_hf, to_hf_numpy

__all__ = ["from_hf", "from_hf_state_dict", "hf_config", "to_hf", "to_hf_numpy"]
