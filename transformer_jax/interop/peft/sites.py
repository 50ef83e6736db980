"""LoRA sites: which Hugging Face module holds which of our Dense layers, for PEFT adapters.

Which HF module is which Dense. Nothing here names a family's modules: the family's
:class:`~transformer_jax.interop.common.TensorMap` table (``hf/<family>.py``: ``<family>_tensor_maps``)
does. A 2-D ``<module>.weight`` entry whose targets are Dense kernels is a LoRA site:
``nn.Linear`` (weight (out, in), ``transpose=True``) or GPT-2's ``Conv1D`` (weight (in, out);
``fan_in_fan_out``). A site may hold several of our Dense layers packed along its output
axis: GPT-2's ``c_attn`` is query, key and value. Adapter module names may differ from the
table's by a leading prefix (saved from ``GPT2Model`` or ``BertModel``, loaded into the
headed model, or the reverse); where the family reads another key layout (ViT: the names of
transformers 4, ``attention.attention.query``), adapters saved under it load too.


Used by :mod:`transformer_jax.interop.peft.lora` (save and load); also PEFT's pattern rules
(``rank_pattern``, ``target_modules`` suffixes) and the targets regex of a loaded LoRA config.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
import os
import pkgutil
import re
from typing import Any, Iterable, Mapping, Sequence

from ...errors import UserError
from ..common import Path, TensorMap
from ..hf.registry import HFFamily, family_for_config, register_hf_family, without_scan

__all__ = ["LoraSite", "hf_family", "hf_family_module", "tensor_maps", "lora_sites", "match_sites",
           "resolve", "suffix_keys", "pattern_value", "lora_scale", "number", "targets_regex"]

_INTEROP = __package__.rsplit(".", 1)[0]
_HF = f"{_INTEROP}.hf"   # the family modules, imported by name (hf/convert.py imports peft)


# ============================================================================ families

def hf_family(config: Any) -> HFFamily:
    """The HF family of ``config``. ``interop.hf`` registers the families when imported;
    where it was not (a model trained here, exported with ``to_peft``), every family module
    of ``interop/hf/`` (each exporting ``FAMILY``) is registered first."""
    try:
        return family_for_config(config)
    except TypeError:
        pass
    hf_dir = os.path.join(os.path.dirname(os.path.dirname(__file__)), "hf")
    for info in pkgutil.iter_modules([hf_dir]):
        if info.name not in ("convert", "registry"):
            family = getattr(importlib.import_module(f"{_HF}.{info.name}"), "FAMILY", None)
            if isinstance(family, HFFamily):
                register_hf_family(family)
    return family_for_config(config)


def hf_family_module(config: Any):
    name = hf_family(config).name
    return name, importlib.import_module(f"{_HF}.{name}")


def tensor_maps(config: Any, **kwargs: Any) -> list[TensorMap]:
    """The family table of ``config`` (unscanned), with the key names ``to_hf`` writes.

    By the family modules' convention: ``hf.<name>.<name>_tensor_maps(config, **kwargs)``;
    BERT's also takes the key prefix of its HF class (none for ``BertModel``). ``kwargs``:
    e.g. ViT's ``layout="legacy"`` (transformers 4 names).
    """
    name, family_module = hf_family_module(config)
    table = getattr(family_module, f"{name}_tensor_maps", None)
    if table is None:
        raise UserError(f"the {name} converter has no tensor table ({family_module.__name__}."
                        f"{name}_tensor_maps), so its LoRA adapters cannot be mapped to PEFT")
    if name == "bert":
        kwargs.setdefault("prefix", "" if config.head == "base" else "bert.")
    return table(without_scan(config), **kwargs)


# ============================================================================ sites

@dataclasses.dataclass(frozen=True)
class LoraSite:
    """One HF ``nn.Linear`` / ``Conv1D`` and the Dense layer(s) whose kernel(s) it holds.

    ``module``: its name in the HF model (``transformer.h.0.attn.c_attn``); ``paths``: our
    Dense paths (unscanned), in the order packed along its output axis; ``in_features``;
    ``out_each``: the output width of each packed Dense; ``fan_in_fan_out``: a ``Conv1D``.
    """
    module: str
    paths: tuple[Path, ...]
    in_features: int
    out_each: int
    fan_in_fan_out: bool


def lora_sites(config: Any, maps: Sequence[TensorMap] | None = None) -> list[LoraSite]:
    """Every HF module of ``config``'s family that PEFT can put a LoRA adapter on and that
    holds Dense kernels of ours, from the family table."""
    sites = []
    for m in tensor_maps(config) if maps is None else maps:
        if (m.constant is not None or len(m.shape) != 2 or not m.key.endswith(".weight")
                or not all(path[-1] == "kernel" for path, _ in m.targets)):
            continue
        axes = m._axes()
        if axes == (1, 0):
            out_axis, conv1d = 0, False          # nn.Linear: (out, in)
        elif axes is None:
            out_axis, conv1d = 1, True           # Conv1D: (in, out)
        else:
            continue
        n = len(m.targets)
        if n > 1 and m.split_axis != out_axis:
            continue                             # packed along the input: no per-Dense LoRA
        sites.append(LoraSite(module=m.key[:-len(".weight")],
                              paths=tuple(path[:-1] for path, _ in m.targets),
                              in_features=m.shape[1 - out_axis],
                              out_each=m.shape[out_axis] // n, fan_in_fan_out=conv1d))
    return sites


def resolve(name: str, names: Sequence[str], exact: set[str]) -> str | None:
    """The one table name that is ``name`` up to a leading prefix (an adapter saved from
    ``GPT2Model`` names ``h.0.attn.c_attn``, the table ``transformer.h.0.attn.c_attn``;
    from ``BertForMaskedLM`` ``bert.encoder...``, for a ``BertModel`` ``encoder...``)."""
    if name in exact:
        return name
    hits = [t for t in names if t.endswith("." + name) or name.endswith("." + t)]
    return hits[0] if len(hits) == 1 else None


def suffix_keys(selected: Iterable[str], universe: Iterable[str]) -> list[str]:
    """For each name in ``selected``, its shortest dotted suffix that matches (PEFT's rule:
    equal, or ending in ``"." + suffix``) only names in ``selected`` among ``universe``."""
    selected, universe = set(selected), set(universe) | set(selected)
    keys = set()
    for name in selected:
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            suffix = ".".join(parts[i:])
            if all(u in selected for u in universe if u == suffix or u.endswith("." + suffix)):
                keys.add(suffix)
                break
    return sorted(keys)


def pattern_value(patterns: Mapping[str, Any], name: str, default: Any) -> Any:
    r"""PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup (``utils.other.get_pattern_key``):
    the first key ``k`` with ``re.match(rf"(.*\.)?({k})$", name)``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def lora_scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / (math.sqrt(rank) if rslora else rank)


def number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def match_sites(config: Any, names: Iterable[str], adapter_config: dict, where: str):
    """``(table, {adapter module: site})``: the table with the key names ``to_hf`` writes,
    else another key layout the family reads (ViT: transformers 4's names) in which every
    adapted module has its site; a module with none is refused, named."""
    names = list(names)
    layouts = getattr(hf_family_module(config)[1], "LAYOUTS", ())
    first = None
    for variant in [{}] + [{"layout": layout} for layout in layouts]:
        maps = tensor_maps(config, **variant)
        by_module = {s.module: s for s in lora_sites(config, maps)}
        site_names, exact = list(by_module), set(by_module)
        hits = {name: resolve(name, site_names, exact) for name in names}
        missed = sorted(n for n, hit in hits.items() if hit is None)
        first = first or (maps, missed)
        if not missed:
            if len(set(hits.values())) != len(hits):
                raise UserError(f"{where}: several adapter modules map to one module: {hits}")
            return maps, {name: by_module[hit] for name, hit in hits.items()}
    raise UserError(f"{where}: the adapter targets Hugging Face module(s) with no LoRA-capable "
                    f"Dense in transformer_jax's {hf_family(config).name} model: {first[1][:8]} "
                    f"(target_modules={adapter_config.get('target_modules')!r}); such adapters "
                    "cannot be loaded")


def targets_regex(paths: Iterable[Path], stacks: Sequence[tuple[Path, str, int]]) -> str:
    """An anchored regex matching each Dense path in every layer of its stack, unrolled
    (``h_0/self_attn/query``) and scanned (``h/self_attn/query``)."""
    groups: dict[str, set[str]] = {}
    for path in paths:
        parts = []
        for i, part in enumerate(path):
            for parent, name, _ in stacks:
                if tuple(path[:i]) == tuple(parent) and re.fullmatch(rf"{re.escape(name)}_\d+", part):
                    parts.append(re.escape(name) + r"(?:_\d+)?")
                    break
            else:
                parts.append(re.escape(part))
        groups.setdefault("/".join(parts[:-1]), set()).add(parts[-1])
    alternatives = []
    for prefix, lasts in sorted(groups.items()):
        last = next(iter(lasts)) if len(lasts) == 1 else "(?:" + "|".join(sorted(lasts)) + ")"
        alternatives.append(f"{prefix}/{last}" if prefix else last)
    return "^(?:" + "|".join(alternatives) + ")$"
