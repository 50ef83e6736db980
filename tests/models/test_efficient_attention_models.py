"""The efficient-attention options of GPT, BERT and ViT (``attention_window``,
``attention_sparsity``, ``attention="linear"``): the block paths equal the reference inside
the models, decoding with a window's ring cache or linear attention's state gives the tokens
of a recomputation without cache, padding leaves linear BERT's real tokens alone, and the
FLOP counts follow the reach. fp32, ``TOL`` = 1e-5, matmul precision "highest".
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decode import generate
from transformer_jax.errors import UserError
from transformer_jax.models import Bert, BertConfig, GPT, GPTConfig, ViT, ViTConfig
from transformer_jax.models.gpt import init_params

TOL = 1e-5


@pytest.fixture(autouse=True)
def _highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _logits(model_cls, cfg, inputs, impl, params=None):
    model = model_cls(cfg.replace(attention_impl=impl))
    params = params or jax.jit(model.init)(jax.random.PRNGKey(0), *inputs)["params"]
    return jax.jit(model.apply)({"params": params}, *inputs), params


@pytest.mark.parametrize("family,options", [
    ("gpt", dict(attention_window=8)), ("gpt", dict(attention_sparsity="fixed:8:2")),
    ("bert", dict(attention_window=6)), ("vit", dict(attention_sparsity="strided:5")),
])
def test_block_path_equals_the_reference_inside_the_model(family, options):
    """Sequences longer than the window/stride: the chunked path (the pattern inside its
    tiles; the block skipping itself is tested in tests/layers/test_efficient_attention.py)
    equals xla with the pattern as a mask, and the pattern changes the logits."""
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 40), 0, 500)
    if family == "gpt":
        cls, cfg, inputs = GPT, GPTConfig.preset("llama-tiny", **options), (ids,)
    elif family == "bert":
        cls, cfg = Bert, BertConfig.preset("tiny", head="mlm", dropout_rate=0.0,
                                           attention_dropout_rate=0.0, **options)
        inputs = (ids, None, (jnp.arange(40)[None] < jnp.array([[40], [29]])).astype(jnp.int32))
    else:
        cls, cfg = ViT, ViTConfig.preset("tiny", num_classes=0, image_size=32, **options)  # features
        inputs = (jax.random.normal(jax.random.PRNGKey(2), (2, 32, 32, 3)),)
    want, params = _logits(cls, cfg, inputs, "xla")
    got, _ = _logits(cls, cfg, inputs, "chunked", params)
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    full, _ = _logits(cls, cfg.replace(attention_window=None, attention_sparsity=None), inputs,
                      "xla", params)
    assert float(jnp.max(jnp.abs(full - want))) > 1e-3      # the pattern does change them


def _greedy_without_cache(model, params, prompt, steps):
    """Greedy decoding by recomputing the whole sequence: one jitted call on the final
    length, whose causal logits at position i see only tokens <= i."""
    t0 = prompt.shape[1]
    seq = jnp.pad(prompt, ((0, 0), (0, steps)))
    logits = jax.jit(lambda ids: model.apply({"params": params}, ids))
    for i in range(t0, t0 + steps):
        seq = seq.at[:, i].set(jnp.argmax(logits(seq)[:, i - 1], axis=-1).astype(seq.dtype))
    return seq


@pytest.mark.parametrize("options", [dict(attention_window=6),
                                     dict(attention="linear", attention_dropout_rate=0.0)])
def test_gpt_greedy_decoding_matches_recomputation(options):
    """A 10-token prompt and 14 new tokens (past the window of 6): ``decode.generate`` with
    the window's ring of 6 slots (or linear attention's state) picks the tokens that
    recomputing the whole sequence at every step picks."""
    cfg = GPTConfig.preset("llama-tiny", **options)
    model = GPT(cfg)
    params = init_params(model, jax.random.PRNGKey(0))
    prompt = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 0, cfg.vocab_size)
    got = generate(model, params, prompt, max_new_tokens=14)
    np.testing.assert_array_equal(got, _greedy_without_cache(model, params, prompt, 14))


def test_a_window_over_rope_decodes_past_max_len():
    """max_len 16, a window of 6, RoPE: a 10-token prompt and 20 new tokens (30 > 16) are the
    tokens that the same weights pick recomputing the whole sequence (max_len raised to 64:
    RoPE has no table, so the parameters are the same)."""
    cfg = GPTConfig.preset("llama-tiny", attention_window=6, max_len=16)
    model = GPT(cfg)
    params = init_params(model, jax.random.PRNGKey(0))
    prompt = jax.random.randint(jax.random.PRNGKey(3), (2, 10), 0, cfg.vocab_size)
    got = generate(model, params, prompt, max_new_tokens=20)
    assert got.shape == (2, 30)
    np.testing.assert_array_equal(got, _greedy_without_cache(GPT(cfg.replace(max_len=64)), params,
                                                             prompt, 20))
    with pytest.raises(UserError, match="exceeds the model's max_len=16"):   # no window: refused
        generate(GPT(cfg.replace(attention_window=None)), params, prompt, max_new_tokens=20)


def test_linear_bert_ignores_padding():
    """Linear attention takes the key-padding mask: the real tokens' outputs do not change
    when padding is appended."""
    cfg = BertConfig.preset("tiny", head="mlm", attention="linear", dropout_rate=0.0,
                            attention_dropout_rate=0.0)
    model = Bert(cfg)
    ids = jax.random.randint(jax.random.PRNGKey(1), (1, 12), 5, 500)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), ids)["params"]
    apply = jax.jit(model.apply)
    short = apply({"params": params}, ids, None, jnp.ones((1, 12), jnp.int32))
    padded = jnp.concatenate([ids, jnp.zeros((1, 6), ids.dtype)], axis=1)
    mask = (jnp.arange(18) < 12).astype(jnp.int32)[None]
    long = apply({"params": params}, padded, None, mask)
    np.testing.assert_allclose(long[:, :12], short, rtol=TOL, atol=TOL)


def test_flops_follow_the_attention_reach():
    """6 N + 12 L D x (keys per query): T, the window W, or the head dim for linear."""
    base = GPTConfig.preset("gpt2")
    dense = 6 * (base.num_params(non_embedding=True) + base.vocab_size * base.d_model)
    per_key = 12 * base.num_layers * base.d_model
    assert base.flops_per_token(1024) == dense + per_key * 1024
    assert base.replace(attention_window=256).flops_per_token(1024) == dense + per_key * 256
    linear = base.replace(attention="linear", attention_dropout_rate=0.0)
    assert linear.flops_per_token(1024) == dense + per_key * 64
    strided = base.replace(attention_sparsity="strided:32")
    assert strided.flops_per_token(1024) == dense + per_key * (32 + 1024 / 32)


def test_hf_export_refuses_what_the_checkpoint_cannot_express():
    """GPT-2, BERT and ViT checkpoints run full softmax attention: a window, a sparse
    pattern or linear attention is named in the error (a Llama layout with a window goes
    to Mistral, tests/interop/test_hf_mistral.py)."""
    from transformer_jax.errors import UserError
    from transformer_jax.interop.hf import hf_config
    with pytest.raises(UserError, match=r"not expressible as GPT-2: attention_window=64 \(a "
                                        r"sliding window: only the Mistral layout has one\)"):
        hf_config(GPTConfig.preset("tiny", attention_window=64))
    with pytest.raises(UserError, match=r"BertConfig option\(s\) not expressible as BERT: "
                                        r"attention='linear' \(HF runs softmax attention\)"):
        hf_config(BertConfig.preset("tiny", attention="linear", attention_dropout_rate=0.0))
    with pytest.raises(UserError, match=r"not expressible as ViT: attention_sparsity='strided:4'"):
        hf_config(ViTConfig.preset("tiny", attention_sparsity="strided:4"))


def test_long_context_experiment_takes_the_paths_its_docstring_names():
    """experiments/long_context_stdlib.py: full attention on the reference at T = 2,048 on
    the CPU (the chunked path at 8,192), the window on the block-skipping chunked path,
    linear attention on its own; the --set overrides of its docstring give the variants."""
    from transformer_jax.models.base import attention_plan
    from transformer_jax.train.config import apply_overrides, load_experiment

    base = load_experiment("long_context_stdlib")
    assert base.seq_len == 2048
    plans = {}
    for name, sets in (("full", []), ("window", ["model.attention_window=256"]),
                       ("linear", ["model.attention=linear"])):
        cfg = apply_overrides(base, sets)
        config = GPTConfig.preset(cfg.model_preset, **cfg.model_overrides)
        plans[name] = [attention_plan(config, t, "cpu")["train"] for t in (2048, 8192)]
    assert plans == {"full": ["xla", "chunked"], "window": ["chunked", "chunked"],
                     "linear": ["linear", "linear"]}
