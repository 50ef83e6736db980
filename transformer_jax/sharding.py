"""Meshes, the one table of logical-axis rules, and the shardings it implies.

Every parameter is created with logical axis names (``nn.with_logical_partitioning``) and
the blocks constrain their activations with ``nn.with_logical_constraint``. Without a
mesh and rules in scope these annotations cost nothing; inside :func:`use_mesh` the same
model code is data-, FSDP- or tensor-parallel, on 1 device, 8, or a pod.

Mesh axes (always all three, in this order; a mesh of 8 devices is e.g. ``data=2,fsdp=2,tensor=2``):

  ``data``    the batch is split, parameters are replicated (data parallelism);
  ``fsdp``    the batch is split *and* the parameters and optimizer state are split along
              their ``embed`` axis (ZeRO-3 / fully sharded data parallelism: XLA all-gathers
              a weight where it is used and reduce-scatters its gradient);
  ``tensor``  attention heads, MLP hidden units and the vocabulary are split (Megatron-style
              tensor parallelism); the batch is replicated over it.

Parameter axes:  vocab, embed, mlp, heads, kv_heads, head_dim, norm, layers (scan)
Activation axes: act_batch, act_length, act_embed, act_mlp, act_heads, act_head_dim
(distinct names, so an activation's embed axis stays unsharded while the weights' embed
axis is FSDP-sharded). A logical name that is not in the table is replicated.

**Indivisible dimensions are replicated.** A parameter dimension whose size is not a
multiple of its mesh axes' size (GPT-2's vocabulary of 50257 over ``tensor=2``, 4 heads
over ``tensor=8``) is kept whole on every device for that dimension, and
:func:`train_state_shardings` reports it, so a model runs on any mesh; pad the
dimension (e.g. ``model.vocab_size=50304``) to shard it. Activation constraints are
hints to XLA, which pads an indivisible dimension itself. The *batch*, which must be
split exactly, is checked by the training loop with an error naming the numbers.

Typical use::

    mesh = make_mesh("data=2,fsdp=4")                        # over jax.devices()
    abstract, shardings, notes = train_state_shardings(create_state, init_vars, mesh)
    state = jax.jit(create_state, out_shardings=shardings)()
    step = jax.jit(train_step, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, replicated(mesh)), donate_argnums=(0,))
    with use_mesh(mesh):
        state, metrics = step(state, shard_batch(batch, mesh))
"""
from __future__ import annotations

import contextlib
import difflib
import math
from typing import Any, Callable, Iterator, Mapping

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from .errors import UserError

MESH_AXES: tuple[str, str, str] = ("data", "fsdp", "tensor")
BATCH_AXES: tuple[str, str] = ("data", "fsdp")   # the global batch is split over both

# (logical axis, mesh axis or axes or None). The first rule whose mesh axes are still free
# in the array's spec wins (flax semantics).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("act_batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_head_dim", None),
    ("act_vocab", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)


# ----------------------------------------------------------------------------- meshes

def parse_mesh(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"data=2,fsdp=4"`` -> ``{"data": 2, "fsdp": 4}`` (only the axes given).

    ``None`` or ``""`` -> ``{}`` (all devices on ``data``). One axis may be ``-1``:
    "whatever the device count leaves", so ``fsdp=4,data=-1`` fits any multiple of 4.
    """
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    elif isinstance(spec, str):
        items = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise UserError(f"mesh {spec!r}: {part!r} is not of the form AXIS=SIZE "
                                f"(e.g. --mesh data=2,fsdp=4; axes: {', '.join(MESH_AXES)})")
            name, size = (s.strip() for s in part.split("=", 1))
            items.append((name, size))
    else:
        raise UserError(f"mesh must be a string like 'data=2,fsdp=4' or a dict, got {spec!r}")
    out: dict[str, int] = {}
    for name, size in items:
        if name not in MESH_AXES:
            hint = difflib.get_close_matches(name, MESH_AXES, n=1)
            raise UserError(f"mesh {spec!r}: unknown axis {name!r}"
                            + (f" (did you mean {hint[0]!r}?)" if hint else "")
                            + f"; the axes are {', '.join(MESH_AXES)}")
        if name in out:
            raise UserError(f"mesh {spec!r}: axis {name!r} is given twice")
        try:
            value = int(size)
        except (TypeError, ValueError):
            raise UserError(f"mesh {spec!r}: size {size!r} of axis {name!r} is not an integer") from None
        if value == 0 or value < -1:
            raise UserError(f"mesh {spec!r}: axis {name!r} has size {value}; sizes are >= 1 "
                            "(or -1 for 'the remaining devices')")
        out[name] = value
    if sum(v == -1 for v in out.values()) > 1:
        raise UserError(f"mesh {spec!r}: at most one axis may be -1")
    return out


def mesh_shape(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """The full ``{data, fsdp, tensor}`` shape for ``num_devices`` (omitted axes are 1).

    With no axis given, every device goes on ``data``. The product must equal
    ``num_devices``; otherwise a ValueError names both numbers.
    """
    axes = parse_mesh(spec)
    if not axes:
        return {"data": num_devices, "fsdp": 1, "tensor": 1}
    shape = {name: axes.get(name, 1) for name in MESH_AXES}
    fixed = math.prod(v for v in shape.values() if v != -1)
    if -1 in shape.values():
        fill = next(k for k, v in shape.items() if v == -1)
        if num_devices % fixed:
            raise UserError(f"mesh {describe_shape(axes)}: the other axes use {fixed} devices, "
                            f"which does not divide the {num_devices} devices; "
                            f"choose sizes whose product divides {num_devices}")
        shape[fill] = num_devices // fixed
    elif fixed != num_devices:
        raise UserError(f"mesh {describe_shape(shape)} has {fixed} devices, but this run has "
                        f"{num_devices} devices ({jax.process_count()} process(es)); give axis "
                        f"sizes whose product is {num_devices}, or -1 for one axis")
    return shape


def describe_shape(shape: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def describe(mesh: Mesh) -> str:
    """``"data=2,fsdp=2,tensor=2"``."""
    return describe_shape(dict(mesh.shape))


def make_mesh(spec: str | Mapping[str, int] | None = None, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all, every process).

    ``jax.make_mesh`` orders the devices for the hardware topology (on TPU, the ``tensor``
    axis, last, gets the fastest interconnect). The axes are ``Auto``: XLA propagates
    shardings from the inputs and the ``with_logical_constraint`` hints.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(spec, len(devices))
    return jax.make_mesh(tuple(shape[a] for a in MESH_AXES), MESH_AXES,
                         axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Iterator[Mesh]:
    """Make ``mesh`` and the logical-axis ``rules`` current, so that the model's
    ``nn.with_logical_constraint`` calls become sharding constraints when traced.

    Wrap every call of a jitted step in it (tracing happens at the first call).
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield mesh


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


# ----------------------------------------------------------------------------- logical -> mesh

def logical_to_spec(names, shape, mesh: Mesh, rules=LOGICAL_AXIS_RULES, *,
                    notes: list | None = None, what: str = "array") -> P:
    """PartitionSpec for an array of ``shape`` with logical axis ``names`` on ``mesh``.

    A dimension not divisible by its mesh axes' total size keeps the longest prefix of
    those axes that does divide it (usually none: replicated) and, if ``notes`` is a
    list, appends a line saying so.
    """
    if names is None:
        return P()
    names = tuple(names)
    if len(names) != len(shape):
        raise UserError(f"{what}: {len(names)} logical axis names {names} for a "
                        f"{len(shape)}-d array of shape {tuple(shape)}")
    mesh_axes = nn.logical_to_mesh_axes(names, rules)
    out = []
    for dim, (size, axes) in enumerate(zip(shape, mesh_axes)):
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        kept = axes
        while kept and size % math.prod(mesh.shape[a] for a in kept):
            kept = kept[:-1]
        if kept != axes and notes is not None and math.prod(mesh.shape[a] for a in axes) > 1:
            notes.append(f"{what} dim {dim} ({names[dim]}={size}) is not divisible by "
                         f"{'x'.join(f'{a}={mesh.shape[a]}' for a in axes)}; "
                         + (f"sharded over {'x'.join(kept)} only" if kept else "replicated"))
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def _key_str(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _path(path) -> tuple[str, ...]:
    return tuple(_key_str(e) for e in path)


def param_shardings(boxed_params: Any, mesh: Mesh, rules=LOGICAL_AXIS_RULES,
                    notes: list | None = None) -> Any:
    """Shardings for a tree of (abstract) parameters as ``model.init`` returns them: leaves
    boxed in ``nn.LogicallyPartitioned`` carry their logical names; plain leaves are
    replicated. The result has the structure of the *unboxed* tree."""
    is_box = lambda x: isinstance(x, nn.meta.AxisMetadata)  # noqa: E731
    leaves, treedef = jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=is_box)
    out = []
    for path, leaf in leaves:
        what = "/".join(_path(path))
        if is_box(leaf):
            spec = nn.get_partition_spec(leaf)
            value = leaf.unbox(apply_constraint=False)
            out.append(NamedSharding(mesh, logical_to_spec(tuple(spec), value.shape, mesh, rules,
                                                           notes=notes, what=what)))
        else:
            out.append(NamedSharding(mesh, P()))
    return jax.tree_util.tree_unflatten(treedef, out)


def shardings_like_params(tree: Any, params: Any, param_sh: Any, mesh: Mesh) -> Any:
    """Shardings for any pytree holding parameter-shaped leaves (a train state, an optax
    state): a leaf whose key path *ends with* a parameter's path and has that parameter's
    shape is sharded like the parameter (Adam's ``mu``/``nu``, gradient accumulators);
    every other leaf (step counters, scalars, RNG keys) is replicated."""
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], Any]] = {}
    for (path, p), (_, sh) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree_util.tree_flatten_with_path(param_sh)[0]):
        by_path[_path(path)] = (tuple(p.shape), sh)
    depth = max((len(k) for k in by_path), default=0)
    rep = NamedSharding(mesh, P())

    def pick(path, leaf):
        key = _path(path)
        shape = tuple(getattr(leaf, "shape", ()))
        for start in range(max(0, len(key) - depth), len(key)):
            hit = by_path.get(key[start:])
            if hit is not None and hit[0] == shape:
                return hit[1]
        return rep

    return jax.tree_util.tree_map_with_path(pick, tree)


def train_state_shardings(create_state: Callable[[], Any], init_variables: Callable[[], Any],
                          mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> tuple[Any, Any, list[str]]:
    """``(abstract_state, shardings, notes)`` for the state ``create_state()`` would build.

    ``create_state()`` returns a pytree with a ``params`` attribute (a flax ``TrainState``);
    ``init_variables()`` returns the *boxed* variables of ``model.init(...)``, which carry
    the parameters' logical axis names. Parameters are sharded by those names, the
    optimizer state like its parameters, everything else is replicated. ``notes`` lists
    the dimensions that fell back to replication. Only shapes are computed.
    """
    abstract = jax.eval_shape(create_state)
    boxed = jax.eval_shape(init_variables)["params"]
    notes: list[str] = []
    p_sh = param_shardings(boxed, mesh, rules, notes)
    # matched against the whole model's parameters: a fine-tuning state splits them into
    # ``params`` (what trains) and ``frozen``, each sharded like the model's leaf
    return abstract, shardings_like_params(abstract, nn.meta.unbox(boxed), p_sh, mesh), notes


def with_shardings(abstract: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs carrying shardings: a restore target for orbax."""
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def put_global(tree: Any, shardings: Any) -> Any:
    """Place a pytree (host or device arrays, the same values on every process) with
    ``shardings``; leaves already placed that way are kept as they are."""
    def put(x, s):
        if isinstance(x, jax.Array) and x.sharding == s:
            return x
        if jax.process_count() == 1:
            return jax.device_put(x, s)
        host = np.asarray(jax.device_get(x))
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    return jax.tree_util.tree_map(put, tree, shardings)


# ----------------------------------------------------------------------------- batches

def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over ``data`` x ``fsdp``; replicated over ``tensor``."""
    return NamedSharding(mesh, P(BATCH_AXES))


def process_rows(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """``(index, count)``: this process loads rows ``[index*B/count, (index+1)*B/count)`` of
    each global batch of ``B`` rows - the rows its devices hold under
    :func:`batch_sharding`. Pass them to the data iterators as ``process_index`` and
    ``process_count``. One process: ``(0, 1)``. Processes whose devices hold the same rows
    (a ``tensor`` axis spanning hosts) load the same rows.
    """
    if jax.process_count() == 1:
        return 0, 1
    sharding = batch_sharding(mesh)
    spans = {(s[0].start or 0, global_batch if s[0].stop is None else s[0].stop)
             for s in sharding.addressable_devices_indices_map((global_batch,)).values()}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    covered = sum(b - a for a, b in spans)
    size = hi - lo
    if covered != size or global_batch % size or lo % size:
        raise UserError(
            f"process {jax.process_index()}'s devices hold batch rows {sorted(spans)} of {global_batch} "
            f"on mesh {describe(mesh)}, not one contiguous block; put the axes that span "
            "processes first (data, then fsdp)")
    return lo // size, global_batch // size


def shard_batch(batch: Any, mesh: Mesh, global_batch: int | None = None) -> Any:
    """Host batch (numpy leaves, this process's rows) -> global arrays split by
    :func:`batch_sharding`. With several processes each passes its own rows (see
    :func:`process_rows`) and ``global_batch`` (rows over all processes)."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)

    def put(x):
        x = np.asarray(x)
        rows = x.shape[0] if global_batch is None else global_batch
        return jax.make_array_from_process_local_data(sharding, x, (rows,) + x.shape[1:])

    return jax.tree_util.tree_map(put, batch)


# ----------------------------------------------------------------------------- pmap layout

def pmap_replicate(tree: Any) -> Any:
    """Copy a pytree (host or device arrays, fully replicated) to every local device with a
    leading device axis: the layout ``jax.pmap`` takes."""
    from flax import jax_utils
    return jax_utils.replicate(jax.device_get(tree))


def pmap_to_global(tree: Any, mesh: Mesh) -> Any:
    """pmap-replicated leaves ``(local devices, ...)`` -> global arrays replicated over
    ``mesh`` (what the checkpoint stores and the jit path uses). No copies: each device's
    slice becomes that device's shard."""
    sharding = NamedSharding(mesh, P())

    def convert(x):
        shards = [s.data.reshape(x.shape[1:]) for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(x.shape[1:], sharding, shards)

    return jax.tree_util.tree_map(convert, tree)


def pmap_local(tree: Any) -> Any:
    """pmap-replicated leaves -> one copy on the first local device."""
    return jax.tree_util.tree_map(lambda x: x.addressable_shards[0].data.reshape(x.shape[1:]), tree)


# ----------------------------------------------------------------------------- memory

def bytes_per_device(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of a pytree of ``jax.Array`` (sum of its shards' sizes)."""
    out: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
