"""GPT: presets, scan/remat equivalence, KV-cache decoding and sampling."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import decode
from transformer_jax.decode import generate, sample_logits
from transformer_jax.layers.stack import stack_layers, unstack_layers
from transformer_jax.errors import UserError
from transformer_jax.models.gpt import GPT, GPTConfig, init_params

from ..helpers import assert_packed_like_alone

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
TINY = GPTConfig.preset("tiny", dropout_rate=0.0, attention_dropout_rate=0.0)


@pytest.fixture(scope="module")
def tiny():
    model = GPT(TINY)
    return model, init_params(model, jax.random.PRNGKey(0))


def ids(key, shape, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.PRNGKey(key), shape, 0, vocab)


@pytest.mark.parametrize("name", ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_param_count_matches_formula(name):
    cfg = GPTConfig.preset(name)
    shapes = jax.eval_shape(lambda: GPT(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))
    n = sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(shapes["params"])))
    assert n == cfg.num_params()


def test_published_gpt2_sizes():
    # HF GPT2LMHeadModel parameter counts (tied head counted once)
    assert GPTConfig.preset("gpt2").num_params() == 124_439_808
    assert GPTConfig.preset("gpt2-medium").num_params() == 354_823_168
    assert GPTConfig.preset("gpt2-large").num_params() == 774_030_080
    assert GPTConfig.preset("gpt2-xl").num_params() == 1_557_611_200


def test_config_errors():
    with pytest.raises(ValueError, match="unknown GPTConfig preset 'gpt3'"):
        GPTConfig.preset("gpt3")
    with pytest.raises(ValueError, match="did you mean 'num_layers'"):
        GPTConfig.preset("tiny", num_layer=3)
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        GPTConfig(d_model=100, num_heads=8)


def test_scan_and_remat_match_unrolled(tiny):
    model, params = tiny
    x = ids(1, (2, 16))
    ref = model.apply({"params": params}, x)
    scanned = GPT(TINY.replace(scan_layers=True, remat=True))
    sp = stack_layers(params, TINY.num_layers, name="h")
    np.testing.assert_allclose(scanned.apply({"params": sp}, x), ref, **FP32_TOL)
    # the scanned model initialises the same tree layout
    init_sp = init_params(scanned, jax.random.PRNGKey(0))
    assert jax.tree_util.tree_structure(init_sp) == jax.tree_util.tree_structure(sp)
    assert jax.tree_util.tree_structure(unstack_layers(sp, name="h")) == jax.tree_util.tree_structure(params)

    def loss(m, p):
        return jnp.mean(jax.nn.log_softmax(m.apply({"params": p}, x))[..., 0])
    g_ref = jax.grad(lambda p: loss(model, p))(params)
    g = unstack_layers(jax.grad(lambda p: loss(scanned, p))(sp), name="h")
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_causal_and_padding(tiny):
    model, params = tiny
    x = ids(2, (2, 12))
    full = model.apply({"params": params}, x)
    changed = model.apply({"params": params}, x.at[:, 8:].set(7))
    np.testing.assert_allclose(changed[:, :8], full[:, :8], **FP32_TOL)   # no peeking ahead
    # right padding: the valid prefix is unaffected by pad tokens when they are masked
    mask = jnp.array([[1] * 12, [1] * 9 + [0] * 3])
    masked = model.apply({"params": params}, x.at[1, 9:].set(0), attention_mask=mask)
    np.testing.assert_allclose(masked[1, :9], full[1, :9], **FP32_TOL)


def test_dropout_needs_and_uses_rng():
    model = GPT(GPTConfig.preset("tiny"))  # dropout 0.1
    params = init_params(model, jax.random.PRNGKey(0))
    x = ids(3, (2, 8))
    a = model.apply({"params": params}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
    b = model.apply({"params": params}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(2)})
    c = model.apply({"params": params}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
    np.testing.assert_array_equal(a, c)
    assert float(jnp.abs(a - b).max()) > 1e-3


def test_bf16_compute_close_to_fp32(tiny):
    model, params = tiny
    x = ids(4, (2, 16))
    ref = model.apply({"params": params}, x)
    bf = GPT(TINY.replace(dtype="bfloat16")).apply({"params": params}, x)
    assert bf.dtype == jnp.float32          # logits for the loss stay fp32
    # documented bf16 tolerance for logits of the tiny model: 5e-2 absolute
    assert float(jnp.abs(bf - ref).max()) < 5e-2


def test_sequence_too_long_is_a_clear_error(tiny):
    model, params = tiny
    with pytest.raises(ValueError, match="exceeds the model's max_len=128"):
        model.apply({"params": params}, jnp.zeros((1, 129), jnp.int32))
    with pytest.raises(ValueError, match="exceeds the model's max_len=128"):
        generate(model, params, jnp.zeros((1, 100), jnp.int32), max_new_tokens=29)


# --------------------------------------------------------------------------- decoding

def greedy_without_cache(model, params, prompt, n):
    out = prompt
    for _ in range(n):
        nxt = jnp.argmax(model.apply({"params": params}, out)[:, -1], -1)
        out = jnp.concatenate([out, nxt[:, None].astype(out.dtype)], 1)
    return out


def test_generate_greedy_equals_uncached_loop_without_recompiling(tiny):
    model, params = tiny
    prompt = ids(5, (3, 6))
    out = generate(model, params, prompt, max_new_tokens=10)
    np.testing.assert_array_equal(out, greedy_without_cache(model, params, prompt, 10))
    before = decode.jitted_generate._cache_size()
    out2 = generate(model, params, ids(6, (3, 6)), max_new_tokens=10)
    assert decode.jitted_generate._cache_size() == before   # new prompt values: no new compilation
    np.testing.assert_array_equal(out2[:, :6], ids(6, (3, 6)))


def test_generate_ragged_batch_equals_single_prompts(tiny):
    model, params = tiny
    rows = [[5, 9, 3], [1, 2, 3, 4, 5, 6], [42]]
    batch = generate(model, params, rows, max_new_tokens=5)
    for row, got in zip(rows, batch):
        single = generate(model, params, jnp.array([row]), max_new_tokens=5)
        assert got == np.asarray(single[0]).tolist()


def test_generate_eos_pads_and_stops(tiny):
    model, params = tiny
    prompt = ids(7, (2, 4))
    free = np.asarray(generate(model, params, prompt, max_new_tokens=8))
    eos = int(free[0, 6])   # the 3rd new token of row 0 becomes "eos"
    out = np.asarray(generate(model, params, prompt, max_new_tokens=8, eos_id=eos, pad_id=0))
    first = list(free[0, 4:]).index(eos) + 4
    np.testing.assert_array_equal(out[0, :first + 1], free[0, :first + 1])
    assert (out[0, first + 1:] == 0).all()
    for r in range(2):    # rows stop at their own first eos
        new = list(free[r, 4:])
        stop = new.index(eos) + 4 if eos in new else 12
        np.testing.assert_array_equal(out[r, :stop + 1], free[r, :stop + 1])


def test_generate_stops_at_any_of_several_eos_ids(tiny):
    """``eos_id`` a list (a generation_config.json's, e.g. Llama 3 Instruct's): each row stops
    at the first of them it emits, the ragged form cuts there, as transformers' generate."""
    model, params = tiny
    prompt = ids(7, (2, 4))
    free = np.asarray(generate(model, params, prompt, max_new_tokens=8))
    stops = (int(free[0, 4]), int(free[1, 4]))     # each row's 1st new token
    assert stops[0] != stops[1] and stops[1] not in free[0] and stops[0] not in free[1]
    out = np.asarray(generate(model, params, prompt, max_new_tokens=8, eos_id=stops, pad_id=0))
    cut = generate(model, params, prompt.tolist(), max_new_tokens=8, eos_id=list(stops))
    for r in range(2):                              # each row at its own one of the two
        np.testing.assert_array_equal(out[r, :5], free[r, :5])
        assert (out[r, 5:] == 0).all() and cut[r] == free[r, :5].tolist()
    assert decode.eos_ids(None) == () and decode.eos_ids(np.int32(3)) == (3,)


def test_generate_sampling_is_seeded_and_topk1_is_greedy(tiny):
    model, params = tiny
    prompt = ids(8, (2, 4))
    greedy = generate(model, params, prompt, max_new_tokens=6)
    k1 = generate(model, params, prompt, max_new_tokens=6, temperature=0.7, top_k=1,
                  rng=jax.random.PRNGKey(0))
    np.testing.assert_array_equal(k1, greedy)
    a = generate(model, params, prompt, max_new_tokens=6, temperature=1.0, rng=jax.random.PRNGKey(1))
    b = generate(model, params, prompt, max_new_tokens=6, temperature=1.0, rng=jax.random.PRNGKey(1))
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="needs an rng"):
        generate(model, params, prompt, max_new_tokens=2, temperature=1.0)


def test_sample_logits_distributions():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    logits = jnp.repeat(logits, 20000, axis=0)
    freq = lambda toks: np.bincount(np.asarray(toks), minlength=4) / toks.shape[0]
    rng = jax.random.PRNGKey(0)
    np.testing.assert_allclose(freq(sample_logits(logits, rng, temperature=1.0)),
                               [0.5, 0.3, 0.15, 0.05], atol=0.015)
    np.testing.assert_allclose(freq(sample_logits(logits, rng, temperature=1.0, top_k=2)),
                               [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.015)
    # nucleus 0.7: tokens 0 and 1 (mass before token 1 is 0.5 < 0.7; before token 2 is 0.8)
    np.testing.assert_allclose(freq(sample_logits(logits, rng, temperature=1.0, top_p=0.7)),
                               [0.5 / 0.8, 0.3 / 0.8, 0, 0], atol=0.015)
    np.testing.assert_allclose(freq(sample_logits(logits, rng, temperature=1.0, top_p=0.4)),
                               [1, 0, 0, 0], atol=0)
    # temperature 0.5 squares the probabilities before renormalising
    p2 = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(freq(sample_logits(logits, rng, temperature=0.5)), p2 / p2.sum(), atol=0.015)
    np.testing.assert_array_equal(sample_logits(logits[:2], None), [0, 0])


# every path at the attention level (test_attention.py; splash: test_splash_attention.py)
@pytest.mark.parametrize("preset, impl", [("tiny", "xla"), ("llama-tiny", "splash")])
def test_packed_documents_equal_documents_alone(preset, impl):
    # learned positions (GPT-2) and RoPE (Llama) restart at each document
    cfg = GPTConfig.preset(preset, dropout_rate=0.0, attention_dropout_rate=0.0,
                           attention_impl=impl, num_layers=1, max_len=32)
    model = GPT(cfg)
    params = init_params(model, jax.random.PRNGKey(1))

    def fn(params, inputs):
        ids, seg, pos, mask = inputs["tokens"]
        return model.apply({"params": params}, ids, mask, position_ids=pos, segment_ids=seg)

    assert_packed_like_alone(fn, params, {"tokens": (5, 9, 3)}, cfg.vocab_size)
    with pytest.raises(UserError, match="not for decode=True: a KV cache holds one sequence"):
        model.apply({"params": params}, jnp.ones((1, 4), jnp.int32),
                    segment_ids=jnp.ones((1, 4), jnp.int32), decode=True, mutable=["cache"])
