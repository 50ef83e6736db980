"""Hugging Face <-> transformer_jax conversion: the public API.

Entry points::

    module, params = from_hf(hf_model)                  # a live transformers PyTorch model
    module, params = from_hf("/path/to/save_pretrained_dir", scan_layers=True)
    module, params = from_hf("/path/to/base_dir", adapter="/path/to/peft_adapter")   # + PEFT LoRA
    module, params = from_hf("/path/to/llama_dir", param_dtype="bfloat16", mesh=mesh,
                             quantize=LoraConfig(quantize="nf4"))   # streamed (hf/stream.py)
    state_dict = to_hf(module, params)                  # torch tensors, strict-loadable
    arrays = to_hf_numpy(module, params)                # the same, as numpy arrays (no torch)
    hf_cfg = hf_config(module.config)                   # e.g. transformers.GPT2Config

torch and transformers are imported lazily, only by the functions that need them:
importing this module, and loading a ``save_pretrained`` directory (``config.json`` plus
``model.safetensors`` or a sharded ``model.safetensors.index.json``), never import torch.

Families. ``from_hf`` reads the HF config's ``model_type`` and dispatches through the
registry (:mod:`transformer_jax.interop.hf.registry`); ``to_hf``/``hf_config`` dispatch on the
flax config's type (a ``GPTConfig`` with Llama's settings, ``position="rope"``, ``norm="rmsnorm"``,
``gated_mlp``, silu, no biases, goes to Llama, or to Mistral when it has an
``attention_window``; any other to GPT-2). One module per family holds its key table and
config mapping:

    model_type   flax model   module (hf/)   HF classes
    gpt2         GPT          gpt2.py        GPT2LMHeadModel, GPT2Model
    llama        GPT          llama.py       LlamaForCausalLM, LlamaModel
    mistral      GPT          mistral.py     MistralForCausalLM, MistralModel (Llama's
                                             table + sliding_window = attention_window)
    bert         Bert         bert.py        BertForPreTraining, BertForMaskedLM, BertModel,
                                             BertForSequenceClassification
    t5           T5           t5.py          T5ForConditionalGeneration
    vit          ViT          vit.py         ViTForImageClassification, ViTModel
    clip         CLIP         clip.py        CLIPModel

Each converts both parameter layouts: unrolled layers, or one scanned stack (``scan_layers``).
Every key and shape is asserted; a mismatch raises ``ConversionError`` (a
:class:`~transformer_jax.errors.UserError`) naming the key.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping

import numpy as np

from ...errors import UserError
from . import bert, clip, gpt2, llama, mistral, t5, vit
from .registry import (family_for_config, family_for_model_type, register_hf_family,
                       supported_model_types, torch_tensors)

for _family in (gpt2.FAMILY, llama.FAMILY, mistral.FAMILY, bert.FAMILY, t5.FAMILY,
                vit.FAMILY, clip.FAMILY):
    register_hf_family(_family)


# ============================================================================ sources
#
# Every problem with the files of a save_pretrained directory is a UserError of one line
# that names the file and what to do (a truncated or damaged file, JSON that is not what
# HF writes, a shard the index names but the directory lacks): no raw traceback.

_SAVE_AGAIN = "save the model again with save_pretrained(..., safe_serialization=True) or copy it anew"


def _read_json(path: str, what: str) -> Any:
    """The JSON value in ``path``, or a UserError naming it (``what``: what the file holds)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{path}: not valid JSON ({e}), so not {what}; the file is damaged: "
                        f"{_SAVE_AGAIN}") from None


def _check_safetensors(path: str) -> None:
    """The layout of a safetensors file (8-byte header length, JSON header, tensor data),
    read from its header alone: a UserError naming ``path`` when it is missing, truncated
    (in the header or the data) or damaged."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            header_len = int.from_bytes(head, "little")
            raw = f.read(header_len) if len(head) == 8 and 8 + header_len <= size else b""
    except OSError as e:
        raise UserError(f"{path}: cannot read the safetensors file ({e.strerror or e}); "
                        f"{_SAVE_AGAIN}") from None
    if size < 8:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes, shorter than its "
                        f"8-byte header length); {_SAVE_AGAIN}")
    if 8 + header_len > size:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes; its header alone "
                        f"needs {8 + header_len}); {_SAVE_AGAIN}")
    try:
        header = json.loads(raw)
        end = max([e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"],
                  default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise UserError(f"{path}: damaged safetensors file (its header is not the JSON "
                        f"safetensors writes); {_SAVE_AGAIN}") from None
    if 8 + header_len + end > size:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes; its tensors need "
                        f"{8 + header_len + end}); {_SAVE_AGAIN}")


def _open_safetensors(path: str):
    """``safe_open(path)`` after :func:`_check_safetensors`; what it still refuses is a
    UserError naming ``path``."""
    from safetensors import safe_open

    _check_safetensors(path)
    try:
        return safe_open(path, framework="numpy")
    except Exception as e:           # safetensors_rust.SafetensorError and friends
        raise UserError(f"{path}: damaged safetensors file ({e}); {_SAVE_AGAIN}") from None


def _weight_map(index: str, directory: str) -> dict[str, str]:
    """``{tensor name: shard path}`` from a ``model.safetensors.index.json``."""
    content = _read_json(index, "a safetensors index")
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise UserError(f"{index}: no \"weight_map\" object (tensor name -> shard file name) "
                        f"as save_pretrained writes; {_SAVE_AGAIN}")
    files = {k: os.path.join(directory, v) for k, v in weight_map.items()}
    for name in sorted(set(weight_map.values())):
        if not os.path.isfile(os.path.join(directory, name)):
            raise UserError(f"{index} names the shard {name!r}, which is not in {directory}; "
                            "copy every shard the index names into the directory, or "
                            f"{_SAVE_AGAIN}")
    return files


class _SafetensorsDir(Mapping):
    """Lazy ``{key: np.ndarray}`` over the safetensors file(s) of a ``save_pretrained`` dir.

    Reads ``model.safetensors`` or, for sharded checkpoints, every shard named in
    ``model.safetensors.index.json``. Tensors load on access, with ``safetensors.numpy``
    except bfloat16 ones (numpy has no bf16), which are read from the file by the offsets
    in its JSON header. Every file is checked when the directory is opened (the JSON, the
    shards named, each file's length against its header): problems are UserErrors.
    """

    #: where :func:`~transformer_jax.interop.hf.stream.stream_params` puts the leaves
    #: (a ``LoadTarget``); the decoder-only families stream when it is set
    load_target = None

    def __init__(self, directory: str):
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        if os.path.exists(index):
            files = _weight_map(index, directory)
        elif os.path.exists(single):
            files = None
        else:
            present = sorted(os.listdir(directory))
            raise UserError(
                f"{directory}: no model.safetensors or model.safetensors.index.json (found "
                f"{present}); save the HF model with save_pretrained(..., safe_serialization=True)")
        self._handles = {}
        if files is None:
            self._handles[single] = _open_safetensors(single)
            files = {k: single for k in self._handles[single].keys()}
        else:
            for path in sorted(set(files.values())):
                self._handles[path] = _open_safetensors(path)
            for key, path in files.items():
                if key not in self._handles[path].keys():
                    raise UserError(f"{index} maps {key!r} to {path}, which does not contain "
                                    f"it (the index and the shards are from different "
                                    f"checkpoints?); {_SAVE_AGAIN}")
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
    if len(data) != end - start:     # cut after it was opened
        raise UserError(f"{path}: truncated safetensors file (tensor {key!r} needs bytes "
                        f"{8 + header_len + start}..{8 + header_len + end}); {_SAVE_AGAIN}")
    return np.frombuffer(data, dtype=ml_dtypes.bfloat16).reshape(entry["shape"])


def _load_local_dir(directory: str) -> tuple[dict, Mapping[str, np.ndarray]]:
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"{directory}: no config.json; expected a directory written by "
                        "save_pretrained")
    config = _read_json(config_path, "a Hugging Face config")
    if not isinstance(config, dict):
        raise UserError(f"{config_path}: a JSON {type(config).__name__}, not the JSON object of "
                        f"a Hugging Face config; {_SAVE_AGAIN}")
    if "model_type" not in config:
        raise UserError(f"{config_path}: no \"model_type\", so the model family is unknown; "
                        f"add it (one of {supported_model_types()}) or {_SAVE_AGAIN}")
    if config["model_type"] not in supported_model_types():
        raise UserError(f"{config_path}: unsupported Hugging Face model_type "
                        f"{config['model_type']!r}; supported: {supported_model_types()}")
    return config, _SafetensorsDir(directory)


# ============================================================================ public API

def from_hf(model_or_local_dir: Any, *, adapter: str | os.PathLike | None = None,
            mesh: Any = None, shardings: Any = None, quantize: Any = None,
            **overrides: Any) -> tuple[Any, Any]:
    """Convert a Hugging Face model to ``(flax_module, params)``.

    Args:
      model_or_local_dir: a live ``transformers`` PyTorch model (one of the classes in the
        module docstring), or the path of a ``save_pretrained`` directory holding
        ``config.json`` and safetensors weights (read without torch).
      **overrides: fields of the flax config to set on top of the converted HF config, e.g.
        ``scan_layers=True`` (the layers then come as one stacked (L, ...) subtree),
        ``remat=True``, ``dtype="bfloat16"``, ``param_dtype`` (the dtype the params are cast
        to) or ``dropout_rate``; ViT also takes ``image_size`` (the position table is
        resized), ``drop_pooler`` and ``pos_interpolation``; CLIP ``image_size`` and
        ``pos_interpolation``. Fields that change the
        architecture are rejected by the shape checks. ``lora`` (a ``LoraConfig`` or its
        dict) adds fresh LoRA adapters (B zero: the model is unchanged) to train.
      mesh: a ``jax.sharding.Mesh``: every leaf is placed sharded by the training loop's
        rules (``transformer_jax.sharding``; FSDP puts each shard on its owner only).
      shardings: instead of ``mesh``, one ``Sharding`` or a nested dict of them with the
        params' structure. Neither: the default device.
      quantize: a ``LoraConfig`` with ``quantize`` set (QLoRA): the base kernels are stored
        as ``layers.quant.quantize_params`` stores them (int8 / nf4).
        A directory of a decoder-only LM (GPT-2, Llama, Mistral) is read tensor by tensor:
        each is cast to ``param_dtype`` (a bf16 checkpoint with ``param_dtype="bfloat16"``
        is never widened), quantized and placed before the next is read
        (:mod:`~transformer_jax.interop.hf.stream`), so the host holds about one tensor;
        other families are converted whole, then quantized and placed (replicated over
        a ``mesh``).
      adapter: the directory of a PEFT LoRA adapter for this model (``adapter_config.json``
        and ``adapter_model.safetensors``, as ``PeftModel.save_pretrained`` writes): the
        module's ``config.lora`` is set from ``adapter_config.json`` (rank, alpha,
        dropout, use_rslora, targets from the modules it adapts) and the params get the
        adapter's ``lora_a``/``lora_b`` (:func:`transformer_jax.interop.peft.load_peft`).

    Returns:
      The flax module (e.g. ``GPT``) and its params: a nested dict of jax arrays, the tree
      that ``module.apply({'params': params}, ...)`` takes.

    Raises:
      UserError (a ``ValueError``): an unsupported ``model_type`` (the message lists the
        supported ones) or config option (named); ``ConversionError`` (a ``UserError``) for
        an unexpected or missing state-dict key (named) or a shape mismatch (key, expected
        and actual shape); a UserError of one line naming the file and what to do for every
        problem with a directory's files: no config.json or weights, malformed JSON, a
        config without ``model_type``, a truncated or damaged safetensors file, an index
        whose shards are missing; for ``adapter``, what ``load_peft`` refuses (another
        ``peft_type``, modules it cannot map, shapes, missing or pickled files).
    """
    from .stream import LoadTarget, place_params     # lazy: jax sharding machinery

    target = LoadTarget(quantize=quantize, mesh=mesh, shardings=shardings)
    if quantize is not None and (adapter is not None or overrides.get("lora") is not None):
        raise UserError("from_hf: quantize= loads a frozen base; give the adapters (adapter=, "
                        "lora=) in a load without quantize, or train them with --init-from "
                        "and --set lora.quantize=...")
    if isinstance(model_or_local_dir, (str, os.PathLike)):
        directory = os.fspath(model_or_local_dir)
        if not os.path.isdir(directory):
            raise UserError(f"{directory!r} is not a directory; from_hf takes a live HF model "
                            "or a local save_pretrained directory (no hub downloads)")
        config, state_dict = _load_local_dir(directory)
        state_dict.load_target = target
    elif hasattr(model_or_local_dir, "config") and hasattr(model_or_local_dir, "state_dict"):
        config = model_or_local_dir.config.to_dict()
        state_dict = model_or_local_dir.state_dict()
    else:
        raise TypeError(f"from_hf takes a transformers PyTorch model or a local directory path, "
                        f"got {type(model_or_local_dir).__name__}")
    lora = overrides.pop("lora", None)       # adapters are added after the base converts
    module, params = from_hf_state_dict(config, state_dict, **overrides)
    params = place_params(module, params, target)     # what was not streamed
    if adapter is None and lora is None:
        return module, params
    from .. import peft                       # lazy: hf <- peft
    if adapter is None:
        return peft.add_adapters(module, params, lora)
    if lora is not None:                     # its quantize settings stay; the rest is the adapter's
        module = module.clone(config=module.config.replace(lora=lora))
    return peft.load_peft(module, params, adapter)


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
