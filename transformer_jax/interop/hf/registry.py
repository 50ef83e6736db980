"""What every Hugging Face family converter shares: the registry, activations, shapes, layouts.

The family modules of this package (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``qwen3``,
``bert``, ``t5``, ``vit``, ``clip``) each describe their checkpoint as one
:class:`~transformer_jax.interop.common.TensorMap` table and export one :class:`HFFamily`;
:mod:`transformer_jax.interop.hf.convert` registers them and dispatches on
the HF ``model_type`` (HF -> flax) or on the flax config (flax -> HF: its type, and for a type
two families share, :attr:`HFFamily.matches`). Imports go one way:
``common`` <- ``registry`` <- family modules <- ``convert``.

Every family converts the same way, with the helpers below:

  HF -> flax   ``load_params(table)`` (unscanned, numpy) -> :func:`check_table` against the
               module -> :func:`cast_params` -> :func:`to_layout` (scanned when the config
               says ``scan_layers``);
  flax -> HF   :func:`plain_params` -> :func:`to_layout` (unscanned, from either layout) ->
               ``dump_state_dict(table)``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...layers.stack import convert_layout
from ..common import ConversionError, Path, Shape, TensorMap, flatten_params

# ============================================================================ registry


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """How one model family converts, registered under its HF ``model_type`` names.

    from_state_dict(hf_config: dict, state_dict: Mapping[str, array-like], **overrides)
        -> (flax_module, params); ``overrides`` replace fields of the flax config.
    to_state_dict(flax_module, params) -> dict[str, np.ndarray] in HF naming.
    make_hf_config(flax_config, **extra) -> a ``transformers`` config object.
    matches(flax_config) -> bool, for families that share a ``config_type`` (GPT-2 and
        Llama both convert a ``GPTConfig``): whether this family's checkpoints express
        that config. ``None`` (the default): the family takes every config of its type
        that no family with a predicate claims (see :func:`family_for_config`).
    """
    name: str
    model_types: tuple[str, ...]
    config_type: type
    from_state_dict: Callable[..., tuple[Any, Any]]
    to_state_dict: Callable[[Any, Any], dict[str, np.ndarray]]
    make_hf_config: Callable[..., Any]
    matches: Callable[[Any], bool] | None = None


_FAMILIES: dict[str, HFFamily] = {}


def register_hf_family(family: HFFamily) -> None:
    """Make ``from_hf`` accept ``family.model_types`` and ``to_hf`` accept ``family.config_type``."""
    for model_type in family.model_types:
        _FAMILIES[model_type] = family


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def family_for_model_type(model_type: Any) -> HFFamily:
    """The family registered for an HF ``model_type``; an unknown one raises, listing the known."""
    if model_type not in _FAMILIES:
        raise UserError(f"unsupported Hugging Face model_type {model_type!r}; supported: "
                        f"{supported_model_types()}")
    return _FAMILIES[model_type]


def family_for_config(config: Any) -> HFFamily:
    """The family whose flax config type ``config`` is.

    Where several families share that type, the first whose ``matches(config)`` holds,
    else the one without a predicate (GPT-2 for a ``GPTConfig``), whose conversion then
    names the options it cannot express.
    """
    candidates = [f for f in _FAMILIES.values() if isinstance(config, f.config_type)]
    for family in candidates:
        if family.matches is not None and family.matches(config):
            return family
    fallback = [f for f in candidates if f.matches is None] or candidates
    if fallback:
        return fallback[0]
    raise TypeError(f"no Hugging Face converter for config type {type(config).__name__}; "
                    f"supported: {sorted({f.config_type.__name__ for f in _FAMILIES.values()})}")


# ============================================================================ activations

#: HF activation name (``activation_function``, ``hidden_act``, the ACT of T5's
#: ``feed_forward_proj``) -> ours. The first HF name listed for one of ours is the one
#: written back (:func:`activation_to_hf`).
HF_ACTIVATIONS: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "quick_gelu": "quick_gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "tanh": "tanh",
}

#: Ours -> the HF name written for it.
OUR_ACTIVATIONS_TO_HF: dict[str, str] = {}
for _hf_name, _ours in HF_ACTIVATIONS.items():
    OUR_ACTIVATIONS_TO_HF.setdefault(_ours, _hf_name)


def activation_from_hf(name: str, *, family: str, option: str) -> str:
    """Our activation for HF's ``name``; an unknown one raises naming ``option`` (e.g. ``hidden_act``)."""
    if name not in HF_ACTIVATIONS:
        raise UserError(f"unsupported {family} config option {option}={name!r}; supported: "
                        f"{sorted(HF_ACTIVATIONS)}")
    return HF_ACTIVATIONS[name]


def activation_to_hf(ours: str, *, what: str) -> str:
    """The HF name for our activation ``ours``; one HF lacks raises, naming ``what`` (the field)."""
    if ours not in OUR_ACTIVATIONS_TO_HF:
        raise UserError(f"{what}={ours!r} has no Hugging Face equivalent; use one of "
                        f"{sorted(OUR_ACTIVATIONS_TO_HF)}")
    return OUR_ACTIVATIONS_TO_HF[ours]


# ============================================================================ shapes

def without_scan(config: Any) -> Any:
    """``config`` with ``scan_layers`` and ``remat`` off (where it has them): the table's layout."""
    names = {f.name for f in dataclasses.fields(config)}
    return config.replace(**{k: False for k in ("scan_layers", "remat") if k in names})


def expected_flax_shapes(module: nn.Module, *inputs: Any) -> dict[Path, Shape]:
    """Path -> shape of every parameter ``module.init(key, *inputs)`` creates, without allocating."""
    tree = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), *inputs))["params"]
    return {path: tuple(x.shape) for path, x in flatten_params(nn.meta.unbox(tree)).items()}


def check_table(maps: Iterable[TensorMap], module: nn.Module, *inputs: Any, what: str) -> None:
    """The table's Flax targets must be exactly ``module``'s parameters, with their shapes.

    A mismatch is a bug in the converter (not in the checkpoint), hence ``AssertionError``.
    ``module`` is built unscanned (:func:`without_scan`); ``inputs`` are example inputs.
    """
    produced = {path: tuple(shape) for m in maps for path, shape in m.targets}
    expected = expected_flax_shapes(module, *inputs)
    if produced != expected:
        name = lambda paths: sorted("/".join(p) for p in paths)  # noqa: E731
        raise AssertionError(
            f"{what} tensor table out of sync with {type(module).__name__}: missing "
            f"{name(set(expected) - set(produced))}, extra {name(set(produced) - set(expected))}, "
            f"shapes differ at {name(p for p in produced if p in expected and produced[p] != expected[p])}")


# ============================================================================ layouts

#: A layer stack: (path of the parent module, layer name, number of layers), as
#: :func:`transformer_jax.layers.stack.convert_layout` takes it: ``((), "h", 12)`` for GPT's
#: ``h_{i}`` / scanned ``h``.
Stack = tuple[Path, str, int]


def cast_params(params: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
    """Every leaf as a jax array of ``dtype`` (the flax config's ``param_dtype``)."""
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), dict(params))


def plain_params(params: Any) -> dict[str, Any]:
    """The params tree as numpy arrays: unboxed (``nn.Partitioned``), ``{'params': ...}`` stripped."""
    params = nn.meta.unbox(params)
    if set(params) == {"params"}:
        params = params["params"]
    return jax.tree_util.tree_map(np.asarray, dict(params))


def to_layout(params: Mapping[str, Any], stacks: Sequence[Stack], *, scanned: bool,
              what: str) -> dict[str, Any]:
    """Every layer stack of ``params`` in one layout (scanned: one subtree with a leading (L,)
    axis), whichever layout each is in now; a tree without the stacks raises, naming the path."""
    try:
        return convert_layout(dict(params), stacks, scanned=scanned)
    except KeyError as e:
        where = " and ".join(f"{'/'.join(path + (name,))}_{{i}} or {'/'.join(path + (name,))}"
                             for path, name, _ in stacks)
        detail = e.args[0] if " " in str(e.args[0]) else f"no {e.args[0]!r}"
        raise ConversionError(f"{what}: expected the layers at {where} ({detail}); are these "
                              "the params of this module's config?") from None


# ============================================================================ torch

def torch_tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Numpy state dict -> torch tensors (lazy torch import).

    Keys holding the same numpy array (tied weights) get the same tensor, as in HF's own
    ``state_dict()``; bfloat16 arrays become bfloat16 tensors.
    """
    import torch

    out, seen = {}, {}
    for key, array in arrays.items():
        if id(array) in seen:
            out[key] = out[seen[id(array)]]
            continue
        seen[id(array)] = key
        if array.dtype.name == "bfloat16":
            out[key] = torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
        else:
            out[key] = torch.from_numpy(np.array(array))     # a writable copy
    return out
