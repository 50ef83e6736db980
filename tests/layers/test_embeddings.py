"""Golden values for the position tables: sinusoidal and rotary."""
import math
import os

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
    "llama-2": (10000.0, 128, {"rope_type": "default"}),
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


def _exact_frequencies(theta, h, scaling):
    """The inverse frequencies of ``rope_frequencies(h, theta, scaling)`` in 50-digit mpmath
    arithmetic, each rounded once to float32 (the nearest of the float32 neighbours)."""
    import mpmath
    with mpmath.workdps(50):
        out = []
        for i in range(0, h, 2):
            f = mpmath.mpf(theta) ** (-mpmath.mpf(i) / h)
            if scaling is not None and scaling.kind == "linear":
                f = f / scaling.factor
            elif scaling is not None:
                wavelen = 2 * mpmath.pi / f
                old, low, high = scaling.original_max_len, scaling.low_freq_factor, scaling.high_freq_factor
                if wavelen > old / low:
                    f = f / scaling.factor
                elif wavelen >= old / high:
                    smooth = (old / wavelen - low) / (high - low)
                    f = (1 - smooth) * f / scaling.factor + smooth * f
            near = np.float32(float(f))
            candidates = [np.nextafter(near, np.float32(0)), near, np.nextafter(near, np.float32(2))]
            out.append(min(candidates, key=lambda c: abs(mpmath.mpf(float(c)) - f)))
    return np.array(out, np.float32)


def _ulps(a, b):
    """How many float32 steps apart a and b are, elementwise (both positive)."""
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def _transformers_bound(name, h, theta):
    """Per frequency, how many ulps transformers' float32 table may be from the correctly
    rounded one: 1 (torch's float32 pow), 3 in ``llama3``'s blended band (its float32
    blending arithmetic on top)."""
    from transformer_jax.layers.embeddings import rope_frequencies
    bound = np.ones(h // 2, np.int64)
    params = REAL_ROPES[name][2]
    if params["rope_type"] == "llama3":
        wavelen = 2 * math.pi / rope_frequencies(h, theta).astype(np.float64)
        old = params["original_max_position_embeddings"]
        blended = (wavelen >= old / params["high_freq_factor"]) & (wavelen <= old / params["low_freq_factor"])
        assert blended.sum() >= 3
        bound[blended] = 3
    return bound


def _transformers_frequencies(name):
    """transformers' float32 table for ``name``: its ROPE_INIT_FUNCTIONS (the rotary
    embedding's buffer for default RoPE), with the attention factor it returns."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    _, config, rotary = _hf_rope(name)
    params = REAL_ROPES[name][2]
    if params["rope_type"] == "default":
        return rotary.inv_freq.numpy(), 1.0
    inv, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return inv.numpy(), factor


@pytest.mark.parametrize("name", sorted(REAL_ROPES))
def test_rope_frequencies_are_correctly_rounded_and_within_transformers_bound(name):
    """Every one of the H/2 inverse frequencies: the float32 nearest the exact value (50-digit
    mpmath), and within :func:`_transformers_bound` ulps of transformers' own table."""
    from transformer_jax.layers.embeddings import rope_frequencies
    scaling, _, _ = _hf_rope(name)
    theta, h, params = REAL_ROPES[name]
    ours = rope_frequencies(h, theta, scaling)
    assert ours.dtype == np.float32 and ours.shape == (h // 2,)
    np.testing.assert_array_equal(ours, _exact_frequencies(theta, h, scaling))
    theirs, factor = _transformers_frequencies(name)
    assert theirs.shape == ours.shape and factor == 1.0
    assert (_ulps(ours, theirs) <= _transformers_bound(name, h, theta)).all(), _ulps(ours, theirs)
    if scaling is not None:    # the scaling is not the identity: the lowest moved by the factor
        plain = rope_frequencies(h, theta)
        assert (ours != plain).sum() >= h // 8 and ours.min() == np.float32(plain.min() / params["factor"])


@pytest.mark.parametrize("h", [64, 256])
def test_plain_rope_frequencies_are_correctly_rounded_at_theta_1e4(h):
    from transformer_jax.layers.embeddings import rope_frequencies
    np.testing.assert_array_equal(rope_frequencies(h, 10000.0), _exact_frequencies(10000.0, h, None))


_TABLES_SCRIPT = """
import json, numpy as np
from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
from transformer_jax.layers.embeddings import RopeScaling, rope_frequencies
tables = {name: rope_frequencies(h, theta, RopeScaling.from_value(scaling)).view(np.int32).tolist()
          for name, (theta, h, scaling) in json.loads(input()).items()}
print(json.dumps({"on": [f for f in __cpu_dispatch__ if __cpu_features__.get(f)], "tables": tables}))
"""


def test_rope_tables_do_not_depend_on_the_hosts_simd():
    """The tables in a process whose NumPy may use every SIMD target this host has, and in one
    limited to NumPy's baseline (``NPY_DISABLE_CPU_FEATURES``: on an AVX-512 host that changes
    NumPy's own float32 ``pow`` by up to 2 ulp): identical, and correctly rounded."""
    import json
    import subprocess
    import sys
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    from transformer_jax.layers.embeddings import RopeScaling
    settings = {name: (theta, h, _OURS[params["rope_type"]](params))
                for name, (theta, h, params) in REAL_ROPES.items()}
    dispatched = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    procs = [subprocess.Popen([sys.executable, "-c", _TABLES_SCRIPT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, NPY_DISABLE_CPU_FEATURES=" ".join(disabled)))
             for disabled in ([], dispatched)]                   # both at once
    runs = []
    for proc in procs:
        out, err = proc.communicate(json.dumps(settings), timeout=120)
        assert proc.returncode == 0, err
        runs.append(json.loads(out.splitlines()[-1]))
    assert runs[0]["on"] == dispatched and runs[1]["on"] == []
    assert runs[0]["tables"] == runs[1]["tables"]
    for name, (theta, h, scaling) in settings.items():
        exact = _exact_frequencies(theta, h, RopeScaling.from_value(scaling))
        assert runs[0]["tables"][name] == exact.view(np.int32).tolist(), name


@pytest.mark.parametrize("name", sorted(REAL_ROPES))
def test_apply_rope_equals_transformers_up_to_131072_positions(name):
    """Queries rotated at 300 positions in [0, 131072) (incl. 0, the original 8192 boundary
    and the last, 131071): equal to transformers' cos/sin and ``apply_rotary_pos_emb`` within
    a tolerance derived from the frequency tables' difference.

    Per frequency f, the two rotation angles are fp32 products ``position * f``: identical
    where the tables agree, and otherwise at most ``position * |df| + ulp(position * max f)``
    apart (within 1 ulp of the exact product each). A rotated pair (x1, x2) then differs by at
    most ``(|x1| + |x2|) * (angle difference + 4 ulp(1))``, the last for XLA's and torch's
    float32 sin and cos, plus the output's rounding."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformer_jax.layers.embeddings import rope_frequencies
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
    mine, hf = rope_frequencies(h, theta, scaling), rotary.inv_freq.numpy()
    assert (_ulps(mine, hf) <= _transformers_bound(name, h, theta)).all()
    df = np.abs(mine.astype(np.float64) - hf.astype(np.float64))                     # (H/2,)
    angle = positions[:, None].astype(np.float64) * np.maximum(mine, hf)              # (T, H/2)
    d_angle = positions[:, None] * df + np.where(df > 0, np.spacing(angle.astype(np.float32)), 0)
    pair = np.abs(x[..., : h // 2]) + np.abs(x[..., h // 2:])                          # (B, T, N, H/2)
    tol = pair * (d_angle[None, :, None, :] + 4 * np.spacing(np.float32(1)))
    tol = np.concatenate([tol, tol], axis=-1) + np.spacing(np.abs(theirs).astype(np.float32))
    err = np.abs(ours - theirs)
    assert (err <= tol).all(), (err - tol).max()
    assert np.abs(ours[:, -1] - x[:, -1]).max() > 0.1       # the last position does rotate
