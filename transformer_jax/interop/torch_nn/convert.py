"""``torch.nn``'s Transformer modules -> their Flax mirrors (:mod:`.modules`), and back.

Used by :func:`transformer_jax.interop.from_torch` and ``to_torch_state_dict``, which try
these built-ins first, then the tutorial's PyTorch modules
(:mod:`transformer_jax.interop.tutorial.convert`).

Recognised by type (subclasses included; an extra parameter or buffer of a subclass is an
unknown key and raises):
``MultiheadAttention`` -> ``TorchMultiheadAttention``; ``TransformerEncoderLayer``,
``TransformerEncoder``, ``TransformerDecoderLayer``, ``TransformerDecoder``,
``Transformer`` -> ``TorchTransformer*``. Read from the module: heads, widths, kdim/vdim,
dropout rates, ``layer_norm_eps``, activation (relu, exact gelu, tanh gelu, silu, tanh as
functions or modules), ``batch_first``, ``norm_first``, bias presence, final norms.
Unsupported: ``add_bias_kv``, ``add_zero_attn``, activations that cannot be identified
(override with ``activation=``), non-LayerNorm norms, custom encoders/decoders in
``nn.Transformer``, layers of one stack that differ from each other.

Also the torch readers the tutorial converters share: :class:`Conversion`,
:func:`check_overrides`, :func:`only_dropout_rate`, :func:`activation_name`,
:func:`layer_norm_cfg`.

Every converter asserts each key and shape through
:class:`~transformer_jax.interop.common.StateDictReader`: every state-dict key must be
consumed exactly once, and every shape must match (``ConversionError``, a ``ValueError``,
naming the key). The same :class:`~transformer_jax.interop.common.TensorMap` tables
drive both directions.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import flax
import numpy as np

from ...errors import UserError
from ..common import ConversionError, TensorMap, flatten_params, layer_norm, linear, packed_linear
from .modules import (TorchMultiheadAttention, TorchTransformer, TorchTransformerDecoder,
                      TorchTransformerDecoderLayer, TorchTransformerEncoder,
                      TorchTransformerEncoderLayer)

__all__ = ["Conversion", "RECOGNISED", "HEAD_ATTRS", "recognise_builtin", "builtin_state_dict_maps",
           "check_overrides", "only_dropout_rate", "activation_name", "layer_norm_cfg"]

RECOGNISED = (
    "torch.nn.MultiheadAttention", "torch.nn.TransformerEncoderLayer",
    "torch.nn.TransformerEncoder", "torch.nn.TransformerDecoderLayer",
    "torch.nn.TransformerDecoder", "torch.nn.Transformer",
)

#: Integer attributes that may hold a module's number of heads.
HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "nhead", "heads", "h")
_MIRRORS = (TorchMultiheadAttention, TorchTransformerEncoderLayer, TorchTransformerDecoderLayer,
            TorchTransformerEncoder, TorchTransformerDecoder, TorchTransformer)


@dataclasses.dataclass
class Conversion:
    """A recognised torch module: its Flax mirror, and the key table used in both directions."""
    module: flax.linen.Module
    maps: list[TensorMap]


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Widths the built-in maps need: D, kdim, vdim, F (0 where not applicable)."""
    d_model: int
    kdim: int
    vdim: int
    dim_feedforward: int = 0


# ----------------------------------------------------------------------------- entry points

def recognise_builtin(m: Any, overrides: dict[str, Any]) -> Conversion | None:
    """The conversion of a ``torch.nn`` built-in, or None if ``m`` is none of them."""
    import torch.nn as tnn

    builtins = (
        (tnn.Transformer, _transformer, ("activation",)),
        (tnn.TransformerEncoder, _encoder, ("activation",)),
        (tnn.TransformerDecoder, _decoder, ("activation",)),
        (tnn.TransformerEncoderLayer, _encoder_layer, ("activation",)),
        (tnn.TransformerDecoderLayer, _decoder_layer, ("activation",)),
        (tnn.MultiheadAttention, _multihead_attention, ()),
    )
    for cls, build, allowed in builtins:
        if isinstance(m, cls):
            check_overrides(type(m).__name__, overrides, allowed)
            return build(m, overrides)
    return None


def builtin_state_dict_maps(flax_module: flax.linen.Module,
                            params: Mapping[str, Any]) -> list[TensorMap] | None:
    """The key table of a built-in mirror, its widths read off ``params``; None for another module."""
    if not isinstance(flax_module, _MIRRORS):
        return None
    return _builtin_maps(flax_module, _dims_from_params(flax_module, params))


def check_overrides(kind: str, overrides: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """Refuse the ``from_torch`` keyword overrides that do not apply to a module of ``kind``."""
    bad = sorted(set(overrides) - set(allowed))
    if bad:
        raise TypeError(f"override(s) {bad} do not apply to a {kind}; allowed: {list(allowed) or 'none'}")


# ----------------------------------------------------------------------------- torch readers

def only_dropout_rate(modules, where: str) -> float:
    """The common rate of some ``nn.Dropout`` modules (0 if none); differing rates raise."""
    rates = {float(d.p) for d in modules}
    if len(rates) > 1:
        raise UserError(f"{where}: dropout modules with different rates {sorted(rates)}; the "
                        "mirror has one rate there")
    return rates.pop() if rates else 0.0


def activation_name(act: Any, where: str) -> str:
    import torch
    import torch.nn as tnn
    import torch.nn.functional as F

    if isinstance(act, functools.partial) and act.func is F.gelu and not act.args:
        if act.keywords in ({"approximate": "tanh"},):
            return "gelu_tanh"
        if act.keywords in ({"approximate": "none"}, {}):
            return "gelu"
    if act is F.relu or act is torch.relu or isinstance(act, tnn.ReLU):
        return "relu"
    if act is F.gelu:
        return "gelu"
    if isinstance(act, tnn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[act.approximate]
    if act is F.silu or isinstance(act, tnn.SiLU):
        return "silu"
    if act is torch.tanh or act is F.tanh or isinstance(act, tnn.Tanh):
        return "tanh"
    raise UserError(f"{where}: cannot identify the activation {act!r}; supported: relu, gelu "
                    "(exact or tanh), silu, tanh. If it is one of these, pass activation=... to "
                    "from_torch")


def layer_norm_cfg(norms: dict[str, Any], where: str) -> tuple[float, bool]:
    """(eps, has bias) shared by some ``nn.LayerNorm`` modules, checked."""
    import torch.nn as tnn

    eps, bias = set(), set()
    for name, norm in norms.items():
        if not isinstance(norm, tnn.LayerNorm):
            raise UserError(f"{where}{name}: expected nn.LayerNorm, got {type(norm).__name__}")
        if not norm.elementwise_affine:
            raise UserError(f"{where}{name}: LayerNorm(elementwise_affine=False) is not supported")
        if len(norm.normalized_shape) != 1:
            raise UserError(f"{where}{name}: only LayerNorm over the last axis is supported, got "
                            f"normalized_shape={tuple(norm.normalized_shape)}")
        eps.add(float(norm.eps))
        bias.add(norm.bias is not None)
    if len(eps) > 1:
        raise UserError(f"{where}{', '.join(norms)}: different eps {sorted(eps)}; the mirror has one eps")
    if len(bias) > 1:
        raise UserError(f"{where}{', '.join(norms)}: some LayerNorms have a bias and some do not")
    return eps.pop(), bias.pop()


# ----------------------------------------------------------------------------- built-in maps

def _mha_maps(tp: str, fp: tuple[str, ...], *, d: int, kdim: int, vdim: int, n: int,
              bias: bool) -> list[TensorMap]:
    """``nn.MultiheadAttention`` at key prefix ``tp`` <-> library attention params at ``fp``.

    Packed ``in_proj_weight`` (3D, D) when kdim == vdim == D, else ``q_proj_weight`` (D, D),
    ``k_proj_weight`` (D, kdim), ``v_proj_weight`` (D, vdim); ``in_proj_bias`` (3D,);
    ``out_proj.weight`` (D, D), ``out_proj.bias`` (D,). Flax: query/key/value kernel
    (Din, N, H), bias (N, H); out kernel (N, H, D), bias (D,).
    """
    if d % n:
        raise ConversionError(f"{tp or 'attention'}: embed_dim={d} is not divisible by num_heads={n}")
    h = d // n
    q, k, v, o = (fp + (name,) for name in ("query", "key", "value", "out"))
    if kdim == d and vdim == d:
        maps = packed_linear(tp, [q, k, v], d, d, bias=bias, kernel_shape=(d, n, h),
                             bias_shape=(n, h), weight_name="in_proj_weight",
                             bias_name="in_proj_bias")
    else:
        maps = [TensorMap(f"{tp}{w}_proj_weight", (d, din), ((path + ("kernel",), (din, n, h)),),
                          transpose=True)
                for w, path, din in (("q", q, d), ("k", k, kdim), ("v", v, vdim))]
        if bias:
            maps.append(TensorMap(f"{tp}in_proj_bias", (3 * d,),
                                  tuple((p + ("bias",), (n, h)) for p in (q, k, v))))
    return maps + linear(f"{tp}out_proj.", o, d, d, bias=bias, kernel_shape=(n, h, d))


def _layer_maps(tp: str, fp: tuple[str, ...], layer: Any, dims: _Dims, *,
                cross: bool) -> list[TensorMap]:
    """``nn.Transformer{Encoder,Decoder}Layer`` at ``tp`` <-> the library block at ``fp``."""
    d, f, n = dims.d_model, dims.dim_feedforward, layer.num_heads
    maps = _mha_maps(f"{tp}self_attn.", fp + ("self_attn",), d=d, kdim=d, vdim=d, n=n,
                     bias=layer.use_bias)
    if cross:
        maps += _mha_maps(f"{tp}multihead_attn.", fp + ("cross_attn",), d=d, kdim=d, vdim=d, n=n,
                          bias=layer.use_bias)
    maps += linear(f"{tp}linear1.", fp + ("mlp", "wi"), d, f, bias=layer.use_bias)
    maps += linear(f"{tp}linear2.", fp + ("mlp", "wo"), f, d, bias=layer.use_bias)
    for i in (1, 2, 3) if cross else (1, 2):
        maps += layer_norm(f"{tp}norm{i}.", fp + (f"norm{i}",), d, bias=layer.norm_bias)
    return maps


def _stack_maps(tp: str, fp: tuple[str, ...], stack: Any, dims: _Dims, *, cross: bool,
                num_layers: int, final_norm: bool, final_norm_bias: bool) -> list[TensorMap]:
    maps = []
    for i in range(num_layers):
        maps += _layer_maps(f"{tp}layers.{i}.", fp + (f"layers_{i}",), stack, dims, cross=cross)
    if final_norm:
        maps += layer_norm(f"{tp}norm.", fp + ("norm",), dims.d_model, bias=final_norm_bias)
    return maps


def _builtin_maps(module: flax.linen.Module, dims: _Dims) -> list[TensorMap]:
    """The one mapping table of each built-in mirror, used by both directions."""
    if isinstance(module, TorchMultiheadAttention):
        return _mha_maps("", (), d=dims.d_model, kdim=dims.kdim, vdim=dims.vdim,
                         n=module.num_heads, bias=module.use_bias)
    if isinstance(module, TorchTransformerEncoderLayer):
        return _layer_maps("", (), module, dims, cross=False)
    if isinstance(module, TorchTransformerDecoderLayer):
        return _layer_maps("", (), module, dims, cross=True)
    if isinstance(module, (TorchTransformerEncoder, TorchTransformerDecoder)):
        return _stack_maps("", (), module, dims, cross=isinstance(module, TorchTransformerDecoder),
                           num_layers=module.num_layers, final_norm=module.final_norm,
                           final_norm_bias=module.final_norm_bias)
    if isinstance(module, TorchTransformer):
        return (_stack_maps("encoder.", ("encoder",), module, dims, cross=False,
                            num_layers=module.num_encoder_layers, final_norm=True,
                            final_norm_bias=module.norm_bias)
                + _stack_maps("decoder.", ("decoder",), module, dims, cross=True,
                              num_layers=module.num_decoder_layers, final_norm=True,
                              final_norm_bias=module.norm_bias))
    raise TypeError(f"no built-in mapping for {type(module).__name__}")


def _dims_from_params(module: flax.linen.Module, params: Mapping[str, Any]) -> _Dims:
    """Read D, kdim, vdim, F off the Flax params (for the Flax -> torch direction)."""
    flat = flatten_params(params)
    if isinstance(module, TorchMultiheadAttention):
        attn, mlp = (), None
    elif isinstance(module, (TorchTransformerEncoderLayer, TorchTransformerDecoderLayer)):
        attn, mlp = ("self_attn",), ("mlp",)
    elif isinstance(module, (TorchTransformerEncoder, TorchTransformerDecoder)):
        attn, mlp = ("layers_0", "self_attn"), ("layers_0", "mlp")
    else:
        attn, mlp = ("encoder", "layers_0", "self_attn"), ("encoder", "layers_0", "mlp")

    def shape(path):
        if path not in flat:
            raise ConversionError(f"{type(module).__name__} params lack {'/'.join(path)}; are "
                                  "these the params of this module?")
        return np.shape(flat[path])

    d = shape(attn + ("query", "kernel"))[0]
    kdim = shape(attn + ("key", "kernel"))[0]
    vdim = shape(attn + ("value", "kernel"))[0]
    f = shape(mlp + ("wi", "kernel"))[1] if mlp is not None else 0
    return _Dims(d, kdim, vdim, f)


# ----------------------------------------------------------------------------- built-in readers

def _mha_cfg(m: Any, where: str) -> dict[str, Any]:
    if m.bias_k is not None or m.bias_v is not None:
        raise UserError(f"{where}add_bias_kv=True (bias_k/bias_v) is not supported")
    if m.add_zero_attn:
        raise UserError(f"{where}add_zero_attn=True is not supported")
    bias = m.in_proj_bias is not None
    if (m.out_proj.bias is not None) != bias:
        raise UserError(f"{where}out_proj.bias presence differs from in_proj_bias; the mirror "
                        "has one use_bias")
    return dict(num_heads=int(m.num_heads), use_bias=bias, dropout_rate=float(m.dropout),
                batch_first=bool(m.batch_first))


def _multihead_attention(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg = _mha_cfg(m, "")
    module = TorchMultiheadAttention(**cfg, embed_dim=int(m.embed_dim), kdim=int(m.kdim),
                                     vdim=int(m.vdim))
    dims = _Dims(int(m.embed_dim), int(m.kdim), int(m.vdim))
    return Conversion(module, _builtin_maps(module, dims))


def _layer_cfg(layer: Any, where: str, *, cross: bool, overrides: dict[str, Any]) -> tuple[dict, _Dims]:
    """Library-block fields and widths of a torch Transformer{Encoder,Decoder}Layer."""
    sa = _mha_cfg(layer.self_attn, f"{where}self_attn.")
    attns = {"self_attn": sa}
    if cross:
        attns["multihead_attn"] = _mha_cfg(layer.multihead_attn, f"{where}multihead_attn.")
        if attns["multihead_attn"] != sa:
            raise UserError(f"{where}multihead_attn is configured differently from self_attn "
                            f"({attns['multihead_attn']} vs {sa})")
    d = int(layer.self_attn.embed_dim)
    for name in attns:
        a = getattr(layer, name)
        if not a._qkv_same_embed_dim:
            raise UserError(f"{where}{name}: kdim/vdim different from d_model are not supported "
                            "inside a Transformer layer")
    for name in ("linear1", "linear2"):
        if (getattr(layer, name).bias is not None) != sa["use_bias"]:
            raise UserError(f"{where}{name}.bias presence differs from the attention's")
    norms = {f"norm{i}": getattr(layer, f"norm{i}") for i in ((1, 2, 3) if cross else (1, 2))}
    eps, norm_bias = layer_norm_cfg(norms, where)
    residual = [getattr(layer, f"dropout{i}") for i in ((1, 2, 3) if cross else (1, 2))]
    activation = overrides.get("activation") or activation_name(layer.activation, f"{where}activation")
    cfg = dict(num_heads=sa["num_heads"], mlp_dim=int(layer.linear1.out_features),
               activation=activation, pre_norm=bool(layer.norm_first), norm_eps=eps,
               use_bias=sa["use_bias"], norm_bias=norm_bias,
               dropout_rate=only_dropout_rate(residual, f"{where}dropout1..{len(residual)}"),
               attention_dropout_rate=sa["dropout_rate"],
               mlp_dropout_rate=float(layer.dropout.p), batch_first=sa["batch_first"])
    return cfg, _Dims(d, d, d, int(layer.linear1.out_features))


def _encoder_layer(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, dims = _layer_cfg(m, "", cross=False, overrides=overrides)
    module = TorchTransformerEncoderLayer(**cfg)
    return Conversion(module, _builtin_maps(module, dims))


def _decoder_layer(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, dims = _layer_cfg(m, "", cross=True, overrides=overrides)
    module = TorchTransformerDecoderLayer(**cfg)
    return Conversion(module, _builtin_maps(module, dims))


def _stack_cfg(stack: Any, where: str, *, cross: bool,
               overrides: dict[str, Any]) -> tuple[dict, _Dims, dict]:
    """(layer fields, widths, final-norm fields) of a TransformerEncoder/Decoder."""
    configs = [_layer_cfg(layer, f"{where}layers.{i}.", cross=cross, overrides=overrides)
               for i, layer in enumerate(stack.layers)]
    if not configs:
        raise UserError(f"{where}layers: the stack has no layers")
    for i, c in enumerate(configs[1:], start=1):
        if c != configs[0]:
            raise UserError(f"{where}layers.{i} is configured differently from {where}layers.0; "
                            "the mirror stacks identical layers")
    final = dict(final_norm=False)
    if stack.norm is not None:
        eps, bias = layer_norm_cfg({"norm": stack.norm}, where)
        final = dict(final_norm=True, final_norm_eps=eps, final_norm_bias=bias)
    return configs[0][0], configs[0][1], final


def _encoder(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, dims, final = _stack_cfg(m, "", cross=False, overrides=overrides)
    module = TorchTransformerEncoder(**cfg, **final, num_layers=len(m.layers))
    return Conversion(module, _builtin_maps(module, dims))


def _decoder(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, dims, final = _stack_cfg(m, "", cross=True, overrides=overrides)
    module = TorchTransformerDecoder(**cfg, **final, num_layers=len(m.layers))
    return Conversion(module, _builtin_maps(module, dims))


def _transformer(m: Any, overrides: dict[str, Any]) -> Conversion:
    import torch.nn as tnn

    if type(m.encoder) is not tnn.TransformerEncoder:
        raise UserError(f"encoder: a custom encoder ({type(m.encoder).__name__}) is not supported")
    if type(m.decoder) is not tnn.TransformerDecoder:
        raise UserError(f"decoder: a custom decoder ({type(m.decoder).__name__}) is not supported")
    enc, dims, enc_final = _stack_cfg(m.encoder, "encoder.", cross=False, overrides=overrides)
    dec, dec_dims, dec_final = _stack_cfg(m.decoder, "decoder.", cross=True, overrides=overrides)
    if enc != dec or dims != dec_dims:
        raise UserError("decoder layers are configured differently from the encoder layers; "
                        "TorchTransformer shares one layer configuration")
    want = dict(final_norm=True, final_norm_eps=enc["norm_eps"], final_norm_bias=enc["norm_bias"])
    for name, final in (("encoder.norm", enc_final), ("decoder.norm", dec_final)):
        if final != want:
            raise UserError(f"{name}: expected a LayerNorm like the layers' (eps={enc['norm_eps']}, "
                            f"bias={enc['norm_bias']}), got {final}")
    module = TorchTransformer(**enc, num_encoder_layers=len(m.encoder.layers),
                              num_decoder_layers=len(m.decoder.layers))
    return Conversion(module, _builtin_maps(module, dims))

