"""The original Transformer: paper parameter counts, the sqrt(d) embedding scale, sinusoidal
positions and post-norm checked by hand composition, equality with ``torch.nn.Transformer``
(weights through ``interop.from_torch``), KV-cache decoding and errors.

Training is exercised end to end (train steps, eval, decoding, reload, generate) by
``tests/test_beam_search.py::test_stdlib_task_trains_and_generates``, which runs the
``transformer_stdlib_seq2seq`` experiment at a tiny size."""
import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.beam_search import init_decoder_cache
from transformer_jax.models import FAMILIES, build_model
from transformer_jax.models.base import to_config_layout
from transformer_jax.models.transformer import Transformer, TransformerConfig, init_params
from transformer_jax.errors import UserError

from ..helpers import assert_encoder_decoder_packed

TINY = dict(vocab_size=40, max_len=32, num_layers=1, num_decoder_layers=2, d_model=32,
            num_heads=4, mlp_dim=48, dropout_rate=0.0)


def test_paper_parameter_counts():
    """Every weight and bias once; the shared 37k embedding (source = target = output) once."""
    base, big = TransformerConfig.preset("base"), TransformerConfig.preset("big")
    d, f, v = 512, 2048, 37000
    attn, ff, ln = 4 * (d * d + d), d * f + f + f * d + d, 2 * d
    assert base.num_params() == v * d + 6 * (attn + ff + 2 * ln) + 6 * (2 * attn + ff + 3 * ln)
    assert base.num_params() == 63_082_496          # the paper: 65M
    assert big.num_params() == 214_245_376          # the paper: 213M
    assert (big.d_model, big.num_heads, big.mlp_dim, big.dropout_rate) == (1024, 16, 4096, 0.3)
    assert (base.dropout_rate, base.vocab_size, base.pre_norm) == (0.1, 37000, False)
    for cfg in (base, big):
        shapes = jax.eval_shape(lambda c=cfg: init_params(Transformer(c), jax.random.PRNGKey(0)))
        assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == cfg.num_params()
    untied = base.replace(tie_embeddings=False, pre_norm=True)
    assert untied.num_params() == base.num_params() + v * d + 2 * ln
    assert FAMILIES["transformer"] == (TransformerConfig, Transformer)
    assert isinstance(build_model("transformer", "tiny")[1], Transformer)


@functools.lru_cache(maxsize=None)
def forward(model):
    return jax.jit(lambda p, *args: model.apply({"params": p}, *args))


@pytest.fixture(scope="module")
def tiny():
    model = Transformer(TransformerConfig(**TINY))
    return model, jax.jit(lambda r: init_params(model, r))(jax.random.PRNGKey(0))


def batch(seed=0, b=3, s=9, t=6, vocab=40):
    rng = np.random.default_rng(seed)
    src = rng.integers(2, vocab, (b, s)).astype(np.int32)
    src_mask = np.ones((b, s), np.int32)
    src_mask[1, 5:] = 0
    tgt = rng.integers(0, vocab, (b, t)).astype(np.int32)
    return src, src_mask, tgt


# ----------------------------------------------------------------------------- by hand

def _layer_norm(x, p, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def _attention(x, mem, p, mask):
    q = np.einsum("BTD,DNH->BTNH", x, p["query"]["kernel"]) + p["query"]["bias"]
    k = np.einsum("BSD,DNH->BSNH", mem, p["key"]["kernel"]) + p["key"]["bias"]
    v = np.einsum("BSD,DNH->BSNH", mem, p["value"]["kernel"]) + p["value"]["bias"]
    logits = np.einsum("BTNH,BSNH->BNTS", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -1e30)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    return np.einsum("BNTS,BSNH,NHD->BTD", w, v, p["out"]["kernel"]) + p["out"]["bias"]


def test_encoder_by_hand_composition(tiny):
    """x0 = E[ids] sqrt(D) + PE; h = LN(x0 + MHA(x0)); out = LN(h + W2 relu(W1 h)), post-norm."""
    model, params = tiny
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), params)
    src, src_mask, _ = batch()
    d, s = 32, src.shape[1]
    pos = np.arange(s)[:, None]
    angles = pos / 10000.0 ** (np.arange(0, d, 2)[None, :] / d)
    pe = np.zeros((s, d))
    pe[:, 0::2], pe[:, 1::2] = np.sin(angles), np.cos(angles)           # the paper's formula
    x = p["embed"]["embedding"][src] * math.sqrt(d) + pe
    layer = p["encoder"]["layers_0"]
    mask = src_mask.astype(bool)[:, None, None, :]
    h = _layer_norm(x + _attention(x, x, layer["self_attn"], mask), layer["norm1"], 1e-6)
    ff = np.maximum(h @ layer["mlp"]["wi"]["kernel"] + layer["mlp"]["wi"]["bias"], 0)
    out = _layer_norm(h + ff @ layer["mlp"]["wo"]["kernel"] + layer["mlp"]["wo"]["bias"],
                      layer["norm2"], 1e-6)
    got = jax.jit(lambda prm: model.apply({"params": prm}, src, src_mask, method="encode"))(params)
    np.testing.assert_allclose(np.asarray(got), out, rtol=1e-4, atol=1e-4)
    assert set(params["encoder"]) == {"layers_0"}            # post-norm: no final norm


def test_matches_torch_transformer():
    """torch.nn.Transformer (its final norms, eps 1e-5) + a hand-written embedding and
    positional table and the tied read-out equals our model with final_norm=True."""
    torch = pytest.importorskip("torch")
    from transformer_jax.interop import from_torch

    torch.manual_seed(0)
    d, v = 32, 40
    ref = torch.nn.Transformer(d_model=d, nhead=4, num_encoder_layers=1, num_decoder_layers=2,
                               dim_feedforward=48, dropout=0.0, batch_first=True).eval()
    with torch.no_grad():
        for prm in ref.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    _, stacks = from_torch(ref)
    emb = torch.randn(v, d) * d ** -0.5
    model = Transformer(TransformerConfig(**{**TINY, "norm_eps": 1e-5, "final_norm": True}))
    params = {"embed": {"embedding": jnp.asarray(emb.numpy())}, **stacks}
    src, src_mask, tgt = batch(1)
    tgt_mask = np.ones_like(tgt)
    tgt_mask[2, 4:] = 0
    ours = np.asarray(forward(model)(params, src, tgt, src_mask, tgt_mask))
    pos = torch.arange(32.0)[:, None] / 10000 ** (torch.arange(0, d, 2.0) / d)
    pe = torch.stack([torch.sin(pos), torch.cos(pos)], -1).reshape(32, d)

    def embed(ids):
        return emb[torch.as_tensor(ids, dtype=torch.long)] * math.sqrt(d) + pe[: ids.shape[1]]

    with torch.no_grad():
        out = ref(embed(src), embed(tgt), tgt_mask=ref.generate_square_subsequent_mask(6),
                  src_key_padding_mask=torch.as_tensor(src_mask == 0),
                  memory_key_padding_mask=torch.as_tensor(src_mask == 0),
                  tgt_key_padding_mask=torch.as_tensor(tgt_mask == 0), tgt_is_causal=True)
        want = (out @ emb.T).numpy()
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=2e-5)
    # the same weights in the scanned layout, for a scan_layers=True model
    scanned = Transformer(model.config.replace(scan_layers=True))
    scanned_params = to_config_layout(params, scanned.config)
    assert scanned_params["decoder"]["layers"]["cross_attn"]["query"]["kernel"].shape[0] == 2
    np.testing.assert_allclose(np.asarray(forward(scanned)(scanned_params, src, tgt, src_mask,
                                                           tgt_mask)), ours, rtol=1e-5, atol=1e-5)


def test_pre_norm_variant_and_untied_head():
    cfg = TransformerConfig(**{**TINY, "pre_norm": True, "tie_embeddings": False})
    shapes = jax.eval_shape(lambda: init_params(Transformer(cfg), jax.random.PRNGKey(0)))
    assert "norm" in shapes["encoder"] and "norm" in shapes["decoder"]
    assert shapes["lm_head"]["kernel"].shape == (32, 40)
    assert sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes)) == cfg.num_params()


# ----------------------------------------------------------------------------- decoding

def test_kv_cache_decode_equals_full_pass(tiny):
    model, params = tiny
    src, src_mask, tgt = batch(2, t=5)
    full = np.asarray(forward(model)(params, src, tgt, src_mask))
    encoded = jax.jit(lambda p: model.apply({"params": p}, src, src_mask, method="encode"))(params)
    cache = jax.jit(lambda p: init_decoder_cache(model, p, encoded, src_mask, 5))(params)
    step = jax.jit(lambda p, c, t: model.apply({"params": p, "cache": c}, t, encoded, src_mask,
                                               decode=True, method="decode", mutable=["cache"]))
    outs = []
    for i in range(5):
        logits, state = step(params, cache, tgt[:, i:i + 1])
        cache = state["cache"]
        outs.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)
    assert int(cache["decoder"]["position_index"]) == 5


def _matmul_lhs_rows(jaxpr) -> list[int]:
    """Rows (leading dimension) of the left operand of every 2-D matmul in a jaxpr, nested
    jaxprs included (the Dense layers flatten (B, L, D) inputs to (B * L, D))."""
    rows = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general" and eqn.invars[0].aval.ndim == 2:
            rows.append(eqn.invars[0].aval.shape[0])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            rows += _matmul_lhs_rows(sub)
    return rows


@pytest.mark.parametrize("scan", [False, True])
def test_decode_step_reads_the_cross_attention_cache(tiny, scan):
    """The decoder's cross-attention keys and values are computed from the encoder output
    once, when the cache is created: a decode step multiplies only its B = 3 new rows (no
    B * S = 27 row projection of the encoder output), and its logits are unchanged."""
    model, params = tiny
    if scan:
        model = Transformer(model.config.replace(scan_layers=True))
        params = to_config_layout(params, model.config)
    src, src_mask, tgt = batch(2, t=5)
    encoded = model.apply({"params": params}, src, src_mask, method="encode")
    cache = init_decoder_cache(model, params, encoded, src_mask, 5)
    cross = cache["decoder"]["layers" if scan else "layers_1"]["cross_attn"]
    assert cross["cached_key"].shape[-3:] == (4, 9, 8)                 # (.., N, S, H)

    def step(p, c, t):
        return model.apply({"params": p, "cache": c}, t, encoded, src_mask, decode=True,
                           method="decode", mutable=["cache"])
    rows = _matmul_lhs_rows(jax.make_jaxpr(step)(params, cache, tgt[:, :1]).jaxpr)
    assert rows and set(rows) == {3}, rows
    logits, _ = step(params, cache, tgt[:, :1])
    full = np.asarray(forward(model)(params, src, tgt[:, :1], src_mask))
    np.testing.assert_allclose(np.asarray(logits), full, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("field,value,match", [
    ("num_heads", 5, "not divisible by num_heads=5"),
    ("d_model", 33, "even d_model"),
    ("final_norm", False, "pre_norm=True needs final_norm"),
    ("activation", "gelu_fast", "activation='gelu_fast' is unknown"),
    ("dropout_rate", 1.0, r"dropout_rate must be in \[0, 1\)"),
    ("decoder_start_token_id", 99, "outside the vocabulary"),
])
def test_bad_config_raises(field, value, match):
    extra = {"pre_norm": True} if field == "final_norm" else {"num_heads": 3} if field == "d_model" else {}
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**{**TINY, **extra, field: value})


def test_bad_inputs_raise(tiny):
    model, params = tiny
    src, src_mask, tgt = batch()
    with pytest.raises(ValueError, match="exceeds the model's max_len=32"):
        model.apply({"params": params}, np.zeros((1, 40), np.int32), tgt[:1])
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, length\) = \(3, 9\)"):
        model.apply({"params": params}, src, tgt, src_mask[:, :4])
    with pytest.raises(ValueError, match="different batch sizes"):
        model.apply({"params": params}, src, tgt[:1])
    with pytest.raises(ValueError, match="decoder_input_ids must be"):
        model.apply({"params": params}, src, tgt[0])


# one path per family here (every path: test_attention.py and test_gpt.py)
@pytest.mark.parametrize("impl", ["xla"])
def test_packed_documents_equal_documents_alone(impl):
    # two source/target pairs packed into one row each: encoder self-attention, causal decoder
    # self-attention and cross-attention stay within each pair; positions restart per document
    model = Transformer(TransformerConfig(**TINY, attention_impl=impl))
    params = jax.jit(lambda rng: init_params(model, rng))(jax.random.PRNGKey(2))
    assert_encoder_decoder_packed(model, params, 40)
