"""Optimizers, learning-rate schedules and the label-smoothed loss.

Everything here is built from optax primitives:

* Learning-rate schedules are ``optax.Schedule`` callables mapping the 0-based
  optimizer update count (the ``count`` optax keeps in its state) to a learning
  rate. Update ``k`` (the ``k``-th call of ``tx.update``, starting at 0) uses
  ``schedule(k)``. Pieces are joined with ``optax.join_schedules`` and the
  cosine part is ``optax.cosine_decay_schedule``; linear ramps are evaluated
  by a small local helper that keeps float32 relative precision near zero
  (see :func:`_linear_warmup`).
* :func:`make_optimizer` chains global-norm clipping with AdamW, where weight
  decay is masked by :func:`decay_mask` to matrices and embeddings only.
* :func:`label_smoothed_cross_entropy` returns a ``(loss_sum, weight_sum)``
  pair so that losses over micro-batches (gradient accumulation) or data
  parallel shards can be combined exactly; :func:`mean_loss` turns the pair
  into the per-token mean.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "SCHEDULES",
    "noam",
    "warmup_cosine",
    "warmup_rsqrt",
    "constant",
    "make_schedule",
    "DECAYED_PARAM_NAMES",
    "decay_mask",
    "make_optimizer",
    "label_smoothed_cross_entropy",
    "mean_loss",
]


# ---------------------------------------------------------------------------
# Learning-rate schedules
# ---------------------------------------------------------------------------


def _check_nonnegative_int(name: str, value: int) -> None:
    if int(value) != value or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def _linear_warmup(init_lr: float, peak_lr: float, warmup_steps: int) -> optax.Schedule:
    """``init_lr + (peak_lr - init_lr) * min(count, warmup_steps) / warmup_steps``.

    Same values as ``optax.linear_schedule(init_lr, peak_lr, warmup_steps)``,
    but evaluated so that float32 keeps full *relative* precision near the
    start of the ramp. optax computes ``(init - end) * (1 - frac) + end``,
    which cancels catastrophically when ``init << end``; for the Noam warm-up
    that means errors of ~1e-4 relative in the first steps.
    """
    delta = (peak_lr - init_lr) / warmup_steps

    def schedule(count):
        count = jnp.minimum(jnp.asarray(count, jnp.float32), float(warmup_steps))
        return init_lr + delta * count

    return schedule


def _rsqrt_decay(peak_lr: float, warmup_steps: int) -> optax.Schedule:
    """``peak_lr * sqrt(warmup_steps / (warmup_steps + count))``.

    Meant as the second piece of ``optax.join_schedules(..., [warmup_steps])``,
    which calls it with ``count = step - warmup_steps``; the result is therefore
    ``peak_lr * sqrt(warmup_steps / step)`` in terms of the global ``step``.
    """

    def schedule(count):
        step = jnp.asarray(count, jnp.float32) + float(warmup_steps)
        return peak_lr * jnp.sqrt(float(warmup_steps) / step)

    return schedule


def noam(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
    """The "Noam" schedule of *Attention Is All You Need* (Vaswani et al. 2017).

    ``lr(step) = scale * d_model**-0.5 * min(s**-0.5, s * warmup_steps**-1.5)``
    with ``s = max(step, 1)``, i.e. a linear increase up to
    ``scale * (d_model * warmup_steps)**-0.5`` at ``step == warmup_steps``
    followed by inverse square-root decay. This matches the usual PyTorch
    implementation with ``LambdaLR`` (where the first update uses ``lr(0)``,
    which equals ``lr(1)`` because of the ``max(step, 1)``).

    Args:
      d_model: model width.
      warmup_steps: number of warm-up steps (>= 1).
      scale: overall multiplier (the "factor" of many implementations).
    """
    _check_nonnegative_int("warmup_steps", warmup_steps)
    if warmup_steps < 1:
        raise ValueError(f"noam needs warmup_steps >= 1, got {warmup_steps}")
    peak = scale * d_model**-0.5 * warmup_steps**-0.5
    slope = peak / warmup_steps  # lr(s) = slope * s during warm-up.

    def warmup(count):
        return slope * jnp.maximum(jnp.asarray(count, jnp.float32), 1.0)

    return optax.join_schedules(
        [warmup, _rsqrt_decay(peak, warmup_steps)], [warmup_steps]
    )


def warmup_cosine(
    peak_lr: float,
    warmup_steps: int,
    total_steps: int,
    end_lr: float = 0.0,
    init_lr: float = 0.0,
) -> optax.Schedule:
    """Linear warm-up from ``init_lr`` to ``peak_lr``, then cosine decay.

    ``lr(step) = init_lr + (peak_lr - init_lr) * step / warmup_steps`` for
    ``step < warmup_steps``; afterwards
    ``end_lr + (peak_lr - end_lr) * 0.5 * (1 + cos(pi * t))`` with
    ``t = (step - warmup_steps) / (total_steps - warmup_steps)`` clipped to 1,
    so the rate stays at ``end_lr`` from ``total_steps`` on. (The same values
    as ``optax.warmup_cosine_decay_schedule(init_lr, peak_lr, warmup_steps,
    total_steps, end_lr)``.)
    """
    _check_nonnegative_int("warmup_steps", warmup_steps)
    if total_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine needs total_steps > warmup_steps, got "
            f"total_steps={total_steps}, warmup_steps={warmup_steps}"
        )
    alpha = 0.0 if peak_lr == 0.0 else end_lr / peak_lr
    decay = optax.cosine_decay_schedule(
        init_value=peak_lr, decay_steps=total_steps - warmup_steps, alpha=alpha
    )
    if warmup_steps == 0:
        return decay
    return optax.join_schedules(
        [_linear_warmup(init_lr, peak_lr, warmup_steps), decay], [warmup_steps]
    )


def warmup_rsqrt(peak_lr: float, warmup_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to ``peak_lr``, then ``peak_lr * sqrt(warmup / step)``.

    ``lr(step) = peak_lr * step / warmup_steps`` for ``step < warmup_steps`` and
    ``peak_lr * sqrt(warmup_steps / step)`` from ``warmup_steps`` on.
    """
    _check_nonnegative_int("warmup_steps", warmup_steps)
    if warmup_steps < 1:
        raise ValueError(
            f"warmup_rsqrt needs warmup_steps >= 1, got {warmup_steps}"
        )
    return optax.join_schedules(
        [_linear_warmup(0.0, peak_lr, warmup_steps),
         _rsqrt_decay(peak_lr, warmup_steps)],
        [warmup_steps],
    )


def constant(lr: float, warmup_steps: int = 0) -> optax.Schedule:
    """Constant ``lr``, optionally after a linear warm-up from 0.

    ``lr(step) = lr * step / warmup_steps`` for ``step < warmup_steps``, else
    ``lr``.
    """
    _check_nonnegative_int("warmup_steps", warmup_steps)
    if warmup_steps == 0:
        return optax.constant_schedule(lr)
    return _linear_warmup(0.0, lr, warmup_steps)


SCHEDULES: dict[str, Callable[..., optax.Schedule]] = {
    "noam": noam,
    "warmup_cosine": warmup_cosine,
    "warmup_rsqrt": warmup_rsqrt,
    "constant": constant,
}
"""Schedule factories available through :func:`make_schedule`, by name."""


def make_schedule(name: str, **kwargs: Any) -> optax.Schedule:
    """Builds the schedule called ``name`` with keyword arguments ``kwargs``.

    Example: ``make_schedule("warmup_cosine", peak_lr=1e-3, warmup_steps=100,
    total_steps=1000)``.

    Raises:
      ValueError: for an unknown name (the message lists the valid ones), or
        arguments the chosen schedule does not accept.
    """
    try:
        factory = SCHEDULES[name]
    except KeyError:
        raise ValueError(
            f"Unknown learning-rate schedule {name!r}; valid names are: "
            f"{', '.join(sorted(SCHEDULES))}"
        ) from None
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"Bad arguments for schedule {name!r}: {e}") from e


# ---------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------

DECAYED_PARAM_NAMES = frozenset({"kernel", "embedding"})
"""Parameter names that receive weight decay (dense weights and embeddings)."""


def _leaf_name(path: tuple) -> Optional[str]:
    """Name of the innermost dictionary key on a pytree path.

    Using the innermost *dictionary* key (instead of simply the last entry)
    makes boxed parameters such as ``nn.Partitioned`` - whose path ends in an
    attribute key like ``.value`` - resolve to their parameter name.
    """
    for entry in reversed(path):
        if isinstance(entry, jax.tree_util.DictKey):
            return str(entry.key)
    return None


def decay_mask(params: Any) -> Any:
    """Pytree of bools: ``True`` where weight decay applies.

    Decay applies only to leaves named ``kernel`` (dense / attention /
    convolution weights) or ``embedding`` (embedding tables); biases
    (``bias``), normalisation gains (``scale``) and anything else are excluded.
    The result has the same structure as ``params`` (nested dicts,
    ``FrozenDict`` or other pytrees), as ``optax.masked`` requires.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, _: _leaf_name(path) in DECAYED_PARAM_NAMES, params
    )


def make_optimizer(
    *,
    schedule: Union[optax.Schedule, float],
    b1: float = 0.9,
    b2: float = 0.98,
    eps: float = 1e-9,
    weight_decay: float = 0.01,
    clip_norm: Optional[float] = 1.0,
    mu_dtype: Any = None,
) -> optax.GradientTransformation:
    """Global-norm clipping followed by AdamW with masked weight decay.

    The defaults follow *Attention Is All You Need*: ``b1=0.9``, ``b2=0.98``
    and ``eps=1e-9``. The small epsilon is kept from the paper so that the
    Noam schedule reproduces the original recipe; note that in bfloat16/fp16
    *optimizer states* such a small epsilon does not help - keep the moments in
    fp32 (the default, ``mu_dtype=None``) or pass ``eps=1e-8``.

    Weight decay is decoupled (``p <- p - lr * (adam_update + weight_decay *
    p)``, identical to ``torch.optim.AdamW``) and applied only where
    :func:`decay_mask` is true.

    Args:
      schedule: learning-rate schedule (or a constant float).
      b1, b2, eps: Adam hyper-parameters.
      weight_decay: decoupled weight-decay coefficient.
      clip_norm: maximum global gradient norm; ``None`` disables clipping.
      mu_dtype: optional dtype of the first moment (e.g. ``jnp.bfloat16``).
    """
    adamw = optax.adamw(
        learning_rate=schedule,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        mask=decay_mask,
        mu_dtype=mu_dtype,
    )
    if clip_norm is None:
        return adamw
    if clip_norm <= 0:
        raise ValueError(f"clip_norm must be positive or None, got {clip_norm}")
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


# ---------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------


def target_logits(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(logits[..., target], in_range)`` for float32 logits (..., V) and integer targets.

    Out-of-range targets (a padding id, -100) are clipped into [0, V) for the lookup;
    ``in_range`` says which were not. The logit is picked by a compare-and-sum, not a
    gather: its gradient is then a select that fuses with the softmax gradient instead of a
    scatter into a zeroed (..., V) buffer.
    """
    num_classes = logits.shape[-1]
    targets = targets.astype(jnp.int32)
    safe = jnp.clip(targets, 0, num_classes - 1)
    is_target = jnp.arange(num_classes, dtype=jnp.int32) == safe[..., None]
    return jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1), safe == targets


def label_smoothed_cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    weights: Optional[jax.Array] = None,
    smoothing: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """Weighted, label-smoothed cross-entropy summed over tokens.

    The target distribution puts ``1 - smoothing`` on the target class plus
    ``smoothing / V`` on every one of the ``V`` classes (the target included),
    the convention of ``torch.nn.functional.cross_entropy(...,
    label_smoothing=smoothing)``. Per token::

        loss = (1 - smoothing) * -log p[target] + smoothing * mean_v(-log p[v])

    The computation is done in float32 whatever the dtype of ``logits``.

    Returning sums rather than a mean lets gradient accumulation and data
    parallelism combine results exactly: add the ``loss_sum`` and
    ``weight_sum`` of all pieces, then call :func:`mean_loss` once.

    Args:
      logits: ``(..., V)`` unnormalised scores, any float dtype.
      targets: ``(...)`` integer class ids. Positions with zero weight may hold
        any value (e.g. a padding id or -100); they are clipped into range
        before the lookup and contribute nothing.
      weights: optional ``(...)`` per-token weights (bool, int or float), e.g.
        a padding mask. ``None`` means all ones.
      smoothing: label-smoothing epsilon in ``[0, 1]``.

    Returns:
      ``(loss_sum, weight_sum)``: float32 scalars, the weighted sum of
      per-token losses and the sum of the weights.
    """
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"smoothing must be in [0, 1], got {smoothing}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {logits.shape} and targets {targets.shape} disagree: "
            "expected logits.shape == targets.shape + (V,)"
        )
    logits = logits.astype(jnp.float32)
    # -log p[v] = lse - logits[v] (no (..., V) log-probs are stored)
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - target_logits(logits, targets)[0]
    if smoothing:
        uniform = lse - jnp.mean(logits, axis=-1)
        per_token = (1.0 - smoothing) * nll + smoothing * uniform
    else:
        per_token = nll
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    else:
        if weights.shape != targets.shape:
            raise ValueError(
                f"weights {weights.shape} must have the shape of targets "
                f"{targets.shape}"
            )
        weights = weights.astype(jnp.float32)
    # Select rather than multiply so that non-finite losses at masked
    # positions (e.g. -inf logits on padding) cannot leak in as NaN.
    loss_sum = jnp.sum(jnp.where(weights != 0, per_token * weights, 0.0))
    return loss_sum, jnp.sum(weights)


def mean_loss(loss_sum: jax.Array, weight_sum: jax.Array) -> jax.Array:
    """``loss_sum / weight_sum``, or 0 when ``weight_sum`` is 0."""
    weight_sum = jnp.asarray(weight_sum, jnp.float32)
    safe = jnp.where(weight_sum > 0, weight_sum, 1.0)
    return jnp.where(weight_sum > 0, loss_sum / safe, 0.0)

