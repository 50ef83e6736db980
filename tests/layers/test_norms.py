"""LayerNorm and RMSNorm: golden values; LayerNorm's written-out derivative."""
import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.layers import LayerNorm, RMSNorm

from ..helpers import FP32_TOL, rand


def test_norms_golden():
    x = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    ln = LayerNorm(eps=0.0)
    y = ln.apply(ln.init(jax.random.PRNGKey(0), x), x)
    np.testing.assert_allclose(y[0], np.array([-3, -1, 1, 3]) / math.sqrt(5), atol=1e-6)
    rms = RMSNorm(eps=0.0)
    y = rms.apply(rms.init(jax.random.PRNGKey(0), x), x)
    np.testing.assert_allclose(y[0], np.array([1, 2, 3, 4]) / math.sqrt(7.5), atol=1e-6)
    xb = x.astype(jnp.bfloat16)
    assert LayerNorm(dtype=jnp.bfloat16).apply(ln.init(jax.random.PRNGKey(0), x), xb).dtype == jnp.bfloat16


def _plain_standardise(x, eps):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(jnp.mean((x - mean) ** 2, axis=-1, keepdims=True) + eps)


def test_layernorm_written_out_derivative_equals_autodiff():
    """LayerNorm's custom_jvp rule gives the derivatives that autodiff of the plain formula
    gives: forward mode, reverse mode and second order."""
    from transformer_jax.layers.norms import standardise as fast
    x, dx, ct = rand(1, (3, 5, 16)) * 2 + 0.5, rand(2, (3, 5, 16)), rand(3, (3, 5, 16))
    with jax.default_matmul_precision("highest"):
        y, jv = jax.jvp(lambda a: fast(a, 1e-5), (x,), (dx,))
        y_ref, jv_ref = jax.jvp(lambda a: _plain_standardise(a, 1e-5), (x,), (dx,))
        np.testing.assert_allclose(y, y_ref, **FP32_TOL)
        np.testing.assert_allclose(jv, jv_ref, **FP32_TOL)
        g = jax.grad(lambda a: jnp.sum(fast(a, 1e-5) * ct))(x)
        g_ref = jax.grad(lambda a: jnp.sum(_plain_standardise(a, 1e-5) * ct))(x)
        np.testing.assert_allclose(g, g_ref, **FP32_TOL)
        hv = jax.jvp(jax.grad(lambda a: jnp.sum(fast(a, 1e-5) * ct)), (x,), (dx,))[1]
        hv_ref = jax.jvp(jax.grad(lambda a: jnp.sum(_plain_standardise(a, 1e-5) * ct)), (x,), (dx,))[1]
        np.testing.assert_allclose(hv, hv_ref, rtol=1e-4, atol=1e-4)
    # the rows are standardised: zero mean, unit mean square (eps aside)
    np.testing.assert_allclose(jnp.mean(y, -1), 0.0, atol=1e-6)
    np.testing.assert_allclose(jnp.mean(y ** 2, -1), 1.0, rtol=1e-4)
