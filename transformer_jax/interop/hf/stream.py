"""Streaming a checkpoint's tensors into params: one tensor at a time, cast, quantized, placed.

The family converters describe a checkpoint as a :class:`~transformer_jax.interop.common.TensorMap`
table. :func:`stream_params` runs that table the way ``load_params`` + ``cast_params`` +
``to_layout`` do (the same key and shape assertions, the same transposes and reshapes, the
same values), but leaf by leaf: each tensor is read from the (lazy) state dict, converted,
cast to ``param_dtype`` (a bf16 checkpoint stays bf16 unless ``param_dtype`` is float32),
quantized to the QLoRA base format when :class:`LoadTarget` asks for it, and put onto its
devices with its sharding before the next is read. For a scanned layout the L per-layer
tensors of one leaf are stacked into one (L, ...) host buffer of ``param_dtype``, then
placed: the host holds at most one stacked leaf, never the whole tree.

Peak host memory is about one (stacked) leaf, plus, on a CPU backend, the params themselves.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...layers import quant
from ...sharding import param_shardings
from ..common import ConversionError, Path, StateDictReader, TensorMap, unflatten_params
from .registry import Stack


@dataclasses.dataclass(frozen=True)
class LoadTarget:
    """Where streamed leaves go and in which form.

    Attributes:
      quantize: a ``LoraConfig`` whose ``quantize`` is ``"int8"`` or ``"nf4"`` (QLoRA): the
        Dense kernels ``targets`` matches are stored quantized as they are read, exactly as
        :func:`~transformer_jax.layers.quant.quantize_params` stores them. None: plain.
      targets: the regex of the kernels to quantize (``quantize_params``' default).
      mesh: a ``jax.sharding.Mesh``: every leaf is sharded by the training loop's logical
        axis rules (``sharding.param_shardings``; stored quantized leaves are replicated,
        as the training loop keeps them).
      shardings: instead of ``mesh``, the shardings of the result: one ``Sharding`` for
        every leaf, or a nested dict with the params' structure.
      None for both: the default device.
    """
    quantize: Any = None
    targets: str = quant.DEFAULT_TARGETS
    mesh: Any = None
    shardings: Any = None

    def __post_init__(self):
        if self.mesh is not None and self.shardings is not None:
            raise UserError("give mesh or shardings to load the params, not both")
        if self.quantize is not None and getattr(self.quantize, "quantize", None) is None:
            raise UserError("quantize takes a LoraConfig with quantize='int8' or 'nf4' (QLoRA); "
                            f"got {self.quantize!r}")


def put(array: np.ndarray, sharding: Any) -> jax.Array:
    """A host array onto its devices: each device gets (and is sent) its own slice only."""
    if sharding is None:
        return jax.device_put(array)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def _sharding_lookup(target: LoadTarget, module: Any, inputs: Sequence[Any]) -> Callable:
    """``path -> Sharding or None`` for the result's leaves (see :class:`LoadTarget`)."""
    if target.mesh is not None:
        boxed = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs))["params"]
        by_path = {tuple(str(getattr(k, "key", k)) for k in p): s for p, s in
                   jax.tree_util.tree_flatten_with_path(param_shardings(boxed, target.mesh))[0]}
        replicated = jax.sharding.NamedSharding(target.mesh, jax.sharding.PartitionSpec())
        return lambda path: by_path.get(path, replicated)
    if target.shardings is None or isinstance(target.shardings, jax.sharding.Sharding):
        return lambda path: target.shardings

    def lookup(path):
        node = target.shardings
        for part in path:
            if not isinstance(node, dict) or part not in node:
                raise UserError(f"shardings: no entry for {'/'.join(path)}; give a sharding "
                                "for every leaf of the loaded params (or mesh=...)")
            node = node[part]
        return node
    return lookup


def _scanned_path(path: Path, stacks: Sequence[Stack]) -> tuple[Path, int] | None:
    """``(path in the scanned layout, layer index)`` for a leaf of an unrolled stack."""
    for parent, name, _ in stacks:
        n = len(parent)
        if path[:n] == parent and len(path) > n:
            match = re.fullmatch(re.escape(name) + r"_(\d+)", path[n])
            if match:
                return parent + (name,) + path[n + 1:], int(match.group(1))
    return None


def _groups(maps: Sequence[TensorMap], stacks: Sequence[Stack], scanned: bool) -> list:
    """The table in reading order: ``[(final paths of the targets, [(layer, map), ...])]``:
    one map per group (layer None), or, scanned, the L maps whose targets are the same
    stacked leaves."""
    groups: dict[Any, tuple[tuple, list]] = {}
    for m in maps:
        paths = tuple(path for path, _ in m.targets)
        where = [_scanned_path(p, stacks) for p in paths] if scanned else []
        if where and None not in where and len({w[1] for w in where}) == 1:
            final = tuple(w[0] for w in where)
            groups.setdefault(final, (final, []))[1].append((where[0][1], m))
        else:
            groups[("map", id(m))] = (paths, [(None, m)])
    return list(groups.values())


def stream_params(maps: Sequence[TensorMap], reader: StateDictReader, *, param_dtype: Any,
                  stacks: Sequence[Stack], scanned: bool, target: LoadTarget,
                  module: Any, inputs: Sequence[Any]) -> dict[str, Any]:
    """``load_params(maps, reader, finish=False)`` cast to ``param_dtype`` and brought to the
    scanned layout when ``scanned``, streamed leaf by leaf onto ``target`` (module
    docstring). ``module``/``inputs`` give the shardings of ``target.mesh``. The caller
    calls ``reader.finish()``."""
    dtype = np.dtype(jnp.dtype(param_dtype))
    layers = {parent + (name,): n for parent, name, n in stacks}
    shapes = {}                          # leaf path, unrolled and final -> its shape (one layer)
    for m in maps:
        for path, shape in m.targets:
            scanned_path = _scanned_path(path, stacks) if scanned else None
            shapes[path if scanned_path is None else scanned_path[0]] = tuple(shape)
    sharding_of = _sharding_lookup(target, module, inputs)
    pattern = re.compile(target.targets) if target.quantize is not None else None
    flat: dict[Path, Any] = {}
    quantized = []
    for final_paths, members in _groups(maps, stacks, scanned):
        stacked = members[0][0] is not None
        buffers = []
        for layer, m in members:
            leaves = m.to_flax(reader.take(m.key, m.shape))
            if not stacked:
                buffers = [np.asarray(leaf).astype(dtype, copy=False) for leaf in leaves]
                continue
            if not buffers:
                size = _stack_size(final_paths[0], layers)
                buffers = [np.empty((size,) + leaf.shape, dtype) for leaf in leaves]
            for buffer, leaf in zip(buffers, leaves):
                buffer[layer] = leaf
        for path, buffer in zip(final_paths, buffers):
            if path in flat:
                raise ConversionError(f"Flax path {'/'.join(path)} is mapped twice")
            if pattern is not None and path[-1] == "kernel" and pattern.search("/".join(path[:-1])):
                quantized.append(path)
                for name, leaf in _quantize(path, buffer, shapes, stacked, target.quantize).items():
                    flat[path[:-1] + (name,)] = put(leaf, sharding_of(path[:-1] + (name,)))
            else:
                flat[path] = put(buffer, sharding_of(path))
            del buffer
        del buffers
    if pattern is not None and not quantized:
        raise UserError(f"quantize_params: targets {target.targets!r} match no Dense kernel")
    return unflatten_params(flat)


def _stack_size(path: Path, layers: dict[Path, int]) -> int:
    for prefix, n in layers.items():
        if path[:len(prefix)] == prefix:
            return n
    raise AssertionError(f"{'/'.join(path)} is in no layer stack")


def _quantize(path: Path, kernel: np.ndarray, shapes: dict[Path, tuple], scanned: bool,
              config: Any) -> dict[str, np.ndarray]:
    """The stored leaves of one kernel (host arrays), as ``quantize_params`` makes them
    (``shapes``: one layer's shape of each leaf, by final path)."""
    unscanned = tuple(kernel.shape[int(scanned):])
    node = {"kernel": jax.ShapeDtypeStruct(unscanned, kernel.dtype)}
    bias = path[:-1] + ("bias",)
    if bias in shapes:
        node["bias"] = jax.ShapeDtypeStruct(shapes[bias], kernel.dtype)
    in_axes = quant._in_axes(path[:-1], node, False)
    quantize = _quantizer(config.quantize, config.quantize_block, config.double_quant, in_axes,
                          scanned)
    with jax.default_device(jax.devices("cpu")[0]):
        stored = quantize(kernel)
    return {name: np.asarray(leaf) for name, leaf in stored.items()}


@functools.lru_cache(maxsize=None)
def _quantizer(fmt: str, block: int, double_quant: bool, in_axes: int, scanned: bool):
    """``quantize_kernel`` compiled whole for these settings (once per kernel shape): one
    program instead of an XLA compile per op and shape, which on the CPU backend is most
    of a streamed QLoRA load's peak host memory above the params, and its time."""
    return jax.jit(functools.partial(quant.quantize_kernel, fmt=fmt, block=block,
                                     double_quant=double_quant, in_axes=in_axes,
                                     scanned=scanned))


def place_params(module: Any, params: dict, target: LoadTarget) -> dict:
    """``params`` converted whole (a live model, a family that does not stream) brought to
    ``target``: quantized (unless they are already) and placed leaf by leaf. A plain
    ``target`` returns them as they are."""
    if target.quantize is None and target.mesh is None and target.shardings is None:
        return params
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [tuple(str(getattr(k, "key", k)) for k in p) for p, _ in leaves]
    if target.quantize is not None and not any(p[-1] == "kernel_q" for p in paths):
        params = quant.quantize_params(params, target.quantize, target.targets)
    if target.mesh is not None and type(module).__name__ == "GPT":
        sharding_of = _sharding_lookup(target, module, (jnp.zeros((1, 1), jnp.int32),))
    elif target.mesh is not None:        # other families: replicated over the mesh
        sharding_of = _sharding_lookup(LoadTarget(shardings=jax.sharding.NamedSharding(
            target.mesh, jax.sharding.PartitionSpec())), module, ())
    else:
        sharding_of = _sharding_lookup(target, module, ())

    def place(path, leaf):
        sharding = sharding_of(tuple(str(getattr(k, "key", k)) for k in path))
        if isinstance(leaf, jax.Array) and (sharding is None or leaf.sharding == sharding):
            return leaf
        return put(np.asarray(leaf), sharding)
    return jax.tree_util.tree_map_with_path(place, params)
