"""Hugging Face CLIP (``CLIPModel``) <-> transformer_jax ``CLIP``.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="clip"``, ``CLIPConfig``)::

    module, params = from_hf(hf_model)                 # a live CLIPModel
    module, params = from_hf("/path/to/save_pretrained_dir", scan_layers=True)
    state_dict = to_hf(module, params)                 # torch tensors, strict-loadable
    hf_cfg = hf_config(module.config)                  # transformers.CLIPConfig

Images. HF takes ``pixel_values`` NCHW; our ``CLIP`` takes NHWC: ``x.transpose(0, 2, 3, 1)``.

Config. HF nests a ``text_config`` and a ``vision_config``; ours is flat
(``CLIP_CONFIG_FIELDS``). Options both towers have (``hidden_act``, ``layer_norm_eps``,
``attention_dropout``, ``initializer_range``) are one field here: towers that disagree on
the activation or the norm epsilon are refused, naming both values; different attention
dropouts (training only) take the text tower's, with a warning. A key missing from a
``config.json`` (``save_pretrained`` writes only what differs from HF's defaults) takes
HF's default, which is ours (``CLIPConfig()`` is HF's ``CLIPConfig()``: ViT-B/32). HF
CLIP has no residual dropout: ``dropout_rate`` is not written, and reads back as 0. The
sub-configs' ``projection_dim`` and ``initializer_factor`` shape nothing ``CLIPModel``
builds (its own ``projection_dim`` does) and are ignored.

Pooling. HF pools captions at their largest id when ``text_config.eos_token_id == 2``
(configs from before transformers PR 24773), else at the first ``eos_token_id``: that is
``text_pooling="argmax"`` or ``"eos"`` here. ``hf_config`` writes ``eos_token_id=2`` for
``"argmax"``, and refuses ``"eos"`` pooling with ``eos_token_id == 2`` (HF would read such
captions at their largest id instead).

Keys. Legend: V vocab, T_max text positions, D_t/D_v widths, N heads, H = D/N, F MLP
width, C channels, P patch, T_v = (image_size/P)^2 + 1 image tokens, E projection width.

    HF key (text_model. / vision_model. prefixes)    shape          flax path (shape)
    text_model.embeddings.token_embedding.weight     (V, D_t)       text/token_embedding/embedding
    text_model.embeddings.position_embedding.weight  (T_max, D_t)   text/position_embedding/embedding
    text_model.encoder.layers.{i}.<layer>                           text/layers_{i}/<block>
    text_model.final_layer_norm.{weight,bias}        (D_t,)         text/final_norm/{scale,bias}
    vision_model.embeddings.class_embedding          (D_v,)         vision/cls
    vision_model.embeddings.patch_embedding.weight   (D_v, C, P, P) vision/embedding/kernel
                                                     OIHW -> HWIO   (P, P, C, D_v)
    vision_model.embeddings.position_embedding.weight  (T_v, D_v)   vision/pos_embedding
    vision_model.pre_layrnorm.{weight,bias}          (D_v,)         vision/embedding_norm/...
    vision_model.encoder.layers.{i}.<layer>                         vision/encoderblock_{i}/<block>
    vision_model.post_layernorm.{weight,bias}        (D_v,)         vision/encoder_norm/...
    visual_projection.weight                         (E, D_v)       visual_projection/kernel (D_v, E)
    text_projection.weight                           (E, D_t)       text_projection/kernel (D_t, E)
    logit_scale                                      ()             logit_scale ()

  <layer> -> <block> (one table for both towers):
    layer_norm1.{weight,bias}         (D,)           norm1/{scale,bias}
    self_attn.{q,k,v}_proj.weight     (D, D)         self_attn/{query,key,value}/kernel (D, N, H)
    self_attn.{q,k,v}_proj.bias       (D,)           self_attn/{query,key,value}/bias (N, H)
    self_attn.out_proj.{weight,bias}  (D, D), (D,)   self_attn/out/kernel (N, H, D), bias (D,)
    layer_norm2.{weight,bias}         (D,)           norm2/{scale,bias}
    mlp.fc1.{weight,bias}             (F, D), (F,)   mlp/wi/kernel (D, F), bias (F,)
    mlp.fc2.{weight,bias}             (D, F), (D,)   mlp/wo/kernel (F, D), bias (D,)

HF's ``post_layernorm`` normalises the CLS token only; ours normalises every token and
takes the CLS one (the same numbers). The ``position_ids`` buffers that older checkpoints
saved (``*.embeddings.position_ids``, (1, T)) are accepted when they hold 0, 1, ... and
dropped (``to_hf`` never writes them). Every other key and every shape is asserted
(``StateDictReader``): a missing, unexpected or misshapen key raises ``ConversionError``
naming it.

``from_hf(..., image_size=S)`` resizes the vision position table
(:func:`~transformer_jax.models.clip.resize_params`: bicubic, the arithmetic of HF's
``interpolate_pos_encoding``; ``pos_interpolation="bilinear"`` for the other).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...models.clip import CLIP, CLIPConfig, resize_params
from ..common import (ConversionError, Path, StateDictReader, TensorMap, dump_state_dict,
                      layer_norm, linear, load_params, refuse_attention_options)
from .registry import (HFFamily, activation_from_hf, activation_to_hf, cast_params,
                       check_table, plain_params, to_layout, without_scan)

#: (HF sub-config or "" for the top level, HF attribute, CLIPConfig field): both directions.
CLIP_CONFIG_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("text_config", "vocab_size", "vocab_size"),
    ("text_config", "max_position_embeddings", "max_len"),
    ("text_config", "eos_token_id", "eos_token_id"),
    ("text_config", "pad_token_id", "pad_token_id"),
    ("text_config", "num_hidden_layers", "text_layers"),
    ("text_config", "num_attention_heads", "text_heads"),
    ("text_config", "hidden_size", "text_width"),
    ("text_config", "intermediate_size", "text_mlp_dim"),
    ("vision_config", "image_size", "image_size"),
    ("vision_config", "patch_size", "patch_size"),
    ("vision_config", "num_channels", "num_channels"),
    ("vision_config", "num_hidden_layers", "vision_layers"),
    ("vision_config", "num_attention_heads", "vision_heads"),
    ("vision_config", "hidden_size", "vision_width"),
    ("vision_config", "intermediate_size", "vision_mlp_dim"),
    ("", "projection_dim", "projection_dim"),
    ("", "logit_scale_init_value", "logit_scale_init"),
)

#: HF options of each tower that are one CLIPConfig field (both towers written alike).
CLIP_SHARED_FIELDS: tuple[tuple[str, str], ...] = (
    ("hidden_act", "activation"),
    ("layer_norm_eps", "norm_eps"),
    ("attention_dropout", "attention_dropout_rate"),
    ("initializer_range", "initializer_range"),
)

TOWERS = ("text_config", "vision_config")
#: HF's text_config.eos_token_id that selects argmax pooling (transformers PR 24773)
LEGACY_EOS_TOKEN_ID = 2

# ============================================================================ config


def _sub_config(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A tower's HF config as a dict; the legacy ``<name>_dict`` entries win, as in HF."""
    sub = config.get(name) or {}
    sub = sub if isinstance(sub, Mapping) else sub.to_dict()
    return {**sub, **(config.get(name + "_dict") or {})}


def _square(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise UserError(f"unsupported CLIP config vision_config.{name}={value!r}: "
                            "transformer_jax's CLIP takes square images and patches")
        value = value[0]
    return int(value)


def _shared_values(towers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The CLIPConfig fields both towers set (``CLIP_SHARED_FIELDS``; a key a tower lacks
    is HF's default, the same in both towers and ours). Towers that disagree on what the
    model computes raise, naming both values; on the attention dropout (training only)
    the text tower's wins, with a warning; on the initializer range, the text tower's."""
    defaults = {f.name: f.default for f in dataclasses.fields(CLIPConfig)}
    values = {}
    for hf, ours in CLIP_SHARED_FIELDS:
        text, vision = (towers[name].get(hf, defaults[ours]) for name in TOWERS)
        if text != vision and ours in ("activation", "norm_eps"):
            raise UserError(f"unsupported CLIP config: text_config.{hf}={text!r} but "
                            f"vision_config.{hf}={vision!r}; transformer_jax's CLIP has one "
                            f"{ours} for both towers")
        if text != vision and ours == "attention_dropout_rate":
            warnings.warn(f"CLIP config has text_config.attention_dropout={text} and "
                          f"vision_config.attention_dropout={vision}; CLIPConfig has one "
                          "attention_dropout_rate and uses the text tower's (no effect on "
                          "inference)", stacklevel=4)
        values[ours] = text
    values["activation"] = activation_from_hf(values["activation"], family="CLIP",
                                              option="hidden_act")
    return values


def clip_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> CLIPConfig:
    """HF CLIP config (a dict) -> ``CLIPConfig``; unsupported options raise, naming them."""
    if config.get("model_type") != "clip":
        raise UserError(f"expected a CLIP config (model_type 'clip'), got model_type "
                        f"{config.get('model_type')!r}")
    towers = {name: _sub_config(config, name) for name in TOWERS}
    eos = towers["text_config"].get("eos_token_id", 49407)
    if not isinstance(eos, int) or isinstance(eos, bool):
        raise UserError(f"unsupported CLIP config option text_config.eos_token_id={eos!r}: "
                        "transformer_jax's CLIP pools at one end-of-text id (an integer)")
    values = {ours: (towers[sub] if sub else config)[hf]
              for sub, hf, ours in CLIP_CONFIG_FIELDS if hf in (towers[sub] if sub else config)}
    for name in ("image_size", "patch_size"):
        if name in values:
            values[name] = _square(values[name], name)
    values["text_pooling"] = "argmax" if eos == LEGACY_EOS_TOKEN_ID else "eos"
    values.update(_shared_values(towers))
    values.update(overrides)
    return CLIPConfig.from_dict(values)


def clip_hf_config(config: CLIPConfig, **extra: Any):
    """``CLIPConfig`` -> ``transformers.CLIPConfig`` (lazy import); ``extra`` goes to the
    top level (e.g. ``logit_scale_init_value``), or into a tower as ``text_config={...}``."""
    from transformers import CLIPConfig as HFCLIPConfig

    _check_pooling(config)
    towers: dict[str, dict[str, Any]] = {name: {} for name in TOWERS}
    top: dict[str, Any] = {}
    for sub, hf, ours in CLIP_CONFIG_FIELDS:
        (towers[sub] if sub else top)[hf] = getattr(config, ours)
    if config.text_pooling == "argmax":               # HF's switch for argmax pooling
        towers["text_config"]["eos_token_id"] = LEGACY_EOS_TOKEN_ID
    towers["text_config"]["intermediate_size"] = config.text_mlp_features
    towers["vision_config"]["intermediate_size"] = config.vision_mlp_features
    shared = {hf: getattr(config, ours) for hf, ours in CLIP_SHARED_FIELDS}
    shared["hidden_act"] = activation_to_hf(config.activation, what="CLIPConfig.activation")
    for name in TOWERS:
        towers[name].update(shared)
        towers[name].update(extra.pop(name, None) or {})
    # HF's default bos (49406) only makes sense inside the vocabulary
    towers["text_config"].setdefault("bos_token_id",
                                     49406 if config.vocab_size > 49406 else None)
    return HFCLIPConfig(**towers, **top, **extra)


def _check_pooling(config: CLIPConfig) -> None:
    """What an HF CLIP checkpoint cannot express: efficient attention, and first-eos
    pooling at the id that HF reads as the switch to argmax pooling."""
    refuse_attention_options(config, "CLIP")
    if config.text_pooling == "eos" and config.eos_token_id == LEGACY_EOS_TOKEN_ID:
        raise UserError(f"CLIPConfig.eos_token_id={LEGACY_EOS_TOKEN_ID} with text_pooling='eos' "
                        "has no Hugging Face equivalent: HF pools configs with eos_token_id=2 "
                        "at the largest token id (text_pooling='argmax'); train with another "
                        "end-of-text id")


# ============================================================================ tensor maps

def _encoder_layer(key: str, path: Path, d: int, n: int, f: int) -> list[TensorMap]:
    """One ``CLIPEncoderLayer`` at HF ``key`` <-> our ``EncoderBlock`` at ``path``."""
    h = d // n
    attn = path + ("self_attn",)
    maps = layer_norm(key + "layer_norm1.", path + ("norm1",), d)
    for hf, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        maps += linear(f"{key}self_attn.{hf}.", attn + (ours,), d, d, kernel_shape=(d, n, h),
                       bias_shape=(n, h))
    maps += linear(key + "self_attn.out_proj.", attn + ("out",), d, d, kernel_shape=(n, h, d))
    maps += layer_norm(key + "layer_norm2.", path + ("norm2",), d)
    maps += linear(key + "mlp.fc1.", path + ("mlp", "wi"), d, f)
    maps += linear(key + "mlp.fc2.", path + ("mlp", "wo"), f, d)
    return maps


def clip_tensor_maps(cfg: CLIPConfig) -> list[TensorMap]:
    """Every HF tensor <-> flax leaf of ``cfg`` (unscanned), in HF state-dict order."""
    dt, dv, e = cfg.text_width, cfg.vision_width, cfg.projection_dim
    p, c, tv = cfg.patch_size, cfg.num_channels, cfg.vision_config.seq_len
    maps = [TensorMap("logit_scale", (), ((("logit_scale",), ()),))]
    t = "text_model."
    maps += [
        TensorMap(t + "embeddings.token_embedding.weight", (cfg.vocab_size, dt),
                  ((("text", "token_embedding", "embedding"), (cfg.vocab_size, dt)),)),
        TensorMap(t + "embeddings.position_embedding.weight", (cfg.max_len, dt),
                  ((("text", "position_embedding", "embedding"), (cfg.max_len, dt)),)),
    ]
    for i in range(cfg.text_layers):
        maps += _encoder_layer(f"{t}encoder.layers.{i}.", ("text", f"layers_{i}"), dt,
                               cfg.text_heads, cfg.text_mlp_features)
    maps += layer_norm(t + "final_layer_norm.", ("text", "final_norm"), dt)
    v = "vision_model."
    maps += [
        TensorMap(v + "embeddings.class_embedding", (dv,), ((("vision", "cls"), (dv,)),)),
        TensorMap(v + "embeddings.patch_embedding.weight", (dv, c, p, p),      # OIHW -> HWIO
                  ((("vision", "embedding", "kernel"), (p, p, c, dv)),), transpose=(2, 3, 1, 0)),
        TensorMap(v + "embeddings.position_embedding.weight", (tv, dv),
                  ((("vision", "pos_embedding"), (tv, dv)),)),
    ]
    maps += layer_norm(v + "pre_layrnorm.", ("vision", "embedding_norm"), dv)
    for i in range(cfg.vision_layers):
        maps += _encoder_layer(f"{v}encoder.layers.{i}.", ("vision", f"encoderblock_{i}"), dv,
                               cfg.vision_heads, cfg.vision_mlp_features)
    maps += layer_norm(v + "post_layernorm.", ("vision", "encoder_norm"), dv)
    maps += linear("visual_projection.", ("visual_projection",), dv, e, bias=False)
    maps += linear("text_projection.", ("text_projection",), dt, e, bias=False)
    return maps


def _example_inputs(cfg: CLIPConfig) -> tuple[Any, Any]:
    return (jnp.zeros((1, min(cfg.max_len, 8)), jnp.int32),
            jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.num_channels), jnp.float32))


# ============================================================================ HF -> flax

def _drop_position_ids(reader: StateDictReader, cfg: CLIPConfig) -> None:
    """Accept (and drop) the ``position_ids`` buffers older checkpoints saved, if 0, 1, ..."""
    buffers = {"text_model.embeddings.position_ids": cfg.max_len,
               "vision_model.embeddings.position_ids": cfg.vision_config.seq_len}
    for key, n in buffers.items():
        if key in reader:
            ids = reader.take(key, (1, n))
            if not np.array_equal(ids, np.arange(n)[None]):
                raise ConversionError(f"CLIP state dict: {key!r} is not 0, 1, ..., {n - 1}; "
                                      "transformer_jax's CLIP numbers positions from 0")


def _clip_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                          **overrides: Any) -> tuple[CLIP, dict[str, Any]]:
    """HF ``CLIPModel`` state dict -> ``(CLIP, params)``.

    ``overrides``: CLIPConfig fields (``image_size`` resizes the vision position table),
    plus ``pos_interpolation`` (``"bicubic"``/``"bilinear"``) for that resizing.
    """
    method = overrides.pop("pos_interpolation", "bicubic")
    target_size = overrides.pop("image_size", None)
    stored_patch = _square(_sub_config(config, "vision_config").get("patch_size", 32),
                           "patch_size")
    if overrides.get("patch_size", stored_patch) != stored_patch:
        raise UserError("from_hf cannot change patch_size: the patch embedding is fixed by the "
                        "checkpoint (image_size can change; the position table is resized)")
    cfg = clip_config_from_hf(config, **overrides)
    reader = StateDictReader(state_dict, what="CLIP state dict")
    _drop_position_ids(reader, cfg)
    maps = clip_tensor_maps(cfg)
    check_table(maps, CLIP(without_scan(cfg)), *_example_inputs(cfg), what="CLIP")
    params = cast_params(load_params(maps, reader), cfg.param_dtype)
    if target_size is not None and target_size != cfg.image_size:
        cfg, params = resize_params(params, cfg, target_size, method=method)
    params = to_layout(params, cfg.layer_stacks, scanned=cfg.scan_layers, what="CLIP params")
    return CLIP(cfg), params


# ============================================================================ flax -> HF

def clip_to_state_dict(module: CLIP, params: Any) -> dict[str, np.ndarray]:
    """``(CLIP, params)`` -> ``CLIPModel`` state dict of numpy arrays (loads with
    ``strict=True``). ``params``: the params tree or ``{'params': ...}``, boxed or not, in
    either layout."""
    cfg = module.config
    activation_to_hf(cfg.activation, what="CLIPConfig.activation")   # raises if HF has none
    _check_pooling(cfg)
    params = to_layout(plain_params(params), cfg.layer_stacks, scanned=False, what="CLIP params")
    return dump_state_dict(clip_tensor_maps(cfg), params, what="CLIP params")


FAMILY = HFFamily(
    name="clip", model_types=("clip",), config_type=CLIPConfig,
    from_state_dict=_clip_from_state_dict, to_state_dict=clip_to_state_dict,
    make_hf_config=clip_hf_config)
