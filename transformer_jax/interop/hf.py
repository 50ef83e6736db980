"""Hugging Face <-> transformer_jax conversion: the public API.

Entry points::

    module, params = from_hf(hf_model)                  # a live transformers PyTorch model
    module, params = from_hf("/path/to/save_pretrained_dir", scan_layers=True)
    state_dict = to_hf(module, params)                  # torch tensors, strict-loadable
    arrays = to_hf_numpy(module, params)                # the same, as numpy arrays (no torch)
    hf_cfg = hf_config(module.config)                   # e.g. transformers.GPT2Config

torch and transformers are imported lazily, only by the functions that need them:
importing this module, and loading a ``save_pretrained`` directory (``config.json`` plus
``model.safetensors`` or a sharded ``model.safetensors.index.json``), never import torch.

Families. ``from_hf`` reads the HF config's ``model_type`` and dispatches through the
registry (:mod:`transformer_jax.interop.registry`); ``to_hf``/``hf_config`` dispatch on the
flax config's type. One file per family holds its key table and config mapping:

    model_type   flax model   file
    gpt2         GPT          hf_gpt2.py   GPT2LMHeadModel, GPT2Model
    bert         Bert         hf_bert.py   BertForPreTraining, BertForMaskedLM, BertModel,
                                           BertForSequenceClassification
    t5           T5           hf_t5.py     T5ForConditionalGeneration
    vit          ViT          hf_vit.py    ViTForImageClassification, ViTModel

Each converts both parameter layouts: unrolled layers, or one scanned stack (``scan_layers``).
Every key and shape is asserted; a mismatch raises ``ConversionError`` (a
:class:`~transformer_jax.errors.UserError`) naming the key.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping

import numpy as np

from . import hf_bert, hf_gpt2, hf_t5, hf_vit
from .registry import family_for_config, family_for_model_type, register_hf_family, torch_tensors

for _family in (hf_gpt2.FAMILY, hf_bert.FAMILY, hf_t5.FAMILY, hf_vit.FAMILY):
    register_hf_family(_family)


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
      model_or_local_dir: a live ``transformers`` PyTorch model (one of the classes in the
        module docstring), or the path of a ``save_pretrained`` directory holding
        ``config.json`` and safetensors weights (read without torch).
      **overrides: fields of the flax config to set on top of the converted HF config, e.g.
        ``scan_layers=True`` (the layers then come as one stacked (L, ...) subtree),
        ``remat=True``, ``dtype="bfloat16"``, ``param_dtype`` (the dtype the params are cast
        to) or ``dropout_rate``; ViT also takes ``image_size`` (the position table is
        resized), ``drop_pooler`` and ``pos_interpolation``. Fields that change the
        architecture are rejected by the shape checks.

    Returns:
      The flax module (e.g. ``GPT``) and its params: a nested dict of jax arrays, the tree
      that ``module.apply({'params': params}, ...)`` takes.

    Raises:
      UserError (a ``ValueError``): an unsupported ``model_type`` (the message lists the
        supported ones) or config option (named); ``ConversionError`` (a ``UserError``) for
        an unexpected or missing state-dict key (named) or a shape mismatch (key, expected
        and actual shape).
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
    family = family_for_model_type(config.get("model_type"))
    return family.from_state_dict(config, state_dict, **overrides)


def to_hf_numpy(module: Any, params: Any) -> dict[str, np.ndarray]:
    """Flax module + params -> HF state dict of numpy arrays (HF naming and layout)."""
    return family_for_config(module.config).to_state_dict(module, params)


def to_hf(module: Any, params: Any) -> dict[str, Any]:
    """Flax module + params -> HF state dict of torch tensors.

    ``HFModel(hf_config(module.config)).load_state_dict(sd, strict=True)`` accepts it.
    Tensors share names with HF's own ``state_dict()``; like it, a tied ``lm_head.weight``
    is the same tensor as ``transformer.wte.weight``.
    """
    return torch_tensors(to_hf_numpy(module, params))


def hf_config(config: Any, **extra: Any) -> Any:
    """The ``transformers`` config equivalent to a flax config (e.g. ``GPTConfig`` -> ``GPT2Config``).

    ``extra`` is passed on to the HF config (e.g. ``pad_token_id``, ``eos_token_id``).
    """
    return family_for_config(config).make_hf_config(config, **extra)
