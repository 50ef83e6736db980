"""Hugging Face Mistral (``MistralForCausalLM``, ``MistralModel``) <-> :class:`~transformer_jax.models.gpt.GPT`.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="mistral"``). A Mistral
checkpoint is a Llama checkpoint (:mod:`~transformer_jax.interop.hf.llama`: the same keys,
shapes, RoPE, RMSNorm, SwiGLU and grouped-query attention; its tensor table and config
mapping are reused here) plus a causal sliding window: HF's ``sliding_window`` W lets query
i see keys j with ``i - W < j <= i`` (``masking_utils``' ``kv_idx > q_idx - sliding_window``),
which is our ``GPTConfig.attention_window`` (``sliding_window: null`` -> ``None``, full
attention). Decoding with a window keeps a ring of W cache slots.

Differences from Llama the converter handles:
  * HF's defaults for keys a ``config.json`` leaves out are ``MistralConfig``'s
    (:data:`MISTRAL_HF_DEFAULTS`: 8 key/value heads, MLP 14336, 131072 positions,
    ``sliding_window`` 4096);
  * ``MistralForCausalLM`` has no ``attention_bias``/``mlp_bias``/``pretraining_tp``
    options (it ignores them, and so does the converter);
  * ``layer_types`` (Ministral's alternating full/sliding layers) is ignored by
    ``MistralForCausalLM``, which windows every layer: a uniform list is accepted, a mixed
    one refused by name (our GPT has one window for every layer).

``to_hf``/``hf_config`` pick this family for a ``GPTConfig`` with Llama's settings and an
``attention_window`` and no q/k/v biases or q/k norms (:func:`is_mistral_config`); without
a window it stays a Llama. As for Llama, a ``head_dim`` other than D / N (Mistral-Nemo)
becomes ``GPTConfig.head_size``, ``llama3`` and ``linear`` RoPE scaling convert (both
directions), and anything else the GPT cannot express (``yarn`` scaling, ...) raises
``UserError`` naming the option.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...errors import UserError
from ...models.gpt import GPT, GPTConfig
from .gpt2 import causal_lm_from_state_dict, causal_lm_to_state_dict
from .llama import (LLAMA_HF_DEFAULTS, check_llama_layout, has_attention_extras,
                    has_llama_layout, llama_layout_config_from_hf, llama_layout_hf_values,
                    llama_tensor_maps, take_rope_buffers)
from .registry import HFFamily

#: ``transformers.MistralConfig``'s defaults where they differ from LlamaConfig's.
MISTRAL_HF_DEFAULTS: dict[str, Any] = {
    **LLAMA_HF_DEFAULTS, "intermediate_size": 14336, "num_key_value_heads": 8,
    "max_position_embeddings": 4096 * 32,
}
_DEFAULT_SLIDING_WINDOW = 4096

#: The table is Llama's (``interop.peft`` looks up ``<family>_tensor_maps``).
mistral_tensor_maps = llama_tensor_maps


# ============================================================================ config

def _sliding_window(config: Mapping[str, Any]) -> int | None:
    """``sliding_window`` (MistralConfig's default 4096 when absent; null: full attention);
    a mixed ``layer_types`` or a window that is not a positive integer raises, naming it."""
    layer_types = config.get("layer_types")
    if layer_types is not None and len(set(layer_types)) > 1:
        raise UserError(f"unsupported Mistral config option layer_types={list(layer_types)!r}: "
                        "transformer_jax's GPT has one attention window for every layer (and "
                        "MistralForCausalLM ignores layer_types); per-layer full/sliding "
                        "attention (Ministral) does not convert")
    window = config.get("sliding_window", _DEFAULT_SLIDING_WINDOW)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise UserError(f"unsupported Mistral config option sliding_window={window!r}: expected "
                        "a positive integer (the window W: each token sees itself and the "
                        "W - 1 before it) or null (full attention)")
    return window


def mistral_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """HF Mistral config (as a dict) -> ``GPTConfig`` (``attention_window`` =
    ``sliding_window``); unsupported options raise, naming them."""
    return llama_layout_config_from_hf(
        config, model_type="mistral", family="Mistral", defaults=MISTRAL_HF_DEFAULTS,
        fixed_options={}, settings={"attention_window": _sliding_window(config)},
        overrides=overrides)


def is_mistral_config(config: Any) -> bool:
    """Whether ``config`` is a ``GPTConfig`` that converts to a ``MistralConfig`` (dispatch):
    Llama's settings, no q/k/v biases or q/k norms (Qwen) and a sliding window."""
    return (has_llama_layout(config) and not has_attention_extras(config)
            and config.attention_window is not None)


def _check_mistral_compatible(config: GPTConfig) -> None:
    check_llama_layout(config, "Mistral", sliding_window=True)


def mistral_hf_config(config: GPTConfig, **extra: Any):
    """``GPTConfig`` -> ``transformers.MistralConfig`` (lazy import), ``sliding_window`` =
    ``attention_window`` (``None``: full attention); options Mistral lacks raise."""
    from transformers import MistralConfig

    _check_mistral_compatible(config)
    values = llama_layout_hf_values(config)
    values["sliding_window"] = config.attention_window
    values.update(extra)
    return MistralConfig(**values)


# ============================================================================ state dicts

def _mistral_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                             **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """Mistral state dict (``MistralForCausalLM`` or ``MistralModel`` naming) -> ``(GPT, params)``."""
    return causal_lm_from_state_dict(
        "Mistral", lambda **o: mistral_config_from_hf(config, **o), llama_tensor_maps,
        take_rope_buffers, state_dict, overrides, embed_key="embed_tokens.weight",
        prefix="model.")


def mistral_to_state_dict(module: GPT, params: Any) -> dict[str, np.ndarray]:
    """``(GPT, params)`` -> ``MistralForCausalLM`` state dict of numpy arrays (Llama's keys;
    see :func:`~transformer_jax.interop.hf.llama.llama_to_state_dict`)."""
    return causal_lm_to_state_dict(module, params, _check_mistral_compatible, llama_tensor_maps,
                                   "model.embed_tokens.weight")


FAMILY = HFFamily(
    name="mistral", model_types=("mistral",), config_type=GPTConfig,
    from_state_dict=_mistral_from_state_dict, to_state_dict=mistral_to_state_dict,
    make_hf_config=mistral_hf_config, matches=is_mistral_config)
