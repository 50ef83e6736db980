"""Hugging Face BERT <-> ``models.bert.Bert``, reached through :mod:`transformer_jax.interop.hf`.

Use the generic entry points, which dispatch here on ``model_type == "bert"`` (``from_hf``)
or on a ``BertConfig`` (``to_hf``, ``hf_config``)::

    module, params = from_hf(hf_model)             # BertForPreTraining, BertForMaskedLM,
    module, params = from_hf("/path/to/save_dir")  # BertModel, BertForSequenceClassification
    state_dict = to_hf(module, params)             # strict-loads into hf_class(module.config.head)

The HF class is recognised from the state-dict keys (a live model's config may not list
``architectures``) and becomes ``BertConfig.head``:

    BertForPreTraining             bert.* + cls.predictions.* + cls.seq_relationship.*  "pretraining"
    BertForMaskedLM                bert.* (no pooler) + cls.predictions.*              "mlm"
    BertModel                      embeddings.*, encoder.*, pooler.* (no prefix)        "base"
    BertForSequenceClassification  bert.* + classifier.*                               "classification"

Weight layout (``p`` = ``"bert."``, empty for ``BertModel``). Every ``nn.Linear`` weight is
(out, in) and transposed into the Dense kernel (in, out...). Legend: V vocab, P positions,
Y token types, D width, N heads, H = D / N, F MLP width, C classes.

    HF key                                               shape    flax path (under bert/ unless noted)
    {p}embeddings.word_embeddings.weight                 (V, D)   word_embeddings/embedding (V, D)
    {p}embeddings.position_embeddings.weight             (P, D)   position_embeddings/embedding
    {p}embeddings.token_type_embeddings.weight           (Y, D)   token_type_embeddings/embedding
    {p}embeddings.LayerNorm.{weight,bias}                (D,)     embeddings_norm/{scale,bias}
    {p}encoder.layer.{i}.attention.self.{query,key,value}.weight (D, D)  layer_{i}/self_attn/{..}/kernel (D, N, H)
    {p}encoder.layer.{i}.attention.self.{query,key,value}.bias   (D,)    layer_{i}/self_attn/{..}/bias (N, H)
    {p}encoder.layer.{i}.attention.output.dense.weight   (D, D)   layer_{i}/self_attn/out/kernel (N, H, D)
    {p}encoder.layer.{i}.attention.output.dense.bias     (D,)     layer_{i}/self_attn/out/bias
    {p}encoder.layer.{i}.attention.output.LayerNorm.*    (D,)     layer_{i}/norm1/{scale,bias}
    {p}encoder.layer.{i}.intermediate.dense.{weight,bias} (F, D)  layer_{i}/mlp/wi/{kernel (D, F),bias}
    {p}encoder.layer.{i}.output.dense.{weight,bias}      (D, F)   layer_{i}/mlp/wo/{kernel (F, D),bias}
    {p}encoder.layer.{i}.output.LayerNorm.*              (D,)     layer_{i}/norm2/{scale,bias}
    (scan_layers=True: the layer_{i} subtrees are one bert/layer with a leading (L,) axis)
    {p}pooler.dense.{weight,bias}                        (D, D)   pooler/{kernel,bias}
    cls.predictions.transform.dense.{weight,bias}        (D, D)   mlm/transform/{kernel,bias} (top level)
    cls.predictions.transform.LayerNorm.{weight,bias}    (D,)     mlm/transform_norm/{scale,bias}
    cls.predictions.bias                                 (V,)     mlm/bias
    cls.seq_relationship.{weight,bias}                   (2, D)   nsp/{kernel (D, 2),bias}
    classifier.{weight,bias}                             (C, D)   classifier/{kernel (D, C),bias}

Keys that are not parameters of their own:
  * ``cls.predictions.decoder.weight`` and ``cls.predictions.decoder.bias`` are tied to
    ``{p}embeddings.word_embeddings.weight`` and ``cls.predictions.bias``: a live model's
    ``state_dict()`` lists them, a ``save_pretrained`` file omits them. ``from_hf`` accepts
    them only if they equal the tensors they are tied to (an untied decoder raises);
    ``to_hf`` emits them, as the same arrays, because a strict load expects every key of
    ``state_dict()``.
  * ``{p}embeddings.position_ids`` (1, P) and ``{p}embeddings.token_type_ids`` (1, P) are
    HF's *non-persistent* buffers (``arange(P)`` and zeros): absent from current state dicts
    and files, but written by transformers < 4.31. ``from_hf`` accepts them only with
    exactly those values and drops them (the flax model builds both itself);
    ``to_hf`` never emits them (a strict load would reject them as unexpected).
  * Anything else unexpected, missing, or of the wrong shape raises ``ConversionError``
    naming the key (via ``StateDictReader``).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from ...errors import UserError
from ...models.bert import Bert, BertConfig
from ..common import (ConversionError, StateDictReader, TensorMap, dump_state_dict, layer_norm,
                      linear, load_params, refuse_attention_options)
from .registry import (HFFamily, activation_from_hf, activation_to_hf, cast_params,
                       check_table, plain_params, to_layout, without_scan)

#: HF config attribute <-> BertConfig field, one table for both directions.
BERT_CONFIG_FIELDS: tuple[tuple[str, str], ...] = (
    ("vocab_size", "vocab_size"),
    ("max_position_embeddings", "max_len"),
    ("type_vocab_size", "type_vocab_size"),
    ("num_hidden_layers", "num_layers"),
    ("num_attention_heads", "num_heads"),
    ("hidden_size", "d_model"),
    ("intermediate_size", "mlp_dim"),
    ("layer_norm_eps", "norm_eps"),
    ("hidden_dropout_prob", "dropout_rate"),
    ("attention_probs_dropout_prob", "attention_dropout_rate"),
    ("classifier_dropout", "classifier_dropout_rate"),
    ("initializer_range", "initializer_range"),
    ("pad_token_id", "pad_token_id"),
)

#: HF options our BERT implements at one value only: name -> the supported value.
BERT_FIXED_OPTIONS: dict[str, Any] = {
    "is_decoder": False,
    "add_cross_attention": False,
    "position_embedding_type": "absolute",   # older transformers; gone from 5.x configs
}

#: BertConfig.head -> the transformers class holding that head.
HF_CLASSES: dict[str, str] = {
    "pretraining": "BertForPreTraining",
    "mlm": "BertForMaskedLM",
    "base": "BertModel",
    "classification": "BertForSequenceClassification",
}


def hf_class(head: str):
    """The ``transformers`` class for a ``BertConfig.head`` (lazy import)."""
    import transformers

    if head not in HF_CLASSES:
        raise UserError(f"unknown BERT head {head!r}; choose one of {sorted(HF_CLASSES)}")
    return getattr(transformers, HF_CLASSES[head])


# ============================================================================ config

def _num_labels(config: Mapping[str, Any]) -> int:
    if config.get("id2label"):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def bert_config_from_hf(config: Mapping[str, Any], head: str, **overrides: Any) -> BertConfig:
    """HF BERT config (a dict) -> ``BertConfig`` with ``head``; unsupported options raise."""
    if config.get("model_type") != "bert":
        raise UserError(f"expected a BERT config (model_type 'bert'), got model_type "
                        f"{config.get('model_type')!r}")
    for option, supported in BERT_FIXED_OPTIONS.items():
        if option in config and config[option] != supported:
            raise UserError(f"unsupported BERT config option {option}={config[option]!r}: "
                            f"transformer_jax's BERT implements only {option}={supported!r}")
    activation = activation_from_hf(config.get("hidden_act", "gelu"), family="BERT",
                                    option="hidden_act")
    if head in ("pretraining", "mlm") and config.get("tie_word_embeddings", True) is False:
        raise UserError("unsupported BERT config option tie_word_embeddings=False: "
                        "transformer_jax's BERT always ties the MLM decoder to the word embeddings")
    values = {ours: config[hf] for hf, ours in BERT_CONFIG_FIELDS if hf in config}
    values.update(activation=activation, head=head)
    if head == "classification":
        values["num_classes"] = _num_labels(config)
    values.update(overrides)
    return BertConfig.from_dict(values)


def bert_hf_config(config: BertConfig, **extra: Any):
    """``BertConfig`` -> ``transformers.BertConfig`` (lazy import).

    ``num_labels`` is set for the classification head; ``extra`` goes to the HF config.
    """
    from transformers import BertConfig as HFBertConfig

    refuse_attention_options(config, "BERT")
    values = {hf: getattr(config, ours) for hf, ours in BERT_CONFIG_FIELDS}
    values.update(intermediate_size=config.mlp_features,
                  hidden_act=activation_to_hf(config.activation, what="BertConfig.activation"),
                  is_decoder=False, add_cross_attention=False, tie_word_embeddings=True)
    if config.head == "classification":
        values["num_labels"] = config.num_classes
    values.update(extra)
    return HFBertConfig(**values)


# ============================================================================ the table

def bert_tensor_maps(cfg: BertConfig, prefix: str) -> list[TensorMap]:
    """Every HF tensor <-> flax leaf of ``Bert(cfg)`` (unscanned), in HF state-dict order.

    ``prefix`` is ``"bert."`` for the headed classes and ``""`` for ``BertModel``.
    """
    d, f, n, h, v = cfg.d_model, cfg.mlp_features, cfg.num_heads, cfg.head_dim, cfg.vocab_size
    emb = prefix + "embeddings."
    maps = [
        TensorMap(emb + "word_embeddings.weight", (v, d), ((("bert", "word_embeddings", "embedding"), (v, d)),)),
        TensorMap(emb + "position_embeddings.weight", (cfg.max_len, d),
                  ((("bert", "position_embeddings", "embedding"), (cfg.max_len, d)),)),
        TensorMap(emb + "token_type_embeddings.weight", (cfg.type_vocab_size, d),
                  ((("bert", "token_type_embeddings", "embedding"), (cfg.type_vocab_size, d)),)),
        *layer_norm(emb + "LayerNorm.", ("bert", "embeddings_norm"), d),
    ]
    for i in range(cfg.num_layers):
        hf, ours = f"{prefix}encoder.layer.{i}.", ("bert", f"layer_{i}")
        for proj in ("query", "key", "value"):
            maps += linear(f"{hf}attention.self.{proj}.", ours + ("self_attn", proj), d, d,
                           kernel_shape=(d, n, h), bias_shape=(n, h))
        maps += linear(f"{hf}attention.output.dense.", ours + ("self_attn", "out"), d, d,
                       kernel_shape=(n, h, d))
        maps += layer_norm(f"{hf}attention.output.LayerNorm.", ours + ("norm1",), d)
        maps += linear(f"{hf}intermediate.dense.", ours + ("mlp", "wi"), d, f)
        maps += linear(f"{hf}output.dense.", ours + ("mlp", "wo"), f, d)
        maps += layer_norm(f"{hf}output.LayerNorm.", ours + ("norm2",), d)
    if cfg.has_pooler:
        maps += linear(prefix + "pooler.dense.", ("bert", "pooler"), d, d)
    if cfg.head in ("pretraining", "mlm"):
        maps += [TensorMap("cls.predictions.bias", (v,), ((("mlm", "bias"), (v,)),))]
        maps += linear("cls.predictions.transform.dense.", ("mlm", "transform"), d, d)
        maps += layer_norm("cls.predictions.transform.LayerNorm.", ("mlm", "transform_norm"), d)
    if cfg.head == "pretraining":
        maps += linear("cls.seq_relationship.", ("nsp",), d, 2)
    if cfg.head == "classification":
        maps += linear("classifier.", ("classifier",), d, cfg.num_classes)
    return maps


# ============================================================================ HF -> flax

def _detect_head(config: Mapping[str, Any], keys: set[str]) -> tuple[str, str]:
    """(head, key prefix) from the state-dict keys (see the module docstring)."""
    if config.get("is_decoder"):
        raise UserError("unsupported BERT config option is_decoder=True (BertLMHeadModel, a "
                        "causal decoder); transformer_jax's BERT is a bidirectional encoder")
    supported = sorted(HF_CLASSES.values())
    unsupported = [a for a in config.get("architectures") or () if a not in supported]
    if unsupported:
        raise ConversionError(f"unsupported BERT architecture {unsupported[0]!r}; supported: "
                              f"{supported}")
    if "embeddings.word_embeddings.weight" in keys:
        return "base", ""
    if "bert.embeddings.word_embeddings.weight" not in keys:
        raise ConversionError("BERT state dict: neither 'bert.embeddings.word_embeddings.weight' "
                              "nor 'embeddings.word_embeddings.weight' is present; is this a BERT "
                              "checkpoint?")
    pooler = "bert.pooler.dense.weight" in keys
    if "classifier.weight" in keys and pooler:
        return "classification", "bert."
    if "cls.predictions.bias" in keys:
        return ("pretraining" if "cls.seq_relationship.weight" in keys else "mlm"), "bert."
    heads = sorted({k.split(".")[0] for k in keys if not k.startswith("bert.")})
    raise ConversionError(
        f"unsupported BERT head: top-level keys besides 'bert.' are {heads}"
        + ("" if pooler else " and there is no pooler")
        + f" (e.g. BertForTokenClassification, BertForQuestionAnswering); supported: {supported}")


def _take_tied(reader: StateDictReader, key: str, shape, tied_to: str, value: np.ndarray) -> None:
    if key in reader and not np.array_equal(reader.take(key, shape), value):
        raise ConversionError(f"{key!r} differs from {tied_to!r}, to which BERT ties it; an "
                              "untied MLM decoder is not supported")


def _take_buffer(reader: StateDictReader, key: str, shape, expected: np.ndarray, what: str) -> None:
    if key in reader and not np.array_equal(reader.take(key, shape), expected):
        raise ConversionError(f"{key!r}: this buffer must be {what}; a checkpoint with other "
                              "values is not supported")


def _bert_from_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any],
                          **overrides: Any) -> tuple[Bert, dict[str, Any]]:
    """HF BERT state dict (any of the four classes) -> ``(Bert, params)``."""
    reader = StateDictReader(state_dict, what="BERT state dict")
    head, prefix = _detect_head(config, set(reader.remaining()))
    cfg = bert_config_from_hf(config, head, **overrides)
    if cfg.head != head:
        raise UserError(f"this checkpoint holds the {head!r} head ({HF_CLASSES[head]}); "
                        f"head={cfg.head!r} cannot be loaded from it")
    maps = bert_tensor_maps(cfg, prefix)
    check_table(maps, Bert(without_scan(cfg)), jnp.zeros((1, 1), jnp.int32), what="BERT")
    params = load_params(maps, reader, finish=False)

    if cfg.head in ("pretraining", "mlm"):
        words = params["bert"]["word_embeddings"]["embedding"]
        _take_tied(reader, "cls.predictions.decoder.weight", words.shape,
                   prefix + "embeddings.word_embeddings.weight", words)
        _take_tied(reader, "cls.predictions.decoder.bias", (cfg.vocab_size,),
                   "cls.predictions.bias", params["mlm"]["bias"])
    p = cfg.max_len
    _take_buffer(reader, prefix + "embeddings.position_ids", (1, p), np.arange(p)[None],
                 f"arange({p})")
    _take_buffer(reader, prefix + "embeddings.token_type_ids", (1, p), np.zeros((1, p)), "zeros")
    reader.finish()
    params = to_layout(cast_params(params, cfg.param_dtype), cfg.layer_stacks,
                       scanned=cfg.scan_layers, what="BERT params")
    return Bert(cfg), params


# ============================================================================ flax -> HF

def bert_to_state_dict(module: Bert, params: Any) -> dict[str, np.ndarray]:
    """``(Bert, params)`` -> the state dict of ``hf_class(module.config.head)``, numpy arrays.

    ``params`` may be the params tree or the ``{'params': ...}`` variables, boxed or not,
    in either layout (``bert/layer_{i}`` or a scanned ``bert/layer``).
    """
    cfg = module.config
    params = to_layout(plain_params(params), cfg.layer_stacks, scanned=False, what="BERT params")
    prefix = "" if cfg.head == "base" else "bert."
    out = dump_state_dict(bert_tensor_maps(cfg, prefix), params, what="BERT params")
    if cfg.head in ("pretraining", "mlm"):
        out["cls.predictions.decoder.weight"] = out[prefix + "embeddings.word_embeddings.weight"]
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"]
    return out


FAMILY = HFFamily(
    name="bert", model_types=("bert",), config_type=BertConfig,
    from_state_dict=_bert_from_state_dict, to_state_dict=bert_to_state_dict,
    make_hf_config=bert_hf_config)
