"""The train and eval steps: pure functions of (state, batch), and the compile of the
train step for a placement (:func:`compile_train_step`: ``jax.jit`` with the state's
shardings, or ``jax.pmap``; the state is donated either way).

  batch: {"inputs": (B, T) int, "targets": (B, T) int, "weights": (B, T) float}

The train step splits the batch into ``accum_steps`` micro-batches and scans over them,
summing the token-weighted loss and its gradient, so one update with accumulation equals
one update on the whole batch (up to float summation order). Dropout keys are derived
from the state's key, the step and the micro-batch index: a resumed run draws the same
dropout masks as an uninterrupted one.

Float16 compute overflows where bfloat16 does not, so a state may carry a dynamic
:class:`LossScale`: each micro-batch's mean loss is multiplied by it before
differentiation and the gradients divided by it after; a step whose gradients are not all
finite changes neither the parameters nor the optimizer state and halves the scale, and a
run of good steps doubles it.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from .. import sharding as sh
from ..errors import UserError
from ..losses import LossFn, lm_loss, per_weight_means

if TYPE_CHECKING:   # distributed imports this module
    from .distributed import Placement

Array = jax.Array


class LossScale(struct.PyTreeNode):
    """Dynamic loss scale: ``scale`` (fp32) and ``good_steps`` (finite steps since it last
    changed). After a step with non-finite gradients the scale is halved (not below
    ``min_scale``); after ``growth_interval`` finite steps in a row it is doubled. Powers of
    two, so scaling and unscaling are exact."""
    scale: Array
    good_steps: Array
    growth_interval: int = struct.field(pytree_node=False, default=2000)
    min_scale: float = struct.field(pytree_node=False, default=2.0 ** -14)

    @classmethod
    def create(cls, init_scale: float = 2.0 ** 15, growth_interval: int = 2000) -> "LossScale":
        return cls(scale=jnp.asarray(init_scale, jnp.float32), good_steps=jnp.asarray(0, jnp.int32),
                   growth_interval=int(growth_interval))

    def update(self, finite: Array) -> "LossScale":
        """The scale after a step whose gradients were (``finite``) or were not all finite."""
        grow = finite & (self.good_steps + 1 >= self.growth_interval)
        scale = jnp.where(finite, jnp.where(grow, self.scale * 2.0, self.scale),
                          jnp.maximum(self.scale * 0.5, self.min_scale))
        good = jnp.where(finite & ~grow, self.good_steps + 1, 0).astype(jnp.int32)
        return self.replace(scale=scale, good_steps=good)


class TrainState(train_state.TrainState):
    """``flax`` TrainState (step, params, opt_state, apply_fn, tx), the dropout key, a
    :class:`LossScale` (None: no loss scaling) and the ``frozen`` parameters.

    Parameter-efficient fine-tuning (LoRA, prefix tuning) splits the model's parameters in
    two: ``params`` are the ones that train (the adapters, a fresh task head): they alone
    get gradients and optimizer state; ``frozen`` holds the rest (the base model, possibly
    stored quantized), read by the forward pass and never updated. ``frozen`` is None when
    everything trains; then the state holds exactly the leaves it held before, so older
    checkpoints restore. :func:`full_params` joins the two."""
    rng: Array = struct.field(default=None)
    loss_scale: LossScale | None = struct.field(default=None)
    frozen: Any = struct.field(default=None)


#: ``partition(params) -> (trainable, frozen)``: how a run splits its parameters
Partition = Callable[[Any], tuple[Any, Any]]


def combine(trainable: Any, frozen: Any) -> Any:
    """The model's whole parameter tree from two nested dicts with disjoint leaves."""
    if frozen is None:
        return trainable
    if trainable is None:
        return frozen
    if not (isinstance(trainable, dict) and isinstance(frozen, dict)):
        raise ValueError("combine: a parameter is both trainable and frozen")
    out = dict(frozen)
    for key, value in trainable.items():
        out[key] = combine(value, frozen.get(key)) if key in frozen else value
    return out


def split_tree(params: Any, keep: Callable[[tuple[str, ...]], bool]) -> tuple[Any, Any]:
    """``(leaves where keep(path), the other leaves)`` as two nested dicts (empty subtrees
    dropped; an empty side is ``{}``)."""
    def walk(node, path):
        if not isinstance(node, dict):
            return (node, None) if keep(path) else (None, node)
        kept, rest = {}, {}
        for key, value in node.items():
            a, b = walk(value, path + (str(key),))
            if a is not None:
                kept[key] = a
            if b is not None:
                rest[key] = b
        return kept or None, rest or None
    kept, rest = walk(dict(params), ())
    return kept or {}, rest or {}


def full_params(state: TrainState) -> Any:
    """The parameters a forward pass takes: the trainable ones and the frozen ones."""
    return combine(state.params, state.frozen)


def create_train_state(model: nn.Module, tx: optax.GradientTransformation, rng: Array,
                       *init_args: Any, loss_scale: LossScale | None = None,
                       partition: Partition | None = None) -> TrainState:
    """Initialise parameters (``model.init(rng, *init_args)``, unboxed) and optimizer state.

    With ``partition`` (parameter-efficient fine-tuning) only its first part trains: the
    optimizer state covers it alone and the second part becomes ``state.frozen``.

    ``step`` starts as a (weakly typed) int32 array, like the ``step + 1`` that every train
    step returns, so a jitted step compiles once (a Python ``0`` would make the second
    call a new signature and compile again).
    """
    init_rng, dropout_rng = jax.random.split(rng)
    params = nn.meta.unbox(model.init(init_rng, *init_args)["params"])
    frozen = None
    if partition is not None:
        params, frozen = partition(params)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx, rng=dropout_rng,
                              loss_scale=loss_scale, frozen=frozen)
    return state.replace(step=jnp.asarray(0))


def _global_norm(tree) -> Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree)))


def _weight(sums: dict[str, Array]) -> Array:
    """A micro-batch's weight sum as a constant divisor (at least 1)."""
    return jax.lax.stop_gradient(jnp.maximum(sums["weight"], 1.0))


def _all_finite(tree) -> Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]))


def _split(batch, accum_steps: int):
    """(B, ...) leaves -> (accum, B/accum, ...), each micro-batch kept split over the batch
    mesh axes (a no-op outside a mesh + rules context, e.g. on one device or under pmap)."""
    b = jax.tree_util.tree_leaves(batch)[0].shape[0]
    if b % accum_steps:
        raise UserError(f"batch size {b} is not divisible by accum_steps={accum_steps}")
    return jax.tree_util.tree_map(
        lambda x: nn.with_logical_constraint(
            x.reshape((accum_steps, b // accum_steps) + x.shape[1:]), (None, "act_batch")),
        batch)


def _skip_if_not_finite(finite: Array, new: TrainState, old: TrainState) -> TrainState:
    """``new``, except that params and optimizer state stay ``old``'s where not ``finite``.

    The step counter still advances: it counts batches, and the data position, the
    dropout keys and the checkpoint numbers follow it."""
    keep = lambda a, b: jnp.where(finite, a, b)  # noqa: E731
    return new.replace(params=jax.tree_util.tree_map(keep, new.params, old.params),
                       opt_state=jax.tree_util.tree_map(keep, new.opt_state, old.opt_state),
                       loss_scale=old.loss_scale.update(finite))


def make_gradient_sums(loss_fn: LossFn, label_smoothing: float, accum_steps: int,
                       axis_name: str | None = None, loss_chunk: int = 0) -> Callable:
    """``gradient_sums(state, batch, rng, scale) -> (grads, loss_sum, sums)``: the loss sum,
    named sums and the gradient of the loss sum, over ``accum_steps`` micro-batches.

    With a ``scale`` each micro-batch differentiates its *mean* loss times the scale (the
    range torch's GradScaler is tuned for; a sum over many tokens would overflow float16 at
    a far smaller scale) and its gradient is unscaled back to that of its sum.

    A loss that needs the whole batch rather than a sum of per-example terms (CLIP's
    contrastive loss: every image against every caption; BERT pretraining's MLM mean over
    all the masked tokens) marks itself ``loss_fn.global_batch = True`` and takes
    ``axis_name``: under ``pmap`` it gathers (or sums) what it needs from the other devices.
    A loss with a vocabulary read-out marks itself ``loss_fn.chunks = True`` and takes
    ``loss_chunk`` (positions of each row per chunk of the read-out, ``losses.head_loss``;
    0: plain); the others ignore it.
    """
    extra = {}
    if getattr(loss_fn, "global_batch", False):
        extra["axis_name"] = axis_name
    if loss_chunk and getattr(loss_fn, "chunks", False):
        extra["loss_chunk"] = loss_chunk
    if extra:
        loss_fn = functools.partial(loss_fn, **extra)
    def objective(params, frozen, apply_fn, batch, rng, scale):
        """Differentiated with respect to ``params`` only: the frozen ones get no gradient
        (and no weight-gradient matmuls)."""
        loss_sum, sums = loss_fn(apply_fn, combine(params, frozen), batch, {"dropout": rng},
                                 False, label_smoothing)
        if scale is None:
            return loss_sum, (loss_sum, sums)
        return loss_sum * (scale / _weight(sums)), (loss_sum, sums)

    grad_fn = jax.value_and_grad(objective, has_aux=True)

    def gradient_sums(state: TrainState, batch, step_rng, scale):
        def micro(carry, xs):
            grads, loss_sum, sums = carry
            i, mb = xs
            (_, (l, s)), g = grad_fn(state.params, state.frozen, state.apply_fn, mb,
                                     jax.random.fold_in(step_rng, i), scale)
            if scale is not None:
                g = jax.tree_util.tree_map(lambda x: x * (_weight(s) / scale), g)
            grads = jax.tree_util.tree_map(jnp.add, grads, g)
            sums = {k: sums[k] + s[k] for k in s} if sums else s
            return (grads, loss_sum + l, sums), None

        micro_batches = _split(batch, accum_steps)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        first = jax.tree_util.tree_map(lambda x: x[0], micro_batches)
        if accum_steps == 1:
            return micro((zeros, jnp.float32(0), None), (0, first))[0]
        shapes = jax.eval_shape(lambda: objective(state.params, state.frozen, state.apply_fn,
                                                  first, step_rng, scale)[1][1])
        init_sums = jax.tree_util.tree_map(lambda sd: jnp.zeros(sd.shape, sd.dtype), shapes)
        return jax.lax.scan(micro, (zeros, jnp.float32(0), init_sums),
                            (jnp.arange(accum_steps), micro_batches))[0]

    return gradient_sums


def make_train_step(*, loss_fn: LossFn = lm_loss, label_smoothing: float = 0.0,
                    accum_steps: int = 1,
                    schedule: Callable[[Array], Array] | None = None,
                    axis_name: str | None = None, loss_chunk: int = 0) -> Callable:
    """Build ``train_step(state, batch) -> (state, metrics)``; ``loss_chunk``: see
    :func:`make_gradient_sums`.

    Metrics (fp32 scalars): ``loss`` (the training objective, label smoothing included),
    the loss function's other sums per weight (``nll``, ``accuracy`` ...), ``grad_norm``
    (before clipping), ``tokens`` (the weight sum), ``lr`` when a schedule is given, and,
    with a loss scale in the state, ``loss_scale`` (the scale this step used) and
    ``skipped`` (1.0 where its gradients overflowed and the update was dropped).

    Under ``jax.jit`` with sharded inputs the step is written for the whole global batch
    and XLA partitions it (see ``transformer_jax.sharding``). Under ``jax.pmap`` pass the
    mapped ``axis_name``: each device sums its shard's loss, named sums and gradient, and
    those *sums* are ``psum``-ed before the one division by the global weight, so the
    result equals the single-device step up to float summation order. (Each device then
    draws its own dropout masks, folding its axis index into the key.)
    """
    if accum_steps < 1:
        raise UserError(f"accum_steps must be >= 1, got {accum_steps}")
    gradient_sums = make_gradient_sums(loss_fn, label_smoothing, accum_steps, axis_name,
                                       loss_chunk)

    def train_step(state: TrainState, batch: dict[str, Array]):
        step_rng = jax.random.fold_in(state.rng, state.step)
        if axis_name is not None:
            step_rng = jax.random.fold_in(step_rng, jax.lax.axis_index(axis_name))
        scale = None if state.loss_scale is None else state.loss_scale.scale
        grads, loss_sum, sums = gradient_sums(state, batch, step_rng, scale)
        if axis_name is not None:   # pmap: combine the devices' sums, then divide once
            grads, loss_sum, sums = jax.lax.psum((grads, loss_sum, sums), axis_name)
        denom = jnp.maximum(sums["weight"], 1.0)
        grads = jax.tree_util.tree_map(lambda g: g / denom, grads)
        metrics = per_weight_means(loss_sum, sums)
        metrics.update(grad_norm=_global_norm(grads), tokens=sums["weight"])
        if schedule is not None:
            metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
        new_state = state.apply_gradients(grads=grads)
        if scale is not None:
            finite = _all_finite(grads)
            if axis_name is not None:   # psum-ed gradients agree already; make the vote explicit
                finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name) > 0
            new_state = _skip_if_not_finite(finite, new_state, state)
            metrics.update(loss_scale=scale, skipped=(~finite).astype(jnp.float32))
        return new_state, metrics

    return train_step


def eval_step(params: Any, batch: dict[str, Array], apply_fn: Callable,
              loss_fn: LossFn = lm_loss) -> dict[str, Array]:
    """Deterministic sums on one batch: ``{"loss": plain cross-entropy sum, "weight", ...}``."""
    _, sums = loss_fn(apply_fn, params, batch, None, True, 0.0)
    return {"loss": sums["nll"], **{k: v for k, v in sums.items() if k != "nll"}}


def compile_train_step(placement: Placement, step_fn: Callable) -> Callable:
    """``run(state, batch) -> (state, metrics)``: ``step_fn`` (from :func:`make_train_step`)
    compiled for ``placement``, with the state donated (updated in place).

    ``jit``: one ``jax.jit`` over the placement's mesh, the state in its shardings, the
    batch split over the batch axes, the metrics replicated. ``pmap``: ``jax.pmap`` over the
    local devices (the step psums over ``placement.axis_name``), metrics read from the
    first device. ``batch`` is this process's host rows or what ``placement.put_batch``
    made of them (already on the devices).
    """
    if placement.parallelism == "pmap":
        pstep = jax.pmap(step_fn, axis_name=placement.axis_name, donate_argnums=(0,))

        def run_pmap(state, batch):
            state, metrics = pstep(state, placement.placed(batch))
            return state, sh.pmap_local(metrics)
        return run_pmap
    shardings = placement.state_shardings
    jitted = jax.jit(step_fn, in_shardings=(shardings, sh.batch_sharding(placement.mesh)),
                     out_shardings=(shardings, sh.replicated(placement.mesh)), donate_argnums=(0,))

    def run(state, batch):
        batch = placement.placed(batch)
        with sh.use_mesh(placement.mesh):
            return jitted(state, batch)
    return run
