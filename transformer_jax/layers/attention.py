"""Scaled dot-product attention (pure functions) and the MultiHeadAttention module.

Shape legend (used in every einsum of the library):
  B batch, T query length, S key length, D model width, N query heads,
  K key/value heads (grouped-query attention: N = K * G), G query heads per kv head,
  H head dim.

``dot_product_attention`` computes ``softmax(Q K^T / sqrt(H) + bias) V`` with the seeds'
mask convention (1/True = may attend). Blocked logits are set to the most negative fp32
number rather than -inf, so a row whose keys are all blocked gives the mean of V instead
of NaN (PyTorch gives NaN there). Logits and softmax are always fp32, also under bf16.

One signature, several implementations (``implementation=``):
  * ``"xla"``     the plain reference: materialises the (B, N, T, S) weights; supports
                  everything (dropout, returned weights).
  * ``"jax"``     ``jax.nn.dot_product_attention``: cuDNN flash attention on GPU for
                  fp16/bf16 inputs, XLA elsewhere. No dropout and no returned weights.
  * ``"cudnn"``   the same, but insists on cuDNN (errors off GPU).
  * ``"chunked"`` memory-efficient exact attention: queries in blocks, keys scanned in
                  blocks with an online softmax, each query block rematerialised in the
                  backward pass; memory grows linearly with S. Supports dropout (an
                  independent stream per block), not returned weights.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from .dense import Dense, Initializer, canonical_dtype, default_kernel_init
from .embeddings import apply_rope
from .masks import as_4d, causal_mask, combine_masks

Array = jax.Array

IMPLEMENTATIONS = ("xla", "jax", "cudnn", "chunked")
_NEG = float(jnp.finfo(jnp.float32).min)


# ----------------------------------------------------------------------------- checks

def _check_qkv(q: Array, k: Array, v: Array) -> tuple[int, int, int, int, int, int]:
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (B, T|S, N|K, H); got shape {x.shape}")
    b, t, n, h = q.shape
    _, s, kh, hk = k.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: query {q.shape}, key {k.shape}, value {v.shape}")
    if hk != h:
        raise ValueError(f"query head dim {h} != key head dim {hk} (query {q.shape}, key {k.shape}); "
                         "queries and keys must share the head dim")
    if v.shape[1] != s or v.shape[2] != kh:
        raise ValueError(f"key {k.shape} and value {v.shape} must agree on (B, S, K)")
    if n % kh:
        raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh} "
                         "(grouped-query attention)")
    return b, t, s, n, kh, h


def _check_broadcast(x: Array | None, name: str, shape: tuple[int, int, int, int]) -> Array | None:
    """Lift a 2/3/4-D mask or bias to 4-D and check it broadcasts to (B, N, T, S)."""
    if x is None:
        return None
    x = as_4d(x, name)
    if any(d not in (1, want) for d, want in zip(x.shape, shape)):
        raise ValueError(f"{name} of shape {x.shape} does not broadcast to the attention "
                         f"logits (B, N, T, S) = {shape}")
    return x


def _group_heads(x: Array, k_heads: int, groups: int) -> Array:
    """(b, n|1, T, S) -> (b, K|1, G|1, T, S) with head n = k * G + g (HF's repeat_kv order)."""
    if x.shape[1] == 1:
        return x[:, :, None]
    return x.reshape(x.shape[0], k_heads, groups, *x.shape[2:])


# ----------------------------------------------------------------------------- reference

def _xla_attention(q, k, v, mask, bias, scale, dropout_rate, dropout_rng, deterministic,
                   precision):
    b, t, s, n, kh, h = _check_qkv(q, k, v)
    g = n // kh
    qg = q.reshape(b, t, kh, g, h)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k, precision=precision,
                        preferred_element_type=jnp.float32) * scale
    if bias is not None:
        logits = logits + _group_heads(bias, kh, g).astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(_group_heads(mask, kh, g), logits, _NEG)
    weights = jax.nn.softmax(logits, axis=-1)                                  # (B, K, G, T, S) fp32
    if not deterministic and dropout_rate > 0.0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights.astype(v.dtype), v, precision=precision,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, v.shape[-1]).astype(v.dtype), weights.reshape(b, n, t, s)


# ----------------------------------------------------------------------------- chunked

def _pad_axis(x: Array, axis: int, size: int, value) -> Array:
    extra = size - x.shape[axis]
    if extra == 0 or x.shape[axis] == 1:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def _block(x: Array | None, axis: int, start, size: int) -> Array | None:
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _chunked_attention(q, k, v, mask, bias, scale, causal, dropout_rate, dropout_rng,
                       deterministic, precision, q_chunk, kv_chunk):
    b, t, s, n, kh, h = _check_qkv(q, k, v)
    g, hv = n // kh, v.shape[-1]
    qc, kc = min(q_chunk, t), min(kv_chunk, s)
    tp, sp = -(-t // qc) * qc, -(-s // kc) * kc
    nq, nk = tp // qc, sp // kc
    q_blocks = _pad_axis(q, 1, tp, 0).reshape(b, nq, qc, kh, g, h).swapaxes(0, 1)
    k_blocks = _pad_axis(k, 1, sp, 0).reshape(b, nk, kc, kh, h).swapaxes(0, 1)
    v_blocks = _pad_axis(v, 1, sp, 0).reshape(b, nk, kc, kh, hv).swapaxes(0, 1)
    if mask is not None:
        mask = _pad_axis(_pad_axis(mask, 3, sp, False), 2, tp, True)
    if bias is not None:
        bias = _pad_axis(_pad_axis(bias, 3, sp, 0), 2, tp, 0)
    use_dropout = (not deterministic) and dropout_rate > 0.0

    def query_block(qi, q_blk):                       # q_blk: (B, qc, K, G, H)
        q_pos = qi * qc + jnp.arange(qc)

        def key_step(carry, ki):
            acc, m, l = carry                         # (B,K,G,qc,Hv), (B,K,G,qc), (B,K,G,qc)
            k_pos = ki * kc + jnp.arange(kc)
            logits = jnp.einsum("BQKGH,BCKH->BKGQC", q_blk, k_blocks[ki], precision=precision,
                                preferred_element_type=jnp.float32) * scale
            if bias is not None:
                blk = _block(_block(bias, 2, qi * qc, qc), 3, ki * kc, kc)
                logits = logits + _group_heads(blk, kh, g).astype(jnp.float32)
            in_range = k_pos < s                      # padded keys never count, even in
            allowed = in_range[None, :]               # rows whose real keys are all masked
            if causal:
                allowed = allowed & (k_pos[None, :] <= q_pos[:, None])
            allowed = allowed[None, None, None]
            if mask is not None:
                blk = _block(_block(mask, 2, qi * qc, qc), 3, ki * kc, kc)
                allowed = allowed & _group_heads(blk, kh, g)
            logits = jnp.where(allowed, logits, _NEG)
            m_new = jax.lax.stop_gradient(jnp.maximum(m, logits.max(axis=-1)))
            p = jnp.where(in_range, jnp.exp(logits - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(axis=-1)
            if use_dropout:
                rng = jax.random.fold_in(jax.random.fold_in(dropout_rng, qi), ki)
                keep = jax.random.bernoulli(rng, 1.0 - dropout_rate, p.shape)
                p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
            pv = jnp.einsum("BKGQC,BCKH->BKGQH", p.astype(v.dtype), v_blocks[ki],
                            precision=precision, preferred_element_type=jnp.float32)
            return (acc * correction[..., None] + pv, m_new, l), None

        init = (jnp.zeros((b, kh, g, qc, hv), jnp.float32),
                jnp.full((b, kh, g, qc), _NEG, jnp.float32),
                jnp.zeros((b, kh, g, qc), jnp.float32))
        (acc, _, l), _ = jax.lax.scan(key_step, init, jnp.arange(nk))
        out = acc / l[..., None]                                    # (B, K, G, qc, Hv)
        return out.transpose(0, 3, 1, 2, 4).reshape(b, qc, n, hv)

    body = jax.checkpoint(lambda args: query_block(*args))
    out = jax.lax.map(body, (jnp.arange(nq), q_blocks))             # (nq, B, qc, N, Hv)
    return out.swapaxes(0, 1).reshape(b, tp, n, hv)[:, :t].astype(v.dtype)


# ----------------------------------------------------------------------------- public

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
    implementation: str = "xla",
    precision: Any = None,
    q_chunk: int = 512,
    kv_chunk: int = 512,
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
      return_weights: also return the (B, N, T, S) fp32 weights (``"xla"`` only).
      implementation: one of ``IMPLEMENTATIONS`` (module docstring).
      q_chunk, kv_chunk: block sizes of ``"chunked"``.

    Returns:
      (B, T, N, Hv) in value's dtype, or ``(out, weights)`` when ``return_weights``.
    """
    b, t, s, n, _, h = _check_qkv(query, key, value)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; "
                         f"choose one of {IMPLEMENTATIONS}")
    shape = (b, n, t, s)
    mask = _check_broadcast(mask, "mask", shape)
    bias = _check_broadcast(bias, "bias", shape)
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    if not deterministic and dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("attention dropout is on (deterministic=False, dropout_rate>0) "
                         "but no dropout_rng was given")

    if implementation == "xla":
        if causal:
            mask = combine_masks(mask, causal_mask(t, s))
        out, weights = _xla_attention(query, key, value, mask, bias, scale, dropout_rate,
                                      dropout_rng, deterministic, precision)
        return (out, weights) if return_weights else out

    if return_weights:
        raise ValueError(f"return_weights=True needs implementation='xla' (the {implementation!r} "
                         "path never materialises the weights)")
    if implementation == "chunked":
        return _chunked_attention(query, key, value, mask, bias, scale, causal, dropout_rate,
                                  dropout_rng, deterministic, precision, q_chunk, kv_chunk)

    # "jax" / "cudnn": jax.nn.dot_product_attention
    if not deterministic and dropout_rate > 0.0:
        raise ValueError(f"implementation={implementation!r} has no attention dropout; "
                         "use implementation='xla' or 'chunked', or dropout_rate=0")
    impl = None
    if implementation == "cudnn" or (jax.default_backend() == "gpu"
                                     and query.dtype in (jnp.float16, jnp.bfloat16)):
        impl = "cudnn"
    return jax.nn.dot_product_attention(
        query, key, value, bias=bias, mask=None if mask is None else mask.astype(bool),
        scale=scale, is_causal=causal, implementation=impl)


# ----------------------------------------------------------------------------- module

class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention owning the Q/K/V/O projections.

    Self-attention when ``inputs_kv`` is None, cross-attention otherwise; ``inputs_v``
    optionally feeds the value projection from a separate tensor (PyTorch's distinct
    ``key``/``value`` arguments; it defaults to ``inputs_kv``). Parameters:
      query (D, N, H), key (Dkv, K, H), value (Dkv, K, H), out (N, H, D) kernels, each with
      a bias when ``use_bias``; logical axes ('embed', 'heads'|'kv_heads', 'head_dim').

    KV cache (``decode=True``, self-attention only): a ``cache`` collection holds
    ``cached_key``/``cached_value`` of shape (B, S_max, K, H) and ``cache_index``. Initialise
    it by calling ``init`` with ``decode=True`` on inputs of the full length S_max; each
    later call appends its T new positions and attends over the filled cache. With
    ``causal=True`` query i (absolute position index + i) sees cached keys <= its position.
    """
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    implementation: str = "xla"
    rope_base: float | None = None
    rope_interleaved: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    out_kernel_init: Initializer | None = None
    bias_init: Initializer = nn.initializers.zeros_init()
    precision: Any = None

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_kv: Array | None = None, *,
                 inputs_v: Array | None = None,
                 mask: Array | None = None, bias: Array | None = None, causal: bool = False,
                 positions: Array | None = None, deterministic: bool = True,
                 decode: bool = False, return_weights: bool = False):
        """inputs_q (B, T, D), inputs_kv (B, S, Dkv) [, inputs_v (B, S, Dv)] -> (B, T, D)
        [, weights (B, N, T, S)]."""
        self_attention = inputs_kv is None
        if self_attention and inputs_v is not None:
            raise ValueError(f"{self.name}: inputs_v needs inputs_kv (separate values are a "
                             "cross-attention feature)")
        inputs_kv = inputs_q if self_attention else inputs_kv
        inputs_v = inputs_kv if inputs_v is None else inputs_v
        if inputs_q.ndim != 3 or inputs_kv.ndim != 3 or inputs_v.ndim != 3:
            raise ValueError(f"{self.name}: inputs must be (B, T, D); got query {inputs_q.shape}, "
                             f"key {inputs_kv.shape}, value {inputs_v.shape}")
        if inputs_v.shape[:2] != inputs_kv.shape[:2]:
            raise ValueError(f"{self.name}: key {inputs_kv.shape} and value {inputs_v.shape} "
                             "inputs must agree on (B, S)")
        d = inputs_q.shape[-1]
        n = self.num_heads
        kh = self.num_kv_heads or n
        if self.head_dim is None and d % n:
            raise ValueError(f"{self.name}: d_model={d} is not divisible by num_heads={n}; "
                             "pick a divisor or set head_dim explicitly")
        h = self.head_dim or d // n
        if n % kh:
            raise ValueError(f"{self.name}: num_heads={n} must be a multiple of num_kv_heads={kh}")

        def proj(heads, axes, name):
            return Dense((heads, h), use_bias=self.use_bias, kernel_axes=axes, dtype=self.dtype,
                         param_dtype=self.param_dtype, kernel_init=self.kernel_init,
                         bias_init=self.bias_init, precision=self.precision, name=name)

        q = proj(n, ("embed", "heads", "head_dim"), "query")(inputs_q)          # (B, T, N, H)
        k = proj(kh, ("embed", "kv_heads", "head_dim"), "key")(inputs_kv)       # (B, S, K, H)
        v = proj(kh, ("embed", "kv_heads", "head_dim"), "value")(inputs_v)      # (B, S, K, H)

        rope = self.rope_base is not None and self_attention
        if decode and self_attention:
            cached = self.has_variable("cache", "cached_key")
            cached_key = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
            cached_value = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
            cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
            if cached:
                idx = cache_index.value
                t = q.shape[1]
                if rope:
                    pos = idx + jnp.arange(t) if positions is None else positions
                    q = apply_rope(q, pos, base=self.rope_base, interleaved=self.rope_interleaved)
                    k = apply_rope(k, pos, base=self.rope_base, interleaved=self.rope_interleaved)
                    rope = False  # done: cached keys are stored rotated
                k = jax.lax.dynamic_update_slice(cached_key.value, k.astype(cached_key.value.dtype),
                                                 (0, idx, 0, 0))
                v = jax.lax.dynamic_update_slice(cached_value.value, v.astype(cached_value.value.dtype),
                                                 (0, idx, 0, 0))
                cached_key.value, cached_value.value = k, v
                cache_index.value = idx + t
                s_max = k.shape[1]
                if causal:
                    filled = causal_mask(t, s_max, offset=idx)
                else:
                    filled = (jnp.arange(s_max) < idx + t)[None, None, None, :]
                if mask is not None:
                    mask = _check_broadcast(mask, "mask", (q.shape[0], n, t, s_max))
                mask = combine_masks(mask, filled)
                causal = False
        if rope:
            pos = jnp.arange(q.shape[1]) if positions is None else positions
            q = apply_rope(q, pos, base=self.rope_base, interleaved=self.rope_interleaved)
            k = apply_rope(k, pos, base=self.rope_base, interleaved=self.rope_interleaved)

        dropout_rng = None
        if not deterministic and self.dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        result = dot_product_attention(
            q, k, v, mask=mask, bias=bias, causal=causal, dropout_rate=self.dropout_rate,
            dropout_rng=dropout_rng, deterministic=deterministic, return_weights=return_weights,
            implementation=self.implementation, precision=self.precision)
        out, weights = result if return_weights else (result, None)
        out = nn.with_logical_constraint(out, ("act_batch", "act_length", "act_heads", "act_head_dim"))
        y = Dense(self.out_features or d, in_axes=2, use_bias=self.use_bias,
                  kernel_axes=("heads", "head_dim", "embed"), dtype=self.dtype,
                  param_dtype=self.param_dtype, kernel_init=self.out_kernel_init or self.kernel_init,
                  bias_init=self.bias_init, precision=self.precision, name="out")(out)
        return (y, weights) if return_weights else y
