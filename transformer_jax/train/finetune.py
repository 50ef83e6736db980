"""Fine-tuning: a run that starts from pretrained weights (``--init-from DIR``) and trains
all of them, or only adapters over a frozen base (LoRA, QLoRA, prefix tuning).

``DIR`` is a Hugging Face ``save_pretrained`` directory (``config.json`` with a
``model_type``: GPT-2, Llama, Mistral, Qwen 2/2.5, Qwen 3, BERT, T5, ViT, CLIP; read by
:func:`~transformer_jax.interop.from_hf`)
or a transformer_jax workdir (its latest checkpoint). The run then:

* takes the model config from ``DIR`` (:func:`resolve`): the experiment's model settings
  apply only where training may change them (:data:`CHANGEABLE`: dropout, dtypes, remat,
  layer scan, attention implementation, cpu tuning, LoRA, prefix tokens) and where the task
  decides (:data:`HEAD_FIELDS`: BERT's head and classes, ViT's classes and channels, CLIP's
  channels); other settings that differ from ``DIR``'s are not used, and reported once
  where they were given for this start (an experiment's settings for training from
  scratch are not: the CLI reports only the ``--set model.*`` of its command line);
* uses ``DIR``'s tokenizer when the experiment asks for the default byte tokenizer
  (``hf:DIR`` for an HF directory with tokenizer files, ``byte`` for the byte tokenizer's
  files that ``export`` writes, ``sentencepiece:DIR/spiece.model`` for a SentencePiece
  run's export; a workdir's own tokenizer);
* loads every parameter whose path and shape the new model shares (:class:`Start`); a task
  head that differs (another number of classes, a classifier on an MLM checkpoint) is
  initialised fresh, and the run says which leaves;
* records where it started: ``config.json``'s ``init_from`` holds the path, the kind and a
  SHA-256 digest of the loaded weights;
* refuses, before anything is written, a source whose family cannot train the experiment's
  task (``transformer_jax/run.py``'s ``check_task``: a BERT checkpoint under a GPT language-model
  experiment).

With ``model.lora`` (``--set lora.rank=8``) or ``model.prefix_tokens`` only the adapters and
the freshly initialised head train (:class:`ParamSplit`): they alone get gradients and
optimizer state, and the rest is ``TrainState.frozen`` (stored quantized with
``lora.quantize``: int8 or NF4, QLoRA). A QLoRA start from an HF directory streams the base
already stored quantized (``load_source(..., quantize=)``) and :meth:`Start.frozen_params`
hands those leaves to the state as they are: the unquantized base tree is never built
(only the trainable leaves are initialised, ``train/distributed.py``'s ``init_frozen_state``),
and ``init_from.sha256`` is then the digest of the stored leaves. LoRA ``targets`` that
match no Dense layer are refused (:func:`check_adapters`), and the run prints how many
parameters each kind of adapter trains (:func:`describe_trainable`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import UserError
from ..layers import lora as lora_lib
from ..layers.stack import convert_layout
from ..models import FAMILIES
from .step import combine, split_tree

#: model fields a fine-tuning run may set on top of the checkpoint's config (they change
#: how the same weights train or run, not which weights there are; a ViT's or CLIP's
#: image_size resizes its position table)
CHANGEABLE = frozenset({"dropout_rate", "attention_dropout_rate", "classifier_dropout_rate",
                        "mlp_dropout_rate",
                        "dtype", "param_dtype", "remat", "remat_policy", "scan_layers",
                        "attention_impl", "cpu_tuning", "lora", "prefix_tokens", "image_size"})

#: per family, the model fields the task decides (its head, its inputs); parameters they
#: shape are loaded when their shapes agree and initialised fresh otherwise
HEAD_FIELDS = {"bert": frozenset({"head", "num_classes"}),
               "vit": frozenset({"num_classes", "num_channels"}),
               "clip": frozenset({"num_channels"}),
               "gpt": frozenset(), "t5": frozenset(), "transformer": frozenset(),
               "gemma": frozenset()}

#: parameter leaves that are adapters: they train, and are new in a fine-tuning run
ADAPTER_LEAVES = frozenset(lora_lib.ADAPTER_NAMES) | {"prefix_key", "prefix_value"}

#: per family, the task heads that train with the adapters when no --init-from says which
#: leaves are fresh (PEFT's modules_to_save for classification)
TASK_HEADS = {"bert": ("classifier",), "vit": ("head",)}

_TOKENIZER_FILES = ("tokenizer.json", "spiece.model", "tokenizer.model")


def _family_of(config: Any) -> str:
    for name, (config_cls, _) in FAMILIES.items():
        if type(config) is config_cls:
            return name
    raise UserError(f"no model family for a {type(config).__name__}")


@dataclasses.dataclass
class Source:
    """Pretrained weights: where from, the family, its model config and its parameters
    (unscanned, adapters merged and quantized kernels read back; numpy from a workdir,
    jax arrays in the run's ``param_dtype`` streamed onto the devices from an HF directory).
    ``stored``: the ``LoraConfig`` an HF directory's base kernels were streamed quantized
    with (a QLoRA start; the params are then in the layout ``model_config`` says), or None."""
    path: str
    kind: str                       # "hf" or "workdir"
    family: str
    model_config: dict
    params: dict
    tokenizer: str | None           # the tokenizer spec that goes with the weights
    task: str | None = None         # a workdir's task ("mlm"); an HF directory's architecture
    stored: Any = None              # the LoraConfig the base kernels are stored with (QLoRA)

    def digest(self) -> str:
        """SHA-256 over every parameter's path, shape, dtype and bytes (sorted by path)."""
        h = hashlib.sha256()
        for path, leaf in sorted(_flat(self.params).items()):
            if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                from jax.experimental import multihost_utils    # sharded over processes
                leaf = multihost_utils.process_allgather(leaf, tiled=True)
            array = np.ascontiguousarray(np.asarray(leaf))
            h.update("/".join(path).encode())
            h.update(f"{array.shape}{array.dtype}".encode())
            h.update(array.tobytes())
        return h.hexdigest()


def _flat(tree: dict, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix + (str(key),)))
        else:
            out[prefix + (str(key),)] = value
    return out


def _unflat(flat: dict[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    for path, leaf in flat.items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaf
    return tree


def load_source(path: str | os.PathLike, *, param_dtype: Any = None, mesh: Any = None,
                quantize: Any = None, scan_layers: bool | None = None) -> Source:
    """The weights of an HF ``save_pretrained`` directory or a transformer_jax workdir.

    An HF directory is streamed tensor by tensor (``interop/hf/stream.py``): cast to
    ``param_dtype`` (None: the family's default; a bf16 checkpoint read for a bf16 run is
    never widened to float32) and placed on the devices, sharded over ``mesh`` by the
    training loop's rules when given, so the host never holds the whole tree. With
    ``quantize`` (the run's ``LoraConfig``, QLoRA) its base kernels are stored quantized as
    they are read, in the layout ``scan_layers`` says (None: the family's default), so
    neither host nor devices ever hold the unquantized base; a workdir ignores both."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise UserError(f"--init-from {path!r} is not a directory; give a Hugging Face "
                        "save_pretrained directory or the --workdir of a transformer_jax run")
    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError:
        raise UserError(f"--init-from {path!r} has no config.json; give a Hugging Face "
                        "save_pretrained directory or the --workdir of a transformer_jax run "
                        "(that saved a checkpoint)") from None
    except ValueError as e:
        raise UserError(f"{config_path}: not valid JSON ({e})") from None
    if isinstance(config, dict) and "model_type" in config:
        source = _hf_source(path, param_dtype, mesh, quantize, scan_layers)
        architectures = config.get("architectures")
        if isinstance(architectures, list) and architectures and isinstance(architectures[0], str):
            source.task = architectures[0]
        return source
    if isinstance(config, dict) and "family" in config and "model" in config:
        return _workdir_source(path)
    raise UserError(f"{config_path} is neither a Hugging Face config (no \"model_type\") nor a "
                    "transformer_jax run config (no \"family\"); --init-from takes one of those")


def _hf_source(path: str, param_dtype: Any = None, mesh: Any = None, quantize: Any = None,
               scan_layers: bool | None = None) -> Source:
    from ..interop.hf import from_hf          # loads the converters only when asked

    fields = {"param_dtype": param_dtype, "scan_layers": scan_layers}
    module, params = from_hf(path, mesh=mesh, quantize=quantize,
                             **{k: v for k, v in fields.items() if v is not None})
    tokenizer = _tokenizer_of(path)
    config = module.config.replace(lora=None) if module.config.lora is not None else module.config
    if module.config.lora is not None:
        params = lora_lib.merge(params, module.config.lora)
    return Source(path=path, kind="hf", family=_family_of(config), model_config=config.to_dict(),
                  params=params, tokenizer=tokenizer, stored=quantize)


def _tokenizer_of(path: str) -> str | None:
    """The tokenizer spec of an HF directory: "byte" for the byte tokenizer's files (what
    ``export`` writes for a byte-level run, or ByT5's), ``sentencepiece:DIR/spiece.model``
    for a SentencePiece run's export, ``hf:DIR`` for other tokenizer files, None without any."""
    from ..data.byte_hf import is_byte_tokenizer
    from ..data.spm_hf import sentencepiece_export

    if is_byte_tokenizer(path):
        return "byte"
    spiece = sentencepiece_export(path)
    if spiece is not None:
        return f"sentencepiece:{spiece}"
    if any(os.path.isfile(os.path.join(path, name)) for name in _TOKENIZER_FILES):
        return f"hf:{path}"
    return None


def _workdir_source(path: str) -> Source:
    from .checkpoint import load_params

    run_config, params = load_params(path)
    family = run_config["family"]
    config = FAMILIES[family][0].from_dict(run_config["model"])
    if config.lora is not None:       # a fine-tuning run: its base read back, adapters merged
        if config.lora.quantize is not None:
            from ..layers import quant
            params = quant.dequantize_params(params)
        params = lora_lib.merge(params, config.lora)
    params = convert_layout(params, config.layer_stacks, scanned=False)
    model_config = config.replace(lora=None, scan_layers=False).to_dict()
    if "prefix_tokens" in model_config:
        model_config["prefix_tokens"] = 0
    params = {k: v for k, v in _flat(params).items() if k[-1] not in ADAPTER_LEAVES}
    tokenizer = (run_config.get("task_spec") or {}).get("tokenizer")
    return Source(path=path, kind="workdir", family=family, model_config=model_config,
                  params=jax.tree_util.tree_map(np.asarray, _unflat(params)),
                  tokenizer=tokenizer if isinstance(tokenizer, str) else None,
                  task=run_config.get("task"))


# ----------------------------------------------------------------------------- the config

def resolve(cfg, source: Source, *, say=None, given=None):
    """``cfg`` (an ExperimentConfig) with the model and tokenizer of ``source``: see the
    module docstring. ``say`` gets one line naming the model settings that do not apply
    (architecture fields that differ from the checkpoint's): those in ``given`` (the
    command line's ``--set model.*``, where it names the start), every one where None."""
    family = source.family
    config_cls = FAMILIES[family][0]
    heads = HEAD_FIELDS[family]
    base = {k: v for k, v in source.model_config.items() if k not in heads}
    same_family = cfg.model == family
    shown = cfg.model_overrides if given is None else given
    ignored = []
    for key, value in cfg.model_overrides.items():
        if key in CHANGEABLE or key in heads:
            base[key] = value
        elif same_family and base.get(key, value) != value and key in shown:
            ignored.append(f"{key}={value!r} (checkpoint: {base[key]!r})")
    if not same_family and cfg.model_overrides:
        changed = sorted(k for k in cfg.model_overrides
                         if k not in CHANGEABLE and k not in heads and k in shown)
        ignored += [f"{k}={cfg.model_overrides[k]!r}" for k in changed]
    if ignored and say is not None:
        say(f"--init-from {source.path}: the model is the checkpoint's ({family}); the "
            f"model settings {', '.join(ignored)} do not apply")
    preset = cfg.model_preset if cfg.model_preset in config_cls.PRESETS else sorted(
        config_cls.PRESETS)[0]
    tokenizer = cfg.tokenizer
    if tokenizer == "byte" and source.tokenizer is not None:
        tokenizer = source.tokenizer
    elif (tokenizer == "byte" and source.kind == "hf" and family != "vit"
          and say is not None):
        say(f"--init-from {source.path}: no tokenizer files there ({', '.join(_TOKENIZER_FILES)}), "
            "so the run tokenizes bytes; if the weights were trained with another tokenizer, "
            "give it as --set tokenizer=hf:DIR (a directory with its tokenizer.json)")
    return cfg.replace(model=family, model_preset=preset, model_overrides=base,
                       tokenizer=tokenizer, init_from=source.path)


# ----------------------------------------------------------------------------- the weights

@dataclasses.dataclass
class Start:
    """How a fresh parameter tree (``abstract``: the new model's, in its layout) takes the
    source's weights: which leaves load, which start fresh, which are dropped."""
    source: Source
    model_config: Any
    loaded: dict[tuple[str, ...], Any]             # path (new layout) -> array (host or device)
    fresh: list[tuple[str, ...]]                   # new leaves the source lacks or mis-shapes
    dropped: list[tuple[str, ...]]                 # source leaves the new model lacks
    dtypes: dict = dataclasses.field(default_factory=dict)   # loaded path -> the model's dtype

    @classmethod
    def plan(cls, source: Source, model_config: Any, abstract: dict) -> "Start":
        """``abstract``: the new model's parameter shapes; a source stored quantized (QLoRA)
        is matched against them with the base kernels in their stored form."""
        if source.stored is not None:
            abstract = stored_shapes(abstract, model_config.lora)
        params = source.params
        old = FAMILIES[source.family][0].from_dict(source.model_config)
        if source.family in ("vit", "clip") and old.image_size != model_config.image_size:
            from ..models import clip, vit             # the position table, interpolated
            resize = clip.resize_params if source.family == "clip" else vit.resize_params
            old, params = resize(params, old, model_config.image_size)
        params = convert_layout(params, old.layer_stacks, scanned=model_config.scan_layers)
        theirs = _flat(params)
        mine = {path: tuple(leaf.shape) for path, leaf in _flat(abstract).items()}
        loaded = {p: a for p, a in theirs.items() if p in mine and tuple(np.shape(a)) == mine[p]}
        fresh = sorted(p for p in mine if p not in loaded)
        dropped = sorted(p for p in theirs if p not in mine)
        _check_stored_fresh(source, fresh)
        dtypes = {p: leaf.dtype for p, leaf in _flat(abstract).items() if p in loaded}
        return cls(source=source, model_config=model_config, loaded=loaded, fresh=fresh,
                   dropped=dropped, dtypes=dtypes)

    @property
    def fresh_head(self) -> list[tuple[str, ...]]:
        """The fresh leaves that are not adapters (a new task head)."""
        return [p for p in self.fresh if p[-1] not in ADAPTER_LEAVES]

    def describe(self) -> str:
        """One line for the start of the run."""
        def names(paths):
            shown = sorted({"/".join(p[:-1]) or p[-1] for p in paths})
            return ", ".join(shown[:6]) + (f" and {len(shown) - 6} more" if len(shown) > 6 else "")
        text = (f"init-from {self.source.path} ({self.source.kind}, {self.source.family}): "
                f"{len(self.loaded)} parameter arrays loaded")
        if self.fresh_head:
            text += f"; initialised fresh (not in the checkpoint, or shaped differently): {names(self.fresh_head)}"
        if self.dropped:
            text += f"; not used: {names(self.dropped)}"
        return text

    def check(self) -> None:
        """Refuse a start that loads nothing of the model's body."""
        if not self.loaded:
            raise UserError(f"--init-from {self.source.path}: none of its parameters fit this "
                            "model (paths or shapes differ everywhere); is it the same family "
                            "and size?")

    def fill(self, params: dict) -> dict:
        """``params`` (a fresh init, whole) with every loaded leaf put in (its dtype and,
        for device arrays, its sharding kept: each loaded leaf moves straight to them)."""
        flat = _flat(params)
        for path, array in self.loaded.items():
            fresh = flat[path]
            if isinstance(array, jax.Array) and isinstance(fresh, jax.Array):
                flat[path] = jax.device_put(array.astype(fresh.dtype), fresh.sharding)
            else:
                flat[path] = jnp.asarray(array, fresh.dtype)
        return _unflat(flat)

    def frozen_params(self, split: "ParamSplit") -> dict:
        """The frozen part of the train state of a start whose source is stored quantized
        (QLoRA): the loaded leaves that do not train, cast to the model's dtypes as
        :meth:`fill` casts them. The leaves move into the result: this Start and its
        source keep none (so that only the state holds the base)."""
        frozen = {}
        for path in [p for p in self.loaded if not split.trains(p)]:
            array = self.loaded.pop(path)
            want = self.dtypes[path]
            frozen[path] = array if array.dtype == want else jnp.asarray(array, want)
        self.source.params = {}
        return _unflat(frozen)

    def record(self) -> dict:
        """What ``config.json`` keeps of the start: path, kind, digest, fresh leaves."""
        return {"path": self.source.path, "kind": self.source.kind,
                "family": self.source.family, "sha256": self.source.digest(),
                "fresh": ["/".join(p) for p in self.fresh_head]}


def stored_shapes(shapes: dict, lora: Any) -> dict:
    """``shapes`` (a parameter tree, abstract) as a QLoRA run's state holds it: the
    adapters as they are, every other Dense kernel that ``quantize_params`` targets in its
    stored form (``kernel_q`` and scales), as ``ParamSplit.split`` stores the frozen part."""
    from ..layers import quant

    adapters, base = split_tree(shapes, lambda p: p[-1] in ADAPTER_LEAVES)
    return combine(adapters, jax.eval_shape(lambda tree: quant.quantize_params(tree, lora), base))


def _check_stored_fresh(source: Source, fresh: list[tuple[str, ...]]) -> None:
    """A quantized source must bring every stored kernel: one that would start fresh has no
    unquantized init to start from (the start never builds the base tree)."""
    from ..layers import quant

    missing = sorted({"/".join(p[:-1]) for p in fresh if p[-1] in quant.STORED_NAMES})
    if source.stored is not None and missing:
        raise UserError(f"--init-from {source.path}: the kernels of {', '.join(missing[:4])} "
                        "are not in the checkpoint (or shaped differently), and a QLoRA start "
                        "(lora.quantize) loads every base kernel stored; start without "
                        "lora.quantize, or from a checkpoint of the same model")


# ----------------------------------------------------------------------------- adapters

def adapted(model_config: Any) -> bool:
    """Whether the model trains adapters over a frozen base (LoRA or prefix tuning)."""
    return getattr(model_config, "lora", None) is not None or getattr(
        model_config, "prefix_tokens", 0) > 0


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """What trains in an adapter run: the adapter leaves and the ``head`` leaves (a task
    head initialised fresh); the rest is frozen, stored quantized with ``lora.quantize``."""
    head: frozenset = frozenset()
    lora: Any = None
    prefixes: bool = False          # ``head`` holds top-level module names, not leaf paths

    def trains(self, path: tuple[str, ...]) -> bool:
        if path[-1] in ADAPTER_LEAVES:
            return True
        return path[0] in self.head if self.prefixes else path in self.head

    def trainable(self, params: dict) -> dict:
        """The leaves that train (``split``'s first part, nothing quantized)."""
        return split_tree(params, self.trains)[0]

    def split(self, params: dict) -> tuple[dict, dict]:
        trainable, frozen = split_tree(params, self.trains)
        if self.lora is not None and self.lora.quantize is not None:
            from ..layers import quant
            frozen = quant.quantize_params(frozen, self.lora)
        return trainable, frozen

    def join(self, trainable: dict, frozen: dict) -> dict:
        """The whole tree, quantized kernels read back (fp32): what ``split`` took apart."""
        if self.lora is not None and self.lora.quantize is not None:
            from ..layers import quant
            frozen = quant.dequantize_params(frozen)
        return combine(trainable, frozen)


def make_split(model_config: Any, head: Any, family: str) -> ParamSplit | None:
    """The run's :class:`ParamSplit`, or None when every parameter trains. ``head``: the
    freshly initialised leaves of an --init-from start (paths or "a/b/c" strings), or None
    without one: then the family's task head (:data:`TASK_HEADS`) trains."""
    if not adapted(model_config):
        return None
    if head is None:
        names = TASK_HEADS.get(family, ())
        keep = frozenset(names)
        return ParamSplit(head=keep, lora=getattr(model_config, "lora", None), prefixes=True)
    paths = frozenset(tuple(p.split("/")) if isinstance(p, str) else tuple(p) for p in head)
    return ParamSplit(head=paths, lora=getattr(model_config, "lora", None))


def resumed_config(cfg, saved: dict, *, say=None):
    """``cfg`` with the model, tokenizer and start its run resolved when it began (``saved``:
    the workdir's config.json): a resumed init-from run needs no --init-from (nor the
    ``lora.*`` settings) again, and does not re-read its source unless nothing was saved.

    ``cfg``'s model settings apply on top as they did at the start (:func:`resolve`): those
    training may change (:data:`CHANGEABLE`, the task's head fields) are kept, so that the
    resumed run refuses a changed adapter (``lora.rank``) by name when it compares the
    model with its checkpoint's; ``say`` names the others that differ (they do not apply)."""
    experiment = saved["experiment"]
    family = experiment["model"]
    base = dict(experiment["model_overrides"])
    ignored = []
    for key, value in cfg.model_overrides.items():
        if key in CHANGEABLE or key in HEAD_FIELDS.get(family, ()):
            base[key] = value
        elif key in base and base[key] != value:
            ignored.append(f"{key}={value!r} (the run's: {base[key]!r})")
    if ignored and say is not None:
        say(f"--resume of a run started from {experiment['init_from']}: the model is the "
            f"run's ({family}); the model settings {', '.join(ignored)} do not apply")
    return cfg.replace(model=family, model_preset=experiment["model_preset"],
                       model_overrides=base, tokenizer=experiment["tokenizer"],
                       init_from=experiment["init_from"])


# ----------------------------------------------------------------------------- what trains

def dense_paths(shapes: dict) -> list[str]:
    """The paths of a parameter tree's Dense layers (``h_0/self_attn/query``): what
    ``lora.targets`` is searched in."""
    return sorted({"/".join(p[:-1]) for p in _flat(shapes) if p[-1] in ("kernel", "lora_a")})


def check_adapters(model_config: Any, shapes: dict) -> None:
    """Refuse LoRA whose ``targets`` matches no Dense layer (it would train nothing),
    listing a few of the model's Dense paths. ``shapes``: the model's parameter tree."""
    lora = getattr(model_config, "lora", None)
    if lora is None or any(p[-1] in lora_lib.ADAPTER_NAMES for p in _flat(shapes)):
        return
    paths = dense_paths(shapes)
    shown = ", ".join(paths[:8]) + (f" and {len(paths) - 8} more" if len(paths) > 8 else "")
    raise UserError(f"lora.targets={lora.targets!r} matches none of the model's {len(paths)} "
                    f"Dense layers ({shown}), so LoRA would train nothing; give a regex that is "
                    "found in some of these paths, e.g. --set lora.targets='attn/(query|value)'")


def trainable_counts(split: ParamSplit | None, shapes: dict) -> tuple[int, int] | None:
    """``(head, adapters)``: the parameters that train over the frozen base, other than
    adapters (a task head) and the LoRA adapters' (prefix keys and values are no matmul
    weights: not counted); None when every parameter trains (``split`` None). For
    ``Task.flops_per_step``. ``shapes``: the whole parameter tree."""
    if split is None:
        return None
    head = adapters = 0
    for path, leaf in _flat(shapes).items():
        if split.trains(path) and path[-1] in lora_lib.ADAPTER_NAMES:
            adapters += int(np.prod(leaf.shape))
        elif split.trains(path) and path[-1] not in ("prefix_key", "prefix_value"):
            head += int(np.prod(leaf.shape))
    return head, adapters


def describe_trainable(split: ParamSplit, shapes: dict) -> str:
    """One line: how many parameters each kind of adapter trains (LoRA, prefix, a task
    head) and how many are frozen. ``shapes``: the whole parameter tree."""
    counts = {"LoRA": 0, "prefix": 0, "head": 0, "frozen": 0}
    lora_layers = set()
    for path, leaf in _flat(shapes).items():
        size = int(np.prod(leaf.shape))
        if not split.trains(path):
            counts["frozen"] += size
        elif path[-1] in lora_lib.ADAPTER_NAMES:
            counts["LoRA"] += size
            lora_layers.add("/".join(path[:-1]))
        elif path[-1] in ("prefix_key", "prefix_value"):
            counts["prefix"] += size
        else:
            counts["head"] += size
    total = sum(counts.values())
    trained = total - counts["frozen"]
    parts = []
    if counts["LoRA"]:
        parts.append(f"LoRA {counts['LoRA']:,} (rank {split.lora.rank} on {len(lora_layers)} "
                     f"Dense layers matching {split.lora.targets!r})")
    if counts["prefix"]:
        parts.append(f"prefix {counts['prefix']:,}")
    if counts["head"]:
        parts.append(f"task head {counts['head']:,}")
    return (f"trainable parameters: {trained:,} of {total:,} ({trained / total:.2%}): "
            + ", ".join(parts) + f"; frozen: {counts['frozen']:,}")
