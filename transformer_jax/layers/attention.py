"""Scaled dot-product attention (pure functions) and the MultiHeadAttention module.

``dot_product_attention`` computes ``softmax(Q K^T * scale + bias) V`` with the seeds' mask
convention (1/True = may attend); shapes and conventions in ``attention_base.py``. Logits
and softmax are always fp32, also under bf16.

One signature, several implementations (``implementation=``):
  * ``"xla"``     the plain reference (below, first): materialises the (B, N, T, S)
                  weights (causal attention in query blocks that skip the keys past the
                  diagonal); supports everything (dropout, returned weights).
  * ``"chunked"`` memory-efficient exact attention in plain XLA (``chunked_attention.py``):
                  blocks with an online softmax, memory linear in T and S; dropout, no
                  returned weights.
  * ``"pallas"``  the same algorithm as Pallas kernels (``flash_attention.py``): Mosaic on
                  TPU, Triton on GPU, interpret mode (slow, for tests) on the CPU.
  * ``"jax"``     ``jax.nn.dot_product_attention``: cuDNN flash attention on a GPU when
                  cuDNN can run the call, XLA's path otherwise.
  * ``"cudnn"``   the same, but insists on cuDNN: a ValueError lists what prevents it.
  * ``"auto"``    (the default) chosen when the function is lowered, per platform, by
                  :func:`resolve_implementation`: the Pallas kernel on TPU v4 and later
                  (XLA's paths on v2/v3, where Mosaic cannot compile it), cuDNN on a GPU
                  where it can run the call (else the Pallas kernel), the reference on the
                  CPU (``"chunked"`` beyond 4,096 x 4,096 logits per head). Calls the
                  kernels cannot serve (dropout, returned weights, one query row of a
                  KV-cache decode step) take the reference everywhere.

Under a mesh (``jax.set_mesh`` with flax's logical-axis rules, as ``sharding.use_mesh``
sets them) the kernels run inside ``shard_map`` over the batch axes and the head axis, so
each device attends over its own rows and heads and nothing is gathered.
"""
from __future__ import annotations

import math
from typing import Any

import jax

from ..errors import UserError
from .attention_base import check_broadcast, check_qkv
from .attention_dispatch import (IMPLEMENTATIONS, _attend, _auto_attention, _Call, _linear,
                                 _mesh_specs, _per_platform, cudnn_problems,
                                 resolve_implementation)
from .attention_reference import xla_attention
from .chunked_attention import chunked_attention, default_chunk
from .masks import AttentionPattern, combine_masks

Array = jax.Array

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
    implementation: str = "auto",
    precision: Any = None,
    q_chunk: int | None = None,
    kv_chunk: int | None = None,
    cpu_tuning: bool = True,
    pattern: AttentionPattern | None = None,
):
    """``softmax(Q K^T * scale + bias, masked) V`` for every head.

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
      implementation: one of ``IMPLEMENTATIONS`` (module docstring).
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

    ``implementation="linear"`` is not softmax attention: it is linear attention
    (``linear_attention.py``, Katharopoulos et al. 2020: feature map elu + 1, O(T)), which
    takes key-padding masks only and no bias, scale, dropout or pattern.

    Returns:
      (B, T, N, Hv) in value's dtype, or ``(out, weights)`` when ``return_weights``.
    """
    b, t, s, n, _, h = check_qkv(query, key, value)
    if implementation not in IMPLEMENTATIONS:
        raise UserError(f"unknown attention implementation {implementation!r}; "
                        f"choose one of {IMPLEMENTATIONS}")
    shape = (b, n, t, s)
    mask = check_broadcast(mask, "mask", shape)
    bias = check_broadcast(bias, "bias", shape)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    dropout = not deterministic and dropout_rate > 0.0
    if dropout and dropout_rng is None:
        raise UserError("attention dropout is on (deterministic=False, dropout_rate>0) "
                        "but no dropout_rng was given")
    rng = dropout_rng if dropout else None

    if implementation == "linear":
        return _linear(query, key, value, mask, bias, causal, dropout, return_weights, pattern,
                       precision, q_chunk)
    if implementation == "auto" and (dropout or return_weights or t == 1):
        implementation = "xla"
    if implementation == "xla":
        if pattern is not None:
            mask = combine_masks(mask, pattern.mask(t, s, causal=False))
        out, weights = xla_attention(query, key, value, mask, bias, scale, causal, dropout_rate,
                                     rng, precision, return_weights, q_chunk, cpu_tuning)
        return (out, weights) if return_weights else out
    if return_weights:
        raise UserError(f"return_weights=True needs implementation='xla' or 'auto' (the "
                        f"{implementation!r} path never materialises the weights)")
    if implementation == "chunked":
        return chunked_attention(query, key, value, mask, bias, scale, causal, dropout_rate,
                                 rng, deterministic, precision, q_chunk or default_chunk(pattern),
                                 kv_chunk or default_chunk(pattern),
                                 pattern=pattern)
    if dropout:
        raise UserError(f"implementation={implementation!r} has no attention dropout; "
                        "use implementation='auto', 'xla' or 'chunked', or dropout_rate=0")
    if implementation == "auto":
        return _auto_attention(query, key, value, mask, bias, scale, causal, precision,
                               q_chunk, kv_chunk, cpu_tuning, pattern)
    settings = dict(scale=float(scale), causal=causal, precision=precision, cpu_tuning=cpu_tuning,
                    pattern=pattern)
    if implementation == "pallas":
        # one source for every platform: Mosaic, Triton or interpret mode, chosen at lowering
        choose = lambda platform, generation: resolve_implementation(  # noqa: E731
            "pallas", platform, tpu_generation=generation if platform == "tpu" else None)
        return _per_platform(query, key, value, mask, bias, choose, kernel_chunks=True,
                             q_chunk=q_chunk, kv_chunk=kv_chunk, **settings)
    problems = cudnn_problems(query, key, value)
    if jax.default_backend() != "gpu":
        problems.insert(0, f"it needs a GPU (the backend is {jax.default_backend()!r})")
    if implementation == "cudnn" and problems:
        raise UserError("implementation='cudnn' cannot run: " + "; ".join(problems)
                        + ". Use implementation='auto' (cuDNN where possible), 'jax', "
                        "'pallas', 'chunked' or 'xla'")
    call = _Call(implementation="cudnn" if not problems else "jax", platform="gpu",
                 mesh_specs=_mesh_specs(query, key, mask, bias), q_chunk=None, kv_chunk=None,
                 **settings)
    return _attend(query, key, value, mask, bias, call=call)
