"""Torch-free machinery shared by the checkpoint converters (``interop.torch``, ``interop.hf``).

A converter describes a checkpoint as a list of :class:`TensorMap` entries: one source
tensor (state-dict key and shape) <-> one or more Flax leaves (path and shape). The same
list drives both directions, so the two can never drift apart::

    params = load_params(maps, StateDictReader(state_dict))   # PyTorch -> Flax
    state_dict = dump_state_dict(maps, params)                 # Flax -> PyTorch

Both directions assert every key and every shape: a missing key, a key taken twice, a
shape that differs from the expected one, or a key left over at the end raises
:class:`ConversionError` (a :class:`~transformer_jax.errors.UserError`) naming the key, and
for shapes the expected and actual shapes. Everything here works on numpy arrays; :func:`as_numpy` converts tensors
(anything with ``.detach()``, e.g. ``torch.Tensor``) at the edge without importing torch.

Shapes in PyTorch's ``nn.Linear`` convention: weight (out, in), bias (out,). Flax
kernels put the input axes first: (in, out...) -- e.g. (D, N, H) for a query projection
or (N, H, D) for an attention output projection (legend: D model width, N heads, H head dim).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ..errors import UserError

Path = tuple[str, ...]
Shape = tuple[int, ...]


class ConversionError(UserError):
    """A checkpoint does not match the structure a converter expects (the message names the key)."""


def as_numpy(x: Any) -> np.ndarray:
    """A tensor or array as a numpy array (bfloat16 tensors are widened to float32).

    Duck-typed so that this module never imports torch: objects with ``.detach()`` are
    treated as torch tensors.
    """
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    return np.asarray(x)


def _fmt_shape(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ("," if len(shape) == 1 else "") + ")"


class StateDictReader:
    """Consume a ``{key: array}`` mapping key by key, asserting shapes; ``finish`` rejects leftovers.

    >>> r = StateDictReader({"w": np.zeros((2, 3))})
    >>> r.take("w", (2, 3)).shape
    (2, 3)
    >>> r.finish()   # raises if any key was never taken

    ``what`` names the mapping in error messages (e.g. ``"BertModel state dict"``).
    """

    def __init__(self, tensors: Mapping[str, Any], *, what: str = "state dict"):
        # lazy: a tensor is read (and converted by as_numpy) when it is taken, so a lazy
        # mapping (a safetensors directory) is never held whole
        self._source = tensors
        self._names = {str(k): k for k in tensors}
        self._taken: set[str] = set()
        self.what = what

    def __contains__(self, key: str) -> bool:
        return key in self._names

    def remaining(self) -> list[str]:
        """Keys not taken (nor skipped) yet, in the mapping's order."""
        return [k for k in self._names if k not in self._taken]

    def _claim(self, key: str) -> np.ndarray:
        if key not in self._names:
            near = [k for k in self.remaining() if k.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]]
            hint = f"; unconsumed keys with the same suffix: {near[:6]}" if near else ""
            raise ConversionError(f"{self.what}: expected key {key!r} is missing{hint}")
        if key in self._taken:
            raise ConversionError(f"{self.what}: key {key!r} is mapped twice")
        self._taken.add(key)
        return as_numpy(self._source[self._names[key]])

    def take(self, key: str, shape: Sequence[int]) -> np.ndarray:
        """The array stored under ``key``, checked to have exactly ``shape``; marks it consumed."""
        array = self._claim(key)
        if tuple(array.shape) != tuple(shape):
            raise ConversionError(f"{self.what}: {key!r} has shape {_fmt_shape(array.shape)}, "
                                  f"expected {_fmt_shape(shape)}")
        return array

    def skip(self, key: str) -> None:
        """Mark ``key`` consumed without using it (it must exist), e.g. a derived buffer."""
        self._claim(key)

    def finish(self) -> None:
        """Raise if any key was never consumed: the checkpoint holds something unmapped."""
        left = self.remaining()
        if left:
            raise ConversionError(f"{self.what}: {len(left)} unexpected key(s) that no mapping "
                                  f"consumes: {left}")


# Alias under the name used in the design notes.
_StateDictReader = StateDictReader


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One source tensor <-> zero or more Flax leaves.

    Attributes:
      key: the state-dict key, e.g. ``"self_attn.in_proj_weight"``.
      shape: its exact shape.
      targets: ``((path, shape), ...)``: the Flax leaves it becomes. With several targets the
        tensor is split into equal chunks along ``split_axis`` (PyTorch's packed
        ``in_proj_weight`` (3D, D) -> query/key/value kernels along axis 0; GPT-2's
        ``c_attn`` (D, 3D) along axis 1).
      transpose: ``True`` for an ``nn.Linear`` weight (out, in): each chunk is transposed to
        (in, out) before it is reshaped to the Flax shape; a tuple of axes permutes each
        chunk instead (a ``Conv2d`` weight OIHW -> HWIO is ``(2, 3, 1, 0)``).
      split_axis: the axis the chunks are cut along (and joined along on the way back).
      constant: for a buffer the Flax side recomputes (no targets): a function returning the
        expected value. Loading checks the stored buffer against it (``within``); dumping
        writes it.
      within: tolerance of that check: a scalar, or an array broadcasting to ``shape``.
      description: what ``constant`` computes, for error messages.
    """
    key: str
    shape: Shape
    targets: tuple[tuple[Path, Shape], ...] = ()
    transpose: bool | tuple[int, ...] = False
    split_axis: int = 0
    constant: Callable[[], np.ndarray] | None = None
    within: Any = 0.0
    description: str = ""

    def __post_init__(self):
        if self.constant is None and not self.targets:
            raise ValueError(f"TensorMap {self.key!r}: give targets or a constant")
        if self.targets:
            n = len(self.targets)
            if n > 1 and self.shape[self.split_axis] % n:
                raise ValueError(f"TensorMap {self.key!r}: shape {self.shape} does not split into "
                                 f"{n} along axis {self.split_axis}")
            size = int(np.prod(self._chunk_shape()))
            for path, shape in self.targets:
                if int(np.prod(shape)) != size:
                    raise ValueError(f"TensorMap {self.key!r}: chunk {self._chunk_shape()} cannot "
                                     f"become {'/'.join(path)} of shape {shape}")

    def _chunk_shape(self) -> Shape:
        if len(self.targets) == 1:          # also a scalar (0-d) tensor: nothing to split
            return tuple(self.shape)
        shape = list(self.shape)
        shape[self.split_axis] //= len(self.targets)
        return tuple(shape)

    def _chunks(self, array: np.ndarray) -> list[np.ndarray]:
        if len(self.targets) == 1:
            return [array]
        return np.split(array, len(self.targets), axis=self.split_axis)

    def _axes(self) -> tuple[int, ...] | None:
        """The permutation applied to each chunk on the way to Flax (None: none)."""
        if self.transpose is True:
            return tuple(reversed(range(len(self.shape))))
        return tuple(self.transpose) if self.transpose else None

    def to_flax(self, array: np.ndarray) -> tuple[np.ndarray, ...]:
        """Source tensor (``shape``) -> the target leaves (their shapes), in ``targets`` order."""
        if self.constant is not None:
            expected = np.asarray(self.constant(), dtype=np.float64).reshape(self.shape)
            err = np.abs(array.astype(np.float64) - expected)
            bad = err > np.asarray(self.within)
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ConversionError(
                    f"{self.key!r}: buffer differs from {self.description or 'the recomputed value'} "
                    f"by up to {err.max():.3g} (first at index {where}: stored {array[where]:.8g}, "
                    f"expected {expected[where]:.8g}); this layout/formula is not supported")
            return ()
        axes = self._axes()
        out = []
        for chunk, (_, shape) in zip(self._chunks(array), self.targets):
            if axes is not None:
                chunk = np.transpose(chunk, axes)
            out.append(np.ascontiguousarray(chunk).reshape(shape))
        return tuple(out)

    def to_torch(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """The target leaves -> the source tensor: the exact inverse of :meth:`to_flax`."""
        if self.constant is not None:
            return np.asarray(self.constant(), dtype=np.float32).reshape(self.shape)
        chunk, axes = self._chunk_shape(), self._axes()
        parts = []
        for a in arrays:
            a = np.asarray(a)
            if axes is None:
                parts.append(a.reshape(chunk))
            else:
                permuted = a.reshape(tuple(chunk[i] for i in axes))
                parts.append(np.transpose(permuted, np.argsort(axes)))
        if len(parts) == 1:                 # a copy, as concatenate makes
            return np.array(parts[0], order="C")
        return np.ascontiguousarray(np.concatenate(parts, axis=self.split_axis))


# ----------------------------------------------------------------------------- factories

def linear(key_prefix: str, path: Path, in_features: int, out_features: int, *,
           bias: bool = True, kernel_shape: Shape | None = None,
           bias_shape: Shape | None = None) -> list[TensorMap]:
    """``nn.Linear(in, out)`` at ``key_prefix`` (``weight`` (out, in), ``bias`` (out,)) <-> a
    Flax Dense at ``path`` (``kernel`` (in, out) or ``kernel_shape``, ``bias`` (out,) or ``bias_shape``)."""
    kernel_shape = kernel_shape or (in_features, out_features)
    maps = [TensorMap(f"{key_prefix}weight", (out_features, in_features),
                      ((path + ("kernel",), tuple(kernel_shape)),), transpose=True)]
    if bias:
        maps.append(TensorMap(f"{key_prefix}bias", (out_features,),
                              ((path + ("bias",), tuple(bias_shape or (out_features,))),)))
    return maps


def packed_linear(key_prefix: str, paths: Sequence[Path], in_features: int, out_each: int, *,
                  bias: bool = True, kernel_shape: Shape | None = None,
                  bias_shape: Shape | None = None, weight_name: str = "weight",
                  bias_name: str = "bias") -> list[TensorMap]:
    """Several projections stacked along the output axis of one weight (n*out, in) <->
    one Dense per path (e.g. PyTorch's ``in_proj_weight`` -> query, key, value)."""
    n = len(paths)
    kernel_shape = tuple(kernel_shape or (in_features, out_each))
    bias_shape = tuple(bias_shape or (out_each,))
    maps = [TensorMap(f"{key_prefix}{weight_name}", (n * out_each, in_features),
                      tuple((p + ("kernel",), kernel_shape) for p in paths), transpose=True)]
    if bias:
        maps.append(TensorMap(f"{key_prefix}{bias_name}", (n * out_each,),
                              tuple((p + ("bias",), bias_shape) for p in paths)))
    return maps


def layer_norm(key_prefix: str, path: Path, features: int, *, bias: bool = True) -> list[TensorMap]:
    """``nn.LayerNorm`` (``weight``, ``bias``) <-> library LayerNorm (``scale``, ``bias``)."""
    maps = [TensorMap(f"{key_prefix}weight", (features,), ((path + ("scale",), (features,)),))]
    if bias:
        maps.append(TensorMap(f"{key_prefix}bias", (features,), ((path + ("bias",), (features,)),)))
    return maps


# ----------------------------------------------------------------------------- trees

def flatten_params(params: Mapping[str, Any]) -> dict[Path, Any]:
    """Nested dict -> ``{path: leaf}``."""
    flat: dict[Path, Any] = {}

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, prefix + (str(k),))
        else:
            flat[prefix] = node
    walk(params, ())
    return flat


def unflatten_params(flat: Mapping[Path, Any]) -> dict[str, Any]:
    """``{path: leaf}`` -> nested dict; a path given twice, or both a leaf and a prefix, raises."""
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConversionError(f"Flax path {'/'.join(path)} runs through a leaf")
        if path[-1] in node:
            raise ConversionError(f"Flax path {'/'.join(path)} is mapped twice")
        node[path[-1]] = leaf
    return tree


def load_params(maps: Iterable[TensorMap], reader: StateDictReader, *,
                finish: bool = True) -> dict[str, Any]:
    """Source tensors -> nested Flax params (numpy). Asserts every key and shape; with
    ``finish`` (default) a key no map consumes raises."""
    flat: dict[Path, np.ndarray] = {}
    for m in maps:
        for (path, _), leaf in zip(m.targets, m.to_flax(reader.take(m.key, m.shape))):
            if path in flat:
                raise ConversionError(f"Flax path {'/'.join(path)} is mapped twice "
                                      f"(second time from {m.key!r})")
            flat[path] = leaf
    if finish:
        reader.finish()
    return unflatten_params(flat)


def dump_state_dict(maps: Iterable[TensorMap], params: Mapping[str, Any], *,
                    what: str = "Flax params") -> dict[str, np.ndarray]:
    """Nested Flax params -> ``{key: numpy array}`` through the same maps as :func:`load_params`.

    Every Flax leaf must be consumed exactly once and have its expected shape.
    """
    reader = StateDictReader({"/".join(p): v for p, v in flatten_params(params).items()}, what=what)
    out: dict[str, np.ndarray] = {}
    for m in maps:
        leaves = [reader.take("/".join(path), shape) for path, shape in m.targets]
        if m.key in out:
            raise ConversionError(f"state-dict key {m.key!r} is produced twice")
        out[m.key] = m.to_torch(leaves)
    reader.finish()
    return out


def attention_mismatches(config: Any, *, sliding_window: bool = False) -> list[str]:
    """The efficient-attention settings (``models.base.EfficientAttentionConfig``) an HF
    checkpoint of plain softmax attention cannot express; ``sliding_window``: the family
    has one (Mistral), so ``attention_window`` is allowed."""
    bad = []
    if getattr(config, "attention", "softmax") != "softmax":
        bad.append(f"attention={config.attention!r} (HF runs softmax attention)")
    if getattr(config, "attention_sparsity", None) is not None:
        bad.append(f"attention_sparsity={config.attention_sparsity!r} (HF has no sparse "
                   "attention pattern)")
    if getattr(config, "attention_window", None) is not None and not sliding_window:
        bad.append(f"attention_window={config.attention_window!r} (a sliding window: only "
                   "the Mistral layout has one)")
    return bad


def refuse_attention_options(config: Any, family: str) -> None:
    """UserError naming what ``attention_mismatches`` finds for an HF ``family``."""
    bad = attention_mismatches(config)
    if bad:
        raise UserError(f"{type(config).__name__} option(s) not expressible as {family}: "
                        + "; ".join(bad) + ". Train such a model here, or convert it without "
                        "these options")
