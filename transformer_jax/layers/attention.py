"""Scaled dot-product attention: ``dot_product_attention``, the one entry point.

``dot_product_attention`` computes ``softmax(Q K^T * scale + bias) V`` with the PyTorch
tutorial's mask convention (1/True = may attend); shapes and conventions in
``attention_base.py``. Logits and softmax are always fp32, also under bf16.

Two kinds of attention (``attention=``): ``"softmax"`` (the default, exact) and
``"linear"`` (``linear_attention.py``, Katharopoulos et al. 2020: feature map elu + 1,
O(T); key-padding masks only, no bias, dropout, returned weights or pattern).

Softmax attention has several implementations (``attention_impl=``, one of
``attention_dispatch.IMPLEMENTATIONS``):
  * ``"xla"``     the plain reference (``attention_reference.py``): materialises the
                  (B, N, T, S) weights (causal attention in query blocks that skip the keys
                  past the diagonal); supports everything (dropout, returned weights).
  * ``"chunked"`` memory-efficient exact attention in plain XLA (``chunked_attention.py``):
                  blocks with an online softmax, memory linear in T and S; dropout, no
                  returned weights.
  * ``"pallas"``  the same algorithm as Pallas kernels (``flash_attention.py``): Mosaic on
                  TPU, Triton on GPU, interpret mode (slow, for tests) on the CPU.
  * ``"splash"``  JAX's splash kernel, MaxText's TPU attention (``splash_attention.py``):
                  causal/bidirectional, a window, segment ids and key padding (B, 1, 1, S);
                  no bias, no other mask or pattern (a UserError says so). Mosaic on TPU,
                  interpret mode on the CPU, a UserError on a GPU.
  * ``"jax"``     ``jax.nn.dot_product_attention``: cuDNN flash attention on a GPU when
                  cuDNN can run the call, XLA's path otherwise.
  * ``"cudnn"``   the same, but insists on cuDNN: a ValueError lists what prevents it.
  * ``"auto"``    (the default) chosen when the function is lowered, per platform, by
                  ``attention_dispatch.resolve_implementation``: on TPU v4 and later splash
                  for every call it expresses, else the Pallas kernel (e.g. T5's relative
                  bias); XLA's paths on v2/v3, where Mosaic cannot compile them; cuDNN on
                  a GPU where it can run the call (else the Pallas kernel), the reference
                  on the CPU (``"chunked"`` beyond 4,096 x 4,096 logits per head). Calls
                  the kernels cannot serve (dropout, returned weights, one query row of a
                  KV-cache decode step) take the reference everywhere.

A model forced onto ``"splash"`` or ``"pallas"`` trains and evaluates its loss with that
kernel and decodes with a KV cache (generation, the samples at eval) by the decode path's
own choice, ``"auto"`` (``attention_dispatch.decode_implementation``, applied by
``multi_head.MultiHeadAttention``): splash cannot express the cache's mask, and neither
kernel is made for a step's one query row.

The route: the kind first (linear attention here), then the reference and chunked paths
here; the kernels ("auto", "pallas", "splash", "jax", "cudnn") in ``attention_dispatch.py``. Under a
mesh (``jax.set_mesh`` with flax's logical-axis rules, as ``sharding.use_mesh`` sets them)
the kernels run inside ``shard_map`` over the batch axes and the head axis, so each
device attends over its own rows and heads and nothing is gathered.
"""
from __future__ import annotations

import math
from typing import Any

import jax

from ..errors import UserError
from .attention_base import check_broadcast, check_qkv
from .attention_dispatch import check_attention_impl, kernel_attention
from .attention_reference import xla_attention
from .chunked_attention import chunked_attention, default_chunk
from .linear_attention import DEFAULT_CHUNK, linear_attention
from .masks import AttentionPattern, combine_masks, segment_ids_pair, segment_mask

Array = jax.Array

ATTENTION_KINDS = ("softmax", "linear")


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    mask: Array | None = None,
    bias: Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: Array | None = None,
    deterministic: bool = True,
    return_weights: bool = False,
    attention: str = "softmax",
    attention_impl: str = "auto",
    precision: Any = None,
    q_chunk: int | None = None,
    kv_chunk: int | None = None,
    cpu_tuning: bool = True,
    pattern: AttentionPattern | None = None,
    segment_ids: Array | tuple[Array, Array] | None = None,
):
    """``softmax(Q K^T * scale + bias, masked) V`` for every head (``attention="linear"``:
    linear attention instead, module docstring).

    Args:
      query: (B, T, N, H).  key: (B, S, K, H).  value: (B, S, K, Hv).  N must be a multiple
        of K (grouped-query attention; K = N is ordinary multi-head attention).
      mask: bool/int, broadcastable to (B, N, T, S) (2-D (T, S) and 3-D (B, T, S) are
        accepted); 1 = may attend.
      bias: float, broadcastable to (B, N, T, S), added to the logits (e.g. T5's relative
        position bias or an ALiBi table).
      causal: also apply a causal mask aligned at the top-left (query i sees keys j <= i).
      scale: defaults to 1/sqrt(H).
      dropout_rate, dropout_rng, deterministic: dropout on the attention weights.
      return_weights: also return the (B, N, T, S) fp32 weights (the reference computes them).
      attention: ``"softmax"`` or ``"linear"`` (``ATTENTION_KINDS``; module docstring).
      attention_impl: the softmax implementation, one of
        ``attention_dispatch.IMPLEMENTATIONS`` (module docstring).
      q_chunk, kv_chunk: query/key block sizes of ``"chunked"`` (default 512; with a pattern,
        ``chunked_attention.default_chunk``) and of
        ``"pallas"`` (powers of two; default per platform, ``flash_attention.BlockSizes``);
        ``q_chunk`` is also the chunk of causal ``"linear"`` attention (default 64) and
        the query block of causal ``"xla"`` attention (default 64, or
        T / 8 beyond T = 512; a value >= T computes the whole (T, S) square). Under
        ``"auto"`` they reach the reference and chunked paths; the kernels keep their own.
      cpu_tuning: the reference's XLA:CPU derivative layouts (``cpu_tuning.py``).
      pattern: a sliding window or a strided/fixed sparse pattern
        (``masks.AttentionPattern``; self-attention, query i and key i the same token),
        ANDed with the mask and causality. ``"xla"`` applies it as a mask; ``"chunked"``
        and ``"pallas"`` skip the key blocks it excludes (a window: O(T W) time and
        memory); ``"jax"``/``"cudnn"`` pass a window as ``local_window_size``.
      segment_ids: packed documents: a (B, T) int array for self-attention, or a pair
        (queries (B, T), keys (B, S)); query i sees key j only when their ids are equal
        (ANDed with the mask, causality and the pattern). Every softmax path takes them.

    Returns:
      (B, T, N, Hv) in value's dtype, or ``(out, weights)`` when ``return_weights``.
    """
    b, t, s, n, _, h = check_qkv(query, key, value)
    if attention not in ATTENTION_KINDS:
        raise UserError(f"unknown attention {attention!r}; choose one of {ATTENTION_KINDS}")
    check_attention_impl(attention_impl)
    shape = (b, n, t, s)
    mask = check_broadcast(mask, "mask", shape)
    bias = check_broadcast(bias, "bias", shape)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    dropout = not deterministic and dropout_rate > 0.0
    if dropout and dropout_rng is None:
        raise UserError("attention dropout is on (deterministic=False, dropout_rate>0) "
                        "but no dropout_rng was given")
    rng = dropout_rng if dropout else None
    segments = segment_ids_pair(segment_ids, t, s)

    if attention == "linear":
        if segments is not None:
            raise UserError("attention='linear' (linear attention) has no segment_ids: its "
                            "running sums mix every earlier token; use attention='softmax' "
                            "for packed documents")
        return _linear(query, key, value, mask, bias, causal, dropout, return_weights, pattern,
                       precision, q_chunk)
    if attention_impl == "auto" and (dropout or return_weights or t == 1):
        attention_impl = "xla"
    if attention_impl == "xla":
        if pattern is not None:
            mask = combine_masks(mask, pattern.mask(t, s, causal=False))
        if segments is not None:
            mask = combine_masks(mask, segment_mask(*segments))
        out, weights = xla_attention(query, key, value, mask, bias, scale, causal, dropout_rate,
                                     rng, precision, return_weights, q_chunk, cpu_tuning)
        return (out, weights) if return_weights else out
    if return_weights:
        raise UserError(f"return_weights=True needs attention_impl='xla' or 'auto' (the "
                        f"{attention_impl!r} path never materialises the weights)")
    if attention_impl == "chunked":
        return chunked_attention(query, key, value, mask, bias, scale, causal, dropout_rate,
                                 rng, deterministic, precision, q_chunk or default_chunk(pattern),
                                 kv_chunk or default_chunk(pattern),
                                 pattern=pattern, segment_ids=segments)
    if dropout:
        raise UserError(f"attention_impl={attention_impl!r} has no attention dropout; "
                        "use attention_impl='auto', 'xla' or 'chunked', or dropout_rate=0")
    return kernel_attention(query, key, value, mask, bias, attention_impl=attention_impl,
                            scale=scale, causal=causal, precision=precision, q_chunk=q_chunk,
                            kv_chunk=kv_chunk, cpu_tuning=cpu_tuning, pattern=pattern,
                            segment_ids=segments)


def _linear(q, k, v, mask, bias, causal, dropout, return_weights, pattern, precision, chunk):
    """``attention="linear"``: what linear attention cannot take, refused by name; ``chunk``
    (``q_chunk``) is the causal scan's chunk."""
    refused = [name for name, present in (("a bias", bias is not None), ("dropout", dropout),
                                          ("returned weights", return_weights),
                                          ("a window/sparse pattern", pattern is not None))
               if present]
    if refused:
        raise UserError(f"attention='linear' (linear attention) has no {', '.join(refused)}: "
                        "it never forms the (T, S) weights; use attention='softmax' for them")
    return linear_attention(q, k, v, mask=mask, causal=causal, precision=precision,
                            chunk=chunk or DEFAULT_CHUNK)
