"""``from_torch`` on the tutorials' own PyTorch classes (``tutorial_classes.py``, kept verbatim).

Each class is first run in PyTorch. Those that run convert, with fp32 forward parity
(``RTOL``/``ATOL``), gradient parity w.r.t. every parameter for the grouped-query attention
and the whole encoder-decoder Transformer (JAX gradients mapped back through the
converter's own table, ``to_torch_state_dict``; loss ``sum(output * cotangent)``), and a
round trip: ``to_torch_state_dict`` loaded strictly into a fresh module reproduces the
outputs. Those that cannot run as written are refused, and the tests check that PyTorch
fails on them too:

* ``GroupedQueryAttention`` has no forward: refused; the same class with a forward written
  here (``CompletedGQA``) converts;
* ``SlidingWindowAttention.forward`` is ``pass``: refused, pointing to the library's
  sliding-window attention;
* ``BERT`` and ``GPT`` apply d_model-wide heads to the Transformer's vocabulary logits:
  refused unless vocab_size == d_model, and converted as written when it is.

The Transformer's decoder mask (``generate_mask``: ``triu(ones, 1)``, inverted w.r.t. the
tutorial's 1 = may attend) is reproduced as written; a subclass with a causal mask converts
to the causal variant. Modules run in eval mode (dropout off) with autograd on.

Sizes: B=2, S=7 source and T=5 target tokens, D=32, N=4 heads (K=2 key/value heads), F=64,
V=50, 2 layers; the learned position table holds ``tutorial.max_seq_len`` = 16 positions and
the sinusoidal one 24.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.interop.torch import from_torch, to_torch_state_dict

from . import tutorial_classes as tutorial
from .conftest import ATOL, RTOL, torch

B, S, T, D, N, K, F, V, L = 2, 7, 5, 32, 4, 2, 64, 50, 2


def setup_module():
    torch.set_num_threads(2)


def config(vocab_size=V):
    return tutorial.TransformerConfig(vocab_size=vocab_size, d_model=D, n_heads=N, n_layers=L, d_ff=F,
                                  dropout=0.1, max_seq_len=24)


class CompletedGQA(tutorial.GroupedQueryAttention):
    """The tutorial's GroupedQueryAttention with the forward it lacks, written for this test:
    batch-first inputs, key/value head k shared by query heads k*N/K ... (k+1)*N/K - 1."""

    def forward(self, query, key, value, mask=None):
        b, t, s = query.shape[0], query.shape[1], key.shape[1]
        q = self.q_proj(query).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key).view(b, s, self.n_kv_groups, self.head_dim).transpose(1, 2)
        v = self.v_proj(value).view(b, s, self.n_kv_groups, self.head_dim).transpose(1, 2)
        groups = self.n_heads // self.n_kv_groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class CausalTransformer(tutorial.Transformer):
    """The tutorial's Transformer with generate_mask in the tutorial's own convention (1 = may attend)."""

    def generate_mask(self, size):
        return torch.tril(torch.ones(size, size)).bool()


# ============================================================================= helpers

def build(make, seed_=0):
    """``make()`` under a fixed seed, every parameter moved off its init, in eval mode."""
    torch.manual_seed(seed_)
    module = make()
    g = torch.Generator().manual_seed(seed_ + 1)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return module.eval()


def randn(*shape, seed_):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed_))


def ids(*shape, seed_, vocab=V):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed_))


def to_jax(x):
    return jnp.asarray(x.detach().numpy()) if isinstance(x, torch.Tensor) else x


def leaves(out):
    """The output arrays in a fixed order (a tensor, a tuple, or a dict by key)."""
    if isinstance(out, dict):
        return [out[k] for k in sorted(out)]
    return list(out) if isinstance(out, tuple) else [out]


def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def assert_outputs(touts, jouts):
    """Same number and shapes of outputs, equal within RTOL/ATOL. Returns the max abs difference."""
    assert len(jouts) == len(touts)
    for i, (t, j) in enumerate(zip(touts, jouts)):
        assert j.shape == tuple(t.shape), (i, j.shape, t.shape)
        np.testing.assert_allclose(np.asarray(j), t.detach().numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"output {i}")
    return max(max_diff(j, t.detach().numpy()) for t, j in zip(touts, jouts))


def assert_forward(tmod, inputs):
    """Convert ``tmod``; its outputs on ``inputs`` and the mirror's agree.

    Returns (fmod, params, max abs difference)."""
    fmod, params = from_torch(tmod)
    with torch.no_grad():
        touts = leaves(tmod(*inputs))
    jouts = leaves(fmod.apply({"params": params}, *[to_jax(x) for x in inputs]))
    return fmod, params, assert_outputs(touts, jouts)


def assert_forward_and_gradients(tmod, inputs):
    """Outputs, and gradients of sum(output * cotangent) w.r.t. every parameter, agree
    (one JAX compile for both). Returns (fmod, max abs output diff, max abs gradient diff).

    Gradient tolerance ``RTOL`` and ``ATOL * max(1, largest |entry| of the tensor)``: the
    scaled token embeddings (sqrt(D) * N(0, 1)) make the early layers' weight gradients
    reach ~15, and an entry that is a fp32 sum of such terms cancelling differs by ~1e-6
    of them (measured: <= 3e-6 of the largest entry). No gradient may be ~0 (a vacuous
    check) but the key biases', which are 0 exactly (a softmax row is shift-invariant).
    """
    fmod, params = from_torch(tmod)
    tmod.zero_grad()
    touts = leaves(tmod(*inputs))
    cots = [randn(*o.shape, seed_=100 + i) for i, o in enumerate(touts)]
    sum((o * c).sum() for o, c in zip(touts, cots)).backward()

    def loss(p):
        outs = leaves(fmod.apply({"params": p}, *[to_jax(x) for x in inputs]))
        return sum((o * to_jax(c)).sum() for o, c in zip(outs, cots)), outs

    (_, jouts), jgrads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    out_diff = assert_outputs(touts, jouts)
    grads = to_torch_state_dict(fmod, jgrads, like=tmod)
    named = dict(tmod.named_parameters())
    assert set(named) <= set(grads), set(named) - set(grads)
    for name, p in named.items():
        ref = p.grad.numpy()
        if not name.endswith(("w_k.bias", "k_proj.bias")):
            assert np.abs(ref).max() > 1e-4, f"{name}: (near-)zero gradient, vacuous test"
        np.testing.assert_allclose(grads[name], ref, rtol=RTOL, atol=ATOL * max(1.0, np.abs(ref).max()),
                                   err_msg=f"grad of parameter {name}")
    return fmod, out_diff, max(max_diff(grads[n], p.grad.numpy()) for n, p in named.items())


def assert_round_trip(tmod, fresh, inputs):
    """from_torch, then to_torch_state_dict(like=fresh) loaded strictly into ``fresh``."""
    fmod, params = from_torch(tmod)
    state = to_torch_state_dict(fmod, params, like=fresh)
    fresh.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    with torch.no_grad():
        for a, b in zip(leaves(fresh(*inputs)), leaves(tmod(*inputs))):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=RTOL, atol=ATOL)


# ============================================================================= what PyTorch does

def test_refused_classes_fail_in_pytorch_too():
    x = randn(B, S, D, seed_=1)
    with pytest.raises(NotImplementedError, match="forward"):
        tutorial.GroupedQueryAttention(D, N, K)(x)
    assert tutorial.SlidingWindowAttention(D, N, window_size=3)(x, x, x) is None
    for cls in (tutorial.BERT, tutorial.GPT):
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            cls(config())(ids(B, S, seed_=2), torch.ones(B, S))


# ============================================================================= converted

def test_grouped_query_attention():
    m = build(lambda: CompletedGQA(D, N, K))
    q, kv = randn(B, T, D, seed_=1), randn(B, S, D, seed_=2)
    mask = (torch.arange(S)[None, :] < torch.tensor([S, 3])[:, None])[:, None, None, :]  # padding
    fmod, _, _ = assert_forward_and_gradients(m, [q, kv, kv, mask])
    assert (fmod.num_heads, fmod.num_kv_heads, fmod.head_dim) == (N, K, D // N)
    x = randn(B, S, D, seed_=3)
    assert_forward(m, [x, x, x, torch.tril(torch.ones(S, S))])
    assert_round_trip(m, CompletedGQA(D, N, K).eval(), [q, kv, kv, mask])


def test_input_embedding():
    m = build(lambda: tutorial.InputEmbedding(V, D))
    tokens = ids(B, S, seed_=1)
    fmod, params, _ = assert_forward(m, [tokens])
    assert (fmod.max_len, fmod.dropout_rate) == (tutorial.max_seq_len, tutorial.dropout)
    assert params["position_embedding"].shape == (1, tutorial.max_seq_len, D)
    assert_round_trip(m, tutorial.InputEmbedding(V, D).eval(), [tokens])
    with pytest.raises(ValueError, match="exceeds the learned position table"):
        fmod.apply({"params": params}, jnp.zeros((1, tutorial.max_seq_len + 1), jnp.int32))


def test_scaled_dot_product_attention():
    m = tutorial.ScaledDotProductAttention(dropout=0.1).eval()
    h = D // N
    q, k, v = randn(B, N, T, h, seed_=1), randn(B, N, S, h, seed_=2), randn(B, N, S, h + 2, seed_=3)
    fmod, params, _ = assert_forward(m, [q, k, v])
    assert params == {} and fmod.dropout_rate == 0.1
    padding = (torch.arange(S)[None, :] < torch.tensor([S, 3])[:, None])[:, None, None, :]
    assert_forward(m, [q, k, v, padding])
    # a 3-D mask broadcasts as PyTorch does (trailing axes aligned: (N, T, S) here); a row
    # without allowed keys averages the values in both
    mask3 = (randn(N, T, S, seed_=4) > 0).float()
    mask3[:, 0] = 0
    assert_forward(m, [q, k, v, mask3])
    assert_forward(m, [q[0], k[0], v[0], mask3])              # (N, T, H): no batch axis
    assert_round_trip(m, tutorial.ScaledDotProductAttention(dropout=0.1).eval(), [q, k, v])


def test_patch_embed():
    m = build(lambda: tutorial.PatchEmbed(img_size=16, patch=4, in_ch=3, d_model=D))
    images = randn(B, 3, 18, 16, seed_=1)          # 18 rows: the last 2 fill no patch
    fmod, params, _ = assert_forward(m, [images])
    assert fmod.patch_size == (4, 4) and params["proj"]["kernel"].shape == (4, 4, 3, D)
    assert_round_trip(m, tutorial.PatchEmbed(img_size=16, patch=4, in_ch=3, d_model=D).eval(), [images])


def test_transformer_encoder_only():
    m = build(lambda: tutorial.Transformer(config(), encoder_only=True))
    fmod, _, _ = assert_forward(m, [ids(B, S, seed_=1)])
    assert fmod.encoder_only and fmod.num_layers == L and not fmod.pre_norm


def test_transformer_encoder_decoder():
    """Whole model: forward and gradients; the decoder mask is the tutorial's, as written."""
    m = build(lambda: tutorial.Transformer(config()))
    inputs = [ids(B, S, seed_=1), ids(B, T, seed_=2)]
    fmod, _, _ = assert_forward_and_gradients(m, inputs)
    assert fmod.decoder_mask == "future" and fmod.num_decoder_layers == L
    assert (fmod.max_len, fmod.pe_max_len, fmod.dropout_rate) == (tutorial.max_seq_len, 24, 0.1)
    assert_round_trip(m, tutorial.Transformer(config()).eval(), inputs)


def test_transformer_with_causal_generate_mask():
    m = build(lambda: CausalTransformer(config()))
    fmod, _, _ = assert_forward(m, [ids(B, S, seed_=1), ids(B, T, seed_=2)])
    assert fmod.decoder_mask == "causal"


@pytest.mark.parametrize("cls", ["BERT", "GPT"])
def test_bert_gpt_when_vocab_equals_width(cls):
    """vocab_size == d_model: the tutorial's classes run; converted as written."""
    m = build(lambda: getattr(tutorial, cls)(config(vocab_size=D)))
    inputs = [ids(B, S, seed_=1, vocab=D), torch.ones(B, S)]
    fmod, _, _ = assert_forward(m, inputs)
    assert fmod.encoder_only and fmod.vocab_size == D
    assert_round_trip(m, getattr(tutorial, cls)(config(vocab_size=D)).eval(), inputs)


# ============================================================================= refused

def test_grouped_query_attention_as_written_is_refused():
    with pytest.raises(ValueError, match=r"(?s)GroupedQueryAttention has no forward\(\).*"
                                         r"subclass.*num_kv_heads"):
        from_torch(tutorial.GroupedQueryAttention(D, N, K))


def test_sliding_window_attention_is_refused():
    with pytest.raises(ValueError, match=r"(?s)SlidingWindowAttention.forward is a stub.*"
                                         r"attention_window.*sliding_window_mask"):
        from_torch(tutorial.SlidingWindowAttention(D, N, window_size=3))


@pytest.mark.parametrize("cls,head", [("BERT", "pooler"), ("GPT", "lm_head")])
def test_bert_gpt_refused_when_vocab_differs_from_width(cls, head):
    with pytest.raises(ValueError, match=rf"(?s)tutorial's {cls} cannot run with vocab_size=50 != "
                                         rf"d_model=32.*{head}.*vocabulary logits"):
        from_torch(getattr(tutorial, cls)(config()))


def test_unsupported_generate_mask_is_refused():
    m = tutorial.Transformer(config())
    m.generate_mask = lambda size: torch.ones(size, size)
    with pytest.raises(ValueError, match="generate_mask.*triu"):
        from_torch(m)


# ============================================================================= dropout

def test_dropout_is_opt_in():
    """Deterministic by default; ``deterministic=False`` with a dropout rng applies the rates read."""
    rngs = {"dropout": jax.random.PRNGKey(0)}
    fmod, params = from_torch(tutorial.ScaledDotProductAttention(dropout=0.5))
    q = jnp.ones((B, N, T, 8))
    out, weights = fmod.apply({}, q, q, q, deterministic=False, rngs=rngs)
    assert np.any(np.asarray(weights) == 0) and not np.allclose(out, fmod.apply({}, q, q, q)[0])
    fmod, params = from_torch(tutorial.InputEmbedding(V, D))
    x = jnp.asarray(ids(B, S, seed_=1).numpy())
    dropped = np.asarray(fmod.apply({"params": params}, x, deterministic=False, rngs=rngs))
    assert fmod.dropout_rate == tutorial.dropout and np.any(dropped == 0)
    np.testing.assert_allclose(dropped[dropped != 0] * (1 - tutorial.dropout),
                               np.asarray(fmod.apply({"params": params}, x))[dropped != 0], rtol=1e-6)
