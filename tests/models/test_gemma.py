"""Gemma 3: the config (pattern, refusals, JSON), the KV cache per layer kind, remat, FLOPs.

Parity with Hugging Face is in tests/interop/test_hf_gemma.py."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decode import init_cache
from transformer_jax.errors import UserError
from transformer_jax.models import FAMILIES, build_model, model_from_config
from transformer_jax.models.gemma import Gemma, GemmaConfig, init_params

from ..helpers import assert_packed_like_alone

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
TINY = GemmaConfig.preset("gemma3-tiny", max_len=64)     # local, local, global; W = 8


@pytest.fixture(scope="module")
def tiny():
    model = Gemma(TINY)
    params = init_params(model, jax.random.PRNGKey(0))
    # HF's init leaves the norms at 1 + 0: move them so that a misplaced norm shows
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params = jax.tree_util.tree_unflatten(
        tree, [x + 0.1 * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])
    return model, params


def ids(key, shape, vocab=TINY.vocab_size):
    return jax.random.randint(jax.random.PRNGKey(key), shape, 0, vocab)


def test_layer_pattern_and_registration():
    assert GemmaConfig.preset("gemma3-1b").layer_kinds == (("local",) * 5 + ("global",)) * 4 + (
        "local", "local")
    assert TINY.layer_kinds == ("local", "local", "global")
    explicit = TINY.replace(layer_types=["global", "local", "local"])      # JSON gives lists
    assert explicit.layer_kinds == ("global", "local", "local")
    assert GemmaConfig.from_dict(explicit.to_dict()) == explicit
    assert FAMILIES["gemma"] == (GemmaConfig, Gemma)
    cfg, module = build_model("gemma", "gemma3-tiny", {"num_layers": 6})
    assert cfg.layer_kinds == ("local", "local", "global") * 2 and isinstance(module, Gemma)
    assert model_from_config("gemma", cfg.to_dict())[0] == cfg


@pytest.mark.parametrize("change, match", [
    (dict(scan_layers=True), "GemmaConfig.scan_layers=True is not supported by Gemma: its "
                             "local and global layers differ"),
    (dict(layer_types=("local", "global")), r"GemmaConfig.layer_types=\('local', 'global'\) "
                                            r"needs one entry per layer \(num_layers=3\)"),
    (dict(layer_types=("local", "sliding", "global")), "GemmaConfig.layer_types must be None or"),
    (dict(num_kv_heads=3), "num_heads=4 is not divisible by num_kv_heads=3"),
    (dict(head_dim=15), "GemmaConfig.head_dim=15 must be even"),
    (dict(sliding_window=0), "GemmaConfig.sliding_window must be an integer >= 1"),
    (dict(final_logit_softcap=0.0), "GemmaConfig.final_logit_softcap must be a number > 0"),
])
def test_config_errors(change, match):
    with pytest.raises(UserError, match=match):
        TINY.replace(**change)


def test_sliding_window_cuts_in_on_local_layers_only(tiny):
    """Logits of the first W tokens do not depend on the window; later ones do; a model whose
    every layer is global equals the tiny one with a window past the sequence."""
    model, params = tiny
    x = ids(0, (2, 24))
    ref = model.apply({"params": params}, x)
    wide = Gemma(TINY.replace(sliding_window=64)).apply({"params": params}, x)
    np.testing.assert_allclose(wide[:, :8], ref[:, :8], **FP32_TOL)
    assert np.abs(wide[:, 8:] - ref[:, 8:]).max() > 1e-3
    # every layer global with the local RoPE base on none: not the same model
    glob = Gemma(TINY.replace(layer_types=("global",) * 3)).apply({"params": params}, x)
    assert np.abs(glob - wide).max() > 1e-3


def test_kv_cache_rings_on_local_layers_and_matches_the_full_forward(tiny):
    """Prefill 5 tokens, then 1 token at a time to 30 (> W = 8): each step's logits equal the
    full forward's at that position; the local layers keep W slots, the global one 30."""
    model, params = tiny
    x = ids(3, (2, 30))
    full = model.apply({"params": params}, x)
    cache = init_cache(model, 2, 30)
    assert [cache[f"h_{i}"]["self_attn"]["cached_key"].shape for i in range(3)] == [
        (2, 2, 8, 16), (2, 2, 8, 16), (2, 2, 30, 16)]
    mask = jnp.ones((2, 30), jnp.int32)
    step = jax.jit(lambda cache, tokens: model.apply(
        {"params": params, "cache": cache}, tokens, attention_mask=mask, decode=True,
        mutable=["cache"]))
    out, state = step(cache, x[:, :5])
    steps = [out]
    for t in range(5, 30):
        out, state = step(state["cache"], x[:, t:t + 1])
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, **FP32_TOL)


def test_remat_matches_and_gradients_reach_every_parameter(tiny):
    model, params = tiny
    x = ids(4, (2, 16))

    def loss(m):
        return lambda p: jnp.mean(m.apply({"params": p}, x) ** 2)

    ref, grads = jax.jit(jax.value_and_grad(loss(model)))(params)
    val, rgrads = jax.jit(jax.value_and_grad(loss(Gemma(TINY.replace(remat=True)))))(params)
    np.testing.assert_allclose(val, ref, **FP32_TOL)
    for g, r in zip(jax.tree_util.tree_leaves(rgrads), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        assert float(jnp.abs(r).max()) > 0


def test_param_count_and_flops():
    shapes = jax.eval_shape(lambda: Gemma(TINY).init(jax.random.PRNGKey(0),
                                                     jnp.zeros((1, 4), jnp.int32)))
    n = sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(shapes["params"])))
    assert n == TINY.num_params() == 144_288
    assert TINY.replace(tie_embeddings=False).num_params() == 144_288 + 512 * 64
    # 6 N + 12 N H (8 + 8 + 32 keys): N = 144288 non-embedding + 512 x 64 read-out
    assert TINY.flops_per_token(32) == 6 * 144_288 + 12 * 64 * 48


# one path per family here (every path: test_attention.py and test_gpt.py)
@pytest.mark.parametrize("impl", ["xla"])
def test_packed_documents_equal_documents_alone(impl):
    # local (window 8) and global layers; RoPE restarts at each document
    model = Gemma(TINY.replace(attention_impl=impl, max_len=32))
    params = init_params(model, jax.random.PRNGKey(1))

    def fn(params, inputs):
        ids, seg, pos, mask = inputs["tokens"]
        return model.apply({"params": params}, ids, mask, position_ids=pos, segment_ids=seg)

    assert_packed_like_alone(fn, params, {"tokens": (10, 4)}, TINY.vocab_size)
    with pytest.raises(UserError, match="not for decode=True"):
        model.apply({"params": params}, jnp.ones((1, 4), jnp.int32),
                    segment_ids=jnp.ones((1, 4), jnp.int32), decode=True, mutable=["cache"])
