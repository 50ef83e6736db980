"""FeedForward: golden values for each activation, plain and gated."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.layers import FeedForward


@pytest.mark.parametrize("act,golden", [("relu", 1.0), ("gelu", 0.8413447460685429),
                                        ("gelu_tanh", 0.8411919906082768), ("silu", 0.7310585786300049),
                                        ("quick_gelu", 0.8457957659328212)])
def test_feedforward_activations(act, golden):
    ff = FeedForward(mlp_dim=1, activation=act, use_bias=False)
    x = jnp.ones((1, 1, 1))
    p = {"wi": {"kernel": jnp.ones((1, 1))}, "wo": {"kernel": jnp.ones((1, 1))}}
    np.testing.assert_allclose(ff.apply({"params": p}, x)[0, 0, 0], golden, rtol=1e-6)
    gated = FeedForward(mlp_dim=1, activation=act, gated=True, use_bias=False)
    pg = {"wi_0": {"kernel": jnp.ones((1, 1))}, "wi_1": {"kernel": 2 * jnp.ones((1, 1))},
          "wo": {"kernel": jnp.ones((1, 1))}}
    np.testing.assert_allclose(gated.apply({"params": pg}, x)[0, 0, 0], 2 * golden, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown activation"):
        FeedForward(mlp_dim=1, activation="swishy").init(jax.random.PRNGKey(0), x)
