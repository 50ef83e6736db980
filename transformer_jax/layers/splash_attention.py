"""JAX's splash attention on TPU: ``dot_product_attention(..., attention_impl="splash")``.

A wrapper of ``jax.experimental.pallas.ops.tpu.splash_attention`` (block-sparse flash
attention in Pallas/Mosaic, with a fused forward and a dQ + dK/dV backward), which is what
MaxText and the other JAX anchors run on TPU. Our conventions around it:

  * q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv), N a multiple of K: the kernel's own
    grouped-query heads (query head n reads kv head n // G, HF's repeat_kv order), vmapped
    over the batch; ``scale`` is folded into q; (B, T, N, Hv) in value's dtype comes back.
  * the static mask is one splash mask per head: ``CausalMask`` (top-left aligned, query i
    sees keys j <= i), ``LocalMask`` for a window ``AttentionPattern`` (causal: i - W < j
    <= i, window (W - 1, 0); bidirectional: |i - j| < W, window (W - 1, W - 1)), else
    ``FullMask``. Splash skips the key blocks a static mask excludes.
  * segment ids (packed documents) are the kernel's ``SegmentIds``; a key-padding mask
    (B|1, 1, 1, S) becomes segments too: a padded key gets an id that no query of its row
    carries. Lengths are padded to the block sizes (multiples of 128) the same way.
  * under a "highest" (or any multi-pass) ``jax_default_matmul_precision`` bf16/fp16
    inputs run in fp32: Mosaic refuses multi-pass bf16 matmuls, and splash's dots take the
    default precision (our kernel sets its own per dtype instead).
  * rows that see no key at all (every key padded, or no key of their segment) get the
    mean of V, as the reference gives them (``attention_base.fill_empty_rows``).

Splash takes no additive bias, no general (..., T, S) mask and no strided/fixed pattern
(``splash_problems`` names them); ``attention_dispatch`` sends those calls to our Pallas
kernel (``flash_attention.py``). Off a TPU it runs in interpret mode (slow, for tests).

Block sizes (``SPLASH_BLOCKS``, one row per TPU generation; ``tpu_name`` reads the device
kind). All rows start from MaxText's defaults (``sa_block_*`` = 512 for the forward, dQ and
dK/dV kernels, the separate dQ/dK/dV backward); none has been measured on a chip here, the
compile check is ``benchmarks/splash_compile.py`` (docs/tpu.md):

  =========  =======  ========  ================  ==========================================
  TPU        block_q  block_kv  block_kv_compute  basis
  =========  =======  ========  ================  ==========================================
  v4         512      512       512               MaxText defaults; 16 MiB scoped VMEM fits
  v5e        512      512       512               MaxText defaults
  v5p        512      512       512               MaxText defaults
  v6e        512      512       512               MaxText defaults
  later      512      512       512               MaxText defaults (v7x and unknown kinds)
  =========  =======  ========  ================  ==========================================

A block is shrunk to the (128-rounded) length when the length is shorter, and to the
largest halving of it that divides the padded length otherwise (a T of 640 takes 128).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _splash
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask_info as _mask_info)

from ..errors import UserError
from .attention_base import check_broadcast, check_qkv, fill_empty_rows, pad_axis
from .masks import AttentionPattern, combine_masks, segment_mask

Array = jax.Array

LANES = 128     # splash's block sizes and padded lengths are multiples of the lane width


@dataclasses.dataclass(frozen=True)
class SplashBlocks:
    """Block sizes of one TPU generation: queries and keys of the forward kernel, the key
    block each inner step computes, and the same for the backward kernels."""
    block_q: int = 512
    block_kv: int = 512
    block_kv_compute: int = 512


SPLASH_BLOCKS = {"v4": SplashBlocks(), "v5e": SplashBlocks(), "v5p": SplashBlocks(),
                 "v6e": SplashBlocks(), "later": SplashBlocks()}


def tpu_name(device_kind: str | None = None) -> str:
    """``SPLASH_BLOCKS``'s row for a device kind ("TPU v5 lite" -> "v5e"); by default the
    current mesh's devices (a TPU topology's too), else this process's TPU, else "later"."""
    if device_kind is None:
        device = jax.sharding.get_abstract_mesh().abstract_device
        device_kind = getattr(device, "device_kind", None) if device is not None else None
        if device_kind is None and jax.default_backend() == "tpu":
            device_kind = jax.devices()[0].device_kind
    m = re.match(r"TPU\s*v?(\d+)\s*(\w*)", device_kind or "")
    if not m:
        return "later"
    generation, variant = int(m.group(1)), m.group(2).lower()
    if generation == 4:
        return "v4"
    if generation in (5, 6):
        lite = variant in ("lite", "e")
        return f"v{generation}e" if lite else ("v5p" if generation == 5 else "later")
    return "later"


def splash_problems(*, bias: bool | str | None = None, mask: str | None = None,
                    pattern: AttentionPattern | None = None) -> list[str]:
    """What of a call splash cannot express: a bias (True or its description), a mask kind
    (None, "keys" for key padding (B, 1, 1, S), "general" for anything with a head or
    query axis) and a pattern. Empty when splash can run it."""
    problems = []
    if bias:
        problems.append("an additive bias" + (f" ({bias})" if isinstance(bias, str) else ""))
    if mask == "general":
        problems.append("a mask with a head or query axis (splash takes key padding "
                        "(B, 1, 1, S), causality, a window and segment ids)")
    if pattern is not None and pattern.kind != "window":
        problems.append(f"the {pattern.kind!r} sparse pattern")
    return problems


def mask_kind(mask: Array | None) -> str | None:
    """None, "keys" (a 4-D key-padding mask (B|1, 1, 1, S|1)) or "general"."""
    if mask is None:
        return None
    return "keys" if mask.shape[1] == 1 and mask.shape[2] == 1 else "general"


def _fit(block: int, length: int) -> tuple[int, int]:
    """(block, padded length): the length rounded up to the lane width; the block halved
    from ``block`` until it divides that (at least one lane width)."""
    padded = -(-length // LANES) * LANES
    block = min(block, padded)
    while padded % block:
        block //= 2
    return max(block, LANES), padded


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, tp: int, sp: int, causal: bool, window: int | None, bq: int,
            bkv: int, bkv_compute: int, interpret: bool):
    """The splash kernel for one shape, its mask processed into block tables, cached: the
    layers of a model, and later traces, share it.

    ``make_splash_mha`` would do the same but turns the tables into device arrays, which
    fails inside a trace under a mesh of a TPU topology's devices (a compile on a host
    without a TPU); here they stay numpy arrays, constants of the traced program."""
    shape = (tp, sp)
    if window is not None:
        base = splash.LocalMask(shape, (window - 1, 0 if causal else window - 1), offset=0)
    elif causal:
        base = splash.CausalMask(shape)
    else:
        base = splash.FullMask(shape)
    mask = splash.MultiHeadMask([base] * heads)
    blocks = splash.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv_compute, block_q_dkv=bq,
        block_kv_dkv=bkv, block_kv_dkv_compute=bkv_compute, block_q_dq=bq, block_kv_dq=bkv)
    tables = dict(downcast_smem_data=True, head_shards=1, q_seq_shards=1)
    # the dQ kernel uses the forward's blocks, so it shares the forward's tables
    fwd, mask_fn = _mask_info.process_mask(mask, (bq, bkv), **tables)
    dkv, _ = _mask_info.process_mask_dkv(mask, (bq, bkv), shrink_grid=True, **tables)
    return _splash.SplashAttentionKernel(
        fwd, fwd, dkv, block_sizes=blocks, is_mqa=False, save_residuals=False,
        mask_value=_splash.DEFAULT_MASK_VALUE, attn_logits_soft_cap=None,
        residual_checkpoint_name=None, mask_function=mask_fn, interpret=interpret)


def _padding_id(q_ids: Array) -> Array:
    """(B, 1) int32 ids that no query of the row carries: one below the smallest."""
    low, high = jnp.min(q_ids, axis=1, keepdims=True), jnp.max(q_ids, axis=1, keepdims=True)
    return jnp.where(low > jnp.iinfo(jnp.int32).min, low - 1, high + 1)


def splash_attention(query: Array, key: Array, value: Array, *, mask: Array | None = None,
                     causal: bool = False, scale: float | None = None,
                     pattern: AttentionPattern | None = None,
                     segment_ids: tuple[Array, Array] | None = None, interpret: bool = False,
                     device: str | None = None, blocks: SplashBlocks | None = None) -> Array:
    """Exact attention by JAX's splash kernel, conventions of ``dot_product_attention``.

    Args:
      query (B, T, N, H), key (B, S, K, H), value (B, S, K, Hv); N a multiple of K.
      mask: a key-padding mask broadcastable to (B, 1, 1, S), 1 = may attend; None.
      causal: query i sees keys j <= i (top-left aligned).
      pattern: a window ``AttentionPattern`` (splash's ``LocalMask``); no other kind.
      segment_ids: (q (B, T), kv (B, S)) int32 (``masks.segment_ids_pair``).
      interpret: run the kernels as XLA loops (off a TPU; slow, for tests).
      device: ``SPLASH_BLOCKS``'s row (default ``tpu_name()``); blocks: overrides it.

    Returns: (B, T, N, Hv) in value's dtype.
    """
    b, t, s, n, kh, h = check_qkv(query, key, value)
    mask = check_broadcast(mask, "mask", (b, n, t, s))
    problems = splash_problems(mask=mask_kind(mask), pattern=pattern)
    if problems:
        raise UserError("splash attention cannot express " + "; ".join(problems)
                        + "; use attention_impl='auto' or 'pallas' (our kernel takes them)")
    blocks = blocks or SPLASH_BLOCKS[device or tpu_name()]
    bq, tp = _fit(blocks.block_q, t)
    bkv, sp = _fit(blocks.block_kv, s)
    scale = 1.0 / math.sqrt(h) if scale is None else float(scale)
    dtype = jnp.result_type(query, key, value)
    if jnp.dtype(dtype).itemsize < 4 and jax.config.jax_default_matmul_precision not in (
            None, "default", "fastest", "bfloat16", "DEFAULT"):
        # splash's dots take the default precision, which Mosaic refuses for bf16/fp16 tiles
        # at more than one pass ("highest", as the parity tests set it): run them in fp32
        dtype = jnp.float32

    q_ids, kv_ids = segment_ids if segment_ids is not None else (None, None)
    if segment_ids is not None or mask is not None or (tp, sp) != (t, s):
        q_ids = jnp.zeros((b, t), jnp.int32) if q_ids is None else q_ids
        kv_ids = jnp.zeros((b, s), jnp.int32) if kv_ids is None else kv_ids
        pad = _padding_id(q_ids)
        if mask is not None:
            valid = jnp.broadcast_to(mask.reshape(mask.shape[0], -1).astype(bool),
                                     (b, s))
            kv_ids = jnp.where(valid, kv_ids, pad)
        q_ids = pad_axis(q_ids, 1, tp, keep_broadcast=False)          # cut off afterwards
        kv_ids = jnp.concatenate([kv_ids, jnp.broadcast_to(pad, (b, sp - s))], axis=1)

    # (B, T, N, H) -> (B, N, Tp, H): the kernel's per-example layout, heads first
    q = pad_axis((query.astype(jnp.float32) * scale).astype(dtype).transpose(0, 2, 1, 3), 2,
                 tp, keep_broadcast=False)
    k = pad_axis(key.astype(dtype).transpose(0, 2, 1, 3), 2, sp, keep_broadcast=False)
    v = pad_axis(value.astype(dtype).transpose(0, 2, 1, 3), 2, sp, keep_broadcast=False)
    window = pattern.size if pattern is not None else None
    kernel = _kernel(n, tp, sp, causal, window, bq, bkv, min(blocks.block_kv_compute, bkv),
                     interpret)
    if q_ids is None:
        out = jax.vmap(lambda q, k, v: kernel(q, k, v))(q, k, v)
    else:
        out = jax.vmap(lambda q, k, v, qi, ki: kernel(q, k, v, segment_ids=splash.SegmentIds(
            qi, ki)))(q, k, v, q_ids, kv_ids)
    out = out[:, :, :t].transpose(0, 2, 1, 3).astype(value.dtype)
    if mask is not None or segment_ids is not None:
        seen = combine_masks(mask, None if segment_ids is None else segment_mask(*segment_ids))
        out = fill_empty_rows(out, value, seen, t, s, causal, pattern)
    return out
