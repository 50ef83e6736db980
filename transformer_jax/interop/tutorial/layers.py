"""The tutorial's PyTorch layers -> their Flax mirrors (:mod:`.modules`): attention, grouped-query
attention, positional encoding, feed-forward, encoder blocks, decoder layer, input and patch
embeddings, scaled dot-product attention.

Rules 4 to 13 of :mod:`transformer_jax.interop.tutorial.convert`; the whole models (rules 1
to 3) are there. Each converter returns a :class:`~transformer_jax.interop.torch_nn.convert.Conversion`.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import UserError
from ...layers.embeddings import sinusoidal_table
from ..common import TensorMap, layer_norm, linear
from ..torch_nn.convert import (HEAD_ATTRS, Conversion, activation_name, layer_norm_cfg,
                                only_dropout_rate)
from .detect import GQA_NAMES, KV_HEAD_ATTRS, attention_names, has
from .modules import (TutorialDecoderLayer, TutorialEncoderBlock, TutorialFeedForward,
                      TutorialGroupedQueryAttention, TutorialInputEmbedding,
                      TutorialMultiHeadAttention, TutorialPatchEmbed, TutorialPositionalEncoding,
                      TutorialScaledDotProductAttention)

__all__ = ["tutorial_attention", "tutorial_attention_module", "tutorial_pe", "tutorial_ff",
           "tutorial_ff_module", "tutorial_block", "tutorial_decoder", "tutorial_gqa",
           "tutorial_input_embedding", "tutorial_patch_embed", "tutorial_sdpa"]


# ---------------------------------------------------------------- attention, feed-forward, blocks

def tutorial_attention(m: Any, tp: str, fp: tuple[str, ...], where: str,
                       num_heads: int | None) -> tuple[dict, list[TensorMap]]:
    """Tutorial attention at key prefix ``tp`` -> (library attention fields, maps to ``fp``)."""
    import torch.nn as tnn

    names = attention_names(m)
    if names is None:
        raise UserError(f"{where}: expected nn.Linear attributes w_q, w_k, w_v, w_o (or W_q, "
                        f"W_k, W_v, W_o) on {type(m).__name__}")
    lq, lk, lv, lo = (getattr(m, n) for n in names)
    d, inner = lq.in_features, lq.out_features
    if num_heads is None:
        for attr in HEAD_ATTRS:
            value = getattr(m, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                num_heads = value
                break
        else:
            head_dim = next((getattr(m, a) for a in ("d_k", "head_dim")
                             if isinstance(getattr(m, a, None), int)), None)
            if head_dim is None or inner % head_dim:
                raise UserError(f"{where}: cannot find the number of heads (no int attribute among "
                                f"{HEAD_ATTRS} or d_k/head_dim); pass num_heads= to from_torch")
            num_heads = inner // head_dim
    n = int(num_heads)
    if inner % n:
        raise UserError(f"{where}{names[0]}: {inner} output features are not divisible by "
                        f"num_heads={n}")
    h = inner // n
    for lin, name in ((lk, names[1]), (lv, names[2])):
        if lin.out_features != inner:
            raise UserError(f"{where}{name}: out_features={lin.out_features}, expected {inner} "
                            f"like {names[0]}")
    if lo.in_features != inner or lo.out_features != d:
        raise UserError(f"{where}{names[3]}: expected Linear({inner}, {d}), got "
                        f"Linear({lo.in_features}, {lo.out_features})")
    biases = {name: getattr(m, name).bias is not None for name in names}
    if len(set(biases.values())) > 1:
        raise UserError(f"{where}: bias presence differs between {biases}; the mirror has one use_bias")
    bias = biases[names[0]]
    dropouts = [mod for mod in m.modules() if isinstance(mod, tnn.Dropout)]
    cfg = dict(num_heads=n, head_dim=h, use_bias=bias,
               dropout_rate=only_dropout_rate(dropouts, f"{where}dropout"))
    maps = []
    for name, lin, flax_name in zip(names[:3], (lq, lk, lv), ("query", "key", "value")):
        maps += linear(f"{tp}{name}.", fp + (flax_name,), lin.in_features, inner, bias=bias,
                       kernel_shape=(lin.in_features, n, h), bias_shape=(n, h))
    maps += linear(f"{tp}{names[3]}.", fp + ("out",), inner, d, bias=bias, kernel_shape=(n, h, d))
    return cfg, maps


def tutorial_attention_module(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, maps = tutorial_attention(m, "", (), type(m).__name__, overrides.get("num_heads"))
    return Conversion(TutorialMultiHeadAttention(**cfg), maps)


def tutorial_pe(m: Any, overrides: dict[str, Any]) -> Conversion:
    import torch.nn as tnn

    pe = m.pe.detach().cpu().float().numpy()
    if pe.ndim != 3 or pe.shape[0] != 1:
        raise UserError(f"pe: expected a buffer of shape (1, max_len, D) (forward x + pe[:, :T]), "
                        f"got {pe.shape}")
    _, max_len, d = pe.shape
    table = TensorMap("pe", pe.shape,
                      constant=lambda: np.asarray(sinusoidal_table(max_len, d))[None],
                      within=1e-6 + np.arange(max_len, dtype=np.float64)[None, :, None] * 2.0 ** -22,
                      description=f"sinusoidal_table({max_len}, {d})")
    table.to_flax(pe)  # check the attribute even when the buffer is not persistent
    persistent = "pe" in m.state_dict()
    rate = only_dropout_rate([x for x in m.modules() if isinstance(x, tnn.Dropout)], "dropout")
    return Conversion(TutorialPositionalEncoding(max_len=max_len, dropout_rate=rate),
                       [table] if persistent else [])


def tutorial_ff(m: Any, tp: str, fp: tuple[str, ...], where: str,
                activation: str | None) -> tuple[dict, list[TensorMap]]:
    """Tutorial feed-forward at key prefix ``tp`` -> (TutorialFeedForward fields, maps to ``fp``)."""
    import torch.nn as tnn

    if isinstance(m, tnn.Sequential):
        seq, prefix = m, tp
    else:
        attr = next((a for a in ("net", "feed_forward") if isinstance(getattr(m, a, None), tnn.Sequential)),
                    None)
        seq, prefix = (getattr(m, attr), f"{tp}{attr}.") if attr else (None, tp)
    if seq is not None:
        linears, acts, hidden_drop, out_drop = [], [], [], []
        for name, child in seq.named_children():
            if isinstance(child, tnn.Linear):
                linears.append((name, child))
            elif isinstance(child, tnn.Dropout):
                if not linears:
                    raise UserError(f"{where}{prefix}{name}: Dropout before the first Linear is "
                                    "not supported")
                (hidden_drop if len(linears) == 1 else out_drop).append(child)
            elif len(linears) == 1 and not acts:
                acts.append((name, child))
            else:
                raise UserError(f"{where}{prefix}{name}: unexpected {type(child).__name__} in the "
                                "feed-forward Sequential (expected Linear, activation, Dropout, Linear)")
        if len(linears) != 2:
            raise UserError(f"{where}{prefix.rstrip('.') or type(m).__name__}: expected exactly two "
                            f"Linear layers, found {len(linears)}")
        (n1, l1), (n2, l2) = linears
        k1, k2 = f"{prefix}{n1}.", f"{prefix}{n2}."
        if acts:
            act_name, act = acts[0]
            act_where = f"{where}{prefix}{act_name}"
        else:
            act, act_where = None, f"{where}{prefix.rstrip('.')}"
    else:
        l1, l2 = m.w_1, m.w_2
        k1, k2 = f"{tp}w_1.", f"{tp}w_2."
        children = dict(m.named_children())
        act_children = [(n, c) for n, c in children.items()
                        if isinstance(c, (tnn.ReLU, tnn.GELU, tnn.SiLU, tnn.Tanh))]
        if len(act_children) > 1:
            raise UserError(f"{where}: several activation modules {[n for n, _ in act_children]}")
        act, act_where = None, where
        if act_children:
            act, act_where = act_children[0][1], f"{where}{act_children[0][0]}"
        hidden_drop = [c for c in children.values() if isinstance(c, tnn.Dropout)]
        out_drop = []
    if activation is None:
        if act is None:
            raise UserError(f"{act_where}: no activation module found (a functional activation in "
                            "forward cannot be identified); pass activation='relu'|'gelu'|... to from_torch")
        activation = activation_name(act, act_where)
    if l2.in_features != l1.out_features or l2.out_features != l1.in_features:
        raise UserError(f"{where}: Linear({l1.in_features}, {l1.out_features}) then "
                        f"Linear({l2.in_features}, {l2.out_features}) is not a D -> F -> D feed-forward")
    if (l1.bias is None) != (l2.bias is None):
        raise UserError(f"{where}: one Linear has a bias and the other does not")
    d, f = l1.in_features, l1.out_features
    bias = l1.bias is not None
    cfg = dict(mlp_dim=f, activation=activation, use_bias=bias,
               dropout_rate=only_dropout_rate(hidden_drop, f"{where}dropout"),
               output_dropout_rate=only_dropout_rate(out_drop, f"{where}dropout"))
    maps = (linear(k1, fp + ("wi",), d, f, bias=bias) + linear(k2, fp + ("wo",), f, d, bias=bias))
    return cfg, maps


def tutorial_ff_module(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, maps = tutorial_ff(m, "", (), "", overrides.get("activation"))
    return Conversion(TutorialFeedForward(**cfg), maps)


def _norm_first(m: Any, overrides: dict[str, Any], default: bool) -> bool:
    if "norm_first" in overrides:
        return bool(overrides["norm_first"])
    own = getattr(m, "norm_first", None)
    return own if isinstance(own, bool) else default


def _block_parts(m: Any, attn_names: dict[str, str], ff_name: str, norms: tuple[str, ...],
                 overrides: dict[str, Any]) -> tuple[dict, list[TensorMap]]:
    """Common reading of the tutorial blocks: attention(s) ``{torch name: flax name}``,
    feed-forward, norms."""
    import torch.nn as tnn

    attn_cfgs, maps = [], []
    for tname, fname in attn_names.items():
        cfg, amaps = tutorial_attention(getattr(m, tname), f"{tname}.", (fname,), f"{tname}.",
                                        overrides.get("num_heads"))
        attn_cfgs.append(cfg)
        maps += amaps
    if any(c != attn_cfgs[0] for c in attn_cfgs):
        raise UserError(f"{' and '.join(attn_names)} are configured differently ({attn_cfgs}); "
                        "the mirror has one attention configuration")
    ff_cfg, ff_maps = tutorial_ff(getattr(m, ff_name), f"{ff_name}.", ("mlp",), f"{ff_name}.",
                                  overrides.get("activation"))
    maps += ff_maps
    if ff_cfg["output_dropout_rate"]:
        raise UserError(f"{ff_name}: a Dropout after the second Linear inside a block is not "
                        "supported (the block's residual dropout plays that role)")
    attn = attn_cfgs[0]
    if attn["use_bias"] != ff_cfg["use_bias"]:
        raise UserError(f"bias presence differs between the attention and {ff_name}; the mirror "
                        "has one use_bias")
    eps, norm_bias = layer_norm_cfg({n: getattr(m, n) for n in norms}, "")
    for n in norms:
        maps += layer_norm(f"{n}.", (n,), getattr(m, n).normalized_shape[0], bias=norm_bias)
    residual = [c for c in m.children() if isinstance(c, tnn.Dropout)]
    cfg = dict(num_heads=attn["num_heads"], head_dim=attn["head_dim"], mlp_dim=ff_cfg["mlp_dim"],
               activation=ff_cfg["activation"], norm_eps=eps, use_bias=attn["use_bias"],
               norm_bias=norm_bias, dropout_rate=only_dropout_rate(residual, "dropout"),
               attention_dropout_rate=attn["dropout_rate"], mlp_dropout_rate=ff_cfg["dropout_rate"])
    return cfg, maps


def tutorial_block(m: Any, overrides: dict[str, Any], *, pre: bool) -> Conversion:
    if pre:
        attn_name, ff_name = "attn", "ff"
    else:
        attn_name = "attention" if has(m, "attention") else "self_attn"
        ff_name = "feed_forward"
    cfg, maps = _block_parts(m, {attn_name: "self_attn"}, ff_name, ("norm1", "norm2"), overrides)
    module = TutorialEncoderBlock(**cfg, pre_norm=_norm_first(m, overrides, default=pre))
    return Conversion(module, maps)


def tutorial_decoder(m: Any, overrides: dict[str, Any]) -> Conversion:
    cfg, maps = _block_parts(m, {"self_attn": "self_attn", "cross_attn": "cross_attn"},
                             "feed_forward", ("norm1", "norm2", "norm3"), overrides)
    module = TutorialDecoderLayer(**cfg, pre_norm=_norm_first(m, overrides, default=False))
    return Conversion(module, maps)


# ------------------------------------------------------------ grouped-query attention, embeddings

def _int_attr(m: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(m, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _gqa_heads(m: Any, overrides: dict[str, Any]) -> tuple[int, int, int]:
    """(N query heads, K key/value heads, head dim H) of a tutorial grouped-query attention."""
    lq, lk = m.q_proj, m.k_proj
    n = overrides.get("num_heads") or _int_attr(m, HEAD_ATTRS)
    if n is None:
        raise UserError(f"cannot find the number of query heads (no int attribute among "
                        f"{HEAD_ATTRS}); pass num_heads= to from_torch")
    n = int(n)
    if lq.out_features % n:
        raise UserError(f"q_proj: {lq.out_features} output features are not divisible by num_heads={n}")
    h = lq.out_features // n
    own = getattr(m, "head_dim", None)
    if isinstance(own, int) and own != h:
        raise UserError(f"head_dim={own} but q_proj's {lq.out_features} features over num_heads={n} "
                        f"give {h}; pass the right num_heads=")
    kv = overrides.get("num_kv_heads") or _int_attr(m, KV_HEAD_ATTRS)
    if kv is None:
        if lk.out_features % h:
            raise UserError(f"k_proj: {lk.out_features} output features are not a multiple of "
                            f"head_dim={h}; pass num_kv_heads= to from_torch")
        kv = lk.out_features // h
    kv = int(kv)
    for name in ("k_proj", "v_proj"):
        if getattr(m, name).out_features != kv * h:
            raise UserError(f"{name}: out_features={getattr(m, name).out_features}, expected "
                            f"num_kv_heads * head_dim = {kv} * {h}")
    if n % kv:
        raise UserError(f"num_heads={n} is not a multiple of the {kv} key/value heads")
    if m.o_proj.in_features != n * h:
        raise UserError(f"o_proj: in_features={m.o_proj.in_features}, expected num_heads * head_dim "
                        f"= {n * h} (the concatenated heads)")
    return n, kv, h


def tutorial_gqa(m: Any, overrides: dict[str, Any]) -> Conversion:
    import torch.nn as tnn

    n, kv, h = _gqa_heads(m, overrides)
    lq, lk, lv, lo = (getattr(m, name) for name in GQA_NAMES)
    biases = {name: getattr(m, name).bias is not None for name in GQA_NAMES}
    if len(set(biases.values())) > 1:
        raise UserError(f"bias presence differs between {biases}; the mirror has one use_bias")
    bias = biases["q_proj"]
    maps = linear("q_proj.", ("query",), lq.in_features, n * h, bias=bias,
                  kernel_shape=(lq.in_features, n, h), bias_shape=(n, h))
    for name, lin, flax_name in (("k_proj", lk, "key"), ("v_proj", lv, "value")):
        maps += linear(f"{name}.", (flax_name,), lin.in_features, kv * h, bias=bias,
                       kernel_shape=(lin.in_features, kv, h), bias_shape=(kv, h))
    maps += linear("o_proj.", ("out",), n * h, lo.out_features, bias=bias,
                   kernel_shape=(n, h, lo.out_features))
    rate = only_dropout_rate([x for x in m.modules() if isinstance(x, tnn.Dropout)], "dropout")
    module = TutorialGroupedQueryAttention(
        num_heads=n, num_kv_heads=kv, head_dim=h, use_bias=bias, dropout_rate=rate,
        out_features=None if lo.out_features == lq.in_features else lo.out_features)
    return Conversion(module, maps)


def tutorial_input_embedding(m: Any, overrides: dict[str, Any]) -> Conversion:
    import torch.nn as tnn

    emb, pos = m.token_embedding, m.position_embedding
    v, d = emb.num_embeddings, emb.embedding_dim
    if emb.max_norm is not None or emb.scale_grad_by_freq:
        raise UserError("token_embedding: max_norm / scale_grad_by_freq are not supported (the "
                        "mirror is a plain lookup)")
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape[2] != d:
        raise UserError(f"position_embedding: expected shape (1, max_len, {d}) (forward adds "
                        f"position_embedding[:, :T]), got {tuple(pos.shape)}")
    own = getattr(m, "d_model", d)
    if own != d:
        raise UserError(f"d_model={own!r} differs from token_embedding's width {d}; the mirror "
                        "scales the embeddings by sqrt(width)")
    shape = tuple(pos.shape)
    maps = [TensorMap("token_embedding.weight", (v, d), ((("token_embedding", "embedding"), (v, d)),)),
            TensorMap("position_embedding", shape, ((("position_embedding",), shape),))]
    rate = only_dropout_rate([x for x in m.modules() if isinstance(x, tnn.Dropout)], "dropout")
    return Conversion(TutorialInputEmbedding(vocab_size=v, features=d, max_len=shape[1],
                                             dropout_rate=rate), maps)


def tutorial_patch_embed(m: Any, overrides: dict[str, Any]) -> Conversion:
    conv = m.proj
    kernel, stride = tuple(conv.kernel_size), tuple(conv.stride)
    if kernel != stride:
        raise UserError(f"proj: kernel_size={kernel} != stride={stride}; only non-overlapping "
                        "patches (kernel_size == stride) are supported")
    if conv.padding not in ((0, 0), "valid") or tuple(conv.dilation) != (1, 1) or conv.groups != 1:
        raise UserError(f"proj: padding={conv.padding}, dilation={conv.dilation}, groups="
                        f"{conv.groups}; only padding 0, dilation 1 and groups 1 are supported")
    d, c = conv.out_channels, conv.in_channels
    bias = conv.bias is not None
    maps = [TensorMap("proj.weight", (d, c) + kernel, ((("proj", "kernel"), kernel + (c, d)),),
                      transpose=(2, 3, 1, 0))]                                  # OIHW -> HWIO
    if bias:
        maps.append(TensorMap("proj.bias", (d,), ((("proj", "bias"), (d,)),)))
    return Conversion(TutorialPatchEmbed(features=d, patch_size=kernel, in_channels=c, use_bias=bias),
                      maps)


def tutorial_sdpa(m: Any, overrides: dict[str, Any]) -> Conversion:
    rate = only_dropout_rate(list(m.children()), "dropout")
    return Conversion(TutorialScaledDotProductAttention(dropout_rate=rate), [])
