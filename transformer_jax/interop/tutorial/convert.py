"""The tutorial's PyTorch modules -> their Flax mirrors (:mod:`.modules`), and back.

Used by :func:`transformer_jax.interop.from_torch` and ``to_torch_state_dict`` after the
``torch.nn`` built-ins (:mod:`transformer_jax.interop.torch_nn.convert`). The classes of
``tests/interop/tutorial_classes.py`` are the tutorial's own.

Recognised by attribute names. First, a module whose ``forward`` is
missing (``nn.Module``'s unimplemented one) or a stub (a body that only returns None, e.g.
``pass``) is refused with a ``UserError`` (a ``ValueError``): PyTorch computes nothing to
convert. Both occur in the tutorials: ``GroupedQueryAttention`` stops after ``__init__``
(the message says what forward to add to a subclass, which then converts by rule 4) and
``SlidingWindowAttention.forward`` is ``pass`` (the message points to the library's
sliding-window attention). Then, tried in this order:
  1. whole Transformer: ``embedding``, ``pos_encoder``, ``encoder_layers`` (ModuleList),
     ``classifier`` [, ``decoder_embedding``, ``decoder_pos_encoder``, ``decoder_layers``
     unless the bool ``encoder_only``] -> ``TutorialTransformer``. The parts follow rules 5,
     11, 9 and 7; all layers must share one configuration. The decoder's ``tgt_mask`` is
     read off the module's own ``generate_mask``: the tutorial's ``triu(ones, diagonal=1)``
     -- inverted w.r.t. its own convention (1 = may attend), so target position i sees
     only later positions -- is reproduced as written (``decoder_mask="future"``), not
     refused: conversion keeps PyTorch's outputs, which is what a checkpoint trained with
     that mask needs; a corrected causal ``tril`` gives ``decoder_mask="causal"``;
  2. BERT: ``transformer`` (rule 1, encoder-only), ``pooler``, ``next_sentence_predictor``,
     ``masked_lm_predictor`` -> ``TutorialBERT``;
  3. GPT: ``transformer`` (rule 1, encoder-only), ``lm_head`` -> ``TutorialGPT``. The
     tutorial's BERT and GPT apply their heads (Linear layers of input width d_model) to
     the Transformer's output, which is already its classifier's vocabulary logits: they
     run, and convert as written, only when vocab_size == d_model; otherwise PyTorch
     fails with a shape error and so does ``from_torch``, with a message saying so;
  4. grouped-query attention: ``nn.Linear`` attributes ``q_proj, k_proj, v_proj, o_proj``
     -> ``TutorialGroupedQueryAttention``. Query heads from an int attribute as in rule 10 (or
     ``num_heads=``), key/value heads from ``n_kv_groups``, ``n_kv_heads``, ``num_kv_heads``
     or ``num_key_value_heads`` (or ``num_kv_heads=``, else k_proj's width / head dim).
     The forward is assumed to be the usual one (see ``TutorialGroupedQueryAttention``);
  5. input embedding: ``token_embedding`` (``nn.Embedding``) and an ``nn.Parameter``
     ``position_embedding`` (1, max_len, D) -> ``TutorialInputEmbedding`` (ids -> E[ids] *
     sqrt(D) + learned positions, dropout). ``padding_idx`` is accepted (its row gets a
     gradient here, none in PyTorch); ``max_norm`` and ``scale_grad_by_freq`` are refused;
  6. patch embedding: an ``nn.Conv2d`` attribute ``proj`` with kernel_size == stride, no
     padding, dilation 1, groups 1 -> ``TutorialPatchEmbed`` (NCHW images -> (B, N, D));
  7. post-norm decoder layer: ``self_attn``, ``cross_attn``, ``feed_forward``, ``norm1``,
     ``norm2``, ``norm3`` -> ``TutorialDecoderLayer``;
  8. pre-norm encoder block: ``attn``, ``ff``, ``norm1``, ``norm2`` -> ``TutorialEncoderBlock``
     (``pre_norm=True``);
  9. post-norm block: ``attention`` or ``self_attn``, ``feed_forward``, ``norm1``, ``norm2``
     -> ``TutorialEncoderBlock`` (``pre_norm=False``);
  10. multi-head attention: ``nn.Linear`` attributes ``w_q, w_k, w_v, w_o`` (or ``W_q, W_k,
      W_v, W_o``) -> ``TutorialMultiHeadAttention``. Heads from an int attribute ``num_heads``,
      ``n_heads``, ``n_head``, ``nhead``, ``heads`` or ``h`` (or ``d_k``/``head_dim``), else
      pass ``num_heads=``. Any ``nn.Dropout`` inside (directly or in an inner ``attention``
      submodule) is taken as dropout on the attention weights;
  11. positional encoding: a buffer ``pe`` of shape (1, max_len, D) equal to the library's
      ``sinusoidal_table(max_len, D)`` within 1e-6 + pos * 2**-22 (the second term is the
      fp32 rounding of the angle pos * freq: two implementations' 1-ulp differences in
      ``exp`` grow with the position), else an error naming ``pe``; the mirror recomputes
      the table (no parameters) -> ``TutorialPositionalEncoding``;
  12. feed-forward: an ``nn.Sequential`` of Linear, activation, Dropout, Linear [, Dropout]
      -- the module itself or its attribute ``net`` or ``feed_forward`` -- or ``nn.Linear``
      attributes ``w_1``, ``w_2`` with an activation module (ReLU/GELU/SiLU/Tanh) and an
      optional ``nn.Dropout`` among its children -> ``TutorialFeedForward``;
  13. scaled dot-product attention: no parameters or buffers, only ``nn.Dropout``
      children (their rate: dropout on the weights), ``forward(query, key, value, ...)``
      (or ``q, k, v``) -> ``TutorialScaledDotProductAttention``, returning (output, weights).
  Inside blocks, the attention and feed-forward submodules follow rules 10 and 12; residual
  dropout is the block's own ``nn.Dropout`` child(ren).

Overrides (keyword arguments) resolve ambiguities: ``norm_first`` (blocks and whole models;
default by the rules above, or the module's own bool ``norm_first`` attribute),
``num_heads`` (tutorial attention, blocks and whole models), ``num_kv_heads`` (grouped-query
attention), ``activation`` (feed-forwards, blocks, whole models and the built-in layers).

Here: the table of rules and the whole models (rules 1-3); the layers (rules 4-13) are in
:mod:`.layers`, the predicates in :mod:`.detect`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from ...errors import UserError
from ..common import TensorMap, linear
from ..torch_nn.convert import RECOGNISED as BUILTIN_RECOGNISED
from ..torch_nn.convert import Conversion, check_overrides, recognise_builtin
from . import detect, layers
from .modules import (TutorialBERT, TutorialDecoderLayer, TutorialEncoderBlock, TutorialGPT,
                      TutorialInputEmbedding, TutorialPositionalEncoding, TutorialTransformer)

__all__ = ["RECOGNISED", "recognise_tutorial"]

RECOGNISED = (
    "tutorial decoder layer (self_attn, cross_attn, feed_forward, norm1, norm2, norm3)",
    "tutorial pre-norm block (attn, ff, norm1, norm2)",
    "tutorial post-norm block (attention|self_attn, feed_forward, norm1, norm2)",
    "tutorial multi-head attention (w_q, w_k, w_v, w_o Linear layers, or W_q...)",
    "tutorial positional encoding (buffer pe)",
    "tutorial feed-forward (Sequential Linear/act/Dropout/Linear, itself or as net/feed_forward; "
    "or w_1, w_2 Linear + activation module)",
    ("tutorial Transformer (embedding, pos_encoder, encoder_layers, classifier [, decoder_layers, "
     "decoder_embedding, decoder_pos_encoder])"),
    "tutorial BERT (transformer, pooler, next_sentence_predictor, masked_lm_predictor)",
    "tutorial GPT (transformer, lm_head)",
    "tutorial grouped-query attention (q_proj, k_proj, v_proj, o_proj Linear layers)",
    "tutorial input embedding (token_embedding Embedding, position_embedding Parameter)",
    "tutorial patch embedding (proj Conv2d)",
    "tutorial scaled dot-product attention (no parameters, forward(query, key, value, ...))",
)


# ----------------------------------------------------------------------------- the table

def recognise_tutorial(m: Any, overrides: dict[str, Any]) -> Conversion:
    """The conversion of one of the tutorial's modules, by the rules in the module docstring.

    Raises ``TypeError`` (listing every recognised module, built-ins included) when ``m``
    matches no rule, ``UserError`` when it cannot run (no or a stub ``forward``).
    """
    detect.check_runnable(m)
    blocks = ("norm_first", "num_heads", "activation")
    tutorial = (
        ("tutorial Transformer", detect.is_tutorial_transformer, _tutorial_transformer, blocks),
        ("tutorial BERT", detect.is_tutorial_bert, _tutorial_bert, blocks),
        ("tutorial GPT", detect.is_tutorial_gpt, _tutorial_gpt, blocks),
        ("tutorial grouped-query attention", detect.gqa_names, layers.tutorial_gqa,
         ("num_heads", "num_kv_heads")),
        ("tutorial input embedding", detect.is_tutorial_input_embedding,
         layers.tutorial_input_embedding, ()),
        ("tutorial patch embedding", detect.is_tutorial_patch_embed, layers.tutorial_patch_embed, ()),
        ("tutorial decoder layer", detect.is_tutorial_decoder, layers.tutorial_decoder, blocks),
        ("tutorial pre-norm block", detect.is_tutorial_pre_block,
         functools.partial(layers.tutorial_block, pre=True), blocks),
        ("tutorial post-norm block", detect.is_tutorial_post_block,
         functools.partial(layers.tutorial_block, pre=False), blocks),
        ("tutorial multi-head attention", detect.is_tutorial_attention,
         layers.tutorial_attention_module, ("num_heads",)),
        ("tutorial positional encoding", detect.is_tutorial_pe, layers.tutorial_pe, ()),
        ("tutorial feed-forward", detect.is_tutorial_ff, layers.tutorial_ff_module, ("activation",)),
        ("tutorial scaled dot-product attention", detect.is_tutorial_sdpa, layers.tutorial_sdpa, ()),
    )
    for kind, test, build, allowed in tutorial:
        if test(m):
            check_overrides(kind, overrides, allowed)
            return build(m, overrides)
    listing = "\n  - ".join(BUILTIN_RECOGNISED + RECOGNISED)
    raise TypeError(f"from_torch: unsupported module type {type(m).__module__}.{type(m).__name__}; "
                    f"recognised:\n  - {listing}")


# ----------------------------------------------------------------------------- whole models

_BLOCK_FIELDS = ("num_heads", "head_dim", "mlp_dim", "activation", "pre_norm", "norm_eps",
                 "use_bias", "norm_bias", "dropout_rate", "attention_dropout_rate",
                 "mlp_dropout_rate")
_BLOCK_OVERRIDES = ("norm_first", "num_heads", "activation")


def _nest(maps: list[TensorMap], tp: str, fp: tuple[str, ...]) -> list[TensorMap]:
    """Maps of a submodule moved under state-dict key prefix ``tp`` and Flax path ``fp``."""
    return [dataclasses.replace(t, key=tp + t.key, targets=tuple((fp + p, s) for p, s in t.targets))
            for t in maps]


def _part(child: Any, name: str, flax_name: str, want: type, overrides: dict[str, Any]) -> Conversion:
    """A submodule (attribute path ``name``) converted by the rules above; must give ``want``."""
    import torch.nn as tnn

    if not isinstance(child, tnn.Module):
        raise UserError(f"{name}: expected a torch module, got {type(child).__name__}")
    try:
        conv = (recognise_builtin(child, dict(overrides))
                or recognise_tutorial(child, dict(overrides)))
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from e
    if not isinstance(conv.module, want):
        raise UserError(f"{name}: expected a module that converts to {want.__name__}, got "
                        f"{type(child).__name__} (-> {type(conv.module).__name__})")
    return Conversion(conv.module, _nest(conv.maps, f"{name}.", (flax_name,)))


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b))
                     if a.get(k) != b.get(k))


def _stack_of(layers: Any, name: str, want: type, overrides: dict[str, Any]) -> tuple[dict, list]:
    """(shared block fields, maps) of a ModuleList of tutorial layers ``name.{i}`` -> ``name_{i}``."""
    import torch.nn as tnn

    if not isinstance(layers, tnn.ModuleList) or not len(layers):
        raise UserError(f"{name}: expected a non-empty nn.ModuleList of layers, got "
                        f"{type(layers).__name__}")
    cfgs, maps = [], []
    for i, layer in enumerate(layers):
        conv = _part(layer, f"{name}.{i}", f"{name}_{i}", want, overrides)
        cfgs.append({f: getattr(conv.module, f) for f in _BLOCK_FIELDS})
        maps += conv.maps
    for i, cfg in enumerate(cfgs[1:], start=1):
        if cfg != cfgs[0]:
            raise UserError(f"{name}.{i} is configured differently from {name}.0 "
                            f"({_differences(cfgs[0], cfg)}); the mirror stacks identical layers")
    return cfgs[0], maps


def _embeddings(m: Any, emb_name: str, pe_name: str) -> tuple[dict, list[TensorMap]]:
    """(TutorialTransformer embedding fields, maps) of an InputEmbedding + PositionalEncoding pair."""
    emb = _part(getattr(m, emb_name, None), emb_name, emb_name, TutorialInputEmbedding, {})
    pe = _part(getattr(m, pe_name, None), pe_name, pe_name, TutorialPositionalEncoding, {})
    e, p = emb.module, pe.module
    cfg = dict(vocab_size=e.vocab_size, d_model=e.features, max_len=e.max_len,
               embedding_dropout_rate=e.dropout_rate, pe_max_len=p.max_len,
               pe_dropout_rate=p.dropout_rate)
    return cfg, emb.maps + pe.maps


def _decoder_mask(m: Any) -> str:
    """Which of TutorialTransformer's decoder masks the module's ``generate_mask`` builds."""
    import torch

    if not callable(getattr(m, "generate_mask", None)):
        raise UserError("generate_mask: an encoder-decoder Transformer needs its generate_mask(size) "
                        "method (the decoder's tgt_mask)")
    t = 5
    with torch.no_grad():
        keep = torch.as_tensor(m.generate_mask(t)) != 0       # the decoder reads mask == 0 as blocked
    ones = torch.ones(t, t, dtype=torch.bool)
    if tuple(keep.shape) == (t, t) and torch.equal(keep.cpu(), torch.triu(ones, diagonal=1)):
        return "future"
    if tuple(keep.shape) == (t, t) and torch.equal(keep.cpu(), torch.tril(ones)):
        return "causal"
    raise UserError(f"generate_mask({t}) gives {keep.int().tolist()} (nonzero = may attend, as the "
                    "decoder layers read it); supported: the tutorial's triu(ones, diagonal=1) and "
                    "a causal tril(ones)")


def _tutorial_transformer_parts(m: Any, overrides: dict[str, Any]) -> tuple[dict, list[TensorMap]]:
    """(TutorialTransformer fields, maps) of the tutorial's whole Transformer."""
    import torch.nn as tnn

    enc_only = getattr(m, "encoder_only", False)
    if not isinstance(enc_only, bool):
        raise UserError(f"encoder_only: expected a bool, got {enc_only!r}")
    blocks = {k: v for k, v in overrides.items() if k in _BLOCK_OVERRIDES}
    cfg, maps = _embeddings(m, "embedding", "pos_encoder")
    block, layer_maps = _stack_of(getattr(m, "encoder_layers", None), "encoder_layers",
                                  TutorialEncoderBlock, blocks)
    maps += layer_maps
    if not enc_only:
        dec, dec_maps = _embeddings(m, "decoder_embedding", "decoder_pos_encoder")
        if dec != cfg:
            raise UserError("decoder_embedding/decoder_pos_encoder are configured differently from "
                            f"embedding/pos_encoder ({_differences(cfg, dec)}); the mirror has one "
                            "embedding configuration")
        dec_block, layer_maps = _stack_of(getattr(m, "decoder_layers", None), "decoder_layers",
                                          TutorialDecoderLayer, blocks)
        if dec_block != block:
            raise UserError(f"decoder_layers are configured differently from encoder_layers "
                            f"({_differences(block, dec_block)}); the mirror has one layer "
                            "configuration")
        maps += dec_maps + layer_maps
        cfg.update(num_decoder_layers=len(m.decoder_layers), decoder_mask=_decoder_mask(m))
    d, v = cfg["d_model"], cfg["vocab_size"]
    clf = getattr(m, "classifier", None)
    if not isinstance(clf, tnn.Linear) or (clf.in_features, clf.out_features) != (d, v):
        raise UserError(f"classifier: expected nn.Linear({d}, {v}) (d_model -> vocab_size), got {clf!r}")
    maps += linear("classifier.", ("classifier",), d, v, bias=clf.bias is not None)
    cfg.update(block, num_layers=len(m.encoder_layers), encoder_only=enc_only,
               classifier_bias=clf.bias is not None)
    return cfg, maps


def _tutorial_transformer(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, maps = _tutorial_transformer_parts(m, overrides)
    return Conversion(TutorialTransformer(**cfg), maps)


def _check_linear(m: Any, name: str, d_in: int, d_out: int, bias: bool | None = True) -> bool:
    import torch.nn as tnn

    lin = getattr(m, name, None)
    if not isinstance(lin, tnn.Linear) or (lin.in_features, lin.out_features) != (d_in, d_out):
        raise UserError(f"{name}: expected nn.Linear({d_in}, {d_out}), got {lin!r}")
    if bias is not None and (lin.bias is not None) != bias:
        raise UserError(f"{name}: expected {'a' if bias else 'no'} bias, as in the tutorial's class")
    return lin.bias is not None


def _tutorial_lm_parts(m: Any, overrides: dict[str, Any], kind: str,
                       heads: str) -> tuple[dict, list[TensorMap]]:
    """The ``transformer`` of the tutorial's BERT/GPT, and the check that the class can run."""
    if not detect.is_tutorial_transformer(m.transformer):
        raise UserError("transformer: expected the tutorial's Transformer (embedding, pos_encoder, "
                        f"encoder_layers, classifier), got {type(m.transformer).__name__}")
    cfg, maps = _tutorial_transformer_parts(m.transformer, overrides)
    if not cfg["encoder_only"]:
        raise UserError(f"transformer: the {kind} calls transformer(input_ids) without target ids, "
                        "which only an encoder_only=True Transformer accepts")
    d, v = cfg["d_model"], cfg["vocab_size"]
    if v != d:
        raise UserError(
            f"the tutorial's {kind} cannot run with vocab_size={v} != d_model={d}: its forward "
            f"applies {heads} to transformer(input_ids), which is the Transformer's classifier "
            f"output -- (B, T, {v}) vocabulary logits, not (B, T, {d}) hidden states -- so PyTorch "
            "raises 'mat1 and mat2 shapes cannot be multiplied' and there is nothing to convert. "
            "Convert its encoder on its own (from_torch(model.transformer)), or fix the class so "
            "that its heads read the hidden states")
    return cfg, _nest(maps, "transformer.", ("transformer",))


def _tutorial_bert(m: Any, overrides: dict[str, Any]) -> Conversion:
    import torch.nn as tnn

    heads = "pooler = Linear(d_model, d_model) and masked_lm_predictor = Linear(d_model, vocab_size)"
    cfg, maps = _tutorial_lm_parts(m, overrides, "BERT", heads)
    d, v = cfg["d_model"], cfg["vocab_size"]
    if not isinstance(getattr(m, "activation", None), tnn.Tanh):
        raise UserError(f"activation: expected nn.Tanh (the pooler's), got "
                        f"{getattr(m, 'activation', None)!r}")
    for name, d_out in (("pooler", d), ("next_sentence_predictor", 2), ("masked_lm_predictor", v)):
        _check_linear(m, name, d, d_out)
        maps += linear(f"{name}.", (name,), d, d_out)
    return Conversion(TutorialBERT(**cfg), maps)


def _tutorial_gpt(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, maps = _tutorial_lm_parts(m, overrides, "GPT", "lm_head = Linear(d_model, vocab_size)")
    d, v = cfg["d_model"], cfg["vocab_size"]
    bias = _check_linear(m, "lm_head", d, v, bias=None)
    maps += linear("lm_head.", ("lm_head",), d, v, bias=bias)
    return Conversion(TutorialGPT(**cfg, lm_head_bias=bias), maps)
