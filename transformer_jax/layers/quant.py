"""Frozen base kernels stored quantized and dequantized on the fly (QLoRA, Dettmers et al. 2023).

With ``LoraConfig.quantize`` set, the training loop keeps the frozen base parameters
quantized (:func:`quantize_params`); each :class:`~transformer_jax.layers.dense.Dense` whose
module holds a stored kernel (``kernel_q`` beside it) dequantizes it to the compute dtype
right before its matmul, and its LoRA adapters (fp32, trainable) work as before.
:func:`dequantize_params` is the inverse (export, :func:`~transformer_jax.layers.lora.merge`).
All functions are pure ``jnp`` and can run under ``jit`` / ``eval_shape``.

Shape legend::

  L    layers of a scanned stack: a leading axis on every leaf under ``h/...`` (none under
       ``h_0/...``; every stored leaf keeps it, so ``nn.scan`` slices them per layer)
  in   the Dense's input axes: (D,) for a query projection or ``wi``, (N, H) for ``out``
  out  its feature axes: (N, H) for a query projection, (D,) for ``out``, (F,) for ``wi``
  K    the kernel's shape: (L,) + in + out
  B    ``quantize_block`` (64); G: the trailing axes of K the NF4 blocks run over (below)

Stored layout (leaves beside the Dense's ``bias`` / ``lora_a`` / ``lora_b``; ``kernel`` is gone):

``int8``: symmetric, one scale per output feature (LLM.int8()'s vector-wise weights)::

  kernel_q       int8     K                      round(kernel / scale), in [-127, 127]
  kernel_scale   float32  K, the in axes 1       absmax over the in axes / 127: (1, N, H) for
                                                 a query projection, (1, 1, D) for ``out``
  kernel = kernel_q * kernel_scale               (|error| <= scale / 2)

``nf4``: the row-major flattened kernel of each layer in blocks of B consecutive values,
each block scaled by its absmax into [-1, 1] and every value replaced by the index of the
nearest of the 16 :data:`NF4` codes::

  kernel_q       uint8    K[:-1] + (K[-1] / 2,)  two indices a byte: the value at the even
                                                 flat position in the HIGH nibble, the next
                                                 one in the low nibble (as bitsandbytes)
  kernel_absmax  float32  K[:-G] + (prod(K[-G:]) / B,)   each block's absmax
  kernel = NF4[index] * absmax of its block      (|error| <= absmax * NF4_MAX_GAP / 2)

G is the fewest trailing axes whose size is a multiple of B (1 for GPT-2's (768, 12, 64)
query kernel, 2 for a (64, 4, 16) one). Blocks then never straddle rows of the other axes,
so they are exactly bitsandbytes' blocks of the flattened kernel, each layer's blocks are
its own, and the stored shapes give back K (dequantization needs no other information).
NF4 needs an even last axis and per-layer kernel sizes that are multiples of B (all
transformer projections are); anything else is a :class:`UserError`.

``double_quant`` (nf4 only; int8's per-channel scales are already few): the fp32 block
absmax values of each kernel (of each layer: L) are quantized in turn, QLoRA's "double
quantization". Their mean is subtracted first (they are all positive), then runs of 256 of
them get a second-level fp32 scale. QLoRA stores them as 8-bit floats (bitsandbytes: its
8-bit dynamic code); here they are symmetric linear int8, the same bytes, with the simple
bound |absmax' - absmax| <= scale2 / 2::

  kernel_absmax_q      int8     the absmax's shape   round((absmax - mean) / scale2)
  kernel_absmax_scale  float32  (L,) + (ceil(A / 256),)  max |absmax - mean| of each run of 256 / 127
  kernel_absmax_mean   float32  (L,), or ()              the mean of the layer's A absmax values
  absmax' = (kernel_absmax_q + mean / scale2) * scale2   (mean where scale2 = 0)

The NF4 indices are taken against the exact absmax (as bitsandbytes); dequantization uses
the double-quantized one (so a value's error bound grows by |absmax' - absmax|). Bits per parameter: int8 8 (+ the scales), nf4 4 + 32/B = 4.5,
nf4 with double_quant 4 + 8/B + 32/(256 B) = 4.127 (B = 64).
"""
from __future__ import annotations

import math
import re
import statistics
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import UserError
from .lora import LoraConfig

Array = jax.Array

FORMATS = ("int8", "nf4")

#: second-level block of the double quantization (QLoRA: 256)
DQ_BLOCK = 256

#: default :func:`quantize_params` targets, searched in each Dense's module path: the
#: attention projections (``self_attn``/``cross_attn`` ``query``, ``key``, ``value``,
#: ``out``) and feed-forward projections (``mlp/wi``, ``wi_0``, ``wi_1``, ``wo``) of the
#: layer stacks (``h_3/...``, scanned ``h/...``; BERT ``layer``, T5 ``layers``, ViT
#: ``encoderblock``). Embeddings, norms, poolers and the LM / classifier heads stay as they are.
DEFAULT_TARGETS = r"(^|/)[a-z_]*attn/(query|key|value|out)$|(^|/)mlp/(wi|wi_0|wi_1|wo)$"

#: the leaves that replace a Dense's ``kernel`` (those of its format, see the module docstring)
STORED_NAMES = ("kernel_q", "kernel_scale", "kernel_absmax", "kernel_absmax_q",
                "kernel_absmax_scale", "kernel_absmax_mean")


def _nf4_code() -> np.ndarray:
    """NormalFloat4 (QLoRA, Sec. 3): quantiles of N(0, 1) normalized into [-1, 1], with an
    exact 0. Asymmetric: 8 positive values at the probabilities from ``delta`` down towards
    1/2 in 8 equal steps (1/2 itself, whose quantile is 0, left out) and 7 negative values
    likewise in 7 steps, plus 0; ``delta = (1 - 1/(2*15) + 1 - 1/(2*16)) / 2`` keeps the
    outermost quantile finite. Computed in float64, divided by the largest, then float32."""
    normal = statistics.NormalDist()
    delta = 0.5 * ((1 - 1 / 30) + (1 - 1 / 32))
    pos = [normal.inv_cdf(delta + (0.5 - delta) * i / 8) for i in range(8)]
    neg = [-normal.inv_cdf(delta + (0.5 - delta) * i / 7) for i in range(7)]
    values = sorted(neg + [0.0] + pos)
    return np.asarray([v / values[-1] for v in values], np.float32)


#: the 16 NF4 codes, ascending: NF4[0] = -1, NF4[7] = 0, NF4[15] = 1
NF4 = _nf4_code()
#: decision thresholds between neighbouring codes (a value goes to the nearest code)
NF4_MIDPOINTS = ((NF4[:-1] + NF4[1:]) / 2).astype(np.float32)
#: the largest gap between neighbouring codes (NF4[1] - NF4[0] = 0.304); half of it x absmax
#: bounds the error of every value
NF4_MAX_GAP = float(np.max(np.diff(NF4)))


# ----------------------------------------------------------------------------- one kernel

def quantize_kernel(kernel: Array, fmt: str, block: int = 64, double_quant: bool = False, *,
                    in_axes: int = 1, scanned: bool = False) -> dict[str, Array]:
    """The stored form of ``kernel`` (shape K, see the module docstring): ``{"kernel_q": ...,
    "kernel_scale": ...}`` (int8) or ``{"kernel_q": ..., "kernel_absmax": ...}`` (nf4; with
    ``double_quant`` ``kernel_absmax_{q,scale,mean}`` instead of ``kernel_absmax``).

    ``in_axes``: how many axes (after the layer axis) the Dense contracts (int8's scales are
    per output feature). ``scanned``: the kernel has a leading layer axis (L,).
    """
    s = int(scanned)
    x = jnp.asarray(kernel).astype(jnp.float32)
    if fmt == "int8":
        if not 1 <= in_axes < x.ndim - s:
            raise UserError(f"quantize_kernel: in_axes={in_axes} does not fit a kernel of shape "
                            f"{x.shape}{' (scanned)' if scanned else ''}")
        absmax = jnp.max(jnp.abs(x), axis=tuple(range(s, s + in_axes)), keepdims=True)
        scale = absmax / 127.0
        q = jnp.clip(jnp.round(x / _nonzero(scale)), -127, 127).astype(jnp.int8)
        return {"kernel_q": q, "kernel_scale": scale}
    if fmt != "nf4":
        raise UserError(f"unknown quantization format {fmt!r}; choose one of {FORMATS}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block % 2:
        raise UserError(f"quantize_kernel: block must be an even integer >= 2, got {block!r}")
    shape = x.shape
    g = _block_axes(shape[s:], block)
    if shape[-1] % 2:
        raise UserError(f"nf4 packs two values a byte along the kernel's last axis, which is "
                        f"odd in {shape}")
    blocks = x.reshape(shape[:-g] + (math.prod(shape[-g:]) // block, block))
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    normed = blocks / _nonzero(absmax)[..., None]                      # in [-1, 1]
    idx = jnp.searchsorted(jnp.asarray(NF4_MIDPOINTS), normed, method="compare_all")
    stored = {"kernel_q": pack_nibbles(idx.astype(jnp.uint8).reshape(shape))}
    if double_quant:
        stored.update(_quantize_absmax(absmax, s))
    else:
        stored["kernel_absmax"] = absmax
    return stored


def dequantize_kernel(stored: Mapping[str, Array], shape: tuple[int, ...] | None = None,
                      dtype: Any = jnp.float32) -> Array:
    """The kernel (shape K) back from its stored leaves (:func:`quantize_kernel`), computed in
    fp32 and returned in ``dtype``. ``shape``, when given, must be the stored kernel's."""
    fmt = stored_format(stored)
    want = stored_shape(stored)
    if shape is not None and tuple(shape) != want:
        raise UserError(f"the stored {fmt} kernel has shape {want}, expected {tuple(shape)}")
    q = stored["kernel_q"]
    if fmt == "int8":
        kernel = q.astype(jnp.float32) * stored["kernel_scale"]
    else:
        absmax = block_absmax(stored)
        codes = jnp.take(jnp.asarray(NF4), unpack_nibbles(q).astype(jnp.int32))   # K
        block = math.prod(want[absmax.ndim - 1:]) // absmax.shape[-1]
        kernel = (codes.reshape(absmax.shape + (block,)) * absmax[..., None]).reshape(want)
    return kernel.astype(dtype)


def block_absmax(stored: Mapping[str, Array]) -> Array:
    """The absmax of each block of a stored nf4 kernel (``kernel_absmax``, or its double
    quantization undone), fp32, in ``kernel_absmax``'s shape."""
    return stored["kernel_absmax"] if "kernel_absmax" in stored else _dequantize_absmax(stored)


def stored_format(stored: Mapping[str, Any]) -> str:
    """``"int8"`` or ``"nf4"``: the format of a stored kernel, from its leaf names."""
    if "kernel_q" in stored and "kernel_scale" in stored:
        return "int8"
    if "kernel_q" in stored and ("kernel_absmax" in stored or "kernel_absmax_q" in stored):
        return "nf4"
    raise UserError(f"not a stored kernel: leaves {sorted(stored)}; expected kernel_q with "
                    "kernel_scale (int8) or kernel_absmax[_q] (nf4)")


def stored_shape(stored: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape K of the kernel a stored form holds."""
    q = stored["kernel_q"]
    if stored_format(stored) == "int8":
        return tuple(q.shape)
    return tuple(q.shape[:-1]) + (2 * q.shape[-1],)


def pack_nibbles(idx: Array) -> Array:
    """4-bit values (uint8 < 16, even last axis) two a byte: ``idx[..., 2j]`` in the high
    nibble of byte j, ``idx[..., 2j + 1]`` in the low one. Shape (..., n) -> (..., n / 2)."""
    pairs = idx.astype(jnp.uint8).reshape(idx.shape[:-1] + (idx.shape[-1] // 2, 2))
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack_nibbles(packed: Array) -> Array:
    """The inverse of :func:`pack_nibbles`: (..., n / 2) uint8 -> (..., n) values < 16."""
    pairs = jnp.stack([packed >> 4, packed & 0xF], axis=-1)
    return pairs.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def _nonzero(x: Array) -> Array:
    """A divisor: zeros (all-zero channels / blocks) become ones (they quantize to 0)."""
    return jnp.where(x > 0, x, 1.0)


def _block_axes(shape: tuple[int, ...], block: int) -> int:
    """The fewest trailing axes of (one layer's) ``shape`` whose size is a multiple of ``block``."""
    for g in range(1, len(shape) + 1):
        if math.prod(shape[-g:]) % block == 0:
            return g
    raise UserError(f"nf4: a kernel of shape {shape} ({math.prod(shape)} values) is not a "
                    f"whole number of blocks of {block}; choose a quantize_block that divides it")


def _quantize_absmax(absmax: Array, s: int) -> dict[str, Array]:
    """Double quantization of the block absmax values (A of them per layer; ``s`` leading
    layer axes): mean-subtracted, runs of 256 scaled by their own absmax into int8."""
    lead, shape = absmax.shape[:s], absmax.shape
    n = math.prod(shape[s:])
    flat = absmax.reshape(lead + (n,))
    mean = jnp.mean(flat, axis=-1)
    runs = _runs(flat - mean[..., None], n)                              # (..., A/256, 256)
    scale = jnp.max(jnp.abs(runs), axis=-1) / 127.0
    q = jnp.clip(jnp.round(runs / _nonzero(scale)[..., None]), -127, 127).astype(jnp.int8)
    q = q.reshape(lead + (-1,))[..., :n].reshape(shape)
    return {"kernel_absmax_q": q, "kernel_absmax_scale": scale, "kernel_absmax_mean": mean}


def _dequantize_absmax(stored: Mapping[str, Array]) -> Array:
    q, scale, mean = (stored["kernel_absmax_q"], stored["kernel_absmax_scale"],
                      stored["kernel_absmax_mean"])
    lead = mean.shape                                       # (L,) over a scanned stack, or ()
    n = math.prod(q.shape[len(lead):])
    # (q + mean / scale) * scale rather than q * scale + mean: an add before the multiply,
    # which no compiler contracts into an FMA (rounded once instead of twice), so a Dense's
    # jitted dequantization gives dequantize_params' kernel bit for bit
    offset = (mean[..., None] / _nonzero(scale))[..., None]                 # (..., runs, 1)
    runs = (_runs(q.reshape(lead + (n,)).astype(jnp.float32), n) + offset) * scale[..., None]
    runs = jnp.where(scale[..., None] > 0, runs, mean[..., None, None])    # a run all = mean
    return runs.reshape(lead + (-1,))[..., :n].reshape(q.shape)


def _runs(flat: Array, n: int) -> Array:
    """(..., n) -> (..., ceil(n / 256), 256), zero-padded."""
    runs = -(-n // DQ_BLOCK)
    pad = [(0, 0)] * (flat.ndim - 1) + [(0, runs * DQ_BLOCK - n)]
    return jnp.pad(flat, pad).reshape(flat.shape[:-1] + (runs, DQ_BLOCK))


# ----------------------------------------------------------------------------- param trees

_UNROLLED_LAYER = re.compile(r".+_\d+")


def quantize_params(params: Mapping, config: LoraConfig | None, targets: str = DEFAULT_TARGETS,
                    *, scanned: bool | None = None) -> dict:
    """``params`` (unboxed) with every targeted Dense ``kernel`` replaced by its stored form
    (``config.quantize``, ``quantize_block``, ``double_quant``; leaves as in the module
    docstring). ``targets`` is searched (``re.search``) in each Dense's module path, e.g.
    ``h_0/self_attn/query`` (default :data:`DEFAULT_TARGETS`: the layer stacks' attention
    and feed-forward projections). Returns ``params`` as they are when ``config`` or its
    ``quantize`` is None; a ``targets`` that matches no kernel is a :class:`UserError`.

    Per kernel, ``scanned`` (a leading layer axis) is, unless given: no module above the
    Dense is an unrolled layer (``h_3``) and there is one (``h``). The Dense's input axes
    (int8's scales are per output feature) come from its ``bias`` or ``lora_a`` if it has
    one, else from its name: 2 for ``out`` (heads, head_dim), 1 for anything else.
    """
    if config is None or config.quantize is None:
        return params
    pattern = re.compile(targets)
    found = []

    def walk(node, path):
        if not isinstance(node, Mapping):
            return node
        if "kernel" in node and not isinstance(node["kernel"], Mapping) and path \
                and pattern.search("/".join(path)):
            found.append(path)
            kernel = node["kernel"]
            s = _is_scanned(path) if scanned is None else bool(scanned)
            out = {k: v for k, v in node.items() if k != "kernel"}
            out.update(quantize_kernel(kernel, config.quantize, config.quantize_block,
                                       config.double_quant, in_axes=_in_axes(path, node, s),
                                       scanned=s))
            return out
        return {k: walk(v, path + (str(k),)) for k, v in node.items()}

    out = walk(params, ())
    if not found:
        raise UserError(f"quantize_params: targets {targets!r} match no Dense kernel")
    return out


def dequantize_params(params: Mapping, dtype: Any = jnp.float32) -> dict:
    """The inverse of :func:`quantize_params`: every stored kernel dequantized back into a
    ``kernel`` of ``dtype`` (scanned stacks included), the stored leaves removed."""
    def walk(node):
        if not isinstance(node, Mapping):
            return node
        if "kernel_q" in node:
            out = {k: v for k, v in node.items() if k not in STORED_NAMES}
            out["kernel"] = dequantize_kernel({k: node[k] for k in STORED_NAMES if k in node},
                                              None, dtype)
            return out
        return {k: walk(v) for k, v in node.items()}

    return walk(params)


def param_bytes(tree: Any) -> dict[str, int]:
    """Bytes of the leaves of ``tree`` (arrays or ``jax.ShapeDtypeStruct``) by dtype name,
    and ``"total"``."""
    out: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        dt = np.dtype(leaf.dtype)
        out[dt.name] = out.get(dt.name, 0) + math.prod(leaf.shape) * dt.itemsize
    out["total"] = sum(out.values())
    return out


def stored_kernel(module) -> dict[str, Array] | None:
    """A bound Dense's stored (quantized) kernel leaves, or None when it holds a plain ``kernel``."""
    if not module.has_variable("params", "kernel_q"):
        return None
    return {name: module.get_variable("params", name) for name in STORED_NAMES
            if module.has_variable("params", name)}


def _is_scanned(path: tuple[str, ...]) -> bool:
    above = path[:-1]
    return bool(above) and not any(_UNROLLED_LAYER.fullmatch(p) for p in above)


def _in_axes(path: tuple[str, ...], node: Mapping, s: bool) -> int:
    kernel = node["kernel"]
    if "bias" in node and not isinstance(node["bias"], Mapping):
        return kernel.ndim - node["bias"].ndim
    if "lora_a" in node and not isinstance(node["lora_a"], Mapping):
        return node["lora_a"].ndim - 1 - int(s)
    return 2 if path[-1] == "out" else 1
