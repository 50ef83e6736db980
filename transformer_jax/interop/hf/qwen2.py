"""Hugging Face Qwen 2 / 2.5 (``Qwen2ForCausalLM``, ``Qwen2Model``) <-> :class:`~transformer_jax.models.gpt.GPT`.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="qwen2"``). A Qwen 2 block is
a Llama block (:mod:`~transformer_jax.interop.hf.llama`: RoPE, RMSNorm, SwiGLU, grouped-query
attention, no other biases) whose query, key and value projections have biases: our GPT
with ``qkv_bias=True`` (the ``qwen2.5-*`` presets of ``GPTConfig``). Llama's config mapping
and tensor table convert it; the table's optional entries add

    HF key (after the optional ``model.`` prefix)   shape      flax path, shape
    layers.{i}.self_attn.q_proj.bias                (N H,)     h_{i}/self_attn/query/bias (N, H)
    layers.{i}.self_attn.{k,v}_proj.bias            (K H,)     h_{i}/self_attn/{key,value}/bias (K, H)

Differences from Llama the converter handles:
  * HF's defaults for keys a ``config.json`` leaves out are ``Qwen2Config``'s
    (:data:`QWEN2_HF_DEFAULTS`: 151936 tokens, 32768 positions, ``rms_norm_eps`` 1e-6);
  * sliding-window attention: ``Qwen2ForCausalLM`` windows the layers ``layer_types``
    marks ``"sliding_attention"`` (by default the layers from ``max_window_layers`` on) when
    ``use_sliding_window`` is true. Qwen 2.5 ships ``use_sliding_window: false`` (every
    layer full), which converts; a checkpoint that windows any layer is refused by name
    (our GPT has one window for every layer). ``to_hf`` writes ``use_sliding_window: false``.

``to_hf``/``hf_config`` pick this family for a ``GPTConfig`` with Llama's settings and
``qkv_bias=True`` (:func:`is_qwen2_config`); with ``qk_norm`` it is a Qwen 3
(:mod:`~transformer_jax.interop.hf.qwen3`). RoPE scaling (``llama3``, ``linear``) and an
explicit ``head_dim`` convert as for Llama.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...errors import UserError
from ...models.gpt import GPT, GPTConfig
from .gpt2 import causal_lm_from_state_dict, causal_lm_to_state_dict
from .llama import (LLAMA_HF_DEFAULTS, check_llama_layout, has_llama_layout,
                    llama_layout_config_from_hf, llama_layout_hf_values, llama_tensor_maps,
                    take_rope_buffers)
from .registry import HFFamily

#: ``transformers.Qwen2Config``'s defaults where they differ from LlamaConfig's (Qwen3Config
#: has the same ones).
QWEN2_HF_DEFAULTS: dict[str, Any] = {
    **LLAMA_HF_DEFAULTS, "vocab_size": 151936, "intermediate_size": 22016,
    "max_position_embeddings": 32768, "num_key_value_heads": 32,
}
_HF_SLIDING_WINDOW, _HF_MAX_WINDOW_LAYERS = 4096, 28

#: The table is Llama's with its bias entries (``interop.peft`` looks up ``<family>_tensor_maps``).
qwen2_tensor_maps = llama_tensor_maps


# ============================================================================ config

def check_full_attention(config: Mapping[str, Any], family: str) -> None:
    """Refuse a Qwen config that windows any layer (``use_sliding_window`` with
    ``layer_types``, or ``max_window_layers`` below the layer count), naming the options;
    ``use_sliding_window: false`` (Qwen 2.5, Qwen 3) means full attention everywhere."""
    use = config.get("use_sliding_window", False)
    window = config.get("sliding_window", _HF_SLIDING_WINDOW) if use else None
    layers = config.get("num_hidden_layers", LLAMA_HF_DEFAULTS["num_hidden_layers"])
    first = config.get("max_window_layers", _HF_MAX_WINDOW_LAYERS)
    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = ["sliding_attention" if window is not None and i >= first
                       else "full_attention" for i in range(layers)]
    unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UserError(f"unsupported {family} config option layer_types with {unknown}: "
                        "expected 'full_attention' (or 'sliding_attention') per layer")
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if window is not None and sliding:
        raise UserError(
            f"unsupported {family} config option use_sliding_window=True (sliding_window="
            f"{window}, max_window_layers={first}): layers {sliding[0]}..{sliding[-1]} would "
            "attend within a window; transformer_jax converts Qwen checkpoints whose every "
            "layer attends fully: set use_sliding_window to false (as Qwen 2.5 and Qwen 3 ship)")


def qwen2_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """HF Qwen2 config (as a dict) -> ``GPTConfig`` (``qkv_bias=True``); unsupported
    options raise, naming them."""
    check_full_attention(config, "Qwen2")
    return llama_layout_config_from_hf(
        config, model_type="qwen2", family="Qwen2", defaults=QWEN2_HF_DEFAULTS,
        fixed_options={}, settings={"qkv_bias": True}, overrides=overrides)


def is_qwen2_config(config: Any) -> bool:
    """Whether ``config`` is a ``GPTConfig`` that converts to a ``Qwen2Config`` (dispatch):
    Llama's settings with q/k/v biases and no q/k norms (with those: Qwen 3)."""
    return has_llama_layout(config) and config.qkv_bias and not config.qk_norm


def _check_qwen2_compatible(config: GPTConfig) -> None:
    check_llama_layout(config, "Qwen2", extras={"qkv_bias": True})


def qwen2_hf_config(config: GPTConfig, **extra: Any):
    """``GPTConfig`` -> ``transformers.Qwen2Config`` (lazy import); options Qwen 2 lacks raise."""
    from transformers import Qwen2Config

    _check_qwen2_compatible(config)
    values = llama_layout_hf_values(config)
    if config.head_size is None:          # Qwen2Config has no head_dim field: D / N
        del values["head_dim"]
    values.update(use_sliding_window=False, **extra)
    return Qwen2Config(**values)


# ============================================================================ state dicts

def _qwen2_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                           **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """Qwen2 state dict (``Qwen2ForCausalLM`` or ``Qwen2Model`` naming) -> ``(GPT, params)``."""
    return causal_lm_from_state_dict(
        "Qwen2", lambda **o: qwen2_config_from_hf(config, **o), llama_tensor_maps,
        take_rope_buffers, state_dict, overrides, embed_key="embed_tokens.weight",
        prefix="model.")


def qwen2_to_state_dict(module: GPT, params: Any) -> dict[str, np.ndarray]:
    """``(GPT, params)`` -> ``Qwen2ForCausalLM`` state dict of numpy arrays (Llama's keys
    plus the q/k/v biases)."""
    return causal_lm_to_state_dict(module, params, _check_qwen2_compatible, llama_tensor_maps,
                                   "model.embed_tokens.weight")


FAMILY = HFFamily(
    name="qwen2", model_types=("qwen2",), config_type=GPTConfig,
    from_state_dict=_qwen2_from_state_dict, to_state_dict=qwen2_to_state_dict,
    make_hf_config=qwen2_hf_config, matches=is_qwen2_config)
