"""Hugging Face GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``) <-> :class:`~transformer_jax.models.gpt.GPT`.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="gpt2"``, ``GPTConfig``).

Weight layout. HF's ``Conv1D`` stores weights as (in, out), so nothing is transposed except
the (untied) ``lm_head`` (an ``nn.Linear``: (out, in)). One :class:`TensorMap` table
(:func:`gpt2_tensor_maps`) drives both directions, and ``GPT2_CONFIG_FIELDS`` does the same
for the config. Legend: V vocab, P positions, D width, N heads, H = D / N, F MLP width.

    HF key (after the optional ``transformer.`` prefix)   shape      flax path, shape
    wte.weight                                           (V, D)     wte/embedding (V, D)
    wpe.weight                                           (P, D)     wpe/embedding (P, D)
    h.{i}.ln_1.{weight,bias}                             (D,)       h_{i}/norm1/{scale,bias}
    h.{i}.attn.c_attn.weight                             (D, 3D)    self_attn/{query,key,value}/kernel (D, N, H)
    h.{i}.attn.c_attn.bias                               (3D,)      self_attn/{query,key,value}/bias (N, H)
    h.{i}.attn.c_proj.weight                             (D, D)     self_attn/out/kernel (N, H, D)
    h.{i}.attn.c_proj.bias                               (D,)       self_attn/out/bias (D,)
    h.{i}.ln_2.{weight,bias}                             (D,)       h_{i}/norm2/{scale,bias}
    h.{i}.mlp.c_fc.{weight,bias}                         (D, F)     mlp/wi/{kernel,bias}
    h.{i}.mlp.c_proj.{weight,bias}                       (F, D)     mlp/wo/{kernel,bias}
    ln_f.{weight,bias}                                   (D,)       ln_f/{scale,bias}
    lm_head.weight (untied only; no prefix)              (V, D)     lm_head/kernel (D, V)

With ``scan_layers=True`` the ``h_{i}`` subtrees are one ``h`` with a leading (L,) axis.

Keys that are not parameters:
  * ``lm_head.weight`` of a *tied* model (a live model's ``state_dict()`` lists it; a
    ``save_pretrained`` file omits it) is accepted only if it equals ``wte.weight``.
  * ``h.{i}.attn.bias`` (1, 1, P, P) and ``h.{i}.attn.masked_bias`` () are the causal-mask
    buffers that older transformers versions saved into checkpoints. They carry no learned
    state (our attention builds its causal mask itself), so they are dropped after a check:
    ``attn.bias`` must be the lower-triangular causal mask; ``masked_bias`` (the fill value
    for masked logits, -1e4) is only shape-checked, since any such fill gives a softmax
    weight of exactly 0 in fp32, as our finfo.min fill does. ``to_hf`` never emits them
    (current ``GPT2LMHeadModel`` has no such buffers, so a strict load rejects them).
  * Anything else unexpected, any missing key and any shape mismatch raise
    ``ConversionError`` naming the key (and the expected/actual shape).

A ``GPT2Model`` (no ``transformer.`` prefix, no LM head) converts to a ``GPT`` that reads
out through the tied embedding, whatever the config's ``tie_word_embeddings`` says.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...models.gpt import GPT, GPTConfig
from ..common import (ConversionError, Path, StateDictReader, TensorMap, attention_mismatches,
                      dump_state_dict, layer_norm, linear, load_params)
from .registry import (OUR_ACTIVATIONS_TO_HF, HFFamily, activation_from_hf,
                       activation_to_hf, cast_params, check_table, plain_params, to_layout,
                       without_scan)

#: HF config attribute <-> GPTConfig field, one table for both directions.
GPT2_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("n_positions", "max_len"),
    ("n_layer", "num_layers"),
    ("n_head", "num_heads"),
    ("n_embd", "d_model"),
    ("n_inner", "mlp_dim"),
    ("layer_norm_epsilon", "norm_eps"),
    ("tie_word_embeddings", "tie_embeddings"),
    ("resid_pdrop", "dropout_rate"),
    ("attn_pdrop", "attention_dropout_rate"),
    ("initializer_range", "initializer_range"),
)

#: HF options that our GPT implements only at one value: name -> the supported value.
GPT2_FIXED_OPTIONS: dict[str, Any] = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


# ============================================================================ config

def gpt_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """HF GPT-2 config (as a dict) -> ``GPTConfig``; unsupported options raise, naming them."""
    if config.get("model_type") != "gpt2":
        raise UserError(f"expected a GPT-2 config (model_type 'gpt2'), got model_type "
                        f"{config.get('model_type')!r}")
    for option, supported in GPT2_FIXED_OPTIONS.items():
        if option in config and config[option] != supported:
            raise UserError(f"unsupported GPT-2 config option {option}={config[option]!r}: "
                            f"transformer_jax's GPT implements only {option}={supported!r}")
    activation = activation_from_hf(config.get("activation_function", "gelu_new"),
                                    family="GPT-2", option="activation_function")
    embd, resid = config.get("embd_pdrop"), config.get("resid_pdrop")
    if embd is not None and resid is not None and embd != resid:
        warnings.warn(f"GPT-2 config has embd_pdrop={embd} != resid_pdrop={resid}; GPTConfig has "
                      f"one dropout_rate for both and uses resid_pdrop={resid} (no effect on "
                      "inference)", stacklevel=3)
    values = {ours: config[hf] for hf, ours in GPT2_CONFIG_FIELDS if hf in config}
    values["activation"] = activation
    values.update(overrides)
    return GPTConfig.from_dict(values)


def gpt2_hf_config(config: GPTConfig, **extra: Any):
    """``GPTConfig`` -> ``transformers.GPT2Config`` (lazy import); options GPT-2 lacks raise."""
    from transformers import GPT2Config

    _check_gpt2_compatible(config)
    values = {hf: getattr(config, ours) for hf, ours in GPT2_CONFIG_FIELDS}
    values.update(activation_function=activation_to_hf(config.activation, what="GPTConfig.activation"),
                  embd_pdrop=config.dropout_rate, **GPT2_FIXED_OPTIONS)
    # HF's default bos/eos (50256) only make sense inside the vocabulary.
    if config.vocab_size <= 50256:
        values.update(bos_token_id=None, eos_token_id=None)
    values.update(extra)
    return GPT2Config(**values)


def _check_gpt2_compatible(config: GPTConfig) -> None:
    """Raise for GPTConfig options that a GPT-2 checkpoint cannot express."""
    bad = []
    if config.num_kv_heads not in (None, config.num_heads):
        bad.append(f"num_kv_heads={config.num_kv_heads} (GPT-2 has no grouped-query attention)")
    if config.gated_mlp:
        bad.append("gated_mlp=True")
    if config.norm != "layernorm":
        bad.append(f"norm={config.norm!r}")
    if config.position != "learned":
        bad.append(f"position={config.position!r}")
    if not config.use_bias:
        bad.append("use_bias=False")
    if config.activation not in OUR_ACTIVATIONS_TO_HF:
        bad.append(f"activation={config.activation!r}")
    bad += attention_mismatches(config)
    if bad:
        raise UserError("GPTConfig option(s) not expressible as GPT-2: " + "; ".join(bad))


# ============================================================================ the table

def _conv1d(key_prefix: str, path: Path, in_features: int, out_features: int, *,
            kernel_shape: tuple[int, ...] | None = None) -> list[TensorMap]:
    """HF ``Conv1D`` (``weight`` (in, out), ``bias`` (out,)) <-> a Dense: no transpose."""
    return [TensorMap(f"{key_prefix}weight", (in_features, out_features),
                      ((path + ("kernel",), tuple(kernel_shape or (in_features, out_features))),)),
            TensorMap(f"{key_prefix}bias", (out_features,), ((path + ("bias",), (out_features,)),))]


def gpt2_tensor_maps(cfg: GPTConfig, prefix: str = "transformer.") -> list[TensorMap]:
    """Every HF tensor <-> flax leaf of ``GPT(cfg)`` (unscanned), in HF state-dict order.

    ``prefix`` is ``"transformer."`` for ``GPT2LMHeadModel`` and ``""`` for ``GPT2Model``.
    """
    d, f, n, h, v = cfg.d_model, cfg.mlp_features, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    maps = [TensorMap(f"{prefix}wte.weight", (v, d), ((("wte", "embedding"), (v, d)),)),
            TensorMap(f"{prefix}wpe.weight", (cfg.max_len, d),
                      ((("wpe", "embedding"), (cfg.max_len, d)),))]
    for i in range(cfg.num_layers):
        hf, ours = f"{prefix}h.{i}.", (f"h_{i}",)
        qkv = [ours + ("self_attn", proj) for proj in ("query", "key", "value")]
        maps += layer_norm(f"{hf}ln_1.", ours + ("norm1",), d)
        maps += [TensorMap(f"{hf}attn.c_attn.weight", (d, 3 * d),       # (D, 3D) -> 3 x (D, N, H)
                           tuple((p + ("kernel",), (d, n, h)) for p in qkv), split_axis=1),
                 TensorMap(f"{hf}attn.c_attn.bias", (3 * d,),           # (3D,) -> 3 x (N, H)
                           tuple((p + ("bias",), (n, h)) for p in qkv))]
        maps += _conv1d(f"{hf}attn.c_proj.", ours + ("self_attn", "out"), d, d, kernel_shape=(n, h, d))
        maps += layer_norm(f"{hf}ln_2.", ours + ("norm2",), d)
        maps += _conv1d(f"{hf}mlp.c_fc.", ours + ("mlp", "wi"), d, f)
        maps += _conv1d(f"{hf}mlp.c_proj.", ours + ("mlp", "wo"), f, d)
    maps += layer_norm(f"{prefix}ln_f.", ("ln_f",), d)
    if not cfg.tie_embeddings:
        maps += linear("lm_head.", ("lm_head",), d, v, bias=False)
    return maps


# ============================================================================ HF -> flax

def _take_legacy_buffers(reader: StateDictReader, cfg: GPTConfig, prefix: str) -> None:
    """Check and drop old checkpoints' causal-mask buffers (see the module docstring)."""
    p = cfg.max_len
    for i in range(cfg.num_layers):
        key = f"{prefix}h.{i}.attn.bias"
        if key in reader:
            mask = reader.take(key, (1, 1, p, p))
            if not np.array_equal(mask.reshape(p, p).astype(bool), np.tri(p, dtype=bool)):
                raise ConversionError(f"{key!r}: this causal-mask buffer is not lower-triangular "
                                      "ones; a model with another attention pattern is not GPT-2")
        if f"{prefix}h.{i}.attn.masked_bias" in reader:
            reader.take(f"{prefix}h.{i}.attn.masked_bias", ())


def causal_lm_from_state_dict(what: str, config_fn, tensor_maps, take_buffers,
                              state_dict: Mapping[str, Any], overrides: dict[str, Any], *,
                              embed_key: str, prefix: str) -> tuple[GPT, dict[str, Any]]:
    """A decoder-only LM's HF state dict -> ``(GPT, params)``: GPT-2 and Llama alike.

    ``what`` names the family in errors; ``config_fn(**overrides)`` makes the GPTConfig;
    ``tensor_maps(cfg, prefix)`` is the family's table; ``take_buffers(reader, cfg,
    prefix)`` checks and drops the buffers old checkpoints carry. The base model (no
    ``prefix`` before ``embed_key``, no head) reads out through the tied embedding; a tied
    ``lm_head.weight`` a live model lists must equal the embedding."""
    reader = StateDictReader(state_dict, what=f"{what} state dict")
    base_model = embed_key in reader and prefix + embed_key not in reader
    prefix = "" if base_model else prefix
    if base_model:                       # no LM head: read out through the embedding
        overrides = {"tie_embeddings": True, **overrides}
    cfg = config_fn(**overrides)
    maps = tensor_maps(cfg, prefix)
    inputs = (jnp.zeros((1, 1), jnp.int32),)
    check_table(maps, GPT(without_scan(cfg)), *inputs, what=what)
    target = getattr(state_dict, "load_target", None)
    if target is None:
        params = load_params(maps, reader, finish=False)
    else:                                # tensor by tensor onto the devices (hf/stream.py)
        from .stream import stream_params
        params = stream_params(maps, reader, param_dtype=cfg.param_dtype,
                               stacks=cfg.layer_stacks, scanned=cfg.scan_layers,
                               target=target, module=GPT(cfg), inputs=inputs)
    if cfg.tie_embeddings and not base_model and "lm_head.weight" in reader:
        head = reader.take("lm_head.weight", (cfg.vocab_size, cfg.d_model))
        embedding = np.asarray(params["wte"]["embedding"])
        if not np.array_equal(head.astype(embedding.dtype), embedding):
            raise ConversionError(f"'lm_head.weight' differs from '{prefix}{embed_key}' although "
                                  "the config says tie_word_embeddings=True; pass "
                                  "tie_embeddings=False to keep a separate head")
    take_buffers(reader, cfg, prefix)
    reader.finish()
    if target is not None:               # cast, laid out and placed already
        return GPT(cfg), params
    params = to_layout(cast_params(params, cfg.param_dtype), cfg.layer_stacks,
                       scanned=cfg.scan_layers, what="GPT params")
    return GPT(cfg), params


def causal_lm_to_state_dict(module: GPT, params: Any, check, tensor_maps,
                            embed_key: str) -> dict[str, np.ndarray]:
    """``(GPT, params)`` -> a decoder-only LM's HF state dict (``check(cfg)`` refuses what
    the family cannot express; ``embed_key`` is the full key of the token embedding, which
    a tied ``lm_head.weight`` shares)."""
    cfg = module.config
    check(cfg)
    params = to_layout(plain_params(params), cfg.layer_stacks, scanned=False, what="GPT params")
    out = dump_state_dict(tensor_maps(cfg), params, what="GPT params")
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out[embed_key]
    return out


def _gpt2_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                          **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """GPT-2 state dict (``GPT2LMHeadModel`` or ``GPT2Model`` naming) -> ``(GPT, params)``."""
    return causal_lm_from_state_dict(
        "GPT-2", lambda **o: gpt_config_from_hf(config, **o), gpt2_tensor_maps,
        _take_legacy_buffers, state_dict, overrides, embed_key="wte.weight",
        prefix="transformer.")


# ============================================================================ flax -> HF

def gpt2_to_state_dict(module: GPT, params: Any) -> dict[str, np.ndarray]:
    """``(GPT, params)`` -> ``GPT2LMHeadModel`` state dict of numpy arrays.

    ``params`` may be the params tree or the whole ``{'params': ...}`` variables dict,
    boxed (``nn.Partitioned``) or not, in either layout (``h_{i}`` or a scanned ``h``).
    A tied ``lm_head.weight`` is the same array as ``transformer.wte.weight``.
    """
    return causal_lm_to_state_dict(module, params, _check_gpt2_compatible, gpt2_tensor_maps,
                                   "transformer.wte.weight")


FAMILY = HFFamily(
    name="gpt2", model_types=("gpt2",), config_type=GPTConfig,
    from_state_dict=_gpt2_from_state_dict, to_state_dict=gpt2_to_state_dict,
    make_hf_config=gpt2_hf_config)
