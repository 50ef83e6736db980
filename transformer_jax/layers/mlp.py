"""Position-wise feed-forward network: ``wo(dropout(act(wi(x))))``, or gated ``act(wi_0 x) * wi_1 x``.

Shapes: x (B, T, D) -> (B, T, F) -> (B, T, D). Parameters: ``wi`` (D, F) [or ``wi_0``, ``wi_1``
for gated variants, as in T5 v1.1 / LLaMA] and ``wo`` (F, D), logical axes ('embed', 'mlp').
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from .dense import Dense, Initializer, default_kernel_init

Array = jax.Array

ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),      # exact erf GELU (torch nn.GELU())
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GPT-2's gelu_new
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),    # OpenAI CLIP's (HF "quick_gelu")
    "silu": jax.nn.silu,
    "tanh": jnp.tanh,
}


def get_activation(name: str) -> Callable[[Array], Array]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UserError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}") from None


class FeedForward(nn.Module):
    """Feed-forward sublayer. ``gated=True`` gives GEGLU/SwiGLU/ReGLU depending on ``activation``."""
    mlp_dim: int
    activation: str = "gelu"
    gated: bool = False
    use_bias: bool = True
    dropout_rate: float = 0.0  # on the hidden activation, as in the tutorial's feed-forward
    out_features: int | None = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    out_kernel_init: Initializer | None = None
    precision: Any = None
    cpu_tuning: bool = True

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        act = get_activation(self.activation)
        dense = lambda feats, axes, name, init=self.kernel_init: Dense(  # noqa: E731
            feats, use_bias=self.use_bias, kernel_axes=axes, dtype=self.dtype,
            param_dtype=self.param_dtype, kernel_init=init, precision=self.precision,
            cpu_tuning=self.cpu_tuning, name=name)
        if self.gated:
            h = act(dense(self.mlp_dim, ("embed", "mlp"), "wi_0")(x)) * dense(self.mlp_dim, ("embed", "mlp"), "wi_1")(x)
        else:
            h = act(dense(self.mlp_dim, ("embed", "mlp"), "wi")(x))
        h = nn.with_logical_constraint(h, ("act_batch", "act_length", "act_mlp"))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=deterministic)
        out = self.out_features or x.shape[-1]
        return dense(out, ("mlp", "embed"), "wo", self.out_kernel_init or self.kernel_init)(h)
