"""Encoder and decoder blocks, pre-norm or post-norm.

  pre-norm  (GPT-2, most modern models):  x = x + Drop(Sublayer(Norm(x)))
  post-norm (the 2017 paper, BERT):       x = Norm(x + Drop(Sublayer(x)))

Submodule names follow PyTorch's ``nn.TransformerEncoderLayer``/``DecoderLayer`` so that a
converted state dict reads naturally: ``self_attn``, ``cross_attn``, ``mlp``, ``norm1``,
``norm2``, ``norm3``. x: (B, T, D); encoder output (memory): (B, S, D).

Each block sows its intermediates (``'intermediates'`` collection, when made mutable):
``+sa`` after self-attention, ``+ca`` after cross-attention, ``+mlp`` after the
feed-forward, so a parity failure can be traced to the first sublayer that differs.

In pre-norm blocks every sublayer passes its residual input through
``store_gradient_once`` (below): an identity whose gradient is stored once per sublayer,
so that XLA:CPU does not recompute the residual stream's gradient in every layer.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .attention import MultiHeadAttention
from .dense import Initializer, default_kernel_init
from .mlp import FeedForward
from .norms import make_norm

Array = jax.Array


# ----------------------------------------------------------------------------- residual stream

@jax.custom_jvp
def store_gradient_once(x: Array) -> Array:
    """Identity on ``x`` whose gradient (and tangent) is computed once and stored.

    The gradient of a residual stream is a chain of additions, one per sublayer
    (dx_l = dx_(l+1) + the sublayer's input gradient). XLA:CPU's fusion pass copies cheap
    elementwise producers into every consumer, so unless a link of that chain is stored,
    each layer's backward fusion recomputes the whole chain from the top. The work is
    quadratic in depth: a GPT (D=384, T=256, B=8) train step's largest fusion read 86
    arrays at 6 layers and 338 at 24. Passed through here, the gradient goes through a
    ``lax.cond``, which no fusion can cross, so every link is stored once (a copy of one
    (B, T, D) array). Both branches return the gradient unchanged. (An
    ``optimization_barrier`` alone does not do it: XLA:CPU removes barriers before fusion,
    and the 12-layer step below stayed at 2,275 ms. The conditional outlives that removal;
    the barrier on its predicate only stops XLA from folding it earlier.)

    Measured here (2026-11-29/30, train steps fwd + bwd + AdamW, one process, alternating,
    bitwise the same loss and gradient norm): GPT D=384, T=256, B=8 at 6 layers within
    noise (1,145 vs 1,143 ms), at 12 layers 2,331 -> 2,120 ms (2026-11-30: 2,283 -> 1,997),
    at 24 layers 6,879 -> 4,746 ms; ViT 12L/192 304 -> 263 ms. XLA compiles the GPT
    24L/1024 step in ~9 s instead of ~23 s. Post-norm blocks don't need it (a norm's
    backward, with its reductions, sits in every link of their chain) and don't use it.

    It is the same program on every backend: the model code has no platform branch.
    Elsewhere the cost is one stored (B, T, D) array per sublayer in the backward pass,
    which GPU and TPU fusion would mostly store anyway, and one conditional per sublayer,
    for which XLA:GPU may wait on the host for the predicate. ``benchmarks/gpu_check.py``
    times the GPT-2 step with and without it when a GPU is lent.
    """
    return x


def _through_conditional(t: Array) -> Array:
    # The predicate is an opaque True, not something computed from the activations: XLA
    # does not fold it (tests/test_layers.py checks), vmap never batches it (a batched
    # predicate turns the conditional into a select, which fuses), and it needs no element
    # of a sharded array. ``u * 1.0`` is exact; written so because JAX drops a conditional
    # whose branches all just return their operand.
    return jax.lax.cond(jax.lax.optimization_barrier(jnp.bool_(True)),
                        lambda u: u, lambda u: u * 1.0, t)


@store_gradient_once.defjvp
def _store_gradient_once_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x, _through_conditional(t)


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
    attention_impl: str = "xla"
    rope_base: float | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    out_kernel_init: Initializer | None = None  # residual-branch output projections
    precision: Any = None

    def _attention(self, name: str, rope: bool) -> MultiHeadAttention:
        return MultiHeadAttention(
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            use_bias=self.use_bias, dropout_rate=self.attention_dropout_rate,
            implementation=self.attention_impl, rope_base=self.rope_base if rope else None,
            dtype=self.dtype, param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            out_kernel_init=self.out_kernel_init, precision=self.precision, name=name)

    def _mlp(self) -> FeedForward:
        return FeedForward(
            mlp_dim=self.mlp_dim, activation=self.activation, gated=self.gated_mlp,
            use_bias=self.use_bias, dropout_rate=self.mlp_dropout_rate, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=self.kernel_init,
            out_kernel_init=self.out_kernel_init, precision=self.precision, name="mlp")

    def _norm(self, name: str) -> nn.Module:
        return make_norm(self.norm, self.norm_eps, self.dtype, self.param_dtype, name=name,
                         use_bias=self.norm_bias)

    def _residual(self, x: Array, sublayer, norm_name: str, tag: str, deterministic: bool) -> Array:
        """Apply one sublayer with its residual connection, pre- or post-norm."""
        norm = self._norm(norm_name)
        if self.pre_norm:   # post-norm: each link of the gradient chain has a norm's reductions
            x = store_gradient_once(x)
        y = sublayer(norm(x) if self.pre_norm else x)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        x = x + y
        if not self.pre_norm:
            x = norm(x)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        self.sow("intermediates", tag, x)
        return x


class EncoderBlock(_BlockBase):
    """Bidirectional self-attention + feed-forward."""

    @nn.compact
    def __call__(self, x: Array, mask: Array | None = None, *, bias: Array | None = None,
                 positions: Array | None = None, causal: bool = False,
                 deterministic: bool = True) -> Array:
        """x (B, T, D); mask broadcastable to (B, N, T, T), 1 = may attend -> (B, T, D)."""
        return self.forward(x, mask, bias=bias, positions=positions, causal=causal,
                            deterministic=deterministic)

    def forward(self, x, mask=None, *, bias=None, positions=None, causal=False,
                deterministic=True):
        """The body of ``__call__``; subclasses with another call signature (scan adapters) reuse it."""
        attn = self._attention("self_attn", rope=True)
        x = self._residual(
            x, lambda h: attn(h, mask=mask, bias=bias, causal=causal, positions=positions,
                              deterministic=deterministic),
            "norm1", "+sa", deterministic)
        mlp = self._mlp()
        return self._residual(x, lambda h: mlp(h, deterministic=deterministic), "norm2", "+mlp",
                              deterministic)


class DecoderBlock(_BlockBase):
    """Causal self-attention (+ cross-attention over ``memory``) + feed-forward.

    ``cross_attention=False`` gives the decoder-only (GPT) block.
    """
    cross_attention: bool = True

    @nn.compact
    def __call__(self, x: Array, memory: Array | None = None, *, self_mask: Array | None = None,
                 cross_mask: Array | None = None, self_bias: Array | None = None,
                 cross_bias: Array | None = None, positions: Array | None = None,
                 causal: bool = True, deterministic: bool = True, decode: bool = False) -> Array:
        """x (B, T, D), memory (B, S, D) -> (B, T, D).

        ``self_mask`` is combined with the causal mask when ``causal``; in ``decode`` mode it
        must cover the whole cache (B|1, 1, 1|T, S_max).
        """
        return self.forward(x, memory, self_mask=self_mask, cross_mask=cross_mask,
                            self_bias=self_bias, cross_bias=cross_bias, positions=positions,
                            causal=causal, deterministic=deterministic, decode=decode)

    def forward(self, x, memory=None, *, self_mask=None, cross_mask=None, self_bias=None,
                cross_bias=None, positions=None, causal=True, deterministic=True, decode=False):
        """The body of ``__call__``; subclasses with another call signature (scan adapters) reuse it."""
        attn = self._attention("self_attn", rope=True)
        x = self._residual(
            x, lambda h: attn(h, mask=self_mask, bias=self_bias, causal=causal,
                              positions=positions, deterministic=deterministic, decode=decode),
            "norm1", "+sa", deterministic)
        mlp_norm = "norm2"
        if self.cross_attention:
            if memory is None:
                raise ValueError(f"{self.name}: this decoder block has cross-attention; pass the "
                                 "encoder output as `memory`")
            cross = self._attention("cross_attn", rope=False)
            x = self._residual(
                x, lambda h: cross(h, memory, mask=cross_mask, bias=cross_bias,
                                   deterministic=deterministic),
                "norm2", "+ca", deterministic)
            mlp_norm = "norm3"
        mlp = self._mlp()
        return self._residual(x, lambda h: mlp(h, deterministic=deterministic), mlp_norm, "+mlp",
                              deterministic)
