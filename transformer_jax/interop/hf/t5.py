"""Hugging Face ``T5ForConditionalGeneration`` <-> :class:`~transformer_jax.models.t5.T5`.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="t5"``, ``T5Config``)::

    module, params = from_hf(hf_t5_model)            # or a local save_pretrained directory
    state_dict = to_hf(module, params)               # strict-loadable torch tensors
    hf_model = to_hf_model(module, params)           # a live T5ForConditionalGeneration

A ``save_pretrained`` directory (``config.json`` + safetensors) is read without torch.

Weight layout (legend: V vocab, D width, N heads, H = d_kv, I = N H, F = d_ff, R buckets;
``{s}`` = ``encoder``|``decoder``, ``{i}`` = layer; HF ``nn.Linear`` weights are (out, in) and
are transposed into (in, out...) kernels)::

    HF key                                                     shape     flax path
    shared.weight                                              (V, D)    shared/embedding
    {s}.block.0.layer.0.SelfAttention.relative_attention_bias.weight
                                                               (R, N)    {s}/relative_attention_bias
    {s}.block.{i}.layer.0.SelfAttention.{q,k,v}.weight         (I, D)    {s}/layers_{i}/self_attn/{query,key,value}/kernel (D, N, H)
    {s}.block.{i}.layer.0.SelfAttention.o.weight               (D, I)    {s}/layers_{i}/self_attn/out/kernel (N, H, D)
    {s}.block.{i}.layer.0.layer_norm.weight                    (D,)      {s}/layers_{i}/norm1/scale
    decoder.block.{i}.layer.1.EncDecAttention.{q,k,v,o}.weight           decoder/layers_{i}/cross_attn/...
    decoder.block.{i}.layer.1.layer_norm.weight                (D,)      decoder/layers_{i}/norm2/scale
    {s}.block.{i}.layer.{f}.DenseReluDense.wi.weight           (F, D)    {s}/layers_{i}/mlp/wi/kernel (D, F)
        (v1.1: wi_0 and wi_1 -> mlp/wi_0, mlp/wi_1)
    {s}.block.{i}.layer.{f}.DenseReluDense.wo.weight           (D, F)    {s}/layers_{i}/mlp/wo/kernel (F, D)
    {s}.block.{i}.layer.{f}.layer_norm.weight                  (D,)      norm2 (encoder) | norm3 (decoder)
    {s}.final_layer_norm.weight                                (D,)      {s}/final_norm/scale
    lm_head.weight (untied only)                               (V, D)    lm_head/kernel (D, V)

with ``f`` = 1 in the encoder and 2 in the decoder. With ``scan_layers=True`` the
``layers_{i}`` subtrees of each stack are one ``{s}/layers`` with a leading (L,) axis.

Aliases, handled explicitly:
  * ``shared.weight``, ``encoder.embed_tokens.weight`` and ``decoder.embed_tokens.weight``
    are one tensor in HF. A live model's ``state_dict()`` lists all three; ``save_pretrained``
    keeps only ``shared.weight``. Reading takes the first present one (in that order) as
    the embedding and requires every other present alias to be equal (else
    ``ConversionError``: untied input embeddings are not a T5). Writing emits all three as
    one array (``to_hf`` turns it into one shared torch tensor, as in HF).
  * ``lm_head.weight``. HF >= 5 always *ties* it to ``shared`` in a model built from a
    config (``tie_word_embeddings`` only decides the D^-1/2 output scaling, stored as
    ``scale_decoder_outputs``), and unties it while loading a checkpoint whose two tensors
    differ (the v1.1 checkpoints). So: the flax model is tied iff ``lm_head.weight`` is
    absent or equal to the embedding (overridable with ``tie_embeddings=False``); an HF
    4.x config with ``tie_word_embeddings=False`` and no ``scale_decoder_outputs`` is
    untied and needs its ``lm_head.weight``. The output scaling comes from
    ``scale_decoder_outputs`` when present, else from ``tie_word_embeddings`` (default
    True). ``to_hf`` always emits ``lm_head.weight`` (the embedding itself when tied).
    An untied model does not fit a ``T5ForConditionalGeneration(config)`` built by HF >= 5
    (its lm_head *is* the embedding); :func:`to_hf_model` builds one with a separate head.
  * ``decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight``: present in
    some old checkpoints, never used (HF lists it in ``_keys_to_ignore_on_load_unexpected``);
    shape-checked and dropped.

Every other key must be consumed exactly once with its exact shape (``ConversionError``
naming the key otherwise); ``to_hf`` asserts every flax leaf the same way.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...models.t5 import T5, T5Config
from ..common import (ConversionError, StateDictReader, TensorMap, as_numpy, dump_state_dict,
                      linear, load_params)
from .registry import (HF_ACTIVATIONS, HFFamily, activation_to_hf, cast_params,
                       check_table, plain_params, to_layout, torch_tensors, without_scan)

#: HF config attribute <-> T5Config field (both directions).
T5_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("d_model", "d_model"),
    ("d_kv", "head_dim"),
    ("d_ff", "mlp_dim"),
    ("num_layers", "num_layers"),
    ("num_decoder_layers", "num_decoder_layers"),
    ("num_heads", "num_heads"),
    ("relative_attention_num_buckets", "relative_attention_num_buckets"),
    ("relative_attention_max_distance", "relative_attention_max_distance"),
    ("dropout_rate", "dropout_rate"),
    ("layer_norm_epsilon", "norm_eps"),
    ("initializer_factor", "initializer_factor"),
    ("pad_token_id", "pad_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("decoder_start_token_id", "decoder_start_token_id"),
)

_EMBEDDING_ALIASES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_UNUSED_CROSS_BIAS = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"


# ----------------------------------------------------------------------------- config

def t5_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> T5Config:
    """HF T5 config (dict) -> ``T5Config``; unsupported options raise, naming them."""
    if config.get("model_type") != "t5":
        raise UserError(f"expected a T5 config (model_type 't5'), got {config.get('model_type')!r}")
    if config.get("is_encoder_decoder", True) is not True:
        raise UserError("unsupported T5 config option is_encoder_decoder=False: transformer_jax's "
                        "T5 is the encoder-decoder model")
    proj = config.get("feed_forward_proj", "relu")
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise UserError(f"unsupported T5 config option feed_forward_proj={proj!r}; expected "
                        "'ACT' or 'gated-ACT'")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]     # HF's own special case
    if act not in HF_ACTIVATIONS:
        raise UserError(f"unsupported T5 config option feed_forward_proj={proj!r}: activation "
                        f"{act!r} is not one of {sorted(HF_ACTIVATIONS)}")
    values = {ours: config[hf] for hf, ours in T5_CONFIG_FIELDS
              if hf in config and config[hf] is not None}
    eos = values.get("eos_token_id")
    if isinstance(eos, (list, tuple)):
        if len(eos) != 1:
            raise UserError(f"unsupported T5 config option eos_token_id={eos!r}: one eos id only")
        values["eos_token_id"] = eos[0]
    values.setdefault("decoder_start_token_id", values.get("pad_token_id", 0))
    values["activation"] = HF_ACTIVATIONS[act]
    values["gated_mlp"] = len(parts) == 2
    tie = bool(config.get("tie_word_embeddings", True))
    scale = bool(config["scale_decoder_outputs"]) if "scale_decoder_outputs" in config else tie
    if "scale_decoder_outputs" not in config:           # HF 4.x: the flag ties and scales
        values["tie_embeddings"] = tie
    values.update(overrides)
    values.setdefault("tie_embeddings", True)
    if scale != values["tie_embeddings"]:
        values.setdefault("scale_decoder_output", scale)
    return T5Config.from_dict(values)


def _feed_forward_proj(config: T5Config) -> str:
    """HF's ``feed_forward_proj`` for ``config``: ``ACT`` or ``gated-ACT``.

    HF reads ``gated-gelu`` as the tanh GELU, so that is the name written for it, and the
    exact GELU, gated, is written ``gated-gelu_python``.
    """
    if not config.gated_mlp:
        return activation_to_hf(config.activation, what="T5Config.activation")
    if config.activation == "gelu_tanh":
        return "gated-gelu"
    if config.activation == "gelu":
        return "gated-gelu_python"
    return "gated-" + activation_to_hf(config.activation, what="T5Config.activation")


def t5_hf_config(config: T5Config, **extra: Any):
    """``T5Config`` -> ``transformers.T5Config`` (lazy import).

    ``tie_word_embeddings`` is written as the output *scaling* (its meaning in HF >= 5, and
    in HF 4.x for the standard tied-and-scaled / untied-and-unscaled models).
    """
    from transformers import T5Config as HFT5Config

    values = {hf: getattr(config, ours) for hf, ours in T5_CONFIG_FIELDS}
    values.update(num_decoder_layers=config.decoder_layers, d_ff=config.mlp_features)
    values.update(feed_forward_proj=_feed_forward_proj(config),
                  tie_word_embeddings=config.scales_output, is_encoder_decoder=True)
    values.update(extra)
    return HFT5Config(**values)


# ----------------------------------------------------------------------------- tensor maps

def _norm(key: str, path: tuple[str, ...], d: int) -> TensorMap:
    return TensorMap(key, (d,), ((path + ("scale",), (d,)),))


def _attention(prefix: str, path: tuple[str, ...], cfg: T5Config) -> list[TensorMap]:
    d, n, h, i = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.inner_dim
    maps = []
    for hf, ours in (("q", "query"), ("k", "key"), ("v", "value")):
        maps += linear(f"{prefix}.{hf}.", path + (ours,), d, i, bias=False, kernel_shape=(d, n, h))
    maps += linear(f"{prefix}.o.", path + ("out",), i, d, bias=False, kernel_shape=(n, h, d))
    return maps


def t5_tensor_maps(cfg: T5Config, *, embedding_key: str = "shared.weight") -> list[TensorMap]:
    """Every HF tensor <-> flax leaf pair of ``T5(cfg)``, in HF state-dict order (aliases excluded)."""
    d, f, v = cfg.d_model, cfg.mlp_features, cfg.vocab_size
    maps = [TensorMap(embedding_key, (v, d), ((("shared", "embedding"), (v, d)),))]
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.decoder_layers)):
        decoder = stack == "decoder"
        for i in range(layers):
            hf, ours = f"{stack}.block.{i}.layer.", (stack, f"layers_{i}")
            maps += _attention(f"{hf}0.SelfAttention", ours + ("self_attn",), cfg)
            if i == 0:
                shape = (cfg.relative_attention_num_buckets, cfg.num_heads)
                maps.append(TensorMap(f"{hf}0.SelfAttention.relative_attention_bias.weight", shape,
                                      (((stack, "relative_attention_bias"), shape),)))
            maps.append(_norm(f"{hf}0.layer_norm.weight", ours + ("norm1",), d))
            ff = 1
            if decoder:
                maps += _attention(f"{hf}1.EncDecAttention", ours + ("cross_attn",), cfg)
                maps.append(_norm(f"{hf}1.layer_norm.weight", ours + ("norm2",), d))
                ff = 2
            mlp = f"{hf}{ff}.DenseReluDense."
            for name in (("wi_0", "wi_1") if cfg.gated_mlp else ("wi",)):
                maps += linear(f"{mlp}{name}.", ours + ("mlp", name), d, f, bias=False)
            maps += linear(f"{mlp}wo.", ours + ("mlp", "wo"), f, d, bias=False)
            maps.append(_norm(f"{hf}{ff}.layer_norm.weight", ours + ("norm3" if decoder else "norm2",), d))
        maps.append(_norm(f"{stack}.final_layer_norm.weight", (stack, "final_norm"), d))
    if not cfg.tie_embeddings:
        maps += linear("lm_head.", ("lm_head",), d, v, bias=False)
    return maps


# ----------------------------------------------------------------------------- HF -> flax

def _t5_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                        **overrides: Any) -> tuple[T5, dict[str, Any]]:
    """HF ``T5ForConditionalGeneration`` state dict -> ``(T5, params)`` (see the module docstring)."""
    present = [k for k in _EMBEDDING_ALIASES if k in state_dict]
    if not present:
        raise ConversionError(f"T5 state dict: none of the embedding keys {list(_EMBEDDING_ALIASES)} "
                              "is present")
    embedding = as_numpy(state_dict[present[0]])
    head = as_numpy(state_dict["lm_head.weight"]) if "lm_head.weight" in state_dict else None
    tie = head is None or (head.shape == embedding.shape and np.array_equal(head, embedding))
    hf4_untied = "scale_decoder_outputs" not in config and config.get("tie_word_embeddings") is False
    if hf4_untied:
        tie = False
    if "tie_embeddings" in overrides:
        if overrides["tie_embeddings"] and not tie:
            raise ConversionError("T5 state dict: 'lm_head.weight' differs from the embedding (or the "
                                  "config says tie_word_embeddings=False), so the head cannot be tied; "
                                  "drop the tie_embeddings=True override")
        if not overrides["tie_embeddings"] and head is None:
            raise ConversionError("T5 state dict: tie_embeddings=False needs 'lm_head.weight', which "
                                  "is missing")
        tie = overrides["tie_embeddings"]
    cfg = t5_config_from_hf(config, **{**overrides, "tie_embeddings": tie})

    reader = StateDictReader(state_dict, what="T5 state dict")
    shape = (cfg.vocab_size, cfg.d_model)
    for alias in present[1:]:
        if not np.array_equal(reader.take(alias, shape), embedding):
            raise ConversionError(f"T5 state dict: {alias!r} differs from {present[0]!r}; T5 shares one "
                                  "input embedding between encoder and decoder")
    if tie and head is not None:
        reader.take("lm_head.weight", shape)            # equal to the embedding (checked above)
    if _UNUSED_CROSS_BIAS in reader:
        reader.take(_UNUSED_CROSS_BIAS, (cfg.relative_attention_num_buckets, cfg.num_heads))
    maps = t5_tensor_maps(cfg, embedding_key=present[0])
    ids = jnp.zeros((1, 2), jnp.int32)
    check_table(maps, T5(without_scan(cfg)), ids, ids, what="T5")
    params = load_params(maps, reader)
    params = to_layout(cast_params(params, cfg.param_dtype), cfg.layer_stacks,
                       scanned=getattr(cfg, "scan_layers", False), what="T5 params")
    return T5(cfg), params


# ----------------------------------------------------------------------------- flax -> HF

def t5_to_state_dict(module: T5, params: Any) -> dict[str, np.ndarray]:
    """``(T5, params)`` -> ``T5ForConditionalGeneration`` state dict of numpy arrays.

    ``params`` may be the params tree or ``{'params': ...}``, boxed or not, in either layout.
    The three embedding aliases (and ``lm_head.weight`` when tied) are the same array.
    """
    cfg = module.config
    _feed_forward_proj(cfg)                      # raises for activations HF cannot express
    params = to_layout(plain_params(params), cfg.layer_stacks, scanned=False, what="T5 params")
    flat = dump_state_dict(t5_tensor_maps(cfg), params, what="T5 params")
    out: dict[str, np.ndarray] = {}
    shared = flat.pop("shared.weight")
    out["shared.weight"] = shared
    out["encoder.embed_tokens.weight"] = shared
    out.update({k: v for k, v in flat.items() if k.startswith("encoder.")})
    out["decoder.embed_tokens.weight"] = shared
    out.update({k: v for k, v in flat.items() if k.startswith("decoder.")})
    out["lm_head.weight"] = shared if cfg.tie_embeddings else flat["lm_head.weight"]
    return out


def to_hf_model(module: T5, params: Any | None = None):
    """A live ``transformers.T5ForConditionalGeneration`` (eval mode) equivalent to ``module``.

    Built from :func:`t5_hf_config`; for an untied ``module`` the lm_head is given its own
    parameter (HF >= 5 would tie it to ``shared``), so that ``save_pretrained`` writes it and
    training updates it separately. With ``params`` the weights are loaded (strict).
    """
    import torch
    from transformers import T5ForConditionalGeneration

    cfg = module.config
    model = T5ForConditionalGeneration(t5_hf_config(cfg))
    if not cfg.tie_embeddings and model.lm_head.weight is model.shared.weight:
        model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
        tied = getattr(model, "all_tied_weights_keys", None)
        if isinstance(tied, dict):
            tied.pop("lm_head.weight", None)
    if params is not None:
        model.load_state_dict(torch_tensors(t5_to_state_dict(module, params)), strict=True)
    return model.eval()


FAMILY = HFFamily(
    name="t5", model_types=("t5",), config_type=T5Config,
    from_state_dict=_t5_from_state_dict, to_state_dict=t5_to_state_dict,
    make_hf_config=t5_hf_config)
