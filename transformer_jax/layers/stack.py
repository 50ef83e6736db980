"""A stack of identical blocks, unrolled or scanned, with optional rematerialisation.

Every family builds its layers with :func:`layer_stack`, called inside its own compact
``__call__`` so that the layers are its children:

  unrolled   ``{name}_0 .. {name}_{L-1}``, one parameter subtree per layer;
  scanned    one module ``{name}`` whose parameters (and KV cache, and sown intermediates)
             carry a leading (L,) axis, logical axis ``layers`` (``nn.scan``): one layer is
             compiled instead of L, so compile time no longer grows with depth.

``remat`` recomputes each layer's activations in the backward pass (``nn.remat``) and
keeps only what ``remat_policy`` (a name in ``jax.checkpoint_policies``) allows.
:func:`stack_layers` and :func:`unstack_layers` move parameter trees between the layouts;
the converters use them, so a checkpoint converts either way.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError

Array = jax.Array

REMAT_POLICIES = ("nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
                  "everything_saveable")


@functools.cache
def _stackable(block: type[nn.Module]) -> type[nn.Module]:
    """``block`` with a ``__call__(x, *operands)`` that scan and remat can lift.

    The block's ``forward(x, **kwargs)`` receives the operands under ``operand_names``
    and the Python values (flags such as ``deterministic``) stored in the field
    ``static``; with ``scanned`` the result is returned as scan's ``(carry, None)``.
    """
    class Layer(block):
        operand_names: tuple[str, ...] = ()
        static: tuple[tuple[str, Any], ...] = ()
        scanned: bool = False

        @nn.compact
        def __call__(self, x: Array, *operands):
            y = self.forward(x, **dict(zip(self.operand_names, operands)), **dict(self.static))
            return (y, None) if self.scanned else y

    Layer.__name__ = Layer.__qualname__ = block.__name__
    return Layer


def layer_stack(block: type[nn.Module], fields: dict[str, Any], num_layers: int, x: Array, *,
                name: str, operands: dict[str, Any] | None = None,
                static: dict[str, Any] | None = None, scan: bool = False,
                remat: bool = False, remat_policy: str = "nothing_saveable",
                per_layer: Sequence[dict[str, Any]] | None = None) -> Array:
    """Apply ``num_layers`` blocks ``block(**fields)`` to ``x`` (B, T, D).

    ``operands`` (arrays or None: masks, biases, positions, the encoder output) are passed
    to every layer's ``forward`` by keyword; ``static`` (Python values: ``deterministic``,
    ``decode``, ``causal``) too. Call it inside a compact method; the layers become
    children of that module (see the module docstring for their names). ``per_layer``
    (unrolled only: a scan repeats one layer) gives each layer field values on top of
    ``fields``, e.g. Gemma's local and global layers.
    """
    if num_layers < 1:
        raise UserError(f"layer_stack: num_layers must be >= 1, got {num_layers}")
    if remat_policy not in REMAT_POLICIES:
        raise UserError(f"unknown remat_policy {remat_policy!r}; choose one of {REMAT_POLICIES}")
    operands = operands or {}
    layer = _stackable(block)
    if remat:
        policy = getattr(jax.checkpoint_policies, remat_policy)
        layer = nn.remat(layer, prevent_cse=not scan, policy=policy)
    settings = dict(fields, operand_names=tuple(operands),
                    static=tuple(sorted((static or {}).items())))
    args = tuple(operands.values())
    if per_layer is not None and (scan or len(per_layer) != num_layers):
        raise UserError(f"layer_stack: per_layer needs unrolled layers (scan=False) and one "
                        f"entry per layer; got scan={scan}, {len(per_layer)} entries for "
                        f"{num_layers} layers")
    if scan:
        scanned = nn.scan(layer, variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                          split_rngs={"params": True, "dropout": True},
                          in_axes=(nn.broadcast,) * len(args), length=num_layers,
                          metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = scanned(**settings, scanned=True, name=name)(x, *args)
        return x
    for i in range(num_layers):
        extra = per_layer[i] if per_layer is not None else {}
        x = layer(**{**settings, **extra}, name=f"{name}_{i}")(x, *args)
    return x


# ----------------------------------------------------------------------------- layouts

def stack_layers(params: dict, num_layers: int, *, name: str) -> dict:
    """Unscanned ``{name}_0 .. {name}_{L-1}`` subtrees -> one ``name`` subtree with a leading (L,) axis."""
    prefix = f"{name}_"
    missing = [f"{prefix}{i}" for i in range(num_layers) if f"{prefix}{i}" not in params]
    if missing:
        raise KeyError(f"cannot stack layers: missing {missing}")
    layers = [params[f"{prefix}{i}"] for i in range(num_layers)]
    out = {k: v for k, v in params.items() if not (k.startswith(prefix) and k[len(prefix):].isdigit())}
    out[name] = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *layers)
    return out


def unstack_layers(params: dict, *, name: str) -> dict:
    """Inverse of :func:`stack_layers`."""
    if name not in params:
        raise KeyError(f"cannot unstack layers: no {name!r} subtree in params")
    stacked = params[name]
    num_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
    out = {k: v for k, v in params.items() if k != name}
    for i in range(num_layers):
        out[f"{name}_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
    return out


def _update_at(tree: dict, path: Sequence[str], fn) -> dict:
    if not path:
        return fn(tree)
    out = dict(tree)
    out[path[0]] = _update_at(tree[path[0]], path[1:], fn)
    return out


def convert_layout(params: dict, stacks: Sequence[tuple[tuple[str, ...], str, int]], *,
                   scanned: bool) -> dict:
    """Bring every layer stack of ``params`` to one layout.

    ``stacks`` lists (path of the parent module, layer name, number of layers), e.g. T5's
    ``((("encoder",), "layers", 6), (("decoder",), "layers", 6))``. With ``scanned`` the
    unrolled stacks are stacked; without, the scanned ones are unstacked. Stacks already in
    the wanted layout are left alone.
    """
    def convert(name, num_layers):
        def fn(node):
            if scanned and name not in node:
                return stack_layers(node, num_layers, name=name)
            if not scanned and name in node:
                return unstack_layers(node, name=name)
            return node
        return fn

    for path, name, num_layers in stacks:
        params = _update_at(params, path, convert(name, num_layers))
    return params
