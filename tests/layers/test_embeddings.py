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
