"""Block sizes of the Pallas flash kernels (``flash_attention.py``), per backend and per
TPU generation.

``tpu_block_sizes`` picks, for a TPU generation and a call's lengths, the largest square
blocks that the TPU compiler (Mosaic, libtpu) compiles forward and backward: the forward
and dQ kernels hold (bq, S) rows of a bias (fp32, double-buffered), the dK/dV kernel whole
(T, H) rows of Q and dO and (T, bk) columns of the bias, so a bias bounds the blocks by
the VMEM of the generation (v4: 16 MiB; v5p: 64 MiB; v5e, v6e: 128 MiB). The budgets below
were measured by compiling (docs/tpu.md, "Flash kernel block sizes per generation").
"""
from __future__ import annotations

import dataclasses

from ..errors import UserError


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query/key block sizes of the forward and backward kernels (powers of two).

    ``block_q_bwd``/``block_k_bwd`` default to the forward sizes. Sequences are padded to a
    multiple of the largest query (key) block, so mixed sizes should divide each other.
    """
    block_q: int
    block_k: int
    block_q_bwd: int | None = None
    block_k_bwd: int | None = None

    def __post_init__(self):
        for name in ("block_q", "block_k", "block_q_bwd", "block_k_bwd"):
            size = getattr(self, name)
            if size is not None and (size < 8 or size & (size - 1)):
                raise UserError(f"BlockSizes.{name}={size}: block sizes must be powers of two "
                                ">= 8 (e.g. 64 or 128)")

    @property
    def bwd(self) -> tuple[int, int]:
        return self.block_q_bwd or self.block_q, self.block_k_bwd or self.block_k


# Per-backend defaults. GPU: the forward keeps a (128, H) fp32 accumulator per program; the
# backward holds two (bk, H) accumulators plus four (bq, bk) tiles, hence smaller blocks.
DEFAULT_BLOCK_SIZES = {
    "gpu": BlockSizes(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=64),
    "tpu": BlockSizes(block_q=128, block_k=128),
    "interpret": BlockSizes(block_q=128, block_k=128),
}


# Bytes of VMEM that a (bq, S) block of fp32 bias rows may take, double-buffered
# (bq * S * 4 * 2), per generation: the largest that compiled at T = S = 1,024 .. 8,192.
TPU_BIAS_ROWS_BUDGET = {"v4": 4 << 20, "v5e": 32 << 20, "v5p": 16 << 20, "v6e": 32 << 20}
# The largest block: 1,024 compiles too where VMEM allows (v5e at T = 2,048) but takes
# Mosaic ~10x longer (86 s against 7 s on a 2-core host) for (1024, 1024) fp32 tiles of
# 4 MiB each; the K/V rows are whole per head whatever the block.
TPU_MAX_BLOCK = {"v4": 512, "v5e": 512, "v5p": 512, "v6e": 512}
TPU_MIN_BLOCK = 128        # key blocks sliced along lanes: multiples of 128


def _pow2_at_most(x: int) -> int:
    return 1 << max(0, x.bit_length() - 1)


def tpu_block_sizes(generation: str | None, head_dim: int, q_len: int, kv_len: int,
                    has_bias: bool) -> BlockSizes:
    """Square blocks for the Pallas kernel on a TPU ``generation`` ("v4", "v5e", "v5p",
    "v6e"; another or None: 128 x 128, the compiler-independent default): the largest
    power of two up to ``TPU_MAX_BLOCK`` (``flash_attention`` caps it at the lengths);
    with a bias one whose (block, kv_len) fp32 rows fit ``TPU_BIAS_ROWS_BUDGET`` twice;
    at least 128. The budgets were measured at head dim 64; ``head_dim`` and ``q_len`` are
    in the signature for a finer table and unused today."""
    del head_dim, q_len
    if generation not in TPU_MAX_BLOCK:
        return DEFAULT_BLOCK_SIZES["tpu"]
    block = TPU_MAX_BLOCK[generation]       # flash_attention caps it at the lengths
    if has_bias:
        block = min(block, _pow2_at_most(max(1, TPU_BIAS_ROWS_BUDGET[generation]
                                             // (8 * max(kv_len, 1)))))
    block = max(block, TPU_MIN_BLOCK)
    return BlockSizes(block_q=block, block_k=block)


def tpu_chip() -> str | None:
    """The TPU generation being compiled for ("v4", "v5e", ...), as Mosaic knows it (the
    devices of the current mesh, or this process's TPU); None where it cannot tell."""
    try:
        from jax._src.pallas.mosaic import tpu_info
        return tpu_info.get_tpu_info().chip_version.value
    except Exception:  # noqa: BLE001 - no TPU known here, or JAX moved it
        return None


def tpu_vmem_limit() -> int | None:
    """Scoped VMEM for the kernels on the TPU being compiled for: 3/4 of the chip's VMEM
    where it has 64 MiB or more (v5e, v6e: 128 MiB; v5p: 64 MiB), the compiler's default
    elsewhere (v4: 16 MiB). The dK/dV kernel holds a head's whole-length row statistics
    (m, l, delta side by side: (T, 4) fp32, a 128-lane tile per row) and Q, dO. None where
    JAX cannot tell the TPU (lowering on a host without one) or the chip has little VMEM."""
    try:
        from jax._src.pallas.mosaic import tpu_info
        capacity = tpu_info.get_tpu_info().vmem_capacity_bytes
    except Exception:  # noqa: BLE001 - no TPU known here, or JAX moved it: the default
        return None
    return capacity * 3 // 4 if capacity >= 64 << 20 else None
