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

from .optim import label_smoothed_cross_entropy, mean_loss, target_logits

Array = jax.Array


class TrainState(train_state.TrainState):
    """``flax`` TrainState (step, params, opt_state, apply_fn, tx) plus the dropout key."""
    rng: Array = struct.field(default=None)


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, rng: Array,
                       *init_args: Any) -> TrainState:
    """Initialise parameters (``model.init(rng, *init_args)``, unboxed) and optimizer state.

    ``step`` starts as a (weakly typed) int32 array, like the ``step + 1`` that every train
    step returns, so a jitted step compiles once (a Python ``0`` would make the second
    call a new signature and compile again).
    """
    init_rng, dropout_rng = jax.random.split(rng)
    params = nn.meta.unbox(model.init(init_rng, *init_args)["params"])
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=dropout_rng)
    return state.replace(step=jnp.asarray(0))


# A loss function maps (apply_fn, params, batch, rngs, deterministic, smoothing) to
# (loss_sum, sums): the objective summed over tokens/examples, and named sums that the
# step divides by sums["weight"] to report (at least "weight"; e.g. "nll", "correct").
LossFn = Callable[..., tuple[Array, dict[str, Array]]]


def token_loss(logits: Array, targets: Array, weights: Array | None, smoothing: float):
    """Cross-entropy terms for logits (..., V) and integer targets (...): (loss_sum, sums).

    sums: ``weight`` (tokens counted), ``nll`` (plain cross-entropy sum) and ``correct``
    (hits: the target holds the top logit), so that a step reports loss, nll and accuracy
    per token.
    """
    loss_sum, weight_sum = label_smoothed_cross_entropy(logits, targets, weights, smoothing)
    if smoothing:
        nll_sum, _ = label_smoothed_cross_entropy(jax.lax.stop_gradient(logits), targets, weights, 0.0)
    else:
        nll_sum = jax.lax.stop_gradient(loss_sum)
    w = jnp.ones(targets.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    # A hit: an in-range target whose logit is the largest (a tie for the top counts as a
    # hit). Unlike an argmax this reuses the row maximum and the target logit that the loss
    # computes (XLA merges the identical reductions), instead of another pass over the
    # (..., V) logits.
    lg = jax.lax.stop_gradient(logits).astype(jnp.float32)
    target_logit, in_range = target_logits(lg, targets)
    hits = (in_range & (target_logit >= jnp.max(lg, axis=-1))).astype(jnp.float32)
    return loss_sum, {"weight": weight_sum, "nll": nll_sum, "correct": jnp.sum(hits * w)}


def lm_loss(apply_fn, params, batch, rngs, deterministic: bool, smoothing: float):
    """Next-token loss: ``batch = {"inputs", "targets": (B, T) int, "weights": (B, T)}``."""
    logits = apply_fn({"params": params}, batch["inputs"], deterministic=deterministic, rngs=rngs)
    return token_loss(logits, batch["targets"], batch.get("weights"), smoothing)


def _global_norm(tree) -> Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree)))


def _means(loss_sum: Array, sums: dict[str, Array]) -> dict[str, Array]:
    """Per-weight means: loss, and each named sum (``correct`` is reported as ``accuracy``)."""
    weight = sums["weight"]
    out = {"loss": mean_loss(loss_sum, weight)}
    for k, v in sums.items():
        if k != "weight":
            out["accuracy" if k == "correct" else k] = mean_loss(v, weight)
    return out


def make_train_step(*, loss_fn: LossFn = lm_loss, label_smoothing: float = 0.0,
                    accum_steps: int = 1,
                    schedule: Callable[[Array], Array] | None = None,
                    axis_name: str | None = None) -> Callable:
    """Build ``train_step(state, batch) -> (state, metrics)``.

    Metrics (fp32 scalars): ``loss`` (the training objective, label smoothing included),
    the loss function's other sums per weight (``nll``, ``accuracy`` ...), ``grad_norm``
    (before clipping), ``tokens`` (the weight sum), and ``lr`` when a schedule is given.

    Under ``jax.jit`` with sharded inputs the step is written for the whole global batch
    and XLA partitions it (see ``transformer_jax.sharding``). Under ``jax.pmap`` pass the
    mapped ``axis_name``: each device sums its shard's loss, named sums and gradient, and
    those *sums* are ``psum``-ed before the one division by the global weight, so the
    result equals the single-device step up to float summation order. (Each device then
    draws its own dropout masks, folding its axis index into the key.)
    """
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1, got {accum_steps}")

    def objective(params, apply_fn, batch, rng):
        return loss_fn(apply_fn, params, batch, {"dropout": rng}, False, label_smoothing)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def train_step(state: TrainState, batch: dict[str, Array]):
        b = jax.tree_util.tree_leaves(batch)[0].shape[0]
        if b % accum_steps:
            raise ValueError(f"batch size {b} is not divisible by accum_steps={accum_steps}")
        step_rng = jax.random.fold_in(state.rng, state.step)
        if axis_name is not None:
            step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axis_name))

        def micro(carry, xs):
            grads, loss_sum, sums = carry
            i, mb = xs
            (l, s), g = grad_fn(state.params, state.apply_fn, mb, jax.random.fold_in(step_rng, i))
            grads = jax.tree_util.tree_map(jnp.add, grads, g)
            sums = {k: sums[k] + s[k] for k in s} if sums else s
            return (grads, loss_sum + l, sums), None

        # (accum, B/accum, ...): keep every micro-batch split over the batch mesh axes (a
        # no-op outside a mesh + rules context, e.g. on one device or under pmap).
        micro_batches = jax.tree_util.tree_map(
            lambda x: nn.with_logical_constraint(
                x.reshape((accum_steps, b // accum_steps) + x.shape[1:]), (None, "act_batch")),
            batch)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        if accum_steps == 1:
            (grads, loss_sum, sums), _ = micro(
                (zeros, jnp.float32(0), None), (0, jax.tree_util.tree_map(lambda x: x[0], micro_batches)))
        else:
            first = jax.tree_util.tree_map(lambda x: x[0], micro_batches)
            shapes = jax.eval_shape(lambda: objective(state.params, state.apply_fn, first, step_rng)[1])
            init_sums = jax.tree_util.tree_map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
            (grads, loss_sum, sums), _ = jax.lax.scan(
                micro, (zeros, jnp.float32(0), init_sums), (jnp.arange(accum_steps), micro_batches))
        if axis_name is not None:   # pmap: combine the devices' sums, then divide once
            grads, loss_sum, sums = jax.lax.psum((grads, loss_sum, sums), axis_name)
        denom = jnp.maximum(sums["weight"], 1.0)
        grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
        metrics = _means(loss_sum, sums)
        metrics.update(grad_norm=_global_norm(grads), tokens=sums["weight"])
        if schedule is not None:
            metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        return state.apply_gradients(grads=grads), metrics

    return train_step


def eval_step(params: Any, batch: dict[str, Array], apply_fn: Callable,
              loss_fn: LossFn = lm_loss) -> dict[str, Array]:
    """Deterministic sums on one batch: ``{"loss": plain cross-entropy sum, "weight", ...}``."""
    _, sums = loss_fn(apply_fn, params, batch, None, True, 0.0)
    return {"loss": sums["nll"], **{k: v for k, v in sums.items() if k != "nll"}}
