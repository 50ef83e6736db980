"""NF4 matmuls that dequantize in VMEM: a Pallas TPU kernel for QLoRA's frozen base.

A Dense whose kernel is stored as NF4 (``layers/quant.py``) dequantizes it before its matmul.
Left to XLA:TPU, the dequantized kernel is a separate fusion written to HBM at full size
and read back by the matmul: the TPU compiler fuses elementwise producers (the nibble
shifts, a select chain for the 16 codes, converts) into a matmul's operand, but not the
absmax of each block of B values repeated along the output axis (a broadcast and a reshape
that splits that axis; docs/tpu.md, issue 55, has what was tried). Here the dequantization
happens tile by tile in VMEM, inside the kernel that multiplies; HBM holds only the packed
codes, the block absmax values and the activations.

Shape legend (the Dense's 2-D view, ``layers/dense.py``)::

  M    rows of the input (batch x length, flattened); K the input features (``in``
       flattened); N the output features; N2 = N / 2 packed bytes a row; B the NF4 block
       (``quantize_block``), whose absmax values are A = N / B a row (blocks never cross
       rows when N is a multiple of B)
  x       (M, K)    the input, in the compute dtype
  packed  (K, N2)   uint8: W[k, 2j] in the high nibble of byte j, W[k, 2j + 1] in the low
  absmax  (A, K)    float32, transposed: absmax[a, k] scales W[k, a B .. a B + B - 1]

  hi[k, j] = NF4[packed[k, j] >> 4] * absmax[2j / B, k]     = W[k, 2j]
  lo[k, j] = NF4[packed[k, j] & 15] * absmax[2j / B, k]     = W[k, 2j + 1]

computed in fp32 and rounded once to the compute dtype, as :func:`quant.dequantize_kernel`
does: every value of a tile is that function's kernel bit for bit (tests/layers/
test_quant_matmul.py). The matmuls accumulate in fp32 in their own order, so a product may
differ from XLA's ``x @ W`` in the last bits of fp32 (the tests bound it).

  forward   grid (M / tm, N2 / tn, K / tk): x of ``tm`` rows stays in VMEM across the grid
            (one copy: read from HBM once per row block), a (tk, tn) tile of packed codes
            and its (tn / (B / 2), tk) absmax are dequantized into ``hi`` and ``lo``, and
            ``x @ hi``, ``x @ lo`` accumulate in fp32; out (M, N2) twice, interleaved into
            y (M, N) by XLA (the even and odd columns: an activation-sized copy).
  backward  dx = dy[:, 0::2] @ hi^T + dy[:, 1::2] @ lo^T, grid (M / tm, K / tk, N2 / tn),
            the two halves of dy of ``tm`` rows in VMEM. The frozen base has no gradient
            (``jax.custom_vjp``; the codes' cotangent is float0, the absmax's zero).

Each array is read from HBM once per block of ``tm`` rows (the packed codes M / tm
times; ``tm`` is all rows up to a VMEM budget). :func:`matmul` takes the kernel on a TPU
v4 or later (the generation being compiled for: Mosaic compiles no such kernel for v2/v3),
for the shapes it tiles (K and N2 multiples of 128, B / 2 a multiple of 8), under no mesh
or one that splits only the rows (the kernel then runs per device, ``shard_map``; the
codes are gathered as FSDP gathers any weight); anywhere else it returns None and the
Dense dequantizes with XLA (on a CPU, the reference: what the tests compare against).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from . import quant
from .attention_dispatch import PALLAS_MIN_TPU_GENERATION, tpu_generation
from .flash_blocks import tpu_vmem_limit

Array = jax.Array

#: the largest tiles of packed codes (tk rows, tn bytes); smaller ones where they divide
TILE_ROWS = (512, 256, 128)
TILE_BYTES = (512, 256, 128)
#: VMEM for the rows held across the grid (x, or both halves of dy), one buffer: where the
#: chip has 64 MiB or more for the kernels (v5e, v5p, v6e), and elsewhere (v4: 16 MiB)
RESIDENT_BYTES = {True: 16 << 20, False: 4 << 20}
#: the kernels' names in the compiled program (hlo.costs counts their FLOPs by them)
NAMES = ("nf4_matmul", "nf4_matmul_dx")


@dataclasses.dataclass(frozen=True)
class Plan:
    """The tiling of one call (hashable: a static argument). ``rows``: M padded to a
    multiple of 8; ``tm``/``tm_dx`` rows per block of the forward and backward kernels."""
    rows: int
    k: int
    n2: int
    half_block: int          # B / 2: packed bytes per absmax value
    tm: int
    tm_dx: int
    tk: int
    tn: int
    interpret: bool = False
    vmem_limit: int | None = None

    @property
    def absmax_rows(self) -> int:     # absmax values per tile of packed codes
        return self.tn // self.half_block


# ----------------------------------------------------------------------------- the tile

def nf4_values(codes: Array) -> Array:
    """:data:`quant.NF4` at ``codes`` (int32 < 16): a select on each of the 4 bits (a tree of
    15 selects, no gather), fp32, the table's values exactly."""
    values = [jnp.float32(v) for v in quant.NF4]
    for bit in range(4):
        on = ((codes >> bit) & 1) == 1
        values = [jnp.where(on, values[2 * i + 1], values[2 * i])
                  for i in range(len(values) // 2)]
    return values[0]


def dequantize_tile(packed: Array, absmax_t: Array, dtype) -> tuple[Array, Array]:
    """``(hi, lo)``: the even and odd kernel columns (tk, tn) of a (tk, tn) tile of packed
    codes and its (tn / (B / 2), tk) absmax (see the module docstring), fp32 products
    rounded once to ``dtype``. The absmax is repeated along sublanes and transposed (a
    repeat along lanes is no layout Mosaic has)."""
    tk, tn = packed.shape
    runs = absmax_t.shape[0]
    scale = jnp.broadcast_to(absmax_t[:, None, :], (runs, tn // runs, tk)).reshape(tn, tk).T
    codes = packed.astype(jnp.int32)
    hi = (nf4_values(codes >> 4) * scale).astype(dtype)
    lo = (nf4_values(codes & 15) * scale).astype(dtype)
    return hi, lo


def _dot(a: Array, b: Array, contract: tuple[tuple[int], tuple[int]]) -> Array:
    """A 2-D matmul accumulated in fp32. bf16 operands at the default precision (their
    products are exact in fp32; Mosaic takes no other precision for them), fp32 ones at
    the configured precision (``jax_default_matmul_precision``)."""
    precision = jax.lax.Precision.DEFAULT if a.dtype == jnp.bfloat16 else None
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _forward_kernel(x_ref, packed_ref, absmax_ref, hi_ref, lo_ref, acc_hi, acc_lo, *, tk):
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _():
        acc_hi[...] = jnp.zeros_like(acc_hi)
        acc_lo[...] = jnp.zeros_like(acc_lo)

    x = x_ref[:, pl.ds(pl.multiple_of(k * tk, tk), tk)]
    hi, lo = dequantize_tile(packed_ref[...], absmax_ref[...], x.dtype)
    acc_hi[...] += _dot(x, hi, ((1,), (0,)))
    acc_lo[...] += _dot(x, lo, ((1,), (0,)))

    @pl.when(k == pl.num_programs(2) - 1)
    def _():
        hi_ref[...] = acc_hi[...].astype(hi_ref.dtype)
        lo_ref[...] = acc_lo[...].astype(lo_ref.dtype)


def _dx_kernel(dy_hi_ref, dy_lo_ref, packed_ref, absmax_ref, dx_ref, acc, *, tn):
    j = pl.program_id(2)

    @pl.when(j == 0)
    def _():
        acc[...] = jnp.zeros_like(acc)

    cols = pl.ds(pl.multiple_of(j * tn, tn), tn)
    dy_hi, dy_lo = dy_hi_ref[:, cols], dy_lo_ref[:, cols]
    hi, lo = dequantize_tile(packed_ref[...], absmax_ref[...], dy_hi.dtype)
    acc[...] += _dot(dy_hi, hi, ((1,), (1,))) + _dot(dy_lo, lo, ((1,), (1,)))  # dy . W^T

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        dx_ref[...] = acc[...].astype(dx_ref.dtype)


# ----------------------------------------------------------------------------- the calls

def _compiler_params(plan: Plan, semantics: tuple[str, ...]):
    if plan.interpret:
        return None
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.CompilerParams(dimension_semantics=semantics,
                                vmem_limit_bytes=plan.vmem_limit)


def _resident(rows: int, cols: int, interpret: bool):
    """A block of ``rows`` whole rows that stays in VMEM across the grid (one buffer)."""
    index = lambda i, a, b: (i, 0)  # noqa: E731
    if interpret:
        return pl.BlockSpec((rows, cols), index)
    return pl.BlockSpec((rows, cols), index, pipeline_mode=pl.Buffered(1))


def _scratch(shape):
    from jax.experimental.pallas import tpu as pltpu
    return pltpu.VMEM(shape, jnp.float32)


def _forward(x: Array, packed: Array, absmax_t: Array, plan: Plan) -> tuple[Array, Array]:
    """``(x @ hi, x @ lo)``, (rows, N2) each."""
    tm, tk, tn = plan.tm, plan.tk, plan.tn
    half = jax.ShapeDtypeStruct((plan.rows, plan.n2), x.dtype)
    return pl.pallas_call(
        functools.partial(_forward_kernel, tk=tk), out_shape=[half, half],
        grid=(plan.rows // tm, plan.n2 // tn, plan.k // tk),
        in_specs=[_resident(tm, plan.k, plan.interpret),
                  pl.BlockSpec((tk, tn), lambda i, j, k: (k, j)),
                  pl.BlockSpec((plan.absmax_rows, tk), lambda i, j, k: (j, k))],
        out_specs=[pl.BlockSpec((tm, tn), lambda i, j, k: (i, j))] * 2,
        scratch_shapes=[_scratch((tm, tn)), _scratch((tm, tn))],
        compiler_params=_compiler_params(plan, ("parallel", "parallel", "arbitrary")),
        interpret=plan.interpret, name=NAMES[0])(x, packed, absmax_t)


def _backward(dy_hi: Array, dy_lo: Array, packed: Array, absmax_t: Array,
              plan: Plan) -> Array:
    """dx (rows, K) = dy_hi @ hi^T + dy_lo @ lo^T."""
    tm, tk, tn = plan.tm_dx, plan.tk, plan.tn
    return pl.pallas_call(
        functools.partial(_dx_kernel, tn=tn),
        out_shape=jax.ShapeDtypeStruct((plan.rows, plan.k), dy_hi.dtype),
        grid=(plan.rows // tm, plan.k // tk, plan.n2 // tn),
        in_specs=[_resident(tm, plan.n2, plan.interpret),
                  _resident(tm, plan.n2, plan.interpret),
                  pl.BlockSpec((tk, tn), lambda i, k, j: (k, j)),
                  pl.BlockSpec((plan.absmax_rows, tk), lambda i, k, j: (j, k))],
        out_specs=pl.BlockSpec((tm, tk), lambda i, k, j: (i, k)),
        scratch_shapes=[_scratch((tm, tk))],
        compiler_params=_compiler_params(plan, ("parallel", "parallel", "arbitrary")),
        interpret=plan.interpret, name=NAMES[1])(dy_hi, dy_lo, packed, absmax_t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def nf4_matmul(x: Array, packed: Array, absmax_t: Array, plan: Plan) -> Array:
    """``x @ W`` (M, N) for W stored as ``packed`` and ``absmax_t`` (the module docstring's
    layout), in ``x``'s dtype, with the kernels of ``plan`` (:func:`plan_for`)."""
    return _interleave(*_forward(_pad_rows(x, plan.rows), packed, absmax_t, plan), x.shape[0])


def _interleave(hi: Array, lo: Array, m: int) -> Array:
    return jnp.stack([hi, lo], axis=-1).reshape(hi.shape[0], -1)[:m]


def _pad_rows(x: Array, rows: int) -> Array:
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _nf4_matmul_fwd(x, packed, absmax_t, plan):
    return nf4_matmul(x, packed, absmax_t, plan), (packed, absmax_t)


def _nf4_matmul_bwd(plan, residuals, dy):
    packed, absmax_t = residuals
    m = dy.shape[0]
    halves = _pad_rows(dy, plan.rows).reshape(plan.rows, plan.n2, 2)
    dx = _backward(halves[..., 0], halves[..., 1], packed, absmax_t, plan)[:m]
    return dx, np.zeros(packed.shape, jax.dtypes.float0), jnp.zeros_like(absmax_t)


nf4_matmul.defvjp(_nf4_matmul_fwd, _nf4_matmul_bwd)


# ----------------------------------------------------------------------------- choosing

def _largest(options: tuple[int, ...], size: int, ok=lambda t: True) -> int | None:
    return next((t for t in options if size % t == 0 and ok(t)), None)


def _rows_per_block(rows: int, row_bytes: int, budget: int) -> int | None:
    """The most rows (a multiple of 8 dividing ``rows``) whose bytes fit ``budget``."""
    most = min(rows, budget // max(row_bytes, 1)) // 8 * 8
    return next((t for t in range(most, 7, -8) if rows % t == 0), None)


def plan_for(m: int, k: int, n: int, block: int, itemsize: int, *, interpret: bool = False,
             vmem_limit: int | None = None) -> Plan | None:
    """The tiling for x (m, k) times a (k, n) NF4 kernel in blocks of ``block``, or None
    where the kernel does not tile it: K and N / 2 multiples of 128, B / 2 a multiple of 8
    that divides a tile of N / 2, N a multiple of B. ``vmem_limit`` (bytes, or None: the
    compiler's default) sets the budget of the rows held in VMEM."""
    n2, half = n // 2, block // 2
    if k % 128 or n % block or n2 % 128 or half % 8:
        return None
    tn = _largest(TILE_BYTES, n2, lambda t: t % half == 0 and (t // half) % 8 == 0)
    if tn is None and n2 <= max(TILE_BYTES) and n2 % half == 0:
        tn = n2                                   # one tile: all the absmax rows, whole
    tk = _largest(TILE_ROWS, k)
    rows = -(-m // 8) * 8
    budget = RESIDENT_BYTES[vmem_limit is not None and vmem_limit >= 48 << 20]
    tm = _rows_per_block(rows, k * itemsize, budget)
    tm_dx = _rows_per_block(rows, 2 * n2 * itemsize, budget)
    if None in (tn, tk, tm, tm_dx):
        return None
    return Plan(rows=rows, k=k, n2=n2, half_block=half, tm=tm, tm_dx=tm_dx, tk=tk, tn=tn,
                interpret=interpret, vmem_limit=vmem_limit)


def _row_axes(rows: int):
    """The mesh axes that split the rows (those of ``act_batch`` whose sizes divide them),
    ``()`` with no mesh, or None where the kernel cannot run per device: a mesh that splits
    the weights' features too (``tensor``), or rows it cannot split evenly."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return ()
    if mesh.shape.get("tensor", 1) > 1:
        return None
    axes = nn.logical_to_mesh_axes(("act_batch",))[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
    split = math.prod(mesh.shape[a] for a in axes)
    if split * 8 > rows or rows % split or math.prod(mesh.shape.values()) != split:
        return None
    return axes


def matmul(x2: Array, stored: Mapping[str, Array], kernel_shape: tuple[int, ...],
           in_size: int) -> Array | None:
    """``x2 @ W`` (M, N) for a Dense's NF4 ``stored`` kernel (``kernel_shape``, its first
    ``in_size`` values a row of the 2-D view) by the kernels, in ``x2``'s dtype; None where
    they do not apply (module docstring): the caller dequantizes with XLA."""
    generation = tpu_generation()
    if (quant.stored_format(stored) != "nf4" or generation is None
            or generation < PALLAS_MIN_TPU_GENERATION):
        return None
    m, n = x2.shape[0], math.prod(kernel_shape) // in_size
    absmax = quant.block_absmax(stored)
    block = math.prod(kernel_shape) // absmax.size
    axes = _row_axes(m)
    split = math.prod(jax.sharding.get_abstract_mesh().shape[a] for a in axes or ())
    plan = axes is not None and plan_for(m // split, in_size, n, block, x2.dtype.itemsize,
                                         vmem_limit=tpu_vmem_limit())
    if not plan:
        return None
    packed = stored["kernel_q"].reshape(in_size, n // 2)
    absmax_t = absmax.reshape(in_size, n // block).T
    if not axes:
        return nf4_matmul(x2, packed, absmax_t, plan)
    P = jax.sharding.PartitionSpec
    return jax.shard_map(lambda x, p, a: nf4_matmul(x, p, a, plan),
                         in_specs=(P(axes, None), P(), P()), out_specs=P(axes, None),
                         check_vma=False)(x2, packed, absmax_t)
