"""``transformer-jax export``: a trained run as a Hugging Face directory, or its adapter as
a PEFT directory.

  --format hf    ``model.safetensors`` + ``config.json`` + the tokenizer files: what
                 ``AutoModel*.from_pretrained(DIR)`` loads (GPT-2, Llama or Mistral, BERT with the
                 run's head, T5, ViT, CLIP). A LoRA run needs ``--merge`` (the adapters folded
                 into the kernels); a QLoRA run's base is read back from its quantized form.
                 A model that generates (GPT-2, Llama, Mistral, Qwen 2/3, Gemma 3, T5) also
                 gets ``generation_config.json``.
  --format peft  ``adapter_model.safetensors`` + ``adapter_config.json`` (LoRA, or prefix
                 tuning): ``peft.PeftModel.from_pretrained(base, DIR)`` loads it over the
                 base the run started from (``base_model_name_or_path``: its ``--init-from``).

Tokenizer files: an ``hf:DIR`` tokenizer's own files are copied; the byte tokenizer is
written as a ``tokenizer.json`` with the same ids (pad 0, eos 1, unk 2, byte b -> b + 3;
BERT's [CLS]/[SEP]/[MASK] after it where the run has them) that adds no special token, so
``AutoTokenizer`` and ``lm_eval --model hf`` see the run's ids (``data/byte_hf.py``); a
SentencePiece model as ``spiece.model`` and as a ``tokenizer.json`` built from it that adds
no special token either (``data/spm_hf.py``).

Special ids (:func:`special_ids_config`): the task's ``generation_ids`` (a language model:
``tasks/lm.py``'s ``lm_generation_ids``, the --init-from checkpoint's own generation ids
first, else the tokenizer's; seq2seq: its pad, eos and decoder start) go into
``config.json`` (``bos_token_id``, ``eos_token_id``: a list where there are several,
``pad_token_id``) and, for a model that generates, ``generation_config.json``: what
transformers' ``generate`` and the servers that read these files stop at, the ids our own
``generate`` stops at. Nothing is
written when the run is refused; the directory is filled in a temporary sibling and renamed
into place, with the modes a plain ``mkdir``/``open`` gives (``storage.staged_dir``).
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

from .errors import UserError

FORMATS = ("hf", "peft")

#: HF files that make up a tokenizer (copied from an ``hf:DIR`` tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "spiece.model",
                   "tokenizer.model")


def hf_architecture(config: Any) -> str:
    """The ``transformers`` class a model config exports as (``config.json``'s architectures)."""
    from .interop.hf.registry import family_for_config

    family = family_for_config(config).name
    if family == "bert":
        return {"mlm": "BertForMaskedLM", "pretraining": "BertForPreTraining",
                "classification": "BertForSequenceClassification", "base": "BertModel"}[config.head]
    if family == "vit":
        return "ViTForImageClassification" if config.num_classes else "ViTModel"
    return {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "t5": "T5ForConditionalGeneration", "clip": "CLIPModel",
            "gemma": "Gemma3ForCausalLM"}[family]


def _unique_arrays(state_dict: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tied entries (the same array under two keys, e.g. a tied LM head) written once, under
    the first key: what ``save_pretrained`` does."""
    seen, out = set(), {}
    for key, array in state_dict.items():
        if id(array) not in seen:
            seen.add(id(array))
            out[key] = np.asarray(array, order="C")      # 0-d stays 0-d (logit_scale)
    return out


#: the HF classes that generate text: the export writes their ``generation_config.json``
GENERATES = ("LMHeadModel", "ForCausalLM", "ForConditionalGeneration")


def special_ids_config(task: Any) -> dict:
    """``config.json``'s special ids for the run's ``task`` (``Task.generation_ids``; none
    for a task that generates nothing, whose model config holds its ids): an eos list of one
    written as its id, as transformers writes it."""
    ids = dict(task.generation_ids())
    eos = ids.get("eos_token_id")
    if isinstance(eos, list) and len(eos) == 1:
        ids["eos_token_id"] = eos[0]
    return ids


def write_generation_config(out_dir: str, ids: dict, architecture: str) -> None:
    """``generation_config.json`` for a model that generates (``architecture``, the HF
    class, in :data:`GENERATES`): ``ids`` (:func:`special_ids_config`), greedy decoding
    (transformers' default) that stops at the eos ids; nothing for any other model."""
    if ids and architecture.endswith(GENERATES):
        from transformers import GenerationConfig

        GenerationConfig(**ids).save_pretrained(out_dir)


def write_hf(module: Any, params: Any, out_dir: str, *, extra_config: dict | None = None) -> None:
    """``module`` + plain params (no adapters, no quantized kernels) as an HF directory:
    ``model.safetensors`` and ``config.json``."""
    from safetensors.numpy import save_file

    from .interop.hf import hf_config, to_hf_numpy

    arrays = _unique_arrays(to_hf_numpy(module, params))
    save_file(arrays, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(module.config, **(extra_config or {}))
    config.architectures = [hf_architecture(module.config)]
    config.save_pretrained(out_dir)


def write_tokenizer(spec: str | None, out_dir: str, extra_specials: list[str] = ()) -> list[str]:
    """The tokenizer files for the run's tokenizer ``spec``; returns the names written."""
    written = []
    if isinstance(spec, str) and spec.startswith("hf:"):
        source = spec[3:]
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
                written.append(name)
        return written
    if spec in (None, "byte", "bytes", "byt5"):
        from .data.byte_hf import write_byte_tokenizer
        return write_byte_tokenizer(out_dir, extra_specials)
    path = spec.split(":", 1)[1] if spec.split(":", 1)[0] in ("sentencepiece", "spm") else spec
    from . import storage
    from .data.spm_hf import write_sentencepiece_tokenizer
    return write_sentencepiece_tokenizer(storage.read_bytes(path), out_dir, extra_specials)


def _mlm_specials(task: Any) -> list[str]:
    """[CLS]/[SEP]/[MASK] of a BERT task whose byte tokenizer got them appended, in id order."""
    vocab = getattr(task, "vocab", None)
    if vocab is None or getattr(vocab, "base_size", None) is None:
        return []
    ids = {"[CLS]": vocab.cls_id, "[SEP]": vocab.sep_id, "[MASK]": vocab.mask_id}
    appended = sorted((i, name) for name, i in ids.items() if i >= vocab.base_size)
    return [name for _, name in appended]


def export(workdir: str, out_dir: str, *, fmt: str = "hf", merge: bool = False) -> dict:
    """Export the latest checkpoint of ``workdir`` to ``out_dir`` (see the module docstring);
    returns a summary (the files written, the architecture)."""
    from . import storage
    from .layers import lora as lora_lib
    from .workdir import load_run

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is unknown; choose one of {list(FORMATS)}")
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise UserError(f"--out {out_dir} exists and is not an empty directory; choose a new one")
    run_config, model, params, task = load_run(workdir)
    config = model.config
    lora = getattr(config, "lora", None)
    prefix = getattr(config, "prefix_tokens", 0)
    if lora is not None and lora.quantize is not None:
        from .layers import quant
        params = quant.dequantize_params(params)
    base = (run_config.get("init_from") or {}).get("path")
    with storage.staged_dir(out_dir) as staging:
        if fmt == "peft":
            if merge:
                raise UserError("--merge folds the adapters into the model: use it with "
                                "--format hf; --format peft writes the adapter alone")
            if lora is not None:
                from .interop.peft import to_peft
                to_peft(model, params, staging, base_model_name_or_path=base,
                        modules_to_save=_trained_heads(model, run_config))
            elif prefix:
                from .interop.peft.prefix import prefix_to_peft
                prefix_to_peft(model, params, staging, base_model_name_or_path=base)
            else:
                raise UserError(f"{workdir} trained no adapters (no model.lora, no "
                                "model.prefix_tokens); export it with --format hf")
            architecture = None
        else:
            if prefix:
                raise UserError("a prefix-tuning run has no Hugging Face model form (the prefix "
                                "is not a weight of the HF class): export it with --format peft")
            if lora is not None:
                if not merge:
                    raise UserError("this run trained LoRA adapters: export them with --format "
                                    "peft, or the merged model with --format hf --merge")
                params = lora_lib.merge(params, lora)
                _, model = _plain_model(run_config, config)
            ids = special_ids_config(task)
            write_hf(model, params, staging,
                     extra_config={**ids, **_label_config(task, model.config)})
            architecture = hf_architecture(model.config)
            write_generation_config(staging, ids, architecture)
        if "tokenizer" in task.spec():          # text tasks (an image task has none)
            write_tokenizer(task.spec()["tokenizer"], staging, _mlm_specials(task))
        files = sorted(os.listdir(staging))
    return {"out": out_dir, "format": fmt, "files": files, "architecture": architecture,
            "merged": bool(merge and lora is not None)}


def _label_config(task: Any, config: Any) -> dict:
    """A classifier's class names (the run's task spec: ``classes``, an image set's
    ``label_names``) as ``config.json``'s ``id2label`` / ``label2id``; {} for other models."""
    spec = task.spec()
    names = spec.get("classes") or spec.get("label_names")
    if not names or len(names) != getattr(config, "num_classes", None):
        return {}
    return {"id2label": dict(enumerate(names)),
            "label2id": {name: i for i, name in enumerate(names)}}


def _trained_heads(model: Any, run_config: dict) -> list[str] | None:
    """The HF modules of the task head an adapter run trained along (``config.json``'s
    ``init_from.fresh``: a new classifier, a pooler the checkpoint lacked), which the PEFT
    adapter then carries whole (``modules_to_save``); None: the default (no record)."""
    fresh = (run_config.get("init_from") or {}).get("fresh")
    if not fresh:
        return None
    from .interop.peft import tensor_maps

    paths = {tuple(p.split("/")) for p in fresh}
    return sorted({m.key.rsplit(".", 1)[0] for m in tensor_maps(model.config)
                   if m.constant is None and any(t in paths for t, _ in m.targets)})


def _plain_model(run_config: dict, config: Any):
    """The run's model without adapters (what merged params fit)."""
    from .models import model_from_config

    return model_from_config(run_config["family"], config.replace(lora=None).to_dict())
