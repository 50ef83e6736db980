"""Which attention implementation runs where, and the call of each kernel.

``resolve_implementation`` names what an ``implementation`` runs on a platform; the
functions below ``lax.platform_dependent`` build one branch per platform, chosen when the
function is lowered, and run the kernels (``flash_attention.py``, cuDNN) inside
``shard_map`` under a mesh (our flash kernel ``flash_attention.py``, JAX's splash kernel
``splash_attention.py``, cuDNN). The public entry point is
``attention.dot_product_attention``.
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
from .attention_reference import xla_attention
from .chunked_attention import chunked_attention, default_chunk
from .flash_attention import BlockSizes, flash_attention
from .masks import AttentionPattern, combine_masks, segment_mask
from .splash_attention import mask_kind, splash_attention, splash_problems, tpu_name

Array = jax.Array

IMPLEMENTATIONS = ("auto", "xla", "chunked", "pallas", "splash", "jax", "cudnn")
PLATFORMS = ("cpu", "gpu", "tpu")

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


def check_attention_impl(attention_impl: str) -> None:
    """A UserError unless ``attention_impl`` is one of ``IMPLEMENTATIONS``; "linear" is
    named as the attention kind it is."""
    if attention_impl == "linear":
        raise UserError("attention_impl='linear' is not an implementation: linear attention "
                        "is a kind of attention; choose it with attention='linear' (and "
                        "attention_impl 'auto')")
    if attention_impl not in IMPLEMENTATIONS:
        raise UserError(f"unknown attention_impl {attention_impl!r}; "
                        f"choose one of {IMPLEMENTATIONS}")


#: the kernels a model may be forced onto that leave its KV-cache decoding (``decode=True``:
#: generation, the samples at eval) to the decode path's own implementation
#: (:func:`decode_implementation`)
TRAINING_KERNELS = ("pallas", "splash")


def decode_implementation(attention_impl: str) -> str:
    """What a KV-cache decode call (``decode=True``) runs for a model's ``attention_impl``:
    "auto", the decode path's own choice, for a forced ``"splash"`` or ``"pallas"`` (the
    reference for a step's one query row; for the prompt's prefill over the cache's
    (B, N, T, S) mask, which splash cannot express, what "auto" takes on the platform),
    every other implementation itself. The forced kernel still runs training and the eval
    loss."""
    return "auto" if attention_impl in TRAINING_KERNELS else attention_impl


def resolve_implementation(attention_impl: str, platform: str, **call: Any) -> str:
    """What ``attention_impl`` runs on ``platform`` ("cpu", "gpu" or "tpu") for a call
    of this description: ``"xla"``, ``"chunked"``, ``"pallas"``, ``"splash"`` or
    ``"cudnn"`` (``choose_implementation``'s name, without its reason)."""
    return choose_implementation(attention_impl, platform, **call)[0]


def choose_implementation(attention_impl: str, platform: str, *,
                          dtype: Any = jnp.float32, head_dim: int = 64, q_len: int = 128,
                          kv_len: int = 128, dropout: bool = False,
                          return_weights: bool = False,
                          pattern: AttentionPattern | None = None,
                          tpu_generation: int | None = None, bias: bool | str | None = None,
                          mask: str | None = None) -> tuple[str, str]:
    """(implementation, why) for ``attention_impl`` on ``platform`` and a call of this
    description: ``bias`` (True, or what it is, e.g. "T5 relative positions"), ``mask``
    (None, "keys" for key padding (B, 1, 1, S), "general" for a (..., T, S) mask).

    Explicit implementations resolve to themselves (``"jax"`` to ``"cudnn"`` or
    ``"xla"``); ``"auto"`` as ``attention.py``'s docstring says. The training loop prints the
    result for the model's shapes when a run starts and writes it into ``config.json``.
    On a TPU v4 or later ``"auto"`` takes JAX's splash kernel (MaxText's choice) for every
    call whose mask it expresses (causal, bidirectional, a window, segment ids, key
    padding), our Pallas kernel for the rest (a bias, a general mask, a sparse pattern).
    With a ``pattern`` (window or sparse) ``"auto"`` takes the block paths, which skip the
    blocks outside it: on the CPU for a window once there are 1,024 keys and 4 windows
    (a causal window of 256 at T = 2,048: 3.6x faster than the reference; sparse patterns
    as full attention), on a GPU the Pallas kernel (cuDNN for a window, which it has).
    On a TPU of ``tpu_generation`` 2 or 3 Mosaic kernels do not compile: ``"auto"``
    takes the CPU's choice (the reference, or ``"chunked"`` for long sequences or a
    window), and an explicit ``"pallas"`` or ``"splash"`` is a UserError.
    """
    check_attention_impl(attention_impl)
    if platform not in PLATFORMS:
        raise UserError(f"unknown platform {platform!r}; choose one of {PLATFORMS}")
    if attention_impl == "jax":
        if platform == "gpu" and not _static_cudnn_problems(dtype, head_dim, q_len, kv_len):
            return "cudnn", "named; cuDNN can run the call"
        return "xla", "named; cuDNN cannot run it here"
    if attention_impl in ("pallas", "splash") and platform == "tpu" and not _pallas_on_tpu(
            tpu_generation):
        raise UserError(f"attention_impl={attention_impl!r} cannot run on a TPU "
                        f"v{tpu_generation}: Mosaic compiles Pallas TPU kernels for v4 and "
                        "later only; use 'auto' (XLA's attention on v2/v3), 'xla' or 'chunked'")
    problems = splash_problems(bias=bias, mask=mask, pattern=pattern)
    if attention_impl == "splash":
        if platform == "gpu":
            raise UserError("attention_impl='splash' is JAX's TPU kernel (Mosaic); on a GPU "
                            "use 'auto' (cuDNN or our Pallas kernel), 'pallas', 'cudnn', 'jax', "
                            "'chunked' or 'xla'")
        if problems:
            raise UserError("attention_impl='splash' cannot express " + "; ".join(problems)
                            + ". Use attention_impl='auto' or 'pallas' (our kernel takes them)")
    if attention_impl != "auto":
        return attention_impl, "named"
    if dropout or return_weights or q_len == 1:
        return "xla", ("attention dropout" if dropout else "returned weights" if
                       return_weights else "one query row (a decode step)")
    if platform == "cpu" or (platform == "tpu" and not _pallas_on_tpu(tpu_generation)):
        window = pattern is not None and pattern.kind == "window"
        long = q_len * kv_len > CPU_REFERENCE_MAX_LOGITS or (
            window and kv_len >= max(1024, 4 * pattern.size))
        where = "no Pallas TPU kernels on v2/v3" if platform == "tpu" else "no kernels here"
        return (("chunked", f"{where}; long sequences or a window: memory linear in T")
                if long else ("xla", f"{where}; the exact reference up to 4096 x 4096 logits"))
    if platform == "tpu":
        if problems:
            return "pallas", "; ".join(problems)
        window = f", a window of {pattern.size}" if pattern is not None else ""
        return "splash", (f"no bias, a mask it expresses (causal or not, key padding, segment "
                          f"ids{window}): MaxText's default")
    cudnn_ok = pattern is None or pattern.kind == "window"
    if cudnn_ok and not _static_cudnn_problems(dtype, head_dim, q_len, kv_len):
        return "cudnn", "cuDNN can run the call"
    return "pallas", "cuDNN cannot run the call" if cudnn_ok else "a sparse pattern"


def _static_cudnn_problems(dtype, head_dim, q_len, kv_len) -> list[str]:
    q = jax.ShapeDtypeStruct((1, q_len, 1, head_dim), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct((1, kv_len, 1, head_dim), jnp.dtype(dtype))
    return cudnn_problems(q, k, k)


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
    attention_impl: str         # "xla", "chunked", "pallas", "cudnn" or "jax" (XLA's path)
    platform: str
    scale: float
    causal: bool
    precision: Any
    q_chunk: int | None
    kv_chunk: int | None
    cpu_tuning: bool
    mesh_specs: tuple | None    # ``_mesh_specs`` of the call, resolved outside the trace
    pattern: AttentionPattern | None = None
    tpu_name: str = "later"     # ``splash_attention.SPLASH_BLOCKS``'s row


def _kernel(call: _Call, q, k, v, mask, bias, segment_ids):
    """The Pallas kernel, the splash kernel or ``jax.nn.dot_product_attention`` (cuDNN
    or XLA's path)."""
    if call.attention_impl == "splash":
        return splash_attention(q, k, v, mask=mask, causal=call.causal, scale=call.scale,
                                pattern=call.pattern, segment_ids=segment_ids,
                                interpret=call.platform != "tpu", device=call.tpu_name)
    if call.attention_impl == "pallas":
        blocks = None
        if call.q_chunk or call.kv_chunk:
            blocks = BlockSizes(block_q=call.q_chunk or 128, block_k=call.kv_chunk or 128)
        platform = call.platform if call.platform in ("gpu", "tpu") else "interpret"
        return flash_attention(q, k, v, bias=bias, mask=mask, causal=call.causal,
                               scale=call.scale, block_sizes=blocks, platform=platform,
                               pattern=call.pattern, segment_ids=segment_ids)
    if segment_ids is not None:
        mask = combine_masks(mask, segment_mask(*segment_ids))
    return _jax_attention(q, k, v, mask, bias, call.scale, call.causal,
                          call.attention_impl == "cudnn", call.pattern)


# Jitted with the call's settings static, so that the layers of a model, which attend with
# the same shapes and settings, share one trace of each branch: "auto" and "pallas" trace a
# branch per platform (lowering keeps one), and linearizing one costs up to a second.
@functools.partial(jax.jit, static_argnames=("call",))
def _attend(q, k, v, mask, bias, segment_ids, *, call: _Call):
    """One implementation on one platform; the kernels run per device under a mesh."""
    if call.attention_impl == "xla":
        if call.pattern is not None:
            mask = combine_masks(mask, call.pattern.mask(q.shape[1], k.shape[1], causal=False))
        if segment_ids is not None:
            mask = combine_masks(mask, segment_mask(*segment_ids))
        return xla_attention(q, k, v, mask, bias, call.scale, call.causal,
                             precision=call.precision, query_block=call.q_chunk,
                             cpu_tuning=call.cpu_tuning)[0]
    if call.attention_impl == "chunked":
        return chunked_attention(q, k, v, mask, bias, call.scale, call.causal, 0.0, None, True,
                                 call.precision, call.q_chunk or default_chunk(call.pattern),
                                 call.kv_chunk or default_chunk(call.pattern),
                                 pattern=call.pattern, segment_ids=segment_ids)
    if call.mesh_specs is None:
        return _kernel(call, q, k, v, mask, bias, segment_ids)
    *in_specs, out_spec = call.mesh_specs
    rows = jax.sharding.PartitionSpec(in_specs[0][0], None)     # (B, T) over the batch axes
    segment_specs = None if segment_ids is None else (rows, rows)
    # check_vma=False: pallas_call and cuDNN outputs carry no varying-axes annotation
    return jax.shard_map(functools.partial(_kernel, call),
                         in_specs=(*in_specs, segment_specs), out_specs=out_spec,
                         check_vma=False)(q, k, v, mask, bias, segment_ids)


def kernel_attention(q: Array, k: Array, v: Array, mask: Array | None, bias: Array | None, *,
                     attention_impl: str, scale: float, causal: bool, precision: Any,
                     q_chunk: int | None, kv_chunk: int | None, cpu_tuning: bool,
                     pattern: AttentionPattern | None,
                     segment_ids: tuple[Array, Array] | None = None) -> Array:
    """Softmax attention by ``attention_impl`` "auto", "pallas", "splash", "jax" or "cudnn"
    (checked arguments, no dropout, no returned weights): (B, T, N, Hv).

    "auto", "pallas" and "splash" are one ``lax.platform_dependent`` branch per platform,
    each ``resolve_implementation``'s choice there when the function is lowered ("pallas":
    Mosaic, Triton or interpret mode from one source; "splash": Mosaic on a TPU,
    interpret mode elsewhere, a UserError in a process on a GPU). "auto" hands
    ``q_chunk``/``kv_chunk`` to the reference and chunked paths only (the kernels keep their
    own block sizes), "pallas" to its kernel. "jax" and "cudnn" run ``jax.nn.dot_product_attention``.
    """
    settings = dict(scale=float(scale), causal=causal, precision=precision,
                    cpu_tuning=cpu_tuning, pattern=pattern)
    if attention_impl in ("jax", "cudnn"):
        problems = cudnn_problems(q, k, v)
        if jax.default_backend() != "gpu":
            problems.insert(0, f"it needs a GPU (the backend is {jax.default_backend()!r})")
        if attention_impl == "cudnn" and problems:
            raise UserError("attention_impl='cudnn' cannot run: " + "; ".join(problems)
                            + ". Use attention_impl='auto' (cuDNN where possible), 'jax', "
                            "'pallas', 'chunked' or 'xla'")
        call = _Call(attention_impl="cudnn" if not problems else "jax", platform="gpu",
                     mesh_specs=_mesh_specs(q, k, mask, bias), q_chunk=None, kv_chunk=None,
                     **settings)
        return _attend(q, k, v, mask, bias, segment_ids, call=call)
    specs = _mesh_specs(q, k, mask, bias)
    generation = tpu_generation()
    describe = dict(dtype=q.dtype, head_dim=q.shape[-1], q_len=q.shape[1], kv_len=k.shape[1],
                    pattern=pattern, bias=bias is not None, mask=mask_kind(mask))
    device = tpu_name()
    if attention_impl == "splash" and jax.default_backend() == "gpu":
        resolve_implementation("splash", "gpu", **describe)     # the UserError naming others

    def branch(platform):
        if attention_impl == "splash" and platform == "gpu":
            platform = "cpu"    # never taken: a process on a GPU was refused above
        name = resolve_implementation(
            attention_impl, platform, tpu_generation=generation if platform == "tpu" else None,
            **describe)
        chunks = ((q_chunk, kv_chunk) if attention_impl == "pallas" or name in ("xla", "chunked")
                  else (None, None))
        call = _Call(attention_impl=name, platform=platform, mesh_specs=specs,
                     q_chunk=chunks[0], kv_chunk=chunks[1], tpu_name=device, **settings)
        return functools.partial(_attend, call=call)

    return jax.lax.platform_dependent(q, k, v, mask, bias, segment_ids, cpu=branch("cpu"),
                                      cuda=branch("gpu"), rocm=branch("gpu"), tpu=branch("tpu"),
                                      default=branch("cpu"))
