"""Losses: label-smoothed cross-entropy as sums, and the token loss every task shares.

A loss function (:data:`LossFn`) maps ``(apply_fn, params, batch, rngs, deterministic,
smoothing)`` to ``(loss_sum, sums)``: the objective summed over tokens (or examples) and
named sums (at least ``weight``; usually ``nll`` and ``correct``). Sums rather than means
let gradient accumulation and data-parallel shards combine exactly: add the pieces, then
divide once by the total weight (:func:`mean_loss`, :func:`per_weight_means`). A loss that
counts two kinds of things names a second weight, ``X_weight``, for its ``X_*`` sums
(:func:`metric_names`).

Shapes: B batch, T length, D model width, N tokens, V vocabulary (or classes); ``...`` any
leading axes.

Chunked read-out (:func:`chunked_cross_entropy`): with a ``loss_chunk`` the task losses ask
the model for its final hidden states and read-out weights (``return_hidden=True``) instead
of its logits, and compute the logits, the loss and their gradients ``loss_chunk`` positions
of every row at a time: the (B, T, V) float32 logits and their gradient never exist whole.
The project has no z-loss.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import jax
import jax.numpy as jnp

from .errors import UserError

Array = jax.Array

# (apply_fn, params, batch, rngs, deterministic, smoothing) -> (loss_sum, sums)
LossFn = Callable[..., tuple[Array, dict[str, Array]]]

__all__ = ["LossFn", "target_logits", "label_smoothed_cross_entropy", "mean_loss",
           "token_loss", "chunked_cross_entropy", "head_loss", "hidden_kwargs", "metric_names",
           "per_weight_means", "packed_kwargs", "lm_loss"]


def target_logits(logits: Array, targets: Array) -> tuple[Array, Array]:
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


def label_smoothed_cross_entropy(logits: Array, targets: Array, weights: Optional[Array] = None,
                                 smoothing: float = 0.0) -> tuple[Array, Array]:
    """``(loss_sum, weight_sum)``: weighted, label-smoothed cross-entropy summed over tokens.

    The target distribution puts ``1 - smoothing`` on the target plus ``smoothing / V`` on
    every class (torch's ``cross_entropy(..., label_smoothing=smoothing)``), so per token
    ``loss = (1 - smoothing) * -log p[target] + smoothing * mean_v(-log p[v])``, computed
    in float32 whatever the dtype of ``logits`` (..., V). ``targets`` (...) at zero weight
    may hold anything (padding, -100); ``weights`` (...) default to ones.
    """
    if not 0.0 <= smoothing <= 1.0:
        raise UserError(f"smoothing must be in [0, 1], got {smoothing}")
    if logits.shape[:-1] != targets.shape:
        raise UserError(f"logits {logits.shape} and targets {targets.shape} disagree: "
                        "expected logits.shape == targets.shape + (V,)")
    logits = logits.astype(jnp.float32)
    # -log p[v] = lse - logits[v] (no (..., V) log-probs are stored)
    lse = jax.nn.logsumexp(logits, axis=-1)
    per_token = lse - target_logits(logits, targets)[0]
    if smoothing:
        per_token = (1.0 - smoothing) * per_token + smoothing * (lse - jnp.mean(logits, axis=-1))
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    elif weights.shape != targets.shape:
        raise UserError(f"weights {weights.shape} must have the shape of targets {targets.shape}")
    weights = weights.astype(jnp.float32)
    # Select rather than multiply, so that non-finite losses at masked positions (e.g. -inf
    # logits on padding) cannot leak in as NaN.
    loss_sum = jnp.sum(jnp.where(weights != 0, per_token * weights, 0.0))
    return loss_sum, jnp.sum(weights)


def mean_loss(loss_sum: Array, weight_sum: Array) -> Array:
    """``loss_sum / weight_sum``, or 0 when ``weight_sum`` is 0."""
    weight_sum = jnp.asarray(weight_sum, jnp.float32)
    safe = jnp.where(weight_sum > 0, weight_sum, 1.0)
    return jnp.where(weight_sum > 0, loss_sum / safe, 0.0)


def token_loss(logits: Array, targets: Array, weights: Array | None, smoothing: float):
    """Cross-entropy terms for logits (..., V) and integer targets (...): (loss_sum, sums).

    sums: ``weight`` (tokens counted), ``nll`` (plain cross-entropy sum) and ``correct``
    (hits: the target holds the top logit), so that a step reports loss, nll and accuracy
    per token. Every task's loss function ends here.
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


def chunked_cross_entropy(hidden: Array, kernel: Array, targets: Array,
                          weights: Array | None = None, smoothing: float = 0.0, *,
                          bias: Array | None = None, softcap: float | None = None,
                          chunk: int = 128, precision: Any = None):
    """:func:`token_loss` of the logits ``hidden @ kernel (+ bias)`` (then ``softcap *
    tanh(logits / softcap)``), computed ``chunk`` positions of every row at a time:
    ``(loss_sum, sums)``.

    hidden (..., T, D) (or (N, D): one row) in the compute dtype; kernel (D, V) (a tied
    read-out: the embedding transposed, whose gradient then reaches the embedding); bias
    (V,); targets and weights (..., T). The rows' T axis is padded to whole chunks (at weight
    0) and scanned, the batch axis kept whole in each chunk (a batch sharded over devices stays
    so); each chunk's (..., chunk, V) float32 logits are recomputed in the backward pass
    (``jax.checkpoint``), which accumulates the gradients of ``hidden``, ``kernel`` and
    ``bias``. Sums as :func:`token_loss`: ``weight``, ``nll``, ``correct``.
    """
    if not 0.0 <= smoothing <= 1.0:
        raise UserError(f"smoothing must be in [0, 1], got {smoothing}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise UserError(f"loss_chunk={chunk!r} must be a positive int (positions per chunk), "
                        "or 0 for the plain loss")
    if hidden.shape[:-1] != targets.shape or kernel.shape[:1] != hidden.shape[-1:]:
        raise UserError(f"hidden {hidden.shape}, kernel {kernel.shape} and targets "
                        f"{targets.shape} disagree: expected (..., D), (D, V) and (...)")
    if weights is None:
        weights = jnp.ones(targets.shape, jnp.float32)
    elif weights.shape != targets.shape:
        raise UserError(f"weights {weights.shape} must have the shape of targets {targets.shape}")
    d, t_len = hidden.shape[-1], max(targets.shape[-1], 1)
    h = hidden.reshape((-1, t_len, d))                               # (B, T, D)
    t = targets.reshape((-1, t_len)).astype(jnp.int32)
    w = weights.reshape((-1, t_len)).astype(jnp.float32)
    size = min(chunk, t_len)
    count = -(-t_len // size)
    pad = count * size - t_len
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        t, w = jnp.pad(t, ((0, 0), (0, pad))), jnp.pad(w, ((0, 0), (0, pad)))

    @jax.checkpoint   # save only the chunk's inputs; its logits are recomputed
    def piece(kernel, bias, h, t, w):
        logits = jnp.dot(h, kernel.astype(h.dtype), precision=precision,
                         preferred_element_type=jnp.float32)          # (B, chunk, V)
        if bias is not None:
            logits = logits + bias.astype(jnp.float32)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit, in_range = target_logits(logits, t)
        nll = lse - target_logit
        per_token = nll
        if smoothing:
            per_token = (1.0 - smoothing) * nll + smoothing * (lse - jnp.mean(logits, axis=-1))
        keep = w != 0
        loss = jnp.sum(jnp.where(keep, per_token * w, 0.0))
        nll_sum = jax.lax.stop_gradient(jnp.sum(jnp.where(keep, nll * w, 0.0)))
        top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
        hits = in_range & (jax.lax.stop_gradient(target_logit) >= top)
        return loss, nll_sum, jnp.sum(jnp.where(hits, w, 0.0))

    def body(carry, xs):
        return tuple(a + b for a, b in zip(carry, piece(kernel, bias, *xs))), None

    def chunks(x):   # (B, count * size, ...) -> (count, B, size, ...)
        return jnp.swapaxes(x.reshape((x.shape[0], count, size) + x.shape[2:]), 0, 1)

    zero = jnp.zeros((), jnp.float32)
    (loss_sum, nll_sum, correct), _ = jax.lax.scan(body, (zero, zero, zero),
                                                   (chunks(h), chunks(t), chunks(w)))
    return loss_sum, {"weight": jnp.sum(w), "nll": nll_sum, "correct": correct}


def head_loss(out: Any, targets: Array, weights: Array | None, smoothing: float,
              loss_chunk: int = 0):
    """:func:`token_loss` of a model's output: its logits, or, with ``loss_chunk``, its
    ``(hidden, head)`` (``return_hidden=True``; head: ``kernel``, optional ``bias`` and
    ``softcap``) through :func:`chunked_cross_entropy`."""
    if not loss_chunk:
        return token_loss(out, targets, weights, smoothing)
    hidden, head = out
    return chunked_cross_entropy(hidden, head["kernel"], targets, weights, smoothing,
                                 bias=head.get("bias"), softcap=head.get("softcap"),
                                 chunk=loss_chunk)


def hidden_kwargs(loss_chunk: int) -> dict:
    """The model keywords a task loss passes: ``return_hidden=True`` with a ``loss_chunk``."""
    return {"return_hidden": True} if loss_chunk else {}


def metric_names(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """For each named sum that is not a weight: ``(metric name, the weight it is divided by)``.

    The rule: ``weight`` and every ``X_weight`` are weights (divisors, not metrics). A sum
    ``X_rest`` is divided by ``X_weight`` when that sum exists (the longest such ``X``
    wins), any other sum by ``weight``; ``correct`` is reported as ``accuracy`` and
    ``X_correct`` as ``X_accuracy``. So one loss can count two things, e.g. sentence pairs
    and masked tokens (``tasks/pretrain.py``)::

        {"weight": 8, "nll": 30, "correct": 4}              -> nll 30/8, accuracy 4/8
        {"weight": 8, "mlm_weight": 20, "mlm_correct": 5}   -> mlm_accuracy 5/20

    Used by :func:`per_weight_means` (the train step) and by the eval loop
    (``train/loop.py``), on host floats.
    """
    names = list(names)
    groups = sorted((n[: -len("_weight")] for n in names if n.endswith("_weight")),
                    key=len, reverse=True)
    out = {}
    for name in names:
        if name == "weight" or name.endswith("_weight"):
            continue
        group = next((g for g in groups if name.startswith(g + "_")), None)
        stem = name if group is None else name[len(group) + 1:]
        stem = "accuracy" if stem == "correct" else stem
        out[name] = (stem if group is None else f"{group}_{stem}",
                     "weight" if group is None else f"{group}_weight")
    return out


def per_weight_means(loss_sum: Array, sums: dict[str, Array]) -> dict[str, Array]:
    """Per-weight means: ``loss`` (per ``weight``) and each named sum, named and divided as
    :func:`metric_names` says (0 where its weight is 0)."""
    out = {"loss": mean_loss(loss_sum, sums["weight"])}
    for name, (metric, weight) in metric_names(sums).items():
        out[metric] = mean_loss(sums[name], sums[weight])
    return out


def packed_kwargs(batch: dict[str, Array], positions: str = "position_ids") -> dict[str, Array]:
    """The model keywords of packed documents, when the batch holds them: ``segment_ids``
    and its ``positions`` under the name ``positions``; else none."""
    if "segment_ids" not in batch:
        return {}
    return {"segment_ids": batch["segment_ids"], positions: batch["positions"]}


def lm_loss(apply_fn: Callable, params: Any, batch: dict[str, Array], rngs, deterministic: bool,
            smoothing: float, loss_chunk: int = 0):
    """Next-token loss: ``batch = {"inputs", "targets": (B, T) int, "weights": (B, T)}``, and
    with packed documents ``segment_ids`` and ``positions`` (B, T) int; ``loss_chunk``
    positions at a time when set (:func:`head_loss`)."""
    out = apply_fn({"params": params}, batch["inputs"], deterministic=deterministic, rngs=rngs,
                   **packed_kwargs(batch), **hidden_kwargs(loss_chunk))
    return head_loss(out, batch["targets"], batch.get("weights"), smoothing, loss_chunk)


lm_loss.chunks = True   # takes loss_chunk (train/step.py)
