"""Hugging Face Gemma 3 (``Gemma3ForCausalLM``, ``Gemma3TextModel``, the text model of
``Gemma3ForConditionalGeneration``) <-> :class:`~transformer_jax.models.gemma.Gemma`.

Reached through :mod:`transformer_jax.interop.hf` (``model_type`` ``"gemma3_text"``, and
``"gemma3"`` for the multimodal checkpoints: their ``text_config`` and language-model
weights). Only the text model converts: the vision tower (SigLIP) and the multimodal
projector of a ``gemma3`` checkpoint have no counterpart here, so their keys
(``vision_tower.*``, ``multi_modal_projector.*``, with or without transformers 5's ``model.``
in front) are left out, and the result is a text-only Gemma that ``to_hf`` writes as a
``Gemma3ForCausalLM`` (images cannot be fed to it). Every other unexpected key raises.

Weight layout (legend: V vocab, D width, N query heads, K key/value heads, H head_dim, F
MLP width). Key prefix P: ``model.`` (``Gemma3ForCausalLM``), none (``Gemma3TextModel``),
``model.language_model.`` (``Gemma3ForConditionalGeneration``, transformers 5) or
``language_model.model.`` (the same as saved on the Hub by transformers 4.50+).

    HF key (after P)                                shape      flax path, shape
    embed_tokens.weight                             (V, D)     wte/embedding (V, D)
    layers.{i}.self_attn.q_proj.weight              (N H, D)   h_{i}/self_attn/query/kernel (D, N, H)
    layers.{i}.self_attn.{k,v}_proj.weight          (K H, D)   h_{i}/self_attn/{key,value}/kernel (D, K, H)
    layers.{i}.self_attn.o_proj.weight              (D, N H)   h_{i}/self_attn/out/kernel (N, H, D)
    layers.{i}.self_attn.{q,k}_norm.weight          (H,)       h_{i}/self_attn/{query,key}_norm/scale
    layers.{i}.mlp.gate_proj.weight                 (F, D)     h_{i}/mlp/wi_0/kernel (D, F)  (the GELU branch)
    layers.{i}.mlp.up_proj.weight                   (F, D)     h_{i}/mlp/wi_1/kernel (D, F)
    layers.{i}.mlp.down_proj.weight                 (D, F)     h_{i}/mlp/wo/kernel (F, D)
    layers.{i}.input_layernorm.weight               (D,)       h_{i}/input_norm/scale
    layers.{i}.post_attention_layernorm.weight      (D,)       h_{i}/post_attn_norm/scale
    layers.{i}.pre_feedforward_layernorm.weight     (D,)       h_{i}/pre_mlp_norm/scale
    layers.{i}.post_feedforward_layernorm.weight    (D,)       h_{i}/post_mlp_norm/scale
    norm.weight                                     (D,)       ln_f/scale
    lm_head.weight (untied only)                    (V, D)     lm_head/kernel (D, V)

Gemma's norms store w of ``1 + w`` on both sides: copied as they are. A tied
``lm_head.weight`` (listed by a live model) must equal the embedding.

Config. ``layer_types`` (transformers 5: ``sliding_attention``/``full_attention`` per layer)
or, in older configs, ``sliding_window_pattern`` (every n-th layer global; default 6) give
the local/global pattern. RoPE: transformers 5's ``rope_parameters`` per layer type
(``{"full_attention": {...}, "sliding_attention": {...}}``), or the older ``rope_theta``
(global layers, default 10^6), ``rope_scaling`` (global layers) and
``rope_local_base_freq`` (local layers, default 10^4). Global layers take "default" or
"linear" RoPE; local layers "default" only. Keys a ``config.json`` leaves out take
``Gemma3TextConfig``'s defaults (:data:`GEMMA3_HF_DEFAULTS`). Refused by name, never
ignored: ``attn_logit_softcapping`` (Gemma 2's attention-logit cap: our attention kernels
have no logit cap), ``attention_bias=True``, ``use_bidirectional_attention=True``, a null
or non-positive ``sliding_window``, and any other RoPE type. ``final_logit_softcapping``
converts (``GemmaConfig.final_logit_softcap``).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...models.gemma import Gemma, GemmaConfig
from ..common import (ConversionError, StateDictReader, TensorMap, dump_state_dict, layer_norm,
                      linear, load_params)
from .llama import rope_from_hf
from .registry import (HFFamily, activation_from_hf, activation_to_hf, cast_params, check_table,
                       plain_params, to_layout, without_scan)

#: HF config attribute <-> GemmaConfig field, one table for both directions.
GEMMA3_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("max_position_embeddings", "max_len"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_heads"),
    ("num_key_value_heads", "num_kv_heads"),
    ("head_dim", "head_dim"),
    ("hidden_size", "d_model"),
    ("intermediate_size", "mlp_dim"),
    ("rms_norm_eps", "norm_eps"),
    ("query_pre_attn_scalar", "query_pre_attn_scalar"),
    ("sliding_window", "sliding_window"),
    ("tie_word_embeddings", "tie_embeddings"),
    ("attention_dropout", "attention_dropout_rate"),
    ("initializer_range", "initializer_range"),
    ("final_logit_softcapping", "final_logit_softcap"),
)

#: ``transformers.Gemma3TextConfig``'s defaults for the keys a config.json may leave out.
GEMMA3_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "max_position_embeddings": 131072, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2304,
    "intermediate_size": 9216, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 4096, "tie_word_embeddings": True, "attention_dropout": 0.0,
    "initializer_range": 0.02, "final_logit_softcapping": None,
}

#: HF options implemented at one value only: name -> that value (anything else is refused).
GEMMA3_FIXED_OPTIONS: dict[str, Any] = {
    "attn_logit_softcapping": None,
    "attention_bias": False,
    "use_bidirectional_attention": False,
}

_HF_KINDS = {"sliding_attention": "local", "full_attention": "global"}
_OUR_KINDS = {v: k for k, v in _HF_KINDS.items()}
_DEFAULT_GLOBAL_THETA, _DEFAULT_LOCAL_THETA = 1_000_000.0, 10_000.0


# ============================================================================ config

def _layer_kinds(config: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    layer_types = config.get("layer_types")
    if layer_types is None:
        p = config.get("sliding_window_pattern", 6)
        return tuple("global" if (i + 1) % p == 0 else "local" for i in range(num_layers))
    bad = sorted({t for t in layer_types if t not in _HF_KINDS}, key=str)
    if bad or len(layer_types) != num_layers:
        raise UserError(f"unsupported Gemma 3 config option layer_types={list(layer_types)!r}: "
                        f"expected {num_layers} entries (num_hidden_layers), each "
                        f"'sliding_attention' or 'full_attention'")
    return tuple(_HF_KINDS[t] for t in layer_types)


def _pattern_fields(kinds: tuple[str, ...]) -> dict[str, Any]:
    """``sliding_window_pattern`` when one gives ``kinds`` (the smallest), else ``layer_types``."""
    n = len(kinds)
    for p in range(1, n + 2):
        if all((k == "global") == ((i + 1) % p == 0) for i, k in enumerate(kinds)):
            return {"sliding_window_pattern": p, "layer_types": None}
    return {"sliding_window_pattern": 6, "layer_types": kinds}


def _rope(config: Mapping[str, Any]) -> dict[str, Any]:
    """GemmaConfig's rope fields from either generation of HF config (module docstring)."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and set(params) <= set(_HF_KINDS) and params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        theta, scaling = rope_from_hf({"rope_parameters": {"rope_theta": _DEFAULT_GLOBAL_THETA,
                                                           **full}},
                                      "Gemma 3 (rope_parameters['full_attention'])")
        local_theta, local_scaling = rope_from_hf(
            {"rope_parameters": {"rope_theta": _DEFAULT_LOCAL_THETA, **local}},
            "Gemma 3 (rope_parameters['sliding_attention'])")
    else:
        theta, scaling = rope_from_hf({"rope_theta": config.get("rope_theta",
                                                                _DEFAULT_GLOBAL_THETA),
                                       "rope_scaling": config.get("rope_scaling"),
                                       "rope_parameters": params}, "Gemma 3")
        local_theta = float(config.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA))
        local_scaling = None
    if local_scaling is not None:
        raise UserError(f"unsupported Gemma 3 config option: RoPE scaling {local_scaling} on the "
                        "sliding-window layers; transformer_jax's Gemma rescales the global "
                        "layers' RoPE only")
    return {"rope_base": theta, "rope_scaling": scaling, "rope_local_base": local_theta}


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``gemma3_text`` config of a ``gemma3_text`` or multimodal ``gemma3`` config dict."""
    model_type = config.get("model_type")
    if model_type == "gemma3_text":
        return dict(config)
    if model_type == "gemma3":
        text = config.get("text_config") or {}
        text = dict(text if isinstance(text, Mapping) else text.to_dict())
        if "tie_word_embeddings" in config:       # the wrapper ties its lm_head
            text["tie_word_embeddings"] = config["tie_word_embeddings"]
        return {**text, "model_type": "gemma3_text"}
    raise UserError(f"expected a Gemma 3 config (model_type 'gemma3_text' or 'gemma3'), got "
                    f"model_type {model_type!r}")


def gemma_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GemmaConfig:
    """HF Gemma 3 config (a dict; ``gemma3_text``, or ``gemma3``'s text part) -> ``GemmaConfig``;
    unsupported options raise, naming them."""
    config = text_config(config)
    for option, supported in GEMMA3_FIXED_OPTIONS.items():
        if config.get(option) not in (None, supported):
            raise UserError(f"unsupported Gemma 3 config option {option}={config[option]!r}: "
                            f"transformer_jax's Gemma implements only {option}={supported!r}")
    window = config.get("sliding_window", GEMMA3_HF_DEFAULTS["sliding_window"])
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UserError(f"unsupported Gemma 3 config option sliding_window={window!r}: expected "
                        "a positive integer (the window W of the local layers)")
    activation = activation_from_hf(config.get("hidden_activation", "gelu_pytorch_tanh"),
                                    family="Gemma 3", option="hidden_activation")
    values = {ours: config.get(hf, GEMMA3_HF_DEFAULTS[hf]) for hf, ours in GEMMA3_CONFIG_FIELDS}
    values = {k: v for k, v in values.items()
              if v is not None or k == "final_logit_softcap"}
    values["query_pre_attn_scalar"] = float(values["query_pre_attn_scalar"])
    values.update(_pattern_fields(_layer_kinds(config, values["num_layers"])))
    values.update(_rope(config), activation=activation, dropout_rate=0.0)
    values.update(overrides)
    return GemmaConfig.from_dict(values)


def gemma_hf_config(config: GemmaConfig, **extra: Any):
    """``GemmaConfig`` -> ``transformers.Gemma3TextConfig`` (lazy import), with ``layer_types``
    and transformers 5's per-layer-type ``rope_parameters``."""
    from transformers import Gemma3TextConfig

    values = {hf: getattr(config, ours) for hf, ours in GEMMA3_CONFIG_FIELDS}
    scalar = config.query_pre_attn_scalar
    values["query_pre_attn_scalar"] = int(scalar) if float(scalar).is_integer() else scalar
    full = {"rope_type": "default", "rope_theta": config.rope_base}
    if config.rope_scaling is not None:
        if config.rope_scaling.kind != "linear":
            raise UserError(f"GemmaConfig.rope_scaling={config.rope_scaling} has no Gemma 3 "
                            "form: Gemma 3 rescales RoPE linearly (kind='linear')")
        full.update(rope_type="linear", factor=config.rope_scaling.factor)
    values.update(
        hidden_activation=("gelu_pytorch_tanh" if config.activation == "gelu_tanh" else
                           activation_to_hf(config.activation, what="GemmaConfig.activation")),
        layer_types=[_OUR_KINDS[k] for k in config.layer_kinds],
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": config.rope_local_base}},
        attention_bias=False, attn_logit_softcapping=None, use_bidirectional_attention=False)
    values.update(extra)
    return Gemma3TextConfig(**values)


# ============================================================================ the table

def gemma_tensor_maps(cfg: GemmaConfig, prefix: str = "model.",
                      head: str = "lm_head.") -> list[TensorMap]:
    """Every HF tensor <-> flax leaf of ``Gemma(cfg)``, in HF state-dict order; ``prefix``
    and ``head`` as in the module docstring (``Gemma3ForCausalLM``'s by default)."""
    d, f, v = cfg.d_model, cfg.mlp_dim, cfg.vocab_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    maps = [TensorMap(f"{prefix}embed_tokens.weight", (v, d), ((("wte", "embedding"), (v, d)),))]
    for i in range(cfg.num_layers):
        hf, ours = f"{prefix}layers.{i}.", (f"h_{i}",)
        attn, mlp = ours + ("self_attn",), ours + ("mlp",)
        for name, path, heads in (("q", "query", n), ("k", "key", k), ("v", "value", k)):
            maps += linear(f"{hf}self_attn.{name}_proj.", attn + (path,), d, heads * h,
                           bias=False, kernel_shape=(d, heads, h))
        maps += linear(f"{hf}self_attn.o_proj.", attn + ("out",), n * h, d, bias=False,
                       kernel_shape=(n, h, d))
        maps += layer_norm(f"{hf}self_attn.q_norm.", attn + ("query_norm",), h, bias=False)
        maps += layer_norm(f"{hf}self_attn.k_norm.", attn + ("key_norm",), h, bias=False)
        maps += linear(f"{hf}mlp.gate_proj.", mlp + ("wi_0",), d, f, bias=False)
        maps += linear(f"{hf}mlp.up_proj.", mlp + ("wi_1",), d, f, bias=False)
        maps += linear(f"{hf}mlp.down_proj.", mlp + ("wo",), f, d, bias=False)
        for hf_norm, our_norm in (("input_layernorm", "input_norm"),
                                  ("post_attention_layernorm", "post_attn_norm"),
                                  ("pre_feedforward_layernorm", "pre_mlp_norm"),
                                  ("post_feedforward_layernorm", "post_mlp_norm")):
            maps += layer_norm(f"{hf}{hf_norm}.", ours + (our_norm,), d, bias=False)
    maps += layer_norm(f"{prefix}norm.", ("ln_f",), d, bias=False)
    if not cfg.tie_embeddings:
        maps += linear(head, ("lm_head",), d, v, bias=False)
    return maps


# ============================================================================ HF -> flax

#: (text-model key prefix, LM head prefix, vision key prefixes) of each checkpoint layout
_LAYOUTS = (
    ("model.language_model.", "lm_head.", ("model.vision_tower.", "model.multi_modal_projector.")),
    ("language_model.model.", "language_model.lm_head.", ("vision_tower.",
                                                          "multi_modal_projector.")),
    ("model.", "lm_head.", ()),
    ("", "lm_head.", ()),
)


def _gemma_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                           **overrides: Any) -> tuple[Gemma, dict[str, Any]]:
    """A Gemma 3 state dict (any layout of the module docstring) -> ``(Gemma, params)``."""
    reader = StateDictReader(state_dict, what="Gemma 3 state dict")
    for prefix, head, vision in _LAYOUTS:
        if f"{prefix}embed_tokens.weight" in reader:
            break
    else:
        raise ConversionError("Gemma 3 state dict: no embed_tokens.weight under any of "
                              f"{[p for p, _, _ in _LAYOUTS]}; is this a Gemma 3 checkpoint?")
    if prefix == "":                     # Gemma3TextModel: read out through the embedding
        overrides = {"tie_embeddings": True, **overrides}
    cfg = gemma_config_from_hf(config, **overrides)
    maps = gemma_tensor_maps(cfg, prefix, head)
    check_table(maps, Gemma(without_scan(cfg)), jnp.zeros((1, 1), jnp.int32), what="Gemma 3")
    params = load_params(maps, reader, finish=False)
    if cfg.tie_embeddings and prefix and f"{head}weight" in reader:
        tied = reader.take(f"{head}weight", (cfg.vocab_size, cfg.d_model))
        if not np.array_equal(tied, params["wte"]["embedding"]):
            raise ConversionError(f"'{head}weight' differs from '{prefix}embed_tokens.weight' "
                                  "although the config says tie_word_embeddings=True; pass "
                                  "tie_embeddings=False to keep a separate head")
    for key in reader.remaining():       # the multimodal model's vision side: not converted
        if vision and key.startswith(vision):
            reader.skip(key)
    reader.finish()
    params = to_layout(cast_params(params, cfg.param_dtype), cfg.layer_stacks, scanned=False,
                       what="Gemma params")
    return Gemma(cfg), params


# ============================================================================ flax -> HF

def gemma_to_state_dict(module: Gemma, params: Any) -> dict[str, np.ndarray]:
    """``(Gemma, params)`` -> ``Gemma3ForCausalLM`` state dict of numpy arrays; a tied
    ``lm_head.weight`` is the same array as ``model.embed_tokens.weight``."""
    cfg = module.config
    params = plain_params(params)
    out = dump_state_dict(gemma_tensor_maps(cfg), params, what="Gemma params")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


FAMILY = HFFamily(
    name="gemma", model_types=("gemma3_text", "gemma3"), config_type=GemmaConfig,
    from_state_dict=_gemma_from_state_dict, to_state_dict=gemma_to_state_dict,
    make_hf_config=gemma_hf_config)
