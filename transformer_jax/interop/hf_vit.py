"""Hugging Face ViT (``ViTForImageClassification``, ``ViTModel``) <-> transformer_jax ``ViT``.

Entry points (also reachable through :mod:`transformer_jax.interop.hf`, which dispatches
on ``model_type="vit"`` and on ``ViTConfig``)::

    module, params = from_hf(hf_model)                 # a live ViTForImageClassification
    module, params = from_hf("/path/to/save_pretrained_dir", image_size=384)
    state_dict = to_hf(module, params)                 # torch tensors, strict-loadable
    hf_cfg = vit_hf_config(module.config)              # transformers.ViTConfig

Loading a ``save_pretrained`` directory reads ``config.json`` and the safetensors file(s)
with :mod:`transformer_jax.interop.hf`'s directory reader, without importing torch.

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

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..models.base import stack_layers, unstack_layers
from ..models.vit import ViT, ViTConfig, resize_params
from ._common import (ConversionError, StateDictReader, TensorMap, dump_state_dict, flatten_params,
                      layer_norm, linear, load_params)
from .hf import HFFamily, register_hf_family

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

#: HF ``hidden_act`` -> our activation; the first HF name per activation is the one written.
VIT_ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

_SCAN = dict(prefix="encoderblock_", name="encoderblock")


# ============================================================================ config

def _square(value: Any, name: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"unsupported ViT config {name}={value!r}: transformer_jax's ViT "
                             "takes square images and patches")
        value = value[0]
    return int(value)


def vit_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> ViTConfig:
    """HF ViT config (a dict) -> ``ViTConfig``; unsupported options raise, naming them."""
    if config.get("model_type") != "vit":
        raise ValueError(f"expected a ViT config (model_type 'vit'), got model_type "
                         f"{config.get('model_type')!r}")
    if not config.get("qkv_bias", True):
        raise ValueError("unsupported ViT config option qkv_bias=False: transformer_jax's ViT "
                         "has biases on every attention projection")
    act = config.get("hidden_act", "gelu")
    if act not in VIT_ACTIVATIONS:
        raise ValueError(f"unsupported ViT config option hidden_act={act!r}; supported: "
                         f"{sorted(VIT_ACTIVATIONS)}")
    heads, width = config.get("num_attention_heads", 12), config.get("hidden_size", 768)
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * heads != width:
        raise ValueError(f"unsupported ViT config option head_dim={head_dim}: transformer_jax's "
                         f"ViT uses hidden_size / num_attention_heads = {width // heads}")
    values = {ours: config[hf] for hf, ours in VIT_CONFIG_FIELDS if hf in config}
    values["image_size"] = _square(config.get("image_size", 224), "image_size")
    values["patch_size"] = _square(config.get("patch_size", 16), "patch_size")
    values["activation"] = VIT_ACTIVATIONS[act]
    labels = config.get("id2label")
    values["num_classes"] = len(labels) if labels is not None else config.get("num_labels", 2)
    values.update(overrides)
    return ViTConfig.from_dict(values)


def vit_hf_config(config: ViTConfig, **extra: Any):
    """``ViTConfig`` -> ``transformers.ViTConfig`` (lazy import)."""
    from transformers import ViTConfig as HFViTConfig

    reverse = {}
    for hf_name, ours in VIT_ACTIVATIONS.items():
        reverse.setdefault(ours, hf_name)
    if config.activation not in reverse:
        raise ValueError(f"ViTConfig activation={config.activation!r} has no HF ViT hidden_act; "
                         f"use one of {sorted(reverse)}")
    values = {hf: getattr(config, ours) for hf, ours in VIT_CONFIG_FIELDS}
    values["intermediate_size"] = config.mlp_features
    values.update(image_size=config.image_size, patch_size=config.patch_size,
                  hidden_act=reverse[config.activation], qkv_bias=True,
                  num_labels=config.num_classes)
    values.update(extra)
    return HFViTConfig(**values)


# ============================================================================ tensor maps

@dataclasses.dataclass(frozen=True)
class _ConvKernelMap(TensorMap):
    """PyTorch ``Conv2d`` weight OIHW (D, C, P, P) <-> flax HWIO kernel (P, P, C, D)."""

    def to_flax(self, array):
        return (np.ascontiguousarray(np.transpose(array, (2, 3, 1, 0))),)

    def to_torch(self, arrays):
        return np.ascontiguousarray(np.transpose(np.asarray(arrays[0]), (3, 2, 0, 1)))


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
        raise ValueError(f"unknown HF ViT layout {layout!r}; choose one of {LAYOUTS}")
    d, n, h, f = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_features
    p, c, t = cfg.patch_size, cfg.num_channels, cfg.seq_len
    e = prefix + "embeddings."
    maps = [
        TensorMap(e + "cls_token", (1, 1, d), ((("cls",), (d,)),)),
        TensorMap(e + "position_embeddings", (1, t, d), ((("pos_embedding",), (t, d)),)),
        _ConvKernelMap(e + "patch_embeddings.projection.weight", (d, c, p, p),
                       ((("embedding", "kernel"), (p, p, c, d)),)),
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


def _expected_flax_shapes(cfg: ViTConfig) -> dict[str, tuple[int, ...]]:
    """'/'-joined path -> shape of the unscanned params of ``ViT(cfg)``, without allocating."""
    import flax.linen as nn

    module = ViT(cfg.replace(scan_layers=False))
    images = jnp.zeros((1, cfg.image_size, cfg.image_size, cfg.num_channels), jnp.float32)
    tree = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), images))["params"]
    return {"/".join(path): tuple(x.shape) for path, x in flatten_params(nn.meta.unbox(tree)).items()}


def _check_maps(maps: list[TensorMap], cfg: ViTConfig) -> None:
    """The map table covers ``ViT(cfg)``'s params exactly (a library bug otherwise)."""
    produced = {"/".join(path): shape for m in maps for path, shape in m.targets}
    expected = _expected_flax_shapes(cfg)
    if produced != expected:
        raise AssertionError(f"ViT tensor maps out of sync with ViT: missing "
                             f"{sorted(set(expected) - set(produced))}, extra "
                             f"{sorted(set(produced) - set(expected))}, shapes differ at "
                             f"{sorted(k for k in produced if k in expected and produced[k] != expected[k])}")


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
        raise ValueError("from_hf cannot change patch_size: the patch embedding is fixed by the "
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

    flat_cfg = cfg.replace(scan_layers=False)
    maps = vit_tensor_maps(flat_cfg, prefix=prefix, layout=layout)
    _check_maps(maps, flat_cfg)
    params = load_params(maps, reader)
    param_dtype = jnp.dtype(cfg.param_dtype)
    params = jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype=param_dtype), params)
    if target_size is not None and target_size != cfg.image_size:
        cfg, params = resize_params(params, cfg, target_size, method=method)
    if cfg.scan_layers:
        params = stack_layers(params, cfg.num_layers, **_SCAN)
    return ViT(cfg), params


# ============================================================================ flax -> HF

def vit_to_state_dict(module: ViT, params: Any, *, layout: str = "current") -> dict[str, np.ndarray]:
    """``(ViT, params)`` -> ``ViTForImageClassification`` state dict of numpy arrays.

    ``layout="current"`` matches the installed transformers (>= 5) and loads with
    ``strict=True``; ``"legacy"`` writes transformers 4.x key names. ``params`` may be the
    params tree or ``{'params': ...}``, boxed or not, scanned when the config says so.
    """
    import flax.linen as nn

    cfg = module.config
    if cfg.activation not in VIT_ACTIVATIONS.values():
        raise ValueError(f"ViTConfig activation={cfg.activation!r} has no HF ViT hidden_act")
    params = nn.meta.unbox(params)
    if set(params) == {"params"}:
        params = params["params"]
    params = dict(params)
    if cfg.scan_layers:
        if "encoderblock" not in params:
            raise ConversionError(f"config says scan_layers=True but the params have no stacked "
                                  f"'encoderblock' (top-level keys: {sorted(params)})")
        params = unstack_layers(params, **_SCAN)
    params = jax.tree_util.tree_map(np.asarray, params)
    return dump_state_dict(vit_tensor_maps(cfg, layout=layout), params, what="ViT params")


# ============================================================================ public

def from_hf(model_or_local_dir: Any, **overrides: Any) -> tuple[ViT, dict[str, Any]]:
    """A live HF ViT model or a ``save_pretrained`` directory -> ``(ViT, params)``.

    ``overrides``: ViTConfig fields (``image_size`` resizes the position table;
    ``scan_layers``, ``dtype``, ``param_dtype``, dropout rates ...), ``drop_pooler``,
    ``pos_interpolation``. See :func:`transformer_jax.interop.hf.from_hf`.
    """
    from .hf import from_hf as generic_from_hf

    module, params = generic_from_hf(model_or_local_dir, **overrides)
    if not isinstance(module, ViT):
        raise ValueError(f"expected a Hugging Face ViT model, got a {type(module).__name__} "
                         "checkpoint; use transformer_jax.interop.from_hf for other families")
    return module, params


def to_hf(module: ViT, params: Any) -> dict[str, Any]:
    """``(ViT, params)`` -> torch state dict that ``ViTForImageClassification`` loads strictly."""
    from .hf import to_hf as generic_to_hf

    if not isinstance(module, ViT):
        raise TypeError(f"to_hf here takes a ViT, got {type(module).__name__}")
    return generic_to_hf(module, params)


register_hf_family(HFFamily(
    name="vit", model_types=("vit",), config_type=ViTConfig,
    from_state_dict=_vit_from_state_dict, to_state_dict=vit_to_state_dict,
    make_hf_config=vit_hf_config))
