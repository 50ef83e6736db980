"""PyTorch modules -> Flax mirrors (and back): ``from_torch`` and ``to_torch_state_dict``.

torch is imported lazily inside the functions: ``import transformer_jax`` never imports it.

    flax_module, params = from_torch(torch_module, **overrides)
    y = flax_module.apply({"params": params}, *inputs)          # == torch_module(*inputs)
    state = to_torch_state_dict(flax_module, params)            # {key: np.ndarray}
    torch_module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})

Recognised modules, tried in this order:

  * ``torch.nn``'s Transformer modules (``MultiheadAttention``, ``TransformerEncoderLayer``,
    ``TransformerEncoder``, ``TransformerDecoderLayer``, ``TransformerDecoder``,
    ``Transformer``), by type: :mod:`transformer_jax.interop.torch_nn.convert`, mirrors in
    :mod:`transformer_jax.interop.torch_nn.modules`;
  * the tutorial's PyTorch modules (attention, blocks, embeddings, the whole Transformer,
    BERT and GPT ...), by attribute names: :mod:`transformer_jax.interop.tutorial.convert`
    (its docstring has the rules), mirrors in :mod:`transformer_jax.interop.tutorial.modules`.

Overrides (keyword arguments) resolve ambiguities: ``norm_first`` (blocks and whole models;
default by the tutorial's rules, or the module's own bool ``norm_first`` attribute),
``num_heads`` (tutorial attention, blocks and whole models), ``num_kv_heads`` (grouped-query
attention), ``activation`` (feed-forwards, blocks, whole models and the built-in layers).

Every converter asserts each key and shape through
:class:`~transformer_jax.interop.common.StateDictReader`: every state-dict key must be
consumed exactly once, and every shape must match (``ConversionError``, a ``ValueError``,
naming the key). The same :class:`~transformer_jax.interop.common.TensorMap` tables
drive both directions.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import UserError
from .common import StateDictReader, dump_state_dict, load_params
from .torch_nn.convert import RECOGNISED as BUILTIN_RECOGNISED
from .torch_nn.convert import Conversion, builtin_state_dict_maps, recognise_builtin
from .tutorial.convert import RECOGNISED as TUTORIAL_RECOGNISED
from .tutorial.convert import recognise_tutorial

__all__ = ["from_torch", "to_torch_state_dict", "RECOGNISED"]

#: What ``from_torch`` converts, as its error message lists it.
RECOGNISED = BUILTIN_RECOGNISED + TUTORIAL_RECOGNISED


# ============================================================================= public API

def from_torch(module: Any, **overrides: Any) -> tuple[flax.linen.Module, dict[str, Any]]:
    """Convert a PyTorch module to its Flax mirror and parameters.

    Args:
      module: a ``torch.nn.Module`` recognised as described in the module docstring.
      **overrides: ``norm_first``, ``num_heads``, ``num_kv_heads`` or ``activation`` where
        the module is ambiguous (which ones apply depends on the module kind; others raise
        TypeError).

    Returns:
      ``(flax_module, params)``; ``flax_module.apply({"params": params}, *inputs)`` takes
      the torch forward's positional inputs and returns what it returns.

    Raises:
      TypeError: unrecognised module type, or an override that does not apply.
      ValueError: an unsupported feature (naming the attribute), a module that cannot run
        as written (no or a stub ``forward``; the tutorial's BERT/GPT with vocab_size !=
        d_model), or a state dict that does not match (naming the key, and the expected
        and actual shapes).
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")
    conv = _recognise(module, dict(overrides))
    reader = StateDictReader(module.state_dict(), what=f"{type(module).__name__} state dict")
    params = load_params(conv.maps, reader)
    return conv.module, jax.tree_util.tree_map(jnp.asarray, params)


def to_torch_state_dict(flax_module: flax.linen.Module, params: Mapping[str, Any], *,
                        like: Any = None, **overrides: Any) -> dict[str, np.ndarray]:
    """The inverse of :func:`from_torch`: Flax params -> a PyTorch ``state_dict`` of numpy arrays.

    ``load_state_dict({k: torch.from_numpy(v) ...}, strict=True)`` into a torch module of
    the same configuration reproduces the Flax outputs. Built-in mirrors need nothing
    else; the tutorial mirrors need ``like=`` a torch module of the same structure, from which
    the key names are read: it is recognised as by ``from_torch(like, **overrides)`` (pass
    the same overrides as then) and the resulting configuration must equal
    ``flax_module``'s. Any params-shaped tree works, e.g. gradients. ``params`` may be
    ``{"params": ...}``.
    """
    params = _plain_params(params)
    if like is not None:
        conv = _recognise(like, dict(overrides))
        _check_same_config(conv.module, flax_module)
        maps = conv.maps
    elif (maps := builtin_state_dict_maps(flax_module, params)) is not None:
        if overrides:
            raise TypeError(f"overrides {sorted(overrides)} only apply together with like=")
    else:
        raise TypeError(f"to_torch_state_dict: {type(flax_module).__name__} is not a torch.nn "
                        "built-in mirror; pass like=<the torch module> to take key names from it")
    return dump_state_dict(maps, params, what=f"{type(flax_module).__name__} params")


# ----------------------------------------------------------------------------- recognition

def _recognise(m: Any, overrides: dict[str, Any]) -> Conversion:
    """``torch.nn``'s built-ins first, then the tutorial's modules (which raise if nothing matches)."""
    return recognise_builtin(m, overrides) or recognise_tutorial(m, overrides)


def _check_same_config(expected: flax.linen.Module, got: flax.linen.Module) -> None:
    if type(expected) is not type(got):
        raise UserError(f"like= describes a {type(expected).__name__}, but the Flax module is a "
                        f"{type(got).__name__}")
    diff = [f.name for f in dataclasses.fields(expected)
            if f.name not in ("parent", "name") and getattr(expected, f.name) != getattr(got, f.name)]
    if diff:
        details = ", ".join(f"{k}: like={getattr(expected, k)!r} vs flax={getattr(got, k)!r}" for k in diff)
        raise UserError(f"like= does not match the Flax module's configuration ({details})")


def _plain_params(params: Mapping[str, Any]) -> dict[str, Any]:
    params = flax.core.meta.unbox(params)
    if isinstance(params, Mapping) and set(params) == {"params"}:
        params = params["params"]
    return jax.tree_util.tree_map(np.asarray, dict(params))
