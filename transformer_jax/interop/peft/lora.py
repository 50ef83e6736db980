"""Hugging Face PEFT LoRA adapters <-> the LoRA adapters of ``layers/lora.py``.

Entry points::

    to_peft(module, params, "out/adapter")          # adapter_model.safetensors + adapter_config.json
    module, params = load_peft(module, params, "path/to/adapter")
    module, params = from_hf("path/to/base", adapter="path/to/adapter")   # interop.hf

``to_peft`` writes what ``peft.PeftModel.from_pretrained(hf_base, out_dir)`` loads with no
missing or unexpected adapter key, ``hf_base`` being the model that ``to_hf(module, params)``
strict-loads into (``GPT2LMHeadModel``, ``LlamaForCausalLM``, the BERT class of
``BertConfig.head``, ``T5ForConditionalGeneration``, ``ViTForImageClassification``,
``CLIPModel``).
``load_peft`` reads an adapter that PEFT's ``save_pretrained`` wrote (safetensors only) and
returns the module with ``config.lora`` set from ``adapter_config.json`` and the params with
``lora_a`` / ``lora_b`` filled. Torch is never imported.

Which HF module holds which of our Dense layers (the LoRA sites, PEFT's pattern rules)
is :mod:`transformer_jax.interop.peft.sites`.

Tensor layout (PEFT's ``LoraLayer``, the same for ``nn.Linear`` and ``Conv1D``)::

    base_model.model.<module>.lora_A.weight   (r, in)    = lora_a (in..., r) flattened, transposed
    base_model.model.<module>.lora_B.weight   (out, r)   = lora_b (r, out...) flattened, transposed
    update: x @ A.T @ B.T * lora_alpha / r   (use_rslora: / sqrt(r))

A packed site (``c_attn``: one A (r, D), one B (3D, r)):

  * PEFT -> ours: query, key and value each get ``lora_a = A.T`` and their chunk of B. The
    loaded LoRA config's targets come from the adapter, so they cover all three (a LoRA
    config that targets only query and value would drop the key chunk; ``load_peft``
    replaces the module's LoRA config rather than refusing).
  * ours -> PEFT: where the adapted projections of a packed site share one ``lora_a``
    (e.g. after loading a PEFT adapter), the site gets rank r with B the chunks stacked
    (a projection without adapters contributes zeros). Where they differ (each Dense
    initialises its own), A is the k ``lora_a`` stacked (k*r, in) and B block-diagonal
    (out, k*r): rank k*r. Ranks other than the most common one are written through
    ``rank_pattern``, with ``alpha_pattern`` scaled so that ``alpha / r`` (rsLoRA:
    ``alpha / sqrt(r)``) is unchanged. PEFT applies the dropout mask once per site, ours
    once per Dense: equal outputs in eval mode, not in training.

Ranks. Our LoRA config has one rank and one scale. An adapter with ``rank_pattern`` or
``alpha_pattern`` loads at the largest rank R: smaller adapters are zero-padded (the extra
rank directions stay zero under training: their gradients vanish) and each B is multiplied
by its scale over the loaded config's. The loaded targets regex covers every layer of the
stack for each adapted sublayer (a scanned stack cannot do otherwise); layers the adapter
left out (``layers_to_transform``) get zero adapters.

Other tensors of the adapter file (``modules_to_save``, ``bias="all"``/``"lora_only"``)
replace the base params they map to through the same table; one that maps to nothing is
refused, named. Refused with a :class:`~transformer_jax.errors.UserError` naming what to do:
another ``peft_type``, DoRA and the other LoRA variants, embedding or conv LoRA, modules
without a LoRA-capable Dense, tensors of the wrong shape, a missing config or weights file,
``adapter_model.bin`` (pickle; re-save with safetensors).
"""
from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import math
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...layers.lora import ADAPTER_NAMES, LoraConfig
from ..common import Path, TensorMap, flatten_params, unflatten_params
from ..hf.registry import plain_params, to_layout, without_scan
from .sites import (LoraSite, hf_family, lora_scale, lora_sites, match_sites, number, pattern_value,
                    resolve, suffix_keys, targets_regex, tensor_maps)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: PEFT's prefix of every saved key (``PeftModel.base_model.model`` is the HF model)
KEY_PREFIX = "base_model.model."

#: PEFT LoraConfig options that change what an adapter computes (or where), which our
#: LoRA does not implement: any value but None/False/empty is refused.
_UNSUPPORTED_OPTIONS: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a bias on lora_B",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on nn.Parameters",
    "trainable_token_indices": "trainable tokens",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_qalora": "QA-LoRA",
    "use_bdlora": "block-diagonal LoRA",
    "arrow_config": "Arrow routing",
    "kasa_config": "KaSA",
    "monteclora_config": "MonteCLoRA",
    "velora_config": "VeLoRA",
}

#: HF head modules that PEFT's SEQ_CLS task saves whole (``modules_to_save``)
_SEQ_CLS_HEADS = ("classifier", "score")
_SAVE_AGAIN = "save the adapter again with PeftModel.save_pretrained(dir, safe_serialization=True)"


# ============================================================================ ours -> PEFT

def _task_type(config: Any) -> str | None:
    """PEFT's task type for the HF class ``to_hf`` targets."""
    from ...models.bert import BertConfig
    from ...models.gemma import GemmaConfig
    from ...models.gpt import GPTConfig
    from ...models.t5 import T5Config

    if isinstance(config, (GPTConfig, GemmaConfig)):
        return "CAUSAL_LM"
    if isinstance(config, T5Config):
        return "SEQ_2_SEQ_LM"
    if isinstance(config, BertConfig):
        return {"base": "FEATURE_EXTRACTION", "classification": "SEQ_CLS"}.get(config.head)
    return None


def _site_tensors(site: LoraSite, adapters: Mapping[Path, tuple], r: int):
    """PEFT's ``(A, B)`` of one site from our adapters (see the module docstring)."""
    members = [(j, p) for j, p in enumerate(site.paths) if p in adapters]
    a_s, b_s = {}, {}
    for j, path in members:
        a, b = adapters[path]
        if b is None:
            raise UserError(f"to_peft: {'/'.join(path)} has lora_a but no lora_b")
        a = np.asarray(a, np.float32).reshape(-1, a.shape[-1]).T          # (r, in)
        b = np.asarray(b, np.float32).reshape(b.shape[0], -1).T           # (out, r)
        if a.shape != (r, site.in_features) or b.shape != (site.out_each, r):
            raise UserError(f"to_peft: {'/'.join(path)}: lora_a/lora_b give A {a.shape} and B "
                            f"{b.shape}, expected ({r}, {site.in_features}) and "
                            f"({site.out_each}, {r}) for LoraConfig.rank={r}")
        a_s[j], b_s[j] = a, b
    out, first = site.out_each, members[0][0]
    if all(np.array_equal(a_s[j], a_s[first]) for j, _ in members):
        big_a, big_b = a_s[first], np.zeros((len(site.paths) * out, r), np.float32)
        for j, _ in members:
            big_b[j * out:(j + 1) * out] = b_s[j]
        return big_a, big_b
    k = len(members)                     # stacked A, block-diagonal B: rank k*r
    big_a = np.concatenate([a_s[j] for j, _ in members])
    big_b = np.zeros((len(site.paths) * out, k * r), np.float32)
    for m, (j, _) in enumerate(members):
        big_b[j * out:(j + 1) * out, m * r:(m + 1) * r] = b_s[j]
    return big_a, big_b


def _saved_modules(maps: Sequence[TensorMap], flat: Mapping[Path, Any],
                   modules_to_save: Sequence[str]) -> dict[str, np.ndarray]:
    """The whole tensors of the HF modules ``modules_to_save``, from the family table."""
    tensors = {}
    for name in modules_to_save:
        chosen = [m for m in maps if m.constant is None and (
            m.key.rsplit(".", 1)[0] == name or m.key.rsplit(".", 1)[0].endswith("." + name))]
        if not chosen:
            raise UserError(f"to_peft: modules_to_save entry {name!r} names no module of the "
                            f"Hugging Face checkpoint (its keys: {[m.key for m in maps][:8]} ...)")
        for m in chosen:
            leaves = [np.asarray(flat[path], np.float32) for path, _ in m.targets]
            tensors[KEY_PREFIX + m.key] = np.asarray(m.to_torch(leaves), np.float32)
    return tensors


def peft_adapter(module: Any, params: Any, *, modules_to_save: Sequence[str] | None = None,
                 task_type: str | None = "auto",
                 base_model_name_or_path: str | None = None) -> tuple[dict[str, np.ndarray], dict]:
    """``(tensors, adapter_config)``: what :func:`to_peft` writes, in memory (fp32 numpy)."""
    config = module.config
    lora = getattr(config, "lora", None)
    if lora is None:
        raise UserError(f"to_peft: {type(config).__name__}.lora is None, so the module has no "
                        "LoRA adapters to export (set config.lora, train, then export)")
    flat = flatten_params(to_layout(plain_params(params), config.layer_stacks, scanned=False,
                                    what=f"{type(module).__name__} params"))
    adapters = {path[:-1]: (flat[path], flat.get(path[:-1] + ("lora_b",)))
                for path in flat if path[-1] == "lora_a"}
    if not adapters:
        raise UserError("to_peft: the params hold no LoRA adapters (lora_a/lora_b leaves); "
                        "were they merged (lora.merge) or built without config.lora?")
    maps = tensor_maps(config)
    sites = lora_sites(config, maps)
    unmapped = sorted("/".join(p) for p in set(adapters) - {p for s in sites for p in s.paths})
    if unmapped:
        raise UserError(f"to_peft: LoRA adapters on {unmapped}, which no Hugging Face "
                        f"nn.Linear/Conv1D of the {hf_family(config).name} checkpoint holds; "
                        "narrow LoraConfig.targets")
    tensors, ranks, conv1d = {}, {}, False
    for site in sites:
        if any(p in adapters for p in site.paths):
            a, b = _site_tensors(site, adapters, lora.rank)
            tensors[f"{KEY_PREFIX}{site.module}.lora_A.weight"] = np.ascontiguousarray(a)
            tensors[f"{KEY_PREFIX}{site.module}.lora_B.weight"] = np.ascontiguousarray(b)
            ranks[site.module] = a.shape[0]
            conv1d |= site.fan_in_fan_out

    def alpha_for(rank):                 # the alpha that keeps our scale at this rank
        ratio = rank / lora.rank
        return number(lora.alpha * (math.sqrt(ratio) if lora.use_rslora else ratio))

    default_r = collections.Counter(ranks.values()).most_common(1)[0][0]
    rank_pattern, alpha_pattern = {}, {}
    for rank in sorted(set(ranks.values()) - {default_r}):
        for key in suffix_keys([m for m, k in ranks.items() if k == rank], ranks):
            rank_pattern[re.escape(key)], alpha_pattern[re.escape(key)] = rank, alpha_for(rank)
    if task_type == "auto":
        task_type = _task_type(config)
    if modules_to_save is None:
        modules_to_save = [h for h in _SEQ_CLS_HEADS if task_type == "SEQ_CLS"
                           and any(m.key.startswith(h + ".") for m in maps)]
    tensors.update(_saved_modules(maps, flat, modules_to_save))
    adapter_config = {
        "peft_type": "LORA", "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "r": default_r, "lora_alpha": alpha_for(default_r), "lora_dropout": lora.dropout,
        "target_modules": suffix_keys(ranks, [s.module for s in sites]),
        "fan_in_fan_out": conv1d, "use_rslora": lora.use_rslora,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
        "modules_to_save": list(modules_to_save) or None,
        "bias": "none", "lora_bias": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "layers_to_transform": None, "layers_pattern": None,
        "revision": None,
    }
    return tensors, adapter_config


def to_peft(module: Any, params: Any, out_dir: str | os.PathLike, *,
            base_model_name_or_path: str | None = None,
            modules_to_save: Sequence[str] | None = None,
            task_type: str | None = "auto") -> str:
    """Write the LoRA adapters of ``(module, params)`` as a PEFT adapter directory.

    ``out_dir`` gets ``adapter_model.safetensors`` (fp32) and ``adapter_config.json`` (see
    the module docstring for the layout), loadable with
    ``peft.PeftModel.from_pretrained(hf_base, out_dir)`` where ``hf_base`` is the HF model
    ``to_hf`` targets. ``params`` may be scanned or unrolled, boxed or not.

    Args:
      base_model_name_or_path: recorded in ``adapter_config.json`` (PEFT's field).
      modules_to_save: HF module names (``"classifier"``) whose tensors are written whole,
        for heads trained along with the adapters; default: the classifier for the
        ``SEQ_CLS`` task (PEFT's default for that task), else none.
      task_type: PEFT's ``task_type``; ``"auto"``: ``CAUSAL_LM`` (GPT-2, Llama),
        ``SEQ_2_SEQ_LM`` (T5), ``FEATURE_EXTRACTION`` (``BertModel``), ``SEQ_CLS`` (BERT
        classification), else None.

    Returns the directory.
    """
    from safetensors.numpy import save_file

    tensors, adapter_config = peft_adapter(
        module, params, modules_to_save=modules_to_save, task_type=task_type,
        base_model_name_or_path=base_model_name_or_path)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_file(dict(sorted(tensors.items())), os.path.join(out_dir, ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2, sort_keys=True)
        f.write("\n")
    return out_dir


# ============================================================================ reading

def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise UserError(f"{path}: cannot read the PEFT adapter config ({e.strerror or e})") from None
    except ValueError as e:          # JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{path}: not valid JSON ({e}); {_SAVE_AGAIN}") from None
    if not isinstance(config, dict):
        raise UserError(f"{path}: a JSON {type(config).__name__}, not the JSON object of a "
                        f"PEFT adapter config; {_SAVE_AGAIN}")
    return config


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as numpy (bfloat16 widened to float32)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="flax") as f:
            arrays = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as e:           # SafetensorError and friends: truncated, damaged
        raise UserError(f"{path}: cannot read the safetensors file ({e}); {_SAVE_AGAIN}") from None
    return {k: np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v)
            for k, v in arrays.items()}


def read_adapter(adapter_dir: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """``(adapter_config, tensors)`` of a PEFT adapter directory (safetensors; no torch)."""
    directory = os.fspath(adapter_dir)
    if not os.path.isdir(directory):
        raise UserError(f"{directory!r} is not a directory; expected a PEFT adapter directory "
                        f"({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}, as save_pretrained writes)")
    present = sorted(os.listdir(directory))
    config_path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise UserError(f"{directory}: no {ADAPTER_CONFIG} (found {present}); expected a PEFT "
                        "adapter directory written by PeftModel.save_pretrained or to_peft")
    config = _read_config(config_path)
    weights = os.path.join(directory, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(directory, "adapter_model.bin")):
            raise UserError(f"{directory}: the adapter weights are adapter_model.bin (a pickled "
                            "torch file, which transformer_jax does not read); re-save the "
                            "adapter with PeftModel.save_pretrained(dir, safe_serialization=True) "
                            f"to get {ADAPTER_WEIGHTS}")
        raise UserError(f"{directory}: no {ADAPTER_WEIGHTS} (found {present}); {_SAVE_AGAIN}")
    return config, _read_tensors(weights)


def _check_adapter_config(config: dict, where: str) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise UserError(f"{where}: peft_type {peft_type!r}; transformer_jax loads LoRA adapters "
                        "only (peft_type 'LORA')")
    bad = [f"{name}={config[name]!r} ({what})" for name, what in _UNSUPPORTED_OPTIONS.items()
           if config.get(name) not in (None, False, {}, [], "")]
    if bad:
        raise UserError(f"{where}: LoRA option(s) transformer_jax's LoRA does not implement: "
                        f"{'; '.join(bad)}; train a plain LoRA adapter")
    for name in ("r", "lora_alpha"):
        value = config.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise UserError(f"{where}: {name}={value!r} is not a positive number")
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise UserError(f"{where}: {name} must be a JSON object, got {config.get(name)!r}")


def _split_tensors(tensors: Mapping[str, np.ndarray], weights: str):
    """``({module: {"A": .., "B": ..}}, {other key: tensor})``, prefixes stripped."""
    lora_ab: dict[str, dict[str, np.ndarray]] = {}
    extras: dict[str, np.ndarray] = {}
    odd = []
    for key, array in tensors.items():
        if not key.startswith(KEY_PREFIX):
            raise UserError(f"{weights}: tensor {key!r} does not start with {KEY_PREFIX!r} as "
                            "PEFT's LoRA adapters do")
        name = key[len(KEY_PREFIX):]
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", name)
        if match:
            lora_ab.setdefault(match[1], {})[match[2]] = np.asarray(array, np.float32)
        elif ".lora_" in name:
            odd.append(name)
        else:
            extras[name] = np.asarray(array)
    if odd:
        raise UserError(f"{weights}: LoRA tensors of a kind transformer_jax does not load "
                        f"(embedding LoRA lora_embedding_A/B, DoRA magnitudes, ...): {sorted(odd)[:6]}")
    if not lora_ab:
        raise UserError(f"{weights}: no LoRA tensors (<module>.lora_A.weight / lora_B.weight)")
    for name, ab in lora_ab.items():
        if set(ab) != {"A", "B"}:
            raise UserError(f"{weights}: {name} has lora_{''.join(sorted(ab))} only; a LoRA "
                            "adapter needs both lora_A and lora_B")
    return lora_ab, extras


# ============================================================================ params

def _init_params(module: Any) -> Any:
    """The model file's ``init_params(model, rng)`` (every model file has one)."""
    init = getattr(importlib.import_module(type(module).__module__), "init_params", None)
    if init is None:
        raise UserError(f"{type(module).__name__} has no init_params in its model file, so its "
                        "LoRA adapter shapes are unknown")
    return init


def adapter_shapes(module: Any) -> dict[Path, tuple[int, ...]]:
    """Path -> shape of every ``lora_a`` / ``lora_b`` that ``module`` (unscanned) creates."""
    unscanned = module.clone(config=without_scan(module.config))
    init = _init_params(unscanned)
    tree = jax.eval_shape(lambda: init(unscanned, jax.random.PRNGKey(0)))
    return {path: tuple(x.shape) for path, x in flatten_params(tree).items()
            if path[-1] in ADAPTER_NAMES}


def fresh_adapters(module: Any, rng: Any = None) -> dict[Path, Any]:
    """Path -> freshly initialised ``lora_a`` / ``lora_b`` of ``module`` (unscanned paths;
    B zero), without materialising the rest of the model (jit drops it)."""
    unscanned = module.clone(config=without_scan(module.config))
    init = _init_params(unscanned)
    rng = jax.random.PRNGKey(0) if rng is None else rng

    def adapters(key):
        flat = flatten_params(init(unscanned, key))
        return {"/".join(p): v for p, v in flat.items() if p[-1] in ADAPTER_NAMES}
    return {tuple(k.split("/")): v for k, v in jax.jit(adapters)(rng).items()}


def _base_flat(module: Any, params: Any) -> dict[Path, Any]:
    """The params, unscanned and flat, without any adapter leaves."""
    flat = flatten_params(to_layout(plain_params(params), module.config.layer_stacks,
                                    scanned=False, what=f"{type(module).__name__} params"))
    return {p: v for p, v in flat.items() if p[-1] not in ADAPTER_NAMES}


def _finish(module: Any, flat: dict[Path, Any], new_leaves: dict[Path, Any]) -> Any:
    """Unflatten, cast the new leaves to ``param_dtype``, bring to the config's layout."""
    dtype = jnp.dtype(module.config.param_dtype)
    out = dict(flat)
    for path, leaf in new_leaves.items():
        out[path] = jnp.asarray(leaf, dtype)
    tree = jax.tree_util.tree_map(jnp.asarray, unflatten_params(out))
    return to_layout(tree, module.config.layer_stacks, scanned=module.config.scan_layers,
                     what=f"{type(module).__name__} params")


def add_adapters(module: Any, params: Any, lora: LoraConfig | dict, *, rng: Any = None):
    """``(module with config.lora = lora, params + fresh adapters)``: B zero, so the model
    computes what it did; adapters already in ``params`` are replaced."""
    lora = LoraConfig.from_value(lora)
    module = module.clone(config=module.config.replace(lora=lora))
    return module, _finish(module, _base_flat(module, params), fresh_adapters(module, rng))


# ============================================================================ PEFT -> ours

def _per_module(lora_ab, sites, adapter_config, weights):
    """``{module: (site, A, B, scale)}``, shapes checked against the site and the config."""
    r0, alpha0 = int(adapter_config["r"]), float(adapter_config["lora_alpha"])
    rslora = bool(adapter_config.get("use_rslora", False))
    out = {}
    for name, ab in lora_ab.items():
        site, a, b = sites[name], ab["A"], ab["B"]
        rank = int(pattern_value(adapter_config.get("rank_pattern") or {}, name, r0))
        want_a, want_b = (rank, site.in_features), (site.out_each * len(site.paths), rank)
        if a.shape != want_a or b.shape != want_b:
            raise UserError(f"{weights}: shape mismatch at {name}: lora_A {a.shape}, lora_B "
                            f"{b.shape}; the base model and adapter_config.json (r={rank}) "
                            f"expect {want_a} and {want_b}: is the adapter for another model?")
        alpha = float(pattern_value(adapter_config.get("alpha_pattern") or {}, name, alpha0))
        out[name] = (site, a, b, lora_scale(alpha, rank, rslora))
    return out


def _loaded_lora(old: LoraConfig | None, adapter_config: dict, big_r: int,
                 paths: Iterable[Path], stacks) -> LoraConfig:
    """Our LoRA config for the adapter at rank ``big_r``, with the adapter's scale."""
    r0, alpha0 = int(adapter_config["r"]), float(adapter_config["lora_alpha"])
    rslora = bool(adapter_config.get("use_rslora", False))
    ratio = big_r / r0
    alpha = alpha0 if big_r == r0 else alpha0 * (math.sqrt(ratio) if rslora else ratio)
    return dataclasses.replace(
        old or LoraConfig(), rank=big_r, alpha=float(alpha), targets=targets_regex(paths, stacks),
        dropout=float(adapter_config.get("lora_dropout") or 0.0), use_rslora=rslora)


def _adapter_leaves(per_module, shapes, big_r: int, scale: float, where: str):
    """Our lora_a/lora_b leaves: every one the module has (zeros where the adapter has
    none), rank-padded to ``big_r``, each B times its scale over ``scale``."""
    new = {p: np.zeros(shape, np.float32) for p, shape in shapes.items()}
    for name, (site, a, b, site_scale) in per_module.items():
        rank, out = a.shape[0], site.out_each
        for j, path in enumerate(site.paths):
            if path + ("lora_a",) not in shapes:
                raise UserError(f"{where}: {name} maps to {'/'.join(path)}, which is not a "
                                "LoRA-capable Dense (layers.dense.Dense) in transformer_jax")
            la = np.zeros((big_r, site.in_features), np.float32)
            la[:rank] = a
            lb = np.zeros((out, big_r), np.float32)
            lb[:, :rank] = b[j * out:(j + 1) * out] * np.float32(site_scale / scale)
            new[path + ("lora_a",)] = la.T.reshape(shapes[path + ("lora_a",)])
            new[path + ("lora_b",)] = lb.T.reshape(shapes[path + ("lora_b",)])
    return new


def _extra_leaves(extras, maps, adapter_config, family: str, where: str, weights: str):
    """The params that the adapter's other tensors (modules_to_save, biases) replace."""
    table = {m.key: m for m in maps if m.constant is None}
    keys, exact = list(table), set(table)
    new, bad = {}, []
    for name, array in extras.items():
        hit = resolve(name, keys, exact)
        if hit is None:
            bad.append(name)
            continue
        m = table[hit]
        if tuple(array.shape) != tuple(m.shape):
            raise UserError(f"{weights}: shape mismatch at {name}: {tuple(array.shape)}, the "
                            f"base model has {tuple(m.shape)}")
        for (path, _), leaf in zip(m.targets, m.to_flax(np.asarray(array, np.float32))):
            new[path] = leaf
    if bad:
        raise UserError(f"{where}: the adapter saves tensors (modules_to_save="
                        f"{adapter_config.get('modules_to_save')!r}, bias="
                        f"{adapter_config.get('bias')!r}) that map to no parameter of "
                        f"transformer_jax's {family} model: {sorted(bad)[:8]}")
    return new


def load_peft(module: Any, params: Any, adapter_dir: str | os.PathLike) -> tuple[Any, Any]:
    """``(module, params)`` with the PEFT LoRA adapter in ``adapter_dir`` loaded.

    The returned module's ``config.lora`` comes from ``adapter_config.json`` (rank, alpha,
    dropout, use_rslora; targets: a regex over the Dense layers the adapter holds; the
    quantize settings of the module's own LoRA config, if any, are kept); the params are
    ``params`` (any layout, boxed or not; any adapters in them are dropped) with
    ``lora_a``/``lora_b`` filled, in the config's layout. See the module docstring for the
    mapping, padding of ``rank_pattern`` ranks, and what is refused.
    """
    where = os.fspath(adapter_dir)
    adapter_config, tensors = read_adapter(adapter_dir)
    _check_adapter_config(adapter_config, os.path.join(where, ADAPTER_CONFIG))
    weights = os.path.join(where, ADAPTER_WEIGHTS)
    config = module.config
    lora_ab, extras = _split_tensors(tensors, weights)
    maps, sites = match_sites(config, lora_ab, adapter_config, where)
    per_module = _per_module(lora_ab, sites, adapter_config, weights)
    # one rank R and one scale for all: pad to R, fold each module's scale into its B
    big_r = max(a.shape[0] for _, a, _, _ in per_module.values())
    lora = _loaded_lora(getattr(config, "lora", None), adapter_config, big_r,
                        [p for site, *_ in per_module.values() for p in site.paths],
                        config.layer_stacks)
    module = module.clone(config=config.replace(lora=lora))
    new = _adapter_leaves(per_module, adapter_shapes(module), big_r, lora.scaling, where)
    new.update(_extra_leaves(extras, maps, adapter_config, hf_family(config).name, where, weights))
    return module, _finish(module, _base_flat(module, params), new)
