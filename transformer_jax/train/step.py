"""The train and eval steps: pure functions of (state, batch), jitted at the edge.

  batch: {"inputs": (B, T) int, "targets": (B, T) int, "weights": (B, T) float}

The train step splits the batch into ``accum_steps`` micro-batches and scans over them,
summing the token-weighted loss and its gradient, so one update with accumulation equals
one update on the whole batch (up to float summation order). Dropout keys are derived
from the state's key, the step and the micro-batch index: a resumed run draws the same
dropout masks as an uninterrupted one.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from .optim import label_smoothed_cross_entropy, mean_loss

Array = jax.Array


class TrainState(train_state.TrainState):
    """``flax`` TrainState (step, params, opt_state, apply_fn, tx) plus the dropout key."""
    rng: Array = struct.field(default=None)


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, rng: Array,
                       sample_inputs: Array) -> TrainState:
    """Initialise parameters and optimizer state (unboxed: plain arrays)."""
    init_rng, dropout_rng = jax.random.split(rng)
    params = nn.meta.unbox(model.init(init_rng, sample_inputs)["params"])
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=dropout_rng)


def _forward_loss(apply_fn, params, batch, dropout_rng, smoothing, deterministic):
    logits = apply_fn({"params": params}, batch["inputs"], deterministic=deterministic,
                      rngs=None if deterministic else {"dropout": dropout_rng})
    weights = batch.get("weights")
    loss_sum, weight_sum = label_smoothed_cross_entropy(logits, batch["targets"], weights, smoothing)
    if smoothing:
        nll_sum, _ = label_smoothed_cross_entropy(jax.lax.stop_gradient(logits), batch["targets"],
                                                  weights, 0.0)
    else:
        nll_sum = jax.lax.stop_gradient(loss_sum)
    return loss_sum, (weight_sum, nll_sum)


def _global_norm(tree) -> Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree)))


def make_train_step(*, label_smoothing: float = 0.0, accum_steps: int = 1,
                    schedule: Callable[[Array], Array] | None = None) -> Callable:
    """Build ``train_step(state, batch) -> (state, metrics)``.

    Metrics (fp32 scalars): ``loss`` (the training objective, label smoothing included),
    ``nll`` (plain cross-entropy per token), ``grad_norm`` (before clipping), ``tokens``
    (sum of weights), and ``lr`` when a schedule is given.
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")

    def train_step(state: TrainState, batch: dict[str, Array]):
        b = batch["inputs"].shape[0]
        if b % accum_steps:
            raise ValueError(f"batch size {b} is not divisible by accum_steps={accum_steps}")
        step_rng = jax.random.fold_in(state.rng, state.step)
        grad_fn = jax.value_and_grad(_forward_loss, argnums=1, has_aux=True)

        def micro(carry, xs):
            grads, loss_sum, weight_sum, nll_sum = carry
            i, mb = xs
            (l, (w, nll)), g = grad_fn(state.apply_fn, state.params, mb,
                                       jax.random.fold_in(step_rng, i), label_smoothing, False)
            grads = jax.tree_util.tree_map(jnp.add, grads, g)
            return (grads, loss_sum + l, weight_sum + w, nll_sum + nll), None

        micro_batches = jax.tree_util.tree_map(
            lambda x: x.reshape((accum_steps, b // accum_steps) + x.shape[1:]), batch)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        init = (zeros, jnp.float32(0), jnp.float32(0), jnp.float32(0))
        if accum_steps == 1:
            (grads, loss_sum, weight_sum, nll_sum), _ = micro(
                init, (0, jax.tree_util.tree_map(lambda x: x[0], micro_batches)))
        else:
            (grads, loss_sum, weight_sum, nll_sum), _ = jax.lax.scan(
                micro, init, (jnp.arange(accum_steps), micro_batches))
        denom = jnp.maximum(weight_sum, 1.0)
        grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
        metrics = {"loss": mean_loss(loss_sum, weight_sum), "nll": mean_loss(nll_sum, weight_sum),
                   "grad_norm": _global_norm(grads), "tokens": weight_sum}
        if schedule is not None:
            metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        return state.apply_gradients(grads=grads), metrics

    return train_step


def eval_step(state_or_params: Any, batch: dict[str, Array], apply_fn: Callable | None = None):
    """Deterministic ``(loss_sum, weight_sum)`` of plain cross-entropy on one batch."""
    if isinstance(state_or_params, TrainState):
        params, apply_fn = state_or_params.params, state_or_params.apply_fn
    else:
        params = state_or_params
    loss_sum, (weight_sum, _) = _forward_loss(apply_fn, params, batch, None, 0.0, True)
    return loss_sum, weight_sum
