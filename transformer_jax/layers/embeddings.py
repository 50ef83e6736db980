"""Position information: sinusoidal tables, learned tables and rotary embeddings (RoPE).

All tables are pure functions of their sizes. Shapes: T positions, D model width,
H head dim, N heads, B batch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

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

ROPE_SCALINGS = ("llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A rescaling of RoPE's inverse frequencies for contexts longer than the pretraining one.

    ``kind="linear"`` (position interpolation; Gemma 3's global layers): every inverse
    frequency divided by ``factor``. ``kind="llama3"`` (Llama 3.1-3.3): with wavelengths
    ``2 pi / f`` measured against ``original_max_len``, the long-wavelength band (longer
    than ``original_max_len / low_freq_factor``) is divided by ``factor``, the
    short-wavelength band (shorter than ``original_max_len / high_freq_factor``) is kept, and
    the band between is blended linearly in ``original_max_len / wavelength``. Neither
    rescales the attention logits (HF's ``attention_factor`` is 1 for both).
    A dict of these fields (``config.json``, ``--set rope_scaling.factor=8``) converts.
    """
    kind: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0          # llama3 only
    high_freq_factor: float = 4.0         # llama3 only
    original_max_len: int = 8192          # llama3 only: HF original_max_position_embeddings

    def __post_init__(self):
        if self.kind not in ROPE_SCALINGS:
            raise UserError(f"RopeScaling.kind={self.kind!r} is unknown; choose one of "
                            f"{list(ROPE_SCALINGS)} (yarn, longrope and dynamic are not implemented)")
        for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UserError(f"RopeScaling.{name} must be a number > 0, got {value!r}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise UserError(f"RopeScaling: llama3 needs high_freq_factor > low_freq_factor, got "
                            f"{self.high_freq_factor} and {self.low_freq_factor}")

    @classmethod
    def from_value(cls, value: Any) -> "RopeScaling | None":
        """None, a RopeScaling, or its dict form."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise UserError(f"rope_scaling must be None or a dict of RopeScaling fields "
                            f"(kind, factor, low_freq_factor, high_freq_factor, "
                            f"original_max_len), got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names, key=str)
        if unknown:
            raise UserError(f"unknown RopeScaling field(s) {unknown}; valid: {sorted(names)}")
        return cls(**value)


def rope_frequencies(head_dim: int, base: float = 10000.0,
                     scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies ``base^(-2i/H)``, (H/2,) fp32, rescaled by ``scaling``.

    Computed in NumPy fp32 with transformers' operation order (its rope initialisation
    functions), so the tables agree to the last bit; they are constants of the model.
    """
    if head_dim % 2:
        raise UserError(f"RoPE needs an even head_dim, got {head_dim}")
    f32 = np.float32
    inv = f32(1.0) / (f32(base) ** (np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)))
    if scaling is None:
        return inv
    if scaling.kind == "linear":
        return inv / f32(scaling.factor)
    factor, old = f32(scaling.factor), f32(scaling.original_max_len)
    low, high = f32(scaling.low_freq_factor), f32(scaling.high_freq_factor)
    wavelen = f32(2 * math.pi) / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (f32(1) - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled).astype(f32)


def apply_rope(x: Array, positions: Array, *, base: float = 10000.0, interleaved: bool = False,
               scaling: RopeScaling | None = None) -> Array:
    """Rotate query/key vectors by their positions. x: (B, T, N, H); positions: (B, T) or (T,).

    ``interleaved=False`` rotates the pairs (i, i + H/2) (GPT-NeoX / LLaMA / HF
    ``rotate_half``); ``interleaved=True`` rotates (2i, 2i+1) (RoFormer / GPT-J).
    The rotation is computed in fp32 and cast back to x's dtype; ``scaling`` rescales the
    frequencies (:class:`RopeScaling`).
    """
    h = x.shape[-1]
    positions = jnp.asarray(positions)
    if positions.ndim == 1:
        positions = positions[None, :]
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(h, base, scaling)  # (B, T, H/2)
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
