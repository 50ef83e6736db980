"""Qwen 2.5 and Qwen 3 parity with Hugging Face ``transformers`` (PyTorch), through ``interop.hf``.

Both are options of the Llama-style GPT (``interop/hf/qwen2.py``, ``qwen3.py``). One tiny
random model per family, 4 query heads on 2 key/value heads, weights moved off HF's init
(``conftest.perturbed``: non-zero q/k/v biases, non-identity q/k norms):

  * ``qwen2``: ``Qwen2ForCausalLM`` with q/k/v biases and a tied head;
  * ``qwen3``: ``Qwen3ForCausalLM`` with q/k RMSNorms, ``head_dim`` 32 (not D / N = 16), an
    untied head and llama3 RoPE scaling (positions past ``original_max_position_embeddings``).

Measured (fp32, "highest" matmuls, T = 40): logits (|logit| <= 3.3) differ by <= 2.4e-6,
gradients (|grad| <= 0.58) by <= 2.3e-7.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf, hf_config
from transformer_jax.interop.hf import from_hf_state_dict, to_hf_numpy
from transformer_jax.interop.hf.llama import llama_hf_config
from transformer_jax.interop.hf.qwen2 import (qwen2_config_from_hf, qwen2_hf_config,
                                               qwen2_to_state_dict)
from transformer_jax.interop.hf.qwen3 import qwen3_config_from_hf, qwen3_hf_config
from transformer_jax.interop.hf.registry import family_for_config
from transformer_jax.models.gpt import GPT, GPTConfig

from .conftest import (ATOL, RTOL, abstract_param_count, assert_aligned_greedy_matches_hf,
                       assert_gradients_match, assert_left_padded_greedy_matches_hf,
                       assert_same_leaves, assert_strict_round_trip, lm_gradients,
                       meta_param_count, perturbed, state_dict, transformers)
from .test_hf_llama import hf_logits, our_logits, random_ids

QWEN_TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=88, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None, pad_token_id=None)
#: per family: (HF config class, HF LM class, HF base class, settings on top of QWEN_TINY)
FAMILY = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2Model",
              dict(rope_theta=500.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3Model",
              dict(head_dim=32, tie_word_embeddings=False, rope_parameters={
                  "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16})),
}


def qwen_model(family: str, seed: int = 0, **overrides):
    """A random HF Qwen LM of ``family`` (``QWEN_TINY`` and the family's settings)."""
    config_cls, lm_cls, _, settings = FAMILY[family]
    config = getattr(transformers, config_cls)(**{**QWEN_TINY, **settings, **overrides})
    return perturbed(lambda: getattr(transformers, lm_cls)(config), seed)


@pytest.fixture(scope="module", params=sorted(FAMILY))
def qwen(request):
    """(family, hf_model, module, params), one model per family for the whole module."""
    model = qwen_model(request.param, seed=3)
    return (request.param, model, *from_hf(model))


# ----------------------------------------------------------------------------- config

def test_config_mapping_dispatch_and_round_trip(qwen):
    family, hf_model, module, params = qwen
    cfg = module.config
    assert (cfg.vocab_size, cfg.d_model, cfg.mlp_dim, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.max_len, cfg.norm_eps, cfg.rope_base) == (
        101, 64, 88, 2, 4, 2, 64, 1e-6, 500.0)
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.use_bias) == (family == "qwen2", family == "qwen3", False)
    assert (cfg.head_size, cfg.head_dim) == ((None, 16) if family == "qwen2" else (32, 32))
    assert cfg.tie_embeddings == (family == "qwen2")
    if family == "qwen2":
        assert params["h_0"]["self_attn"]["key"]["bias"].shape == (2, 16)
    else:
        assert params["h_1"]["self_attn"]["query_norm"]["scale"].shape == (32,)
        assert cfg.rope_scaling.kind == "llama3" and cfg.rope_scaling.original_max_len == 16
    assert family_for_config(cfg).name == family
    back = hf_config(cfg)
    assert type(back) is getattr(transformers, FAMILY[family][0])
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                 "rms_norm_eps", "tie_word_embeddings", "hidden_act", "rope_parameters",
                 "use_sliding_window", "sliding_window", "layer_types"):
        assert getattr(back, name) == getattr(hf_model.config, name), name
    assert back.to_dict().get("head_dim") == hf_model.config.to_dict().get("head_dim")


def test_dispatch_between_the_llama_style_families():
    assert [family_for_config(GPTConfig.preset(n)).name for n in
            ("llama-tiny", "mistral-tiny", "qwen2.5-tiny", "qwen3-tiny", "tiny")] == [
        "llama", "mistral", "qwen2", "qwen3", "gpt2"]
    assert family_for_config(GPTConfig.preset("llama-tiny", qkv_bias=True)).name == "qwen2"
    assert type(hf_config(GPTConfig.preset("llama-tiny", qk_norm=True))) is transformers.Qwen3Config


@pytest.mark.parametrize("name, published", [
    ("qwen2.5-tiny", 125_504), ("qwen3-tiny", 149_952), ("qwen2.5-0.5b", 494_032_768),
    ("qwen2.5-1.5b", 1_543_714_304), ("qwen3-0.6b", 596_049_920), ("qwen3-1.7b", 1_720_574_976)])
def test_parameter_counts_match_hf(name, published):
    cfg = GPTConfig.preset(name)
    hf_cfg = hf_config(cfg)
    cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}
    hf_count = meta_param_count(lambda: cls[hf_cfg.model_type](hf_cfg))
    assert cfg.num_params() == hf_count == published
    if name.endswith("tiny"):
        ours = abstract_param_count(lambda: GPT(cfg).init(jax.random.PRNGKey(0),
                                                          jnp.zeros((1, 1), jnp.int32)))
        assert ours == hf_count


def test_real_config_jsons_read_as_the_presets():
    """Qwen/Qwen2.5-0.5B's and Qwen/Qwen3-0.6B's config.json (transformers 4.x form)."""
    qwen25 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu",
              "attention_dropout": 0.0, "hidden_size": 896, "initializer_range": 0.02,
              "intermediate_size": 4864, "max_position_embeddings": 32768,
              "max_window_layers": 24, "num_attention_heads": 14, "num_hidden_layers": 24,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
              "sliding_window": 32768, "tie_word_embeddings": True, "use_sliding_window": False,
              "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151643}
    assert qwen2_config_from_hf(qwen25) == GPTConfig.preset("qwen2.5-0.5b")
    qwen3 = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
             "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
             "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
             "intermediate_size": 3072, "max_position_embeddings": 40960,
             "max_window_layers": 28, "num_attention_heads": 16, "num_hidden_layers": 28,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
             "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
             "use_sliding_window": False, "vocab_size": 151936}
    assert qwen3_config_from_hf(qwen3) == GPTConfig.preset("qwen3-0.6b")
    # Qwen3Config's default head_dim is 128 whatever D / N is.
    assert qwen3_config_from_hf({"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
                                 "num_key_value_heads": 2}).head_dim == 128


# ----------------------------------------------------------------------------- logits, gradients

@pytest.mark.parametrize("side", ["right", "left"])
def test_logits_parity_with_padding(qwen, side):
    """T = 40 > the qwen3 model's original_max_position_embeddings 16 (llama3 scaling)."""
    _, hf_model, module, params = qwen
    t = 40
    ids = random_ids(1, (3, t))
    lengths = np.array([t, 23, 5])
    cols = np.arange(t)[None, :]
    valid = cols < lengths[:, None] if side == "right" else cols >= t - lengths[:, None]
    mask = valid.astype(np.int32)
    gen_positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    for positions in (None, gen_positions):
        ours = our_logits(module, params, ids, mask, positions)
        theirs = hf_logits(hf_model, ids, mask, positions)
        assert np.abs(theirs[valid]).max() > 1.0
        np.testing.assert_allclose(ours[valid], theirs[valid], rtol=RTOL, atol=ATOL)


def test_gradient_parity(qwen):
    _, hf_model, module, params = qwen
    jax_grads, mapped, _ = lm_gradients(module, params, hf_model, random_ids(5, (2, 24)))
    assert assert_gradients_match(jax_grads, mapped, params) == len(jax.tree_util.tree_leaves(params))


def test_base_model_converts(qwen):
    """``Qwen2Model``/``Qwen3Model``: no ``model.`` prefix, no head; every weight is the LM's."""
    family, hf_model, module, params = qwen
    base, base_params = from_hf(hf_model.model)
    assert base.config.tie_embeddings and "lm_head" not in base_params
    assert_same_leaves(base_params, {k: v for k, v in params.items() if k != "lm_head"})


# ----------------------------------------------------------------------------- generation

def test_greedy_generate_matches_hf(qwen):
    _, hf_model, module, params = qwen
    assert_aligned_greedy_matches_hf(hf_model, module, params, random_ids(9, (3, 8)), 20)


def test_greedy_generate_left_padded_matches_hf(qwen):
    _, hf_model, module, params = qwen
    prompts = [random_ids(10, (13,)).tolist(), random_ids(11, (4,)).tolist(),
               random_ids(12, (6,)).tolist()]
    assert_left_padded_greedy_matches_hf(hf_model, module, params, prompts, 16)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(qwen):
    family, hf_model, module, params = qwen
    sd = assert_strict_round_trip(hf_model, module, params,
                                  getattr(transformers, FAMILY[family][1]), hf_logits,
                                  random_ids(6, (2, 24)))
    extra = {"qwen2": "model.layers.1.self_attn.v_proj.bias",
             "qwen3": "model.layers.1.self_attn.k_norm.weight"}[family]
    assert extra in sd


def test_scan_layers_conversion(qwen):
    _, hf_model, module, params = qwen
    smod, sparams = from_hf(hf_model, scan_layers=True)
    assert smod.config == module.config.replace(scan_layers=True) and "h_0" not in sparams
    ids = random_ids(7, (2, 20))
    np.testing.assert_allclose(our_logits(smod, sparams, ids), hf_logits(hf_model, ids),
                               rtol=RTOL, atol=ATOL)
    a, b = to_hf_numpy(smod, sparams), to_hf_numpy(module, params)
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_sharded_save_pretrained_dir_loads(qwen, tmp_path):
    """save_pretrained with a small max_shard_size: several safetensors files and an index."""
    _, hf_model, module, params = qwen
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").exists()
    loaded_module, loaded = from_hf(tmp_path)
    assert loaded_module.config == module.config
    assert_same_leaves(loaded, params)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("family, option, value, match", [
    ("qwen3", "attention_bias", True, "Qwen3 config option attention_bias=True"),
    ("qwen2", "hidden_act", "gelu", "Qwen2 config option hidden_act"),
    ("qwen2", "rope_parameters", {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0},
     "Qwen2 config option rope_parameters with rope_type='yarn'"),
    ("qwen2", "layer_types", ["full_attention", "chunked_attention"],
     r"Qwen2 config option layer_types with \['chunked_attention'\]"),
])
def test_unsupported_config_option_raises(family, option, value, match):
    hf_model = qwen_model(family, seed=4)
    config = {**hf_model.config.to_dict(), option: value}
    with pytest.raises(UserError, match=match):
        from_hf_state_dict(config, state_dict(hf_model))


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_sliding_window_layers_are_refused(family):
    """use_sliding_window with layers at or past max_window_layers: refused by name; with
    max_window_layers >= the layer count every layer is full and it converts."""
    convert = {"qwen2": qwen2_config_from_hf, "qwen3": qwen3_config_from_hf}[family]
    config = {"model_type": family, "hidden_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 2, "use_sliding_window": True,
              "sliding_window": 8}
    with pytest.raises(UserError, match=rf"{family.title()} config option use_sliding_window=True "
                       r"\(sliding_window=8, max_window_layers=1\): layers 1\.\.1"):
        convert({**config, "max_window_layers": 1})
    assert convert({**config, "max_window_layers": 2}).attention_window is None
    with pytest.raises(UserError, match="use_sliding_window=True"):
        convert({**config, "layer_types": ["sliding_attention", "full_attention"]})


def test_to_hf_refuses_what_qwen_cannot_express():
    with pytest.raises(UserError, match=r"not expressible as Qwen3: qkv_bias=True"):
        hf_config(GPTConfig.preset("qwen3-tiny", qkv_bias=True))
    with pytest.raises(UserError, match=r"not expressible as Qwen2: attention_window=8"):
        hf_config(GPTConfig.preset("qwen2.5-tiny", attention_window=8))
    with pytest.raises(UserError, match=r"not expressible as Qwen2: qkv_bias=False"):
        qwen2_hf_config(GPTConfig.preset("llama-tiny"))
    with pytest.raises(UserError, match=r"not expressible as Qwen3: qk_norm=False"):
        qwen3_hf_config(GPTConfig.preset("llama-tiny"))
    with pytest.raises(UserError, match=r"not expressible as Llama: qkv_bias=True"):
        llama_hf_config(GPTConfig.preset("qwen2.5-tiny"))
    cfg = GPTConfig.preset("qwen2.5-tiny")
    module = GPT(cfg)
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))["params"]
    with pytest.raises(UserError, match=r"not expressible as Qwen2: use_bias=True"):
        qwen2_to_state_dict(GPT(cfg.replace(use_bias=True)), params)
