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

import dataclasses
import functools
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from . import cpu_tuning
from .attention_base import NEG, block, check_broadcast, check_qkv, fill_empty_rows, group_heads
from .chunked_attention import chunked_attention, default_chunk
from .dense import Dense, Initializer, default_kernel_init
from .embeddings import apply_rope
from .flash_attention import BlockSizes, flash_attention
from .linear_attention import DEFAULT_CHUNK, linear_attention, linear_attention_step
from .masks import AttentionPattern, causal_mask, combine_masks

Array = jax.Array

IMPLEMENTATIONS = ("auto", "xla", "chunked", "pallas", "jax", "cudnn", "linear")
PLATFORMS = ("cpu", "gpu", "tpu")

# ----------------------------------------------------------------------------- reference

# Causal attention in the reference path splits the queries into blocks; block i attends
# only to the keys up to its last row, so the score and PV matmuls skip most of the upper
# triangle (25% fewer attention FLOPs at 2 blocks, 37.5% at 4, 44% at 8). Each block still
# gets one exact softmax over all its keys, so the result equals the whole-square
# computation up to fp32 rounding. Blocks of 64 queries, at most 8 (unrolled); a
# ``q_chunk`` argument overrides it.
XLA_CAUSAL_MIN_BLOCK = 64
XLA_CAUSAL_MAX_BLOCKS = 8


def _causal_query_block(t: int) -> int:
    return max(XLA_CAUSAL_MIN_BLOCK, -(-t // XLA_CAUSAL_MAX_BLOCKS))


def _causal_blocks(t: int, s: int, size: int) -> list[tuple[int, int, int]]:
    """(first query, end query, number of keys) of each query block; keys are top-left
    aligned (query i sees keys j <= i), so block [a, e) needs keys [0, min(e, s))."""
    return [(a, min(a + size, t), min(a + size, t, s)) for a in range(0, t, size)]


def _unnormalised_softmax(logits, bias, mask, dropout_rate, dropout_rng):
    """exp(logits + bias - max) with blocked entries at 0, dropout applied, and the row sums
    (before dropout). The caller divides the PV product by the row sums, which saves a pass
    over the (B, K, G, T, S) weights forward and backward."""
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, NEG)
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    p = jnp.exp(logits - top)                                                 # fp32
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, p.shape)
        p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
    return p, denom


def _attend_rows(precision, tuned, qt, kt, vt, scale, bias, mask, dropout_rate, dropout_rng):
    """Queries (B, K, G, T, H) over keys (B, K, S, H) and values (B, K, S, Hv): the
    unnormalised weights, their row sums and the output (B, K, G, T, Hv). Both matmuls see
    the G query groups folded into their rows, (B, K, G*T, .)."""
    b, kh, g, t, h = qt.shape
    s, hv = kt.shape[2], vt.shape[3]
    logits = cpu_tuning.attention_scores(qt.reshape(b, kh, g * t, h), kt, precision, tuned)
    p, denom = _unnormalised_softmax(logits.reshape(b, kh, g, t, s) * scale, bias, mask,
                                     dropout_rate, dropout_rng)
    out = cpu_tuning.attention_values(p.astype(vt.dtype).reshape(b, kh, g * t, s), vt,
                                      precision, tuned)
    return p, denom, out.reshape(b, kh, g, t, hv) / denom


def _single_query(q, k, v, mask, bias, scale, dropout_rate, rng, precision, return_weights):
    """One query row (a KV-cache decode step), kept in (B, T, K, G) order: XLA:CPU then lays
    a (B, S, K, H) cache out with contiguous H rows for both dots."""
    b, t, n, h = q.shape
    kh, hv = k.shape[2], v.shape[-1]
    g = n // kh
    dot = cpu_tuning.matmul(precision)
    logits = dot("BTKGH,BSKH->BKGTS", q.reshape(b, t, kh, g, h), k) * scale
    p, denom = _unnormalised_softmax(logits, bias, mask, dropout_rate, rng)
    out = dot("BSKH,BKGTS->BTKGH", v, p.astype(v.dtype)) / jnp.moveaxis(denom, 3, 1)
    weights = (p / denom).reshape(b, n, t, -1) if return_weights else None
    return out.reshape(b, t, n, hv).astype(v.dtype), weights


def xla_attention(q, k, v, mask, bias, scale, causal, dropout_rate=0.0, dropout_rng=None,
                  precision=None, return_weights=False, query_block=None, cpu_tuning_on=True):
    """The reference. q (B, T, N, H), k (B, S, K, H), v (B, S, K, Hv); mask and bias 4-D.

    Returns (out (B, T, N, Hv), weights (B, N, T, S) or None); ``weights`` are the
    normalised ones, dropout included. Queries go to (B, K, G, T, H), keys and values to
    (B, K, S, H). Causal attention is computed in blocks of ``query_block`` queries unless
    the weights are returned. ``dropout_rng`` None: no dropout.
    """
    b, t, s, n, kh, h = check_qkv(q, k, v)
    g, hv = n // kh, v.shape[-1]
    user_mask = mask
    mask = None if mask is None else group_heads(mask, kh, g)                 # (B, K, G, T, S)
    bias = None if bias is None else group_heads(bias, kh, g)
    square_mask = combine_masks(mask, causal_mask(t, s)[:, :, None]) if causal else mask
    if t == 1:
        return _single_query(q, k, v, square_mask, bias, scale, dropout_rate, dropout_rng,
                             precision, return_weights)

    qt = q.reshape(b, t, kh, g, h).transpose(0, 2, 3, 1, 4)                   # (B, K, G, T, H)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)                     # (B, K, S, H/Hv)
    query_block = query_block or _causal_query_block(t)
    blocked = causal and not return_weights and t > query_block
    weights = None
    if not blocked:
        p, denom, out = _attend_rows(precision, cpu_tuning_on, qt, kt, vt, scale, bias,
                                     square_mask, dropout_rate, dropout_rng)
        weights = (p / denom).reshape(b, n, t, s) if return_weights else None
    else:
        outs = []
        for i, (a, e, keys) in enumerate(_causal_blocks(t, s, query_block)):
            blk_mask = combine_masks(block(block(mask, 3, a, e - a), 4, 0, keys),
                                     causal_mask(e - a, keys, offset=a)[:, :, None])
            blk_bias = block(block(bias, 3, a, e - a), 4, 0, keys)
            rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, i)
            outs.append(_attend_rows(precision, cpu_tuning_on, qt[:, :, :, a:e], kt[:, :, :keys],
                                     vt[:, :, :keys], scale, blk_bias, blk_mask, dropout_rate,
                                     rng)[2])
        out = jnp.concatenate(outs, axis=3)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv).astype(v.dtype)
    if blocked and user_mask is not None:
        # a row that the mask and causality leave without keys averages V over all S keys
        # in the whole-square computation; its block saw only the keys up to the block end
        out = fill_empty_rows(out, v, user_mask, t, s)
    return out, weights


# ----------------------------------------------------------------------------- cuDNN

def cudnn_available() -> bool:
    """Whether this jaxlib can lower cuDNN attention (it ships the CUDA plugin with cuDNN)."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        check_cudnn_version()
    except Exception:  # noqa: BLE001 - no CUDA plugin, or no cuDNN in it
        return False
    return True


def cudnn_problems(q: Array, k: Array, v: Array) -> list[str]:
    """Why cuDNN flash attention (``jax.nn.dot_product_attention``) cannot run this call.

    Static checks (dtypes, head dims, lengths) always; the device's compute capability
    only when this process runs on a GPU (a function lowered for CUDA on another host
    cannot ask the device).
    """
    problems = []
    if not cudnn_available():
        problems.append("this jaxlib has no CUDA plugin with cuDNN (pip install 'jax[cuda12]')")
    if q.dtype not in (jnp.float16, jnp.bfloat16) or not q.dtype == k.dtype == v.dtype:
        problems.append(f"it needs fp16/bf16 query, key and value of one dtype (got {q.dtype}, "
                        f"{k.dtype}, {v.dtype}; e.g. a model with dtype='bfloat16')")
    cc = None
    if jax.default_backend() == "gpu":
        try:
            cc = tuple(int(x) for x in str(jax.devices()[0].compute_capability).split("."))
        except (AttributeError, ValueError):
            cc = None
    if cc is not None and cc < (8, 0):
        problems.append(f"it needs compute capability >= 8.0 (Ampere); this GPU has {cc}")
    h = q.shape[-1]
    if h % 8 or h > 128:
        problems.append(f"the head dim must be a multiple of 8 and <= 128; got {h}")
    if v.shape[-1] != h:
        problems.append(f"value head dim {v.shape[-1]} must equal the query/key head dim {h}")
    if q.shape[1] % 2 or k.shape[1] % 2:
        problems.append(f"the lengths must be even for its backward pass (T={q.shape[1]}, "
                        f"S={k.shape[1]})")
    return problems


def _jax_attention(q, k, v, mask, bias, scale, causal, use_cudnn: bool, pattern=None):
    """``jax.nn.dot_product_attention``, through cuDNN or XLA's own path; a window is its
    ``local_window_size`` (cuDNN's sliding window), a sparse pattern a mask."""
    t, s = q.shape[1], k.shape[1]
    window = None
    if pattern is not None and pattern.kind == "window":
        window = (pattern.size - 1, 0 if causal else pattern.size - 1)
    elif pattern is not None:
        mask = combine_masks(mask, pattern.mask(t, s, causal=False))
    if use_cudnn:
        # cuDNN takes masks as an additive bias of full (T, S) extent in the input dtype.
        if bias is not None:
            bias = jnp.broadcast_to(bias, bias.shape[:2] + (t, s)).astype(q.dtype)
        if mask is not None:
            mask = jnp.broadcast_to(mask, mask.shape[:2] + (t, s))
    return jax.nn.dot_product_attention(
        q, k, v, bias=bias, mask=None if mask is None else mask.astype(bool), scale=scale,
        is_causal=causal, local_window_size=window,
        implementation="cudnn" if use_cudnn else "xla")


# ----------------------------------------------------------------------------- choosing

# Above this many logits per (batch, head) the CPU's "auto" takes the chunked path, whose
# memory is linear in the lengths; below it the reference is the faster exact path. A
# TPU v2/v3 (no Pallas kernels) draws the same line.
CPU_REFERENCE_MAX_LOGITS = 4096 * 4096

# Mosaic compiles Pallas TPU kernels for TPU v4 and later; on v2/v3 it fails ("Unsupported
# matmul RHS type on target", jax-ml/jax#18595), so "auto" takes XLA's paths there.
PALLAS_MIN_TPU_GENERATION = 4


def tpu_generation() -> int | None:
    """The TPU generation (2, 3, 4, 5, 6, 7, ...) this trace compiles for, or None if it
    cannot be known: the devices of the current mesh (``jax.set_mesh``; also the devices
    of a TPU topology compiled on a host without a TPU), else this process's TPU."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    kind = getattr(device, "device_kind", None) if device is not None else None
    if kind is None and jax.default_backend() == "tpu":
        kind = jax.devices()[0].device_kind
    return tpu_generation_of(kind)


def tpu_generation_of(device_kind: str | None) -> int | None:
    """``"TPU v3"`` -> 3, ``"TPU v5 lite"`` -> 5, ``"TPU7x"`` -> 7; None for another kind."""
    m = re.match(r"TPU\s*v?(\d+)", device_kind or "")
    return int(m.group(1)) if m else None


def _pallas_on_tpu(generation: int | None) -> bool:
    """Whether the Pallas TPU kernel compiles for this generation (None: unknown, assumed)."""
    return generation is None or generation >= PALLAS_MIN_TPU_GENERATION


def resolve_implementation(implementation: str, platform: str, *, dtype: Any = jnp.float32,
                           head_dim: int = 64, q_len: int = 128, kv_len: int = 128,
                           dropout: bool = False, return_weights: bool = False,
                           pattern: AttentionPattern | None = None,
                           tpu_generation: int | None = None) -> str:
    """What ``implementation`` runs on ``platform`` ("cpu", "gpu" or "tpu") for a call
    of this description: ``"xla"``, ``"chunked"``, ``"pallas"`` or ``"cudnn"``.

    Explicit implementations resolve to themselves (``"jax"`` to ``"cudnn"`` or
    ``"xla"``); ``"auto"`` as the module docstring says. The training loop prints the
    result for the model's shapes when a run starts and writes it into ``config.json``.
    With a ``pattern`` (window or sparse) ``"auto"`` takes the block paths, which skip the
    blocks outside it: on the CPU for a window once there are 1,024 keys and 4 windows
    (a causal window of 256 at T = 2,048: 3.6x faster than the reference; sparse patterns
    as full attention), on a GPU/TPU the Pallas kernel (cuDNN for a window, which it has).
    On a TPU of ``tpu_generation`` 2 or 3 the Pallas kernel does not compile: ``"auto"``
    takes the CPU's choice (the reference, or ``"chunked"`` for long sequences or a
    window), and an explicit ``"pallas"`` is a UserError.
    """
    if implementation not in IMPLEMENTATIONS:
        raise UserError(f"unknown attention implementation {implementation!r}; "
                        f"choose one of {IMPLEMENTATIONS}")
    if platform not in PLATFORMS:
        raise UserError(f"unknown platform {platform!r}; choose one of {PLATFORMS}")
    if implementation == "jax":
        return "cudnn" if platform == "gpu" and not _static_cudnn_problems(
            dtype, head_dim, q_len, kv_len) else "xla"
    if implementation == "pallas" and platform == "tpu" and not _pallas_on_tpu(tpu_generation):
        raise UserError(f"attention implementation 'pallas' cannot run on a TPU "
                        f"v{tpu_generation}: Mosaic compiles Pallas TPU kernels for v4 and "
                        "later only; use 'auto' (XLA's attention on v2/v3), 'xla' or 'chunked'")
    if implementation != "auto":
        return implementation
    if dropout or return_weights or q_len == 1:
        return "xla"
    if platform == "cpu" or (platform == "tpu" and not _pallas_on_tpu(tpu_generation)):
        window = pattern is not None and pattern.kind == "window"
        long = q_len * kv_len > CPU_REFERENCE_MAX_LOGITS or (
            window and kv_len >= max(1024, 4 * pattern.size))
        return "chunked" if long else "xla"
    cudnn_ok = pattern is None or pattern.kind == "window"
    if platform == "gpu" and cudnn_ok and not _static_cudnn_problems(dtype, head_dim, q_len,
                                                                     kv_len):
        return "cudnn"
    return "pallas"


def _static_cudnn_problems(dtype, head_dim, q_len, kv_len) -> list[str]:
    q = jax.ShapeDtypeStruct((1, q_len, 1, head_dim), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((1, kv_len, 1, head_dim), jnp.dtype(dtype))
    return cudnn_problems(q, k, k)


def _kernel(name: str, platform: str, q_chunk, kv_chunk, pattern=None):
    """The kernel call ``f(q, k, v, mask, bias, scale, causal)`` of one implementation."""
    if name == "pallas":
        blocks = None
        if q_chunk or kv_chunk:
            blocks = BlockSizes(block_q=q_chunk or 128, block_k=kv_chunk or 128)
        kernel_platform = platform if platform in ("gpu", "tpu") else "interpret"
        return lambda q, k, v, mask, bias, scale, causal: flash_attention(
            q, k, v, bias=bias, mask=mask, causal=causal, scale=scale, block_sizes=blocks,
            platform=kernel_platform, pattern=pattern)
    use_cudnn = name == "cudnn"
    return lambda q, k, v, mask, bias, scale, causal: _jax_attention(
        q, k, v, mask, bias, scale, causal, use_cudnn, pattern)


def _mesh_specs(q: Array, k: Array, mask: Array | None, bias: Array | None):
    """shard_map specs for (q, k, v, mask, bias, out) under the current mesh, or None.

    Batch rows go over the mesh axes of the logical ``act_batch``, heads over those of
    ``act_heads``, each only as far as the sizes divide (with grouped-query attention the
    heads split only if the K kv heads do).
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return None
    batch_axes, _, head_axes, _ = nn.logical_to_mesh_axes(
        ("act_batch", "act_length", "act_heads", "act_head_dim"))

    def fitting(axes, *sizes):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a in mesh.shape)
        while axes and any(n % math.prod(mesh.shape[a] for a in axes) for n in sizes):
            axes = axes[:-1]
        return axes or None

    batch = fitting(batch_axes, q.shape[0])
    heads = fitting(head_axes, q.shape[2], k.shape[2])
    if batch is None and heads is None:
        return None
    P = jax.sharding.PartitionSpec
    qkv = P(batch, None, heads, None)

    def aux(x):
        if x is None:
            return None
        return P(batch if x.shape[0] > 1 else None, heads if x.shape[1] > 1 else None, None, None)

    return qkv, qkv, qkv, aux(mask), aux(bias), qkv


@dataclasses.dataclass(frozen=True)
class _Call:
    """Everything about an attention call but its arrays (hashable: a jit static argument)."""
    implementation: str         # "xla", "chunked", "pallas", "cudnn" or "jax" (XLA's path)
    platform: str
    scale: float
    causal: bool
    precision: Any
    q_chunk: int | None
    kv_chunk: int | None
    cpu_tuning: bool
    mesh_specs: tuple | None    # ``_mesh_specs`` of the call, resolved outside the trace
    pattern: AttentionPattern | None = None


# Jitted with the call's settings static, so that the layers of a model, which attend with
# the same shapes and settings, share one trace of each branch: "auto" and "pallas" trace a
# branch per platform (lowering keeps one), and linearizing one costs up to a second.
@functools.partial(jax.jit, static_argnames=("call",))
def _attend(q, k, v, mask, bias, *, call: _Call):
    """One implementation on one platform; the kernels run per device under a mesh."""
    if call.implementation == "xla":
        if call.pattern is not None:
            mask = combine_masks(mask, call.pattern.mask(q.shape[1], k.shape[1], causal=False))
        return xla_attention(q, k, v, mask, bias, call.scale, call.causal,
                             precision=call.precision, query_block=call.q_chunk,
                             cpu_tuning_on=call.cpu_tuning)[0]
    if call.implementation == "chunked":
        return chunked_attention(q, k, v, mask, bias, call.scale, call.causal, 0.0, None, True,
                                 call.precision, call.q_chunk or default_chunk(call.pattern),
                                 call.kv_chunk or default_chunk(call.pattern),
                                 pattern=call.pattern)
    kernel = _kernel(call.implementation, call.platform, call.q_chunk, call.kv_chunk,
                     call.pattern)
    if call.mesh_specs is None:
        return kernel(q, k, v, mask, bias, call.scale, call.causal)
    *in_specs, out_spec = call.mesh_specs
    body = lambda q, k, v, mask, bias: kernel(q, k, v, mask, bias, call.scale,  # noqa: E731
                                              call.causal)
    # check_vma=False: pallas_call and cuDNN outputs carry no varying-axes annotation
    return jax.shard_map(body, in_specs=tuple(in_specs), out_specs=out_spec,
                         check_vma=False)(q, k, v, mask, bias)


def _per_platform(q, k, v, mask, bias, choose, *, kernel_chunks: bool, q_chunk, kv_chunk,
                  **settings):
    """``lax.platform_dependent`` over the platforms, ``choose(platform, tpu_generation)``
    naming the implementation of each; the Pallas kernel gets ``q_chunk``/``kv_chunk`` as its block
    sizes only with ``kernel_chunks`` (else its own defaults)."""
    specs = _mesh_specs(q, k, mask, bias)
    generation = tpu_generation()

    def branch(platform):
        name = choose(platform, generation)
        chunks = (q_chunk, kv_chunk) if kernel_chunks or name in ("xla", "chunked") else (None, None)
        call = _Call(implementation=name, platform=platform, mesh_specs=specs, q_chunk=chunks[0],
                     kv_chunk=chunks[1], **settings)
        return functools.partial(_attend, call=call)

    return jax.lax.platform_dependent(q, k, v, mask, bias, cpu=branch("cpu"), cuda=branch("gpu"),
                                      rocm=branch("gpu"), tpu=branch("tpu"), default=branch("cpu"))


def _auto_attention(q, k, v, mask, bias, scale, causal, precision, q_chunk, kv_chunk, tuned,
                    pattern):
    """``implementation="auto"``: one branch per platform, chosen at lowering time. The
    kernels keep their own block sizes; ``q_chunk``/``kv_chunk`` reach the reference and
    the chunked path."""
    describe = dict(dtype=q.dtype, head_dim=q.shape[-1], q_len=q.shape[1], kv_len=k.shape[1],
                    pattern=pattern)
    choose = lambda platform, generation: resolve_implementation(  # noqa: E731
        "auto", platform, tpu_generation=generation if platform == "tpu" else None, **describe)
    return _per_platform(q, k, v, mask, bias, choose, kernel_chunks=False, q_chunk=q_chunk,
                         kv_chunk=kv_chunk, scale=float(scale), causal=causal,
                         precision=precision, cpu_tuning=tuned, pattern=pattern)


def _linear(q, k, v, mask, bias, causal, dropout, return_weights, pattern, precision, chunk):
    """``implementation="linear"``: what linear attention cannot take, refused by name;
    ``chunk`` (``q_chunk``) is the causal scan's chunk."""
    refused = [name for name, present in (("a bias", bias is not None), ("dropout", dropout),
                                          ("returned weights", return_weights),
                                          ("a window/sparse pattern", pattern is not None))
               if present]
    if refused:
        raise UserError(f"implementation='linear' (linear attention) has no {', '.join(refused)}:"
                        " it never forms the (T, S) weights; use a softmax implementation "
                        "('auto', 'xla', 'chunked', 'pallas') for them")
    return linear_attention(q, k, v, mask=mask, causal=causal, precision=precision,
                            chunk=chunk or DEFAULT_CHUNK)


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


# ----------------------------------------------------------------------------- module

class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention owning the Q/K/V/O projections.

    Self-attention when ``inputs_kv`` is None, cross-attention otherwise; ``inputs_v``
    optionally feeds the value projection from a separate tensor (PyTorch's distinct
    ``key``/``value`` arguments; it defaults to ``inputs_kv``). Parameters:
      query (D, N, H), key (Dkv, K, H), value (Dkv, K, H), out (N, H, D) kernels, each with
      a bias when ``use_bias``; logical axes ('embed', 'heads'|'kv_heads', 'head_dim').
    ``scale`` defaults to 1/sqrt(H) (T5 uses 1); ``bias`` at call time is added to the
    logits (T5's relative position bias).

    KV cache (``decode=True``), in a ``cache`` collection. Self-attention keeps
    ``cached_key``/``cached_value`` (B, K, S_max, H) and ``cache_index``: initialise it by
    calling ``init`` with ``decode=True`` on inputs of the full length S_max; each later
    call appends its T new positions and attends over the filled cache (with ``causal``,
    query i at absolute position index + i sees cached keys <= its position).
    Cross-attention keeps the keys and values of ``inputs_kv`` (the encoder output),
    computed once when the cache is created and reused at every step. Heads before
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
    length): each step attends over the ring and its new keys. ``implementation="linear"``
    is linear attention; its decode cache is the constant-size recurrent state
    ``linear_state`` (B, K, H, Hv) and ``linear_norm`` (B, K, H) instead of keys and values.
    """
    num_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    out_features: int | None = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    implementation: str = "auto"
    scale: float | None = None
    rope_base: float | None = None
    rope_interleaved: bool = False
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
        return Dense((heads, h), use_bias=self.use_bias, kernel_axes=axes, dtype=self.dtype,
                     param_dtype=self.param_dtype, kernel_init=init or self.kernel_init,
                     bias_init=self.bias_init, precision=self.precision,
                     cpu_tuning=self.cpu_tuning, name=name)

    def _key_value(self, inputs_kv, inputs_v, kh: int, h: int):
        axes = ("embed", "kv_heads", "head_dim")
        k = self._proj(kh, h, axes, "key")(inputs_kv)                        # (B, S, K, H)
        v = self._proj(kh, h, axes, "value")(inputs_v)                       # (B, S, K, H)
        return k, v

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
        return apply_rope(x, positions, base=self.rope_base, interleaved=self.rope_interleaved)

    def _self_cache(self, q, k, v, mask, causal, positions, rope: bool):
        """Append k, v (B, T, K, H) at ``cache_index``; return q, the whole cache, the mask
        over it and causal=False (the mask now holds causality and the pattern)."""
        cached = self.has_variable("cache", "cached_key")
        heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)    # (B, K, S, H)
        slots = k.shape[1]
        if self.pattern is not None and self.pattern.kind == "window":
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
        if (self.pattern is not None and self.pattern.kind == "window"
                and cached_key.value.shape[2] == self.pattern.size):
            return (q, *self._ring(cached_key, cached_value, cache_index, k, v, mask), False,
                    False)
        ck = jax.lax.dynamic_update_slice(
            cached_key.value, heads_first(k).astype(cached_key.value.dtype), (0, 0, idx, 0))
        cv = jax.lax.dynamic_update_slice(
            cached_value.value, heads_first(v).astype(cached_value.value.dtype), (0, 0, idx, 0))
        cached_key.value, cached_value.value, cache_index.value = ck, cv, idx + t
        k, v = heads_first(ck), heads_first(cv)       # (B, S, K, H) views of the cache
        s_max = k.shape[1]
        filled = (causal_mask(t, s_max, offset=idx) if causal
                  else (jnp.arange(s_max) < idx + t)[None, None, None, :])
        if self.pattern is not None:
            filled = filled & self.pattern.mask(t, s_max, causal=False, offset=idx)
        if mask is not None:
            mask = check_broadcast(mask, "mask", (b, self.num_heads, t, s_max))
        return q, k, v, combine_masks(mask, filled), False, False

    def _ring(self, cached_key, cached_value, cache_index, k, v, mask):
        """Sliding-window decoding over a ring of W slots (slot = position mod W; causal).

        The T new positions idx .. idx+T-1 attend over the ring (positions before idx)
        and over themselves; slot j holds the latest position p < idx with p = j mod W.
        ``mask`` is in absolute positions, (B|1, 1, 1|T, S_max), as for the full cache.
        Returns keys and values (B, W + T, K, H) and their mask (B|1, 1|N, T, W + T)."""
        w, idx, t = self.pattern.size, cache_index.value, k.shape[1]
        heads_first = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
        slot = jnp.arange(w)
        old_pos = idx - 1 - jnp.mod(idx - 1 - slot, w)                      # (W,), -1..: empty
        q_pos = idx + jnp.arange(t)[:, None]                                 # (T, 1)
        new_pos = idx + jnp.arange(t)
        key_pos = jnp.concatenate([old_pos, new_pos])                        # (W + T,)
        allowed = (key_pos >= 0) & (key_pos <= q_pos) & (q_pos - key_pos < w)   # (T, W + T)
        if mask is not None:
            mask = jnp.take(mask, jnp.clip(key_pos, 0, mask.shape[-1] - 1), axis=-1)
        keys = jnp.concatenate([heads_first(cached_key.value), k.astype(cached_key.value.dtype)], 1)
        values = jnp.concatenate([heads_first(cached_value.value),
                                  v.astype(cached_value.value.dtype)], 1)
        keep = min(t, w)                     # the newest W positions go into the ring
        write = jnp.mod(idx + t - keep + jnp.arange(keep), w)
        cached_key.value = cached_key.value.at[:, :, write].set(heads_first(k[:, t - keep:])
                                                                .astype(cached_key.value.dtype))
        cached_value.value = cached_value.value.at[:, :, write].set(
            heads_first(v[:, t - keep:]).astype(cached_value.value.dtype))
        cache_index.value = idx + t
        return keys, values, combine_masks(mask, allowed[None, None])

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
        valid = None
        if mask is not None:                 # a key-padding mask over the absolute positions
            if mask.ndim != 4 or mask.shape[1:3] != (1, 1):
                raise UserError(f"{self.name}: linear attention decodes with a key-padding "
                                f"mask (B, 1, 1, S_max) only; got {mask.shape}")
            valid = jax.lax.dynamic_slice_in_dim(mask[:, 0, 0], idx, t, axis=1)
            valid = jnp.broadcast_to(valid, (b, t))
        out, state.value, norm.value = linear_attention_step(
            q, k, v, state.value, norm.value, key_valid=valid, precision=self.precision)
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
                 decode: bool = False, return_weights: bool = False):
        """inputs_q (B, T, D), inputs_kv (B, S, Dkv) [, inputs_v (B, S, Dv)] -> (B, T, D)
        [, weights (B, N, T, S)]."""
        self_attention = inputs_kv is None
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
        if self.prefix_tokens and (self.pattern is not None or self.implementation == "linear"):
            raise UserError(f"{self.name}: prefix tuning (prefix_tokens) works with full "
                            "softmax attention only; drop the window/sparsity/linear attention "
                            "or the prefix")
        q = self._proj(n, h, ("embed", "heads", "head_dim"), "query",
                       self.query_kernel_init)(inputs_q)                     # (B, T, N, H)
        if decode and not self_attention:
            k, v = self._cross_cache(inputs_kv, inputs_v, kh, h)
        else:
            k, v = self._key_value(inputs_kv, inputs_v, kh, h)

        rope = self.rope_base is not None and self_attention
        pattern = self.pattern if self_attention else None
        if decode and self_attention and self.implementation == "linear":
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
            return_weights=return_weights, implementation=self.implementation,
            precision=self.precision, cpu_tuning=self.cpu_tuning, pattern=pattern)
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
