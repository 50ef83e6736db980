"""LayerNorm and RMSNorm: statistics in fp32, output in the compute dtype.

Parameters: ``scale`` (D,) and, for LayerNorm, ``bias`` (D,); logical axis ``norm``.
"""
from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from .dense import canonical_dtype

Array = jax.Array


def _standardise_with_rstd(x: Array, eps: float) -> tuple[Array, Array]:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(centred), axis=-1, keepdims=True) + eps)
    return centred * rstd, rstd


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def standardise(x: Array, eps: float) -> Array:
    """``(x - mean) / sqrt(var + eps)`` over the last axis (biased variance, as torch).

    Its derivative is written out: for a tangent ``dx``,
    ``rstd * (dx - mean(dx) - y * mean(dx * y))``, so forward and reverse mode both reuse
    the normalised ``y`` and ``rstd`` instead of differentiating through the mean and the
    variance, which XLA:CPU runs faster (figures in docs/performance.md).
    """
    return _standardise_with_rstd(x, eps)[0]


@standardise.defjvp
def _standardise_jvp(eps, primals, tangents):
    (x,), (dx,) = primals, tangents
    y, rstd = _standardise_with_rstd(x, eps)
    dy = rstd * (dx - jnp.mean(dx, axis=-1, keepdims=True)
                 - y * jnp.mean(dx * y, axis=-1, keepdims=True))
    return y, dy


class LayerNorm(nn.Module):
    """``y = (x - mean) / sqrt(var + eps) * scale + bias`` over the last axis (biased var, as torch)."""
    eps: float = 1e-5
    use_bias: bool = True
    use_scale: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        y = standardise(x.astype(jnp.float32), self.eps)
        if self.use_scale:
            scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                               (d,), self.param_dtype)
            y = y * scale.astype(jnp.float32)
        if self.use_bias:
            bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
                              (d,), self.param_dtype)
            y = y + bias.astype(jnp.float32)
        return y.astype(canonical_dtype(self.dtype))


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2) + eps) * (offset + scale)`` (T5 / LLaMA style: no mean
    subtraction, no bias). ``offset=1`` is Gemma's norm: ``scale`` is stored as the
    difference from 1 and initialised to 0."""
    eps: float = 1e-6
    offset: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        d = x.shape[-1]
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        init = nn.initializers.zeros if self.offset == 1.0 else nn.initializers.ones
        scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)),
                           (d,), self.param_dtype)
        return (y * (self.offset + scale.astype(jnp.float32))).astype(canonical_dtype(self.dtype))


#: The norms by name: LayerNorm, RMSNorm, and RMSNorm with Gemma's 1 + scale.
NORMS = ("layernorm", "rmsnorm", "rmsnorm_plus_one")


def make_norm(kind: str, eps: float, dtype: Any, param_dtype: Any, name: str | None = None,
              use_bias: bool = True) -> nn.Module:
    """A norm of :data:`NORMS` by name, with a clear error for anything else.

    ``use_bias`` applies to LayerNorm only (RMSNorm never has a bias).
    """
    if kind == "layernorm":
        return LayerNorm(eps=eps, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, name=name)
    if kind == "rmsnorm":
        return RMSNorm(eps=eps, dtype=dtype, param_dtype=param_dtype, name=name)
    if kind == "rmsnorm_plus_one":
        return RMSNorm(eps=eps, offset=1.0, dtype=dtype, param_dtype=param_dtype, name=name)
    raise UserError(f"unknown norm {kind!r}; expected one of {list(NORMS)}")
