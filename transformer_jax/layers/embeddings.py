"""Position information: sinusoidal tables, learned tables and rotary embeddings (RoPE).

All tables are pure functions of their sizes. Shapes: T positions, D model width,
H head dim, N heads, B batch.
"""
from __future__ import annotations

import dataclasses
import decimal
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
    A dict of these fields converts (``config.json``; on the command line
    ``--set 'model.rope_scaling={"kind": "linear", "factor": 8}'``).
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


def _power_f64(base: float, numerator: int, denominator: int) -> float:
    """``base ** (numerator / denominator)`` correctly rounded to float64, the same on every host.

    Computed in :mod:`decimal` at 40 digits (software arithmetic, so no libm or SIMD ``pow``
    takes part) and rounded once to float64. NumPy's float64 and float32 ``pow`` are not
    host-independent: with AVX-512 NumPy dispatches to vectorised kernels that differ from the
    scalar ones in the last bit (float32: 2 ulp from the truth where torch is 1 ulp).
    """
    with decimal.localcontext(prec=40):
        value = decimal.Decimal(base) ** (decimal.Decimal(numerator) / decimal.Decimal(denominator))
    return float(value)


def rope_frequencies(head_dim: int, base: float = 10000.0,
                     scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies ``base^(-2i/H)``, (H/2,) fp32, rescaled by ``scaling``.

    Computed in float64 (the powers from :func:`_power_f64`, the rescaling in IEEE float64
    arithmetic, whose results every host shares) and rounded once to float32: the correctly
    rounded table, identical on every CPU. They are constants of the model.

    transformers computes the same table in torch float32 (``1 / base ** (arange / H)`` and,
    for ``llama3``, the band arithmetic in float32). For the real models' settings (Llama 2,
    Llama 3.1/3.2, Qwen 3, Gemma 3's global layers; ``tests/layers/test_embeddings.py``) its table is within 1 ulp of this one, and within
    3 ulp in ``llama3``'s blended band (wavelengths between ``original_max_len /
    high_freq_factor`` and ``original_max_len / low_freq_factor``, 6 of Llama 3.1's 64
    frequencies), where its float32 blending adds two more roundings. Torch's float32 ``pow``
    misses the correctly rounded value by 1 ulp at about a third of the frequencies. A
    frequency 1 ulp apart rotates by ``position * ulp`` more: at position 131,071 and a
    frequency near 0.8, 0.008 rad, so rotated queries differ from transformers' by up to
    0.026 (unit-normal entries) there, and by its sin/cos rounding (5e-7) where the
    frequencies agree.
    """
    if head_dim % 2:
        raise UserError(f"RoPE needs an even head_dim, got {head_dim}")
    inv = np.array([_power_f64(base, -i, head_dim) for i in range(0, head_dim, 2)], np.float64)
    if scaling is None:
        return inv.astype(np.float32)
    if scaling.kind == "linear":
        return (inv / float(scaling.factor)).astype(np.float32)
    factor, old = float(scaling.factor), float(scaling.original_max_len)
    low, high = float(scaling.low_freq_factor), float(scaling.high_freq_factor)
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled).astype(np.float32)


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
