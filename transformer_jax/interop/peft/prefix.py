"""PEFT prefix tuning adapters (``PrefixTuningConfig``, ``peft_type`` PREFIX_TUNING) to and
from a GPT's ``prefix_key``/``prefix_value`` parameters (``GPTConfig.prefix_tokens``).

A saved adapter directory (``PeftModel.save_pretrained``) holds ``adapter_config.json`` and
``adapter_model.safetensors`` with one tensor, ``prompt_embeddings`` of shape
(P, L * 2 * token_dim), token_dim = K * H (K key/value heads of head dim H; PEFT sets
``num_attention_heads`` = K and ``token_dim`` = K * H for grouped-query models). PEFT reads
each row as (L, 2, K, H): layer l's key is ``[:, l, 0]``, its value ``[:, l, 1]``, each
(P, K, H), exactly our ``h_{l}/self_attn/prefix_key`` and ``prefix_value`` (scanned
``h/self_attn/...`` with a leading (L,) axis). An adapter trained with
``prefix_projection=True`` stores the MLP's output there, which is what PEFT then loads, so
it converts too; we write ``prefix_projection: false``.

Neither direction imports torch or peft (``safetensors.numpy``). The base model converts
on its own: ``from_hf`` (without ``prefix_tokens``), then ``GPT(config.replace(
prefix_tokens=P))`` and :func:`prefix_from_peft` onto its params; back, ``to_hf`` takes
the params :func:`without_prefix` and :func:`prefix_to_peft` writes the adapter.
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ...errors import UserError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
TENSOR = "prompt_embeddings"
PARAM_NAMES = ("prefix_key", "prefix_value")


def _dims(module: Any) -> tuple[int, int, int, int, str]:
    """(P, L, K, H, layer name) of a prefix-tuned decoder-only model."""
    cfg = getattr(module, "config", None)
    p = getattr(cfg, "prefix_tokens", 0)
    if not p:
        raise UserError(f"{type(module).__name__}: prefix tuning needs a config with "
                        f"prefix_tokens > 0 (got {p!r}), e.g. GPTConfig(..., prefix_tokens=20)")
    stacks = cfg.layer_stacks
    if len(stacks) != 1 or stacks[0][0] != ():
        raise UserError(f"{type(cfg).__name__}: PEFT prefix conversion handles decoder-only "
                        f"models with one layer stack; this one has {stacks}")
    _, name, layers = stacks[0]
    return p, layers, cfg.num_kv_heads or cfg.num_heads, cfg.head_dim, name


def prefix_embeddings(module: Any, params: Any) -> np.ndarray:
    """The model's prefix as PEFT's ``prompt_embeddings`` (P, L * 2 * K * H), fp32 (or the
    parameters' float16/float64)."""
    p, layers, kh, h, name = _dims(module)
    if name in params:                                   # scanned: (L, P, K, H)
        attn = params[name]["self_attn"]
        kv = [np.asarray(attn[n]) for n in PARAM_NAMES]
    else:
        missing = [f"{name}_{i}" for i in range(layers) if f"{name}_{i}" not in params]
        if missing:
            raise UserError(f"params have no layers {missing}: not this model's parameters")
        kv = [np.stack([np.asarray(params[f"{name}_{i}"]["self_attn"][n]) for i in range(layers)])
              for n in PARAM_NAMES]
    for n, x in zip(PARAM_NAMES, kv):
        if x.shape != (layers, p, kh, h):
            raise UserError(f"{n} of shape {x.shape[1:]} per layer (x{x.shape[0]}) does not fit "
                            f"the config's (P, K, H) = {(p, kh, h)} x {layers} layers")
    out = np.stack(kv, axis=2).transpose(1, 0, 2, 3, 4).reshape(p, layers * 2 * kh * h)
    return out if out.dtype in (np.float16, np.float32, np.float64) else out.astype(np.float32)


def with_prefix_embeddings(module: Any, params: Any, embeddings: Any) -> dict:
    """``params`` (either layout; with or without prefix parameters, e.g. straight from
    ``interop.from_hf``) with the prefix set from PEFT's ``prompt_embeddings``
    (P, L * 2 * K * H). Returns a new tree; ``params`` is not modified."""
    p, layers, kh, h, name = _dims(module)
    emb = np.asarray(embeddings)
    if emb.shape != (p, layers * 2 * kh * h):
        raise UserError(f"prompt_embeddings of shape {emb.shape} do not fit the model: "
                        f"(prefix_tokens, num_layers * 2 * kv_heads * head_dim) = "
                        f"({p}, {layers} * 2 * {kh} * {h} = {layers * 2 * kh * h})")
    dtype = np.dtype(getattr(module.config, "param_dtype", "float32"))
    kv = emb.reshape(p, layers, 2, kh, h).transpose(1, 2, 0, 3, 4).astype(dtype)  # (L, 2, P, K, H)
    out = dict(params)
    if name in params:
        attn = dict(params[name]["self_attn"])
        attn.update(prefix_key=kv[:, 0], prefix_value=kv[:, 1])
        out[name] = {**params[name], "self_attn": attn}
        return out
    for i in range(layers):
        layer = params.get(f"{name}_{i}")
        if layer is None or "self_attn" not in layer:
            raise UserError(f"params have no {name}_{i}/self_attn: not this model's parameters")
        out[f"{name}_{i}"] = {**layer, "self_attn": {**layer["self_attn"],
                                                     "prefix_key": kv[i, 0],
                                                     "prefix_value": kv[i, 1]}}
    return out


def without_prefix(params: Any) -> dict:
    """``params`` without the ``prefix_key``/``prefix_value`` leaves (the base model's,
    e.g. for ``interop.to_hf`` with the module built with ``prefix_tokens=0``)."""
    if not isinstance(params, dict) and not hasattr(params, "items"):
        return params
    return {k: without_prefix(v) for k, v in params.items() if k not in PARAM_NAMES}


def _read_config(adapter_dir: str) -> dict:
    path = os.path.join(adapter_dir, CONFIG_NAME)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise UserError(f"{adapter_dir}: no {CONFIG_NAME} (not a PEFT adapter directory)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: cannot read the adapter config ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "PREFIX_TUNING":
        got = config.get("peft_type") if isinstance(config, dict) else config
        raise UserError(f"{path}: peft_type {got!r} is not a prefix tuning adapter "
                        "(PREFIX_TUNING); LoRA adapters convert with interop.peft")
    return config


def prefix_from_peft(module: Any, params: Any, adapter_dir: str) -> dict:
    """``params`` with the prefix of the PEFT prefix tuning adapter saved in ``adapter_dir``
    (``adapter_config.json`` + ``adapter_model.safetensors``). The adapter must match the
    model: ``num_virtual_tokens`` = ``prefix_tokens``, ``num_layers``, and
    ``num_attention_heads`` / ``token_dim`` = the key/value heads and their width."""
    from safetensors.numpy import load_file

    config = _read_config(adapter_dir)
    if not getattr(getattr(module, "config", None), "prefix_tokens", 0):
        raise UserError(f"{type(module).__name__}: the adapter in {adapter_dir} needs a model "
                        f"with prefix_tokens={config.get('num_virtual_tokens')!r} (its "
                        "num_virtual_tokens): module.clone(config=module.config.replace("
                        "prefix_tokens=...))")
    p, layers, kh, h, _ = _dims(module)
    want = dict(num_virtual_tokens=p, num_layers=layers, num_attention_heads=kh, token_dim=kh * h,
                num_transformer_submodules=1)
    wrong = {k: (config.get(k), v) for k, v in want.items() if config.get(k, v) != v}
    if wrong:
        detail = ", ".join(f"{k}={got!r} (the model: {v})" for k, (got, v) in wrong.items())
        raise UserError(f"{adapter_dir}: the adapter does not fit the model: {detail}; build "
                        "the model with prefix_tokens = the adapter's num_virtual_tokens, from "
                        "the base model the adapter was trained on")
    path = os.path.join(adapter_dir, WEIGHTS_NAME)
    if not os.path.exists(path):
        raise UserError(f"{adapter_dir}: no {WEIGHTS_NAME} (only safetensors adapters are read; "
                        "save with PeftModel.save_pretrained(..., safe_serialization=True))")
    try:
        tensors = load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors' own error types
        raise UserError(f"{path}: cannot read the adapter weights ({e})") from None
    if TENSOR not in tensors:
        raise UserError(f"{path}: no {TENSOR!r} tensor (found {sorted(tensors)})")
    return with_prefix_embeddings(module, params, tensors[TENSOR])


def prefix_to_peft(module: Any, params: Any, out_dir: str, *,
                   base_model_name_or_path: str | None = None) -> None:
    """Write the model's prefix as a PEFT adapter directory that
    ``PeftModel.from_pretrained(base_model, out_dir)`` loads (``task_type`` CAUSAL_LM)."""
    p, layers, kh, h, _ = _dims(module)
    from safetensors.numpy import save_file

    emb = np.ascontiguousarray(prefix_embeddings(module, params))
    os.makedirs(out_dir, exist_ok=True)
    config = dict(
        peft_type="PREFIX_TUNING", task_type="CAUSAL_LM", num_virtual_tokens=p,
        num_layers=layers, num_attention_heads=kh, token_dim=kh * h, encoder_hidden_size=kh * h,
        num_transformer_submodules=1, prefix_projection=False, inference_mode=True,
        base_model_name_or_path=base_model_name_or_path, revision=None)
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({TENSOR: emb}, os.path.join(out_dir, WEIGHTS_NAME))
