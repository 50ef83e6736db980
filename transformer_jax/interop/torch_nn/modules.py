"""Flax mirrors of ``torch.nn``'s Transformer modules: same forward signature, same mask conventions.

Each mirror is a thin subclass of a library layer (so its parameters have the library's
layout) whose ``__call__`` takes the positional inputs of the PyTorch ``forward`` and
returns what it returns::

    module, params = interop.from_torch(torch_module)
    out = module.apply({"params": params}, *the_same_inputs_as_torch)

Dropout is off unless ``deterministic=False`` is passed (with a ``"dropout"`` rng).
Nothing here imports torch.

Shape legend: B batch, T query (target) length, S key (source) length, D model width,
N heads, K key/value heads, H head dim, F feed-forward width.

``torch.nn`` built-ins, with PyTorch's conventions: ``batch_first`` (seq-first (T, B, D)
inputs by default) or unbatched 2-D inputs; masks where bool ``True`` = NOT allowed,
or float masks that are *added* to the logits (0 / -inf); ``attn_mask`` (T, S) or
(B*N, T, S); ``key_padding_mask`` (B, S). :class:`TorchMultiheadAttention`,
:class:`TorchTransformerEncoderLayer`, :class:`TorchTransformerEncoder`,
:class:`TorchTransformerDecoderLayer`, :class:`TorchTransformerDecoder`,
:class:`TorchTransformer`. They follow PyTorch's reference ("slow") path, i.e. what
torch computes in training mode or whenever autograd is on:

- ``is_causal`` is a hint that the mask *passed alongside* is causal. As in
  ``F.multi_head_attention_forward``: ``is_causal=True`` without a mask raises; with no
  key padding mask and ``need_weights=False`` (always the case inside the Transformer
  layers) the causal mask (query i sees keys j <= i) *replaces* the given mask;
  otherwise the given mask is used and the hint ignored.
- ``is_causal=None`` on the stacks (torch's default) asks torch to *detect* whether the
  mask equals ``generate_square_subsequent_mask``; it only says yes when that mask is
  exactly causal, in which case both branches compute the same thing, so here ``None``
  simply uses the mask.
- Rows whose keys are all blocked (by bool masks) give the mean of the values (the
  library's convention); torch gives NaN or zeros there depending on its code path.
- torch's inference fast path (eval mode, no autograd) with ``enable_nested_tensor``
  returns zeros at padded positions of ``nn.TransformerEncoder``; the mirrors compute
  the padded positions like the reference path (valid positions agree either way).

The mirrors of the tutorial's PyTorch modules are in
:mod:`transformer_jax.interop.tutorial.modules`.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ...errors import UserError
from ...layers import MultiHeadAttention
from ...layers.blocks import DecoderBlock, EncoderBlock
from ...layers.masks import causal_mask, combine_masks
from ...layers.norms import LayerNorm

Array = jax.Array

__all__ = [
    "TorchMultiheadAttention", "TorchTransformerEncoderLayer", "TorchTransformerEncoder",
    "TorchTransformerDecoderLayer", "TorchTransformerDecoder", "TorchTransformer",
    "torch_attention_masks",
]


# ----------------------------------------------------------------------------- masks & layout

def torch_attention_masks(attn_mask: Array | None, key_padding_mask: Array | None, *,
                          batch: int, num_heads: int, q_len: int, k_len: int,
                          unbatched: bool = False, is_causal: bool = False,
                          need_weights: bool = False,
                          names: tuple[str, str] = ("attn_mask", "key_padding_mask"),
                          ) -> tuple[Array | None, Array | None, bool]:
    """PyTorch's ``attn_mask``/``key_padding_mask`` -> the library's ``(mask, bias, causal)``.

    PyTorch: bool ``True`` = NOT allowed, float masks are added to the logits. ``attn_mask``
    is (T, S) or (B*N, T, S) (for unbatched inputs (T, S) or (N, T, S)); ``key_padding_mask``
    is (B, S) ((S,) unbatched). Returns a bool mask (B|1, N|1, T, S) with 1 = may attend,
    a float32 additive bias of the same layout, and whether to apply a causal mask instead
    (the ``is_causal`` rule of ``F.multi_head_attention_forward``, see the module docstring).
    """
    attn_name, kpm_name = names
    if is_causal and attn_mask is None:
        raise UserError(f"Need {attn_name} if specifying the is_causal hint (as in PyTorch); "
                        "you may use nn.Transformer.generate_square_subsequent_mask to create it")
    masks: list[Array] = []
    biases: list[Array] = []

    def add(x: Array, name: str, expected: tuple[int, ...], lift) -> None:
        x = jnp.asarray(x)
        if tuple(x.shape) != expected:
            raise UserError(f"{name} has shape {tuple(x.shape)}, expected {expected}")
        if x.dtype == jnp.bool_:
            masks.append(jnp.logical_not(lift(x)))
        elif jnp.issubdtype(x.dtype, jnp.floating):
            biases.append(lift(x).astype(jnp.float32))
        else:
            raise UserError(f"only bool and floating types of {name} are supported; got {x.dtype}")

    if attn_mask is not None:
        attn_mask = jnp.asarray(attn_mask)
        if attn_mask.ndim == 2:
            add(attn_mask, attn_name, (q_len, k_len), lambda m: m[None, None])
        elif attn_mask.ndim == 3:
            add(attn_mask, attn_name, (batch * num_heads, q_len, k_len),
                lambda m: m.reshape(batch, num_heads, q_len, k_len))
        else:
            raise UserError(f"{attn_name} must be 2-D (T, S) or 3-D (B*N, T, S); got shape "
                            f"{tuple(attn_mask.shape)}")
    if key_padding_mask is not None:
        expected = (k_len,) if unbatched else (batch, k_len)
        add(key_padding_mask, kpm_name, expected, lambda m: m.reshape(batch, 1, 1, k_len))

    if is_causal and key_padding_mask is None and not need_weights:
        return None, None, True   # torch hands the hint to SDPA and drops attn_mask
    bias = None
    for b in biases:
        bias = b if bias is None else bias + b
    return combine_masks(*masks), bias, False


def _batch_major(x: Array, batch_first: bool, name: str) -> tuple[Array, bool]:
    """(T, B, D) / (B, T, D) / unbatched (T, D) -> ((B, T, D), unbatched)."""
    x = jnp.asarray(x)
    if x.ndim == 2:
        return x[None], True
    if x.ndim != 3:
        layout = "(B, T, D)" if batch_first else "(T, B, D)"
        raise UserError(f"{name} must be {layout} (batch_first={batch_first}) or unbatched (T, D); "
                        f"got shape {x.shape}")
    return (x if batch_first else x.swapaxes(0, 1)), False


def _torch_major(y: Array, batch_first: bool, unbatched: bool) -> Array:
    """Inverse of :func:`_batch_major`."""
    if unbatched:
        return y[0]
    return y if batch_first else y.swapaxes(0, 1)


# ----------------------------------------------------------------------------- torch.nn built-ins

class TorchMultiheadAttention(MultiHeadAttention):
    """``torch.nn.MultiheadAttention``.

    ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False) -> (attn_output, attn_weights or None)``.

    query (T, B, D) [(B, T, D) if ``batch_first``; (T, D) unbatched], key (S, B, kdim),
    value (S, B, vdim) -> output like query; weights (B, T, S) averaged over heads or
    (B, N, T, S) with ``average_attn_weights=False`` (unbatched: without B). Masks in
    PyTorch's convention (:func:`torch_attention_masks`). ``embed_dim``/``kdim``/``vdim``,
    when set, are checked against the inputs. Weights need ``attention_impl="xla"``.
    """
    embed_dim: int | None = None
    kdim: int | None = None
    vdim: int | None = None
    batch_first: bool = False

    @nn.compact
    def __call__(self, query: Array, key: Array, value: Array,
                 key_padding_mask: Array | None = None, need_weights: bool = True,
                 attn_mask: Array | None = None, average_attn_weights: bool = True,
                 is_causal: bool = False, *, deterministic: bool = True):
        q, unbatched = _batch_major(query, self.batch_first, "query")
        k, k_unbatched = _batch_major(key, self.batch_first, "key")
        v, v_unbatched = _batch_major(value, self.batch_first, "value")
        if not unbatched == k_unbatched == v_unbatched:
            raise UserError(f"query {query.shape}, key {key.shape} and value {value.shape} must all "
                            "be batched (3-D) or all unbatched (2-D)")
        for name, x, want in (("query", q, self.embed_dim), ("key", k, self.kdim or self.embed_dim),
                              ("value", v, self.vdim or self.embed_dim)):
            if want is not None and x.shape[-1] != want:
                raise UserError(f"{name} has {x.shape[-1]} features, expected {want}")
        b, t, _ = q.shape
        s = k.shape[1]
        if k.shape[:2] != v.shape[:2] or k.shape[0] != b:
            raise UserError(f"query {query.shape}, key {key.shape} and value {value.shape} disagree "
                            "on the batch size or the key/value length")
        mask, bias, causal = torch_attention_masks(
            attn_mask, key_padding_mask, batch=b, num_heads=self.num_heads, q_len=t, k_len=s,
            unbatched=unbatched, is_causal=is_causal, need_weights=need_weights)
        result = super().__call__(q, k, inputs_v=v, mask=mask, bias=bias, causal=causal,
                                  deterministic=deterministic, return_weights=need_weights)
        if not need_weights:
            return _torch_major(result, self.batch_first, unbatched), None
        out, weights = result                                          # weights (B, N, T, S)
        if average_attn_weights:
            weights = weights.mean(axis=1)
        if unbatched:
            weights = weights[0]
        return _torch_major(out, self.batch_first, unbatched), weights


class TorchTransformerEncoderLayer(EncoderBlock):
    """``torch.nn.TransformerEncoderLayer``: ``forward(src, src_mask=None,
    src_key_padding_mask=None, is_causal=False)``, src (T, B, D) [(B, T, D) if
    ``batch_first``] -> same.

    Field mapping from torch: nhead -> num_heads, dim_feedforward -> mlp_dim, norm_first
    -> pre_norm, layer_norm_eps -> norm_eps, bias -> use_bias and norm_bias; torch's single
    ``dropout`` -> dropout_rate (residual), attention_dropout_rate and mlp_dropout_rate.
    """
    batch_first: bool = False

    @nn.compact
    def __call__(self, src: Array, src_mask: Array | None = None,
                 src_key_padding_mask: Array | None = None, is_causal: bool = False, *,
                 deterministic: bool = True) -> Array:
        x, unbatched = _batch_major(src, self.batch_first, "src")
        mask, bias, causal = torch_attention_masks(
            src_mask, src_key_padding_mask, batch=x.shape[0], num_heads=self.num_heads,
            q_len=x.shape[1], k_len=x.shape[1], unbatched=unbatched, is_causal=is_causal,
            names=("src_mask", "src_key_padding_mask"))
        y = self.forward(x, mask, bias=bias, causal=causal, deterministic=deterministic)
        return _torch_major(y, self.batch_first, unbatched)


class TorchTransformerDecoderLayer(DecoderBlock):
    """``torch.nn.TransformerDecoderLayer``: ``forward(tgt, memory, tgt_mask=None,
    memory_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None,
    tgt_is_causal=False, memory_is_causal=False)``.

    tgt (T, B, D), memory (S, B, D) [batch-first if ``batch_first``] -> (T, B, D).
    Submodules self_attn, cross_attn (torch's ``multihead_attn``), mlp, norm1..3.
    Fields as :class:`TorchTransformerEncoderLayer`.
    """
    batch_first: bool = False

    @nn.compact
    def __call__(self, tgt: Array, memory: Array, tgt_mask: Array | None = None,
                 memory_mask: Array | None = None, tgt_key_padding_mask: Array | None = None,
                 memory_key_padding_mask: Array | None = None, tgt_is_causal: bool = False,
                 memory_is_causal: bool = False, *, deterministic: bool = True) -> Array:
        if not self.cross_attention:
            raise UserError("TorchTransformerDecoderLayer needs cross_attention=True")
        x, unbatched = _batch_major(tgt, self.batch_first, "tgt")
        mem, mem_unbatched = _batch_major(memory, self.batch_first, "memory")
        if unbatched != mem_unbatched or mem.shape[0] != x.shape[0]:
            raise UserError(f"tgt {tgt.shape} and memory {memory.shape} disagree on the batch "
                            f"(batch_first={self.batch_first})")
        b, t, s = x.shape[0], x.shape[1], mem.shape[1]
        self_mask, self_bias, self_causal = torch_attention_masks(
            tgt_mask, tgt_key_padding_mask, batch=b, num_heads=self.num_heads, q_len=t, k_len=t,
            unbatched=unbatched, is_causal=tgt_is_causal,
            names=("tgt_mask", "tgt_key_padding_mask"))
        cross_mask, cross_bias, cross_causal = torch_attention_masks(
            memory_mask, memory_key_padding_mask, batch=b, num_heads=self.num_heads, q_len=t,
            k_len=s, unbatched=unbatched, is_causal=memory_is_causal,
            names=("memory_mask", "memory_key_padding_mask"))
        if cross_causal:  # SDPA's is_causal for T != S: query i sees keys j <= i (top-left)
            cross_mask = causal_mask(t, s)
        y = self.forward(x, mem, self_mask=self_mask, cross_mask=cross_mask, self_bias=self_bias,
                         cross_bias=cross_bias, causal=self_causal, deterministic=deterministic)
        return _torch_major(y, self.batch_first, unbatched)


class _TorchStack(nn.Module):
    """Layer configuration shared by the stacks (all layers of a torch stack are clones)."""
    num_heads: int
    mlp_dim: int = 2048
    activation: str = "relu"
    pre_norm: bool = False
    norm_eps: float = 1e-5
    use_bias: bool = True
    norm_bias: bool = True
    dropout_rate: float = 0.0
    attention_dropout_rate: float = 0.0
    mlp_dropout_rate: float = 0.0
    batch_first: bool = False
    attention_impl: str = "xla"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    precision: Any = None

    def _layer_kwargs(self) -> dict[str, Any]:
        return dict(num_heads=self.num_heads, mlp_dim=self.mlp_dim, activation=self.activation,
                    pre_norm=self.pre_norm, norm_eps=self.norm_eps, use_bias=self.use_bias,
                    norm_bias=self.norm_bias, dropout_rate=self.dropout_rate,
                    attention_dropout_rate=self.attention_dropout_rate,
                    mlp_dropout_rate=self.mlp_dropout_rate, batch_first=self.batch_first,
                    attention_impl=self.attention_impl, dtype=self.dtype,
                    param_dtype=self.param_dtype, precision=self.precision)


class TorchTransformerEncoder(_TorchStack):
    """``torch.nn.TransformerEncoder``: ``num_layers`` encoder layers (``layers_{i}``) and an
    optional final LayerNorm (``norm``). ``forward(src, mask=None, src_key_padding_mask=None,
    is_causal=None)``; shapes as :class:`TorchTransformerEncoderLayer`."""
    num_layers: int = 1
    final_norm: bool = False
    final_norm_eps: float = 1e-5
    final_norm_bias: bool = True

    @nn.compact
    def __call__(self, src: Array, mask: Array | None = None,
                 src_key_padding_mask: Array | None = None, is_causal: bool | None = None, *,
                 deterministic: bool = True) -> Array:
        out = src
        for i in range(self.num_layers):
            out = TorchTransformerEncoderLayer(**self._layer_kwargs(), name=f"layers_{i}")(
                out, mask, src_key_padding_mask, bool(is_causal), deterministic=deterministic)
        if self.final_norm:
            out = LayerNorm(self.final_norm_eps, use_bias=self.final_norm_bias, dtype=self.dtype,
                            param_dtype=self.param_dtype, name="norm")(out)
        return out


class TorchTransformerDecoder(_TorchStack):
    """``torch.nn.TransformerDecoder``: ``num_layers`` decoder layers (``layers_{i}``) and an
    optional final LayerNorm (``norm``). ``forward(tgt, memory, tgt_mask=None,
    memory_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None,
    tgt_is_causal=None, memory_is_causal=False)``; shapes as
    :class:`TorchTransformerDecoderLayer`."""
    num_layers: int = 1
    final_norm: bool = False
    final_norm_eps: float = 1e-5
    final_norm_bias: bool = True

    @nn.compact
    def __call__(self, tgt: Array, memory: Array, tgt_mask: Array | None = None,
                 memory_mask: Array | None = None, tgt_key_padding_mask: Array | None = None,
                 memory_key_padding_mask: Array | None = None, tgt_is_causal: bool | None = None,
                 memory_is_causal: bool = False, *, deterministic: bool = True) -> Array:
        out = tgt
        for i in range(self.num_layers):
            out = TorchTransformerDecoderLayer(**self._layer_kwargs(), name=f"layers_{i}")(
                out, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
                memory_key_padding_mask, bool(tgt_is_causal), memory_is_causal,
                deterministic=deterministic)
        if self.final_norm:
            out = LayerNorm(self.final_norm_eps, use_bias=self.final_norm_bias, dtype=self.dtype,
                            param_dtype=self.param_dtype, name="norm")(out)
        return out


class TorchTransformer(_TorchStack):
    """``torch.nn.Transformer``: ``encoder`` and ``decoder`` stacks, each with a final LayerNorm.

    ``forward(src, tgt, src_mask=None, tgt_mask=None, memory_mask=None,
    src_key_padding_mask=None, tgt_key_padding_mask=None, memory_key_padding_mask=None,
    src_is_causal=None, tgt_is_causal=None, memory_is_causal=False)``:
    src (S, B, D), tgt (T, B, D) [batch-first if ``batch_first``] -> (T, B, D).
    """
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6

    @nn.compact
    def __call__(self, src: Array, tgt: Array, src_mask: Array | None = None,
                 tgt_mask: Array | None = None, memory_mask: Array | None = None,
                 src_key_padding_mask: Array | None = None,
                 tgt_key_padding_mask: Array | None = None,
                 memory_key_padding_mask: Array | None = None, src_is_causal: bool | None = None,
                 tgt_is_causal: bool | None = None, memory_is_causal: bool = False, *,
                 deterministic: bool = True) -> Array:
        src, tgt = jnp.asarray(src), jnp.asarray(tgt)
        batch_axis = 0 if self.batch_first else 1
        if src.ndim == 3 and tgt.ndim == 3 and src.shape[batch_axis] != tgt.shape[batch_axis]:
            raise UserError(f"the batch number of src {src.shape} and tgt {tgt.shape} must be equal "
                            f"(batch_first={self.batch_first})")
        if src.shape[-1] != tgt.shape[-1]:
            raise UserError(f"the feature number of src {src.shape} and tgt {tgt.shape} must be equal")
        stack = dict(self._layer_kwargs(), final_norm=True, final_norm_eps=self.norm_eps,
                     final_norm_bias=self.norm_bias)
        memory = TorchTransformerEncoder(**stack, num_layers=self.num_encoder_layers,
                                         name="encoder")(
            src, src_mask, src_key_padding_mask, src_is_causal, deterministic=deterministic)
        return TorchTransformerDecoder(**stack, num_layers=self.num_decoder_layers, name="decoder")(
            tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask,
            tgt_is_causal, memory_is_causal, deterministic=deterministic)
