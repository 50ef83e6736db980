"""PyTorch modules -> Flax mirrors (and back): ``from_torch`` and ``to_torch_state_dict``.

torch is imported lazily inside the functions: ``import transformer_jax`` never imports it.

    flax_module, params = from_torch(torch_module, **overrides)
    y = flax_module.apply({"params": params}, *inputs)          # == torch_module(*inputs)
    state = to_torch_state_dict(flax_module, params)            # {key: np.ndarray}
    torch_module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})

Recognised modules (the mirrors live in :mod:`transformer_jax.interop.tutorial.modules`):

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

The tutorial's PyTorch modules, by attribute names. First, a module whose ``forward`` is
missing (``nn.Module``'s unimplemented one) or a stub (a body that only returns None, e.g.
``pass``) is refused with a ``UserError`` (a ``ValueError``): PyTorch computes nothing to
convert. Both occur in the tutorials: ``GroupedQueryAttention`` stops after ``__init__``
(the message says what forward to add to a subclass, which then converts by rule 4) and
``SlidingWindowAttention.forward`` is ``pass`` (the message points to the library's
sliding-window attention). Then, tried in this order:
  1. whole Transformer: ``embedding``, ``pos_encoder``, ``encoder_layers`` (ModuleList),
     ``classifier`` [, ``decoder_embedding``, ``decoder_pos_encoder``, ``decoder_layers``
     unless the bool ``encoder_only``] -> ``TutorialTransformer``. The parts follow rules 5,
     11, 9 and 7; all layers must share one configuration. The decoder's ``tgt_mask`` is
     read off the module's own ``generate_mask``: the tutorial's ``triu(ones, diagonal=1)``
     -- inverted w.r.t. its own convention (1 = may attend), so target position i sees
     only later positions -- is reproduced as written (``decoder_mask="future"``), not
     refused: conversion keeps PyTorch's outputs, which is what a checkpoint trained with
     that mask needs; a corrected causal ``tril`` gives ``decoder_mask="causal"``;
  2. BERT: ``transformer`` (rule 1, encoder-only), ``pooler``, ``next_sentence_predictor``,
     ``masked_lm_predictor`` -> ``TutorialBERT``;
  3. GPT: ``transformer`` (rule 1, encoder-only), ``lm_head`` -> ``TutorialGPT``. The
     tutorial's BERT and GPT apply their heads (Linear layers of input width d_model) to
     the Transformer's output, which is already its classifier's vocabulary logits: they
     run, and convert as written, only when vocab_size == d_model; otherwise PyTorch
     fails with a shape error and so does ``from_torch``, with a message saying so;
  4. grouped-query attention: ``nn.Linear`` attributes ``q_proj, k_proj, v_proj, o_proj``
     -> ``TutorialGroupedQueryAttention``. Query heads from an int attribute as in rule 10 (or
     ``num_heads=``), key/value heads from ``n_kv_groups``, ``n_kv_heads``, ``num_kv_heads``
     or ``num_key_value_heads`` (or ``num_kv_heads=``, else k_proj's width / head dim).
     The forward is assumed to be the usual one (see ``TutorialGroupedQueryAttention``);
  5. input embedding: ``token_embedding`` (``nn.Embedding``) and an ``nn.Parameter``
     ``position_embedding`` (1, max_len, D) -> ``TutorialInputEmbedding`` (ids -> E[ids] *
     sqrt(D) + learned positions, dropout). ``padding_idx`` is accepted (its row gets a
     gradient here, none in PyTorch); ``max_norm`` and ``scale_grad_by_freq`` are refused;
  6. patch embedding: an ``nn.Conv2d`` attribute ``proj`` with kernel_size == stride, no
     padding, dilation 1, groups 1 -> ``TutorialPatchEmbed`` (NCHW images -> (B, N, D));
  7. post-norm decoder layer: ``self_attn``, ``cross_attn``, ``feed_forward``, ``norm1``,
     ``norm2``, ``norm3`` -> ``TutorialDecoderLayer``;
  8. pre-norm encoder block: ``attn``, ``ff``, ``norm1``, ``norm2`` -> ``TutorialEncoderBlock``
     (``pre_norm=True``);
  9. post-norm block: ``attention`` or ``self_attn``, ``feed_forward``, ``norm1``, ``norm2``
     -> ``TutorialEncoderBlock`` (``pre_norm=False``);
  10. multi-head attention: ``nn.Linear`` attributes ``w_q, w_k, w_v, w_o`` (or ``W_q, W_k,
      W_v, W_o``) -> ``TutorialMultiHeadAttention``. Heads from an int attribute ``num_heads``,
      ``n_heads``, ``n_head``, ``nhead``, ``heads`` or ``h`` (or ``d_k``/``head_dim``), else
      pass ``num_heads=``. Any ``nn.Dropout`` inside (directly or in an inner ``attention``
      submodule) is taken as dropout on the attention weights;
  11. positional encoding: a buffer ``pe`` of shape (1, max_len, D) equal to the library's
      ``sinusoidal_table(max_len, D)`` within 1e-6 + pos * 2**-22 (the second term is the
      fp32 rounding of the angle pos * freq: two implementations' 1-ulp differences in
      ``exp`` grow with the position), else an error naming ``pe``; the mirror recomputes
      the table (no parameters) -> ``TutorialPositionalEncoding``;
  12. feed-forward: an ``nn.Sequential`` of Linear, activation, Dropout, Linear [, Dropout]
      -- the module itself or its attribute ``net`` or ``feed_forward`` -- or ``nn.Linear``
      attributes ``w_1``, ``w_2`` with an activation module (ReLU/GELU/SiLU/Tanh) and an
      optional ``nn.Dropout`` among its children -> ``TutorialFeedForward``;
  13. scaled dot-product attention: no parameters or buffers, only ``nn.Dropout``
      children (their rate: dropout on the weights), ``forward(query, key, value, ...)``
      (or ``q, k, v``) -> ``TutorialScaledDotProductAttention``, returning (output, weights).
  Inside blocks, the attention and feed-forward submodules follow rules 10 and 12; residual
  dropout is the block's own ``nn.Dropout`` child(ren).

Overrides (keyword arguments) resolve ambiguities: ``norm_first`` (blocks and whole models;
default by the rules above, or the module's own bool ``norm_first`` attribute),
``num_heads`` (tutorial attention, blocks and whole models), ``num_kv_heads`` (grouped-query
attention), ``activation`` (feed-forwards, blocks, whole models and the built-in layers).

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
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import UserError
from ..layers.embeddings import sinusoidal_table
from .common import (ConversionError, StateDictReader, TensorMap, dump_state_dict,
                      flatten_params, layer_norm, linear, load_params, packed_linear)
from .tutorial.modules import (TutorialBERT, TutorialDecoderLayer, TutorialEncoderBlock, TutorialFeedForward,
                            TutorialGPT, TutorialGroupedQueryAttention, TutorialInputEmbedding,
                            TutorialMultiHeadAttention, TutorialPatchEmbed, TutorialPositionalEncoding,
                            TutorialScaledDotProductAttention, TutorialTransformer,
                            TorchMultiheadAttention, TorchTransformer, TorchTransformerDecoder,
                            TorchTransformerDecoderLayer, TorchTransformerEncoder,
                            TorchTransformerEncoderLayer)

__all__ = ["from_torch", "to_torch_state_dict", "RECOGNISED"]

RECOGNISED = (
    "torch.nn.MultiheadAttention", "torch.nn.TransformerEncoderLayer",
    "torch.nn.TransformerEncoder", "torch.nn.TransformerDecoderLayer",
    "torch.nn.TransformerDecoder", "torch.nn.Transformer",
    "tutorial decoder layer (self_attn, cross_attn, feed_forward, norm1, norm2, norm3)",
    "tutorial pre-norm block (attn, ff, norm1, norm2)",
    "tutorial post-norm block (attention|self_attn, feed_forward, norm1, norm2)",
    "tutorial multi-head attention (w_q, w_k, w_v, w_o Linear layers, or W_q...)",
    "tutorial positional encoding (buffer pe)",
    "tutorial feed-forward (Sequential Linear/act/Dropout/Linear, itself or as net/feed_forward; "
    "or w_1, w_2 Linear + activation module)",
    ("tutorial Transformer (embedding, pos_encoder, encoder_layers, classifier [, decoder_layers, "
     "decoder_embedding, decoder_pos_encoder])"),
    "tutorial BERT (transformer, pooler, next_sentence_predictor, masked_lm_predictor)",
    "tutorial GPT (transformer, lm_head)",
    "tutorial grouped-query attention (q_proj, k_proj, v_proj, o_proj Linear layers)",
    "tutorial input embedding (token_embedding Embedding, position_embedding Parameter)",
    "tutorial patch embedding (proj Conv2d)",
    "tutorial scaled dot-product attention (no parameters, forward(query, key, value, ...))",
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
      **overrides: ``norm_first``, ``num_heads``, ``num_kv_heads`` or ``activation`` where
        the module is ambiguous (which ones apply depends on the module kind; others raise
        TypeError).

    Returns:
      ``(flax_module, params)``; ``flax_module.apply({"params": params}, *inputs)`` takes
      the torch forward's positional inputs and returns what it returns.

    Raises:
      TypeError: unrecognised module type, or an override that does not apply.
      ValueError: an unsupported feature (naming the attribute), a module that cannot run
        as written (no or a stub ``forward``; the tutorial's BERT/GPT with vocab_size !=
        d_model), or a state dict that does not match (naming the key, and the expected
        and actual shapes).
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
    else; the tutorial mirrors need ``like=`` a torch module of the same structure, from which
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
    _check_runnable(m)

    blocks = ("norm_first", "num_heads", "activation")
    tutorial = (
        ("tutorial Transformer", _is_tutorial_transformer, _tutorial_transformer, blocks),
        ("tutorial BERT", _is_tutorial_bert, _tutorial_bert, blocks),
        ("tutorial GPT", _is_tutorial_gpt, _tutorial_gpt, blocks),
        ("tutorial grouped-query attention", _gqa_names, _tutorial_gqa, ("num_heads", "num_kv_heads")),
        ("tutorial input embedding", _is_tutorial_input_embedding, _tutorial_input_embedding, ()),
        ("tutorial patch embedding", _is_tutorial_patch_embed, _tutorial_patch_embed, ()),
        ("tutorial decoder layer", _is_tutorial_decoder, _tutorial_decoder, blocks),
        ("tutorial pre-norm block", _is_tutorial_pre_block, functools.partial(_tutorial_block, pre=True), blocks),
        ("tutorial post-norm block", _is_tutorial_post_block, functools.partial(_tutorial_block, pre=False),
         blocks),
        ("tutorial multi-head attention", _is_tutorial_attention, _tutorial_attention_module, ("num_heads",)),
        ("tutorial positional encoding", _is_tutorial_pe, _tutorial_pe, ()),
        ("tutorial feed-forward", _is_tutorial_ff, _tutorial_ff_module, ("activation",)),
        ("tutorial scaled dot-product attention", _is_tutorial_sdpa, _tutorial_sdpa, ()),
    )
    for kind, test, build, allowed in tutorial:
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


# ----------------------------------------------------------------------------- tutorial: tests

def _has(m: Any, *names: str) -> bool:
    return all(getattr(m, n, None) is not None for n in names)


def _attention_names(m: Any) -> tuple[str, str, str, str] | None:
    import torch.nn as tnn

    for names in (("w_q", "w_k", "w_v", "w_o"), ("W_q", "W_k", "W_v", "W_o")):
        if all(isinstance(getattr(m, n, None), tnn.Linear) for n in names):
            return names
    return None


def _is_tutorial_decoder(m: Any) -> bool:
    return _has(m, "self_attn", "cross_attn", "feed_forward", "norm1", "norm2", "norm3")


def _is_tutorial_pre_block(m: Any) -> bool:
    return _has(m, "attn", "ff", "norm1", "norm2")


def _is_tutorial_post_block(m: Any) -> bool:
    return (_has(m, "attention") or _has(m, "self_attn")) and _has(m, "feed_forward", "norm1", "norm2")


def _is_tutorial_attention(m: Any) -> bool:
    return _attention_names(m) is not None


def _is_tutorial_pe(m: Any) -> bool:
    return "pe" in dict(m.named_buffers(recurse=False))


def _is_tutorial_ff(m: Any) -> bool:
    import torch.nn as tnn

    return (isinstance(m, tnn.Sequential)
            or any(isinstance(getattr(m, a, None), tnn.Sequential) for a in ("net", "feed_forward"))
            or all(isinstance(getattr(m, a, None), tnn.Linear) for a in ("w_1", "w_2")))


# ----------------------------------------------------------------------------- tutorial: readers

def _tutorial_attention(m: Any, tp: str, fp: tuple[str, ...], where: str,
                    num_heads: int | None) -> tuple[dict, list[TensorMap]]:
    """Tutorial attention at key prefix ``tp`` -> (library attention fields, maps to ``fp``)."""
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


def _tutorial_attention_module(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _tutorial_attention(m, "", (), type(m).__name__, overrides.get("num_heads"))
    return _Conversion(TutorialMultiHeadAttention(**cfg), maps)


def _tutorial_pe(m: Any, overrides: dict[str, Any]) -> _Conversion:
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
    return _Conversion(TutorialPositionalEncoding(max_len=max_len, dropout_rate=rate),
                       [table] if persistent else [])


def _tutorial_ff(m: Any, tp: str, fp: tuple[str, ...], where: str,
             activation: str | None) -> tuple[dict, list[TensorMap]]:
    """Tutorial feed-forward at key prefix ``tp`` -> (TutorialFeedForward fields, maps to ``fp``)."""
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


def _tutorial_ff_module(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _tutorial_ff(m, "", (), "", overrides.get("activation"))
    return _Conversion(TutorialFeedForward(**cfg), maps)


def _norm_first(m: Any, overrides: dict[str, Any], default: bool) -> bool:
    if "norm_first" in overrides:
        return bool(overrides["norm_first"])
    own = getattr(m, "norm_first", None)
    return own if isinstance(own, bool) else default


def _block_parts(m: Any, attn_names: dict[str, str], ff_name: str, norms: tuple[str, ...],
                 overrides: dict[str, Any]) -> tuple[dict, list[TensorMap]]:
    """Common reading of the tutorial blocks: attention(s) ``{torch name: flax name}``, feed-forward, norms."""
    import torch.nn as tnn

    attn_cfgs, maps = [], []
    for tname, fname in attn_names.items():
        cfg, amaps = _tutorial_attention(getattr(m, tname), f"{tname}.", (fname,), f"{tname}.",
                                     overrides.get("num_heads"))
        attn_cfgs.append(cfg)
        maps += amaps
    if any(c != attn_cfgs[0] for c in attn_cfgs):
        raise UserError(f"{' and '.join(attn_names)} are configured differently ({attn_cfgs}); "
                        "the mirror has one attention configuration")
    ff_cfg, ff_maps = _tutorial_ff(getattr(m, ff_name), f"{ff_name}.", ("mlp",), f"{ff_name}.",
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


def _tutorial_block(m: Any, overrides: dict[str, Any], *, pre: bool) -> _Conversion:
    if pre:
        attn_name, ff_name = "attn", "ff"
    else:
        attn_name = "attention" if _has(m, "attention") else "self_attn"
        ff_name = "feed_forward"
    cfg, maps = _block_parts(m, {attn_name: "self_attn"}, ff_name, ("norm1", "norm2"), overrides)
    module = TutorialEncoderBlock(**cfg, pre_norm=_norm_first(m, overrides, default=pre))
    return _Conversion(module, maps)


def _tutorial_decoder(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _block_parts(m, {"self_attn": "self_attn", "cross_attn": "cross_attn"},
                             "feed_forward", ("norm1", "norm2", "norm3"), overrides)
    module = TutorialDecoderLayer(**cfg, pre_norm=_norm_first(m, overrides, default=False))
    return _Conversion(module, maps)


# ----------------------------------------------------------------------------- tutorial: runnable?

_GQA_NO_FORWARD = (
    "(The tutorial's GroupedQueryAttention is such a class: its code stops after __init__.) Give it a "
    "forward(query, key, value, mask=None) in a subclass -- batch-first (B, T, D) inputs; N "
    "query heads and K key/value heads, each shared by N/K consecutive query heads "
    "(repeat_interleave); softmax(q k^T / sqrt(head_dim)) with mask 1 = may attend; o_proj "
    "over the concatenated heads -- and convert that subclass (-> TutorialGroupedQueryAttention), "
    "or use transformer_jax.layers.MultiHeadAttention(num_heads=N, num_kv_heads=K) directly")
_WINDOW_STUB = (
    "(The tutorial's SlidingWindowAttention is such a stub: no projections and no windowing "
    "were written.) For sliding-window attention use the library's own: set "
    "model.attention_window=W (the GPTConfig/BertConfig/ViTConfig field; each token attends "
    "to the W nearest tokens), or pass the mask "
    "transformer_jax.layers.masks.sliding_window_mask(T, window=W) to a MultiHeadAttention or "
    "to a converted tutorial attention")


def _is_stub(fn: Any) -> bool:
    """Whether a function's body does nothing but return None (``pass``, ``...``, a docstring)."""
    import dis

    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    for ins in dis.get_instructions(code):
        if ins.opname in ("RESUME", "NOP", "CACHE", "EXTENDED_ARG", "RETURN_VALUE"):
            continue
        if ins.opname in ("LOAD_CONST", "RETURN_CONST") and ins.argval is None:
            continue
        return False
    return True


def _check_runnable(m: Any) -> None:
    """Refuse a module whose ``forward`` is missing or a stub: PyTorch computes nothing to match."""
    import torch.nn as tnn

    forward, cls = getattr(type(m), "forward", None), type(m).__name__
    if forward is tnn.Module.forward:
        hint = _GQA_NO_FORWARD if _gqa_names(m) else "Define forward() in a subclass and convert that"
        raise UserError(f"{cls} has no forward(): PyTorch cannot run it (calling it raises "
                        f"NotImplementedError), so there is no computation to convert. {hint}")
    if _is_stub(forward):
        hint = _WINDOW_STUB if hasattr(m, "window_size") else "Implement forward() and convert that"
        raise UserError(f"{cls}.forward is a stub: its body does nothing and returns None, so "
                        f"PyTorch computes nothing that could be converted. {hint}")


# ----------------------------------------------------------------------------- tutorial: more tests

_GQA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
_KV_HEAD_ATTRS = ("n_kv_groups", "n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv_head",
                  "kv_heads")


def _gqa_names(m: Any) -> bool:
    import torch.nn as tnn

    return all(isinstance(getattr(m, n, None), tnn.Linear) for n in _GQA_NAMES)


def _is_tutorial_input_embedding(m: Any) -> bool:
    import torch.nn as tnn

    return (isinstance(getattr(m, "token_embedding", None), tnn.Embedding)
            and isinstance(getattr(m, "position_embedding", None), tnn.Parameter))


def _is_tutorial_patch_embed(m: Any) -> bool:
    import torch.nn as tnn

    return isinstance(getattr(m, "proj", None), tnn.Conv2d)


def _is_tutorial_sdpa(m: Any) -> bool:
    """No parameters or buffers, only Dropout children, ``forward(query, key, value, ...)``."""
    import inspect

    import torch.nn as tnn

    if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
        return False
    if not all(isinstance(c, tnn.Dropout) for c in m.children()):
        return False
    try:
        names = [p.lower() for p in list(inspect.signature(type(m).forward).parameters)[1:4]]
    except (TypeError, ValueError):
        return False
    return names in (["query", "key", "value"], ["q", "k", "v"])


def _is_tutorial_transformer(m: Any) -> bool:
    return _has(m, "embedding", "pos_encoder", "encoder_layers", "classifier")


def _is_tutorial_bert(m: Any) -> bool:
    return _has(m, "transformer", "pooler", "next_sentence_predictor", "masked_lm_predictor")


def _is_tutorial_gpt(m: Any) -> bool:
    return _has(m, "transformer", "lm_head")


# ----------------------------------------------------------------------------- tutorial: small parts

def _int_attr(m: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(m, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _gqa_heads(m: Any, overrides: dict[str, Any]) -> tuple[int, int, int]:
    """(N query heads, K key/value heads, head dim H) of a tutorial grouped-query attention."""
    lq, lk = m.q_proj, m.k_proj
    n = overrides.get("num_heads") or _int_attr(m, _HEAD_ATTRS)
    if n is None:
        raise UserError(f"cannot find the number of query heads (no int attribute among "
                        f"{_HEAD_ATTRS}); pass num_heads= to from_torch")
    n = int(n)
    if lq.out_features % n:
        raise UserError(f"q_proj: {lq.out_features} output features are not divisible by num_heads={n}")
    h = lq.out_features // n
    own = getattr(m, "head_dim", None)
    if isinstance(own, int) and own != h:
        raise UserError(f"head_dim={own} but q_proj's {lq.out_features} features over num_heads={n} "
                        f"give {h}; pass the right num_heads=")
    kv = overrides.get("num_kv_heads") or _int_attr(m, _KV_HEAD_ATTRS)
    if kv is None:
        if lk.out_features % h:
            raise UserError(f"k_proj: {lk.out_features} output features are not a multiple of "
                            f"head_dim={h}; pass num_kv_heads= to from_torch")
        kv = lk.out_features // h
    kv = int(kv)
    for name in ("k_proj", "v_proj"):
        if getattr(m, name).out_features != kv * h:
            raise UserError(f"{name}: out_features={getattr(m, name).out_features}, expected "
                            f"num_kv_heads * head_dim = {kv} * {h}")
    if n % kv:
        raise UserError(f"num_heads={n} is not a multiple of the {kv} key/value heads")
    if m.o_proj.in_features != n * h:
        raise UserError(f"o_proj: in_features={m.o_proj.in_features}, expected num_heads * head_dim "
                        f"= {n * h} (the concatenated heads)")
    return n, kv, h


def _tutorial_gqa(m: Any, overrides: dict[str, Any]) -> _Conversion:
    import torch.nn as tnn

    n, kv, h = _gqa_heads(m, overrides)
    lq, lk, lv, lo = (getattr(m, name) for name in _GQA_NAMES)
    biases = {name: getattr(m, name).bias is not None for name in _GQA_NAMES}
    if len(set(biases.values())) > 1:
        raise UserError(f"bias presence differs between {biases}; the mirror has one use_bias")
    bias = biases["q_proj"]
    maps = linear("q_proj.", ("query",), lq.in_features, n * h, bias=bias,
                  kernel_shape=(lq.in_features, n, h), bias_shape=(n, h))
    for name, lin, flax_name in (("k_proj", lk, "key"), ("v_proj", lv, "value")):
        maps += linear(f"{name}.", (flax_name,), lin.in_features, kv * h, bias=bias,
                       kernel_shape=(lin.in_features, kv, h), bias_shape=(kv, h))
    maps += linear("o_proj.", ("out",), n * h, lo.out_features, bias=bias,
                   kernel_shape=(n, h, lo.out_features))
    rate = _only_dropout_rate([x for x in m.modules() if isinstance(x, tnn.Dropout)], "dropout")
    module = TutorialGroupedQueryAttention(
        num_heads=n, num_kv_heads=kv, head_dim=h, use_bias=bias, dropout_rate=rate,
        out_features=None if lo.out_features == lq.in_features else lo.out_features)
    return _Conversion(module, maps)


def _tutorial_input_embedding(m: Any, overrides: dict[str, Any]) -> _Conversion:
    import torch.nn as tnn

    emb, pos = m.token_embedding, m.position_embedding
    v, d = emb.num_embeddings, emb.embedding_dim
    if emb.max_norm is not None or emb.scale_grad_by_freq:
        raise UserError("token_embedding: max_norm / scale_grad_by_freq are not supported (the "
                        "mirror is a plain lookup)")
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[2] != d:
        raise UserError(f"position_embedding: expected shape (1, max_len, {d}) (forward adds "
                        f"position_embedding[:, :T]), got {tuple(pos.shape)}")
    own = getattr(m, "d_model", d)
    if own != d:
        raise UserError(f"d_model={own!r} differs from token_embedding's width {d}; the mirror "
                        "scales the embeddings by sqrt(width)")
    shape = tuple(pos.shape)
    maps = [TensorMap("token_embedding.weight", (v, d), ((("token_embedding", "embedding"), (v, d)),)),
            TensorMap("position_embedding", shape, ((("position_embedding",), shape),))]
    rate = _only_dropout_rate([x for x in m.modules() if isinstance(x, tnn.Dropout)], "dropout")
    return _Conversion(TutorialInputEmbedding(vocab_size=v, features=d, max_len=shape[1],
                                          dropout_rate=rate), maps)


def _tutorial_patch_embed(m: Any, overrides: dict[str, Any]) -> _Conversion:
    conv = m.proj
    kernel, stride = tuple(conv.kernel_size), tuple(conv.stride)
    if kernel != stride:
        raise UserError(f"proj: kernel_size={kernel} != stride={stride}; only non-overlapping "
                        "patches (kernel_size == stride) are supported")
    if conv.padding not in ((0, 0), "valid") or tuple(conv.dilation) != (1, 1) or conv.groups != 1:
        raise UserError(f"proj: padding={conv.padding}, dilation={conv.dilation}, groups="
                        f"{conv.groups}; only padding 0, dilation 1 and groups 1 are supported")
    d, c = conv.out_channels, conv.in_channels
    bias = conv.bias is not None
    maps = [TensorMap("proj.weight", (d, c) + kernel, ((("proj", "kernel"), kernel + (c, d)),),
                      transpose=(2, 3, 1, 0))]                                  # OIHW -> HWIO
    if bias:
        maps.append(TensorMap("proj.bias", (d,), ((("proj", "bias"), (d,)),)))
    return _Conversion(TutorialPatchEmbed(features=d, patch_size=kernel, in_channels=c, use_bias=bias),
                       maps)


def _tutorial_sdpa(m: Any, overrides: dict[str, Any]) -> _Conversion:
    rate = _only_dropout_rate(list(m.children()), "dropout")
    return _Conversion(TutorialScaledDotProductAttention(dropout_rate=rate), [])


# ----------------------------------------------------------------------------- tutorial: whole models

_BLOCK_FIELDS = ("num_heads", "head_dim", "mlp_dim", "activation", "pre_norm", "norm_eps",
                 "use_bias", "norm_bias", "dropout_rate", "attention_dropout_rate",
                 "mlp_dropout_rate")
_BLOCK_OVERRIDES = ("norm_first", "num_heads", "activation")


def _nest(maps: list[TensorMap], tp: str, fp: tuple[str, ...]) -> list[TensorMap]:
    """Maps of a submodule moved under state-dict key prefix ``tp`` and Flax path ``fp``."""
    return [dataclasses.replace(t, key=tp + t.key, targets=tuple((fp + p, s) for p, s in t.targets))
            for t in maps]


def _part(child: Any, name: str, flax_name: str, want: type, overrides: dict[str, Any]) -> _Conversion:
    """A submodule (attribute path ``name``) converted by the rules above; must give ``want``."""
    import torch.nn as tnn

    if not isinstance(child, tnn.Module):
        raise UserError(f"{name}: expected a torch module, got {type(child).__name__}")
    try:
        conv = _recognise(child, dict(overrides))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from e
    if not isinstance(conv.module, want):
        raise UserError(f"{name}: expected a module that converts to {want.__name__}, got "
                        f"{type(child).__name__} (-> {type(conv.module).__name__})")
    return _Conversion(conv.module, _nest(conv.maps, f"{name}.", (flax_name,)))


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b))
                     if a.get(k) != b.get(k))


def _stack_of(layers: Any, name: str, want: type, overrides: dict[str, Any]) -> tuple[dict, list]:
    """(shared block fields, maps) of a ModuleList of tutorial layers ``name.{i}`` -> ``name_{i}``."""
    import torch.nn as tnn

    if not isinstance(layers, tnn.ModuleList) or not len(layers):
        raise UserError(f"{name}: expected a non-empty nn.ModuleList of layers, got "
                        f"{type(layers).__name__}")
    cfgs, maps = [], []
    for i, layer in enumerate(layers):
        conv = _part(layer, f"{name}.{i}", f"{name}_{i}", want, overrides)
        cfgs.append({f: getattr(conv.module, f) for f in _BLOCK_FIELDS})
        maps += conv.maps
    for i, cfg in enumerate(cfgs[1:], start=1):
        if cfg != cfgs[0]:
            raise UserError(f"{name}.{i} is configured differently from {name}.0 "
                            f"({_differences(cfgs[0], cfg)}); the mirror stacks identical layers")
    return cfgs[0], maps


def _embeddings(m: Any, emb_name: str, pe_name: str) -> tuple[dict, list[TensorMap]]:
    """(TutorialTransformer embedding fields, maps) of an InputEmbedding + PositionalEncoding pair."""
    emb = _part(getattr(m, emb_name, None), emb_name, emb_name, TutorialInputEmbedding, {})
    pe = _part(getattr(m, pe_name, None), pe_name, pe_name, TutorialPositionalEncoding, {})
    e, p = emb.module, pe.module
    cfg = dict(vocab_size=e.vocab_size, d_model=e.features, max_len=e.max_len,
               embedding_dropout_rate=e.dropout_rate, pe_max_len=p.max_len,
               pe_dropout_rate=p.dropout_rate)
    return cfg, emb.maps + pe.maps


def _decoder_mask(m: Any) -> str:
    """Which of TutorialTransformer's decoder masks the module's ``generate_mask`` builds."""
    import torch

    if not callable(getattr(m, "generate_mask", None)):
        raise UserError("generate_mask: an encoder-decoder Transformer needs its generate_mask(size) "
                        "method (the decoder's tgt_mask)")
    t = 5
    with torch.no_grad():
        keep = torch.as_tensor(m.generate_mask(t)) != 0       # the decoder reads mask == 0 as blocked
    ones = torch.ones(t, t, dtype=torch.bool)
    if tuple(keep.shape) == (t, t) and torch.equal(keep.cpu(), torch.triu(ones, diagonal=1)):
        return "future"
    if tuple(keep.shape) == (t, t) and torch.equal(keep.cpu(), torch.tril(ones)):
        return "causal"
    raise UserError(f"generate_mask({t}) gives {keep.int().tolist()} (nonzero = may attend, as the "
                    "decoder layers read it); supported: the tutorial's triu(ones, diagonal=1) and "
                    "a causal tril(ones)")


def _tutorial_transformer_parts(m: Any, overrides: dict[str, Any]) -> tuple[dict, list[TensorMap]]:
    """(TutorialTransformer fields, maps) of the tutorial's whole Transformer."""
    import torch.nn as tnn

    enc_only = getattr(m, "encoder_only", False)
    if not isinstance(enc_only, bool):
        raise UserError(f"encoder_only: expected a bool, got {enc_only!r}")
    blocks = {k: v for k, v in overrides.items() if k in _BLOCK_OVERRIDES}
    cfg, maps = _embeddings(m, "embedding", "pos_encoder")
    block, layer_maps = _stack_of(getattr(m, "encoder_layers", None), "encoder_layers",
                                  TutorialEncoderBlock, blocks)
    maps += layer_maps
    if not enc_only:
        dec, dec_maps = _embeddings(m, "decoder_embedding", "decoder_pos_encoder")
        if dec != cfg:
            raise UserError("decoder_embedding/decoder_pos_encoder are configured differently from "
                            f"embedding/pos_encoder ({_differences(cfg, dec)}); the mirror has one "
                            "embedding configuration")
        dec_block, layer_maps = _stack_of(getattr(m, "decoder_layers", None), "decoder_layers",
                                          TutorialDecoderLayer, blocks)
        if dec_block != block:
            raise UserError(f"decoder_layers are configured differently from encoder_layers "
                            f"({_differences(block, dec_block)}); the mirror has one layer "
                            "configuration")
        maps += dec_maps + layer_maps
        cfg.update(num_decoder_layers=len(m.decoder_layers), decoder_mask=_decoder_mask(m))
    d, v = cfg["d_model"], cfg["vocab_size"]
    clf = getattr(m, "classifier", None)
    if not isinstance(clf, tnn.Linear) or (clf.in_features, clf.out_features) != (d, v):
        raise UserError(f"classifier: expected nn.Linear({d}, {v}) (d_model -> vocab_size), got {clf!r}")
    maps += linear("classifier.", ("classifier",), d, v, bias=clf.bias is not None)
    cfg.update(block, num_layers=len(m.encoder_layers), encoder_only=enc_only,
               classifier_bias=clf.bias is not None)
    return cfg, maps


def _tutorial_transformer(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _tutorial_transformer_parts(m, overrides)
    return _Conversion(TutorialTransformer(**cfg), maps)


def _check_linear(m: Any, name: str, d_in: int, d_out: int, bias: bool | None = True) -> bool:
    import torch.nn as tnn

    lin = getattr(m, name, None)
    if not isinstance(lin, tnn.Linear) or (lin.in_features, lin.out_features) != (d_in, d_out):
        raise UserError(f"{name}: expected nn.Linear({d_in}, {d_out}), got {lin!r}")
    if bias is not None and (lin.bias is not None) != bias:
        raise UserError(f"{name}: expected {'a' if bias else 'no'} bias, as in the tutorial's class")
    return lin.bias is not None


def _tutorial_lm_parts(m: Any, overrides: dict[str, Any], kind: str,
                   heads: str) -> tuple[dict, list[TensorMap]]:
    """The ``transformer`` of the tutorial's BERT/GPT, and the check that the class can run."""
    if not _is_tutorial_transformer(m.transformer):
        raise UserError("transformer: expected the tutorial's Transformer (embedding, pos_encoder, "
                        f"encoder_layers, classifier), got {type(m.transformer).__name__}")
    cfg, maps = _tutorial_transformer_parts(m.transformer, overrides)
    if not cfg["encoder_only"]:
        raise UserError(f"transformer: the {kind} calls transformer(input_ids) without target ids, "
                        "which only an encoder_only=True Transformer accepts")
    d, v = cfg["d_model"], cfg["vocab_size"]
    if v != d:
        raise UserError(
            f"the tutorial's {kind} cannot run with vocab_size={v} != d_model={d}: its forward "
            f"applies {heads} to transformer(input_ids), which is the Transformer's classifier "
            f"output -- (B, T, {v}) vocabulary logits, not (B, T, {d}) hidden states -- so PyTorch "
            "raises 'mat1 and mat2 shapes cannot be multiplied' and there is nothing to convert. "
            "Convert its encoder on its own (from_torch(model.transformer)), or fix the class so "
            "that its heads read the hidden states")
    return cfg, _nest(maps, "transformer.", ("transformer",))


def _tutorial_bert(m: Any, overrides: dict[str, Any]) -> _Conversion:
    import torch.nn as tnn

    heads = "pooler = Linear(d_model, d_model) and masked_lm_predictor = Linear(d_model, vocab_size)"
    cfg, maps = _tutorial_lm_parts(m, overrides, "BERT", heads)
    d, v = cfg["d_model"], cfg["vocab_size"]
    if not isinstance(getattr(m, "activation", None), tnn.Tanh):
        raise UserError(f"activation: expected nn.Tanh (the pooler's), got "
                        f"{getattr(m, 'activation', None)!r}")
    for name, d_out in (("pooler", d), ("next_sentence_predictor", 2), ("masked_lm_predictor", v)):
        _check_linear(m, name, d, d_out)
        maps += linear(f"{name}.", (name,), d, d_out)
    return _Conversion(TutorialBERT(**cfg), maps)


def _tutorial_gpt(m: Any, overrides: dict[str, Any]) -> _Conversion:
    cfg, maps = _tutorial_lm_parts(m, overrides, "GPT", "lm_head = Linear(d_model, vocab_size)")
    d, v = cfg["d_model"], cfg["vocab_size"]
    bias = _check_linear(m, "lm_head", d, v, bias=None)
    maps += linear("lm_head.", ("lm_head",), d, v, bias=bias)
    return _Conversion(TutorialGPT(**cfg, lm_head_bias=bias), maps)
