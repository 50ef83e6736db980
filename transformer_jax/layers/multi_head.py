"""``MultiHeadAttention``: the Q/K/V/O projections, the KV caches and prefix tuning around
``attention.dot_product_attention``.

The three decode caches are pure functions (arrays in, arrays out; the module only reads
and writes its ``cache`` variables): ``self_cache_update`` (the self-attention KV cache),
``ring_cache_update`` (the ring of W slots of a sliding window) and
``linear_cache_update`` (linear attention's recurrent state).
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from .attention import dot_product_attention
from .attention_base import check_broadcast
from .attention_dispatch import decode_implementation
from .dense import Dense, Initializer, default_kernel_init
from .embeddings import RopeScaling, apply_rope
from .linear_attention import linear_attention_step
from .masks import AttentionPattern, causal_mask, combine_masks
from .norms import make_norm

Array = jax.Array


def _heads_first(x: Array) -> Array:
    """(B, S, K, H) <-> (B, K, S, H)."""
    return jnp.swapaxes(x, 1, 2)


def self_cache_update(cached_key: Array, cached_value: Array, index: Array, k: Array,
                      v: Array, *, causal: bool, pattern: AttentionPattern | None = None):
    """The self-attention KV cache after writing the T new positions index .. index+T-1.

    ``cached_key``/``cached_value`` (B, K, S_max, H) hold the positions before ``index``;
    k, v (B, T, K, H) are the new ones. Returns the new cache (B, K, S_max, H) twice, its
    keys and values as (B, S_max, K, H) views, and the bool mask (1, 1, T, S_max) of what
    the new queries see: the filled positions (with ``causal``, query i at index + i sees
    keys <= its position), ANDed with ``pattern``.
    """
    t, s_max = k.shape[1], cached_key.shape[2]
    ck = jax.lax.dynamic_update_slice(cached_key, _heads_first(k).astype(cached_key.dtype),
                                      (0, 0, index, 0))
    cv = jax.lax.dynamic_update_slice(cached_value, _heads_first(v).astype(cached_value.dtype),
                                      (0, 0, index, 0))
    filled = (causal_mask(t, s_max, offset=index) if causal
              else (jnp.arange(s_max) < index + t)[None, None, None, :])
    if pattern is not None:
        filled = filled & pattern.mask(t, s_max, causal=False, offset=index)
    return ck, cv, _heads_first(ck), _heads_first(cv), filled


def ring_cache_update(cached_key: Array, cached_value: Array, index: Array, k: Array, v: Array,
                      mask: Array | None = None):
    """Sliding-window decoding over a ring of W slots (slot = position mod W; causal).

    ``cached_key``/``cached_value`` (B, K, W, H): slot j holds the latest position
    p < ``index`` with p = j mod W. The T new positions index .. index+T-1 (k, v
    (B, T, K, H)) attend over the ring and over themselves. ``mask`` is in absolute
    positions, (B|1, 1, 1|T, S_max), as for the full cache. Returns the new ring (the
    newest W positions written into their slots) twice, the keys and values
    (B, W + T, K, H) the queries attend over, and their mask (B|1, 1|N, T, W + T): a key
    is seen when it holds a position, not after the query and less than W before it.
    """
    w, t = cached_key.shape[2], k.shape[1]
    slot = jnp.arange(w)
    old_pos = index - 1 - jnp.mod(index - 1 - slot, w)                   # (W,), -1..: empty
    q_pos = index + jnp.arange(t)[:, None]                               # (T, 1)
    key_pos = jnp.concatenate([old_pos, index + jnp.arange(t)])          # (W + T,)
    allowed = (key_pos >= 0) & (key_pos <= q_pos) & (q_pos - key_pos < w)   # (T, W + T)
    if mask is not None:
        mask = jnp.take(mask, jnp.clip(key_pos, 0, mask.shape[-1] - 1), axis=-1)
    keys = jnp.concatenate([_heads_first(cached_key), k.astype(cached_key.dtype)], 1)
    values = jnp.concatenate([_heads_first(cached_value), v.astype(cached_value.dtype)], 1)
    keep = min(t, w)                         # the newest W positions go into the ring
    write = jnp.mod(index + t - keep + jnp.arange(keep), w)
    ck = cached_key.at[:, :, write].set(_heads_first(k[:, t - keep:]).astype(cached_key.dtype))
    cv = cached_value.at[:, :, write].set(
        _heads_first(v[:, t - keep:]).astype(cached_value.dtype))
    return ck, cv, keys, values, combine_masks(mask, allowed[None, None])


def linear_cache_update(state: Array, norm: Array, index: Array, q: Array, k: Array, v: Array,
                        mask: Array | None = None, precision: Any = None):
    """Linear attention's decode step over its recurrent state.

    ``state`` (B, K, H, Hv) = sum of phi(k) v^T and ``norm`` (B, K, H) = sum of phi(k) over
    the positions before ``index`` (phi = elu + 1, fp32); q (B, T, N, H), k (B, T, K, H),
    v (B, T, K, Hv) the new positions. ``mask``: a key-padding mask (B|1, 1, 1, S_max) over
    the absolute positions (a padded key adds nothing to the state). Returns the output
    (B, T, N, Hv) and the new state and norm (``linear_attention.linear_attention_step``).
    """
    b, t = k.shape[:2]
    valid = None
    if mask is not None:
        valid = jnp.broadcast_to(jax.lax.dynamic_slice_in_dim(mask[:, 0, 0], index, t, axis=1),
                                 (b, t))
    return linear_attention_step(q, k, v, state, norm, key_valid=valid, precision=precision)



class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention owning the Q/K/V/O projections.

    Self-attention when ``inputs_kv`` is None, cross-attention otherwise; ``inputs_v``
    optionally feeds the value projection from a separate tensor (PyTorch's distinct
    ``key``/``value`` arguments; it defaults to ``inputs_kv``). Parameters:
      query (D, N, H), key (Dkv, K, H), value (Dkv, K, H), out (N, H, D) kernels, each with
      a bias when ``use_bias``; logical axes ('embed', 'heads'|'kv_heads', 'head_dim').
    ``scale`` defaults to 1/sqrt(H) (T5 uses 1); ``bias`` at call time is added to the
    logits (T5's relative position bias). ``qkv_bias`` gives the query, key and value
    projections biases whatever ``use_bias`` says (Qwen 2); ``qk_norm`` (a ``norms.NORMS``
    name) normalises each query and key head over H before RoPE, with parameters
    ``query_norm`` and ``key_norm`` (H,) (Qwen 3, Gemma 3). ``rope_scaling`` rescales the
    rotary frequencies (``embeddings.RopeScaling``).

    KV cache (``decode=True``), in a ``cache`` collection. Self-attention keeps
    ``cached_key``/``cached_value`` (B, K, S_max, H) and ``cache_index``: initialise it by
    calling ``init`` with ``decode=True`` on inputs of the full length S_max; each later
    call appends its T new positions and attends over the filled cache (with ``causal``,
    query i at absolute position index + i sees cached keys <= its position).
    Cross-attention keeps the keys and values of ``inputs_kv`` (the encoder output),
    computed once when the cache is created and reused at every step. A model forced onto
    a kernel (``attention_impl`` "splash" or "pallas") decodes with the decode path's own
    implementation (``attention_dispatch.decode_implementation``). Heads before
    positions: a decode step then reads each head's keys as one contiguous (S, H) block and
    writes its new row in place (with (B, S, K, H), XLA:CPU copied the whole cache into
    that order at every step; measurements in docs/performance.md).

    Prefix tuning (Li & Liang 2021; ``prefix_tokens`` = P > 0, self-attention only): two
    more parameters ``prefix_key`` and ``prefix_value`` (P, K, H), logical axes (None,
    'kv_heads', 'head_dim'), initialised N(0, 1) as PEFT's prefix embedding. They are
    P extra keys and values in front of the real ones, which every query sees (padding and
    causality apply to the real keys only): PEFT's ``PrefixTuningConfig`` with the prefix
    as a length-P ``past_key_values``. As in that cache, the real tokens are numbered from
    P: rotary positions default to P + 0, 1, ... (callers passing ``positions`` pass them
    so numbered), and the prefix keys are used as stored, never rotated (HF caches hold
    rotated keys; PEFT hands its prefix tensors over as they are). With a KV cache the
    prefix is not stored in it: it is put in front of the cache's keys and values at
    every step. Returned weights then cover (B, N, T, P + S).

    Efficient attention (self-attention only; the cross-attention never takes them):
    ``pattern`` (``masks.AttentionPattern``: a sliding window or Child et al.'s strided /
    fixed sparse pattern) is handed to ``dot_product_attention``, whose block paths skip
    what it excludes. Decoding with a window of W keeps a ring of W cache slots when the
    cache would be longer (slot = position mod W; memory independent of the generated
    length): each step attends over the ring and its new keys. ``attention="linear"``
    is linear attention; its decode cache is the constant-size recurrent state
    ``linear_state`` (B, K, H, Hv) and ``linear_norm`` (B, K, H) instead of keys and values.
    """
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    attention: str = "softmax"                      # or "linear" (linear attention)
    attention_impl: str = "auto"                    # softmax attention's implementation
    scale: float | None = None
    rope_base: float | None = None
    rope_interleaved: bool = False
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool | None = None                    # None: use_bias
    qk_norm: str | None = None                      # a norms.NORMS name: per-head q/k norm
    qk_norm_eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = default_kernel_init
    query_kernel_init: Initializer | None = None    # default: kernel_init
    out_kernel_init: Initializer | None = None      # default: kernel_init
    bias_init: Initializer = nn.initializers.zeros_init()
    precision: Any = None
    cpu_tuning: bool = True
    prefix_tokens: int = 0                          # prefix tuning: P learned keys/values
    pattern: AttentionPattern | None = None         # window / sparse (self-attention only)

    def _dims(self, d: int) -> tuple[int, int, int]:
        n = self.num_heads
        kh = self.num_kv_heads or n
        if self.head_dim is None and d % n:
            raise UserError(f"{self.name}: d_model={d} is not divisible by num_heads={n}; "
                            "pick a divisor or set head_dim explicitly")
        if n % kh:
            raise UserError(f"{self.name}: num_heads={n} must be a multiple of num_kv_heads={kh}")
        return n, kh, self.head_dim or d // n

    def _proj(self, heads: int, h: int, axes, name: str, init=None) -> Dense:
        bias = self.use_bias if self.qkv_bias is None else self.qkv_bias
        return Dense((heads, h), use_bias=bias, kernel_axes=axes, dtype=self.dtype,
                     param_dtype=self.param_dtype, kernel_init=init or self.kernel_init,
                     bias_init=self.bias_init, precision=self.precision,
                     cpu_tuning=self.cpu_tuning, name=name)

    def _key_value(self, inputs_kv, inputs_v, kh: int, h: int):
        axes = ("embed", "kv_heads", "head_dim")
        k = self._proj(kh, h, axes, "key")(inputs_kv)                        # (B, S, K, H)
        v = self._proj(kh, h, axes, "value")(inputs_v)                       # (B, S, K, H)
        return self._norm_heads(k, "key_norm"), v

    def _norm_heads(self, x: Array, name: str) -> Array:
        """``qk_norm``: each head's vector (B, T, N|K, H) normalised over H."""
        if self.qk_norm is None:
            return x
        return make_norm(self.qk_norm, self.qk_norm_eps, self.dtype, self.param_dtype,
                         name=name)(x)

    def _cross_cache(self, inputs_kv, inputs_v, kh: int, h: int):
        """Keys and values of the encoder output: computed when the cache is created, then
        read (stored (B, K, S, H), as the self-attention cache)."""
        if self.has_variable("cache", "cached_key"):
            k, v = self.get_variable("cache", "cached_key"), self.get_variable("cache", "cached_value")
            return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        k, v = self._key_value(inputs_kv, inputs_v, kh, h)
        self.put_variable("cache", "cached_key", jnp.swapaxes(k, 1, 2))
        self.put_variable("cache", "cached_value", jnp.swapaxes(v, 1, 2))
        return k, v

    def _rope(self, x: Array, positions: Array) -> Array:
        return apply_rope(x, positions, base=self.rope_base, interleaved=self.rope_interleaved,
                          scaling=self.rope_scaling)

    def _self_cache(self, q, k, v, mask, causal, positions, rope: bool):
        """Append k, v (B, T, K, H) at ``cache_index``; return q, the whole cache, the mask
        over it and causal=False (the mask now holds causality and the pattern)."""
        cached = self.has_variable("cache", "cached_key")
        slots = k.shape[1]
        window = self.pattern is not None and self.pattern.kind == "window"
        if window:
            slots = min(slots, self.pattern.size)            # a ring of W slots (docstring)
        shape = lambda x: (x.shape[0], x.shape[2], slots, x.shape[3])    # noqa: E731
        cached_key = self.variable("cache", "cached_key", jnp.zeros, shape(k), k.dtype)
        cached_value = self.variable("cache", "cached_value", jnp.zeros, shape(v), v.dtype)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not cached:                       # creating the cache: attend as without one
            return q, k, v, mask, causal, rope
        idx, (b, t) = cache_index.value, q.shape[:2]
        if rope:                             # cached keys are stored rotated
            pos = self.prefix_tokens + idx + jnp.arange(t) if positions is None else positions
            q, k = self._rope(q, pos), self._rope(k, pos)
        if window and cached_key.value.shape[2] == self.pattern.size:
            ck, cv, k, v, mask = ring_cache_update(cached_key.value, cached_value.value, idx,
                                                   k, v, mask)
        else:
            if mask is not None:
                mask = check_broadcast(mask, "mask",
                                       (b, self.num_heads, t, cached_key.value.shape[2]))
            ck, cv, k, v, filled = self_cache_update(cached_key.value, cached_value.value, idx,
                                                     k, v, causal=causal, pattern=self.pattern)
            mask = combine_masks(mask, filled)
        cached_key.value, cached_value.value, cache_index.value = ck, cv, idx + t
        return q, k, v, mask, False, False

    def _linear_cache(self, q, k, v, mask, positions, rope: bool):
        """Linear attention's decode cache: the recurrent state replaces keys and values.
        Returns the attention output (B, T, N, Hv), or None while the cache is created."""
        cached = self.has_variable("cache", "linear_state")
        (b, t, kh, h), hv = k.shape, v.shape[-1]
        state = self.variable("cache", "linear_state", jnp.zeros, (b, kh, h, hv), jnp.float32)
        norm = self.variable("cache", "linear_norm", jnp.zeros, (b, kh, h), jnp.float32)
        cache_index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not cached:
            return None
        idx = cache_index.value
        if rope:
            pos = idx + jnp.arange(t) if positions is None else positions
            q, k = self._rope(q, pos), self._rope(k, pos)
        if mask is not None and (mask.ndim != 4 or mask.shape[1:3] != (1, 1)):
            raise UserError(f"{self.name}: linear attention decodes with a key-padding "
                            f"mask (B, 1, 1, S_max) only; got {mask.shape}")
        out, state.value, norm.value = linear_cache_update(
            state.value, norm.value, idx, q, k, v, mask, precision=self.precision)
        cache_index.value = idx + t
        return out

    def _with_prefix(self, k, v, mask, bias, causal, t: int):
        """Prefix tuning: the P learned keys/values in front of k, v (B, S, K, H), which
        every query sees; the mask (and bias) grow by P leading columns, and causality
        (queries aligned with the real keys, numbered from P) moves into the mask."""
        p, (b, s, kh, h) = self.prefix_tokens, k.shape
        init = nn.with_logical_partitioning(nn.initializers.normal(1.0),
                                            (None, "kv_heads", "head_dim"))
        front = [jnp.broadcast_to(self.param(name, init, (p, kh, h), self.param_dtype)
                                  .astype(x.dtype)[None], (b, p, kh, h))
                 for name, x in (("prefix_key", k), ("prefix_value", v))]
        k, v = (jnp.concatenate([f, x], axis=1) for f, x in zip(front, (k, v)))
        shape = (b, self.num_heads, t, s)
        mask, bias = check_broadcast(mask, "mask", shape), check_broadcast(bias, "bias", shape)
        if mask is not None:
            mask = jnp.broadcast_to(mask.astype(bool), mask.shape[:3] + (s,))
            mask = jnp.concatenate([jnp.ones(mask.shape[:3] + (p,), bool), mask], axis=-1)
        if bias is not None and bias.shape[-1] != 1:
            bias = jnp.concatenate([jnp.zeros(bias.shape[:3] + (p,), bias.dtype), bias], axis=-1)
        if causal:                           # query i sees the prefix and real keys <= i
            mask = combine_masks(mask, causal_mask(t, p + s, offset=p))
        return k, v, mask, bias, False

    @nn.compact
    def __call__(self, inputs_q: Array, inputs_kv: Array | None = None, *,
                 inputs_v: Array | None = None,
                 mask: Array | None = None, bias: Array | None = None, causal: bool = False,
                 positions: Array | None = None, deterministic: bool = True,
                 decode: bool = False, return_weights: bool = False,
                 segment_ids: Array | tuple[Array, Array] | None = None):
        """inputs_q (B, T, D), inputs_kv (B, S, Dkv) [, inputs_v (B, S, Dv)] -> (B, T, D)
        [, weights (B, N, T, S)]. ``segment_ids``: packed documents (``dot_product_attention``);
        not with ``decode`` (a cache holds one sequence per row) or prefix tuning."""
        self_attention = inputs_kv is None
        if segment_ids is not None and (decode or self.prefix_tokens):
            raise UserError(f"{self.name}: segment_ids (packed documents) are for training and "
                            "scoring; " + ("a KV-cache decode holds one sequence per row: "
                                           "decode each document in its own row" if decode else
                                           "prefix tuning prepends one prefix per row: drop "
                                           "prefix_tokens or the packing"))
        if self_attention and inputs_v is not None:
            raise UserError(f"{self.name}: inputs_v needs inputs_kv (separate values are a "
                            "cross-attention feature)")
        inputs_kv = inputs_q if self_attention else inputs_kv
        inputs_v = inputs_kv if inputs_v is None else inputs_v
        if inputs_q.ndim != 3 or inputs_kv.ndim != 3 or inputs_v.ndim != 3:
            raise UserError(f"{self.name}: inputs must be (B, T, D); got query {inputs_q.shape}, "
                            f"key {inputs_kv.shape}, value {inputs_v.shape}")
        if inputs_v.shape[:2] != inputs_kv.shape[:2]:
            raise UserError(f"{self.name}: key {inputs_kv.shape} and value {inputs_v.shape} "
                            "inputs must agree on (B, S)")
        d = inputs_q.shape[-1]
        n, kh, h = self._dims(d)
        if self.prefix_tokens and (self.pattern is not None or self.attention == "linear"):
            raise UserError(f"{self.name}: prefix tuning (prefix_tokens) works with full "
                            "softmax attention only; drop the window/sparsity/linear attention "
                            "or the prefix")
        q = self._proj(n, h, ("embed", "heads", "head_dim"), "query",
                       self.query_kernel_init)(inputs_q)                     # (B, T, N, H)
        q = self._norm_heads(q, "query_norm")
        if decode and not self_attention:
            k, v = self._cross_cache(inputs_kv, inputs_v, kh, h)
        else:
            k, v = self._key_value(inputs_kv, inputs_v, kh, h)

        rope = self.rope_base is not None and self_attention
        pattern = self.pattern if self_attention else None
        if decode and self_attention and self.attention == "linear":
            out = self._linear_cache(q, k, v, mask, positions, rope)
            if out is not None:
                return self._output(out, d)
        elif decode and self_attention:
            was_cached = self.has_variable("cache", "cached_key")
            q, k, v, mask, causal, rope = self._self_cache(q, k, v, mask, causal, positions, rope)
            pattern = None if was_cached else pattern     # the cache's mask holds it
        if rope:
            pos = self.prefix_tokens + jnp.arange(q.shape[1]) if positions is None else positions
            q, k = self._rope(q, pos), self._rope(k, pos)
        if self.prefix_tokens and self_attention:
            k, v, mask, bias, causal = self._with_prefix(k, v, mask, bias, causal, q.shape[1])

        dropout_rng = None
        if not deterministic and self.dropout_rate > 0.0:
            dropout_rng = self.make_rng("dropout")
        result = dot_product_attention(
            q, k, v, mask=mask, bias=bias, causal=causal, scale=self.scale,
            dropout_rate=self.dropout_rate, dropout_rng=dropout_rng, deterministic=deterministic,
            return_weights=return_weights, attention=self.attention,
            attention_impl=decode_implementation(self.attention_impl) if decode
            else self.attention_impl,
            precision=self.precision, cpu_tuning=self.cpu_tuning, pattern=pattern,
            segment_ids=segment_ids)
        out, weights = result if return_weights else (result, None)
        y = self._output(out, d)
        return (y, weights) if return_weights else y

    def _output(self, out: Array, d: int) -> Array:
        """The heads (B, T, N, Hv) through the output projection -> (B, T, D)."""
        out = nn.with_logical_constraint(out, ("act_batch", "act_length", "act_heads", "act_head_dim"))
        return Dense(self.out_features or d, in_axes=2, use_bias=self.use_bias,
                     kernel_axes=("heads", "head_dim", "embed"), dtype=self.dtype,
                     param_dtype=self.param_dtype,
                     kernel_init=self.out_kernel_init or self.kernel_init,
                     bias_init=self.bias_init, precision=self.precision,
                     cpu_tuning=self.cpu_tuning, name="out")(out)
