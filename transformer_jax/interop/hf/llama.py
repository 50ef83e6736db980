"""Hugging Face Llama (``LlamaForCausalLM``, ``LlamaModel``) <-> :class:`~transformer_jax.models.gpt.GPT`.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="llama"``). Llama is our
GPT with RoPE, RMSNorm, a SwiGLU MLP, grouped-query attention, no biases and (usually) an
untied head: ``position="rope"``, ``norm="rmsnorm"``, ``gated_mlp=True``,
``activation="silu"``, ``use_bias=False`` (the ``llama-*`` presets of ``GPTConfig``).
Since GPT-2 converts to the same ``GPTConfig``, ``to_hf``/``hf_config`` pick this family for
a ``GPTConfig`` with exactly these settings and no sliding window (:func:`is_llama_config`),
Mistral (:mod:`~transformer_jax.interop.hf.mistral`: this layout and table plus
``attention_window``) for these settings with a window, and GPT-2 otherwise. A linear or
sparse ``attention`` is refused by name (HF runs full softmax attention).

Weight layout. HF's ``nn.Linear`` weights are (out, in) and are transposed into (in, out...)
kernels. One :class:`TensorMap` table (:func:`llama_tensor_maps`) drives both directions, and
``LLAMA_CONFIG_FIELDS`` does the same for the config. Legend: V vocab, D width, N query
heads, K key/value heads, H = D / N, F MLP width.

    HF key (after the optional ``model.`` prefix)   shape      flax path, shape
    embed_tokens.weight                             (V, D)     wte/embedding (V, D)
    layers.{i}.self_attn.q_proj.weight              (N H, D)   h_{i}/self_attn/query/kernel (D, N, H)
    layers.{i}.self_attn.{k,v}_proj.weight          (K H, D)   h_{i}/self_attn/{key,value}/kernel (D, K, H)
    layers.{i}.self_attn.o_proj.weight              (D, N H)   h_{i}/self_attn/out/kernel (N, H, D)
    layers.{i}.mlp.gate_proj.weight                 (F, D)     h_{i}/mlp/wi_0/kernel (D, F)  (the silu branch)
    layers.{i}.mlp.up_proj.weight                   (F, D)     h_{i}/mlp/wi_1/kernel (D, F)
    layers.{i}.mlp.down_proj.weight                 (D, F)     h_{i}/mlp/wo/kernel (F, D)
    layers.{i}.input_layernorm.weight               (D,)       h_{i}/norm1/scale
    layers.{i}.post_attention_layernorm.weight      (D,)       h_{i}/norm2/scale
    norm.weight                                     (D,)       ln_f/scale
    lm_head.weight (untied only; no prefix)         (V, D)     lm_head/kernel (D, V)

With ``scan_layers=True`` the ``h_{i}`` subtrees are one ``h`` with a leading (L,) axis.
Both use HF's head order: query head n reads key/value head n // (N / K) (``repeat_kv``), and
RoPE rotates the pairs (i, i + H/2) (``rotate_half``), as our ``apply_rope`` does.

Keys that are not parameters:
  * ``lm_head.weight`` of a *tied* model (a live model's ``state_dict()`` lists it; a
    ``save_pretrained`` file omits it) is accepted only if it equals ``embed_tokens.weight``.
  * ``layers.{i}.self_attn.rotary_emb.inv_freq`` (H/2,), which transformers before 4.31
    saved into checkpoints, is recomputed by our RoPE: it is dropped after a check against
    our table (``layers.embeddings.rope_frequencies``: ``rope_theta ** (-2j / H)``, rescaled
    by the config's rope scaling; a different table means another RoPE variant: refused).
    ``to_hf`` never emits it.
  * Anything else unexpected, any missing key and any shape mismatch raise
    ``ConversionError`` naming the key (and the expected/actual shape).

Config options our GPT cannot express are refused by name (:data:`LLAMA_FIXED_OPTIONS`,
``hidden_act`` other than silu, and a RoPE scaling other than Llama 3.1-3.3's
``rope_type="llama3"`` and ``"linear"``: ``yarn``, ``longrope``, ``dynamic``, ... are
refused, from transformers < 5 ``rope_scaling`` and >= 5 ``rope_parameters`` alike).
An explicit ``head_dim`` other than D / N becomes ``GPTConfig.head_size``.
Llama has no embedding or residual dropout: the converted ``GPTConfig`` has
``dropout_rate=0``, and ``dropout_rate`` is not written back (HF has no such field).

A ``LlamaModel`` (no ``model.`` prefix, no LM head) converts to a ``GPT`` that reads out
through the tied embedding, whatever the config's ``tie_word_embeddings`` says.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ...errors import UserError
from ...layers.embeddings import rope_frequencies
from ...models.gpt import GPT, GPTConfig
from ..common import (ConversionError, StateDictReader, TensorMap, attention_mismatches,
                      layer_norm, linear)
from .gpt2 import causal_lm_from_state_dict, causal_lm_to_state_dict
from .registry import HFFamily, activation_from_hf

#: HF config attribute <-> GPTConfig field, one table for both directions.
LLAMA_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("max_position_embeddings", "max_len"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_heads"),
    ("num_key_value_heads", "num_kv_heads"),
    ("hidden_size", "d_model"),
    ("intermediate_size", "mlp_dim"),
    ("rms_norm_eps", "norm_eps"),
    ("tie_word_embeddings", "tie_embeddings"),
    ("attention_dropout", "attention_dropout_rate"),
    ("initializer_range", "initializer_range"),
)

#: ``transformers.LlamaConfig``'s defaults for the fields above, used for a key a config
#: (e.g. a hand-written ``config.json``) leaves out: several differ from ``GPTConfig``'s.
LLAMA_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "max_position_embeddings": 2048, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_size": 4096,
    "intermediate_size": 11008, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_dropout": 0.0, "initializer_range": 0.02,
}

#: The GPTConfig settings that make our GPT a Llama (and the converter sets).
LLAMA_SETTINGS: dict[str, Any] = {
    "position": "rope", "norm": "rmsnorm", "gated_mlp": True, "activation": "silu",
    "use_bias": False,
}

#: HF options that our GPT implements only at one value: name -> the supported value.
LLAMA_FIXED_OPTIONS: dict[str, Any] = {
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
}

_DEFAULT_ROPE_THETA = 10000.0


# ============================================================================ config

#: HF rope_type -> the fields of its rope parameters and our ``RopeScaling`` names.
_ROPE_FIELDS: dict[str, dict[str, str]] = {
    "llama3": {"factor": "factor", "low_freq_factor": "low_freq_factor",
               "high_freq_factor": "high_freq_factor",
               "original_max_position_embeddings": "original_max_len"},
    "linear": {"factor": "factor"},
}


def rope_from_hf(config: Mapping[str, Any], family: str = "Llama"
                 ) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of an HF config: transformers < 5 ``rope_theta`` and
    ``rope_scaling``, >= 5 ``rope_parameters``. ``rope_scaling`` is None or the dict form of
    ``layers.embeddings.RopeScaling`` ("llama3" or "linear"); any other rope type, or a field
    we do not implement (``attention_factor``, ...), raises naming it."""
    theta = config.get("rope_theta")
    found = None
    for option in ("rope_scaling", "rope_parameters"):
        value = config.get(option)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise UserError(f"unsupported {family} config option {option}={value!r}: expected a dict")
        rope_type = value.get("rope_type", value.get("type", "default"))
        theta = value.get("rope_theta", theta)
        fields = _ROPE_FIELDS.get(rope_type, {}) if rope_type != "default" else {}
        if rope_type != "default" and rope_type not in _ROPE_FIELDS:
            raise UserError(f"unsupported {family} config option {option} with rope_type="
                            f"{rope_type!r}: transformer_jax's RoPE implements 'default', "
                            f"'llama3' and 'linear' scaling only")
        extra = sorted(set(value) - {"rope_type", "type", "rope_theta"} - set(fields))
        if extra:
            raise UserError(f"unsupported {family} config option {option} field(s) {extra} "
                            f"(rope_type={rope_type!r}): transformer_jax's RoPE does not "
                            f"implement them; only {sorted(fields) or 'rope_theta'} convert")
        if fields:
            missing = sorted(set(fields) - set(value))
            if missing:
                raise UserError(f"{family} config option {option} (rope_type={rope_type!r}) "
                                f"lacks {missing}; add them as the checkpoint's config has them")
            found = {"kind": rope_type, **{ours: value[hf] for hf, ours in fields.items()}}
    return float(_DEFAULT_ROPE_THETA if theta is None else theta), found


def rope_to_hf(config: GPTConfig) -> dict[str, Any]:
    """The HF config fields of ``config``'s RoPE (transformers >= 5 ``rope_parameters``;
    transformers reads it, and older versions read ``rope_theta`` and ``rope_scaling``)."""
    values: dict[str, Any] = {"rope_theta": config.rope_base}
    scaling = config.rope_scaling
    if scaling is None:
        return values
    fields = {hf: getattr(scaling, ours) for hf, ours in _ROPE_FIELDS[scaling.kind].items()}
    values["rope_scaling"] = {"rope_type": scaling.kind, **fields}
    return values


def llama_layout_config_from_hf(config: Mapping[str, Any], *, model_type: str, family: str,
                                defaults: Mapping[str, Any], fixed_options: Mapping[str, Any],
                                settings: Mapping[str, Any], overrides: Mapping[str, Any]
                                ) -> GPTConfig:
    """An HF config of Llama's layout (Llama, Mistral) as a dict -> ``GPTConfig``.

    ``defaults``: the HF class's defaults for ``LLAMA_CONFIG_FIELDS``; ``fixed_options``:
    HF options supported at one value only; ``settings``: GPTConfig fields the family sets
    on top (Mistral's ``attention_window``), before the caller's ``overrides``. Unsupported
    options raise, naming them (``family`` names the family in the message).
    """
    if config.get("model_type") != model_type:
        raise UserError(f"expected a {family} config (model_type {model_type!r}), got model_type "
                        f"{config.get('model_type')!r}")
    for option, supported in fixed_options.items():
        if config.get(option) is not None and config[option] != supported:
            raise UserError(f"unsupported {family} config option {option}={config[option]!r}: "
                            f"transformer_jax's GPT implements only {option}={supported!r}")
    activation = activation_from_hf(config.get("hidden_act", "silu"), family=family,
                                    option="hidden_act")
    if activation != "silu":
        raise UserError(f"unsupported {family} config option hidden_act={config['hidden_act']!r}: "
                        f"{family}'s gated MLP is SwiGLU (hidden_act='silu')")
    values = {ours: config.get(hf, defaults[hf]) for hf, ours in LLAMA_CONFIG_FIELDS}
    values = {k: v for k, v in values.items() if v is not None}
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * values["num_heads"] != values["d_model"]:
        values["head_size"] = head_dim         # an explicit H (Qwen 3; some Llama configs)
    theta, scaling = rope_from_hf(config, family)
    values.update(LLAMA_SETTINGS, rope_base=theta, rope_scaling=scaling, dropout_rate=0.0)
    values.update(settings)
    values.update(overrides)
    return GPTConfig.from_dict(values)


def llama_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """HF Llama config (as a dict) -> ``GPTConfig``; unsupported options raise, naming them."""
    return llama_layout_config_from_hf(config, model_type="llama", family="Llama",
                                       defaults=LLAMA_HF_DEFAULTS,
                                       fixed_options=LLAMA_FIXED_OPTIONS, settings={},
                                       overrides=overrides)


def has_llama_layout(config: Any) -> bool:
    """Whether ``config`` is a ``GPTConfig`` with Llama's settings (``LLAMA_SETTINGS``):
    a Llama (no window) or a Mistral (a sliding window) for the dispatch."""
    return isinstance(config, GPTConfig) and all(
        getattr(config, name) == value for name, value in LLAMA_SETTINGS.items())


def llama_mismatches(config: GPTConfig, *, sliding_window: bool = False) -> list[str]:
    """The settings of ``config`` a Llama checkpoint cannot express (empty: it is a Llama);
    with ``sliding_window`` a Mistral's (``attention_window`` allowed)."""
    bad = [f"{name}={getattr(config, name)!r}" for name, value in LLAMA_SETTINGS.items()
           if getattr(config, name) != value]
    return bad + attention_mismatches(config, sliding_window=sliding_window)


def is_llama_config(config: Any) -> bool:
    """Whether ``config`` is a ``GPTConfig`` that converts to a ``LlamaConfig`` (dispatch):
    Llama's settings and no sliding window (with one: Mistral)."""
    return has_llama_layout(config) and config.attention_window is None


def check_llama_layout(config: GPTConfig, family: str = "Llama",
                       sliding_window: bool = False) -> None:
    """Refuse what a ``family`` checkpoint cannot express, naming every such option."""
    bad = llama_mismatches(config, sliding_window=sliding_window)
    if bad:
        raise UserError(f"GPTConfig option(s) not expressible as {family}: " + "; ".join(bad) +
                        f" (a {family} needs {', '.join(f'{k}={v!r}' for k, v in LLAMA_SETTINGS.items())})")


def _check_llama_compatible(config: GPTConfig) -> None:
    check_llama_layout(config)


def llama_layout_hf_values(config: GPTConfig) -> dict[str, Any]:
    """The HF config fields Llama and Mistral share, for ``config`` (checked by the caller)."""
    values = {hf: getattr(config, ours) for hf, ours in LLAMA_CONFIG_FIELDS}
    values["num_key_value_heads"] = config.num_kv_heads or config.num_heads
    values.update(hidden_act="silu", head_dim=config.head_dim, **rope_to_hf(config))
    return values


def llama_hf_config(config: GPTConfig, **extra: Any):
    """``GPTConfig`` -> ``transformers.LlamaConfig`` (lazy import); options Llama lacks raise."""
    from transformers import LlamaConfig

    _check_llama_compatible(config)
    values = llama_layout_hf_values(config)
    values.update(LLAMA_FIXED_OPTIONS)
    values.update(extra)
    return LlamaConfig(**values)


# ============================================================================ the table

def llama_tensor_maps(cfg: GPTConfig, prefix: str = "model.") -> list[TensorMap]:
    """Every HF tensor <-> flax leaf of ``GPT(cfg)`` (unscanned), in HF state-dict order.

    ``prefix`` is ``"model."`` for ``LlamaForCausalLM`` and ``""`` for ``LlamaModel``.
    """
    d, f, v = cfg.d_model, cfg.mlp_features, cfg.vocab_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads or cfg.num_heads, cfg.head_dim
    maps = [TensorMap(f"{prefix}embed_tokens.weight", (v, d), ((("wte", "embedding"), (v, d)),))]
    for i in range(cfg.num_layers):
        hf, ours = f"{prefix}layers.{i}.", (f"h_{i}",)
        attn, mlp = ours + ("self_attn",), ours + ("mlp",)
        maps += linear(f"{hf}self_attn.q_proj.", attn + ("query",), d, n * h, bias=False,
                       kernel_shape=(d, n, h))
        maps += linear(f"{hf}self_attn.k_proj.", attn + ("key",), d, k * h, bias=False,
                       kernel_shape=(d, k, h))
        maps += linear(f"{hf}self_attn.v_proj.", attn + ("value",), d, k * h, bias=False,
                       kernel_shape=(d, k, h))
        maps += linear(f"{hf}self_attn.o_proj.", attn + ("out",), n * h, d, bias=False,
                       kernel_shape=(n, h, d))
        maps += linear(f"{hf}mlp.gate_proj.", mlp + ("wi_0",), d, f, bias=False)
        maps += linear(f"{hf}mlp.up_proj.", mlp + ("wi_1",), d, f, bias=False)
        maps += linear(f"{hf}mlp.down_proj.", mlp + ("wo",), f, d, bias=False)
        maps += layer_norm(f"{hf}input_layernorm.", ours + ("norm1",), d, bias=False)
        maps += layer_norm(f"{hf}post_attention_layernorm.", ours + ("norm2",), d, bias=False)
    maps += layer_norm(f"{prefix}norm.", ("ln_f",), d, bias=False)
    if not cfg.tie_embeddings:
        maps += linear("lm_head.", ("lm_head",), d, v, bias=False)
    return maps


# ============================================================================ HF -> flax

def take_rope_buffers(reader: StateDictReader, cfg: GPTConfig, prefix: str) -> None:
    """Check and drop old checkpoints' ``rotary_emb.inv_freq`` buffers (module docstring)."""
    h = cfg.head_dim
    expected = rope_frequencies(h, cfg.rope_base, cfg.rope_scaling).astype(np.float64)
    for i in range(cfg.num_layers):
        key = f"{prefix}layers.{i}.self_attn.rotary_emb.inv_freq"
        if key in reader:
            stored = reader.take(key, (h // 2,)).astype(np.float64)
            if not np.allclose(stored, expected, rtol=1e-5, atol=0):
                raise ConversionError(f"{key!r}: this RoPE frequency table is not "
                                      f"rope_theta={cfg.rope_base:g} ** (-2j / {h}) with the "
                                      f"config's rope scaling ({cfg.rope_scaling}); another "
                                      "RoPE variant is not supported")


def _llama_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                           **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """Llama state dict (``LlamaForCausalLM`` or ``LlamaModel`` naming) -> ``(GPT, params)``."""
    return causal_lm_from_state_dict(
        "Llama", lambda **o: llama_config_from_hf(config, **o), llama_tensor_maps,
        take_rope_buffers, state_dict, overrides, embed_key="embed_tokens.weight",
        prefix="model.")


# ============================================================================ flax -> HF

def llama_to_state_dict(module: GPT, params: Any) -> dict[str, np.ndarray]:
    """``(GPT, params)`` -> ``LlamaForCausalLM`` state dict of numpy arrays.

    ``params`` may be the params tree or the whole ``{'params': ...}`` variables dict,
    boxed (``nn.Partitioned``) or not, in either layout (``h_{i}`` or a scanned ``h``).
    A tied ``lm_head.weight`` is the same array as ``model.embed_tokens.weight``.
    """
    return causal_lm_to_state_dict(module, params, _check_llama_compatible, llama_tensor_maps,
                                   "model.embed_tokens.weight")


FAMILY = HFFamily(
    name="llama", model_types=("llama",), config_type=GPTConfig,
    from_state_dict=_llama_from_state_dict, to_state_dict=llama_to_state_dict,
    make_hf_config=llama_hf_config, matches=is_llama_config)
