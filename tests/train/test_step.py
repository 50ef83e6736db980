"""Tests for transformer_jax.train.step: what the gradient sums pass to a loss function."""
import types

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.train.step import make_gradient_sums


@pytest.mark.parametrize("global_batch, chunks, loss_chunk, want", [
    (True, True, 7, {"axis_name": "batch", "loss_chunk": 7}),    # BERT pretraining's loss
    (False, True, 7, {"loss_chunk": 7}),                         # lm, mlm, seq2seq
    (False, True, 0, {}),                                        # the plain loss
    (False, False, 7, {}),                                       # no read-out: ignored
    (True, False, 0, {"axis_name": "batch"}),                    # CLIP's loss
])
def test_a_loss_gets_the_keywords_it_declares(global_batch, chunks, loss_chunk, want):
    seen = []

    def loss_fn(apply_fn, params, batch, rngs, deterministic, smoothing, **kwargs):
        seen.append(kwargs)
        return jnp.sum(params["w"] * batch["x"]), {"weight": jnp.float32(2.0)}

    loss_fn.global_batch, loss_fn.chunks = global_batch, chunks
    sums = make_gradient_sums(loss_fn, 0.0, 1, axis_name="batch", loss_chunk=loss_chunk)
    state = types.SimpleNamespace(params={"w": jnp.array([1.0, 2.0])}, frozen=None,
                                  apply_fn=None)
    grads, loss_sum, _ = sums(state, {"x": jnp.array([[3.0, 4.0]])}, jax.random.PRNGKey(0), None)
    assert seen == [want]
    assert float(loss_sum) == 11.0 and grads["w"].tolist() == [3.0, 4.0]
