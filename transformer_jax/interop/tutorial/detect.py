"""Which of the tutorial's PyTorch modules a torch module is, read off its attribute names.

The predicates that :mod:`transformer_jax.interop.tutorial.convert` tries, in the order its
docstring gives, and :func:`check_runnable`, which refuses first a module whose ``forward`` is
missing or a stub. torch is imported inside the functions.
"""
from __future__ import annotations

from typing import Any

from ...errors import UserError

__all__ = ["check_runnable", "has", "attention_names", "gqa_names", "GQA_NAMES", "KV_HEAD_ATTRS",
           "is_tutorial_decoder", "is_tutorial_pre_block", "is_tutorial_post_block",
           "is_tutorial_attention", "is_tutorial_pe", "is_tutorial_ff", "is_tutorial_input_embedding",
           "is_tutorial_patch_embed", "is_tutorial_sdpa", "is_tutorial_transformer",
           "is_tutorial_bert", "is_tutorial_gpt"]


# ----------------------------------------------------------------------------- layers

def has(m: Any, *names: str) -> bool:
    """Whether ``m`` has every attribute of ``names``, none of them None."""
    return all(getattr(m, n, None) is not None for n in names)


def attention_names(m: Any) -> tuple[str, str, str, str] | None:
    """The names of the tutorial attention's four ``nn.Linear`` (``w_q``... or ``W_q``...), or None."""
    import torch.nn as tnn

    for names in (("w_q", "w_k", "w_v", "w_o"), ("W_q", "W_k", "W_v", "W_o")):
        if all(isinstance(getattr(m, n, None), tnn.Linear) for n in names):
            return names
    return None


def is_tutorial_decoder(m: Any) -> bool:
    return has(m, "self_attn", "cross_attn", "feed_forward", "norm1", "norm2", "norm3")


def is_tutorial_pre_block(m: Any) -> bool:
    return has(m, "attn", "ff", "norm1", "norm2")


def is_tutorial_post_block(m: Any) -> bool:
    return (has(m, "attention") or has(m, "self_attn")) and has(m, "feed_forward", "norm1", "norm2")


def is_tutorial_attention(m: Any) -> bool:
    return attention_names(m) is not None


def is_tutorial_pe(m: Any) -> bool:
    return "pe" in dict(m.named_buffers(recurse=False))


def is_tutorial_ff(m: Any) -> bool:
    import torch.nn as tnn

    return (isinstance(m, tnn.Sequential)
            or any(isinstance(getattr(m, a, None), tnn.Sequential) for a in ("net", "feed_forward"))
            or all(isinstance(getattr(m, a, None), tnn.Linear) for a in ("w_1", "w_2")))

# ----------------------------------------------------------------------------- runnable?

_GQA_NO_FORWARD = (
    "(The tutorial's GroupedQueryAttention is such a class: its code stops after __init__.) Give it a "
    "forward(query, key, value, mask=None) in a subclass -- batch-first (B, T, D) inputs; N "
    "query heads and K key/value heads, each shared by N/K consecutive query heads "
    "(repeat_interleave); softmax(q k^T / sqrt(head_dim)) with mask 1 = may attend; o_proj "
    "over the concatenated heads -- and convert that subclass (-> TutorialGroupedQueryAttention), "
    "or use transformer_jax.layers.MultiHeadAttention(num_heads=N, num_kv_heads=K) directly")
_WINDOW_STUB = (
    "(The tutorial's SlidingWindowAttention is such a stub: no projections and no windowing "
    "were written.) For sliding-window attention use the library's own: set "
    "model.attention_window=W (the GPTConfig/BertConfig/ViTConfig field; each token attends "
    "to the W nearest tokens), or pass the mask "
    "transformer_jax.layers.masks.sliding_window_mask(T, window=W) to a MultiHeadAttention or "
    "to a converted tutorial attention")


def _is_stub(fn: Any) -> bool:
    """Whether a function's body does nothing but return None (``pass``, ``...``, a docstring)."""
    import dis

    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    for ins in dis.get_instructions(code):
        if ins.opname in ("RESUME", "NOP", "CACHE", "EXTENDED_ARG", "RETURN_VALUE"):
            continue
        if ins.opname in ("LOAD_CONST", "RETURN_CONST") and ins.argval is None:
            continue
        return False
    return True


def check_runnable(m: Any) -> None:
    """Refuse a module whose ``forward`` is missing or a stub: PyTorch computes nothing to match."""
    import torch.nn as tnn

    forward, cls = getattr(type(m), "forward", None), type(m).__name__
    if forward is tnn.Module.forward:
        hint = _GQA_NO_FORWARD if gqa_names(m) else "Define forward() in a subclass and convert that"
        raise UserError(f"{cls} has no forward(): PyTorch cannot run it (calling it raises "
                        f"NotImplementedError), so there is no computation to convert. {hint}")
    if _is_stub(forward):
        hint = _WINDOW_STUB if hasattr(m, "window_size") else "Implement forward() and convert that"
        raise UserError(f"{cls}.forward is a stub: its body does nothing and returns None, so "
                        f"PyTorch computes nothing that could be converted. {hint}")


# ----------------------------------------------------------------------------- more layers, whole models

GQA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")
KV_HEAD_ATTRS = ("n_kv_groups", "n_kv_heads", "num_kv_heads", "num_key_value_heads", "n_kv_head",
                 "kv_heads")


def gqa_names(m: Any) -> bool:
    import torch.nn as tnn

    return all(isinstance(getattr(m, n, None), tnn.Linear) for n in GQA_NAMES)


def is_tutorial_input_embedding(m: Any) -> bool:
    import torch.nn as tnn

    return (isinstance(getattr(m, "token_embedding", None), tnn.Embedding)
            and isinstance(getattr(m, "position_embedding", None), tnn.Parameter))


def is_tutorial_patch_embed(m: Any) -> bool:
    import torch.nn as tnn

    return isinstance(getattr(m, "proj", None), tnn.Conv2d)


def is_tutorial_sdpa(m: Any) -> bool:
    """No parameters or buffers, only Dropout children, ``forward(query, key, value, ...)``."""
    import inspect

    import torch.nn as tnn

    if next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
        return False
    if not all(isinstance(c, tnn.Dropout) for c in m.children()):
        return False
    try:
        names = [p.lower() for p in list(inspect.signature(type(m).forward).parameters)[1:4]]
    except (TypeError, ValueError):
        return False
    return names in (["query", "key", "value"], ["q", "k", "v"])


def is_tutorial_transformer(m: Any) -> bool:
    return has(m, "embedding", "pos_encoder", "encoder_layers", "classifier")


def is_tutorial_bert(m: Any) -> bool:
    return has(m, "transformer", "pooler", "next_sentence_predictor", "masked_lm_predictor")


def is_tutorial_gpt(m: Any) -> bool:
    return has(m, "transformer", "lm_head")
