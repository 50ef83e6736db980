"""Golden values for the position tables: sinusoidal and rotary."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import apply_rope, sinusoidal_table

from ..helpers import rand


def test_sinusoidal_table_golden():
    pe = np.asarray(sinusoidal_table(3, 4))
    expected = np.array([
        [0.0, 1.0, 0.0, 1.0],
        [math.sin(1.0), math.cos(1.0), math.sin(0.01), math.cos(0.01)],
        [math.sin(2.0), math.cos(2.0), math.sin(0.02), math.cos(0.02)],
    ])
    np.testing.assert_allclose(pe, expected, rtol=0, atol=1e-6)
    # the formula for a wider table: PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(.)
    pe = np.asarray(sinusoidal_table(50, 16), np.float64)
    pos, i = np.arange(50)[:, None], np.arange(8)[None, :]
    angle = pos / 10000 ** (2 * i / 16)
    np.testing.assert_allclose(pe[:, 0::2], np.sin(angle), atol=2e-5)
    np.testing.assert_allclose(pe[:, 1::2], np.cos(angle), atol=2e-5)


def test_rope_golden_and_relative():
    x = jnp.array([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 1, 4)
    out = np.asarray(apply_rope(x, jnp.array([[1]])))[0, 0, 0]
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.01), math.sin(0.01)
    np.testing.assert_allclose(out, [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2],
                               atol=1e-6)
    out_i = np.asarray(apply_rope(x, jnp.array([[1]]), interleaved=True))[0, 0, 0]
    np.testing.assert_allclose(out_i, [1 * c1 - 2 * s1, 2 * c1 + 1 * s1, 3 * c2 - 4 * s2, 4 * c2 + 3 * s2],
                               atol=1e-6)
    # q.k after RoPE depends only on the relative offset
    q, k = rand(0, (1, 1, 1, 8)), rand(1, (1, 1, 1, 8))
    dot = lambda i, j: float(jnp.sum(apply_rope(q, jnp.array([[i]])) * apply_rope(k, jnp.array([[j]]))))
    assert dot(5, 2) == pytest.approx(dot(13, 10), abs=1e-5)
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, jnp.array([[7]]))), jnp.linalg.norm(q), rtol=1e-6)


# The real models' RoPE: (rope_theta, head size, HF rope parameters).
REAL_ROPES = {
    "llama-3.1": (500000.0, 128, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}),
    "llama-3.2": (500000.0, 64, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}),
    "gemma-3-global": (1e6, 256, {"rope_type": "linear", "factor": 8.0}),
    "qwen-3": (1e6, 128, {"rope_type": "default"}),
}
_OURS = {"llama3": lambda p: dict(kind="llama3", factor=p["factor"],
                                  low_freq_factor=p["low_freq_factor"],
                                  high_freq_factor=p["high_freq_factor"],
                                  original_max_len=p["original_max_position_embeddings"]),
         "linear": lambda p: dict(kind="linear", factor=p["factor"]),
         "default": lambda p: None}


def _hf_rope(name):
    """(our RopeScaling, transformers' LlamaRotaryEmbedding) for the model ``name``."""
    transformers = pytest.importorskip("transformers")
    from transformer_jax.layers.embeddings import RopeScaling
    theta, h, params = REAL_ROPES[name]
    config = transformers.LlamaConfig(hidden_size=h * 4, num_attention_heads=4, head_dim=h,
                                      max_position_embeddings=131072,
                                      rope_parameters={**params, "rope_theta": theta})
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    return RopeScaling.from_value(_OURS[params["rope_type"]](params)), config, rotary


@pytest.mark.parametrize("name", sorted(REAL_ROPES))
def test_rope_frequencies_equal_transformers_for_the_real_models(name):
    """Every one of the H/2 inverse frequencies against transformers' own
    ROPE_INIT_FUNCTIONS (default RoPE: the rotary embedding's table): bit for bit for
    Llama 3.x, within 1 ulp for theta 1e6."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformer_jax.layers.embeddings import rope_frequencies
    scaling, config, rotary = _hf_rope(name)
    theta, h, params = REAL_ROPES[name]
    ours = rope_frequencies(h, theta, scaling)
    if params["rope_type"] == "default":
        theirs, factor = rotary.inv_freq.numpy(), 1.0
    else:
        inv, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        theirs = inv.numpy()
        # the scaling is not the identity: some frequencies moved, by the factor at most
        plain = rope_frequencies(h, theta)
        assert (ours != plain).sum() >= h // 8 and np.allclose(ours.min(), plain.min() / params["factor"])
    assert ours.shape == theirs.shape == (h // 2,) and factor == 1.0
    if name.startswith("llama"):
        np.testing.assert_array_equal(ours, theirs)
    else:    # theta 1e6: NumPy's and torch's fp32 pow differ by 1 ulp at one frequency
        np.testing.assert_array_max_ulp(ours, theirs, maxulp=1)


@pytest.mark.parametrize("name", sorted(REAL_ROPES))
def test_apply_rope_equals_transformers_up_to_131072_positions(name):
    """Queries rotated at 300 positions in [0, 131072) (incl. 0, the original 8192 boundary
    and the last, 131071): equal to transformers' cos/sin and ``apply_rotary_pos_emb``."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    scaling, _, rotary = _hf_rope(name)
    theta, h, _ = REAL_ROPES[name]
    rng = np.random.default_rng(0)
    positions = np.unique(np.concatenate([rng.integers(0, 131072, 295),
                                          [0, 1, 8191, 8192, 131071]])).astype(np.int32)
    x = rng.standard_normal((1, len(positions), 2, h)).astype(np.float32)          # (B, T, N, H)
    ours = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions)[None], base=theta,
                                 scaling=scaling))
    xt = torch.from_numpy(x).transpose(1, 2)                                         # (B, N, T, H)
    cos, sin = rotary(xt, torch.from_numpy(positions.astype(np.int64))[None])
    theirs, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    theirs = theirs.transpose(1, 2).numpy()
    # Measured (|x| <= 5): <= 4.8e-7 for Llama 3.x (the same fp32 angles), 1.7e-6 for
    # Gemma 3, 1.1e-5 for theta 1e6 (a frequency 1 ulp apart, times 131071).
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6 if name.startswith("llama") else 2e-5)
    assert np.abs(ours[:, -1] - x[:, -1]).max() > 0.1       # the last position does rotate
