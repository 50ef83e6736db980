"""XLA:CPU tuning, in one place, chosen when a function is lowered.

The layers state their math once and call the functions below at the three points where
XLA:CPU needs help with the *derivative*:

  ``residual(x)``               a pre-norm block's residual input: its gradient is stored
                                once per sublayer instead of recomputed in every layer;
  ``matmul_weight(w)``          a matmul's (K, N) weight: its gradient is computed with the
                                longer axis last, then transposed;
  ``attention_scores(q, k)``,   the two matmuls of the reference attention: the key and
  ``attention_values(p, v)``    value gradients contract a materialised transpose.

Each is an identity (or the plain product) whose tangent rule is a
``jax.lax.platform_dependent`` choice: the tuned form where the function is lowered for the
CPU, the plain form on every other platform. One jitted function is thus right everywhere:
lowered for TPU or CUDA it holds none of this (no conditional, no optimization barrier;
``tests/layers/test_cpu_tuning.py`` lowers train steps for both and checks). Values are the
same everywhere, and so are gradients up to float rounding.

Every function takes ``cpu_tuning``, the models' config field of that name: False gives the
plain form on the CPU too. What each tuning buys and costs was measured on two CPU cores;
the figures are in ``docs/performance.md``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ..errors import UserError

Array = jax.Array


def on_cpu(cpu_form: Callable, plain: Callable, *args: Any) -> Any:
    """``cpu_form(*args)`` where this is lowered for the CPU, ``plain(*args)`` elsewhere."""
    return jax.lax.platform_dependent(*args, cpu=cpu_form, default=plain)


def _identity(x: Array) -> Array:
    return x


# ----------------------------------------------------------------------------- residual stream

def _through_conditional(t: Array) -> Array:
    # The predicate is an opaque True, not computed from the activations: XLA does not fold
    # it, vmap never batches it (a batched predicate becomes a select, which fuses) and it
    # needs no element of a sharded array. ``u * 1.0`` is exact; written so because JAX
    # drops a conditional whose branches all return their operand unchanged.
    return jax.lax.cond(jax.lax.optimization_barrier(jnp.bool_(True)),
                        lambda u: u, lambda u: u * 1.0, t)


@jax.custom_jvp
def _store_gradient_once(x: Array) -> Array:
    return x


@_store_gradient_once.defjvp
def _store_gradient_once_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x, on_cpu(_through_conditional, _identity, t)


def residual(x: Array, cpu_tuning: bool = True) -> Array:
    """Identity on a residual stream ``x`` whose gradient is stored once (on the CPU).

    The gradient of a residual stream is a chain of additions, one per sublayer. XLA:CPU's
    fusion copies cheap elementwise producers into every consumer, so unless each link is
    stored, every layer's backward fusion recomputes the chain from the top: quadratic in
    depth. On the CPU the gradient passes through a ``lax.cond`` that no fusion crosses.
    Post-norm blocks don't need it (a norm's reductions sit in every link).
    """
    return _store_gradient_once(x) if cpu_tuning else x


# ----------------------------------------------------------------------------- weight gradients

def _check_matrix(w: Array) -> None:
    if w.ndim != 2:
        raise UserError(f"matmul_weight expects a 2-D matmul operand (K, N), got shape "
                        f"{w.shape}; reshape the weight to (K, N) before passing it")


def _wide_first(t: Array) -> Array:
    # The gradient is formed with its longer axis last; the barrier keeps XLA from folding
    # the transpose back into the dot.
    if t.shape[0] <= t.shape[1]:
        return jax.lax.optimization_barrier(t)
    return jax.lax.optimization_barrier(t.T).T


@jax.custom_jvp
def _wide_gradient(w: Array) -> Array:
    return w


@_wide_gradient.defjvp
def _wide_gradient_jvp(primals, tangents):
    (w,), (t,) = primals, tangents
    return w, on_cpu(_wide_first, _identity, t)


def matmul_weight(w: Array, cpu_tuning: bool = True) -> Array:
    """Identity on the right operand ``w`` (K, N) of ``x @ w``; fixes its gradient's layout.

    On the CPU the weight gradient ``x^T g`` is computed as (min(K, N), max(K, N)) and
    transposed afterwards when the weight is stored tall (an FFN output kernel, the tied
    read-out's (D, V) view of a (V, D) table): XLA:CPU writes tall results slowly.
    """
    _check_matrix(w)
    return _wide_gradient(w) if cpu_tuning else w


# ----------------------------------------------------------------------------- attention matmuls

def matmul(precision: Any) -> Callable:
    """``jnp.einsum`` with fp32 accumulation and output at ``precision``."""
    return functools.partial(jnp.einsum, precision=precision, preferred_element_type=jnp.float32)


def _t(x: Array) -> Array:
    return jnp.swapaxes(x, -1, -2)


def _plain_scores(q: Array, k: Array, precision) -> Array:
    return matmul(precision)("BKRH,BKSH->BKRS", q, k)


def _plain_values(p: Array, v: Array, precision) -> Array:
    return matmul(precision)("BKRS,BKSH->BKRH", p, v)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _scores(q: Array, k: Array, precision) -> Array:
    return _plain_scores(q, k, precision)


@_scores.defjvp
def _scores_jvp(precision, primals, tangents):
    (q, k), (dq, dk) = primals, tangents
    dot = matmul(precision)

    def transposed(dk, q):
        # the dk term as (B, K, S, R), transposed after the barrier: reverse mode then
        # contracts the transposed (R, S) cotangent with q as an (S, R) x (R, H) product
        return _t(jax.lax.optimization_barrier(dot("BKSH,BKRH->BKSR", dk, q)))

    dk_term = on_cpu(transposed, lambda dk, q: dot("BKRH,BKSH->BKRS", q, dk), dk, q)
    return _scores(q, k, precision), dot("BKRH,BKSH->BKRS", dq, k) + dk_term


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _values(p: Array, v: Array, precision) -> Array:
    return _plain_values(p, v, precision)


@_values.defjvp
def _values_jvp(precision, primals, tangents):
    (p, v), (dp, dv) = primals, tangents
    dot = matmul(precision)
    # p transposed behind a barrier: XLA folds the outer transpose into the dot, so that
    # dV = p^T dO reads p^T rows
    rows = on_cpu(lambda p: _t(jax.lax.optimization_barrier(_t(p))), _identity, p)
    tangent = dot("BKRS,BKSH->BKRH", dp, v) + dot("BKRS,BKSH->BKRH", rows, dv)
    return _values(p, v, precision), tangent


def attention_scores(q: Array, k: Array, precision: Any = None, cpu_tuning: bool = True) -> Array:
    """Logits (B, K, R, S) fp32 of queries (B, K, R, H) against keys (B, K, S, H).

    On the CPU, reverse mode computes dK = dS^T Q as an ordinary (S, R) x (R, H) product of
    a materialised transpose; XLA:CPU otherwise contracts the rows of both operands in a
    slower kernel.
    """
    return _scores(q, k, precision) if cpu_tuning else _plain_scores(q, k, precision)


def attention_values(p: Array, v: Array, precision: Any = None, cpu_tuning: bool = True) -> Array:
    """Weights (B, K, R, S) times values (B, K, S, Hv): (B, K, R, Hv) fp32; on the CPU,
    dV = P^T dO reads a materialised P^T (see :func:`attention_scores`)."""
    return _values(p, v, precision) if cpu_tuning else _plain_values(p, v, precision)
