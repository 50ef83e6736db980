"""Parameter-owning primitives shared by every block: Dense, Embed, and the dtype policy.

Dtype policy (one rule for the whole library):
  * parameters are stored in ``param_dtype`` (fp32 by default);
  * matmuls run in the compute ``dtype`` (fp32 by default, bf16 for mixed precision);
  * softmax, normalisation statistics and the logits fed to the loss are fp32.

Dense layers flatten every leading axis into one before the matmul: ``(B, T, D) ->
(B*T, D)``. XLA:CPU runs the weight-gradient contraction of a 2-D activation much faster
than the same contraction over a 3-D one, and the flattening is free on GPU and TPU.
Their weight, and the tied read-out's, passes through ``wide_gradient`` (below), which
fixes the orientation the weight gradient is computed in.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

default_kernel_init = nn.initializers.lecun_normal()


def canonical_dtype(dtype: Dtype) -> jnp.dtype:
    """Accept ``"bfloat16"``, ``jnp.bfloat16`` or ``np.dtype`` alike; raise a clear error otherwise."""
    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'") from e


def _flat_init(init: Initializer, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
    """Run a 2-D initializer on the flattened (in, out) shape and reshape.

    Fan-in/fan-out then count all contracted and all produced axes, as for a plain matmul.
    """
    def f(rng, shape, dtype=jnp.float32):
        flat = init(rng, (math.prod(in_shape), math.prod(out_shape)), dtype)
        return flat.reshape(shape)
    return f


def _check_matrix(w: Array) -> None:
    if w.ndim != 2:
        raise ValueError(f"wide_gradient expects a 2-D matmul operand (K, N), got shape "
                         f"{w.shape}; reshape the weight to (K, N) before passing it")


@jax.custom_jvp
def wide_gradient(w: Array) -> Array:
    """Identity on the right operand ``w`` (K, N) of ``x @ w``; fixes its gradient's layout.

    The weight gradient ``x^T g`` (contracting the B*T rows) is computed with its longer
    axis last, (min(K, N), max(K, N)), then transposed when the parameter is stored the
    other way: an FFN output kernel (F, D), or the tied read-out's (V, D) table, whose
    operand here is its transpose (D, V). Left to itself XLA folds that transpose into the
    dot and writes the tall result directly, which XLA:CPU's kernel does ~20% slower: the
    (1536, 384) and (8192, 384) weight gradients ran at 146-157 GFLOP/s, the same products
    as (384, 1536) and (384, 8192) at 177-197 GFLOP/s (2048 rows, measured here
    2026-11-30). ``optimization_barrier`` keeps the dot and the transpose apart. The same
    program runs on every backend; elsewhere the cost is at most one pass over a
    weight-sized array. Values are unchanged, and tangents (forward mode) go through the
    same identity.
    """
    _check_matrix(w)
    return w


@wide_gradient.defjvp
def _wide_gradient_jvp(primals, tangents):
    (w,), (t,) = primals, tangents
    _check_matrix(w)
    if t.shape[0] <= t.shape[1]:
        return w, jax.lax.optimization_barrier(t)
    return w, jax.lax.optimization_barrier(t.T).T


class Dense(nn.Module):
    """``y = x @ W + b`` contracting the last ``in_axes`` axes of ``x`` into ``features``.

    Kernel shape: ``x.shape[-in_axes:] + features``, e.g. (D, N, H) for a query projection
    ('BTD,DNH->BTNH') or (N, H, D) for the output projection ('BTNH,NHD->BTD').
    ``kernel_axes`` are the logical axis names used for sharding (see ``sharding.py``).
    """
    features: int | Sequence[int]
    in_axes: int = 1
    use_bias: bool = True
    kernel_axes: tuple[str | None, ...] = ()
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = nn.initializers.zeros_init()
    precision: Any = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        in_shape = tuple(x.shape[-self.in_axes:])
        kernel_shape = in_shape + features
        axes = self.kernel_axes or (None,) * len(kernel_shape)
        if len(axes) != len(kernel_shape):
            raise ValueError(f"{self.name}: kernel_axes {axes} do not match kernel shape {kernel_shape}")
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(_flat_init(self.kernel_init, in_shape, features), axes),
            kernel_shape, self.param_dtype)
        dtype = canonical_dtype(self.dtype)
        lead = x.shape[:-self.in_axes]
        x2 = x.reshape((-1, math.prod(in_shape))).astype(dtype)
        w2 = kernel.reshape((math.prod(in_shape), math.prod(features))).astype(dtype)
        y = jnp.dot(x2, wide_gradient(w2), precision=self.precision)
        if self.use_bias:
            bias = self.param(
                "bias", nn.with_logical_partitioning(self.bias_init, axes[self.in_axes:]),
                features, self.param_dtype)
            y = y + bias.reshape(-1).astype(dtype)
        return y.reshape(lead + features)


class Embed(nn.Module):
    """Token (or learned position) embedding table ``(V, D)`` with a tied read-out ``attend``."""
    num_embeddings: int
    features: int
    embedding_axes: tuple[str | None, str | None] = ("vocab", "embed")
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    embedding_init: Initializer = nn.initializers.normal(stddev=0.02)
    precision: Any = None

    def setup(self):
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(self.embedding_init, self.embedding_axes),
            (self.num_embeddings, self.features), self.param_dtype)

    def __call__(self, ids: Array) -> Array:
        """(B, T) int -> (B, T, D) in the compute dtype."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{self.name}: expected integer ids, got dtype {ids.dtype}")
        return jnp.take(self.embedding, ids, axis=0).astype(canonical_dtype(self.dtype))

    def attend(self, x: Array) -> Array:
        """Tied read-out (B, T, D) -> (B, T, V) logits, accumulated and returned in fp32."""
        dtype = canonical_dtype(self.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape((-1, x.shape[-1])).astype(dtype)
        table = wide_gradient(self.embedding.astype(dtype).T)                  # (D, V)
        logits = jnp.dot(x2, table, precision=self.precision, preferred_element_type=jnp.float32)
        return logits.reshape(lead + (self.num_embeddings,))
