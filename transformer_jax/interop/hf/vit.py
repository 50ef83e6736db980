"""Hugging Face ViT (``ViTForImageClassification``, ``ViTModel``) <-> transformer_jax ``ViT``.

Reached through :mod:`transformer_jax.interop.hf` (``model_type="vit"``, ``ViTConfig``)::

    module, params = from_hf(hf_model)                 # a live ViTForImageClassification
    module, params = from_hf("/path/to/save_pretrained_dir", image_size=384)
    state_dict = to_hf(module, params)                 # torch tensors, strict-loadable
    hf_cfg = hf_config(module.config)                  # transformers.ViTConfig

Images. HF takes ``pixel_values`` NCHW; our ``ViT`` takes NHWC: ``x.transpose(0, 2, 3, 1)``.

Layouts. Two HF key layouts are read: the current one (transformers >= 5, written by
``to_hf``) and the legacy one of transformers 4.x and of checkpoints on the hub
(``encoder.layer.{i}.attention.attention.query`` ...). Legend: D width, N heads, H = D/N,
F MLP width, C channels, P patch, T tokens, K classes. Prefix ``vit.`` in a
``ViTForImageClassification``, none in a ``ViTModel``.

    HF key (current; legacy where different)          shape          flax path, shape
    embeddings.cls_token                              (1, 1, D)      cls (D,)
    embeddings.position_embeddings                    (1, T, D)      pos_embedding (T, D)
    embeddings.patch_embeddings.projection.weight     (D, C, P, P)   embedding/kernel (P, P, C, D)
                                                      OIHW -> HWIO: transpose(2, 3, 1, 0)
    embeddings.patch_embeddings.projection.bias       (D,)           embedding/bias (D,)
    layers.{i}.layernorm_before.{weight,bias}         (D,)           encoderblock_{i}/norm1/{scale,bias}
      (legacy encoder.layer.{i}.layernorm_before)
    layers.{i}.attention.{q,k,v}_proj.weight          (D, D)         self_attn/{query,key,value}/kernel (D, N, H)
      (legacy ...attention.attention.{query,key,value})
    layers.{i}.attention.{q,k,v}_proj.bias            (D,)           self_attn/{query,key,value}/bias (N, H)
    layers.{i}.attention.o_proj.{weight,bias}         (D, D), (D,)   self_attn/out/kernel (N, H, D), bias (D,)
      (legacy ...attention.output.dense)
    layers.{i}.layernorm_after.{weight,bias}          (D,)           norm2/{scale,bias}
    layers.{i}.mlp.fc1.{weight,bias}                  (F, D), (F,)   mlp/wi/kernel (D, F), bias (F,)
      (legacy ...intermediate.dense)
    layers.{i}.mlp.fc2.{weight,bias}                  (D, F), (D,)   mlp/wo/kernel (F, D), bias (D,)
      (legacy ...output.dense)
    layernorm.{weight,bias}                           (D,)           encoder_norm/{scale,bias}
    classifier.{weight,bias} (no prefix)              (K, D), (K,)   head/kernel (D, K), bias (K,)

With ``scan_layers=True`` the ``encoderblock_{i}`` subtrees are one ``encoderblock`` with a
leading (L,) axis.

A model without ``classifier.*`` keys (a ``ViTModel``, or ``num_labels=0``) converts to
``num_classes=0`` (apply returns the CLS representation). A ``ViTModel``'s pooler
(``pooler.dense``, a dense + tanh that ``ViTForImageClassification`` does not have) is
rejected unless ``drop_pooler=True``. Every key and shape is asserted
(``StateDictReader``): a missing, unexpected or misshapen key raises ``ConversionError``
naming it.

Another image size on load: ``from_hf(..., image_size=S)`` resizes the position table
with :func:`~transformer_jax.models.vit.resize_pos_embedding` (bicubic, the arithmetic of
HF's ``interpolate_pos_encoding``; ``pos_interpolation="bilinear"`` for the other).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...models.vit import ViT, ViTConfig, resize_params
from ..common import (ConversionError, StateDictReader, TensorMap, dump_state_dict, layer_norm,
                      linear, load_params, refuse_attention_options)
from .registry import (HFFamily, activation_from_hf, activation_to_hf, cast_params,
                       check_table, plain_params, to_layout, without_scan)

LAYOUTS = ("current", "legacy")

#: HF config attribute <-> ViTConfig field, one table for both directions.
VIT_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("hidden_size", "d_model"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_heads"),
    ("intermediate_size", "mlp_dim"),
    ("num_channels", "num_channels"),
    ("layer_norm_eps", "norm_eps"),
    ("hidden_dropout_prob", "dropout_rate"),
    ("attention_probs_dropout_prob", "attention_dropout_rate"),
    ("initializer_range", "initializer_range"),
)

# ============================================================================ config

def _square(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise UserError(f"unsupported ViT config {name}={value!r}: transformer_jax's ViT "
                            "takes square images and patches")
        value = value[0]
    return int(value)


def vit_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> ViTConfig:
    """HF ViT config (a dict) -> ``ViTConfig``; unsupported options raise, naming them."""
    if config.get("model_type") != "vit":
        raise UserError(f"expected a ViT config (model_type 'vit'), got model_type "
                        f"{config.get('model_type')!r}")
    if not config.get("qkv_bias", True):
        raise UserError("unsupported ViT config option qkv_bias=False: transformer_jax's ViT "
                        "has biases on every attention projection")
    activation = activation_from_hf(config.get("hidden_act", "gelu"), family="ViT",
                                    option="hidden_act")
    heads, width = config.get("num_attention_heads", 12), config.get("hidden_size", 768)
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != width:
        raise UserError(f"unsupported ViT config option head_dim={head_dim}: transformer_jax's "
                        f"ViT uses hidden_size / num_attention_heads = {width // heads}")
    values = {ours: config[hf] for hf, ours in VIT_CONFIG_FIELDS if hf in config}
    values["image_size"] = _square(config.get("image_size", 224), "image_size")
    values["patch_size"] = _square(config.get("patch_size", 16), "patch_size")
    values["activation"] = activation
    labels = config.get("id2label")
    values["num_classes"] = len(labels) if labels is not None else config.get("num_labels", 2)
    values.update(overrides)
    return ViTConfig.from_dict(values)


def _refuse_clip_options(config: ViTConfig) -> None:
    """HF's ViT has a patch bias and no LayerNorm before the blocks (CLIP's vision tower,
    ``interop.hf.clip``, has the other two)."""
    bad = [f"{name}={getattr(config, name)!r}" for name, plain in
           (("patch_bias", True), ("embedding_norm", False)) if getattr(config, name) != plain]
    if bad:
        raise UserError(f"ViTConfig option(s) not expressible as an HF ViT: {', '.join(bad)} "
                        "(CLIP's vision tower; convert the CLIP model it belongs to)")


def vit_hf_config(config: ViTConfig, **extra: Any):
    """``ViTConfig`` -> ``transformers.ViTConfig`` (lazy import)."""
    from transformers import ViTConfig as HFViTConfig

    refuse_attention_options(config, "ViT")
    _refuse_clip_options(config)
    values = {hf: getattr(config, ours) for hf, ours in VIT_CONFIG_FIELDS}
    values["intermediate_size"] = config.mlp_features
    values.update(image_size=config.image_size, patch_size=config.patch_size,
                  hidden_act=activation_to_hf(config.activation, what="ViTConfig.activation"),
                  qkv_bias=True,
                  num_labels=config.num_classes)
    values.update(extra)
    return HFViTConfig(**values)


# ============================================================================ tensor maps

def _layer_keys(layout: str, i: int) -> dict[str, str]:
    """HF key prefixes (no model prefix) of layer ``i``'s sublayers in ``layout``."""
    if layout == "current":
        base = f"layers.{i}."
        return dict(ln1=base + "layernorm_before.", ln2=base + "layernorm_after.",
                    q=base + "attention.q_proj.", k=base + "attention.k_proj.",
                    v=base + "attention.v_proj.", o=base + "attention.o_proj.",
                    fc1=base + "mlp.fc1.", fc2=base + "mlp.fc2.")
    base = f"encoder.layer.{i}."
    return dict(ln1=base + "layernorm_before.", ln2=base + "layernorm_after.",
                q=base + "attention.attention.query.", k=base + "attention.attention.key.",
                v=base + "attention.attention.value.", o=base + "attention.output.dense.",
                fc1=base + "intermediate.dense.", fc2=base + "output.dense.")


def vit_tensor_maps(cfg: ViTConfig, *, prefix: str = "vit.", layout: str = "current") -> list[TensorMap]:
    """Every HF tensor <-> flax leaf of ``cfg`` (unscanned), in HF state-dict order."""
    if layout not in LAYOUTS:
        raise UserError(f"unknown HF ViT layout {layout!r}; choose one of {LAYOUTS}")
    d, n, h, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_features
    p, c, t = cfg.patch_size, cfg.num_channels, cfg.seq_len
    e = prefix + "embeddings."
    maps = [
        TensorMap(e + "cls_token", (1, 1, d), ((("cls",), (d,)),)),
        TensorMap(e + "position_embeddings", (1, t, d), ((("pos_embedding",), (t, d)),)),
        TensorMap(e + "patch_embeddings.projection.weight", (d, c, p, p),    # OIHW -> HWIO
                  ((("embedding", "kernel"), (p, p, c, d)),), transpose=(2, 3, 1, 0)),
        TensorMap(e + "patch_embeddings.projection.bias", (d,), ((("embedding", "bias"), (d,)),)),
    ]
    for i in range(cfg.num_layers):
        k = {name: prefix + key for name, key in _layer_keys(layout, i).items()}
        block = (f"encoderblock_{i}",)
        attn = block + ("self_attn",)
        maps += layer_norm(k["ln1"], block + ("norm1",), d)
        for key, proj in (("q", "query"), ("k", "key"), ("v", "value")):
            maps += linear(k[key], attn + (proj,), d, d, kernel_shape=(d, n, h), bias_shape=(n, h))
        maps += linear(k["o"], attn + ("out",), d, d, kernel_shape=(n, h, d))
        maps += layer_norm(k["ln2"], block + ("norm2",), d)
        maps += linear(k["fc1"], block + ("mlp", "wi"), d, f)
        maps += linear(k["fc2"], block + ("mlp", "wo"), f, d)
    maps += layer_norm(prefix + "layernorm.", ("encoder_norm",), d)
    if cfg.num_classes:
        maps += linear("classifier.", ("head",), d, cfg.num_classes)
    return maps


# ============================================================================ HF -> flax

def _vit_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                         **overrides: Any) -> tuple[ViT, dict[str, Any]]:
    """HF ViT state dict (current or legacy keys) -> ``(ViT, params)``.

    ``overrides``: ViTConfig fields, plus ``drop_pooler`` (accept and drop a ``ViTModel``
    pooler) and ``pos_interpolation`` (``"bicubic"``/``"bilinear"``, used when
    ``image_size`` differs from the checkpoint's).
    """
    drop_pooler = bool(overrides.pop("drop_pooler", False))
    method = overrides.pop("pos_interpolation", "bicubic")
    target_size = overrides.pop("image_size", None)
    stored_patch = _square(config.get("patch_size", 16), "patch_size")
    if overrides.get("patch_size", stored_patch) != stored_patch:
        raise UserError("from_hf cannot change patch_size: the patch embedding is fixed by the "
                        "checkpoint (image_size can change; the position table is resized)")
    reader = StateDictReader(state_dict, what="ViT state dict")
    keys = list(reader.remaining())
    prefix = "vit." if any(k.startswith("vit.") for k in keys) else ""
    if any(k.startswith(prefix + "encoder.layer.") for k in keys):
        layout = "legacy"
    else:
        layout = "current"
    head = "classifier.weight" in reader
    cfg_overrides = dict(overrides)
    if not head:
        if "classifier.bias" in reader:
            raise ConversionError("ViT state dict: 'classifier.bias' without 'classifier.weight'")
        cfg_overrides.setdefault("num_classes", 0)
    cfg = vit_config_from_hf(config, **cfg_overrides)
    if head and cfg.num_classes == 0:
        raise ConversionError("ViT state dict has 'classifier.weight' but the config has no labels "
                              "(num_labels=0); fix id2label/num_labels in config.json")

    pooler = [k for k in keys if k.startswith(prefix + "pooler.")]
    for key in pooler:
        if not drop_pooler:
            raise ConversionError(
                f"ViT state dict has a ViTModel pooler ({pooler}); transformer_jax's ViT (like "
                "ViTForImageClassification) classifies the CLS token without it. Pass "
                "drop_pooler=True to drop it")
        reader.skip(key)

    maps = vit_tensor_maps(cfg, prefix=prefix, layout=layout)
    images = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.num_channels), jnp.float32)
    check_table(maps, ViT(without_scan(cfg)), images, what="ViT")
    params = cast_params(load_params(maps, reader), cfg.param_dtype)
    if target_size is not None and target_size != cfg.image_size:
        cfg, params = resize_params(params, cfg, target_size, method=method)
    params = to_layout(params, cfg.layer_stacks, scanned=cfg.scan_layers, what="ViT params")
    return ViT(cfg), params


# ============================================================================ flax -> HF

def vit_to_state_dict(module: ViT, params: Any, *, layout: str = "current") -> dict[str, np.ndarray]:
    """``(ViT, params)`` -> ``ViTForImageClassification`` state dict of numpy arrays.

    ``layout="current"`` matches the installed transformers (>= 5) and loads with
    ``strict=True``; ``"legacy"`` writes transformers 4.x key names. ``params`` may be the
    params tree or ``{'params': ...}``, boxed or not, in either layout.
    """
    cfg = module.config
    activation_to_hf(cfg.activation, what="ViTConfig.activation")   # raises if HF has none
    _refuse_clip_options(cfg)
    params = to_layout(plain_params(params), cfg.layer_stacks, scanned=False, what="ViT params")
    return dump_state_dict(vit_tensor_maps(cfg, layout=layout), params, what="ViT params")


FAMILY = HFFamily(
    name="vit", model_types=("vit",), config_type=ViTConfig,
    from_state_dict=_vit_from_state_dict, to_state_dict=vit_to_state_dict,
    make_hf_config=vit_hf_config)
