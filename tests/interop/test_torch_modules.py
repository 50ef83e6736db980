"""fp32 parity of the Flax mirrors (``interop.torch_nn.modules``, ``interop.tutorial.modules``) with PyTorch modules.

For every module: the forward outputs, the gradients w.r.t. the float inputs and the
gradients w.r.t. every torch parameter (the JAX gradients mapped through the converter's
own mapping table, ``to_torch_state_dict``) agree within ``RTOL``/``ATOL``. The loss is
``sum(output * cotangent)`` with a fixed random cotangent per output.

Reference versions of the tutorial's PyTorch modules below are written for this test from the
descriptions of the tutorial modules' attribute names and semantics.

Torch modules run in eval mode (dropout off) with autograd on, i.e. torch's reference
("slow") path; ``TransformerEncoder`` is built with ``enable_nested_tensor=False`` for
the gradient tests, and ``test_encoder_nested_fast_path_valid_positions`` checks the
inference fast path (which zeroes padded positions) on the valid positions only.

Sizes: B=2, T=7, S=5, D=32, N=4, F=64.
"""
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.interop.common import ConversionError, StateDictReader
from transformer_jax.interop.torch import from_torch, to_torch_state_dict
from transformer_jax.layers import MultiHeadAttention, dot_product_attention

# RTOL/ATOL: the fp32 parity tolerance of forward outputs, input and parameter gradients.
from .conftest import ATOL, RTOL, torch

tnn = torch.nn
B, T, S, D, N, F = 2, 7, 5, 32, 4, 64


def setup_module():
    torch.manual_seed(0)
    torch.set_num_threads(2)


# ============================================================================= tutorial references

class ScaledDotProduct(tnn.Module):
    """softmax(q k^T / sqrt(H), masked) v, with dropout on the weights (inner submodule)."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.dropout = tnn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
        return self.dropout(torch.softmax(scores, dim=-1)) @ v


class RefAttention(tnn.Module):
    """Tutorial multi-head attention: Linear w_q/w_k/w_v/w_o (or W_*), heads split from D."""

    def __init__(self, d_model, num_heads, dropout=0.0, capital=False, inner=False):
        super().__init__()
        self.names = ("W_q", "W_k", "W_v", "W_o") if capital else ("w_q", "w_k", "w_v", "w_o")
        for name in self.names:
            setattr(self, name, tnn.Linear(d_model, d_model))
        self.num_heads, self.d_k = num_heads, d_model // num_heads
        if inner:
            self.attention = ScaledDotProduct(dropout)
        else:
            self.dropout = tnn.Dropout(dropout)

    def forward(self, query, key, value, mask=None):
        wq, wk, wv, wo = (getattr(self, n) for n in self.names)
        b = query.shape[0]

        def heads(x):                                          # (B, L, D) -> (B, N, L, H)
            return x.view(b, -1, self.num_heads, self.d_k).transpose(1, 2)

        q, k, v = heads(wq(query)), heads(wk(key)), heads(wv(value))
        if hasattr(self, "attention"):
            out = self.attention(q, k, v, mask)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
            if mask is not None:
                scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
            out = self.dropout(torch.softmax(scores, dim=-1)) @ v
        return wo(out.transpose(1, 2).reshape(b, -1, self.num_heads * self.d_k))


def sinusoid_buffer(max_len, d_model, swap=False):
    position = torch.arange(max_len, dtype=torch.float32)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    pe = torch.zeros(max_len, d_model)
    first, second = (torch.cos, torch.sin) if swap else (torch.sin, torch.cos)
    pe[:, 0::2] = first(position * inv_freq)
    pe[:, 1::2] = second(position * inv_freq)
    return pe[None]


class RefPositionalEncoding(tnn.Module):
    def __init__(self, d_model, max_len=5000, dropout=0.0, swap=False):
        super().__init__()
        self.dropout = tnn.Dropout(dropout)
        self.register_buffer("pe", sinusoid_buffer(max_len, d_model, swap))

    def forward(self, x):
        return self.dropout(x + self.pe[:, :x.shape[1]])


class RefFeedForwardNet(tnn.Module):
    """Feed-forward as ``net = Sequential(Linear, act, Dropout, Linear)``."""

    def __init__(self, d_model, d_ff, act=None, dropout=0.0):
        super().__init__()
        self.net = tnn.Sequential(tnn.Linear(d_model, d_ff), act or tnn.GELU(), tnn.Dropout(dropout),
                                  tnn.Linear(d_ff, d_model))

    def forward(self, x):
        return self.net(x)


class RefFeedForwardW(tnn.Module):
    """Feed-forward with ``w_1``/``w_2`` Linear attributes, an activation module and dropout."""

    def __init__(self, d_model, d_ff, dropout=0.0):
        super().__init__()
        self.w_1, self.w_2 = tnn.Linear(d_model, d_ff), tnn.Linear(d_ff, d_model)
        self.activation = tnn.ReLU()
        self.dropout = tnn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(self.activation(self.w_1(x))))


class RefPreNormBlock(tnn.Module):
    """x + attn(norm1 x); x + ff(norm2 x)."""

    def __init__(self, d_model, num_heads, d_ff, dropout=0.0):
        super().__init__()
        self.attn = RefAttention(d_model, num_heads, dropout)
        self.ff = RefFeedForwardNet(d_model, d_ff, dropout=dropout)
        self.norm1, self.norm2 = tnn.LayerNorm(d_model), tnn.LayerNorm(d_model)
        self.dropout = tnn.Dropout(dropout)

    def forward(self, x, mask=None):
        h = self.norm1(x)
        x = x + self.dropout(self.attn(h, h, h, mask))
        return x + self.dropout(self.ff(self.norm2(x)))


class RefPostNormBlock(tnn.Module):
    """norm1(x + attn(x)); norm2(x + ff(x)); ``compute_pre_norm`` switches the arithmetic only."""

    def __init__(self, d_model, num_heads, d_ff, dropout=0.0, attn_name="attention",
                 w_ff=False, compute_pre_norm=False):
        super().__init__()
        self.attn_name, self.compute_pre_norm = attn_name, compute_pre_norm
        setattr(self, attn_name, RefAttention(d_model, num_heads, dropout, capital=True, inner=True))
        self.feed_forward = (RefFeedForwardW(d_model, d_ff, dropout) if w_ff else
                             tnn.Sequential(tnn.Linear(d_model, d_ff), tnn.GELU(), tnn.Dropout(dropout),
                                            tnn.Linear(d_ff, d_model)))
        self.norm1, self.norm2 = tnn.LayerNorm(d_model, eps=1e-6), tnn.LayerNorm(d_model, eps=1e-6)
        self.dropout = tnn.Dropout(dropout)

    def forward(self, x, mask=None):
        attn = getattr(self, self.attn_name)
        if self.compute_pre_norm:
            h = self.norm1(x)
            x = x + self.dropout(attn(h, h, h, mask))
            return x + self.dropout(self.feed_forward(self.norm2(x)))
        x = self.norm1(x + self.dropout(attn(x, x, x, mask)))
        return self.norm2(x + self.dropout(self.feed_forward(x)))


class RefDecoderLayer(tnn.Module):
    """Post-norm: self-attn (tgt_mask), cross-attn (src_mask), feed-forward."""

    def __init__(self, d_model, num_heads, d_ff, dropout=0.0):
        super().__init__()
        self.self_attn = RefAttention(d_model, num_heads, dropout)
        self.cross_attn = RefAttention(d_model, num_heads, dropout)
        self.feed_forward = RefFeedForwardW(d_model, d_ff, dropout)
        self.norm1, self.norm2, self.norm3 = (tnn.LayerNorm(d_model) for _ in range(3))
        self.dropout = tnn.Dropout(dropout)

    def forward(self, x, encoder_output, src_mask=None, tgt_mask=None):
        x = self.norm1(x + self.dropout(self.self_attn(x, x, x, tgt_mask)))
        x = self.norm2(x + self.dropout(self.cross_attn(x, encoder_output, encoder_output, src_mask)))
        return self.norm3(x + self.dropout(self.feed_forward(x)))


# ============================================================================= helpers

def perturb(module, seed=0):
    """Move every parameter away from its init (LayerNorms are the identity, biases zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module.eval()


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def to_jax(x):
    if isinstance(x, torch.Tensor):
        return jnp.asarray(x.detach().numpy())
    return x


def flat_outputs(out):
    outs = out if isinstance(out, tuple) else (out,)
    return [o for o in outs if o is not None], [o is None for o in outs]


def check_parity(tmod, inputs, extra=(), *, like=None, overrides=None):
    """Forward + grads of ``tmod(*inputs, *extra)`` vs. the converted Flax mirror.

    ``inputs``: float tensors differentiated; ``extra``: other positional args (masks, flags).
    """
    fmod, params = from_torch(tmod, **(overrides or {}))
    tin = [x.clone().requires_grad_(True) for x in inputs]
    tout, tnone = flat_outputs(tmod(*tin, *extra))
    cots = [randn(*o.shape, seed=100 + i) for i, o in enumerate(tout)]
    tmod.zero_grad()
    sum((o * c).sum() for o, c in zip(tout, cots)).backward()

    jextra = [to_jax(x) for x in extra]
    jcots = [to_jax(c) for c in cots]

    def loss(p, *xs):
        outs, nones = flat_outputs(fmod.apply({"params": p}, *xs, *jextra))
        assert nones == tnone
        return sum((o * c).sum() for o, c in zip(outs, jcots)), outs

    (_, jout), grads = jax.value_and_grad(loss, argnums=tuple(range(len(inputs) + 1)),
                                          has_aux=True)(params, *[to_jax(x) for x in inputs])
    for i, (t, j) in enumerate(zip(tout, jout)):
        np.testing.assert_allclose(np.asarray(j), t.detach().numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"output {i}")
    for i, (t, g) in enumerate(zip(tin, grads[1:])):
        np.testing.assert_allclose(np.asarray(g), t.grad.numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"grad of input {i}")
    pgrads = to_torch_state_dict(fmod, grads[0], like=like,
                                 **((overrides or {}) if like is not None else {}))
    named = dict(tmod.named_parameters())
    assert set(named) <= set(pgrads), set(named) - set(pgrads)
    for name, p in named.items():
        np.testing.assert_allclose(pgrads[name], p.grad.numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"grad of parameter {name}")
    return fmod, params


def causal_keep(t):          # the tutorial's convention: 1 = may attend
    return torch.tril(torch.ones(t, t))


def padding_keep(lengths, s):  # (B, 1, 1, S)
    return (torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]).float()[:, None, None, :]


# ============================================================================= tutorial modules

@pytest.mark.parametrize("variant", ["plain", "capital_inner"])
@pytest.mark.parametrize("masking", ["none", "causal", "padding", "causal_padding"])
def test_tutorial_attention(variant, masking):
    m = perturb(RefAttention(D, N, dropout=0.1, capital=variant != "plain",
                             inner=variant != "plain"))
    self_attn = masking in ("causal", "causal_padding")
    s = T if self_attn else S
    q, k, v = randn(B, T, D, seed=1), randn(B, s, D, seed=2), randn(B, s, D, seed=3)
    mask = {"none": None, "causal": causal_keep(T), "padding": padding_keep([S, 3], S),
            "causal_padding": causal_keep(T)[None, None] * padding_keep([T, 4], T)}[masking]
    fmod, _ = check_parity(m, [q, k, v], () if mask is None else (mask,), like=m)
    assert fmod.num_heads == N and fmod.dropout_rate == 0.1


def test_tutorial_positional_encoding():
    m = RefPositionalEncoding(D, max_len=64, dropout=0.1).eval()
    fmod, params = check_parity(m, [randn(B, T, D, seed=1)], like=m)
    assert params == {} and fmod.max_len == 64 and fmod.dropout_rate == 0.1


def test_tutorial_positional_encoding_long_table_and_bad_buffer():
    from_torch(RefPositionalEncoding(D))                      # max_len 5000: within the fp32 bound
    with pytest.raises(ValueError, match="'pe'"):
        from_torch(RefPositionalEncoding(D, max_len=64, swap=True))


@pytest.mark.parametrize("variant", ["net_gelu", "w12_relu", "sequential_gelu_tanh"])
def test_tutorial_feed_forward(variant):
    if variant == "net_gelu":
        m, act = RefFeedForwardNet(D, F, dropout=0.1), "gelu"
    elif variant == "w12_relu":
        m, act = RefFeedForwardW(D, F, dropout=0.1), "relu"
    else:
        m = tnn.Sequential(tnn.Linear(D, F), tnn.GELU(approximate="tanh"), tnn.Dropout(0.1),
                           tnn.Linear(F, D))
        act = "gelu_tanh"
    fmod, _ = check_parity(perturb(m), [randn(B, T, D, seed=1)], like=m)
    assert fmod.activation == act and fmod.mlp_dim == F and fmod.dropout_rate == 0.1


@pytest.mark.parametrize("masking", ["none", "causal", "padding"])
def test_tutorial_pre_norm_block(masking):
    m = perturb(RefPreNormBlock(D, N, F, dropout=0.1))
    mask = {"none": None, "causal": causal_keep(T), "padding": padding_keep([T, 4], T)}[masking]
    fmod, _ = check_parity(m, [randn(B, T, D, seed=1)], () if mask is None else (mask,), like=m)
    assert fmod.pre_norm and fmod.activation == "gelu" and fmod.dropout_rate == 0.1


@pytest.mark.parametrize("attn_name,w_ff,masking", [("attention", False, "causal"),
                                                    ("self_attn", True, "padding"),
                                                    ("attention", True, "none")])
def test_tutorial_post_norm_block(attn_name, w_ff, masking):
    m = perturb(RefPostNormBlock(D, N, F, dropout=0.1, attn_name=attn_name, w_ff=w_ff))
    mask = {"none": None, "causal": causal_keep(T), "padding": padding_keep([T, 4], T)}[masking]
    fmod, _ = check_parity(m, [randn(B, T, D, seed=1)], () if mask is None else (mask,), like=m)
    assert not fmod.pre_norm and fmod.norm_eps == 1e-6


def test_tutorial_block_norm_first_override():
    m = perturb(RefPostNormBlock(D, N, F, compute_pre_norm=True))
    fmod, _ = check_parity(m, [randn(B, T, D, seed=1)], (causal_keep(T),), like=m,
                           overrides={"norm_first": True})
    assert fmod.pre_norm


@pytest.mark.parametrize("masking", ["none", "causal_padding"])
def test_tutorial_decoder_layer(masking):
    m = perturb(RefDecoderLayer(D, N, F, dropout=0.1))
    x, enc = randn(B, T, D, seed=1), randn(B, S, D, seed=2)
    extra = () if masking == "none" else (padding_keep([S, 2], S), causal_keep(T))
    fmod, _ = check_parity(m, [x, enc], extra, like=m)
    assert not fmod.pre_norm and fmod.activation == "relu"


# ============================================================================= nn.MultiheadAttention

def _pad_bool(lengths, s):   # torch convention: True = NOT allowed
    return torch.arange(s)[None, :] >= torch.tensor(lengths)[:, None]


def _to_float_mask(m):
    return torch.zeros(m.shape).masked_fill(m, float("-inf"))


def _random_block(t, s, seed, p=0.2):   # bool, True = blocked (never a whole row here)
    m = torch.rand(t, s, generator=torch.Generator().manual_seed(seed)) < p
    m[:, 0] = False
    return m


_CAUSAL_FLOAT = tnn.Transformer.generate_square_subsequent_mask

MHA_CASES = {
    # name: (mha kwargs, self-attention (S = T), forward kwargs builder)
    "plain_avg": (dict(), False, lambda: dict()),
    "kpm_bool_per_head": (dict(), False, lambda: dict(
        key_padding_mask=_pad_bool([S, 3], S), average_attn_weights=False)),
    "kpm_float_attn_float": (dict(), False, lambda: dict(
        key_padding_mask=_to_float_mask(_pad_bool([4, S], S)), attn_mask=0.5 * randn(T, S, seed=7))),
    "attn_bool_2d_kpm_bool": (dict(), False, lambda: dict(
        attn_mask=_random_block(T, S, seed=3, p=0.3), key_padding_mask=_pad_bool([S, 4], S))),
    "attn_bool_3d": (dict(), False, lambda: dict(
        attn_mask=torch.triu(torch.ones(B * N, T, S, dtype=torch.bool), 1))),
    "causal_hint_no_weights": (dict(), True, lambda: dict(
        attn_mask=_CAUSAL_FLOAT(T), need_weights=False, is_causal=True)),
    # torch's slow path: the hint *replaces* the mask when there is no kpm and no weights ...
    "causal_hint_replaces_mask": (dict(), True, lambda: dict(
        attn_mask=_random_block(T, T, seed=4), need_weights=False, is_causal=True)),
    # ... and is ignored (the mask is used) once a key padding mask is given
    "causal_hint_with_kpm": (dict(), True, lambda: dict(
        attn_mask=_random_block(T, T, seed=4), key_padding_mask=_pad_bool([T, 5], T),
        need_weights=False, is_causal=True)),
    "kdim_vdim": (dict(kdim=24, vdim=16), False, lambda: dict(key_padding_mask=_pad_bool([S, 2], S))),
    "no_bias": (dict(bias=False), False, lambda: dict(average_attn_weights=False)),
}


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_multihead_attention(case, batch_first):
    kwargs, self_attn, fwd = MHA_CASES[case]
    m = perturb(tnn.MultiheadAttention(D, N, dropout=0.1, batch_first=batch_first, **kwargs))
    s = T if self_attn else S
    q = randn(B, T, D, seed=1)
    k, v = randn(B, s, kwargs.get("kdim", D), seed=2), randn(B, s, kwargs.get("vdim", D), seed=3)
    if not batch_first:
        q, k, v = (x.transpose(0, 1).contiguous() for x in (q, k, v))
    f = fwd()
    extra = (f.get("key_padding_mask"), f.get("need_weights", True), f.get("attn_mask"),
             f.get("average_attn_weights", True), f.get("is_causal", False))
    fmod, _ = check_parity(m, [q, k, v], extra)
    assert fmod.batch_first == batch_first and fmod.dropout_rate == 0.1


def test_multihead_attention_unbatched():
    m = perturb(tnn.MultiheadAttention(D, N, batch_first=True))
    check_parity(m, [randn(T, D, seed=1), randn(S, D, seed=2), randn(S, D, seed=3)],
                 (_pad_bool([3], S)[0], True, None, False))


# ============================================================================= Transformer layers

@pytest.mark.parametrize("norm_first,activation,batch_first", [
    (False, "relu", False), (True, "gelu", True), (False, "gelu_module", True), (True, "relu", False)])
def test_encoder_layer(norm_first, activation, batch_first):
    act = tnn.GELU() if activation == "gelu_module" else activation
    m = perturb(tnn.TransformerEncoderLayer(D, N, F, dropout=0.1, activation=act, layer_norm_eps=1e-6,
                                            batch_first=batch_first, norm_first=norm_first))
    src = randn(B, T, D, seed=1)
    if not batch_first:
        src = src.transpose(0, 1).contiguous()
    fmod, _ = check_parity(m, [src], (None, _pad_bool([T, 4], T)))
    assert (fmod.pre_norm, fmod.activation, fmod.norm_eps) == (norm_first, activation[:4], 1e-6)


def test_encoder_layer_causal_hint_and_no_bias():
    m = perturb(tnn.TransformerEncoderLayer(D, N, F, batch_first=True, bias=False))
    mask = tnn.Transformer.generate_square_subsequent_mask(T)
    fmod, params = check_parity(m, [randn(B, T, D, seed=1)], (mask, None, True))
    assert "bias" not in params["norm1"] and "bias" not in params["self_attn"]["query"]


def test_encoder_stack():
    layer = tnn.TransformerEncoderLayer(D, N, F, dropout=0.1, batch_first=True)
    m = perturb(tnn.TransformerEncoder(layer, 2, norm=tnn.LayerNorm(D, eps=1e-6),
                                       enable_nested_tensor=False))
    mask = torch.rand(T, T, generator=torch.Generator().manual_seed(5)) > 0.8
    mask.fill_diagonal_(False)
    fmod, _ = check_parity(m, [randn(B, T, D, seed=1)], (mask, _pad_bool([T, 5], T)))
    assert fmod.num_layers == 2 and fmod.final_norm and fmod.final_norm_eps == 1e-6


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_encoder_nested_fast_path_valid_positions():
    """Inference fast path + nested tensors: padded positions differ by design; valid ones agree."""
    layer = tnn.TransformerEncoderLayer(D, N, F, batch_first=True)
    m = perturb(tnn.TransformerEncoder(layer, 2, enable_nested_tensor=True))
    x, kpm = randn(B, T, D, seed=1), _pad_bool([T, 4], T)
    fmod, params = from_torch(m)
    with torch.no_grad():
        ref = m(x, src_key_padding_mask=kpm).numpy()
    out = np.asarray(fmod.apply({"params": params}, to_jax(x), None, kpm.numpy()))
    valid = ~kpm.numpy()
    np.testing.assert_allclose(out[valid], ref[valid], rtol=RTOL, atol=ATOL)
    assert np.all(ref[~valid] == 0)   # what the fast path returns at padded positions


@pytest.mark.parametrize("norm_first,batch_first", [(False, False), (True, True)])
def test_decoder_layer(norm_first, batch_first):
    m = perturb(tnn.TransformerDecoderLayer(D, N, F, dropout=0.1, activation="gelu",
                                            batch_first=batch_first, norm_first=norm_first))
    tgt, mem = randn(B, T, D, seed=1), randn(B, S, D, seed=2)
    if not batch_first:
        tgt, mem = tgt.transpose(0, 1).contiguous(), mem.transpose(0, 1).contiguous()
    extra = (tnn.Transformer.generate_square_subsequent_mask(T), 0.3 * randn(T, S, seed=4),
             _to_float_mask(_pad_bool([T, 5], T)), _to_float_mask(_pad_bool([S, 3], S)))
    check_parity(m, [tgt, mem], extra)


def test_decoder_stack():
    layer = tnn.TransformerDecoderLayer(D, N, F, batch_first=True)
    m = perturb(tnn.TransformerDecoder(layer, 2, norm=tnn.LayerNorm(D)))
    extra = (tnn.Transformer.generate_square_subsequent_mask(T), None, None, _pad_bool([S, 2], S),
             True)
    check_parity(m, [randn(B, T, D, seed=1), randn(B, S, D, seed=2)], extra)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer(batch_first):
    m = perturb(tnn.Transformer(D, N, 2, 2, F, dropout=0.1, batch_first=batch_first))
    src, tgt = randn(B, S, D, seed=1), randn(B, T, D, seed=2)
    if not batch_first:
        src, tgt = src.transpose(0, 1).contiguous(), tgt.transpose(0, 1).contiguous()
    causal = tnn.Transformer.generate_square_subsequent_mask(T)
    src_kpm, tgt_kpm = _to_float_mask(_pad_bool([S, 3], S)), _to_float_mask(_pad_bool([T, 5], T))
    fmod, _ = check_parity(m, [src, tgt], (None, causal, None, src_kpm, tgt_kpm, src_kpm))
    assert (fmod.num_encoder_layers, fmod.num_decoder_layers) == (2, 2)


# ============================================================================= round trips

def _builtin(kind):
    if kind == "mha":
        return tnn.MultiheadAttention(D, N, kdim=24, vdim=16, batch_first=True), \
            (randn(B, T, D, seed=1), randn(B, S, 24, seed=2), randn(B, S, 16, seed=3))
    if kind == "encoder_layer":
        return tnn.TransformerEncoderLayer(D, N, F, norm_first=True), (randn(T, B, D, seed=1),)
    if kind == "encoder":
        return tnn.TransformerEncoder(tnn.TransformerEncoderLayer(D, N, F, bias=False), 2,
                                      norm=tnn.LayerNorm(D, bias=False), enable_nested_tensor=False), \
            (randn(T, B, D, seed=1),)
    if kind == "decoder_layer":
        return tnn.TransformerDecoderLayer(D, N, F, batch_first=True), \
            (randn(B, T, D, seed=1), randn(B, S, D, seed=2))
    if kind == "decoder":
        return tnn.TransformerDecoder(tnn.TransformerDecoderLayer(D, N, F), 2), \
            (randn(T, B, D, seed=1), randn(S, B, D, seed=2))
    return tnn.Transformer(D, N, 1, 2, F, batch_first=True), \
        (randn(B, S, D, seed=1), randn(B, T, D, seed=2))


@pytest.mark.parametrize("kind", ["mha", "encoder_layer", "encoder", "decoder_layer", "decoder",
                                  "transformer"])
def test_round_trip_builtin(kind):
    torch.manual_seed(1)
    m, inputs = _builtin(kind)
    m = perturb(m)
    fmod, params = from_torch(m)
    state = to_torch_state_dict(fmod, params)
    torch.manual_seed(2)
    fresh, _ = _builtin(kind)
    fresh.eval().load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    with torch.no_grad():
        ref, mine = m(*inputs), fresh(*inputs)
    ref, mine = (r[0] if isinstance(r, tuple) else r for r in (ref, mine))
    out = fmod.apply({"params": params}, *[to_jax(x) for x in inputs])
    out = out[0] if isinstance(out, tuple) else out
    np.testing.assert_array_equal(mine.numpy(), ref.numpy())
    np.testing.assert_allclose(np.asarray(out), ref.numpy(), rtol=RTOL, atol=ATOL)


def test_round_trip_tutorial_needs_like():
    m = perturb(RefDecoderLayer(D, N, F))
    fmod, params = from_torch(m)
    with pytest.raises(TypeError, match="like="):
        to_torch_state_dict(fmod, params)
    fresh = RefDecoderLayer(D, N, F).eval()
    fresh.load_state_dict({k: torch.from_numpy(v) for k, v in
                           to_torch_state_dict(fmod, params, like=fresh).items()}, strict=True)
    x, enc = randn(B, T, D, seed=1), randn(B, S, D, seed=2)
    with torch.no_grad():
        np.testing.assert_array_equal(fresh(x, enc).numpy(), m(x, enc).numpy())
    with pytest.raises(ValueError, match="num_heads"):
        to_torch_state_dict(fmod, params, like=RefDecoderLayer(D, 2, F))


# ============================================================================= errors

def test_library_attention_rejects_bad_dims():
    x = jnp.ones((B, T, D))
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        MultiHeadAttention(num_heads=5).init(jax.random.PRNGKey(0), x)
    q, k = jnp.ones((B, T, N, 8)), jnp.ones((B, S, N, 16))
    with pytest.raises(ValueError, match="head dim"):
        dot_product_attention(q, k, k)


def test_wrong_mask_shapes():
    fmod, params = from_torch(tnn.MultiheadAttention(D, N, batch_first=True))
    q, kv = jnp.ones((B, T, D)), jnp.ones((B, S, D))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(8, 5\), expected \(7, 5\)"):
        fmod.apply({"params": params}, q, kv, kv, None, True, jnp.zeros((T + 1, S), bool))
    with pytest.raises(ValueError, match="key_padding_mask has shape"):
        fmod.apply({"params": params}, q, kv, kv, jnp.zeros((B, S + 1), bool))
    with pytest.raises(ValueError, match="only bool and floating"):
        fmod.apply({"params": params}, q, kv, kv, jnp.zeros((B, S), jnp.int32))
    with pytest.raises(ValueError, match="Need attn_mask"):
        fmod.apply({"params": params}, q, q, q, None, False, None, True, True)
    smod, sparams = from_torch(RefAttention(D, N))
    with pytest.raises(ValueError, match="2-D"):
        smod.apply({"params": sparams}, q, kv, kv, jnp.ones((B, T, S)))
    with pytest.raises(ValueError, match="does not broadcast"):
        smod.apply({"params": sparams}, q, kv, kv, jnp.ones((B, 1, T, S + 1)))


def test_unknown_state_dict_keys():
    class Extra(tnn.TransformerEncoderLayer):
        def __init__(self):
            super().__init__(D, N, F)
            self.register_buffer("running_thing", torch.zeros(3))

    with pytest.raises(ValueError, match="running_thing"):
        from_torch(Extra())
    m = RefAttention(D, N)
    m.scale = tnn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match="'scale'"):
        from_torch(m)


def test_shape_assertions():
    reader = StateDictReader({"w": np.zeros((3, 2))}, what="demo")
    with pytest.raises(ConversionError, match=r"'w' has shape \(3, 2\), expected \(2, 3\)"):
        reader.take("w", (2, 3))
    with pytest.raises(ConversionError, match="'missing' is missing"):
        reader.take("missing", (1,))
    fmod, params = from_torch(tnn.MultiheadAttention(D, N))
    params = jax.tree_util.tree_map(np.asarray, params)
    params["query"]["bias"] = np.zeros((N, D // N + 1), np.float32)
    with pytest.raises(ValueError, match=r"query/bias.*\(4, 9\), expected \(4, 8\)"):
        to_torch_state_dict(fmod, params)


def test_unsupported_modules_and_features():
    with pytest.raises(TypeError, match="(?s)unsupported module type.*LSTM.*MultiheadAttention"):
        from_torch(tnn.LSTM(4, 4))
    with pytest.raises(ValueError, match="add_bias_kv"):
        from_torch(tnn.MultiheadAttention(D, N, add_bias_kv=True))
    with pytest.raises(ValueError, match="add_zero_attn"):
        from_torch(tnn.MultiheadAttention(D, N, add_zero_attn=True))
    with pytest.raises(ValueError, match="activation"):
        from_torch(tnn.TransformerEncoderLayer(D, N, F, activation=lambda x: x * torch.sigmoid(x)))
    from_torch(tnn.TransformerEncoderLayer(D, N, F, activation=lambda x: x * torch.sigmoid(x)),
               activation="silu")
    with pytest.raises(TypeError, match="norm_first"):
        from_torch(RefAttention(D, N), norm_first=True)


def test_dropout_is_opt_in():
    fmod, params = from_torch(perturb(RefPreNormBlock(D, N, F, dropout=0.5)))
    x = jnp.asarray(randn(B, T, D, seed=1).numpy())
    a = fmod.apply({"params": params}, x)
    np.testing.assert_array_equal(a, fmod.apply({"params": params}, x))
    b = fmod.apply({"params": params}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)})
    assert not np.allclose(a, b)


def test_import_does_not_import_torch():
    code = ("import sys, transformer_jax, transformer_jax.interop.torch, "
            "transformer_jax.interop.tutorial.modules, transformer_jax.interop.torch_nn.modules, "
            "transformer_jax.interop.common; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
