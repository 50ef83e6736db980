"""Hugging Face Qwen 3 (``Qwen3ForCausalLM``, ``Qwen3Model``) <-> :class:`~transformer_jax.models.gpt.GPT`.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="qwen3"``). A Qwen 3 block is
a Llama block (:mod:`~transformer_jax.interop.hf.llama`) that RMS-normalises each query and
key head over H before RoPE (``q_norm``, ``k_norm``, with ``rms_norm_eps``), and whose head
size ``head_dim`` need not be D / N: our GPT with ``qk_norm=True`` and ``head_size`` (the
``qwen3-*`` presets of ``GPTConfig``). Llama's config mapping and tensor table convert it;
the table's optional entries add

    HF key (after the optional ``model.`` prefix)   shape      flax path, shape
    layers.{i}.self_attn.q_norm.weight              (H,)       h_{i}/self_attn/query_norm/scale
    layers.{i}.self_attn.k_norm.weight              (H,)       h_{i}/self_attn/key_norm/scale

Differences from Llama the converter handles:
  * HF's defaults for keys a ``config.json`` leaves out are ``Qwen3Config``'s (Qwen 2's,
    :data:`~transformer_jax.interop.hf.qwen2.QWEN2_HF_DEFAULTS`, and ``head_dim`` 128);
  * ``attention_bias`` (biases on q/k/v *and* o) is supported at false only (every Qwen 3
    checkpoint); true is refused by name;
  * sliding windows: as for Qwen 2 (:func:`~transformer_jax.interop.hf.qwen2.check_full_attention`).

``to_hf``/``hf_config`` pick this family for a ``GPTConfig`` with Llama's settings and
``qk_norm=True`` (:func:`is_qwen3_config`).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...models.gpt import GPT, GPTConfig
from .gpt2 import causal_lm_from_state_dict, causal_lm_to_state_dict
from .llama import (check_llama_layout, has_llama_layout, llama_layout_config_from_hf,
                    llama_layout_hf_values, llama_tensor_maps, take_rope_buffers)
from .qwen2 import QWEN2_HF_DEFAULTS, check_full_attention
from .registry import HFFamily

_HF_HEAD_DIM = 128                      # Qwen3Config's default head_dim

#: HF options that our GPT implements only at one value: name -> the supported value.
QWEN3_FIXED_OPTIONS: dict[str, Any] = {"attention_bias": False}

#: The table is Llama's with its q/k norm entries (``interop.peft``: ``<family>_tensor_maps``).
qwen3_tensor_maps = llama_tensor_maps


def qwen3_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """HF Qwen3 config (as a dict) -> ``GPTConfig`` (``qk_norm=True``, ``head_size`` =
    ``head_dim`` where it is not D / N); unsupported options raise, naming them."""
    check_full_attention(config, "Qwen3")
    config = {**config, "head_dim": config.get("head_dim") or _HF_HEAD_DIM}
    return llama_layout_config_from_hf(
        config, model_type="qwen3", family="Qwen3", defaults=QWEN2_HF_DEFAULTS,
        fixed_options=QWEN3_FIXED_OPTIONS, settings={"qk_norm": True}, overrides=overrides)


def is_qwen3_config(config: Any) -> bool:
    """Whether ``config`` is a ``GPTConfig`` that converts to a ``Qwen3Config`` (dispatch):
    Llama's settings with q/k norms (with q/k/v biases too: refused by the conversion)."""
    return has_llama_layout(config) and config.qk_norm


def _check_qwen3_compatible(config: GPTConfig) -> None:
    check_llama_layout(config, "Qwen3", extras={"qk_norm": True})


def qwen3_hf_config(config: GPTConfig, **extra: Any):
    """``GPTConfig`` -> ``transformers.Qwen3Config`` (lazy import); options Qwen 3 lacks raise."""
    from transformers import Qwen3Config

    _check_qwen3_compatible(config)
    values = llama_layout_hf_values(config)
    values.update(QWEN3_FIXED_OPTIONS, use_sliding_window=False, **extra)
    return Qwen3Config(**values)


def _qwen3_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                           **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """Qwen3 state dict (``Qwen3ForCausalLM`` or ``Qwen3Model`` naming) -> ``(GPT, params)``."""
    return causal_lm_from_state_dict(
        "Qwen3", lambda **o: qwen3_config_from_hf(config, **o), llama_tensor_maps,
        take_rope_buffers, state_dict, overrides, embed_key="embed_tokens.weight",
        prefix="model.")


def qwen3_to_state_dict(module: GPT, params: Any) -> dict[str, np.ndarray]:
    """``(GPT, params)`` -> ``Qwen3ForCausalLM`` state dict of numpy arrays (Llama's keys
    plus the q/k norms)."""
    return causal_lm_to_state_dict(module, params, _check_qwen3_compatible, llama_tensor_maps,
                                   "model.embed_tokens.weight")


FAMILY = HFFamily(
    name="qwen3", model_types=("qwen3",), config_type=GPTConfig,
    from_state_dict=_qwen3_from_state_dict, to_state_dict=qwen3_to_state_dict,
    make_hf_config=qwen3_hf_config, matches=is_qwen3_config)
