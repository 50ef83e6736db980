"""Flax mirrors of the tutorial's PyTorch modules: same forward signature, same mask conventions.

Built like :mod:`transformer_jax.interop.torch_nn.modules`' mirrors (a thin subclass of
a library layer, the PyTorch ``forward``'s inputs and outputs, dropout off unless
``deterministic=False``, no torch import) and with its shape legend.

The mirrors of the tutorial's PyTorch modules, batch-first, mask 1 = may attend:
:class:`TutorialMultiHeadAttention` ``(query, key, value, mask=None)``,
:class:`TutorialPositionalEncoding` ``(x)``, :class:`TutorialFeedForward` ``(x)``,
:class:`TutorialEncoderBlock` ``(x, mask=None)`` (pre- or post-norm) and
:class:`TutorialDecoderLayer` ``(x, encoder_output, src_mask=None, tgt_mask=None)``,
:class:`TutorialGroupedQueryAttention` ``(query, key, value, mask=None)``,
:class:`TutorialScaledDotProductAttention` ``(query, key, value, mask=None)`` -> (output,
weights), :class:`TutorialInputEmbedding` ``(input_ids)``, :class:`TutorialPatchEmbed` ``(x)``
(NCHW images), and whole models: :class:`TutorialTransformer` ``(src, tgt=None)``,
:class:`TutorialBERT` ``(input_ids, attention_mask, token_type_ids=None)`` and
:class:`TutorialGPT` ``(input_ids, attention_mask=None)``, which reproduce what the
tutorial's classes compute, oddities included (their docstrings say which).
Their masks are 2-D (T, S) or 4-D (B|1, N|1, T, S); nonzero = may attend
(:class:`TutorialScaledDotProductAttention` broadcasts any mask as PyTorch does).

The mirrors of ``torch.nn``'s built-in modules are in
:mod:`transformer_jax.interop.torch_nn.modules`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ...errors import UserError
from ...layers import MultiHeadAttention, dot_product_attention
from ...layers.blocks import DecoderBlock, EncoderBlock
from ...layers.dense import Dense, Embed
from ...layers.embeddings import SinusoidalPositionalEncoding
from ...layers.masks import causal_mask
from ...layers.mlp import FeedForward

Array = jax.Array

__all__ = [
    "TutorialMultiHeadAttention", "TutorialPositionalEncoding", "TutorialFeedForward",
    "TutorialEncoderBlock", "TutorialDecoderLayer", "TutorialGroupedQueryAttention",
    "TutorialScaledDotProductAttention", "TutorialInputEmbedding", "TutorialPatchEmbed",
    "TutorialTransformer", "TutorialBERT", "TutorialGPT", "tutorial_mask",
]


# ----------------------------------------------------------------------------- masks

def tutorial_mask(mask: Array | None, name: str = "mask") -> Array | None:
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


# ----------------------------------------------------------------------------- tutorial modules

class TutorialMultiHeadAttention(MultiHeadAttention):
    """Tutorial multi-head attention: ``forward(query, key, value, mask=None)``.

    query (B, T, D), key (B, S, Dk), value (B, S, Dv) -> (B, T, D). ``mask`` (see
    :func:`tutorial_mask`): 2-D (T, S) or 4-D (B|1, N|1, T, S), nonzero = may attend (the
    tutorial's ``scores.masked_fill(mask == 0, ...)``). Parameters as the library's
    ``MultiHeadAttention``: query/key/value kernels (Din, N, H), out kernel (N, H, D).
    """

    @nn.compact
    def __call__(self, query: Array, key: Array, value: Array, mask: Array | None = None, *,
                 deterministic: bool = True) -> Array:
        return super().__call__(query, key, inputs_v=value, mask=tutorial_mask(mask),
                                deterministic=deterministic)


class TutorialPositionalEncoding(SinusoidalPositionalEncoding):
    """Tutorial positional encoding: ``forward(x) = dropout(x + pe[:, :T])``, x (B, T, D).

    The table is recomputed by ``sinusoidal_table`` (no parameters); ``max_len`` is the
    length of the tutorial's ``pe`` buffer.
    """


class TutorialFeedForward(FeedForward):
    """Tutorial feed-forward ``Linear -> activation -> Dropout -> Linear [-> Dropout]``.

    x (B, T, D) -> (B, T, D). ``dropout_rate`` is on the hidden (B, T, F) activation,
    ``output_dropout_rate`` after the second Linear (some tutorials put it there).
    """
    output_dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        y = super().__call__(x, deterministic=deterministic)
        return nn.Dropout(self.output_dropout_rate)(y, deterministic=deterministic)


class TutorialEncoderBlock(EncoderBlock):
    """Tutorial encoder block ``forward(x, mask=None)``, x (B, T, D) -> (B, T, D).

    ``pre_norm=True``:  x = x + attn(norm1 x); x = x + ff(norm2 x).
    ``pre_norm=False``: x = norm1(x + attn(x)); x = norm2(x + ff(x)).
    ``mask`` as for :class:`TutorialMultiHeadAttention` (T = S).
    """

    @nn.compact
    def __call__(self, x: Array, mask: Array | None = None, *, deterministic: bool = True) -> Array:
        return self.forward(x, tutorial_mask(mask), deterministic=deterministic)


class TutorialDecoderLayer(DecoderBlock):
    """Tutorial post-norm decoder layer ``forward(x, encoder_output, src_mask=None, tgt_mask=None)``.

    x (B, T, D), encoder_output (B, S, D) -> (B, T, D)::

        x = norm1(x + self_attn(x, x, x, tgt_mask))
        x = norm2(x + cross_attn(x, enc, enc, src_mask))
        x = norm3(x + ff(x))

    No causal mask of its own: causality comes from ``tgt_mask`` (e.g. (T, T) lower
    triangular). Masks as for :class:`TutorialMultiHeadAttention`.
    """
    pre_norm: bool = False

    @nn.compact
    def __call__(self, x: Array, encoder_output: Array, src_mask: Array | None = None,
                 tgt_mask: Array | None = None, *, deterministic: bool = True) -> Array:
        if not self.cross_attention:
            raise UserError("TutorialDecoderLayer needs cross_attention=True")
        return self.forward(x, encoder_output, self_mask=tutorial_mask(tgt_mask, "tgt_mask"),
                            cross_mask=tutorial_mask(src_mask, "src_mask"), causal=False,
                            deterministic=deterministic)


class TutorialGroupedQueryAttention(TutorialMultiHeadAttention):
    """Tutorial grouped-query attention ``forward(query, key, value, mask=None)``.

    As :class:`TutorialMultiHeadAttention` with ``num_kv_heads`` = K < N key/value heads: the
    PyTorch ``q_proj`` (N*H, D), ``k_proj``/``v_proj`` (K*H, D), ``o_proj`` (D, N*H) become
    query (D, N, H), key/value (D, K, H), out (N, H, D) kernels. Key/value head k serves the
    query heads k*N/K ... (k+1)*N/K - 1 (``repeat_interleave`` of the K heads, the Llama
    convention). query (B, T, D), key/value (B, S, D) -> (B, T, D); masks as
    :class:`TutorialMultiHeadAttention`.
    """


class TutorialScaledDotProductAttention(nn.Module):
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


class TutorialInputEmbedding(nn.Module):
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


class TutorialPatchEmbed(nn.Module):
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


class _TutorialTransformerFields(nn.Module):
    """The configuration of :class:`TutorialTransformer` (shared by :class:`TutorialBERT` and
    :class:`TutorialGPT`, which hold one as ``transformer``)."""
    vocab_size: int
    d_model: int
    num_heads: int
    mlp_dim: int
    num_layers: int = 1
    num_decoder_layers: int = 0
    encoder_only: bool = False
    decoder_mask: str = "future"         # see TutorialTransformer
    max_len: int = 2048                  # learned position table (TutorialInputEmbedding)
    pe_max_len: int = 5000               # sinusoidal table (TutorialPositionalEncoding)
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
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(_TutorialTransformerFields)
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


class TutorialTransformer(_TutorialTransformerFields):
    """The tutorial's whole Transformer: ``forward(src, tgt=None)`` -> logits.

    src (B, S) and tgt (B, T) token ids -> (B, T, V) (encoder-decoder) or (B, S, V)
    (``encoder_only``)::

        x = pos_encoder(embedding(src)); x = encoder_layers_i(x)        (no mask)
        encoder_only: return classifier(x)
        y = decoder_pos_encoder(decoder_embedding(tgt))
        y = decoder_layers_i(y, x, src_mask=None, tgt_mask=<decoder_mask>)
        return classifier(y)

    Embeddings are :class:`TutorialInputEmbedding` (``max_len`` learned positions) followed by
    :class:`TutorialPositionalEncoding` (``pe_max_len``); the layers are
    :class:`TutorialEncoderBlock` and :class:`TutorialDecoderLayer` (post-norm unless ``pre_norm``),
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
            x = TutorialInputEmbedding(self.vocab_size, self.d_model, self.max_len,
                                       self.embedding_dropout_rate, dtype=self.dtype,
                                       param_dtype=self.param_dtype, name=emb_name)(
                ids, deterministic=deterministic)
            return TutorialPositionalEncoding(max_len=self.pe_max_len, dropout_rate=self.pe_dropout_rate,
                                              dtype=self.dtype, name=pe_name)(x, deterministic=deterministic)

        x = embed(src, "embedding", "pos_encoder")
        for i in range(self.num_layers):
            x = TutorialEncoderBlock(**self._block_kwargs(), name=f"encoder_layers_{i}")(
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
            y = TutorialDecoderLayer(**self._block_kwargs(), name=f"decoder_layers_{i}")(
                y, x, None, mask, deterministic=deterministic)
        return classifier(y)


class TutorialBERT(_TutorialTransformerFields):
    """The tutorial's BERT: ``forward(input_ids, attention_mask, token_type_ids=None)`` ->
    ``{"mlm_logits": (B, T, V), "nsp_logits": (B, 2)}``.

    As written: ``out = transformer(input_ids)`` (an encoder-only :class:`TutorialTransformer`,
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
        out = TutorialTransformer(**self._fields(), name="transformer")(input_ids,
                                                                        deterministic=deterministic)
        if out.shape[-1] != self.d_model:
            raise UserError(f"the tutorial's BERT pools its Transformer's logits ({out.shape[-1]} "
                            f"= vocab_size wide) with a Linear of input width d_model={self.d_model}; "
                            "it runs only when vocab_size == d_model")
        pooled = jnp.tanh(self._dense(self.d_model, "pooler")(out[:, 0]))
        return {"mlm_logits": self._dense(self.vocab_size, "masked_lm_predictor")(out),
                "nsp_logits": self._dense(2, "next_sentence_predictor")(pooled)}


class TutorialGPT(_TutorialTransformerFields):
    """The tutorial's GPT: ``forward(input_ids, attention_mask=None) = lm_head(transformer(input_ids))``.

    input_ids (B, T) -> (B, T, V). As written: ``transformer`` is an encoder-only
    :class:`TutorialTransformer` (bidirectional, no causal mask) whose output is already (B,
    T, V) logits, and ``lm_head`` (a Linear of input width D, no bias) is applied to them,
    so it runs only when V == D. ``attention_mask`` is accepted and ignored, as there.
    """
    lm_head_bias: bool = False

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array | None = None, *,
                 deterministic: bool = True) -> Array:
        out = TutorialTransformer(**self._fields(), name="transformer")(input_ids,
                                                                        deterministic=deterministic)
        if out.shape[-1] != self.d_model:
            raise UserError(f"the tutorial's GPT applies lm_head (input width d_model={self.d_model}) "
                            f"to its Transformer's logits ({out.shape[-1]} = vocab_size wide); it "
                            "runs only when vocab_size == d_model")
        return self._dense(self.vocab_size, "lm_head", self.lm_head_bias)(out)
