"""Llama parity with Hugging Face ``transformers`` (PyTorch), through ``interop.hf``.

Two tiny random ``LlamaForCausalLM``s, both with grouped-query attention: an untied one
(4 query heads on 2 key/value heads) and a tied one (4 on 1), with a non-default
``rope_theta``; weights moved off HF's init (``conftest.perturbed``) so that every mapping
of the conversion table is exercised.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf, hf_config
from transformer_jax.interop.common import ConversionError
from transformer_jax.interop.hf import from_hf_state_dict, to_hf_numpy
from transformer_jax.interop.hf.llama import (llama_config_from_hf, llama_hf_config,
                                               llama_to_state_dict)
from transformer_jax.interop.hf.registry import family_for_config
from transformer_jax.models.bert import BertConfig
from transformer_jax.models.gpt import GPT, GPTConfig

from .conftest import (ATOL, RTOL, abstract_param_count, assert_aligned_greedy_matches_hf,
                       assert_gradients_match, assert_same_leaves, meta_param_count,
                       assert_left_padded_greedy_matches_hf, assert_strict_round_trip,
                       lm_gradients, perturbed, run_without_torch, state_dict, torch,
                       transformers)

LLAMA_TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
VOCAB = LLAMA_TINY["vocab_size"]
LLAMA_PRESETS = ["llama-tiny", "llama-2-7b", "tinyllama-1.1b", "llama-3.2-1b"]


def llama_model(seed: int = 0, **overrides):
    """A random ``LlamaForCausalLM`` (``LLAMA_TINY`` with ``overrides``)."""
    config = transformers.LlamaConfig(**{**LLAMA_TINY, **overrides})
    return perturbed(lambda: transformers.LlamaForCausalLM(config), seed)


def hf_logits(model, ids, mask=None, positions=None) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids), dtype=torch.long),
                    attention_mask=None if mask is None else torch.as_tensor(np.asarray(mask)),
                    position_ids=None if positions is None else torch.as_tensor(np.asarray(positions)))
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


def our_logits(module, params, ids, mask=None, positions=None) -> np.ndarray:
    return np.asarray(module.apply({"params": params}, jnp.asarray(ids), attention_mask=mask,
                                   position_ids=positions))


def random_ids(seed, shape, vocab=VOCAB):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@pytest.fixture(scope="module")
def untied():
    """(hf_model, module, params): 4 query heads on 2 kv heads, separate lm_head."""
    model = llama_model(seed=0)
    return (model, *from_hf(model))


@pytest.fixture(scope="module")
def tied():
    """(hf_model, module, params): 4 query heads on 1 kv head, lm_head = embed_tokens."""
    model = llama_model(seed=1, num_key_value_heads=1, tie_word_embeddings=True)
    return (model, *from_hf(model))


@pytest.fixture(params=["untied", "tied"])
def llama(request):
    return request.getfixturevalue(request.param)


# ----------------------------------------------------------------------------- config

def test_config_mapping(untied, tied):
    hf_model, module, params = untied
    cfg = module.config
    assert (cfg.vocab_size, cfg.d_model, cfg.mlp_dim, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.max_len) == (101, 64, 88, 2, 4, 2, 64)
    assert (cfg.position, cfg.norm, cfg.gated_mlp, cfg.activation, cfg.use_bias) == (
        "rope", "rmsnorm", True, "silu", False)
    assert (cfg.rope_base, cfg.norm_eps, cfg.tie_embeddings, cfg.dropout_rate) == (500.0, 1e-5, False, 0.0)
    assert params["lm_head"]["kernel"].shape == (64, 101) and "wpe" not in params
    assert tied[1].config.tie_embeddings and tied[1].config.num_kv_heads == 1
    assert "lm_head" not in tied[2]
    back = hf_config(cfg)
    assert type(back) is transformers.LlamaConfig
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings", "hidden_act", "head_dim",
                 "attention_bias", "mlp_bias", "rope_parameters"):
        assert getattr(back, name) == getattr(hf_model.config, name), name
    assert back.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}


def test_old_style_config_dict_uses_llama_defaults():
    """A transformers 4.x config.json: ``rope_theta`` at top level, ``rope_scaling`` null,
    no ``num_key_value_heads``/``tie_word_embeddings`` (HF's defaults: MHA, untied)."""
    cfg = llama_config_from_hf({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                                "intermediate_size": 88, "num_hidden_layers": 2, "vocab_size": 50,
                                "rope_theta": 1e6, "rope_scaling": None})
    assert (cfg.rope_base, cfg.tie_embeddings, cfg.num_kv_heads, cfg.norm_eps, cfg.max_len) == (
        1e6, False, None, 1e-6, 2048)
    assert llama_config_from_hf({"model_type": "llama", "hidden_size": 64,
                                 "num_attention_heads": 4}).rope_base == 10000.0


def test_dispatch_on_gpt_config_settings():
    """GPTConfig is GPT-2's and Llama's: the settings pick the family, in both helpers."""
    assert family_for_config(GPTConfig.preset("llama-tiny")).name == "llama"
    assert family_for_config(GPTConfig.preset("tiny")).name == "gpt2"
    assert family_for_config(BertConfig.preset("tiny")).name == "bert"
    assert type(hf_config(GPTConfig.preset("tiny"))) is transformers.GPT2Config
    llama = hf_config(GPTConfig.preset("llama-tiny"), bos_token_id=None)
    assert type(llama) is transformers.LlamaConfig and llama.bos_token_id is None
    assert (llama.num_key_value_heads, llama.intermediate_size) == (2, 176)
    # Neither family: GPT-2's refusal, unchanged; the Llama converter names its reasons.
    near = GPTConfig.preset("llama-tiny", use_bias=True)
    with pytest.raises(UserError, match="not expressible as GPT-2"):
        hf_config(near)
    with pytest.raises(UserError, match=r"not expressible as Llama: use_bias=True"):
        llama_hf_config(near)
    with pytest.raises(TypeError, match="no Hugging Face converter for config type int"):
        hf_config(3)


@pytest.mark.parametrize("name", LLAMA_PRESETS)
def test_parameter_counts_match_hf(name):
    cfg = GPTConfig.preset(name)
    hf_count = meta_param_count(lambda: transformers.LlamaForCausalLM(hf_config(cfg)))
    ours = abstract_param_count(lambda: GPT(cfg).init(jax.random.PRNGKey(0),
                                                      jnp.zeros((1, 1), jnp.int32)))
    assert cfg.num_params() == ours == hf_count
    published = {"llama-tiny": 158_016, "llama-2-7b": 6_738_415_616,
                 "tinyllama-1.1b": 1_100_048_384, "llama-3.2-1b": 1_235_814_400}
    assert hf_count == published[name]
    assert (cfg.dropout_rate, cfg.attention_dropout_rate) == (0.0, 0.0)
    # FLOPs count the V x D read-out matmul once, and never the (untied) embedding lookup.
    n = cfg.num_params(non_embedding=True) + cfg.vocab_size * cfg.d_model
    assert n == cfg.num_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model)
    assert cfg.flops_per_token(128) == 6 * n + 12 * cfg.num_layers * cfg.d_model * 128


# ----------------------------------------------------------------------------- logits

@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_parity_with_padding(llama, side):
    hf_model, module, params = llama
    ids = random_ids(1, (3, 12))
    lengths = np.array([12, 7, 3])
    cols = np.arange(12)[None, :]
    valid = cols < lengths[:, None] if side == "right" else cols >= 12 - lengths[:, None]
    mask = valid.astype(np.int32)
    # HF's forward uses positions 0..T-1 whatever the mask (so do we); HF's generate
    # counts real tokens only. Check both.
    gen_positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    for positions in (None, gen_positions):
        ours = our_logits(module, params, ids, mask, positions)
        theirs = hf_logits(hf_model, ids, mask, positions)
        assert np.abs(theirs[valid]).max() > 1.0          # not a vacuous comparison
        np.testing.assert_allclose(ours[valid], theirs[valid], rtol=RTOL, atol=ATOL)


def test_llama_model_base_converts(tied):
    """``LlamaModel`` has no ``model.`` prefix and no head; logits use the tied embedding."""
    hf_model, _, params = tied
    module, base_params = from_hf(hf_model.model)
    assert module.config.tie_embeddings and "lm_head" not in base_params
    ids = random_ids(3, (2, 8))
    np.testing.assert_allclose(our_logits(module, base_params, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- gradients

def test_gradient_parity(llama):
    hf_model, module, params = llama
    jax_grads, mapped, torch_grads = lm_gradients(module, params, hf_model, random_ids(5, (2, 16)))
    assert assert_gradients_match(jax_grads, mapped, params) == len(jax.tree_util.tree_leaves(params))
    # A few leaves by name against HF's own .grad (kernels (in, out...) -> weights (out, in)).
    as_weight = lambda g: np.asarray(g).reshape(g.shape[0], -1).T  # noqa: E731
    named = {("h_0", "self_attn", "key", "kernel"): ("model.layers.0.self_attn.k_proj.weight", as_weight),
             ("h_1", "self_attn", "out", "kernel"): ("model.layers.1.self_attn.o_proj.weight",
                                                     lambda g: np.asarray(g).reshape(-1, g.shape[-1]).T),
             ("h_1", "mlp", "wi_0", "kernel"): ("model.layers.1.mlp.gate_proj.weight", as_weight),
             ("h_1", "norm2", "scale"): ("model.layers.1.post_attention_layernorm.weight", np.asarray),
             ("wte", "embedding"): ("model.embed_tokens.weight", np.asarray)}
    for path, (key, to_torch_layout) in named.items():
        ours = jax_grads
        for k in path:
            ours = ours[k]
        ours, theirs = to_torch_layout(ours), torch_grads[key].numpy()
        assert ours.shape == theirs.shape, key
        assert np.abs(theirs).max() > 1e-3, key
        assert np.abs(ours - theirs).max() < 1e-4, key


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(llama):
    hf_model, module, params = llama
    sd = assert_strict_round_trip(hf_model, module, params, transformers.LlamaForCausalLM,
                                  hf_logits, random_ids(6, (2, 11)))
    if module.config.tie_embeddings:
        assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]


def test_scan_layers_conversion(untied):
    hf_model, module, params = untied
    smod, sparams = from_hf(hf_model, scan_layers=True)
    assert smod.config.scan_layers and "h" in sparams and "h_0" not in sparams
    assert sparams["h"]["self_attn"]["key"]["kernel"].shape == (2, 64, 2, 16)
    assert sparams["h"]["mlp"]["wi_1"]["kernel"].shape == (2, 64, 88)
    ids = random_ids(7, (2, 10))
    np.testing.assert_allclose(our_logits(smod, sparams, ids), our_logits(module, params, ids),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(our_logits(smod, sparams, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)
    a, b = to_hf_numpy(smod, sparams), to_hf_numpy(module, params)
    assert set(a) == set(b) == set(hf_model.state_dict())
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    c = to_hf_numpy(module, sparams)          # either layout, whatever the config says
    for key in a:
        np.testing.assert_array_equal(c[key], a[key], err_msg=key)


def test_save_pretrained_dir(tied, tmp_path):
    hf_model, _, params = tied
    hf_model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    module, loaded = from_hf(tmp_path / "ckpt")
    assert module.config == tied[1].config
    assert_same_leaves(loaded, params)


def test_load_save_pretrained_dir_without_torch(untied, tmp_path):
    hf_model = untied[0]
    hf_model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    ids = random_ids(8, (2, 13))
    np.save(tmp_path / "ids.npy", ids)
    run_without_torch("""
        assert module.config.position == "rope" and not module.config.tie_embeddings
        ids = np.load(sys.argv[2])
        np.save(sys.argv[3], np.asarray(module.apply({"params": params}, ids)))
    """, tmp_path / "ckpt", tmp_path / "ids.npy", tmp_path / "out.npy")
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- generation

def test_greedy_generate_matches_hf(llama):
    hf_model, module, params = llama
    assert_aligned_greedy_matches_hf(hf_model, module, params, random_ids(9, (3, 8)), 20)


def test_greedy_generate_left_padded_matches_hf(untied):
    hf_model, module, params = untied
    prompts = [random_ids(10, (9,)).tolist(), random_ids(11, (4,)).tolist(),
               random_ids(12, (6,)).tolist()]
    assert_left_padded_greedy_matches_hf(hf_model, module, params, prompts, 16)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("option, value", [
    ("attention_bias", True),
    ("mlp_bias", True),
    ("pretraining_tp", 2),
    ("hidden_act", "gelu"),
    ("hidden_act", "quick_gelu"),
    ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}),
    ("rope_scaling", {"type": "linear", "factor": 2.0, "attention_factor": 0.5}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}),
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 500.0, "factor": 4.0}),
])
def test_unsupported_config_option_raises(untied, option, value):
    hf_model = untied[0]
    config = {**hf_model.config.to_dict(), option: value}
    with pytest.raises(UserError, match=rf"unsupported Llama config option {option}"):
        from_hf_state_dict(config, state_dict(hf_model))


def test_llama_3_2_config_json_converts_with_its_rope_scaling():
    """A Llama 3.2 1B config.json (transformers 4.45) reads as the llama-3.2-1b preset."""
    config = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
              "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": True, "head_dim": 64,
              "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}
    assert llama_config_from_hf(config) == GPTConfig.preset("llama-3.2-1b")


def test_bad_state_dicts_raise_naming_the_key(untied, tied):
    hf_model = untied[0]
    sd = state_dict(hf_model)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        from_hf_state_dict(hf_model.config, sd)
    sd = state_dict(hf_model)
    sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)     # MHA shape, not GQA
    with pytest.raises(ConversionError, match=r"k_proj\.weight.*\(64, 64\).*\(32, 64\)"):
        from_hf_state_dict(hf_model.config, sd)
    sd = dict(state_dict(hf_model), **{"model.layers.0.extra": torch.zeros(2)})
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.extra"):
        from_hf_state_dict(hf_model.config, sd)
    tied_model = tied[0]
    sd = state_dict(tied_model)
    sd["lm_head.weight"] = sd["lm_head.weight"].clone() + 1
    with pytest.raises(ConversionError, match="lm_head.weight"):
        from_hf_state_dict(tied_model.config, sd)


def test_legacy_inv_freq_buffers_are_checked_and_dropped(untied):
    hf_model, _, params = untied
    sd = state_dict(hf_model)
    inv_freq = 1.0 / (500.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    for i in range(2):
        sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = inv_freq
    _, loaded = from_hf_state_dict(hf_model.config, sd)
    np.testing.assert_array_equal(np.asarray(loaded["h_1"]["self_attn"]["key"]["kernel"]),
                                  np.asarray(params["h_1"]["self_attn"]["key"]["kernel"]))
    sd["model.layers.1.self_attn.rotary_emb.inv_freq"] = inv_freq / 4       # a scaled RoPE
    with pytest.raises(ConversionError, match=r"layers\.1\.self_attn\.rotary_emb\.inv_freq"):
        from_hf_state_dict(hf_model.config, sd)


def test_to_hf_rejects_non_llama_module(untied):
    _, module, params = untied
    cfg = module.config.replace(gated_mlp=False)
    with pytest.raises(UserError, match="gated_mlp=False"):
        llama_hf_config(cfg)
    with pytest.raises(UserError, match="gated_mlp=False"):
        llama_to_state_dict(GPT(cfg), params)
