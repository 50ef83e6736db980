"""GPT-2 parity with Hugging Face ``transformers`` (PyTorch), through ``interop.hf``.

The HF models and tolerances come from ``conftest.py`` (random weights moved off HF's init,
so that every mapping in the conversion table is exercised).
"""
import copy
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decode import generate
from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf, hf_config, to_hf
from transformer_jax.interop.common import ConversionError
from transformer_jax.interop.hf import from_hf_state_dict, to_hf_numpy
from transformer_jax.models.gpt import GPT, GPTConfig

from .conftest import (ATOL, GPT2_TINY, RTOL, abstract_param_count, assert_gradients_match,
                       assert_same_leaves, meta_param_count,
                       assert_left_padded_greedy_matches_hf, assert_strict_round_trip,
                       gpt2_model, hf_generate, lm_gradients, run_without_torch, state_dict,
                       torch, transformers)


def hf_logits(model, ids, mask=None, positions=None) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(ids), dtype=torch.long),
                    attention_mask=None if mask is None else torch.as_tensor(np.asarray(mask)),
                    position_ids=None if positions is None else torch.as_tensor(np.asarray(positions)))
    return out.logits.numpy()


def our_logits(module, params, ids, mask=None, positions=None) -> np.ndarray:
    return np.asarray(module.apply({"params": params}, jnp.asarray(ids), attention_mask=mask,
                                   position_ids=positions))


@pytest.fixture(scope="module")
def hf_model():
    return gpt2_model()


@pytest.fixture(scope="module")
def converted(hf_model):
    return from_hf(hf_model)


def random_ids(seed, shape, vocab=GPT2_TINY["vocab_size"]):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


# ----------------------------------------------------------------------------- logits

def test_config_mapping(hf_model, converted):
    module, _ = converted
    cfg = module.config
    assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.vocab_size, cfg.max_len) == (64, 2, 4, 101, 64)
    assert cfg.activation == "gelu_tanh" and cfg.tie_embeddings and cfg.norm_eps == 1e-5
    assert (cfg.dropout_rate, cfg.attention_dropout_rate) == (0.1, 0.1)
    back = hf_config(cfg)
    for name in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions", "layer_norm_epsilon",
                 "activation_function", "tie_word_embeddings", "resid_pdrop", "attn_pdrop"):
        assert getattr(back, name) == getattr(hf_model.config, name), name


def test_logits_parity(hf_model, converted):
    ids = random_ids(0, (3, 17))
    np.testing.assert_allclose(our_logits(*converted, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_parity_with_padding(hf_model, converted, side):
    ids = random_ids(1, (3, 12))
    lengths = np.array([12, 7, 3])
    cols = np.arange(12)[None, :]
    valid = cols < lengths[:, None] if side == "right" else cols >= 12 - lengths[:, None]
    mask = valid.astype(np.int32)
    # HF's forward uses positions 0..T-1 whatever the mask (so do we); HF's generate
    # instead counts real tokens only. Check both.
    gen_positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    for positions in (None, gen_positions):
        ours = our_logits(*converted, ids, mask, positions)
        theirs = hf_logits(hf_model, ids, mask, positions)
        np.testing.assert_allclose(ours[valid], theirs[valid], rtol=RTOL, atol=ATOL)


def test_untied_lm_head_parity():
    model = gpt2_model(seed=3, tie_word_embeddings=False)
    module, params = from_hf(model)
    assert not module.config.tie_embeddings and params["lm_head"]["kernel"].shape == (64, 101)
    ids = random_ids(2, (2, 9))
    np.testing.assert_allclose(our_logits(module, params, ids), hf_logits(model, ids),
                               rtol=RTOL, atol=ATOL)
    fresh = transformers.GPT2LMHeadModel(hf_config(module.config)).eval()
    fresh.load_state_dict(to_hf(module, params), strict=True)
    np.testing.assert_array_equal(hf_logits(fresh, ids), hf_logits(model, ids))


def test_gpt2_base_model_converts():
    """``GPT2Model`` has no ``transformer.`` prefix and no head; logits use the tied wte."""
    lm = gpt2_model(seed=4)
    base = lm.transformer
    module, params = from_hf(base)
    ids = random_ids(3, (2, 8))
    np.testing.assert_allclose(our_logits(module, params, ids), hf_logits(lm, ids),
                               rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- gradients

def test_gradient_parity(hf_model, converted):
    module, params = converted
    jax_grads, mapped, _ = lm_gradients(module, params, hf_model, random_ids(5, (2, 16)))
    assert_gradients_match(jax_grads, mapped, params)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(hf_model, converted):
    module, params = converted
    assert_strict_round_trip(hf_model, module, params, transformers.GPT2LMHeadModel, hf_logits,
                             random_ids(6, (2, 11)))


def test_scan_layers_conversion(hf_model, converted):
    module, params = converted
    smod, sparams = from_hf(hf_model, scan_layers=True)
    assert smod.config.scan_layers and "h" in sparams and "h_0" not in sparams
    assert sparams["h"]["self_attn"]["query"]["kernel"].shape == (2, 64, 4, 16)
    ids = random_ids(7, (2, 10))
    np.testing.assert_allclose(our_logits(smod, sparams, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(our_logits(smod, sparams, ids), our_logits(module, params, ids),
                               rtol=RTOL, atol=ATOL)
    a, b = to_hf_numpy(smod, sparams), to_hf_numpy(module, params)
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # to_hf takes either layout, whatever the config says
    c = to_hf_numpy(module, sparams)
    for key in a:
        np.testing.assert_array_equal(c[key], a[key], err_msg=key)


def test_load_save_pretrained_dir_without_torch(hf_model, tmp_path):
    hf_model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    ids = random_ids(8, (2, 13))
    np.save(tmp_path / "ids.npy", ids)
    run_without_torch("""
        ids = np.load(sys.argv[2])
        np.save(sys.argv[3], np.asarray(module.apply({"params": params}, ids)))
    """, tmp_path / "ckpt", tmp_path / "ids.npy", tmp_path / "out.npy")
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)


def test_load_sharded_and_bf16_dirs(hf_model, converted, tmp_path):
    hf_model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    module, params = from_hf(tmp_path / "sharded")
    assert_same_leaves(params, converted[1])

    copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16",
                                                              safe_serialization=True)
    module, params = from_hf(tmp_path / "bf16")
    assert params["wte"]["embedding"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(params["wte"]["embedding"]),
                               np.asarray(converted[1]["wte"]["embedding"]), rtol=1e-2, atol=1e-2)


def test_import_does_not_import_torch():
    code = ("import sys, transformer_jax.interop as i, transformer_jax.interop.hf; i.from_hf; i.to_hf; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- generation

def test_greedy_generate_matches_hf(hf_model, converted):
    module, params = converted
    ids = random_ids(9, (3, 8))
    ours = np.asarray(generate(module, params, ids, max_new_tokens=20))
    theirs = hf_generate(hf_model, ids, np.ones_like(ids), 20)
    assert ours.shape == theirs.shape == (3, 28)
    np.testing.assert_array_equal(ours, theirs)


def test_greedy_generate_left_padded_matches_hf(hf_model, converted):
    module, params = converted
    prompts = [random_ids(10, (9,)).tolist(), random_ids(11, (4,)).tolist(),
               random_ids(12, (6,)).tolist()]
    assert_left_padded_greedy_matches_hf(hf_model, module, params, prompts, 20)


def test_greedy_generate_eos_matches_hf(hf_model, converted):
    module, params = converted
    ids = random_ids(13, (3, 8))
    free = hf_generate(hf_model, ids, np.ones_like(ids), 20)[:, 8:]
    eos = int(free[0, 4])                 # row 0 will stop at (or before) its 5th new token
    pad = next(t for t in range(101) if t != eos)
    theirs = hf_generate(hf_model, ids, np.ones_like(ids), 20, eos_id=eos, pad_id=pad)
    ours = np.asarray(generate(module, params, ids, max_new_tokens=20, eos_id=eos, pad_id=pad))
    # HF stops once every row has emitted eos; our output keeps its fixed length, padded.
    n = theirs.shape[1]
    np.testing.assert_array_equal(ours[:, :n], theirs)
    assert np.all(ours[:, n:] == pad)
    row0 = ours[0, 8:].tolist()
    first = row0.index(eos)
    assert first <= 4 and all(t == pad for t in row0[first + 1:])


# ----------------------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("name", ["tiny", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_parameter_counts_match_hf(name):
    cfg = GPTConfig.preset(name)
    hf_count = meta_param_count(lambda: transformers.GPT2LMHeadModel(hf_config(cfg)))
    ours = abstract_param_count(lambda: GPT(cfg).init(jax.random.PRNGKey(0),
                                                      jnp.zeros((1, 1), jnp.int32)))
    assert cfg.num_params() == ours == hf_count
    if name == "gpt2":
        assert hf_count == 124_439_808


# ----------------------------------------------------------------------------- bad input

def test_unknown_key_raises(hf_model):
    sd = state_dict(hf_model)
    sd["transformer.h.0.attn.rotary_inv_freq"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.rotary_inv_freq"):
        from_hf_state_dict(hf_model.config, sd)


def test_missing_key_raises(hf_model):
    sd = state_dict(hf_model)
    del sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.mlp\.c_fc\.bias"):
        from_hf_state_dict(hf_model.config, sd)


def test_wrong_shape_raises(hf_model):
    sd = state_dict(hf_model)
    sd["transformer.h.0.attn.c_attn.weight"] = torch.zeros(64, 190)
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.attn\.c_attn\.weight") as err:
        from_hf_state_dict(hf_model.config, sd)
    assert "190" in str(err.value) and "192" in str(err.value)


def test_legacy_mask_buffers_are_accepted_and_checked(hf_model, converted):
    sd = state_dict(hf_model)
    for i in range(2):
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64, dtype=torch.bool))[None, None]
        sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    _, params = from_hf_state_dict(hf_model.config, sd)
    np.testing.assert_array_equal(np.asarray(params["h_1"]["mlp"]["wo"]["kernel"]),
                                  np.asarray(converted[1]["h_1"]["mlp"]["wo"]["kernel"]))
    sd["transformer.h.1.attn.bias"] = torch.ones(1, 1, 32, 32, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.attn\.bias"):
        from_hf_state_dict(hf_model.config, sd)
    sd["transformer.h.1.attn.bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool)   # not causal
    with pytest.raises(ValueError, match=r"transformer\.h\.1\.attn\.bias.*lower-triangular"):
        from_hf_state_dict(hf_model.config, sd)


def test_untied_head_in_tied_config_raises(hf_model):
    sd = state_dict(hf_model)
    sd["lm_head.weight"] = sd["lm_head.weight"].clone() + 1
    with pytest.raises(ValueError, match="lm_head.weight"):
        from_hf_state_dict(hf_model.config, sd)


@pytest.mark.parametrize("option, value", [
    ("scale_attn_by_inverse_layer_idx", True),
    ("reorder_and_upcast_attn", True),
    ("add_cross_attention", True),
    ("scale_attn_weights", False),
    ("activation_function", "mish"),
])
def test_unsupported_config_option_raises(hf_model, option, value):
    config = {**hf_model.config.to_dict(), option: value}
    with pytest.raises(ValueError, match=option):
        from_hf_state_dict(config, state_dict(hf_model))


def test_unsupported_model_type_lists_supported(hf_model):
    config = {**hf_model.config.to_dict(), "model_type": "bloom"}
    with pytest.raises(ValueError, match=r"'bloom'.*gpt2"):
        from_hf_state_dict(config, state_dict(hf_model))


def test_conversion_errors_are_user_errors(hf_model):
    """Bad checkpoints and configs raise the project's UserError (a ValueError), naming the problem."""
    assert issubclass(ConversionError, UserError) and issubclass(UserError, ValueError)
    sd = dict(state_dict(hf_model), **{"transformer.h.0.extra": torch.zeros(2)})
    with pytest.raises(ConversionError, match=r"transformer\.h\.0\.extra"):
        from_hf_state_dict(hf_model.config, sd)
    with pytest.raises(UserError, match="bloom"):
        from_hf_state_dict({**hf_model.config.to_dict(), "model_type": "bloom"}, state_dict(hf_model))


def test_to_hf_rejects_non_gpt2_options(converted):
    _, params = converted
    cfg = GPTConfig.preset("tiny", position="rope", norm="rmsnorm")
    with pytest.raises(ValueError, match=r"norm='rmsnorm'.*position='rope'"):
        hf_config(cfg)
    with pytest.raises(ValueError, match="position"):
        to_hf(GPT(cfg), params)
