"""Memory-efficient exact attention in plain XLA: ``attention_impl="chunked"``.

Queries in blocks of ``q_chunk``, keys in blocks of ``kv_chunk`` with an online softmax;
with ``causal`` the key blocks past the diagonal are skipped. A custom VJP saves only the
output and the softmax statistics and recomputes the probabilities block by block in the
backward pass (FlashAttention-2), so memory grows linearly with T and S. Supports
dropout (an independent stream per block pair), not returned weights. It computes what
the reference in ``attention.py`` computes, to fp32 rounding.

Segment ids (packed documents) are compared tile by tile, a (qc, kc) comparison of the
block's ids, so no (T, S) mask is ever built; a tile whose query and key id ranges are
disjoint holds no equal pair whatever the order of the ids, and is skipped.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from .attention_base import (NEG, block, check_qkv, fill_empty_rows, fill_rows, group_heads,
                             key_block_range, pad_axis, query_block_range, visit)
from .masks import AttentionPattern

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _Chunking:
    """Static settings of the chunked kernel (hashable: a custom_vjp non-diff argument)."""
    scale: float
    causal: bool
    t: int
    s: int
    qc: int
    kc: int
    nq: int
    nk: int
    dropout_rate: float        # 0.0: no dropout
    skip: bool                 # skip key blocks past the causal diagonal / the pattern
    precision: Any
    pattern: AttentionPattern | None = None


def _key_blocks(c: _Chunking, qi):
    """Key blocks [first, end) visited by query block ``qi``: all, or those the causal
    diagonal and the pattern leave."""
    if not c.skip:
        return 0, c.nk
    return key_block_range(c.pattern, c.causal, qi * c.qc, c.qc, c.kc, c.nk)


def _query_blocks(c: _Chunking, ki):
    """Query blocks [first, end) that see key block ``ki``."""
    if not c.skip:
        return 0, c.nq
    return query_block_range(c.pattern, c.causal, ki * c.kc, c.kc, c.qc, c.nq)


def _visit(c: _Chunking, qi, ki, body, carry, seg=None):
    """``body(carry)`` unless the pattern, or the segment ids (``_Segments``), leave the
    (qi, ki) tile without a pair."""
    if not c.skip:
        return body(carry)
    if seg is not None:
        inner = body
        body = lambda carry: jax.lax.cond(seg.overlap(c, qi, ki), inner,  # noqa: E731
                                          lambda x: x, carry)
    tile = (qi * c.qc, qi * c.qc + c.qc, ki * c.kc, ki * c.kc + c.kc)
    return visit(c.pattern, c.causal, tile, body, carry)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Segments:
    """Padded segment ids q (B, Tp), kv (B, Sp) int32 and each block's id range
    (nq|nk, B) min and max: a tile whose ranges are disjoint (for every row) has no equal
    pair, whether or not the ids are sorted."""
    q: Array
    kv: Array
    q_lo: Array
    q_hi: Array
    kv_lo: Array
    kv_hi: Array

    @classmethod
    def build(cls, q_ids: Array, kv_ids: Array, c: _Chunking) -> _Segments:
        # padding repeats the last id, so that it widens no block's range
        q = pad_axis(q_ids.astype(jnp.int32), 1, c.nq * c.qc, mode="edge",
                     keep_broadcast=False)
        kv = pad_axis(kv_ids.astype(jnp.int32), 1, c.nk * c.kc, mode="edge",
                      keep_broadcast=False)
        qb = q.reshape(q.shape[0], c.nq, c.qc)
        kb = kv.reshape(kv.shape[0], c.nk, c.kc)
        return cls(q, kv, qb.min(-1).T, qb.max(-1).T, kb.min(-1).T, kb.max(-1).T)

    def overlap(self, c: _Chunking, qi, ki):
        return jnp.any((self.q_lo[qi] <= self.kv_hi[ki]) & (self.kv_lo[ki] <= self.q_hi[qi]))

    def same(self, c: _Chunking, qi, ki):
        """(B, qc, kc) bool: equal ids in tile (qi, ki)."""
        q = jax.lax.dynamic_slice_in_dim(self.q, qi * c.qc, c.qc, 1)
        kv = jax.lax.dynamic_slice_in_dim(self.kv, ki * c.kc, c.kc, 1)
        return q[:, :, None] == kv[:, None, :]


def _chunk_scores(c: _Chunking, q_blk, k_blk, qi, ki, bias, mask, seg=None):
    """fp32 logits (B, K, G, qc, kc) of one block pair, disallowed entries at NEG.

    Returns (logits, allowed, key_ok); ``key_ok`` (kc,) marks real (unpadded) keys, which
    alone enter the softmax sum, also in rows whose real keys are all masked.
    """
    kh, g = k_blk.shape[2], q_blk.shape[3]
    logits = jnp.einsum("BQKGH,BCKH->BKGQC", q_blk, k_blk, precision=c.precision,
                        preferred_element_type=jnp.float32) * c.scale
    if bias is not None:
        blk = block(block(bias, 2, qi * c.qc, c.qc), 3, ki * c.kc, c.kc)
        logits = logits + group_heads(blk, kh, g).astype(jnp.float32)
    q_pos = qi * c.qc + jnp.arange(c.qc)
    k_pos = ki * c.kc + jnp.arange(c.kc)
    key_ok = k_pos < c.s
    allowed = key_ok[None, :]
    if c.causal:
        allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
    if c.pattern is not None:
        allowed = allowed & c.pattern.allowed(q_pos[:, None], k_pos[None, :])
    allowed = allowed[None, None, None]
    if mask is not None:
        blk = block(block(mask, 2, qi * c.qc, c.qc), 3, ki * c.kc, c.kc)
        allowed = allowed & group_heads(blk, kh, g)
    if seg is not None:
        allowed = allowed & seg.same(c, qi, ki)[:, None, None]
    return jnp.where(allowed, logits, NEG), allowed, key_ok


def _chunk_keep(c: _Chunking, rng, qi, ki, shape):
    """Dropout keep-mask of block pair (qi, ki): the same stream forward and backward."""
    key = jax.random.fold_in(jax.random.fold_in(rng, qi), ki)
    return jax.random.bernoulli(key, 1.0 - c.dropout_rate, shape)


def _chunk_forward(c: _Chunking, q, k, v, bias, mask, rng, seg: _Segments | None = None):
    """q (B, Tp, K, G, H), k (B, Sp, K, H), v (B, Sp, K, Hv) -> out (B, Tp, K, G, Hv) and
    the softmax statistics m, l (nq, B, K, G, qc) per query block."""
    b, _, kh, g, _ = q.shape
    hv = v.shape[-1]

    def query_block(qi):
        q_blk = jax.lax.dynamic_slice_in_dim(q, qi * c.qc, c.qc, 1)

        def key_step(ki, carry):
            return _visit(c, qi, ki, functools.partial(key_tile, ki), carry, seg)

        def key_tile(ki, carry):
            acc, m, l = carry                         # (B,K,G,qc,Hv), (B,K,G,qc), (B,K,G,qc)
            k_blk = jax.lax.dynamic_slice_in_dim(k, ki * c.kc, c.kc, 1)
            logits, _, key_ok = _chunk_scores(c, q_blk, k_blk, qi, ki, bias, mask, seg)
            m_new = jnp.maximum(m, logits.max(axis=-1))
            p = jnp.where(key_ok, jnp.exp(logits - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(axis=-1)
            if c.dropout_rate:
                keep = _chunk_keep(c, rng, qi, ki, p.shape)
                p = jnp.where(keep, p / (1.0 - c.dropout_rate), 0.0)
            v_blk = jax.lax.dynamic_slice_in_dim(v, ki * c.kc, c.kc, 1)
            pv = jnp.einsum("BKGQC,BCKH->BKGQH", p.astype(v.dtype), v_blk, precision=c.precision,
                            preferred_element_type=jnp.float32)
            return acc * correction[..., None] + pv, m_new, l

        init = (jnp.zeros((b, kh, g, c.qc, hv), jnp.float32),
                jnp.full((b, kh, g, c.qc), NEG, jnp.float32),
                jnp.zeros((b, kh, g, c.qc), jnp.float32))
        acc, m, l = jax.lax.fori_loop(*_key_blocks(c, qi), key_step, init)
        l = jnp.where(l > 0, l, 1.0)     # a padded query row a pattern kept from every key
        return (acc / l[..., None]).astype(v.dtype), m, l

    out, m, l = jax.lax.map(query_block, jnp.arange(c.nq))          # out (nq, B, K, G, qc, Hv)
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, c.nq * c.qc, kh, g, hv)
    return out, m, l


@dataclasses.dataclass(frozen=True)
class _Backward:
    """The operands of one backward pass and the per-block-pair work the passes share."""
    c: _Chunking
    q: Array            # (B, Tp, K, G, H)
    k: Array            # (B, Sp, K, H)
    v: Array            # (B, Sp, K, Hv)
    bias: Array | None
    mask: Array | None
    rng: Array | None
    m: Array            # softmax statistics (nq, B, K, G, qc)
    l: Array
    delta: Array        # rowsum(dO * O) (nq, B, K, G, qc)
    d_out: Array        # (B, Tp, K, G, Hv)
    seg: _Segments | None = None

    def q_slices(self, qi):
        c = self.c
        return (jax.lax.dynamic_slice_in_dim(self.q, qi * c.qc, c.qc, 1),
                jax.lax.dynamic_slice_in_dim(self.d_out, qi * c.qc, c.qc, 1))

    def kv_slices(self, ki):
        c = self.c
        return (jax.lax.dynamic_slice_in_dim(self.k, ki * c.kc, c.kc, 1),
                jax.lax.dynamic_slice_in_dim(self.v, ki * c.kc, c.kc, 1))

    def pair(self, qi, ki, q_blk, k_blk, v_blk, do_blk):
        """(probabilities after dropout, dLogits) of block pair (qi, ki)."""
        c = self.c
        logits, allowed, key_ok = _chunk_scores(c, q_blk, k_blk, qi, ki, self.bias, self.mask,
                                                self.seg)
        p = jnp.exp(logits - self.m[qi][..., None]) / self.l[qi][..., None]
        p = jnp.where(key_ok, p, 0.0)
        dp = jnp.einsum("BQKGH,BCKH->BKGQC", do_blk, v_blk, precision=c.precision,
                        preferred_element_type=jnp.float32)
        p_used = p
        if c.dropout_rate:
            keep = _chunk_keep(c, self.rng, qi, ki, p.shape)
            p_used = jnp.where(keep, p / (1.0 - c.dropout_rate), 0.0)
            dp = jnp.where(keep, dp / (1.0 - c.dropout_rate), 0.0)
        ds = jnp.where(allowed, p * (dp - self.delta[qi][..., None]), 0.0)
        return p_used, ds


def _grad_q(bw: _Backward) -> Array:
    """dQ (B, Tp, K, G, H): one pass over query blocks, each looping over its key blocks."""
    c, q, k = bw.c, bw.q, bw.k

    def dq_block(qi):
        q_blk, do_blk = bw.q_slices(qi)

        def tile(ki, dq):
            k_blk, v_blk = bw.kv_slices(ki)
            _, ds = bw.pair(qi, ki, q_blk, k_blk, v_blk, do_blk)
            return dq + jnp.einsum("BKGQC,BCKH->BQKGH", ds.astype(k.dtype), k_blk,
                                   precision=c.precision, preferred_element_type=jnp.float32)

        def step(ki, dq):
            return _visit(c, qi, ki, functools.partial(tile, ki), dq, bw.seg)

        dq = jax.lax.fori_loop(*_key_blocks(c, qi), step, jnp.zeros(q_blk.shape, jnp.float32))
        return (dq * c.scale).astype(q.dtype)

    dq = jax.lax.map(dq_block, jnp.arange(c.nq))                    # (nq, B, qc, K, G, H)
    return dq.swapaxes(0, 1).reshape(q.shape)


def _grad_kv(bw: _Backward) -> tuple[Array, Array]:
    """dK, dV (B, Sp, K, H|Hv): one pass over key blocks, each looping over query blocks."""
    c, q, k, v = bw.c, bw.q, bw.k, bw.v

    def dkdv_block(ki):
        k_blk, v_blk = bw.kv_slices(ki)

        def step(qi, carry):
            return _visit(c, qi, ki, functools.partial(tile, qi), carry, bw.seg)

        def tile(qi, carry):
            dk, dv = carry
            q_blk, do_blk = bw.q_slices(qi)
            p, ds = bw.pair(qi, ki, q_blk, k_blk, v_blk, do_blk)
            dv = dv + jnp.einsum("BKGQC,BQKGH->BCKH", p.astype(do_blk.dtype), do_blk,
                                 precision=c.precision, preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("BKGQC,BQKGH->BCKH", ds.astype(q.dtype), q_blk,
                                 precision=c.precision, preferred_element_type=jnp.float32)
            return dk, dv

        init = (jnp.zeros(k_blk.shape, jnp.float32), jnp.zeros(v_blk.shape, jnp.float32))
        dk, dv = jax.lax.fori_loop(*_query_blocks(c, ki), step, init)
        return (dk * c.scale).astype(k.dtype), dv.astype(v.dtype)

    dk, dv = jax.lax.map(dkdv_block, jnp.arange(c.nk))              # (nk, B, kc, K, H|Hv)
    return dk.swapaxes(0, 1).reshape(k.shape), dv.swapaxes(0, 1).reshape(v.shape)


def _grad_bias(bw: _Backward) -> Array:
    """dBias in the bias's own (broadcast) shape: dLogits summed over its size-1 axes."""
    c, bias = bw.c, bw.bias
    b, _, kh, g, _ = bw.q.shape
    sp = bw.k.shape[1]
    bb, nb, tb, sb = bias.shape
    summed = tuple(a for a, size in enumerate((bb, nb, tb, sb)) if size == 1)

    def dbias_block(qi):
        q_blk, do_blk = bw.q_slices(qi)

        def step(ki, acc):
            return _visit(c, qi, ki, functools.partial(tile, ki), acc, bw.seg)

        def tile(ki, acc):
            k_blk, v_blk = bw.kv_slices(ki)
            _, ds = bw.pair(qi, ki, q_blk, k_blk, v_blk, do_blk)
            ds = ds.reshape(b, kh * g, c.qc, c.kc)                   # head n = k * G + g
            ds = jnp.sum(ds, axis=summed, keepdims=True)
            if sb == 1:
                return acc + ds
            return jax.lax.dynamic_update_slice_in_dim(acc, ds, ki * c.kc, 3)

        init = jnp.zeros((bb, nb, c.qc if tb > 1 else 1, sp if sb > 1 else 1), jnp.float32)
        return jax.lax.fori_loop(*_key_blocks(c, qi), step, init)

    d_bias = jax.lax.map(dbias_block, jnp.arange(c.nq))             # (nq, Bb, Nb, qc|1, Sp|1)
    if tb > 1:
        d_bias = d_bias.transpose(1, 2, 0, 3, 4).reshape(bb, nb, c.nq * c.qc, -1)
    else:
        d_bias = d_bias.sum(axis=0)
    return d_bias.astype(bias.dtype)


def _chunk_backward(c: _Chunking, q, k, v, bias, mask, rng, seg, out, m, l, d_out):
    """FlashAttention-2 style backward: probabilities recomputed from (m, l), one pass over
    query blocks for dQ, one over key blocks for dK/dV, one more for dBias (only when a
    bias is given; XLA removes it when that gradient is unused)."""
    b, _, kh, g, _ = q.shape
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1)  # (B,Tp,K,G)
    delta = delta.reshape(b, c.nq, c.qc, kh, g).transpose(1, 0, 3, 4, 2)           # (nq,B,K,G,qc)
    bw = _Backward(c, q, k, v, bias, mask, rng, m, l, delta, d_out, seg)
    dk, dv = _grad_kv(bw)
    return _grad_q(bw), dk, dv, None if bias is None else _grad_bias(bw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _chunked_core(q, k, v, bias, mask, rng, seg, c: _Chunking):
    """(out (B, Tp, K, G, Hv), m (nq, B, K, G, qc)); m stays NEG in rows without an
    allowed key (no gradient flows through it)."""
    out, m, _ = _chunk_forward(c, q, k, v, bias, mask, rng, seg)
    return out, m


def _chunked_core_fwd(q, k, v, bias, mask, rng, seg, c):
    out, m, l = _chunk_forward(c, q, k, v, bias, mask, rng, seg)
    return (out, m), (q, k, v, bias, mask, rng, seg, out, m, l)


def _chunked_core_bwd(c, residuals, cotangents):
    q, k, v, bias, mask, rng, seg, out, m, l = residuals
    dq, dk, dv, d_bias = _chunk_backward(c, q, k, v, bias, mask, rng, seg, out, m, l,
                                         cotangents[0])
    return dq, dk, dv, d_bias, None, None, None


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def default_chunk(pattern: AttentionPattern | None) -> int:
    """Query/key block size of ``"chunked"`` when none is given: 512, and for a window the
    power of two at or below W / 4 within [64, 512], so that few keys outside the window
    are computed (W = 512 in blocks of 128: 5 key blocks per query block, 640 keys for 512
    allowed). Sparse patterns keep 512: their tiles then all hold an allowed pair, and
    smaller ones cost more loop steps than they skip (docs/performance.md, 2026-12-02)."""
    if pattern is None or pattern.kind != "window":
        return 512
    return max(64, min(512, 1 << max(0, (pattern.size // 4).bit_length() - 1)))


def chunked_attention(q, k, v, mask, bias, scale, causal, dropout_rate, dropout_rng,
                      deterministic, precision, q_chunk, kv_chunk, skip_masked_blocks=True,
                      pattern: AttentionPattern | None = None,
                      segment_ids: tuple[Array, Array] | None = None):
    """Exact attention in (q_chunk, kv_chunk) blocks with an online softmax (module doc).

    ``pattern`` (a window or a strided/fixed sparse pattern, ``masks.AttentionPattern``)
    restricts the pairs; the key blocks outside its span are never visited, and inside it
    the tiles without an allowed pair are skipped. ``segment_ids`` (q (B, T), kv (B, S)
    int32, ``masks.segment_ids_pair``) restrict them to equal ids, compared tile by tile
    (tiles with disjoint id ranges skipped). ``skip_masked_blocks=False`` visits every key
    block (the blocks past the diagonal or the pattern then contribute exact
    zeros): a reference for the skipping path.
    """
    b, t, s, n, kh, h = check_qkv(q, k, v)
    g = n // kh
    qc, kc = min(q_chunk, t), min(kv_chunk, s)
    tp, sp = -(-t // qc) * qc, -(-s // kc) * kc
    use_dropout = (not deterministic) and dropout_rate > 0.0
    c = _Chunking(scale=float(scale), causal=causal, t=t, s=s, qc=qc, kc=kc, nq=tp // qc,
                  nk=sp // kc, dropout_rate=float(dropout_rate) if use_dropout else 0.0,
                  skip=skip_masked_blocks, precision=precision, pattern=pattern)
    qg = pad_axis(q, 1, tp, 0).reshape(b, tp, kh, g, h)
    kp, vp = pad_axis(k, 1, sp, 0), pad_axis(v, 1, sp, 0)
    mask_p = None if mask is None else pad_axis(
        pad_axis(mask.astype(bool), 3, sp, False), 2, tp, True)
    if bias is not None:
        bias = pad_axis(pad_axis(bias, 3, sp, 0), 2, tp, 0)
    seg = None if segment_ids is None else _Segments.build(*segment_ids, c)
    out, m = _chunked_core(qg, kp, vp, bias, mask_p, dropout_rng if use_dropout else None, seg,
                           c)
    out = out.reshape(b, tp, n, v.shape[-1])[:, :t]
    if seg is not None:       # rows without an allowed key: m never left NEG
        m = m.transpose(1, 0, 4, 2, 3).reshape(b, tp, n)[:, :t]
        out = fill_rows(out, v, m[..., None] == NEG)
    elif (causal or pattern is not None) and mask is not None:
        out = fill_empty_rows(out, v, mask, t, s, causal, pattern)
    return out

