"""Position information: sinusoidal tables, learned tables and rotary embeddings (RoPE).

All tables are pure functions of their sizes. Shapes: T positions, D model width,
H head dim, N heads, B batch.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from .dense import canonical_dtype

Array = jax.Array


def sinusoidal_table(length: int, d_model: int, *, base: float = 10000.0) -> Array:
    """The 2017 Transformer's fixed table, (T, D) fp32.

    ``PE[pos, 2i] = sin(pos / base^(2i/D))`` and ``PE[pos, 2i+1] = cos(pos / base^(2i/D))``:
    sines on even columns, cosines on odd columns, interleaved. The inverse frequencies are
    computed as ``exp(2i * -ln(base)/D)`` in fp32, the same arithmetic as the PyTorch
    tutorial modules, so converted ``pe`` buffers compare equal to fp32 rounding.
    """
    if d_model % 2:
        raise UserError(f"sinusoidal positions need an even d_model, got {d_model}")
    position = jnp.arange(length, dtype=jnp.float32)[:, None]                       # (T, 1)
    inv_freq = jnp.exp(jnp.arange(0, d_model, 2, dtype=jnp.float32)
                       * jnp.float32(-math.log(base) / d_model))                     # (D/2,)
    angles = position * inv_freq                                                    # (T, D/2)
    table = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)                  # (T, D/2, 2)
    return table.reshape(length, d_model)


class SinusoidalPositionalEncoding(nn.Module):
    """``x + PE[:T]`` followed by dropout; no parameters. x: (B, T, D)."""
    max_len: int = 5000
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, *, deterministic: bool = True) -> Array:
        t, d = x.shape[-2], x.shape[-1]
        if t > self.max_len:
            raise UserError(f"sequence length {t} exceeds the positional table's max_len={self.max_len}")
        x = (x.astype(jnp.float32) + sinusoidal_table(t, d)).astype(canonical_dtype(self.dtype))
        return nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)


# ----------------------------------------------------------------------------- RoPE

def rope_frequencies(head_dim: int, base: float = 10000.0) -> Array:
    """Inverse frequencies ``base^(-2i/H)``, (H/2,) fp32."""
    if head_dim % 2:
        raise UserError(f"RoPE needs an even head_dim, got {head_dim}")
    return 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x: Array, positions: Array, *, base: float = 10000.0, interleaved: bool = False) -> Array:
    """Rotate query/key vectors by their positions. x: (B, T, N, H); positions: (B, T) or (T,).

    ``interleaved=False`` rotates the pairs (i, i + H/2) (GPT-NeoX / LLaMA / HF
    ``rotate_half``); ``interleaved=True`` rotates (2i, 2i+1) (RoFormer / GPT-J).
    The rotation is computed in fp32 and cast back to x's dtype.
    """
    h = x.shape[-1]
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = positions[None, :]
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(h, base)   # (B, T, H/2)
    sin = jnp.sin(angles)[:, :, None, :]                                             # (B, T, 1, H/2)
    cos = jnp.cos(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    if interleaved:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(x.shape)
    else:
        x1, x2 = x32[..., : h // 2], x32[..., h // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
