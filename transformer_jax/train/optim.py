"""Optimizers and learning-rate schedules (the losses are in :mod:`transformer_jax.losses`).

Everything here is built from optax primitives:

* Learning-rate schedules are ``optax.Schedule`` callables mapping the 0-based
  optimizer update count (the ``count`` optax keeps in its state) to a learning
  rate. Update ``k`` (the ``k``-th call of ``tx.update``, starting at 0) uses
  ``schedule(k)``: what ``torch.optim.lr_scheduler.LambdaLR`` gives update ``k``
  when ``scheduler.step()`` follows each ``optimizer.step()``. Pieces are joined
  with ``optax.join_schedules``. Linear ramps and cosines are evaluated by small
  local helpers that keep float32 *relative* precision where the rate nears
  zero (:func:`_linear_warmup`, :func:`_half_cosine`), so that a rate agrees with
  PyTorch's float64 ``LambdaLR`` to about 1e-7 relative at every step.
* :func:`make_optimizer` chains global-norm clipping with AdamW, where weight
  decay is masked by :func:`decay_mask` to matrices and embeddings only.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from ..errors import UserError

__all__ = [
    "SCHEDULES",
    "noam",
    "warmup_cosine",
    "warmup_times_cosine",
    "warmup_rsqrt",
    "constant",
    "make_schedule",
    "DECAYED_PARAM_NAMES",
    "decay_mask",
    "make_optimizer",
]


# ---------------------------------------------------------------------------
# Learning-rate schedules
# ---------------------------------------------------------------------------


def _check_nonnegative_int(name: str, value: int) -> None:
    if int(value) != value or value < 0:
        raise UserError(f"{name} must be a non-negative integer, got {value!r}")


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


def _half_cosine(remaining, span: float):
    """``0.5 * (1 + cos(pi * (1 - remaining / span)))`` for ``0 <= remaining <= span``.

    Computed as ``sin(pi/2 * remaining / span) ** 2`` (the same value): in float32 the
    cosine form loses relative precision as it nears 0 (1 + cos(x) cancels near x = pi, an
    error of ~1e-5 relative at the last steps of a 30-step run), the sine form does not.
    """
    frac = jnp.asarray(remaining, jnp.float32) / jnp.float32(span)
    return jnp.square(jnp.sin(jnp.float32(math.pi / 2) * frac))


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
        raise UserError(f"noam needs warmup_steps >= 1, got {warmup_steps}")
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
    so the rate stays at ``end_lr`` from ``total_steps`` on. (The values of
    ``optax.warmup_cosine_decay_schedule(init_lr, peak_lr, warmup_steps,
    total_steps, end_lr)``, without its float32 cancellation near ``end_lr``.)
    """
    _check_nonnegative_int("warmup_steps", warmup_steps)
    if total_steps <= warmup_steps:
        raise UserError(
            f"warmup_cosine needs total_steps > warmup_steps, got "
            f"total_steps={total_steps}, warmup_steps={warmup_steps}"
        )
    decay_steps = total_steps - warmup_steps

    def decay(count):
        remaining = decay_steps - jnp.clip(jnp.asarray(count, jnp.float32), 0.0, decay_steps)
        return end_lr + (peak_lr - end_lr) * _half_cosine(remaining, decay_steps)

    if warmup_steps == 0:
        return decay
    return optax.join_schedules(
        [_linear_warmup(init_lr, peak_lr, warmup_steps), decay], [warmup_steps]
    )


def warmup_times_cosine(peak_lr: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """A linear warm-up *multiplied by* one cosine over the whole run (the ``LambdaLR`` recipe).

    ``lr(step) = peak_lr * min(step / warmup_steps, 1) * 0.5 * (1 + cos(pi * step /
    total_steps))``, with ``step`` held at ``total_steps`` after it (the rate stays 0; the
    plain formula would rise again). Unlike :func:`warmup_cosine`, whose cosine starts
    when the warm-up ends, the cosine here runs from step 0, so the rate never quite
    reaches ``peak_lr``. ``warmup_steps=0``: no warm-up factor.
    """
    _check_nonnegative_int("warmup_steps", warmup_steps)
    _check_nonnegative_int("total_steps", total_steps)
    if total_steps < 1:
        raise UserError(f"warmup_times_cosine needs total_steps >= 1, got {total_steps}")

    def schedule(count):
        step = jnp.clip(jnp.asarray(count, jnp.float32), 0.0, float(total_steps))
        ramp = 1.0 if warmup_steps == 0 else jnp.minimum(step / float(warmup_steps), 1.0)
        return peak_lr * ramp * _half_cosine(float(total_steps) - step, total_steps)

    return schedule


def warmup_rsqrt(peak_lr: float, warmup_steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to ``peak_lr``, then ``peak_lr * sqrt(warmup / step)``.

    ``lr(step) = peak_lr * step / warmup_steps`` for ``step < warmup_steps`` and
    ``peak_lr * sqrt(warmup_steps / step)`` from ``warmup_steps`` on.
    """
    _check_nonnegative_int("warmup_steps", warmup_steps)
    if warmup_steps < 1:
        raise UserError(
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
    "warmup_times_cosine": warmup_times_cosine,
    "warmup_rsqrt": warmup_rsqrt,
    "constant": constant,
}
"""Schedule factories available through :func:`make_schedule`, by name."""


def make_schedule(name: str, **kwargs: Any) -> optax.Schedule:
    """Builds the schedule called ``name`` with keyword arguments ``kwargs``.

    Example: ``make_schedule("warmup_cosine", peak_lr=1e-3, warmup_steps=100,
    total_steps=1000)``.

    Raises:
      UserError: for an unknown name (the message lists the valid ones), or
        arguments the chosen schedule does not accept.
    """
    try:
        factory = SCHEDULES[name]
    except KeyError:
        raise UserError(
            f"Unknown learning-rate schedule {name!r}; valid names are: "
            f"{', '.join(sorted(SCHEDULES))}"
        ) from None
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise UserError(f"Bad arguments for schedule {name!r}: {e}") from e


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
        raise UserError(f"clip_norm must be positive or None, got {clip_norm}")
    return optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
