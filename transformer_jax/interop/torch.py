"""PyTorch modules -> Flax mirrors (and back): ``from_torch`` and ``to_torch_state_dict``.

torch is imported lazily inside the functions: ``import transformer_jax`` never imports it.

    flax_module, params = from_torch(torch_module, **overrides)
    y = flax_module.apply({"params": params}, *inputs)          # == torch_module(*inputs)
    state = to_torch_state_dict(flax_module, params)            # {key: np.ndarray}
    torch_module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})

Recognised modules (the mirrors live in :mod:`transformer_jax.interop.torch_modules`):

``torch.nn`` built-ins, by type (subclasses included; an extra parameter or buffer of a
subclass is an unknown key and raises):
  ``MultiheadAttention`` -> ``TorchMultiheadAttention``; ``TransformerEncoderLayer``,
  ``TransformerEncoder``, ``TransformerDecoderLayer``, ``TransformerDecoder``,
  ``Transformer`` -> ``TorchTransformer*``. Read from the module: heads, widths, kdim/vdim,
  dropout rates, ``layer_norm_eps``, activation (relu, exact gelu, tanh gelu, silu, tanh as
  functions or modules), ``batch_first``, ``norm_first``, bias presence, final norms.
  Unsupported: ``add_bias_kv``, ``add_zero_attn``, activations that cannot be identified
  (override with ``activation=``), non-LayerNorm norms, custom encoders/decoders in
  ``nn.Transformer``, layers of one stack that differ from each other.

Tutorial ("seed") modules, by attribute names, tried in this order:
  1. post-norm decoder layer: ``self_attn``, ``cross_attn``, ``feed_forward``, ``norm1``,
     ``norm2``, ``norm3`` -> ``SeedDecoderLayer``;
  2. pre-norm encoder block: ``attn``, ``ff``, ``norm1``, ``norm2`` -> ``SeedEncoderBlock``
     (``pre_norm=True``);
  3. post-norm block: ``attention`` or ``self_attn``, ``feed_forward``, ``norm1``, ``norm2``
     -> ``SeedEncoderBlock`` (``pre_norm=False``);
  4. multi-head attention: ``nn.Linear`` attributes ``w_q, w_k, w_v, w_o`` (or ``W_q, W_k,
     W_v, W_o``) -> ``SeedMultiHeadAttention``. Heads from an int attribute ``num_heads``,
     ``n_heads``, ``n_head``, ``nhead``, ``heads`` or ``h`` (or ``d_k``/``head_dim``), else
     pass ``num_heads=``. Any ``nn.Dropout`` inside (directly or in an inner ``attention``
     submodule) is taken as dropout on the attention weights;
  5. positional encoding: a buffer ``pe`` of shape (1, max_len, D) equal to the library's
     ``sinusoidal_table(max_len, D)`` within 1e-6 + pos * 2**-22 (the second term is the
     fp32 rounding of the angle pos * freq: two implementations' 1-ulp differences in
     ``exp`` grow with the position), else an error naming ``pe``; the mirror recomputes
     the table (no parameters) -> ``SeedPositionalEncoding``;
  6. feed-forward: an ``nn.Sequential`` of Linear, activation, Dropout, Linear [, Dropout]
     -- the module itself or its attribute ``net`` or ``feed_forward`` -- or ``nn.Linear``
     attributes ``w_1``, ``w_2`` with an activation module (ReLU/GELU/SiLU/Tanh) and an
     optional ``nn.Dropout`` among its children -> ``SeedFeedForward``.
  Inside blocks, the attention and feed-forward submodules follow rules 4 and 6; residual
  dropout is the block's own ``nn.Dropout`` child(ren).

Overrides (keyword arguments) resolve ambiguities: ``norm_first`` (blocks; default by the
rules above, or the module's own bool ``norm_first`` attribute), ``num_heads`` (seed
attention and blocks), ``activation`` (feed-forwards, blocks and the built-in layers).

Every converter asserts each key and shape through
:class:`~transformer_jax.interop._common.StateDictReader`: every state-dict key must be
consumed exactly once, and every shape must match (``ConversionError``, a ``ValueError``,
naming the key). The same :class:`~transformer_jax.interop._common.TensorMap` tables
drive both directions.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import UserError
from ..layers.embeddings import sinusoidal_table
from ._common import (ConversionError, StateDictReader, TensorMap, dump_state_dict,
                      flatten_params, layer_norm, linear, load_params, packed_linear)
from .torch_modules import (SeedDecoderLayer, SeedEncoderBlock, SeedFeedForward,
                            SeedMultiHeadAttention, SeedPositionalEncoding,
                            TorchMultiheadAttention, TorchTransformer, TorchTransformerDecoder,
                            TorchTransformerDecoderLayer, TorchTransformerEncoder,
                            TorchTransformerEncoderLayer)

__all__ = ["from_torch", "to_torch_state_dict", "RECOGNISED"]

RECOGNISED = (
    "torch.nn.MultiheadAttention", "torch.nn.TransformerEncoderLayer",
    "torch.nn.TransformerEncoder", "torch.nn.TransformerDecoderLayer",
    "torch.nn.TransformerDecoder", "torch.nn.Transformer",
    "seed decoder layer (self_attn, cross_attn, feed_forward, norm1, norm2, norm3)",
    "seed pre-norm block (attn, ff, norm1, norm2)",
    "seed post-norm block (attention|self_attn, feed_forward, norm1, norm2)",
    "seed multi-head attention (w_q, w_k, w_v, w_o Linear layers, or W_q...)",
    "seed positional encoding (buffer pe)",
    "seed feed-forward (Sequential Linear/act/Dropout/Linear, itself or as net/feed_forward; "
    "or w_1, w_2 Linear + activation module)",
)

_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "nhead", "heads", "h")
_MIRRORS = (TorchMultiheadAttention, TorchTransformerEncoderLayer, TorchTransformerDecoderLayer,
            TorchTransformerEncoder, TorchTransformerDecoder, TorchTransformer)


@dataclasses.dataclass
class _Conversion:
    module: flax.linen.Module
    maps: list[TensorMap]


@dataclasses.dataclass(frozen=True)
class _Dims:
    """Widths the built-in maps need: D, kdim, vdim, F (0 where not applicable)."""
    d_model: int
    kdim: int
    vdim: int
    dim_feedforward: int = 0


# ============================================================================= public API

def from_torch(module: Any, **overrides: Any) -> tuple[flax.linen.Module, dict[str, Any]]:
    """Convert a PyTorch module to its Flax mirror and parameters.

    Args:
      module: a ``torch.nn.Module`` recognised as described in the module docstring.
      **overrides: ``norm_first``, ``num_heads`` or ``activation`` where the module is
        ambiguous (which ones apply depends on the module kind; others raise TypeError).

    Returns:
      ``(flax_module, params)``; ``flax_module.apply({"params": params}, *inputs)`` takes
      the torch forward's positional inputs and returns what it returns.

    Raises:
      TypeError: unrecognised module type, or an override that does not apply.
      ValueError: an unsupported feature (naming the attribute), or a state dict that does
        not match (naming the key, and the expected and actual shapes).
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")
    conv = _recognise(module, dict(overrides))
    reader = StateDictReader(module.state_dict(), what=f"{type(module).__name__} state dict")
    params = load_params(conv.maps, reader)
    return conv.module, jax.tree_util.tree_map(jnp.asarray, params)


def to_torch_state_dict(flax_module: flax.linen.Module, params: Mapping[str, Any], *,
                        like: Any = None, **overrides: Any) -> dict[str, np.ndarray]:
    """The inverse of :func:`from_torch`: Flax params -> a PyTorch ``state_dict`` of numpy arrays.

    ``load_state_dict({k: torch.from_numpy(v) ...}, strict=True)`` into a torch module of
    the same configuration reproduces the Flax outputs. Built-in mirrors need nothing
    else; the seed mirrors need ``like=`` a torch module of the same structure, from which
    the key names are read: it is recognised as by ``from_torch(like, **overrides)`` (pass
    the same overrides as then) and the resulting configuration must equal
    ``flax_module``'s. Any params-shaped tree works, e.g. gradients. ``params`` may be
    ``{"params": ...}``.
    """
    params = _plain_params(params)
    if like is not None:
        conv = _recognise(like, dict(overrides))
        _check_same_config(conv.module, flax_module)
        maps = conv.maps
    elif isinstance(flax_module, _MIRRORS):
        if overrides:
            raise TypeError(f"overrides {sorted(overrides)} only apply together with like=")
        maps = _builtin_maps(flax_module, _dims_from_params(flax_module, params))
    else:
        raise TypeError(f"to_torch_state_dict: {type(flax_module).__name__} is not a torch.nn "
                        "built-in mirror; pass like=<the torch module> to take key names from it")
    return dump_state_dict(maps, params, what=f"{type(flax_module).__name__} params")


# ============================================================================= recognition

def _recognise(m: Any, overrides: dict[str, Any]) -> _Conversion:
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
            _check_overrides(type(m).__name__, overrides, allowed)
            return build(m, overrides)

    seeds = (
        ("seed decoder layer", _is_seed_decoder, _seed_decoder, ("norm_first", "num_heads", "activation")),
        ("seed pre-norm block", _is_seed_pre_block, functools.partial(_seed_block, pre=True),
         ("norm_first", "num_heads", "activation")),
        ("seed post-norm block", _is_seed_post_block, functools.partial(_seed_block, pre=False),
         ("norm_first", "num_heads", "activation")),
        ("seed multi-head attention", _is_seed_attention, _seed_attention_module, ("num_heads",)),
        ("seed positional encoding", _is_seed_pe, _seed_pe, ()),
        ("seed feed-forward", _is_seed_ff, _seed_ff_module, ("activation",)),
    )
    for kind, test, build, allowed in seeds:
        if test(m):
            _check_overrides(kind, overrides, allowed)
            return build(m, overrides)
    listing = "\n  - ".join(RECOGNISED)
    raise TypeError(f"from_torch: unsupported module type {type(m).__module__}.{type(m).__name__}; "
                    f"recognised:\n  - {listing}")


def _check_overrides(kind: str, overrides: dict[str, Any], allowed: tuple[str, ...]) -> None:
    bad = sorted(set(overrides) - set(allowed))
    if bad:
        raise TypeError(f"override(s) {bad} do not apply to a {kind}; allowed: {list(allowed) or 'none'}")


def _check_same_config(expected: flax.linen.Module, got: flax.linen.Module) -> None:
    if type(expected) is not type(got):
        raise UserError(f"like= describes a {type(expected).__name__}, but the Flax module is a "
                        f"{type(got).__name__}")
    diff = [f.name for f in dataclasses.fields(expected)
            if f.name not in ("parent", "name") and getattr(expected, f.name) != getattr(got, f.name)]
    if diff:
        details = ", ".join(f"{k}: like={getattr(expected, k)!r} vs flax={getattr(got, k)!r}" for k in diff)
        raise UserError(f"like= does not match the Flax module's configuration ({details})")


def _plain_params(params: Mapping[str, Any]) -> dict[str, Any]:
    params = flax.core.meta.unbox(params)
    if isinstance(params, Mapping) and set(params) == {"params"}:
        params = params["params"]
    return jax.tree_util.tree_map(np.asarray, dict(params))


# ----------------------------------------------------------------------------- torch readers

def _only_dropout_rate(modules, where: str) -> float:
    """The common rate of some ``nn.Dropout`` modules (0 if none); differing rates raise."""
    rates = {float(d.p) for d in modules}
    if len(rates) > 1:
        raise UserError(f"{where}: dropout modules with different rates {sorted(rates)}; the "
                        "mirror has one rate there")
    return rates.pop() if rates else 0.0


def _activation_name(act: Any, where: str) -> str:
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


def _layer_norm_cfg(norms: dict[str, Any], where: str) -> tuple[float, bool]:
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


def _multihead_attention(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg = _mha_cfg(m, "")
    module = TorchMultiheadAttention(**cfg, embed_dim=int(m.embed_dim), kdim=int(m.kdim),
                                     vdim=int(m.vdim))
    dims = _Dims(int(m.embed_dim), int(m.kdim), int(m.vdim))
    return _Conversion(module, _builtin_maps(module, dims))


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
    eps, norm_bias = _layer_norm_cfg(norms, where)
    residual = [getattr(layer, f"dropout{i}") for i in ((1, 2, 3) if cross else (1, 2))]
    activation = overrides.get("activation") or _activation_name(layer.activation, f"{where}activation")
    cfg = dict(num_heads=sa["num_heads"], mlp_dim=int(layer.linear1.out_features),
               activation=activation, pre_norm=bool(layer.norm_first), norm_eps=eps,
               use_bias=sa["use_bias"], norm_bias=norm_bias,
               dropout_rate=_only_dropout_rate(residual, f"{where}dropout1..{len(residual)}"),
               attention_dropout_rate=sa["dropout_rate"],
               mlp_dropout_rate=float(layer.dropout.p), batch_first=sa["batch_first"])
    return cfg, _Dims(d, d, d, int(layer.linear1.out_features))


def _encoder_layer(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, dims = _layer_cfg(m, "", cross=False, overrides=overrides)
    module = TorchTransformerEncoderLayer(**cfg)
    return _Conversion(module, _builtin_maps(module, dims))


def _decoder_layer(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, dims = _layer_cfg(m, "", cross=True, overrides=overrides)
    module = TorchTransformerDecoderLayer(**cfg)
    return _Conversion(module, _builtin_maps(module, dims))


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
        eps, bias = _layer_norm_cfg({"norm": stack.norm}, where)
        final = dict(final_norm=True, final_norm_eps=eps, final_norm_bias=bias)
    return configs[0][0], configs[0][1], final


def _encoder(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, dims, final = _stack_cfg(m, "", cross=False, overrides=overrides)
    module = TorchTransformerEncoder(**cfg, **final, num_layers=len(m.layers))
    return _Conversion(module, _builtin_maps(module, dims))


def _decoder(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, dims, final = _stack_cfg(m, "", cross=True, overrides=overrides)
    module = TorchTransformerDecoder(**cfg, **final, num_layers=len(m.layers))
    return _Conversion(module, _builtin_maps(module, dims))


def _transformer(m: Any, overrides: dict[str, Any]) -> _Conversion:
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
    return _Conversion(module, _builtin_maps(module, dims))


# ----------------------------------------------------------------------------- seed: tests

def _has(m: Any, *names: str) -> bool:
    return all(getattr(m, n, None) is not None for n in names)


def _attention_names(m: Any) -> tuple[str, str, str, str] | None:
    import torch.nn as tnn

    for names in (("w_q", "w_k", "w_v", "w_o"), ("W_q", "W_k", "W_v", "W_o")):
        if all(isinstance(getattr(m, n, None), tnn.Linear) for n in names):
            return names
    return None


def _is_seed_decoder(m: Any) -> bool:
    return _has(m, "self_attn", "cross_attn", "feed_forward", "norm1", "norm2", "norm3")


def _is_seed_pre_block(m: Any) -> bool:
    return _has(m, "attn", "ff", "norm1", "norm2")


def _is_seed_post_block(m: Any) -> bool:
    return (_has(m, "attention") or _has(m, "self_attn")) and _has(m, "feed_forward", "norm1", "norm2")


def _is_seed_attention(m: Any) -> bool:
    return _attention_names(m) is not None


def _is_seed_pe(m: Any) -> bool:
    return "pe" in dict(m.named_buffers(recurse=False))


def _is_seed_ff(m: Any) -> bool:
    import torch.nn as tnn

    return (isinstance(m, tnn.Sequential)
            or any(isinstance(getattr(m, a, None), tnn.Sequential) for a in ("net", "feed_forward"))
            or all(isinstance(getattr(m, a, None), tnn.Linear) for a in ("w_1", "w_2")))


# ----------------------------------------------------------------------------- seed: readers

def _seed_attention(m: Any, tp: str, fp: tuple[str, ...], where: str,
                    num_heads: int | None) -> tuple[dict, list[TensorMap]]:
    """Seed attention at key prefix ``tp`` -> (library attention fields, maps to ``fp``)."""
    import torch.nn as tnn

    names = _attention_names(m)
    if names is None:
        raise UserError(f"{where}: expected nn.Linear attributes w_q, w_k, w_v, w_o (or W_q, "
                        f"W_k, W_v, W_o) on {type(m).__name__}")
    lq, lk, lv, lo = (getattr(m, n) for n in names)
    d, inner = lq.in_features, lq.out_features
    if num_heads is None:
        for attr in _HEAD_ATTRS:
            value = getattr(m, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                num_heads = value
                break
        else:
            head_dim = next((getattr(m, a) for a in ("d_k", "head_dim")
                             if isinstance(getattr(m, a, None), int)), None)
            if head_dim is None or inner % head_dim:
                raise UserError(f"{where}: cannot find the number of heads (no int attribute among "
                                f"{_HEAD_ATTRS} or d_k/head_dim); pass num_heads= to from_torch")
            num_heads = inner // head_dim
    n = int(num_heads)
    if inner % n:
        raise UserError(f"{where}{names[0]}: {inner} output features are not divisible by "
                        f"num_heads={n}")
    h = inner // n
    for lin, name in ((lk, names[1]), (lv, names[2])):
        if lin.out_features != inner:
            raise UserError(f"{where}{name}: out_features={lin.out_features}, expected {inner} "
                            f"like {names[0]}")
    if lo.in_features != inner or lo.out_features != d:
        raise UserError(f"{where}{names[3]}: expected Linear({inner}, {d}), got "
                        f"Linear({lo.in_features}, {lo.out_features})")
    biases = {name: getattr(m, name).bias is not None for name in names}
    if len(set(biases.values())) > 1:
        raise UserError(f"{where}: bias presence differs between {biases}; the mirror has one use_bias")
    bias = biases[names[0]]
    dropouts = [mod for mod in m.modules() if isinstance(mod, tnn.Dropout)]
    cfg = dict(num_heads=n, head_dim=h, use_bias=bias,
               dropout_rate=_only_dropout_rate(dropouts, f"{where}dropout"))
    maps = []
    for name, lin, flax_name in zip(names[:3], (lq, lk, lv), ("query", "key", "value")):
        maps += linear(f"{tp}{name}.", fp + (flax_name,), lin.in_features, inner, bias=bias,
                       kernel_shape=(lin.in_features, n, h), bias_shape=(n, h))
    maps += linear(f"{tp}{names[3]}.", fp + ("out",), inner, d, bias=bias, kernel_shape=(n, h, d))
    return cfg, maps


def _seed_attention_module(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _seed_attention(m, "", (), type(m).__name__, overrides.get("num_heads"))
    return _Conversion(SeedMultiHeadAttention(**cfg), maps)


def _seed_pe(m: Any, overrides: dict[str, Any]) -> _Conversion:
    import torch.nn as tnn

    pe = m.pe.detach().cpu().float().numpy()
    if pe.ndim != 3 or pe.shape[0] != 1:
        raise UserError(f"pe: expected a buffer of shape (1, max_len, D) (forward x + pe[:, :T]), "
                        f"got {pe.shape}")
    _, max_len, d = pe.shape
    table = TensorMap("pe", pe.shape,
                      constant=lambda: np.asarray(sinusoidal_table(max_len, d))[None],
                      within=1e-6 + np.arange(max_len, dtype=np.float64)[None, :, None] * 2.0 ** -22,
                      description=f"sinusoidal_table({max_len}, {d})")
    table.to_flax(pe)  # check the attribute even when the buffer is not persistent
    persistent = "pe" in m.state_dict()
    rate = _only_dropout_rate([x for x in m.modules() if isinstance(x, tnn.Dropout)], "dropout")
    return _Conversion(SeedPositionalEncoding(max_len=max_len, dropout_rate=rate),
                       [table] if persistent else [])


def _seed_ff(m: Any, tp: str, fp: tuple[str, ...], where: str,
             activation: str | None) -> tuple[dict, list[TensorMap]]:
    """Seed feed-forward at key prefix ``tp`` -> (SeedFeedForward fields, maps to ``fp``)."""
    import torch.nn as tnn

    if isinstance(m, tnn.Sequential):
        seq, prefix = m, tp
    else:
        attr = next((a for a in ("net", "feed_forward") if isinstance(getattr(m, a, None), tnn.Sequential)),
                    None)
        seq, prefix = (getattr(m, attr), f"{tp}{attr}.") if attr else (None, tp)
    if seq is not None:
        linears, acts, hidden_drop, out_drop = [], [], [], []
        for name, child in seq.named_children():
            if isinstance(child, tnn.Linear):
                linears.append((name, child))
            elif isinstance(child, tnn.Dropout):
                if not linears:
                    raise UserError(f"{where}{prefix}{name}: Dropout before the first Linear is "
                                    "not supported")
                (hidden_drop if len(linears) == 1 else out_drop).append(child)
            elif len(linears) == 1 and not acts:
                acts.append((name, child))
            else:
                raise UserError(f"{where}{prefix}{name}: unexpected {type(child).__name__} in the "
                                "feed-forward Sequential (expected Linear, activation, Dropout, Linear)")
        if len(linears) != 2:
            raise UserError(f"{where}{prefix.rstrip('.') or type(m).__name__}: expected exactly two "
                            f"Linear layers, found {len(linears)}")
        (n1, l1), (n2, l2) = linears
        k1, k2 = f"{prefix}{n1}.", f"{prefix}{n2}."
        if acts:
            act_name, act = acts[0]
            act_where = f"{where}{prefix}{act_name}"
        else:
            act, act_where = None, f"{where}{prefix.rstrip('.')}"
    else:
        l1, l2 = m.w_1, m.w_2
        k1, k2 = f"{tp}w_1.", f"{tp}w_2."
        children = dict(m.named_children())
        act_children = [(n, c) for n, c in children.items()
                        if isinstance(c, (tnn.ReLU, tnn.GELU, tnn.SiLU, tnn.Tanh))]
        if len(act_children) > 1:
            raise UserError(f"{where}: several activation modules {[n for n, _ in act_children]}")
        act, act_where = None, where
        if act_children:
            act, act_where = act_children[0][1], f"{where}{act_children[0][0]}"
        hidden_drop = [c for c in children.values() if isinstance(c, tnn.Dropout)]
        out_drop = []
    if activation is None:
        if act is None:
            raise UserError(f"{act_where}: no activation module found (a functional activation in "
                            "forward cannot be identified); pass activation='relu'|'gelu'|... to from_torch")
        activation = _activation_name(act, act_where)
    if l2.in_features != l1.out_features or l2.out_features != l1.in_features:
        raise UserError(f"{where}: Linear({l1.in_features}, {l1.out_features}) then "
                        f"Linear({l2.in_features}, {l2.out_features}) is not a D -> F -> D feed-forward")
    if (l1.bias is None) != (l2.bias is None):
        raise UserError(f"{where}: one Linear has a bias and the other does not")
    d, f = l1.in_features, l1.out_features
    bias = l1.bias is not None
    cfg = dict(mlp_dim=f, activation=activation, use_bias=bias,
               dropout_rate=_only_dropout_rate(hidden_drop, f"{where}dropout"),
               output_dropout_rate=_only_dropout_rate(out_drop, f"{where}dropout"))
    maps = (linear(k1, fp + ("wi",), d, f, bias=bias) + linear(k2, fp + ("wo",), f, d, bias=bias))
    return cfg, maps


def _seed_ff_module(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _seed_ff(m, "", (), "", overrides.get("activation"))
    return _Conversion(SeedFeedForward(**cfg), maps)


def _norm_first(m: Any, overrides: dict[str, Any], default: bool) -> bool:
    if "norm_first" in overrides:
        return bool(overrides["norm_first"])
    own = getattr(m, "norm_first", None)
    return own if isinstance(own, bool) else default


def _block_parts(m: Any, attn_names: dict[str, str], ff_name: str, norms: tuple[str, ...],
                 overrides: dict[str, Any]) -> tuple[dict, list[TensorMap]]:
    """Common reading of the seed blocks: attention(s) ``{torch name: flax name}``, feed-forward, norms."""
    import torch.nn as tnn

    attn_cfgs, maps = [], []
    for tname, fname in attn_names.items():
        cfg, amaps = _seed_attention(getattr(m, tname), f"{tname}.", (fname,), f"{tname}.",
                                     overrides.get("num_heads"))
        attn_cfgs.append(cfg)
        maps += amaps
    if any(c != attn_cfgs[0] for c in attn_cfgs):
        raise UserError(f"{' and '.join(attn_names)} are configured differently ({attn_cfgs}); "
                        "the mirror has one attention configuration")
    ff_cfg, ff_maps = _seed_ff(getattr(m, ff_name), f"{ff_name}.", ("mlp",), f"{ff_name}.",
                               overrides.get("activation"))
    maps += ff_maps
    if ff_cfg["output_dropout_rate"]:
        raise UserError(f"{ff_name}: a Dropout after the second Linear inside a block is not "
                        "supported (the block's residual dropout plays that role)")
    attn = attn_cfgs[0]
    if attn["use_bias"] != ff_cfg["use_bias"]:
        raise UserError(f"bias presence differs between the attention and {ff_name}; the mirror "
                        "has one use_bias")
    eps, norm_bias = _layer_norm_cfg({n: getattr(m, n) for n in norms}, "")
    for n in norms:
        maps += layer_norm(f"{n}.", (n,), getattr(m, n).normalized_shape[0], bias=norm_bias)
    residual = [c for c in m.children() if isinstance(c, tnn.Dropout)]
    cfg = dict(num_heads=attn["num_heads"], head_dim=attn["head_dim"], mlp_dim=ff_cfg["mlp_dim"],
               activation=ff_cfg["activation"], norm_eps=eps, use_bias=attn["use_bias"],
               norm_bias=norm_bias, dropout_rate=_only_dropout_rate(residual, "dropout"),
               attention_dropout_rate=attn["dropout_rate"], mlp_dropout_rate=ff_cfg["dropout_rate"])
    return cfg, maps


def _seed_block(m: Any, overrides: dict[str, Any], *, pre: bool) -> _Conversion:
    if pre:
        attn_name, ff_name = "attn", "ff"
    else:
        attn_name = "attention" if _has(m, "attention") else "self_attn"
        ff_name = "feed_forward"
    cfg, maps = _block_parts(m, {attn_name: "self_attn"}, ff_name, ("norm1", "norm2"), overrides)
    module = SeedEncoderBlock(**cfg, pre_norm=_norm_first(m, overrides, default=pre))
    return _Conversion(module, maps)


def _seed_decoder(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _block_parts(m, {"self_attn": "self_attn", "cross_attn": "cross_attn"},
                             "feed_forward", ("norm1", "norm2", "norm3"), overrides)
    module = SeedDecoderLayer(**cfg, pre_norm=_norm_first(m, overrides, default=False))
    return _Conversion(module, maps)
