"""Flax modules that mirror PyTorch modules: same forward signature, same mask conventions.

Each mirror is a thin subclass of a library layer (so its parameters have the library's
layout) whose ``__call__`` takes the positional inputs of the PyTorch ``forward`` and
returns what it returns::

    module, params = interop.torch.from_torch(torch_module)
    out = module.apply({"params": params}, *the_same_inputs_as_torch)

Dropout is off unless ``deterministic=False`` is passed (with a ``"dropout"`` rng).
Nothing here imports torch.

Shape legend: B batch, T query (target) length, S key (source) length, D model width,
N heads, K key/value heads, H head dim, F feed-forward width.

Two families:

* the tutorial ("seed") modules, batch-first, mask 1 = may attend:
  :class:`SeedMultiHeadAttention` ``(query, key, value, mask=None)``,
  :class:`SeedPositionalEncoding` ``(x)``, :class:`SeedFeedForward` ``(x)``,
  :class:`SeedEncoderBlock` ``(x, mask=None)`` (pre- or post-norm) and
  :class:`SeedDecoderLayer` ``(x, encoder_output, src_mask=None, tgt_mask=None)``,
  :class:`SeedGroupedQueryAttention` ``(query, key, value, mask=None)``,
  :class:`SeedScaledDotProductAttention` ``(query, key, value, mask=None)`` -> (output,
  weights), :class:`SeedInputEmbedding` ``(input_ids)``, :class:`SeedPatchEmbed` ``(x)``
  (NCHW images), and whole models: :class:`SeedTransformer` ``(src, tgt=None)``,
  :class:`SeedBERT` ``(input_ids, attention_mask, token_type_ids=None)`` and
  :class:`SeedGPT` ``(input_ids, attention_mask=None)``, which reproduce what the
  tutorial's classes compute, oddities included (their docstrings say which).
  Their masks are 2-D (T, S) or 4-D (B|1, N|1, T, S); nonzero = may attend
  (:class:`SeedScaledDotProductAttention` broadcasts any mask as PyTorch does).

* ``torch.nn`` built-ins, with PyTorch's conventions: ``batch_first`` (seq-first (T, B, D)
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
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from ..layers import MultiHeadAttention, dot_product_attention
from ..layers.blocks import DecoderBlock, EncoderBlock
from ..layers.dense import Dense, Embed
from ..layers.embeddings import SinusoidalPositionalEncoding
from ..layers.masks import causal_mask, combine_masks
from ..layers.mlp import FeedForward
from ..layers.norms import LayerNorm

Array = jax.Array

__all__ = [
    "SeedMultiHeadAttention", "SeedPositionalEncoding", "SeedFeedForward", "SeedEncoderBlock",
    "SeedDecoderLayer", "SeedGroupedQueryAttention", "SeedScaledDotProductAttention",
    "SeedInputEmbedding", "SeedPatchEmbed", "SeedTransformer", "SeedBERT", "SeedGPT",
    "TorchMultiheadAttention", "TorchTransformerEncoderLayer",
    "TorchTransformerEncoder", "TorchTransformerDecoderLayer", "TorchTransformerDecoder",
    "TorchTransformer", "seed_mask", "torch_attention_masks",
]


# ----------------------------------------------------------------------------- masks & layout

def seed_mask(mask: Array | None, name: str = "mask") -> Array | None:
    """A tutorial-style mask (nonzero = may attend) as a 4-D bool mask.

    Accepts 2-D (T, S) or 4-D (B|1, N|1, T, S) -- the shapes that broadcast against the
    (B, N, T, S) scores in PyTorch the same way as here. (A 3-D mask would broadcast as
    (N, T, S) in PyTorch but is commonly meant as (B, T, S), so it is rejected.)
    """
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.ndim == 2:
        mask = mask[None, None]
    elif mask.ndim != 4:
        raise UserError(f"{name} must be 2-D (T, S) or 4-D (B|1, N|1, T, S) with 1 = may attend; "
                        f"got shape {mask.shape}")
    return mask if mask.dtype == jnp.bool_ else mask != 0


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


# ----------------------------------------------------------------------------- seed modules

class SeedMultiHeadAttention(MultiHeadAttention):
    """Tutorial multi-head attention: ``forward(query, key, value, mask=None)``.

    query (B, T, D), key (B, S, Dk), value (B, S, Dv) -> (B, T, D). ``mask`` (see
    :func:`seed_mask`): 2-D (T, S) or 4-D (B|1, N|1, T, S), nonzero = may attend (the
    tutorial's ``scores.masked_fill(mask == 0, ...)``). Parameters as the library's
    ``MultiHeadAttention``: query/key/value kernels (Din, N, H), out kernel (N, H, D).
    """

    @nn.compact
    def __call__(self, query: Array, key: Array, value: Array, mask: Array | None = None, *,
                 deterministic: bool = True) -> Array:
        return super().__call__(query, key, inputs_v=value, mask=seed_mask(mask),
                                deterministic=deterministic)


class SeedPositionalEncoding(SinusoidalPositionalEncoding):
    """Tutorial positional encoding: ``forward(x) = dropout(x + pe[:, :T])``, x (B, T, D).

    The table is recomputed by ``sinusoidal_table`` (no parameters); ``max_len`` is the
    length of the tutorial's ``pe`` buffer.
    """


class SeedFeedForward(FeedForward):
    """Tutorial feed-forward ``Linear -> activation -> Dropout -> Linear [-> Dropout]``.

    x (B, T, D) -> (B, T, D). ``dropout_rate`` is on the hidden (B, T, F) activation,
    ``output_dropout_rate`` after the second Linear (some tutorials put it there).
    """
    output_dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        y = super().__call__(x, deterministic=deterministic)
        return nn.Dropout(self.output_dropout_rate)(y, deterministic=deterministic)


class SeedEncoderBlock(EncoderBlock):
    """Tutorial encoder block ``forward(x, mask=None)``, x (B, T, D) -> (B, T, D).

    ``pre_norm=True``:  x = x + attn(norm1 x); x = x + ff(norm2 x).
    ``pre_norm=False``: x = norm1(x + attn(x)); x = norm2(x + ff(x)).
    ``mask`` as for :class:`SeedMultiHeadAttention` (T = S).
    """

    @nn.compact
    def __call__(self, x: Array, mask: Array | None = None, *, deterministic: bool = True) -> Array:
        return self.forward(x, seed_mask(mask), deterministic=deterministic)


class SeedDecoderLayer(DecoderBlock):
    """Tutorial post-norm decoder layer ``forward(x, encoder_output, src_mask=None, tgt_mask=None)``.

    x (B, T, D), encoder_output (B, S, D) -> (B, T, D)::

        x = norm1(x + self_attn(x, x, x, tgt_mask))
        x = norm2(x + cross_attn(x, enc, enc, src_mask))
        x = norm3(x + ff(x))

    No causal mask of its own: causality comes from ``tgt_mask`` (e.g. (T, T) lower
    triangular). Masks as for :class:`SeedMultiHeadAttention`.
    """
    pre_norm: bool = False

    @nn.compact
    def __call__(self, x: Array, encoder_output: Array, src_mask: Array | None = None,
                 tgt_mask: Array | None = None, *, deterministic: bool = True) -> Array:
        if not self.cross_attention:
            raise UserError("SeedDecoderLayer needs cross_attention=True")
        return self.forward(x, encoder_output, self_mask=seed_mask(tgt_mask, "tgt_mask"),
                            cross_mask=seed_mask(src_mask, "src_mask"), causal=False,
                            deterministic=deterministic)


class SeedGroupedQueryAttention(SeedMultiHeadAttention):
    """Tutorial grouped-query attention ``forward(query, key, value, mask=None)``.

    As :class:`SeedMultiHeadAttention` with ``num_kv_heads`` = K < N key/value heads: the
    PyTorch ``q_proj`` (N*H, D), ``k_proj``/``v_proj`` (K*H, D), ``o_proj`` (D, N*H) become
    query (D, N, H), key/value (D, K, H), out (N, H, D) kernels. Key/value head k serves the
    query heads k*N/K ... (k+1)*N/K - 1 (``repeat_interleave`` of the K heads, the Llama
    convention). query (B, T, D), key/value (B, S, D) -> (B, T, D); masks as
    :class:`SeedMultiHeadAttention`.
    """


class SeedScaledDotProductAttention(nn.Module):
    """Tutorial attention core without parameters: ``forward(query, key, value, mask=None)
    -> (output, attention_weights)``.

    query (..., T, H), key (..., S, H), value (..., S, Hv) with the same leading axes
    (typically (B, N)) -> output (..., T, Hv) and the weights (..., T, S) in fp32, dropout
    included (as PyTorch returns them). ``mask`` is broadcast against the (..., T, S)
    scores with PyTorch's (numpy's) rules, trailing axes aligned, so a 3-D mask lines up
    with the last three score axes exactly as in ``scores.masked_fill(mask == 0, -1e9)``;
    nonzero = may attend. A row without any allowed key averages the values, as the
    tutorial's -1e9 fill does. The arithmetic is the library's reference
    ``dot_product_attention`` (``attention_impl="xla"``), each leading index a batch row.
    """
    dropout_rate: float = 0.0
    precision: Any = None

    @nn.compact
    def __call__(self, query: Array, key: Array, value: Array, mask: Array | None = None, *,
                 deterministic: bool = True) -> tuple[Array, Array]:
        q, k, v = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
        lead = q.shape[:-2]
        if q.ndim < 2 or k.shape[:-2] != lead or v.shape[:-2] != lead or k.shape[-2] != v.shape[-2]:
            raise UserError(f"query {q.shape}, key {k.shape} and value {v.shape} must be (..., T, H), "
                            "(..., S, H) and (..., S, Hv) with the same leading axes")
        t, s, rows = q.shape[-2], k.shape[-2], math.prod(lead)
        if mask is not None:
            mask = jnp.asarray(mask)
            try:
                mask = jnp.broadcast_to(mask != 0, lead + (t, s))
            except ValueError:
                raise UserError(f"mask of shape {mask.shape} does not broadcast to the scores "
                                f"{lead + (t, s)} (PyTorch's rules: trailing axes aligned)") from None
            mask = mask.reshape(rows, 1, t, s)
        rng = self.make_rng("dropout") if not deterministic and self.dropout_rate > 0.0 else None
        out, weights = dot_product_attention(
            *(x.reshape(rows, x.shape[-2], 1, x.shape[-1]) for x in (q, k, v)), mask=mask,
            dropout_rate=self.dropout_rate, dropout_rng=rng, deterministic=deterministic,
            return_weights=True, attention_impl="xla", precision=self.precision)
        return out.reshape(lead + (t, v.shape[-1])), weights.reshape(lead + (t, s))


class SeedInputEmbedding(nn.Module):
    """Tutorial input embedding: ``forward(input_ids) = dropout(E[ids] * sqrt(D) + P[:, :T])``.

    input_ids (B, T) int -> (B, T, D). Parameters: ``token_embedding/embedding`` (V, D)
    (the library's :class:`~transformer_jax.layers.dense.Embed`) and the learned
    ``position_embedding`` (1, max_len, D), PyTorch's ``nn.Parameter`` of that shape.
    """
    vocab_size: int
    features: int
    max_len: int
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids: Array, *, deterministic: bool = True) -> Array:
        ids = jnp.asarray(input_ids)
        if ids.ndim != 2:
            raise UserError(f"input_ids must be (B, T) token ids; got shape {ids.shape}")
        if ids.shape[1] > self.max_len:
            raise UserError(f"sequence length {ids.shape[1]} exceeds the learned position table "
                            f"(position_embedding holds max_len={self.max_len} positions)")
        tokens = Embed(self.vocab_size, self.features, dtype=self.dtype,
                       param_dtype=self.param_dtype, name="token_embedding")(ids)
        table = self.param("position_embedding", nn.initializers.normal(1.0),
                           (1, self.max_len, self.features), self.param_dtype)
        x = tokens * math.sqrt(self.features) + table[:, :ids.shape[1]].astype(tokens.dtype)
        return nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)


class SeedPatchEmbed(nn.Module):
    """Tutorial patch embedding: ``proj`` = ``Conv2d(C, D, kernel_size=P, stride=P)``, then
    ``flatten(2).transpose(1, 2)``.

    x (B, C, H, W) (NCHW, as in PyTorch) -> (B, N, D), N = (H // Ph) * (W // Pw) patches in
    row-major grid order; trailing rows/columns that do not fill a patch are dropped, as
    the strided convolution drops them. The convolution is the library's ``Dense`` over
    (Ph, Pw, C) patches (kernel (Ph, Pw, C, D), PyTorch's OIHW weight as HWIO, as in
    :class:`~transformer_jax.models.vit.ViT`).
    """
    features: int
    patch_size: tuple[int, int]
    in_channels: int
    use_bias: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        x = jnp.asarray(x)
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise UserError(f"x must be NCHW images (B, {self.in_channels}, H, W); got shape {x.shape}")
        b, c, h, w = x.shape
        ph, pw = self.patch_size
        gh, gw = h // ph, w // pw
        if not gh or not gw:
            raise UserError(f"images of {h}x{w} pixels are smaller than one {ph}x{pw} patch")
        x = x[:, :, :gh * ph, :gw * pw].reshape(b, c, gh, ph, gw, pw)
        patches = x.transpose(0, 2, 4, 3, 5, 1).reshape(b, gh * gw, ph, pw, c)  # (B, N, Ph, Pw, C)
        return Dense(self.features, in_axes=3, use_bias=self.use_bias,
                     kernel_axes=(None, None, None, "embed"), dtype=self.dtype,
                     param_dtype=self.param_dtype, precision=self.precision, name="proj")(patches)


DECODER_MASKS = ("future", "causal")


class _SeedTransformerFields(nn.Module):
    """The configuration of :class:`SeedTransformer` (shared by :class:`SeedBERT` and
    :class:`SeedGPT`, which hold one as ``transformer``)."""
    vocab_size: int
    d_model: int
    num_heads: int
    mlp_dim: int
    num_layers: int = 1
    num_decoder_layers: int = 0
    encoder_only: bool = False
    decoder_mask: str = "future"         # see SeedTransformer
    max_len: int = 2048                  # learned position table (SeedInputEmbedding)
    pe_max_len: int = 5000               # sinusoidal table (SeedPositionalEncoding)
    head_dim: int | None = None
    activation: str = "gelu"
    pre_norm: bool = False
    norm_eps: float = 1e-5
    use_bias: bool = True
    norm_bias: bool = True
    classifier_bias: bool = True
    dropout_rate: float = 0.0            # residual
    attention_dropout_rate: float = 0.0
    mlp_dropout_rate: float = 0.0
    embedding_dropout_rate: float = 0.0
    pe_dropout_rate: float = 0.0
    attention_impl: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    precision: Any = None

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(_SeedTransformerFields)
                if f.name not in ("parent", "name")}

    def _block_kwargs(self) -> dict[str, Any]:
        return dict(num_heads=self.num_heads, head_dim=self.head_dim, mlp_dim=self.mlp_dim,
                    activation=self.activation, pre_norm=self.pre_norm, norm_eps=self.norm_eps,
                    use_bias=self.use_bias, norm_bias=self.norm_bias,
                    dropout_rate=self.dropout_rate,
                    attention_dropout_rate=self.attention_dropout_rate,
                    mlp_dropout_rate=self.mlp_dropout_rate, attention_impl=self.attention_impl,
                    dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision)

    def _dense(self, features: int, name: str, use_bias: bool = True) -> Dense:
        return Dense(features, use_bias=use_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                     precision=self.precision, name=name)


class SeedTransformer(_SeedTransformerFields):
    """The tutorial's whole Transformer: ``forward(src, tgt=None)`` -> logits.

    src (B, S) and tgt (B, T) token ids -> (B, T, V) (encoder-decoder) or (B, S, V)
    (``encoder_only``)::

        x = pos_encoder(embedding(src)); x = encoder_layers_i(x)        (no mask)
        encoder_only: return classifier(x)
        y = decoder_pos_encoder(decoder_embedding(tgt))
        y = decoder_layers_i(y, x, src_mask=None, tgt_mask=<decoder_mask>)
        return classifier(y)

    Embeddings are :class:`SeedInputEmbedding` (``max_len`` learned positions) followed by
    :class:`SeedPositionalEncoding` (``pe_max_len``); the layers are
    :class:`SeedEncoderBlock` and :class:`SeedDecoderLayer` (post-norm unless ``pre_norm``),
    all of one configuration; ``classifier`` is a Dense (D, V).

    ``decoder_mask`` reproduces the PyTorch module's ``generate_mask`` as its decoder layers
    read it (nonzero = may attend): ``"future"`` is the tutorial's
    ``triu(ones(T, T), diagonal=1)``, read that way target position i sees only the
    positions j > i, and the last one none (its self-attention averages the values, as
    the -1e9 fill makes PyTorch do); ``"causal"`` is a lower-triangular mask (j <= i), what
    a corrected ``generate_mask`` returns. The converter reads which one the module has;
    it does not correct the tutorial's mask, so that the outputs stay those of PyTorch.
    """

    @nn.compact
    def __call__(self, src: Array, tgt: Array | None = None, *,
                 deterministic: bool = True) -> Array:
        def embed(ids, emb_name: str, pe_name: str) -> Array:
            x = SeedInputEmbedding(self.vocab_size, self.d_model, self.max_len,
                                   self.embedding_dropout_rate, dtype=self.dtype,
                                   param_dtype=self.param_dtype, name=emb_name)(
                ids, deterministic=deterministic)
            return SeedPositionalEncoding(max_len=self.pe_max_len, dropout_rate=self.pe_dropout_rate,
                                          dtype=self.dtype, name=pe_name)(x, deterministic=deterministic)

        x = embed(src, "embedding", "pos_encoder")
        for i in range(self.num_layers):
            x = SeedEncoderBlock(**self._block_kwargs(), name=f"encoder_layers_{i}")(
                x, deterministic=deterministic)
        classifier = self._dense(self.vocab_size, "classifier", self.classifier_bias)
        if self.encoder_only:
            return classifier(x)
        if tgt is None:
            raise UserError("this Transformer has a decoder (encoder_only=False): pass tgt, the "
                            "target token ids (B, T)")
        if self.decoder_mask not in DECODER_MASKS:
            raise UserError(f"decoder_mask={self.decoder_mask!r}; choose one of {DECODER_MASKS}")
        y = embed(tgt, "decoder_embedding", "decoder_pos_encoder")
        t = y.shape[1]
        mask = (causal_mask(t) if self.decoder_mask == "causal"
                else jnp.triu(jnp.ones((t, t), jnp.bool_), k=1))
        for i in range(self.num_decoder_layers):
            y = SeedDecoderLayer(**self._block_kwargs(), name=f"decoder_layers_{i}")(
                y, x, None, mask, deterministic=deterministic)
        return classifier(y)


class SeedBERT(_SeedTransformerFields):
    """The tutorial's BERT: ``forward(input_ids, attention_mask, token_type_ids=None)`` ->
    ``{"mlm_logits": (B, T, V), "nsp_logits": (B, 2)}``.

    As written: ``out = transformer(input_ids)`` (an encoder-only :class:`SeedTransformer`,
    whose output is its classifier's (B, T, V) logits); ``pooled = tanh(pooler(out[:, 0]))``;
    ``nsp_logits = next_sentence_predictor(pooled)``; ``mlm_logits =
    masked_lm_predictor(out)``. The pooler and the MLM head are Linear layers of input
    width D applied to those V-wide logits, so the module runs only when V == D (the
    converter refuses other sizes). ``attention_mask`` and ``token_type_ids`` are accepted
    and ignored, as the tutorial's forward ignores them.
    """

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array | None = None,
                 token_type_ids: Array | None = None, *,
                 deterministic: bool = True) -> dict[str, Array]:
        out = SeedTransformer(**self._fields(), name="transformer")(input_ids,
                                                                     deterministic=deterministic)
        if out.shape[-1] != self.d_model:
            raise UserError(f"the tutorial's BERT pools its Transformer's logits ({out.shape[-1]} "
                            f"= vocab_size wide) with a Linear of input width d_model={self.d_model}; "
                            "it runs only when vocab_size == d_model")
        pooled = jnp.tanh(self._dense(self.d_model, "pooler")(out[:, 0]))
        return {"mlm_logits": self._dense(self.vocab_size, "masked_lm_predictor")(out),
                "nsp_logits": self._dense(2, "next_sentence_predictor")(pooled)}


class SeedGPT(_SeedTransformerFields):
    """The tutorial's GPT: ``forward(input_ids, attention_mask=None) = lm_head(transformer(input_ids))``.

    input_ids (B, T) -> (B, T, V). As written: ``transformer`` is an encoder-only
    :class:`SeedTransformer` (bidirectional, no causal mask) whose output is already (B,
    T, V) logits, and ``lm_head`` (a Linear of input width D, no bias) is applied to them,
    so it runs only when V == D. ``attention_mask`` is accepted and ignored, as there.
    """
    lm_head_bias: bool = False

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array | None = None, *,
                 deterministic: bool = True) -> Array:
        out = SeedTransformer(**self._fields(), name="transformer")(input_ids,
                                                                     deterministic=deterministic)
        if out.shape[-1] != self.d_model:
            raise UserError(f"the tutorial's GPT applies lm_head (input width d_model={self.d_model}) "
                            f"to its Transformer's logits ({out.shape[-1]} = vocab_size wide); it "
                            "runs only when vocab_size == d_model")
        return self._dense(self.vocab_size, "lm_head", self.lm_head_bias)(out)


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
