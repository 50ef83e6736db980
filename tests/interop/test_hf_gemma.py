"""Gemma 3 parity with Hugging Face ``transformers`` (PyTorch), through ``interop.hf``.

A tiny random ``Gemma3ForCausalLM``: 3 layers (local, local, global), ``sliding_window`` 8,
4 query heads on 2 key/value heads of ``head_dim`` 24 (not D / N = 16),
``query_pre_attn_scalar`` 20, linear RoPE scaling (factor 4) on the global layer, its own
RoPE bases per layer type, run on sequences of 24 and more tokens: logits, gradients,
greedy decoding (the local layers' ring of W cache slots), the round trips, the
multimodal checkpoint's text model, and the options refused by name.
"""
import jax
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf, hf_config, to_hf
from transformer_jax.interop.hf import from_hf_state_dict
from transformer_jax.interop.hf.gemma import gemma_config_from_hf
from transformer_jax.interop.hf.registry import family_for_config
from transformer_jax.models.gemma import Gemma, GemmaConfig

from .conftest import (RTOL, ATOL, assert_aligned_greedy_matches_hf, assert_gradients_match,
                       assert_left_padded_greedy_matches_hf, assert_strict_round_trip,
                       lm_gradients, meta_param_count, perturbed, state_dict, torch,
                       transformers)
from .test_hf_llama import hf_logits, our_logits, random_ids

WINDOW = 8
KINDS = ["sliding_attention", "sliding_attention", "full_attention"]
GEMMA3_TINY = dict(
    vocab_size=101, hidden_size=64, intermediate_size=88, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=64,
    sliding_window=WINDOW, layer_types=KINDS, query_pre_attn_scalar=20,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                        "rope_theta": 5000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def gemma_model(seed: int = 0, **overrides):
    """A random ``Gemma3ForCausalLM`` (``GEMMA3_TINY`` with ``overrides``)."""
    config = transformers.Gemma3TextConfig(**{**GEMMA3_TINY, **overrides})
    return perturbed(lambda: transformers.Gemma3ForCausalLM(config), seed)


@pytest.fixture(scope="module")
def gemma():
    """(hf_model, module, params) of the tiny Gemma 3 (tied embeddings)."""
    model = gemma_model(seed=0)
    return (model, *from_hf(model))


# ----------------------------------------------------------------------------- config

def test_config_mapping_and_dispatch(gemma):
    hf_model, module, params = gemma
    cfg = module.config
    assert (cfg.vocab_size, cfg.d_model, cfg.mlp_dim, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.max_len, cfg.sliding_window) == (
        101, 64, 88, 3, 4, 2, 24, 64, WINDOW)
    assert cfg.layer_kinds == ("local", "local", "global")
    assert (cfg.rope_base, cfg.rope_scaling.kind, cfg.rope_scaling.factor,
            cfg.rope_local_base) == (5000.0, "linear", 4.0, 100.0)
    assert (cfg.query_pre_attn_scalar, cfg.activation, cfg.tie_embeddings,
            cfg.final_logit_softcap) == (20.0, "gelu_tanh", True, None)
    assert "lm_head" not in params
    assert family_for_config(cfg).name == "gemma"
    back = hf_config(cfg)
    assert type(back) is transformers.Gemma3TextConfig
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim",
                 "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                 "hidden_activation", "query_pre_attn_scalar", "sliding_window", "layer_types",
                 "rope_parameters", "final_logit_softcapping", "attn_logit_softcapping"):
        assert getattr(back, name) == getattr(hf_model.config, name), name


def test_older_config_json_fields():
    """A transformers 4 config.json (the Hub's gemma-3-1b-pt: rope_theta, rope_local_base_freq,
    sliding_window_pattern, rope_scaling null; 4b's text_config: a linear rope_scaling and
    Gemma3TextConfig's defaults for what it leaves out)."""
    cfg = gemma_config_from_hf({
        "model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "head_dim": 256, "max_position_embeddings": 32768, "query_pre_attn_scalar": 256,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144,
        "attn_logit_softcapping": None, "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6})
    assert cfg == GemmaConfig.preset("gemma3-1b")
    cfg = gemma_config_from_hf({
        "model_type": "gemma3", "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}})
    assert cfg == GemmaConfig.preset("gemma3-4b")
    assert cfg.layer_kinds[:6] == ("local",) * 5 + ("global",)


@pytest.mark.parametrize("name, count", [("gemma3-tiny", 144_288), ("gemma3-1b", 999_885_952),
                                         ("gemma3-4b", 3_880_263_168),
                                         ("gemma3-12b", 11_766_034_176)])
def test_parameter_counts_match_hf(name, count):
    """HF's meta-device count of the preset's Gemma3ForCausalLM; 1B: the published
    999,885,952 parameters of google/gemma-3-1b-pt."""
    cfg = GemmaConfig.preset(name)
    hf_count = meta_param_count(lambda: transformers.Gemma3ForCausalLM(hf_config(cfg)))
    assert cfg.num_params() == hf_count == count


# ----------------------------------------------------------------------------- logits

@pytest.mark.parametrize("side", ["none", "right", "left"])
def test_logits_parity_past_the_window(gemma, side):
    """T = 24 > W = 8. Without padding: the window, the per-layer RoPE bases and the global
    layer's scaling each matter (changing any one is far off)."""
    hf_model, module, params = gemma
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
    if side == "none":
        for change in (dict(sliding_window=WINDOW + 1), dict(rope_local_base=5000.0),
                       dict(rope_scaling=None), dict(query_pre_attn_scalar=24.0)):
            other = our_logits(Gemma(module.config.replace(**change)), params, ids)
            assert np.abs(other - theirs).max() > 1e-2, change


def test_final_logit_softcapping():
    hf_model = gemma_model(seed=3, final_logit_softcapping=2.0, tie_word_embeddings=False)
    module, params = from_hf(hf_model)
    assert module.config.final_logit_softcap == 2.0 and "lm_head" in params
    ids = random_ids(2, (2, 24))
    theirs = hf_logits(hf_model, ids)
    assert np.abs(theirs).max() < 2.0 and np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(our_logits(module, params, ids), theirs, rtol=RTOL, atol=ATOL)
    assert_strict_round_trip(hf_model, module, params, transformers.Gemma3ForCausalLM,
                             hf_logits, ids)


def test_gradient_parity(gemma):
    hf_model, module, params = gemma
    jax_grads, mapped, _ = lm_gradients(module, params, hf_model, random_ids(5, (2, 24)))
    assert assert_gradients_match(jax_grads, mapped, params) == len(jax.tree_util.tree_leaves(params))


# ----------------------------------------------------------------------------- generation

def test_greedy_generate_past_the_window_matches_hf(gemma):
    """Prompt 8 + 20 new tokens: the local layers decode over a ring of W = 8 slots."""
    hf_model, module, params = gemma
    assert_aligned_greedy_matches_hf(hf_model, module, params, random_ids(9, (3, 8)), 20)


def test_greedy_generate_left_padded_matches_hf(gemma):
    hf_model, module, params = gemma
    prompts = [random_ids(10, (13,)).tolist(), random_ids(11, (4,)).tolist(),
               random_ids(12, (6,)).tolist()]
    assert_left_padded_greedy_matches_hf(hf_model, module, params, prompts, 16)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(gemma):
    hf_model, module, params = gemma
    assert_strict_round_trip(hf_model, module, params, transformers.Gemma3ForCausalLM,
                             hf_logits, random_ids(6, (2, 24)))


def test_base_model_reads_out_through_the_embedding(gemma):
    """A Gemma3TextModel (no ``model.`` prefix, no head) converts to the tied model."""
    hf_model, module, params = gemma
    base, base_params = from_hf(hf_model.model)
    assert base.config == module.config
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, base_params, params))


def test_sharded_save_pretrained_and_export_dirs(gemma, tmp_path):
    """A sharded save_pretrained dir (index + shards) loads; ``export --format hf``'s writer
    gives a dir AutoModelForCausalLM loads as a Gemma3ForCausalLM, which reads back equal."""
    from transformer_jax.export import write_hf

    hf_model, module, params = gemma
    ids = random_ids(7, (2, 24))
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    back, back_params = from_hf(tmp_path / "sharded")
    assert back.config == module.config
    np.testing.assert_allclose(our_logits(back, back_params, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)
    (tmp_path / "export").mkdir()
    write_hf(module, params, str(tmp_path / "export"))
    auto = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert (auto.model_type, auto.architectures, auto.layer_types) == (
        "gemma3_text", ["Gemma3ForCausalLM"], KINDS)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert type(loaded) is transformers.Gemma3ForCausalLM
    np.testing.assert_allclose(hf_logits(loaded, ids), hf_logits(hf_model, ids), rtol=0, atol=0)
    again, _ = from_hf(tmp_path / "export")
    assert again.config == module.config


def test_multimodal_checkpoint_converts_its_text_model(gemma):
    """Gemma3ForConditionalGeneration (a tiny SigLIP tower): its language model converts,
    both in transformers 5's key layout and the Hub's (``language_model.model.``), the
    vision keys left out; text-only logits equal HF's."""
    hf_text = gemma[0]
    config = transformers.Gemma3Config(
        text_config=hf_text.config.to_dict(),
        vision_config=dict(hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)
    torch.manual_seed(0)
    mm = transformers.Gemma3ForConditionalGeneration(config).eval()
    text_sd = {k.replace("model.", "model.language_model.", 1): v
               for k, v in hf_text.state_dict().items() if k.startswith("model.")}
    missing, _ = mm.load_state_dict(text_sd, strict=False)
    assert all("vision" in k or "multi_modal" in k or k == "lm_head.weight" for k in missing)
    module, params = from_hf(mm)
    ids = random_ids(8, (2, 24))
    np.testing.assert_allclose(our_logits(module, params, ids), hf_logits(hf_text, ids),
                               rtol=RTOL, atol=ATOL)
    hub = {}
    for key, value in mm.state_dict().items():
        key = key.replace("model.language_model.", "language_model.model.")
        key = key.replace("lm_head.", "language_model.lm_head.")
        hub[key.replace("model.vision_tower.", "vision_tower.")
               .replace("model.multi_modal_projector.", "multi_modal_projector.")] = value
    _, hub_params = from_hf_state_dict(mm.config, hub)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, hub_params, params))


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("option, value, match", [
    ("attn_logit_softcapping", 50.0, "Gemma 3 config option attn_logit_softcapping=50.0"),
    ("attention_bias", True, "Gemma 3 config option attention_bias=True"),
    ("use_bidirectional_attention", True, "Gemma 3 config option use_bidirectional_attention"),
    ("sliding_window", None, "Gemma 3 config option sliding_window=None"),
    ("hidden_activation", "gelu_fast", "Gemma 3 config option hidden_activation='gelu_fast'"),
    ("layer_types", ["sliding_attention", "chunked_attention", "full_attention"],
     "Gemma 3 config option layer_types"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                         "sliding_attention": {"rope_type": "default"}},
     r"rope_parameters\['full_attention'\]\) config option rope_parameters with rope_type='yarn'"),
    ("rope_parameters", {"full_attention": {"rope_type": "default"},
                         "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
     "RoPE scaling .* on the sliding-window layers"),
])
def test_unsupported_config_option_raises(gemma, option, value, match):
    config = {**gemma[0].config.to_dict(), option: value}
    with pytest.raises(UserError, match=match):
        from_hf_state_dict(config, state_dict(gemma[0]))


def test_scan_layers_is_refused_by_name(gemma):
    with pytest.raises(UserError, match="GemmaConfig.scan_layers=True is not supported"):
        from_hf(gemma[0], scan_layers=True)
