"""Hugging Face <-> transformer_jax conversion (GPT-2 today; a registry for later families).

Entry points::

    module, params = from_hf(hf_model)                  # a live transformers PyTorch model
    module, params = from_hf("/path/to/save_pretrained_dir", scan_layers=True)
    state_dict = to_hf(module, params)                  # torch tensors, strict-loadable
    arrays = to_hf_numpy(module, params)                # the same, as numpy arrays (no torch)
    hf_cfg = hf_config(module.config)                   # transformers.GPT2Config

torch and transformers are imported lazily, only by the functions that need them:
importing this module, and loading a ``save_pretrained`` directory (``config.json`` plus
``model.safetensors`` or a sharded ``model.safetensors.index.json``), never import torch.

Families. ``from_hf`` reads the HF config's ``model_type`` and dispatches through a small
registry (``register_hf_family``); ``to_hf``/``hf_config`` dispatch on the flax config's
type. GPT-2 (``model_type="gpt2"``) is registered here; BERT, T5 and ViT add their own
``HFFamily`` the same way.

GPT-2 weight layout. HF's ``Conv1D`` stores weights as (in, out), so no transposes are
needed except for the (untied) ``lm_head`` (an ``nn.Linear``: (out, in)). One table of
``ParamRule`` entries (``GPT2_GLOBAL_RULES``, ``GPT2_LAYER_RULES``, ``GPT2_LM_HEAD_RULE``)
drives both directions, and ``GPT2_CONFIG_FIELDS`` / ``GPT2_ACTIVATIONS`` do the same for
the config. Legend: V vocab, P positions, D width, N heads, H = D / N, F MLP width.

    HF key (after the optional ``transformer.`` prefix)   shape      flax path, shape
    wte.weight                                           (V, D)     wte/embedding (V, D)
    wpe.weight                                           (P, D)     wpe/embedding (P, D)
    h.{i}.ln_1.{weight,bias}                             (D,)       h_{i}/norm1/{scale,bias}
    h.{i}.attn.c_attn.weight                             (D, 3D)    self_attn/{query,key,value}/kernel (D, N, H)
    h.{i}.attn.c_attn.bias                               (3D,)      self_attn/{query,key,value}/bias (N, H)
    h.{i}.attn.c_proj.weight                             (D, D)     self_attn/out/kernel (N, H, D)
    h.{i}.attn.c_proj.bias                               (D,)       self_attn/out/bias (D,)
    h.{i}.ln_2.{weight,bias}                             (D,)       h_{i}/norm2/{scale,bias}
    h.{i}.mlp.c_fc.{weight,bias}                         (D, F)     mlp/wi/{kernel,bias}
    h.{i}.mlp.c_proj.{weight,bias}                       (F, D)     mlp/wo/{kernel,bias}
    ln_f.{weight,bias}                                   (D,)       ln_f/{scale,bias}
    lm_head.weight (untied only; no prefix)              (V, D)     lm_head/kernel (D, V)

Keys that are not parameters:
  * ``lm_head.weight`` of a *tied* model (a live model's ``state_dict()`` lists it; a
    ``save_pretrained`` file omits it) is accepted only if it equals ``wte.weight``.
  * ``h.{i}.attn.bias`` (1, 1, P, P) and ``h.{i}.attn.masked_bias`` () are the causal-mask
    buffers that older transformers versions saved into checkpoints. They carry no learned
    state (our attention builds its causal mask itself), so they are dropped after a check:
    ``attn.bias`` must be the lower-triangular causal mask; ``masked_bias`` (the fill value
    for masked logits, -1e4) is only shape-checked, since any such fill gives a softmax
    weight of exactly 0 in fp32, as our finfo.min fill does. ``to_hf`` never emits them
    (current ``GPT2LMHeadModel`` has no such buffers, so a strict load rejects them).
  * Anything else unexpected, any missing key and any shape mismatch raise
    ``ConversionError`` (a ``ValueError``) naming the key (and the expected/actual shape).

A ``GPT2Model`` (no ``transformer.`` prefix, no LM head) converts to a ``GPT`` that reads
out through the tied embedding, whatever the config's ``tie_word_embeddings`` says.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..models.gpt import GPT, GPTConfig
from ._common import ConversionError, StateDictReader, flatten_params, unflatten_params

# ============================================================================ registry


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """How one model family converts, registered under its HF ``model_type`` names.

    from_state_dict(hf_config: dict, state_dict: Mapping[str, array-like], **overrides)
        -> (flax_module, params); ``overrides`` replace fields of the flax config.
    to_state_dict(flax_module, params) -> dict[str, np.ndarray] in HF naming.
    make_hf_config(flax_config, **extra) -> a ``transformers`` config object.
    """
    name: str
    model_types: tuple[str, ...]
    config_type: type
    from_state_dict: Callable[..., tuple[Any, Any]]
    to_state_dict: Callable[[Any, Any], dict[str, np.ndarray]]
    make_hf_config: Callable[..., Any]


_FAMILIES: dict[str, HFFamily] = {}


def register_hf_family(family: HFFamily) -> None:
    """Make ``from_hf`` accept ``family.model_types`` and ``to_hf`` accept ``family.config_type``."""
    for model_type in family.model_types:
        _FAMILIES[model_type] = family


def supported_model_types() -> list[str]:
    return sorted(_FAMILIES)


def _family_for_model_type(model_type: Any) -> HFFamily:
    if model_type not in _FAMILIES:
        raise ValueError(f"unsupported Hugging Face model_type {model_type!r}; supported: "
                         f"{supported_model_types()}")
    return _FAMILIES[model_type]


def _family_for_config(config: Any) -> HFFamily:
    for family in _FAMILIES.values():
        if isinstance(config, family.config_type):
            return family
    raise TypeError(f"no Hugging Face converter for config type {type(config).__name__}; "
                    f"supported: {sorted({f.config_type.__name__ for f in _FAMILIES.values()})}")


# ============================================================================ sources

class _SafetensorsDir(Mapping):
    """Lazy ``{key: np.ndarray}`` over the safetensors file(s) of a ``save_pretrained`` dir.

    Reads ``model.safetensors`` or, for sharded checkpoints, every shard named in
    ``model.safetensors.index.json``. Tensors load on access, with ``safetensors.numpy``
    except bfloat16 ones (numpy has no bf16), which are read from the file by the offsets
    in its JSON header.
    """

    def __init__(self, directory: str):
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = {k: os.path.join(directory, v) for k, v in weight_map.items()}
        elif os.path.exists(single):
            files = None
        else:
            present = sorted(os.listdir(directory))
            raise FileNotFoundError(
                f"{directory}: no model.safetensors or model.safetensors.index.json (found "
                f"{present}); save the HF model with save_pretrained(..., safe_serialization=True)")
        self._handles = {}
        if files is None:
            self._handles[single] = safe_open(single, framework="numpy")
            files = {k: single for k in self._handles[single].keys()}
        else:
            for path in sorted(set(files.values())):
                self._handles[path] = safe_open(path, framework="numpy")
            for key, path in files.items():
                if key not in self._handles[path].keys():
                    raise KeyError(f"{index} maps {key!r} to {path}, which does not contain it")
        self._files = files

    def __getitem__(self, key: str) -> np.ndarray:
        path = self._files[key]
        handle = self._handles[path]
        if handle.get_slice(key).get_dtype() == "BF16":
            return _read_bf16(path, key)
        return handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def _read_bf16(path: str, key: str) -> np.ndarray:
    """One BF16 tensor of a safetensors file: 8-byte header size, JSON header, raw data."""
    import ml_dtypes

    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        entry = json.loads(f.read(header_len))[key]
        start, end = entry["data_offsets"]
        f.seek(8 + header_len + start)
        data = f.read(end - start)
    return np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(entry["shape"])


def _load_local_dir(directory: str) -> tuple[dict, Mapping[str, np.ndarray]]:
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{directory}: no config.json; expected a directory written by "
                                "save_pretrained")
    with open(config_path) as f:
        config = json.load(f)
    return config, _SafetensorsDir(directory)


# ============================================================================ public API

def from_hf(model_or_local_dir: Any, **overrides: Any) -> tuple[Any, Any]:
    """Convert a Hugging Face model to ``(flax_module, params)``.

    Args:
      model_or_local_dir: a live ``transformers`` PyTorch model (e.g. ``GPT2LMHeadModel``
        or ``GPT2Model``), or the path of a ``save_pretrained`` directory holding
        ``config.json`` and safetensors weights (read without torch).
      **overrides: fields of the flax config to set on top of the converted HF config, e.g.
        ``scan_layers=True`` (params then carry a stacked (L, ...) ``h``), ``remat=True``,
        ``dtype="bfloat16"``, ``param_dtype`` (the dtype the params are cast to) or
        ``dropout_rate``. Fields that change the architecture are rejected by the shape
        checks.

    Returns:
      The flax module (e.g. ``GPT``) and its params: a nested dict of jax arrays, the tree
      that ``module.apply({'params': params}, ...)`` takes.

    Raises:
      ValueError: an unsupported ``model_type`` (the message lists the supported ones) or
        config option (named); ``ConversionError`` (a ``ValueError``) for an unexpected or
        missing state-dict key (named) or a shape mismatch (key, expected and actual shape).
    """
    if isinstance(model_or_local_dir, (str, os.PathLike)):
        directory = os.fspath(model_or_local_dir)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"{directory!r} is not a directory; from_hf takes a live HF "
                                    "model or a local save_pretrained directory (no hub downloads)")
        config, state_dict = _load_local_dir(directory)
    elif hasattr(model_or_local_dir, "config") and hasattr(model_or_local_dir, "state_dict"):
        config = model_or_local_dir.config.to_dict()
        state_dict = model_or_local_dir.state_dict()
    else:
        raise TypeError(f"from_hf takes a transformers PyTorch model or a local directory path, "
                        f"got {type(model_or_local_dir).__name__}")
    return from_hf_state_dict(config, state_dict, **overrides)


def from_hf_state_dict(hf_config_: Any, state_dict: Mapping[str, Any], **overrides: Any):
    """``from_hf`` from parts: an HF config (object or dict) and a state dict of arrays/tensors.

    ``state_dict`` values may be numpy arrays or torch tensors (bfloat16 ones are widened
    to float32, then cast to the flax config's ``param_dtype``).
    """
    config = hf_config_ if isinstance(hf_config_, Mapping) else hf_config_.to_dict()
    family = _family_for_model_type(config.get("model_type"))
    return family.from_state_dict(config, state_dict, **overrides)


def to_hf_numpy(module: Any, params: Any) -> dict[str, np.ndarray]:
    """Flax module + params -> HF state dict of numpy arrays (HF naming and layout)."""
    return _family_for_config(module.config).to_state_dict(module, params)


def to_hf(module: Any, params: Any) -> dict[str, Any]:
    """Flax module + params -> HF state dict of torch tensors.

    ``HFModel(hf_config(module.config)).load_state_dict(sd, strict=True)`` accepts it.
    Tensors share names with HF's own ``state_dict()``; like it, a tied ``lm_head.weight``
    is the same tensor as ``transformer.wte.weight``.
    """
    import torch

    arrays = to_hf_numpy(module, params)
    out, seen = {}, {}
    for key, array in arrays.items():
        if id(array) in seen:                 # tied weights: share the tensor, as HF does
            out[key] = out[seen[id(array)]]
            continue
        seen[id(array)] = key
        if array.dtype.name == "bfloat16":
            out[key] = torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
        else:
            out[key] = torch.from_numpy(np.array(array))     # a writable copy
    return out


def hf_config(config: Any, **extra: Any) -> Any:
    """The ``transformers`` config equivalent to a flax config (e.g. ``GPTConfig`` -> ``GPT2Config``).

    ``extra`` is passed on to the HF config (e.g. ``pad_token_id``, ``eos_token_id``).
    """
    return _family_for_config(config).make_hf_config(config, **extra)


# ============================================================================ GPT-2

#: HF config attribute <-> GPTConfig field, one table for both directions.
GPT2_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("n_positions", "max_len"),
    ("n_layer", "num_layers"),
    ("n_head", "num_heads"),
    ("n_embd", "d_model"),
    ("n_inner", "mlp_dim"),
    ("layer_norm_epsilon", "norm_eps"),
    ("tie_word_embeddings", "tie_embeddings"),
    ("resid_pdrop", "dropout_rate"),
    ("attn_pdrop", "attention_dropout_rate"),
    ("initializer_range", "initializer_range"),
)

#: HF ``activation_function`` -> our activation name. The first HF name listed for an
#: activation is the one ``hf_config`` writes.
GPT2_ACTIVATIONS: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu": "gelu",
    "gelu_python": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
    "tanh": "tanh",
}

#: HF options that our GPT implements only at one value: name -> the supported value.
GPT2_FIXED_OPTIONS: dict[str, Any] = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


def gpt_config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """HF GPT-2 config (as a dict) -> ``GPTConfig``; unsupported options raise, naming them."""
    if config.get("model_type") != "gpt2":
        raise ValueError(f"expected a GPT-2 config (model_type 'gpt2'), got model_type "
                         f"{config.get('model_type')!r}")
    for option, supported in GPT2_FIXED_OPTIONS.items():
        if option in config and config[option] != supported:
            raise ValueError(f"unsupported GPT-2 config option {option}={config[option]!r}: "
                             f"transformer_jax's GPT implements only {option}={supported!r}")
    act = config.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise ValueError(f"unsupported GPT-2 config option activation_function={act!r}; "
                         f"supported: {sorted(GPT2_ACTIVATIONS)}")
    embd, resid = config.get("embd_pdrop"), config.get("resid_pdrop")
    if embd is not None and resid is not None and embd != resid:
        warnings.warn(f"GPT-2 config has embd_pdrop={embd} != resid_pdrop={resid}; GPTConfig has "
                      f"one dropout_rate for both and uses resid_pdrop={resid} (no effect on "
                      "inference)", stacklevel=3)
    values = {ours: config[hf] for hf, ours in GPT2_CONFIG_FIELDS if hf in config}
    values["activation"] = GPT2_ACTIVATIONS[act]
    values.update(overrides)
    return GPTConfig.from_dict(values)


def gpt2_hf_config(config: GPTConfig, **extra: Any):
    """``GPTConfig`` -> ``transformers.GPT2Config`` (lazy import); options GPT-2 lacks raise."""
    from transformers import GPT2Config

    _check_gpt2_compatible(config)
    reverse_act = {}
    for hf_name, ours in GPT2_ACTIVATIONS.items():
        reverse_act.setdefault(ours, hf_name)
    values = {hf: getattr(config, ours) for hf, ours in GPT2_CONFIG_FIELDS}
    values.update(activation_function=reverse_act[config.activation],
                  embd_pdrop=config.dropout_rate, **GPT2_FIXED_OPTIONS)
    # HF's default bos/eos (50256) only make sense inside the vocabulary.
    if config.vocab_size <= 50256:
        values.update(bos_token_id=None, eos_token_id=None)
    values.update(extra)
    return GPT2Config(**values)


def _check_gpt2_compatible(config: GPTConfig) -> None:
    """Raise for GPTConfig options that a GPT-2 checkpoint cannot express."""
    bad = []
    if config.num_kv_heads not in (None, config.num_heads):
        bad.append(f"num_kv_heads={config.num_kv_heads} (GPT-2 has no grouped-query attention)")
    if config.gated_mlp:
        bad.append("gated_mlp=True")
    if config.norm != "layernorm":
        bad.append(f"norm={config.norm!r}")
    if config.position != "learned":
        bad.append(f"position={config.position!r}")
    if not config.use_bias:
        bad.append("use_bias=False")
    if config.activation not in GPT2_ACTIVATIONS.values():
        bad.append(f"activation={config.activation!r}")
    if bad:
        raise ValueError("GPTConfig option(s) not expressible as GPT-2: " + "; ".join(bad))


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """One HF tensor <-> one or more flax params. ``{i}`` in names is the layer index.

    hf: HF key without the ``transformer.`` prefix (``lm_head.*`` is never prefixed).
    flax: '/'-joined paths in the unscanned param tree.
    hf_shape(cfg): the HF tensor's shape.
    split(array, cfg) -> arrays for ``flax`` (HF -> flax); join(arrays, cfg) -> array (flax -> HF).
    """
    hf: str
    flax: tuple[str, ...]
    hf_shape: Callable[[GPTConfig], tuple[int, ...]]
    split: Callable[[np.ndarray, GPTConfig], tuple[np.ndarray, ...]]
    join: Callable[[tuple[np.ndarray, ...], GPTConfig], np.ndarray]


def _same(a, cfg):
    return (a,)


def _single(arrays, cfg):
    return arrays[0]


def _split_qkv_kernel(a, cfg):             # (D, 3D) -> 3 x (D, N, H)
    d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
    return tuple(x.reshape(d, n, h) for x in np.split(a, 3, axis=1))


def _join_qkv_kernel(arrays, cfg):         # 3 x (D, N, H) -> (D, 3D)
    return np.concatenate([x.reshape(cfg.d_model, -1) for x in arrays], axis=1)


def _split_qkv_bias(a, cfg):               # (3D,) -> 3 x (N, H)
    return tuple(x.reshape(cfg.num_heads, cfg.head_dim) for x in np.split(a, 3))


def _join_qkv_bias(arrays, cfg):           # 3 x (N, H) -> (3D,)
    return np.concatenate([x.reshape(-1) for x in arrays])


def _heads_out(a, cfg):                    # (D_in = N*H, D) -> (N, H, D)
    return (a.reshape(cfg.num_heads, cfg.head_dim, cfg.d_model),)


def _flat_out(arrays, cfg):                # (N, H, D) -> (N*H, D)
    return arrays[0].reshape(cfg.d_model, cfg.d_model)


def _transpose(a, cfg):                    # nn.Linear (out, in) <-> Dense (in, out)
    return (a.T,)


def _untranspose(arrays, cfg):
    return arrays[0].T


def _vec(n):
    return lambda cfg: (n(cfg),)


_D = lambda c: c.d_model                   # noqa: E731
_F = lambda c: c.mlp_features              # noqa: E731


def _identity(hf, flax, shape):
    return ParamRule(hf, (flax,), shape, _same, _single)


def _norm(hf, flax):
    return [_identity(f"{hf}.weight", f"{flax}/scale", _vec(_D)),
            _identity(f"{hf}.bias", f"{flax}/bias", _vec(_D))]


_QKV = tuple(f"h_{{i}}/self_attn/{p}" for p in ("query", "key", "value"))

#: Per-layer rules (``{i}`` = layer index).
GPT2_LAYER_RULES: tuple[ParamRule, ...] = (
    *_norm("h.{i}.ln_1", "h_{i}/norm1"),
    ParamRule("h.{i}.attn.c_attn.weight", tuple(f"{p}/kernel" for p in _QKV),
              lambda c: (c.d_model, 3 * c.d_model), _split_qkv_kernel, _join_qkv_kernel),
    ParamRule("h.{i}.attn.c_attn.bias", tuple(f"{p}/bias" for p in _QKV),
              lambda c: (3 * c.d_model,), _split_qkv_bias, _join_qkv_bias),
    ParamRule("h.{i}.attn.c_proj.weight", ("h_{i}/self_attn/out/kernel",),
              lambda c: (c.d_model, c.d_model), _heads_out, _flat_out),
    _identity("h.{i}.attn.c_proj.bias", "h_{i}/self_attn/out/bias", _vec(_D)),
    *_norm("h.{i}.ln_2", "h_{i}/norm2"),
    _identity("h.{i}.mlp.c_fc.weight", "h_{i}/mlp/wi/kernel", lambda c: (c.d_model, c.mlp_features)),
    _identity("h.{i}.mlp.c_fc.bias", "h_{i}/mlp/wi/bias", _vec(_F)),
    _identity("h.{i}.mlp.c_proj.weight", "h_{i}/mlp/wo/kernel", lambda c: (c.mlp_features, c.d_model)),
    _identity("h.{i}.mlp.c_proj.bias", "h_{i}/mlp/wo/bias", _vec(_D)),
)

#: Rules outside the layers; ``lm_head`` applies only to untied models.
GPT2_GLOBAL_RULES: tuple[ParamRule, ...] = (
    _identity("wte.weight", "wte/embedding", lambda c: (c.vocab_size, c.d_model)),
    _identity("wpe.weight", "wpe/embedding", lambda c: (c.max_len, c.d_model)),
    *_norm("ln_f", "ln_f"),
)
GPT2_LM_HEAD_RULE = ParamRule("lm_head.weight", ("lm_head/kernel",),
                              lambda c: (c.vocab_size, c.d_model), _transpose, _untranspose)

#: Causal-mask buffers of old checkpoints: (key, shape(cfg)); shape-checked and dropped.
GPT2_LEGACY_BUFFERS: tuple[tuple[str, Callable[[GPTConfig], tuple[int, ...]]], ...] = (
    ("h.{i}.attn.bias", lambda c: (1, 1, c.max_len, c.max_len)),
    ("h.{i}.attn.masked_bias", lambda c: ()),
)


def _gpt2_rules(cfg: GPTConfig) -> list[tuple[ParamRule, int | None]]:
    """Every (rule, layer index) pair for ``cfg``, in HF state-dict order."""
    rules = [(r, None) for r in GPT2_GLOBAL_RULES[:2]]
    rules += [(r, i) for i in range(cfg.num_layers) for r in GPT2_LAYER_RULES]
    rules += [(r, None) for r in GPT2_GLOBAL_RULES[2:]]
    if not cfg.tie_embeddings:
        rules.append((GPT2_LM_HEAD_RULE, None))
    return rules


def _fmt(template: str, i: int | None) -> str:
    return template if i is None else template.format(i=i)


def _expected_flax_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """'/'-joined path -> shape of the unscanned params of ``GPT(cfg)``, without allocating."""
    import flax.linen as nn

    module = GPT(cfg.replace(scan_layers=False))
    ids = jnp.zeros((1, 1), jnp.int32)
    tree = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), ids))["params"]
    return {"/".join(path): tuple(x.shape)
            for path, x in flatten_params(nn.meta.unbox(tree)).items()}


def _stack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """Unscanned ``h_0 .. h_{L-1}`` -> one ``h`` whose leaves have a leading (L,) axis."""
    params = dict(params)
    layers = [params.pop(f"h_{i}") for i in range(num_layers)]
    params["h"] = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *layers)
    return params


def _unstack_layers(params: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Inverse of ``_stack_layers``."""
    params = dict(params)
    if "h" not in params:
        raise ConversionError(f"config says scan_layers=True but the params have no stacked 'h' "
                              f"(top-level keys: {sorted(params)})")
    stacked = params.pop("h")
    for i in range(num_layers):
        params[f"h_{i}"] = jax.tree_util.tree_map(lambda x: x[i], stacked)
    return params


def _check_causal_buffer(key: str, array: np.ndarray, cfg: GPTConfig) -> None:
    """An old checkpoint's ``attn.bias`` must be the plain causal mask (anything else changes the model)."""
    if not np.array_equal(array.reshape(cfg.max_len, cfg.max_len).astype(bool),
                          np.tri(cfg.max_len, dtype=bool)):
        raise ConversionError(f"{key!r}: this causal-mask buffer is not lower-triangular ones; "
                              "a model with another attention pattern is not GPT-2")


def _gpt2_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                          **overrides: Any) -> tuple[GPT, dict[str, Any]]:
    """GPT-2 state dict (``GPT2LMHeadModel`` or ``GPT2Model`` naming) -> ``(GPT, params)``."""
    reader = StateDictReader(state_dict, what="GPT-2 state dict")
    base_model = "wte.weight" in reader and "transformer.wte.weight" not in reader
    prefix = "" if base_model else "transformer."
    if base_model:                       # GPT2Model: no LM head, read out through wte
        overrides = {"tie_embeddings": True, **overrides}
    cfg = gpt_config_from_hf(config, **overrides)

    flat: dict[str, np.ndarray] = {}
    for rule, i in _gpt2_rules(cfg):
        hf_key = rule.hf if rule.hf.startswith("lm_head") else prefix + _fmt(rule.hf, i)
        for path, part in zip(rule.flax, rule.split(reader.take(hf_key, rule.hf_shape(cfg)), cfg)):
            flat[_fmt(path, i)] = part
    if cfg.tie_embeddings and not base_model and "lm_head.weight" in reader:
        head = reader.take("lm_head.weight", (cfg.vocab_size, cfg.d_model))
        if not np.array_equal(head, flat["wte/embedding"]):
            raise ConversionError("'lm_head.weight' differs from 'transformer.wte.weight' although "
                                  "the config says tie_word_embeddings=True; pass "
                                  "tie_embeddings=False to keep a separate head")
    for i in range(cfg.num_layers):
        for template, shape in GPT2_LEGACY_BUFFERS:
            key = prefix + template.format(i=i)
            if key in reader:
                array = reader.take(key, shape(cfg))
                if template.endswith(".attn.bias"):
                    _check_causal_buffer(key, array, cfg)
    reader.finish()

    expected = _expected_flax_shapes(cfg)
    if set(flat) != set(expected):           # a bug in the rule table, not in the input
        raise AssertionError(f"GPT-2 rule table out of sync with GPT: missing "
                             f"{sorted(set(expected) - set(flat))}, extra "
                             f"{sorted(set(flat) - set(expected))}")
    for path, shape in expected.items():
        if flat[path].shape != shape:
            raise AssertionError(f"GPT-2 rule table: {path} converted to {flat[path].shape}, "
                                 f"GPT expects {shape}")
    param_dtype = jnp.dtype(cfg.param_dtype)
    params = unflatten_params({tuple(k.split("/")): np.asarray(v, dtype=param_dtype)
                               for k, v in flat.items()})
    if cfg.scan_layers:
        params = _stack_layers(params, cfg.num_layers)
    return GPT(cfg), jax.tree_util.tree_map(jnp.asarray, params)


def _gpt2_to_state_dict(module: GPT, params: Any) -> dict[str, np.ndarray]:
    """``(GPT, params)`` -> ``GPT2LMHeadModel`` state dict of numpy arrays.

    ``params`` may be the params tree or the whole ``{'params': ...}`` variables dict,
    boxed (``nn.Partitioned``) or not, scanned when ``module.config.scan_layers``.
    """
    import flax.linen as nn

    cfg = module.config
    _check_gpt2_compatible(cfg)
    params = nn.meta.unbox(params)
    if set(params) == {"params"}:
        params = params["params"]
    params = dict(params)
    if cfg.scan_layers:
        params = _unstack_layers(params, cfg.num_layers)
    expected = _expected_flax_shapes(cfg)
    reader = StateDictReader({"/".join(p): v for p, v in flatten_params(params).items()},
                             what="GPT params")
    out: dict[str, np.ndarray] = {}
    for rule, i in _gpt2_rules(cfg):
        arrays = tuple(reader.take(_fmt(p, i), expected[_fmt(p, i)]) for p in rule.flax)
        key = rule.hf if rule.hf.startswith("lm_head") else "transformer." + _fmt(rule.hf, i)
        out[key] = np.ascontiguousarray(rule.join(arrays, cfg))
    reader.finish()
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


register_hf_family(HFFamily(
    name="gpt2", model_types=("gpt2",), config_type=GPTConfig,
    from_state_dict=_gpt2_from_state_dict, to_state_dict=_gpt2_to_state_dict,
    make_hf_config=gpt2_hf_config))

from . import hf_vit  # noqa: E402,F401  (registers the "vit" family)
from . import hf_bert  # noqa: E402,F401  (registers the "bert" family)
from . import hf_t5  # noqa: E402,F401  (registers the "t5" family)
