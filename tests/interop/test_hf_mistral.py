"""Mistral parity with Hugging Face ``transformers`` (PyTorch), through ``interop.hf``.

A tiny random ``MistralForCausalLM`` (4 query heads on 2 key/value heads, untied, a
non-default ``rope_theta``) with ``sliding_window`` 8, run on sequences of 24 and more
tokens, so that the window cuts into every row past the eighth token: logits, gradients,
greedy decoding (the ring of W cache slots) and the round trip. Measured (fp32, "highest"
matmuls): logits differ by <= 2.3e-6, gradients by <= 2.4e-7 (|grad| up to 0.37).
"""
import jax
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf, hf_config, to_hf
from transformer_jax.interop.hf import from_hf_state_dict
from transformer_jax.interop.hf.llama import llama_hf_config
from transformer_jax.interop.hf.mistral import mistral_config_from_hf, mistral_hf_config
from transformer_jax.interop.hf.registry import family_for_config
from transformer_jax.models.gpt import GPT, GPTConfig

from .conftest import (ATOL, RTOL, assert_aligned_greedy_matches_hf, assert_gradients_match,
                       assert_left_padded_greedy_matches_hf, assert_strict_round_trip,
                       lm_gradients, meta_param_count, perturbed, state_dict, transformers)
from .test_hf_llama import hf_logits, our_logits, random_ids

WINDOW = 8
MISTRAL_TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                    rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=False,
                    sliding_window=WINDOW, bos_token_id=None, eos_token_id=None,
                    pad_token_id=None)


def mistral_model(seed: int = 0, **overrides):
    """A random ``MistralForCausalLM`` (``MISTRAL_TINY`` with ``overrides``)."""
    config = transformers.MistralConfig(**{**MISTRAL_TINY, **overrides})
    return perturbed(lambda: transformers.MistralForCausalLM(config), seed)


@pytest.fixture(scope="module")
def mistral():
    """(hf_model, module, params): window 8, 4 query heads on 2 kv heads, separate lm_head."""
    model = mistral_model(seed=0)
    return (model, *from_hf(model))


# ----------------------------------------------------------------------------- config

def test_config_mapping_and_dispatch(mistral):
    hf_model, module, params = mistral
    cfg = module.config
    assert (cfg.vocab_size, cfg.d_model, cfg.mlp_dim, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.max_len, cfg.attention_window) == (101, 64, 88, 2, 4, 2, 64, 8)
    assert (cfg.position, cfg.norm, cfg.gated_mlp, cfg.activation, cfg.use_bias) == (
        "rope", "rmsnorm", True, "silu", False)
    assert (cfg.rope_base, cfg.norm_eps, cfg.tie_embeddings, cfg.dropout_rate) == (500.0, 1e-5, False, 0.0)
    assert "lm_head" in params and "wpe" not in params
    back = hf_config(cfg)
    assert type(back) is transformers.MistralConfig and back.sliding_window == WINDOW
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings", "hidden_act", "head_dim",
                 "rope_parameters", "sliding_window"):
        assert getattr(back, name) == getattr(hf_model.config, name), name
    # Llama's layout picks the family by the window; GPT-2's stays GPT-2.
    assert family_for_config(cfg).name == "mistral"
    assert family_for_config(GPTConfig.preset("mistral-tiny")).name == "mistral"
    assert family_for_config(GPTConfig.preset("llama-tiny")).name == "llama"
    assert family_for_config(GPTConfig.preset("tiny")).name == "gpt2"
    assert type(hf_config(cfg.replace(attention_window=None))) is transformers.LlamaConfig


def test_hand_written_config_uses_mistral_defaults():
    """Keys a config.json leaves out take MistralConfig's defaults (not Llama's)."""
    cfg = mistral_config_from_hf({"model_type": "mistral", "hidden_size": 64,
                                  "num_attention_heads": 8, "vocab_size": 50})
    assert (cfg.attention_window, cfg.num_kv_heads, cfg.mlp_dim, cfg.max_len, cfg.norm_eps,
            cfg.rope_base, cfg.tie_embeddings) == (4096, 8, 14336, 131072, 1e-6, 1e4, False)
    # Mistral v0.2+ (transformers 4.x config.json): sliding_window null, rope_theta 1e6.
    cfg = mistral_config_from_hf({"model_type": "mistral", "hidden_size": 64,
                                  "num_attention_heads": 8, "sliding_window": None,
                                  "rope_theta": 1e6, "rope_scaling": None})
    assert (cfg.attention_window, cfg.rope_base) == (None, 1e6)


@pytest.mark.parametrize("name", ["mistral-tiny", "mistral-7b"])
def test_parameter_counts_match_hf(name):
    cfg = GPTConfig.preset(name)
    hf_cfg = hf_config(cfg)
    assert type(hf_cfg) is transformers.MistralConfig
    assert hf_cfg.sliding_window == cfg.attention_window
    hf_count = meta_param_count(lambda: transformers.MistralForCausalLM(hf_cfg))
    assert cfg.num_params() == hf_count == {"mistral-tiny": 158_016,
                                            "mistral-7b": 7_241_732_096}[name]
    if name == "mistral-7b":       # Mistral-7B-v0.1's config.json
        assert (hf_cfg.vocab_size, hf_cfg.num_hidden_layers, hf_cfg.hidden_size,
                hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads, hf_cfg.intermediate_size,
                hf_cfg.sliding_window, hf_cfg.max_position_embeddings, hf_cfg.rms_norm_eps,
                hf_cfg.rope_parameters["rope_theta"], hf_cfg.tie_word_embeddings) == (
            32000, 32, 4096, 32, 8, 14336, 4096, 32768, 1e-5, 10000.0, False)


# ----------------------------------------------------------------------------- logits

@pytest.mark.parametrize("side", ["none", "right", "left"])
def test_logits_parity_past_the_window(mistral, side):
    """T = 24 > W = 8; the same weights without the window are far off (it is exercised)."""
    hf_model, module, params = mistral
    t = 24
    ids = random_ids(1, (3, t))
    lengths = np.array([t, 17, 5]) if side != "none" else np.array([t] * 3)
    cols = np.arange(t)[None, :]
    valid = cols < lengths[:, None] if side != "left" else cols >= t - lengths[:, None]
    mask = None if side == "none" else valid.astype(np.int32)
    ours = our_logits(module, params, ids, mask)
    theirs = hf_logits(hf_model, ids, mask)
    assert np.abs(theirs[valid]).max() > 1.0
    np.testing.assert_allclose(ours[valid], theirs[valid], rtol=RTOL, atol=ATOL)
    if side == "none":        # the window cuts in after W tokens, and matters there
        full = our_logits(GPT(module.config.replace(attention_window=None)), params, ids)
        np.testing.assert_allclose(full[:, :WINDOW], theirs[:, :WINDOW], rtol=RTOL, atol=ATOL)
        assert np.abs(full[:, WINDOW:] - theirs[:, WINDOW:]).max() > 1e-2
        for w in (WINDOW - 1, WINDOW + 1):     # HF's W counts the token itself: no off-by-one
            other = our_logits(GPT(module.config.replace(attention_window=w)), params, ids)
            assert np.abs(other - theirs).max() > 1e-2, w
    print(f"Mistral logits ({side} padding): max |ours - HF| = "
          f"{np.abs(ours[valid] - theirs[valid]).max():.2e}")


def test_gradient_parity(mistral):
    hf_model, module, params = mistral
    jax_grads, mapped, _ = lm_gradients(module, params, hf_model, random_ids(5, (2, 24)))
    assert assert_gradients_match(jax_grads, mapped, params) == len(jax.tree_util.tree_leaves(params))


# ----------------------------------------------------------------------------- generation

def test_greedy_generate_past_the_window_matches_hf(mistral):
    """Prompt 8 + 20 new tokens: decoding runs 20 steps over the ring of W = 8 slots."""
    hf_model, module, params = mistral
    assert_aligned_greedy_matches_hf(hf_model, module, params, random_ids(9, (3, 8)), 20)


def test_greedy_generate_left_padded_matches_hf(mistral):
    """Prompts of 13, 4 and 6 tokens (one longer than the window), 16 new tokens."""
    hf_model, module, params = mistral
    prompts = [random_ids(10, (13,)).tolist(), random_ids(11, (4,)).tolist(),
               random_ids(12, (6,)).tolist()]
    assert_left_padded_greedy_matches_hf(hf_model, module, params, prompts, 16)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(mistral):
    hf_model, module, params = mistral
    assert_strict_round_trip(hf_model, module, params, transformers.MistralForCausalLM,
                             hf_logits, random_ids(6, (2, 24)))


def test_exported_dir_is_a_mistral(mistral, tmp_path):
    """``export --format hf``'s writer: config.json says mistral with the window,
    ``AutoModelForCausalLM`` loads it, and ``from_hf`` reads it back unchanged."""
    from transformer_jax.export import write_hf

    hf_model, module, params = mistral
    write_hf(module, params, str(tmp_path))
    auto = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (auto.model_type, auto.sliding_window, auto.architectures) == (
        "mistral", WINDOW, ["MistralForCausalLM"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is transformers.MistralForCausalLM
    ids = random_ids(7, (2, 24))
    np.testing.assert_allclose(hf_logits(loaded, ids), hf_logits(hf_model, ids), rtol=0, atol=0)
    back, back_params = from_hf(tmp_path, scan_layers=True)
    assert back.config == module.config.replace(scan_layers=True)
    np.testing.assert_allclose(our_logits(back, back_params, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)


def test_null_sliding_window_is_full_attention():
    """``sliding_window: null``: attention_window None, logits match HF's full attention,
    and to_hf writes it back as a Llama (the same model)."""
    hf_model = mistral_model(seed=2, sliding_window=None, num_key_value_heads=1,
                             tie_word_embeddings=True)
    module, params = from_hf(hf_model)
    assert module.config.attention_window is None and module.config.tie_embeddings
    ids = random_ids(3, (2, 24))
    np.testing.assert_allclose(our_logits(module, params, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)
    assert type(hf_config(module.config)) is transformers.LlamaConfig
    llama = transformers.LlamaForCausalLM(hf_config(module.config)).eval()
    llama.load_state_dict(to_hf(module, params), strict=True)
    np.testing.assert_allclose(hf_logits(llama, ids), hf_logits(hf_model, ids), rtol=RTOL,
                               atol=ATOL)
    assert mistral_hf_config(module.config).sliding_window is None     # asked for explicitly


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("option, value, match", [
    ("hidden_act", "gelu", "Mistral config option hidden_act"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0},
     "Mistral config option rope_parameters with rope_type='yarn'"),
    ("sliding_window", 0, "Mistral config option sliding_window=0"),
    ("layer_types", ["sliding_attention", "full_attention"], "Mistral config option layer_types"),
])
def test_unsupported_config_option_raises(mistral, option, value, match):
    hf_model = mistral[0]
    config = {**hf_model.config.to_dict(), option: value}
    with pytest.raises(UserError, match=match):
        from_hf_state_dict(config, state_dict(hf_model))


def test_to_hf_refuses_what_hf_cannot_express():
    """Llama/Mistral run full softmax attention, over a window for Mistral only."""
    with pytest.raises(UserError, match=r"not expressible as Llama: attention_window=16"):
        llama_hf_config(GPTConfig.preset("mistral-tiny"))
    with pytest.raises(UserError, match=r"not expressible as Llama: attention_sparsity='strided:4'"):
        hf_config(GPTConfig.preset("llama-tiny", attention_sparsity="strided:4"))
    with pytest.raises(UserError, match=r"not expressible as Llama: attention='linear'"):
        hf_config(GPTConfig.preset("llama-tiny", attention="linear"))
    with pytest.raises(UserError, match=r"not expressible as Mistral: use_bias=True"):
        mistral_hf_config(GPTConfig.preset("mistral-tiny", use_bias=True))
