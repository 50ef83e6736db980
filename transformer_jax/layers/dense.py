"""Parameter-owning primitives shared by every block: Dense, Embed, and the dtype policy.

Dtype policy (one rule for the whole library):
  * parameters are stored in ``param_dtype`` (fp32 by default);
  * matmuls run in the compute ``dtype`` (fp32 by default, bf16 for mixed precision);
  * softmax, normalisation statistics and the logits fed to the loss are fp32.

Dense layers flatten every leading axis into one before the matmul: ``(B, T, D) ->
(B*T, D)``, a free reshape on every backend, after which the matmul and its weight
gradient are plain 2-D products. Their weight, and the tied read-out's, passes through
``cpu_tuning.matmul_weight`` (the orientation of the weight gradient on XLA:CPU; an
identity elsewhere, or everywhere with ``cpu_tuning=False``). A Dense that the model's
LoRA config targets adds its low-rank update (``layers/lora.py``); one whose kernel is
stored quantized (``kernel_q`` and its scales, ``layers/quant.py``) dequantizes it per call:
an NF4 kernel on a TPU inside the matmul's kernel (``layers/quant_matmul.py``), elsewhere
with XLA before the matmul.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from . import lora, quant, quant_matmul
from .cpu_tuning import matmul_weight

Array = jax.Array
Dtype = Any
Initializer = Callable[..., Array]

default_kernel_init = nn.initializers.lecun_normal()


def canonical_dtype(dtype: Dtype) -> jnp.dtype:
    """Accept ``"bfloat16"``, ``jnp.bfloat16`` or ``np.dtype`` alike; raise a clear error otherwise."""
    try:
        return jnp.dtype(dtype)
    except TypeError as e:
        raise UserError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'") from e


def _flat_init(init: Initializer, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
    """Run a 2-D initializer on the flattened (in, out) shape and reshape.

    Fan-in/fan-out then count all contracted and all produced axes, as for a plain matmul.
    """
    def f(rng, shape, dtype=jnp.float32):
        flat = init(rng, (math.prod(in_shape), math.prod(out_shape)), dtype)
        return flat.reshape(shape)
    return f


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
    cpu_tuning: bool = True

    @nn.compact
    def __call__(self, x: Array, weights_only: bool = False) -> Array | dict:
        """``x @ W + b``; with ``weights_only`` the read-out weights instead: ``{"kernel":
        (in, out) in the compute dtype, "bias": (out,) or None}`` (no LoRA adapter may target
        the layer then), for a loss that does the matmul itself (``losses.head_loss``)."""
        features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
        in_shape = tuple(x.shape[-self.in_axes:])
        kernel_shape = in_shape + features
        axes = self.kernel_axes or (None,) * len(kernel_shape)
        if len(axes) != len(kernel_shape):
            raise UserError(f"{self.name}: kernel_axes {axes} do not match kernel shape {kernel_shape}")
        dtype = canonical_dtype(self.dtype)
        lead = x.shape[:-self.in_axes]
        x2 = x.reshape((-1, math.prod(in_shape))).astype(dtype)
        stored = quant.stored_kernel(self)     # a frozen base kernel stored quantized (QLoRA)
        y = None
        if stored is not None and not weights_only:   # NF4 on a TPU: dequantized in VMEM
            y = quant_matmul.matmul(x2, stored, kernel_shape, math.prod(in_shape))
        if y is None:
            if stored is not None:             # dequantized to the matmul's input dtype
                kernel = quant.dequantize_kernel(stored, kernel_shape, dtype)
            else:
                kernel = self.param(
                    "kernel", nn.with_logical_partitioning(
                        _flat_init(self.kernel_init, in_shape, features), axes),
                    kernel_shape, self.param_dtype)
            w2 = kernel.reshape((math.prod(in_shape), math.prod(features))).astype(dtype)
            if weights_only:
                return self._weights(w2, features, axes)
            y = jnp.dot(x2, matmul_weight(w2, self.cpu_tuning), precision=self.precision)
        delta = lora.adapter_delta(self, x2, in_shape, features, axes, self.in_axes, dtype,
                                   self.param_dtype, self.precision)   # LoRA, where targeted
        if delta is not None:
            y = y + delta
        if self.use_bias:
            bias = self.param(
                "bias", nn.with_logical_partitioning(self.bias_init, axes[self.in_axes:]),
                features, self.param_dtype)
            y = y + bias.reshape(-1).astype(dtype)
        return y.reshape(lead + features)

    def _weights(self, w2: Array, features: tuple[int, ...], axes: tuple) -> dict:
        current = lora.active()
        if current is not None and current[0].matches(lora.module_path(self)):
            raise UserError(f"{self.name}: loss_chunk reads the weights of this layer, which a "
                            "LoRA adapter targets; leave it out of lora.targets, or set "
                            "loss_chunk=0")
        bias = None
        if self.use_bias:
            bias = self.param(
                "bias", nn.with_logical_partitioning(self.bias_init, axes[self.in_axes:]),
                features, self.param_dtype).reshape(-1).astype(canonical_dtype(self.dtype))
        return {"kernel": w2, "bias": bias}


class Embed(nn.Module):
    """Token (or learned position) embedding table ``(V, D)`` with a tied read-out ``attend``."""
    num_embeddings: int
    features: int
    embedding_axes: tuple[str | None, str | None] = ("vocab", "embed")
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    embedding_init: Initializer = nn.initializers.normal(stddev=0.02)
    precision: Any = None
    cpu_tuning: bool = True

    def setup(self):
        self.embedding = self.param(
            "embedding", nn.with_logical_partitioning(self.embedding_init, self.embedding_axes),
            (self.num_embeddings, self.features), self.param_dtype)

    def _gathered(self) -> Array:
        """The table with its ``embed`` axis whole: under FSDP the lookup reads every
        feature of a row, so the shards are gathered first (as for any FSDP weight), and
        the batch axes stay free for the looked-up rows."""
        return nn.with_logical_constraint(self.embedding, (self.embedding_axes[0], None))

    def __call__(self, ids: Array) -> Array:
        """(B, T) int -> (B, T, D) in the compute dtype."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise UserError(f"{self.name}: expected integer ids, got dtype {ids.dtype}")
        return jnp.take(self._gathered(), ids, axis=0).astype(canonical_dtype(self.dtype))

    def rows(self, start, length: int) -> Array:
        """``length`` consecutive rows from ``start`` (L, D), in the compute dtype: a slice,
        whose gradient is a pad, where a lookup of the same positions in every batch row
        would be a gather and a scatter (which XLA cannot shard against the table's split)."""
        table = jax.lax.dynamic_slice_in_dim(self._gathered(), start, length, axis=0)
        return table.astype(canonical_dtype(self.dtype))

    def readout_kernel(self) -> Array:
        """The tied read-out's weight (D, V) in the compute dtype (the table transposed)."""
        return self.embedding.astype(canonical_dtype(self.dtype)).T

    def attend(self, x: Array) -> Array:
        """Tied read-out (B, T, D) -> (B, T, V) logits, accumulated and returned in fp32."""
        dtype = canonical_dtype(self.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape((-1, x.shape[-1])).astype(dtype)
        table = matmul_weight(self.embedding.astype(dtype).T, self.cpu_tuning)  # (D, V)
        logits = jnp.dot(x2, table, precision=self.precision, preferred_element_type=jnp.float32)
        return logits.reshape(lead + (self.num_embeddings,))
