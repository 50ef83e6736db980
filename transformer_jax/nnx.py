"""The Linen models inside Flax NNX code: :func:`to_nnx` wraps, initialises and shards.

    from flax import nnx
    from transformer_jax import GPT, GPTConfig, to_nnx
    model = to_nnx(GPT(GPTConfig.preset("tiny")), ids, rngs=nnx.Rngs(0))   # an nnx.Module
    logits = model(ids)                                                    # (B, T, V)

Why not ``nnx.bridge.ToNNX`` + ``nnx.bridge.lazy_init`` alone: the bridge turns each
parameter's ``nn.LogicallyPartitioned`` box into an ``nnx.Param`` whose ``out_sharding``
holds the box's *logical* axis names (``("embed", "mlp")``), and flax >= 0.12 shards a
variable the moment it is created ("eager sharding", on by default). With no mesh in scope
that raises ``An auto mesh context or metadata is required ... out_sharding=P('mlp',)``;
under a mesh flax maps the names through its rules context only, and a dimension the mesh
does not divide fails. :func:`to_nnx` creates the variables with eager sharding off, then,
given a mesh, places every parameter as the Linen training path does
(:func:`transformer_jax.sharding.logical_to_spec` over ``LOGICAL_AXIS_RULES``; indivisible
dimensions replicated). The ``Param`` keeps its logical names, so ``model(...)`` rebuilds
the Linen boxes and ``nn.with_logical_constraint`` works as in Linen.

The flax version differences (0.11: no eager sharding, names under ``sharding_names``;
0.12: ``nnx.use_eager_sharding``, ``out_sharding``) live in :mod:`transformer_jax.compat`.
"""
from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from . import compat, sharding as sh
from .errors import UserError

# ----------------------------------------------------------------------------- helpers

def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _logical_names(model: nnx.Module) -> dict[tuple[str, ...], tuple | None]:
    """Path -> logical axis names (None: none given) of every ``nnx.Param`` in ``model``."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            meta = node.get_metadata()
            names = next((meta[k] for k in compat.NNX_AXIS_NAME_KEYS if meta.get(k) is not None), None)
            out[_keys(path)] = None if names is None else tuple(names)
    return out


def _replace(values: Any, params: Any) -> Any:
    """``params``' leaves in the structure of ``values``, or a UserError naming the
    first differences (missing, unexpected or reshaped parameters)."""
    given = {_keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {_keys(p): x for p, x in jax.tree_util.tree_flatten_with_path(values)[0]}
    problems = [f"missing {'/'.join(k)}" for k in want if k not in given]
    problems += [f"unexpected {'/'.join(k)}" for k in given if k not in want]
    problems += [f"{'/'.join(k)} has shape {tuple(jax.numpy.shape(given[k]))}, the module's "
                 f"is {tuple(want[k].shape)}" for k in want
                 if k in given and tuple(jax.numpy.shape(given[k])) != tuple(want[k].shape)]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError(f"to_nnx: params do not fit the module: {'; '.join(problems[:3])}{more}; "
                        "pass the params that belong to this module (e.g. both halves of "
                        "from_hf's (module, params)), without the outer {'params': ...}")
    return jax.tree_util.tree_map_with_path(lambda p, _: given[_keys(p)], values)


def _check_mesh_axes(mesh: Mesh, rules) -> None:
    types = getattr(mesh, "axis_types", None) or ()
    if any(t != AxisType.Auto for t in types):
        raise UserError(f"to_nnx: the mesh's axes are {', '.join(t.name for t in types)}; the models "
                        "constrain their activations as hints, which needs Auto axes: build the "
                        "mesh with transformer_jax.sharding.make_mesh (or axis_types=Auto)")
    named = {a for _, axes in rules if axes is not None
             for a in ((axes,) if isinstance(axes, str) else axes)}
    missing = sorted(named - set(mesh.axis_names))
    if missing:
        raise UserError(f"to_nnx: the logical-axis rules map onto mesh axes {', '.join(missing)}, "
                        f"which the mesh ({', '.join(mesh.axis_names)}) lacks; build it with "
                        "transformer_jax.sharding.make_mesh (axes data, fsdp, tensor) or pass "
                        "rules= that name your mesh's axes")


# ----------------------------------------------------------------------------- public

def to_nnx(module: nn.Module, *args: Any, rngs: nnx.Rngs | jax.Array | int | None = None,
           params: Any = None, mesh: Mesh | None = None, rules=sh.LOGICAL_AXIS_RULES,
           **kwargs: Any) -> nnx.bridge.ToNNX:
    """A Linen ``module`` as an initialised NNX module (``nnx.bridge.ToNNX``).

    Args:
      module: e.g. ``GPT(GPTConfig.preset("tiny"))``, or the module ``from_hf`` returns.
      *args, **kwargs: example inputs, as for ``module.init`` (e.g. ``ids``; for T5
        ``ids, decoder_ids``); only their shapes and dtypes matter.
      rngs: the ``nnx.Rngs`` (or a key, or a seed) for the initialisation; the wrapper
        keeps it and draws its ``dropout`` stream (else ``params``) when called with
        ``deterministic=False``. Default ``nnx.Rngs(0)``.
      params: Linen params to load instead of the random ones (the tree that
        ``module.apply({"params": params}, ...)`` takes, e.g. from ``from_hf``, boxed or
        not); their paths and shapes are checked.
      mesh: place every parameter on this mesh (Auto axes, e.g. ``sharding.make_mesh``)
        by its logical axis names and ``rules`` (default: this package's, as in
        :mod:`transformer_jax.sharding`; a dimension the mesh does not divide is
        replicated). Call the model inside ``sharding.use_mesh(mesh)`` so its activation
        constraints apply too.

    The initialisation runs under ``nnx.jit`` (compiled, and sharded from the start on a
    mesh). ``linen_params(model)`` gives the Linen params back (for ``to_hf``, ``apply``).
    """
    if mesh is not None:
        _check_mesh_axes(mesh, rules)
    if isinstance(rngs, int):
        rngs = nnx.Rngs(rngs)
    model = nnx.bridge.ToNNX(module, rngs=nnx.Rngs(0) if rngs is None else rngs)

    if params is not None:     # checked before tracing: the error comes without jax's notes
        shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), *args, **kwargs))["params"]
        params = _replace(nn.meta.unbox(shapes), nn.meta.unbox(params))

    def init(model, params):
        nnx.bridge.lazy_init(model, *args, **kwargs)
        state = nnx.state(model, nnx.Param)
        values = nnx.to_pure_dict(state) if params is None else params
        if mesh is not None:
            names = _logical_names(model)

            def place(path, x):
                key = _keys(path)
                spec = sh.logical_to_spec(names.get(key), x.shape, mesh, rules, what="/".join(key))
                return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

            values = jax.tree_util.tree_map_with_path(place, values)
        nnx.replace_by_pure_dict(state, values)
        nnx.update(model, state)

    scope = sh.use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext()
    with compat.eager_sharding_off(), scope:
        nnx.jit(init)(model, params)
    return model


def linen_params(model: nnx.Module) -> dict:
    """The Linen params of a :func:`to_nnx` model: the nested dict of arrays that
    ``module.apply({"params": ...})``, ``to_hf`` and the checkpoints take."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))
