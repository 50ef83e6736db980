"""Encoder and decoder blocks, pre-norm or post-norm: every family's layers are these.

  pre-norm  (GPT-2, T5, most modern models):  x = x + Drop(Sublayer(Norm(x)))
  post-norm (the 2017 paper, BERT):           x = Norm(x + Drop(Sublayer(x)))

Submodule names follow PyTorch's ``nn.TransformerEncoderLayer``/``DecoderLayer`` so that a
converted state dict reads naturally: ``self_attn``, ``cross_attn``, ``mlp``, ``norm1``,
``norm2``, ``norm3``. x: (B, T, D); encoder output (memory): (B, S, D).

The fields cover the families' differences: LayerNorm or RMSNorm (``norm``), biases or
none (``use_bias``, ``norm_bias``), the attention ``attention_scale`` (T5: 1), rotary
positions (``rope_base``, ``rope_scaling``), grouped-query heads, q/k/v biases without
other biases (``qkv_bias``), per-head query/key norms (``qk_norm``), gated MLPs, and an
initialiser for each kind of kernel. An additive logit bias (T5's relative positions) is a
call argument.
``prefix_tokens`` > 0 gives the self-attention (never the cross-attention) P learned
prefix keys and values (prefix tuning; ``MultiHeadAttention``'s docstring), and
``attention_pattern`` restricts it to a sliding window or a sparse pattern
(``attention="linear"`` makes it linear attention).

Each block sows its intermediates (``'intermediates'`` collection, when made mutable):
``+sa`` after self-attention, ``+ca`` after cross-attention, ``+mlp`` after the
feed-forward, so a parity failure can be traced to the first sublayer that differs.

Decoding (``decode=True``) keeps a KV cache in both attention sublayers: the
self-attention's grows by the new tokens, the cross-attention's holds the encoder
output's keys and values, computed once.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from .cpu_tuning import residual
from .dense import Initializer, default_kernel_init
from .embeddings import RopeScaling
from .masks import AttentionPattern
from .mlp import FeedForward
from .multi_head import MultiHeadAttention
from .norms import make_norm

Array = jax.Array


class _BlockBase(nn.Module):
    """Fields shared by the encoder and decoder blocks."""
    num_heads: int
    mlp_dim: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    activation: str = "gelu"
    gated_mlp: bool = False
    pre_norm: bool = True
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    use_bias: bool = True                # dense layers (attention projections, feed-forward)
    norm_bias: bool = True               # LayerNorm bias (PyTorch's ``bias=False`` drops it too)
    dropout_rate: float = 0.0            # residual (after each sublayer)
    attention_dropout_rate: float = 0.0  # on the attention weights
    mlp_dropout_rate: float = 0.0        # on the feed-forward hidden activation
    attention: str = "softmax"           # or "linear" (linear attention)
    attention_impl: str = "auto"         # softmax attention's implementation
    attention_scale: float | None = None  # default 1/sqrt(H)
    rope_base: float | None = None
    rope_scaling: RopeScaling | None = None   # rescaled rotary frequencies (Llama 3)
    qkv_bias: bool | None = None         # q/k/v projection biases; None: use_bias (Qwen 2)
    qk_norm: str | None = None           # per-head norm of queries and keys (Qwen 3, Gemma 3)
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    query_kernel_init: Initializer | None = None    # attention queries; default kernel_init
    out_kernel_init: Initializer | None = None      # attention outputs; default kernel_init
    mlp_out_kernel_init: Initializer | None = None  # feed-forward output; default out_kernel_init
    precision: Any = None
    cpu_tuning: bool = True
    prefix_tokens: int = 0               # prefix tuning of the self-attention (0: none)
    attention_pattern: AttentionPattern | None = None   # window / sparse self-attention

    def _attention(self, name: str, rope: bool) -> MultiHeadAttention:
        return MultiHeadAttention(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            use_bias=self.use_bias, dropout_rate=self.attention_dropout_rate,
            attention=self.attention, attention_impl=self.attention_impl,
            scale=self.attention_scale,
            rope_base=self.rope_base if rope else None,
            rope_scaling=self.rope_scaling if rope else None, qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm, qk_norm_eps=self.norm_eps, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            query_kernel_init=self.query_kernel_init, out_kernel_init=self.out_kernel_init,
            precision=self.precision, cpu_tuning=self.cpu_tuning,
            prefix_tokens=self.prefix_tokens if name == "self_attn" else 0,
            pattern=self.attention_pattern if name == "self_attn" else None, name=name)

    def _mlp(self) -> FeedForward:
        return FeedForward(
            mlp_dim=self.mlp_dim, activation=self.activation, gated=self.gated_mlp,
            use_bias=self.use_bias, dropout_rate=self.mlp_dropout_rate, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            out_kernel_init=self.mlp_out_kernel_init or self.out_kernel_init,
            precision=self.precision, cpu_tuning=self.cpu_tuning, name="mlp")

    def _norm(self, name: str) -> nn.Module:
        return make_norm(self.norm, self.norm_eps, self.dtype, self.param_dtype, name=name,
                         use_bias=self.norm_bias)

    def _residual(self, x: Array, sublayer, norm_name: str, tag: str, deterministic: bool) -> Array:
        """Apply one sublayer with its residual connection, pre- or post-norm."""
        norm = self._norm(norm_name)
        if self.pre_norm:   # the residual stream's gradient: stored once per sublayer on CPU
            x = residual(x, self.cpu_tuning)
        y = sublayer(norm(x) if self.pre_norm else x)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        x = x + y
        if not self.pre_norm:
            x = norm(x)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        self.sow("intermediates", tag, x)
        return x

    def _feed_forward(self, x: Array, norm_name: str, deterministic: bool) -> Array:
        mlp = self._mlp()
        return self._residual(x, lambda h: mlp(h, deterministic=deterministic), norm_name, "+mlp",
                              deterministic)


class EncoderBlock(_BlockBase):
    """Bidirectional self-attention + feed-forward."""

    @nn.compact
    def __call__(self, x: Array, mask: Array | None = None, *, bias: Array | None = None,
                 positions: Array | None = None, causal: bool = False,
                 deterministic: bool = True, segment_ids: Array | None = None) -> Array:
        """x (B, T, D); mask broadcastable to (B, N, T, T), 1 = may attend; bias added to
        the logits; segment_ids (B, T) of packed documents -> (B, T, D)."""
        return self.forward(x, mask, bias=bias, positions=positions, causal=causal,
                            deterministic=deterministic, segment_ids=segment_ids)

    def forward(self, x, mask=None, *, bias=None, positions=None, causal=False,
                deterministic=True, segment_ids=None):
        """The body of ``__call__`` (``layers.stack`` calls it with the operands by keyword)."""
        attn = self._attention("self_attn", rope=True)
        x = self._residual(
            x, lambda h: attn(h, mask=mask, bias=bias, causal=causal, positions=positions,
                              deterministic=deterministic, segment_ids=segment_ids),
            "norm1", "+sa", deterministic)
        return self._feed_forward(x, "norm2", deterministic)


class DecoderBlock(_BlockBase):
    """Causal self-attention (+ cross-attention over ``memory``) + feed-forward.

    ``cross_attention=False`` gives the decoder-only (GPT) block.
    """
    cross_attention: bool = True

    @nn.compact
    def __call__(self, x: Array, memory: Array | None = None, *, self_mask: Array | None = None,
                 cross_mask: Array | None = None, self_bias: Array | None = None,
                 cross_bias: Array | None = None, positions: Array | None = None,
                 causal: bool = True, deterministic: bool = True, decode: bool = False,
                 segment_ids: Array | None = None,
                 memory_segment_ids: Array | None = None) -> Array:
        """x (B, T, D), memory (B, S, D) -> (B, T, D).

        ``self_mask`` is combined with the causal mask when ``causal``; in ``decode`` mode it
        must cover the whole cache (B|1, 1, 1|T, S_max). Packed documents: ``segment_ids``
        (B, T) of the decoder tokens, ``memory_segment_ids`` (B, S) of the encoder's (a
        decoder token attends to the memory of its own document).
        """
        return self.forward(x, memory, self_mask=self_mask, cross_mask=cross_mask,
                            self_bias=self_bias, cross_bias=cross_bias, positions=positions,
                            causal=causal, deterministic=deterministic, decode=decode,
                            segment_ids=segment_ids, memory_segment_ids=memory_segment_ids)

    def forward(self, x, memory=None, *, self_mask=None, cross_mask=None, self_bias=None,
                cross_bias=None, positions=None, causal=True, deterministic=True, decode=False,
                segment_ids=None, memory_segment_ids=None):
        """The body of ``__call__`` (``layers.stack`` calls it with the operands by keyword)."""
        attn = self._attention("self_attn", rope=True)
        x = self._residual(
            x, lambda h: attn(h, mask=self_mask, bias=self_bias, causal=causal,
                              positions=positions, deterministic=deterministic, decode=decode,
                              segment_ids=segment_ids),
            "norm1", "+sa", deterministic)
        mlp_norm = "norm2"
        if self.cross_attention:
            if memory is None:
                raise UserError(f"{self.name}: this decoder block has cross-attention; pass the "
                                "encoder output as `memory`")
            if (segment_ids is None) != (memory_segment_ids is None):
                raise UserError(f"{self.name}: packed documents need segment_ids for both the "
                                "decoder tokens and the memory (memory_segment_ids), or neither")
            cross = self._attention("cross_attn", rope=False)
            x = self._residual(
                x, lambda h: cross(h, memory, mask=cross_mask, bias=cross_bias,
                                   deterministic=deterministic, decode=decode,
                                   segment_ids=None if segment_ids is None else (
                                       segment_ids, memory_segment_ids)),
                "norm2", "+ca", deterministic)
            mlp_norm = "norm3"
        return self._feed_forward(x, mlp_norm, deterministic)
