"""Flash attention as Pallas kernels: ``dot_product_attention(..., attention_impl="pallas")``.

The same exact attention as the ``"xla"`` reference (fp32 logits and softmax, the mask
convention 1 = may attend, an additive ``bias``, grouped-query heads, ``causal``), computed
block by block with an online softmax so that no (T, S) matrix is ever stored:

  forward   grid (B, N, T/bq): one query block of one head per program; a loop over the
            key blocks keeps the running max ``m``, the running sum ``l`` and the output
            accumulator in registers/VMEM. With ``causal`` the loop stops at the diagonal
            (fully masked key blocks are skipped, not computed). Saves out, m, l.
  backward  recomputes the probabilities from (q, k, m, l) (FlashAttention-2 style), in
            Pallas too: a dK/dV kernel over key blocks (grid (B, N, S/bk), looping over query
            blocks from the diagonal on) and a dQ kernel over query blocks. dK/dV are formed
            per query head and summed over the G heads of a group outside the kernel. When
            a bias is given its gradient dS comes from a third kernel (the dQ kernel writing
            dS blocks), a separate call so that XLA drops it when the bias needs no gradient;
            it materialises a (B, N, T, S) fp32 array, like the bias gradient of ``"xla"``.

Segment ids (packed documents) are kernel inputs, not a mask: the query ids in (bq, 2)
blocks (forward; in the backward two more columns of the row statistics), the key ids in
(2, bk) blocks, each id as two fp32 halves (``_encode_ids``), compared per tile.

Memory: out, m, l and the gradients are linear in the sequence length. A bias, and a
mask with a query axis ((..., T, S)), are inputs of quadratic size by nature; they are read
block by block (a mask is passed as int32). A key-padding mask (B, 1, 1, S) stays linear.

Backends. The kernels use only ``pl.pallas_call`` with a grid, ``pl.BlockSpec``, 2-D ref
slices (``pl.ds``), ``lax.fori_loop`` and 2-D ``dot_general``, so one source targets
  * GPU: the Triton lowering (selected with ``pallas.triton.CompilerParams``; block sizes
    and the head dim must be powers of two there, so the head dim is zero-padded to one);
  * TPU: Mosaic (2-D blocks whose last dims are full or multiples of (8, 128); K and V of
    one head are held in VMEM, S * H * itemsize * 4 bytes with double buffering; key
    blocks of at least 128 when a bias or mask is sliced along its keys; a raised scoped
    VMEM limit on chips with 64 MiB or more, for long sequences' row statistics; block
    sizes per generation, ``flash_blocks.tpu_block_sizes``);
  * CPU (and any other backend): ``interpret=True`` (chosen automatically), which runs the
    kernels as plain XLA loops; exact but slow, for tests.
The tests run the kernels in interpret mode and lower them for TPU (Mosaic) and GPU
(Triton) from the CPU host; ``benchmarks/gpu_check.py`` compiles and times them where a
GPU is available.

Not supported (a clear ``ValueError`` names the alternative): attention dropout and
returning the weights (use ``"xla"``, or ``"chunked"`` for dropout). Lengths that are not
multiples of the block sizes are zero-padded (padded keys are excluded from the softmax,
padded query rows are cut off). Forward-mode autodiff (jvp) is not defined (custom_vjp).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..errors import UserError
from .attention_base import (NEG, check_broadcast, check_qkv, fill_empty_rows, fill_rows,
                             key_block_range, pad_axis, query_block_range, visit)
from .flash_blocks import (DEFAULT_BLOCK_SIZES, BlockSizes,  # noqa: F401 - re-exported
                           tpu_block_sizes, tpu_chip, tpu_vmem_limit)
from .masks import AttentionPattern

Array = jax.Array


def default_interpret() -> bool:
    """Interpret mode unless the default backend is a GPU or a TPU."""
    return jax.default_backend() not in ("gpu", "tpu")


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels need that is known at trace time (hashable)."""
    scale: float
    causal: bool
    t: int                 # real query length (before padding)
    s: int                 # real key length
    tp: int                # padded lengths
    sp: int
    groups: int            # G = N / K
    bq: int
    bk: int
    bq_bwd: int
    bk_bwd: int
    platform: str          # "gpu", "tpu" or "interpret"
    num_warps: int
    num_stages: int
    pattern: AttentionPattern | None = None   # window / sparse: blocks outside it skipped
    segments: bool = False                    # segment ids given (kernel inputs)

    @property
    def interpret(self) -> bool:
        return self.platform == "interpret"


# ----------------------------------------------------------------------------- kernel math

def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    """2-D matmul contracting a's axis contract[0] with b's axis contract[1], fp32 result.

    bf16/fp16 operands multiply at the default precision whatever the global
    ``jax_default_matmul_precision`` says: their products are exact in fp32 anyway, and
    Mosaic refuses a "highest" bf16 matmul ("Bad lhs type"). fp32 operands follow the
    global setting."""
    low = jnp.dtype(a.dtype).itemsize < 4 and jnp.dtype(b.dtype).itemsize < 4
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=lax.Precision.DEFAULT if low else None,
                           preferred_element_type=jnp.float32)


def _scores(st: _Static, q, k, q_start, k_start, bias_blk, mask_blk, same=None):
    """Logits of one (bq, bk) tile: fp32 ``q k^T * scale + bias``, disallowed -> NEG.

    Returns (logits, allowed, key_ok); ``key_ok`` (None when no key is padding) marks real
    keys: padded keys get probability 0 even in rows whose real keys are all masked, where
    the reference averages over the real keys.
    """
    s = _dot(q, k, (1, 1)) * st.scale
    if bias_blk is not None:
        s = s + bias_blk.astype(jnp.float32)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
    key_ok = None if st.s == st.sp else k_pos < st.s
    allowed = key_ok
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
    if st.causal:
        allowed = (k_pos <= q_pos) if allowed is None else allowed & (k_pos <= q_pos)
    if st.pattern is not None:
        rule = st.pattern.allowed(q_pos, k_pos)
        allowed = rule if allowed is None else allowed & rule
    if mask_blk is not None:
        allowed = (mask_blk != 0) if allowed is None else allowed & (mask_blk != 0)
    if same is not None:
        allowed = same if allowed is None else allowed & same
    if allowed is not None:
        s = jnp.where(allowed, s, NEG)
    return s, allowed, key_ok


def _kv_blocks(st: _Static, i, bq: int, bk: int):
    """Key blocks [first, end) query block ``i`` visits: all, up to the causal diagonal,
    or inside the pattern's span."""
    return key_block_range(st.pattern, st.causal, i * bq, bq, bk, st.sp // bk)


def _q_blocks(st: _Static, j, bq: int, bk: int):
    """Query blocks [first, end) that see key block ``j``."""
    return query_block_range(st.pattern, st.causal, j * bk, bk, bq, st.tp // bq)


def _visit(st: _Static, q_start, k_start, bq: int, bk: int, body, carry):
    """``body(carry)`` unless the pattern leaves the tile without an allowed pair."""
    return visit(st.pattern, st.causal, (q_start, q_start + bq, k_start, k_start + bk), body,
                 carry)


def _unpack(refs, names):
    it = iter(refs)
    return {name: (next(it) if present else None) for name, present in names}


def _fwd_kernel(*refs, st: _Static, has_bias: bool, has_mask: bool):
    r = _unpack(refs, [("q", True), ("k", True), ("v", True), ("bias", has_bias),
                       ("mask", has_mask), ("q_ids", st.segments), ("kv_ids", st.segments),
                       ("o", True), ("m", True), ("l", True)])
    bq, bk = st.bq, st.bk
    i = pl.program_id(2)
    q_start = i * bq
    q = r["q"][...]                                                  # (bq, H)
    q_ids = _columns(r["q_ids"][...], (0, 1)) if st.segments else None

    def step(j, carry):
        return _visit(st, q_start, j * bk, bq, bk, functools.partial(body, j), carry)

    def body(j, carry):
        acc, m, l = carry                                            # (bq, Hv), (bq, 1), (bq, 1)
        k_start = pl.multiple_of(j * bk, bk)
        cols = pl.ds(k_start, bk)
        s, _, key_ok = _scores(
            st, q, r["k"][cols, :], q_start, k_start,
            None if r["bias"] is None else r["bias"][:, cols],
            None if r["mask"] is None else r["mask"][:, cols],
            None if q_ids is None else _same(q_ids, r["kv_ids"][:, cols]))
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        if key_ok is not None:
            p = jnp.where(key_ok, p, 0.0)
        correction = jnp.exp(m - m_new)
        l = l * correction + jnp.sum(p, axis=1, keepdims=True)
        v = r["v"][cols, :]
        acc = acc * correction + _dot(p.astype(v.dtype), v, (1, 0))
        return acc, m_new, l

    hv = r["o"].shape[-1]
    init = (jnp.zeros((bq, hv), jnp.float32), jnp.full((bq, 1), NEG, jnp.float32),
            jnp.zeros((bq, 1), jnp.float32))
    acc, m, l = lax.fori_loop(*_kv_blocks(st, i, bq, bk), step, init)
    l = jnp.where(l > 0, l, 1.0)         # a padded query row a pattern kept from every key
    r["o"][...] = (acc / l).astype(r["o"].dtype)
    r["m"][...] = m
    r["l"][...] = l


def _columns(block: Array, which, axis: int = 1) -> tuple[Array, ...]:
    """The (rows, 1) columns ``which`` of a (rows, C) block (``axis=0``: the (1, cols)
    rows of a (R, cols) block), e.g. m, l, delta of the row statistics.

    Picked out by a masked sum, not by slicing the value: the Triton lowering has no value
    ``slice``, and every backend lowers iota, where and sum."""
    index = lax.broadcasted_iota(jnp.int32, block.shape, axis)
    return tuple(jnp.sum(jnp.where(index == c, block, 0.0), axis=axis, keepdims=True)
                 for c in which)


def _row_stats(block: Array) -> tuple[Array, Array, Array]:
    """m, l, delta of a (rows, 4|8) block of row statistics."""
    return _columns(block, range(3))


def _same(q_ids: tuple[Array, Array], kv_block: Array) -> Array:
    """(bq, bk) bool: equal segment ids. ``q_ids``: the (bq, 1) columns (high, low) of the
    query ids; ``kv_block``: the (2, bk) rows (high, low) of the key ids (``_encode_ids``)."""
    k_hi, k_lo = _columns(kv_block, (0, 1), axis=0)
    return (q_ids[0] == k_hi) & (q_ids[1] == k_lo)


def _dkdv_kernel(*refs, st: _Static, has_bias: bool, has_mask: bool):
    r = _unpack(refs, [("q", True), ("k", True), ("v", True), ("bias", has_bias),
                       ("mask", has_mask), ("kv_ids", st.segments), ("do", True),
                       ("stats", True), ("dk", True), ("dv", True)])
    bq, bk = st.bq_bwd, st.bk_bwd
    j = pl.program_id(2)
    k_start = j * bk
    k, v = r["k"][...], r["v"][...]                                  # (bk, H), (bk, Hv)
    kv_ids = r["kv_ids"][...] if st.segments else None              # (2, bk)

    def rows(ref, qs):  # a bias/mask block with a query axis, or one broadcast row
        if ref is None:
            return None
        return ref[qs, :] if ref.shape[0] > 1 else ref[...]

    def step(i, carry):
        return _visit(st, i * bq, k_start, bq, bk, functools.partial(body, i), carry)

    def body(i, carry):
        dk, dv = carry
        q_start = pl.multiple_of(i * bq, bq)
        qs = pl.ds(q_start, bq)
        q, do = r["q"][qs, :], r["do"][qs, :]
        stats = r["stats"][qs, :]
        s, allowed, key_ok = _scores(
            st, q, k, q_start, k_start, rows(r["bias"], qs), rows(r["mask"], qs),
            None if kv_ids is None else _same(_columns(stats, (4, 5)), kv_ids))
        m, l, delta = _row_stats(stats)
        p = jnp.exp(s - m) * (1.0 / l)
        if key_ok is not None:
            p = jnp.where(key_ok, p, 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, (0, 0))               # (bk, Hv)
        ds = p * (_dot(do, v, (1, 1)) - delta)                       # (bq, bk)
        if allowed is not None:
            ds = jnp.where(allowed, ds, 0.0)
        dk = dk + _dot(ds.astype(q.dtype), q, (0, 0))                # (bk, H)
        return dk, dv

    init = (jnp.zeros(r["dk"].shape, jnp.float32), jnp.zeros(r["dv"].shape, jnp.float32))
    dk, dv = lax.fori_loop(*_q_blocks(st, j, bq, bk), step, init)
    r["dk"][...] = (dk * st.scale).astype(r["dk"].dtype)
    r["dv"][...] = dv.astype(r["dv"].dtype)


def _dq_kernel(*refs, st: _Static, has_bias: bool, has_mask: bool, emit_dq: bool,
               emit_ds: bool):
    r = _unpack(refs, [("q", True), ("k", True), ("v", True), ("bias", has_bias),
                       ("mask", has_mask), ("kv_ids", st.segments), ("do", True),
                       ("stats", True), ("dq", emit_dq), ("ds", emit_ds)])
    bq, bk = st.bq_bwd, st.bk_bwd
    i = pl.program_id(2)
    q_start = i * bq
    q, do = r["q"][...], r["do"][...]
    stats = r["stats"][...]
    m, l, delta = _row_stats(stats)
    q_ids = _columns(stats, (4, 5)) if st.segments else None
    inv_l = 1.0 / l

    def step(j, dq):
        return _visit(st, q_start, j * bk, bq, bk, functools.partial(body, j), dq)

    def body(j, dq):
        k_start = pl.multiple_of(j * bk, bk)
        cols = pl.ds(k_start, bk)
        k = r["k"][cols, :]
        s, allowed, key_ok = _scores(
            st, q, k, q_start, k_start,
            None if r["bias"] is None else r["bias"][:, cols],
            None if r["mask"] is None else r["mask"][:, cols],
            None if q_ids is None else _same(q_ids, r["kv_ids"][:, cols]))
        p = jnp.exp(s - m) * inv_l
        if key_ok is not None:
            p = jnp.where(key_ok, p, 0.0)
        ds = p * (_dot(do, r["v"][cols, :], (1, 1)) - delta)
        if allowed is not None:
            ds = jnp.where(allowed, ds, 0.0)
        if emit_ds:
            r["ds"][:, cols] = ds
        if emit_dq:
            dq = dq + _dot(ds.astype(k.dtype), k, (1, 0))
        return dq

    first, end = _kv_blocks(st, i, bq, bk)
    if emit_ds and (st.causal or st.pattern is not None):   # skipped key blocks: zero gradient
        def zero(j, carry):
            r["ds"][:, pl.ds(pl.multiple_of(j * bk, bk), bk)] = jnp.zeros((bq, bk), jnp.float32)
            return carry
        lax.fori_loop(0, st.sp // bk, zero, 0)
    init = jnp.zeros((bq, q.shape[-1]) if emit_dq else (1, 1), jnp.float32)
    dq = lax.fori_loop(first, end, step, init)
    if emit_dq:
        r["dq"][...] = (dq * st.scale).astype(r["dq"].dtype)


# ----------------------------------------------------------------------------- pallas calls

def _compiler_params(st: _Static):
    if st.platform == "gpu":
        from jax.experimental.pallas import triton as pltriton
        return pltriton.CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages)
    if st.platform == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"),
                                    vmem_limit_bytes=tpu_vmem_limit())
    return None


def _call(kernel, st: _Static, grid, in_specs, out_specs, out_shape, name: str):
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs,
                          out_specs=out_specs, interpret=st.interpret,
                          compiler_params=_compiler_params(st), name=name)


def _head_spec(rows: int, cols: int, kv: bool, groups: int, along_grid: bool,
               single_buffer: bool = False):
    """(B, N|K, L, C) array, one head per program, ``rows`` rows: block i of the grid's
    last axis when ``along_grid``, else the whole length. ``kv``: head n reads kv head n // G.
    ``single_buffer``: one VMEM buffer instead of two (a block that stays the same along
    the grid's last axis: prefetching it ahead saves nothing there)."""
    def index(b, n, x):
        return (b, n // groups if kv else n, x if along_grid else 0, 0)
    if single_buffer:
        return pl.BlockSpec((None, None, rows, cols), index, pipeline_mode=pl.Buffered(1))
    return pl.BlockSpec((None, None, rows, cols), index)


def _aux_spec(x: Array, rows: int, cols: int, rows_along_grid: bool):
    """Spec of a bias/mask (Ba, Na, Ta, Sp), Ba/Na in {1, full}, Ta in {1, Tp}.

    ``rows_along_grid`` (forward, dQ): the grid walks query blocks; block (rows, Sp).
    Otherwise (dK/dV): the grid walks key blocks; block (Tp or 1, cols).
    """
    ba, na, ta, _ = x.shape
    block_rows = (rows if rows_along_grid else ta) if ta > 1 else 1

    def index(b, n, g):
        return (b if ba > 1 else 0, n if na > 1 else 0,
                g if (rows_along_grid and ta > 1) else 0, 0 if rows_along_grid else g)
    return pl.BlockSpec((None, None, block_rows, x.shape[3] if rows_along_grid else cols), index)


def _ids_spec(rows: int, cols: int, q_side: bool, along_grid: bool):
    """Encoded segment ids: queries (B, Tp, 2) in (rows, 2) blocks, keys (B, 2, Sp) in
    (2, cols) blocks; block i of the grid's last axis when ``along_grid``, else block 0."""
    def index(b, n, x):
        x = x if along_grid else 0
        return (b, x, 0) if q_side else (b, 0, x)
    return pl.BlockSpec((None, rows, 2) if q_side else (None, 2, cols), index)


def _forward(q, k, v, bias, mask, q_ids, kv_ids, st: _Static):
    """q (B, N, Tp, H), k (B, K, Sp, H), v (B, K, Sp, Hv) -> out (B, N, Tp, Hv), m, l."""
    b, n, tp, h = q.shape
    hv = v.shape[-1]
    aux = [x for x in (bias, mask) if x is not None]
    in_specs = [_head_spec(st.bq, h, False, st.groups, True),
                _head_spec(st.sp, h, True, st.groups, False),
                _head_spec(st.sp, hv, True, st.groups, False)]
    in_specs += [_aux_spec(x, st.bq, st.sp, True) for x in aux]
    if st.segments:
        aux += [q_ids, kv_ids]
        in_specs += [_ids_spec(st.bq, 0, True, True), _ids_spec(0, st.sp, False, False)]
    stat = jax.ShapeDtypeStruct((b, n, tp, 1), jnp.float32)
    kernel = functools.partial(_fwd_kernel, st=st, has_bias=bias is not None,
                               has_mask=mask is not None)
    return _call(kernel, st, (b, n, tp // st.bq), in_specs,
                 [_head_spec(st.bq, hv, False, 1, True), _head_spec(st.bq, 1, False, 1, True),
                  _head_spec(st.bq, 1, False, 1, True)],
                 [jax.ShapeDtypeStruct((b, n, tp, hv), v.dtype), stat, stat],
                 "flash_attention_fwd")(q, k, v, *aux)


def _backward(q, k, v, bias, mask, q_ids, kv_ids, out, m, l, do, st: _Static):
    b, n, tp, h = q.shape
    kh, sp, hv = k.shape[1], k.shape[2], v.shape[-1]
    bq, bk = st.bq_bwd, st.bk_bwd
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    # m, l, delta side by side: one (rows, 4) block instead of three (rows, 1) ones, each of
    # which a TPU pads to 128 lanes in VMEM (the dK/dV kernel holds whole rows of them); the
    # fourth column is zeros (Triton takes power-of-two shapes only); with segment ids the
    # query ids (high, low) follow in columns 4 and 5 of 8 (the same 128 lanes on a TPU)
    columns = [m, l, delta, jnp.zeros_like(m)]
    if st.segments:
        ids = jnp.broadcast_to(q_ids[:, None], (b, n, tp, 2))
        columns += [ids, jnp.zeros_like(ids)]
    stats = jnp.concatenate(columns, axis=-1)                            # (B, N, Tp, 4|8)
    width = stats.shape[-1]
    aux = [x for x in (bias, mask) if x is not None]
    flags = dict(st=st, has_bias=bias is not None, has_mask=mask is not None)
    # dK, dV per query head: grid over key blocks; Q, dO and the row statistics are whole
    # rows, the same block for every key block of a head: single-buffered on a TPU
    # (VMEM: 16 MiB on a v4, where double buffers of them overflow it at T = 8,192)
    once = st.platform == "tpu"
    in_specs = [_head_spec(tp, h, False, st.groups, False, once),
                _head_spec(bk, h, True, st.groups, True),
                _head_spec(bk, hv, True, st.groups, True)]
    in_specs += [_aux_spec(x, bq, bk, False) for x in aux]
    ids = [kv_ids] if st.segments else []
    in_specs += [_ids_spec(0, bk, False, True)] * len(ids)
    in_specs += [_head_spec(tp, hv, False, 1, False, once),
                 _head_spec(tp, width, False, 1, False, once)]
    dk, dv = _call(functools.partial(_dkdv_kernel, **flags), st, (b, n, sp // bk), in_specs,
                   [_head_spec(bk, h, False, 1, True), _head_spec(bk, hv, False, 1, True)],
                   [jax.ShapeDtypeStruct((b, n, sp, h), jnp.float32),
                    jax.ShapeDtypeStruct((b, n, sp, hv), jnp.float32)],
                   "flash_attention_dkdv")(q, k, v, *aux, *ids, do, stats)
    dk = dk.reshape(b, kh, st.groups, sp, h).sum(axis=2).astype(k.dtype)
    dv = dv.reshape(b, kh, st.groups, sp, hv).sum(axis=2).astype(v.dtype)

    # dQ (and, in a separate call that XLA drops when unused, dS for the bias).
    in_specs = [_head_spec(bq, h, False, st.groups, True),
                _head_spec(sp, h, True, st.groups, False),
                _head_spec(sp, hv, True, st.groups, False)]
    in_specs += [_aux_spec(x, bq, sp, True) for x in aux]
    in_specs += [_ids_spec(0, sp, False, False)] * len(ids)
    in_specs += [_head_spec(bq, hv, False, 1, True), _head_spec(bq, width, False, 1, True)]
    args = (q, k, v, *aux, *ids, do, stats)
    dq = _call(functools.partial(_dq_kernel, emit_dq=True, emit_ds=False, **flags), st,
               (b, n, tp // bq), in_specs, _head_spec(bq, h, False, 1, True),
               jax.ShapeDtypeStruct((b, n, tp, h), q.dtype), "flash_attention_dq")(*args)
    dbias = None
    if bias is not None:
        ds = _call(functools.partial(_dq_kernel, emit_dq=False, emit_ds=True, **flags), st,
                   (b, n, tp // bq), in_specs, _head_spec(bq, sp, False, 1, True),
                   jax.ShapeDtypeStruct((b, n, tp, sp), jnp.float32),
                   "flash_attention_dbias")(*args)
        axes = tuple(a for a in range(4) if bias.shape[a] == 1 and ds.shape[a] > 1)
        dbias = jnp.sum(ds, axis=axes, keepdims=True).astype(bias.dtype)
    return dq, dk, dv, dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _flash(q, k, v, bias, mask, q_ids, kv_ids, st: _Static):
    """(out, empty): ``empty`` (B, N, Tp) marks the rows without an allowed key, where m
    stayed NEG (no gradient)."""
    out, m, _ = _forward(q, k, v, bias, mask, q_ids, kv_ids, st)
    return out, _no_key(m)


def _no_key(m: Array) -> Array:
    return m[..., 0] == NEG


def _flash_fwd(q, k, v, bias, mask, q_ids, kv_ids, st):
    out, m, l = _forward(q, k, v, bias, mask, q_ids, kv_ids, st)
    return (out, _no_key(m)), (q, k, v, bias, mask, q_ids, kv_ids, out, m, l)


def _flash_bwd(st, residuals, cotangents):
    q, k, v, bias, mask, q_ids, kv_ids, out, m, l = residuals
    dq, dk, dv, dbias = _backward(q, k, v, bias, mask, q_ids, kv_ids, out, m, l,
                                  cotangents[0], st)
    return dq, dk, dv, dbias, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------- public

def _pad_to(x: Array, axis: int, size: int, value=0) -> Array:
    return pad_axis(x, axis, size, value, keep_broadcast=False)


def _encode_ids(ids: Array, size: int) -> Array:
    """(B, L) int segment ids -> (B, size, 2) fp32 (id >> 12, id & 4095), each exact in
    fp32 for any int32, the pair equal iff the ids are; padding repeats the last id."""
    ids = pad_axis(ids.astype(jnp.int32), 1, size, mode="edge", keep_broadcast=False)
    return jnp.stack([ids >> 12, ids & 4095], axis=-1).astype(jnp.float32)


def _prepare_aux(x: Array | None, t: int, s: int, tp: int, sp: int, dtype) -> Array | None:
    """(Ba, Na, Ta, Sa) -> (Ba, Na, 1|Tp, Sp) in ``dtype``: keys always explicit, padded."""
    if x is None:
        return None
    x = jnp.broadcast_to(x, x.shape[:3] + (s,)).astype(dtype)
    if x.shape[2] > 1:
        x = _pad_to(x, 2, tp)
    return _pad_to(x, 3, sp)


def flash_attention(query: Array, key: Array, value: Array, *, bias: Array | None = None,
                    mask: Array | None = None, causal: bool = False, scale: float | None = None,
                    block_sizes: BlockSizes | None = None, interpret: bool | None = None,
                    platform: str | None = None, num_warps: int | None = None,
                    num_stages: int = 2, pattern: AttentionPattern | None = None,
                    segment_ids: tuple[Array, Array] | None = None) -> Array:
    """Exact attention with Pallas kernels, same conventions as ``dot_product_attention``.

    Args:
      query (B, T, N, H), key (B, S, K, H), value (B, S, K, Hv); N a multiple of K.
      bias: float, broadcastable to (B, N, T, S); differentiable (e.g. T5's relative bias).
      mask: bool/int, broadcastable to (B, N, T, S); 1 = may attend.
      causal: query i sees keys j <= i (top-left aligned); fully masked key blocks skipped.
      block_sizes: ``BlockSizes``; default ``DEFAULT_BLOCK_SIZES`` of the platform (on a
        TPU ``flash_blocks.tpu_block_sizes`` of the generation compiled for), shrunk to the
        (power-of-two rounded) sequence lengths.
      interpret: run the kernels as XLA loops; default: on any backend but GPU/TPU.
      platform: "tpu" (Mosaic), "gpu" (Triton) or "interpret"; default: from ``interpret``
        and the default backend. A function lowered for another platform than the one it
        runs on (``jax.jit(f).trace(...).lower(lowering_platforms=...)``) passes it.
      num_warps, num_stages: Triton launch parameters on GPU (default 4 warps for H <= 64,
        else 8; 2 stages).
      pattern: a window or strided/fixed sparse ``masks.AttentionPattern`` (self-attention,
        aligned positions): key blocks outside its span are not visited, and tiles inside
        it without an allowed pair are skipped, so a window costs O(T W).
      segment_ids: packed documents, (q (B, T), kv (B, S)) int32
        (``masks.segment_ids_pair``): query i sees key j only when their ids are equal.

    Returns: (B, T, N, Hv) in value's dtype.
    """
    b, t, s, n, kh, h = check_qkv(query, key, value)
    shape = (b, n, t, s)
    mask = check_broadcast(mask, "mask", shape)
    bias = check_broadcast(bias, "bias", shape)
    if platform is None:
        interpret = default_interpret() if interpret is None else interpret
        platform = "interpret" if interpret else jax.default_backend()
    if platform not in ("gpu", "tpu", "interpret"):
        raise UserError(f"the Pallas attention kernels compile for GPU (Triton) and TPU "
                        f"(Mosaic) only; backend {platform!r} needs interpret=True (the "
                        "default there) or attention_impl='chunked'")
    blocks = block_sizes or DEFAULT_BLOCK_SIZES[platform]
    if block_sizes is None and platform == "tpu":       # per generation, flash_blocks.py
        blocks = tpu_block_sizes(tpu_chip(), h, t, s, bias is not None)
    floor = 16 if platform == "gpu" else 8        # Triton's tl.dot needs tiles >= 16

    def fit(block, length):
        return max(floor, min(block, _next_pow2(length)))

    bq, bk = fit(blocks.block_q, t), fit(blocks.block_k, s)
    bq_bwd, bk_bwd = fit(blocks.bwd[0], t), fit(blocks.bwd[1], s)
    if platform == "tpu" and (bias is not None or mask is not None or segment_ids is not None):
        # bias/mask/key-id blocks are sliced along their key (lane) axis, which Mosaic takes
        # at multiples of 128 only: short keys are padded to one 128-wide block
        bk, bk_bwd = max(bk, 128), max(bk_bwd, 128)
    tp, sp = _round_up(t, max(bq, bq_bwd)), _round_up(s, max(bk, bk_bwd))
    hv = value.shape[-1]
    st = _Static(scale=1.0 / math.sqrt(h) if scale is None else float(scale), causal=causal,
                 t=t, s=s, tp=tp, sp=sp, groups=n // kh, bq=bq, bk=bk, bq_bwd=bq_bwd,
                 bk_bwd=bk_bwd, platform=platform,
                 num_warps=num_warps or (4 if max(h, hv) <= 64 else 8), num_stages=num_stages,
                 pattern=pattern, segments=segment_ids is not None)

    # (B, T, N, H) -> (B, N, Tp, H'): heads outermost, so that a block is a 2-D (rows, H)
    # tile; Triton also needs power-of-two head dims (zero padding changes no logit).
    hp, hvp = (max(16, _next_pow2(h)), max(16, _next_pow2(hv))) if platform == "gpu" else (h, hv)
    q = _pad_to(_pad_to(query.transpose(0, 2, 1, 3), 2, tp), 3, hp)
    k = _pad_to(_pad_to(key.transpose(0, 2, 1, 3), 2, sp), 3, hp)
    v = _pad_to(_pad_to(value.transpose(0, 2, 1, 3), 2, sp), 3, hvp)
    q_ids = kv_ids = None
    if segment_ids is not None:    # (B, Tp, 2) and (B, 2, Sp): see _encode_ids
        q_ids, kv_ids = _encode_ids(segment_ids[0], tp), _encode_ids(segment_ids[1], sp)
        kv_ids = kv_ids.transpose(0, 2, 1)
    out, empty = _flash(q, k, v, _prepare_aux(bias, t, s, tp, sp, jnp.float32),
                        _prepare_aux(mask, t, s, tp, sp, jnp.int32), q_ids, kv_ids, st)
    out = out[:, :, :t, :hv].transpose(0, 2, 1, 3).astype(value.dtype)
    if segment_ids is not None and (causal or pattern is not None):
        # rows without an allowed key get the mean of V (all keys, not the visited ones)
        out = fill_rows(out, value, empty[:, :, :t].transpose(0, 2, 1)[..., None])
    elif (causal or pattern is not None) and mask is not None:
        out = fill_empty_rows(out, value, mask, t, s, causal, pattern)
    return out
