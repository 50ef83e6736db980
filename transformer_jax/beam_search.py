"""Greedy and beam search for encoder-decoder models, with the KV cache, in one jitted loop.

Each search is one ``jax.jit``-compiled function: encode once, create the decoder cache,
then a ``lax.while_loop`` over decode steps on fixed-size buffers, so no token triggers a
recompilation; calls with the same model, batch and source shape, ``max_new_tokens``,
beam count and eos presence reuse the compiled program (length penalty, early stopping
and the special ids are traced values).

Model protocol (``T5`` and ``Transformer`` follow it):
  * ``module.apply({"params": p}, input_ids, attention_mask, method="encode")`` -> (B, S, D);
  * ``module.apply({"params": p, "cache": c}, tokens, encoded, attention_mask, decode=True,
    method="decode", mutable=["cache"])`` appends ``tokens`` (B, T) to the decoder's KV cache
    and returns logits (B, T, V). The cache is created by the same call without a ``cache``
    collection, on decoder inputs of the full length L (their values are not used);
  * ``module.config.decoder_start_token_id``, ``eos_token_id``, ``pad_token_id`` supply the
    defaults of the special ids.
Every cache leaf whose leading axis is the batch (B * beams) is reordered when beams are
reselected; scalars (write positions) are shared.

Outputs hold the *generated* tokens only (the decoder start token is not repeated):
(B, max_new_tokens) int32, each row ending at its first ``eos`` and filled with ``pad``
after it.

Beam search is Hugging Face's (``generate(num_beams=k, do_sample=False)``, transformers
>= 4.50 vectorised version), step for step:
  * every step scores the ``K = 2k`` best continuations of all live beams by their summed
    log-probabilities (``log_softmax`` of fp32 logits);
  * a continuation that emits ``eos`` (or reaches ``max_new_tokens``) and ranks among the
    best ``k`` of those K becomes a finished hypothesis with score
    ``sum_logprobs / len ** length_penalty``, ``len`` = number of generated tokens
    including the ``eos`` (the decoder start token not counted); the ``k`` best finished
    hypotheses are kept;
  * the ``k`` best continuations that did not finish stay live (unnormalised scores);
  * ``early_stopping=True``: a sentence stops once it has ``k`` finished hypotheses.
    ``False``: it stops when the best live beam, normalised with its current length, cannot
    beat the worst kept hypothesis. ``"never"``: the same test, but with the most
    favourable length (``max_new_tokens`` when ``length_penalty > 0``) — the canonical
    beam search when ``length_penalty`` is 0;
  * the loop ends when no sentence can improve, or (``early_stopping=True``) every
    sentence is done, or at ``max_new_tokens``. The result is the best finished hypothesis.
``length_penalty > 0`` favours longer outputs, ``< 0`` shorter ones, ``0`` compares raw
log-probabilities.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .errors import UserError
from .models.base import check_id_range, check_special_id

Array = jax.Array

_NEG = -1.0e9     # HF's "impossible" score offset (exact in fp32)


class BeamSearchOutput(NamedTuple):
    """sequences (B, L) and scores (B,): the best hypothesis per input; beam_sequences
    (B, k, L) and beam_scores (B, k): the k kept hypotheses, best first (unfilled slots have
    scores near -1e9)."""
    sequences: Array
    scores: Array
    beam_sequences: Array
    beam_scores: Array


# ----------------------------------------------------------------------------- model calls

def _encode(module, params, input_ids, mask):
    return module.apply({"params": params}, input_ids, mask, method="encode")


def init_decoder_cache(module, params, encoded: Array, attention_mask: Array, length: int):
    """The decoder cache for ``length`` positions (cross-attention keys/values filled)."""
    tokens = jnp.zeros((encoded.shape[0], length), jnp.int32)
    _, state = module.apply({"params": params}, tokens, encoded, attention_mask, decode=True,
                            method="decode", mutable=["cache"])
    return state["cache"]


def _decode_step(module, params, cache, tokens, encoded, mask):
    """tokens (B,) -> next-token logits (B, V) fp32 and the updated cache."""
    logits, state = module.apply({"params": params, "cache": cache}, tokens[:, None], encoded,
                                 mask, decode=True, method="decode", mutable=["cache"])
    return logits[:, -1].astype(jnp.float32), state["cache"]


def _reorder(cache, index: Array):
    """Gather the batch rows ``index`` of every batch-major cache leaf."""
    n = index.shape[0]
    return jax.tree_util.tree_map(
        lambda x: jnp.take(x, index, axis=0) if x.ndim >= 1 and x.shape[0] == n else x, cache)


# ----------------------------------------------------------------------------- arguments

def _prepare(module, input_ids, attention_mask, max_new_tokens, eos_id, pad_id, start_id):
    cfg = module.config
    given, input_ids = input_ids, jnp.asarray(input_ids)
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise UserError(f"input_ids must be (B, S) with S >= 1; got shape {input_ids.shape}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise UserError(f"input_ids must be integer token ids; got dtype {input_ids.dtype}")
    vocab = getattr(cfg, "vocab_size", None) is not None
    if vocab:        # on the host, before anything is compiled; padding included
        check_id_range("input_ids", given if isinstance(given, np.ndarray) else input_ids, cfg)
    if attention_mask is None:
        attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    attention_mask = jnp.asarray(attention_mask).astype(jnp.int32)
    if attention_mask.shape != input_ids.shape:
        raise UserError(f"attention_mask shape {attention_mask.shape} != input_ids shape "
                        f"{input_ids.shape}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    max_len = getattr(cfg, "max_len", None)
    if max_len is not None and max_new_tokens > max_len:
        raise UserError(f"max_new_tokens={max_new_tokens} exceeds the model's max_len={max_len} "
                        "(decoder positions)")
    eos_id = getattr(cfg, "eos_token_id", None) if eos_id is None else eos_id
    pad_id = getattr(cfg, "pad_token_id", 0) if pad_id is None else pad_id
    start_id = getattr(cfg, "decoder_start_token_id", pad_id) if start_id is None else start_id
    if vocab:
        check_special_id("decoder_start_id", start_id, cfg, "every output starts from it")
    return input_ids.astype(jnp.int32), attention_mask, int(max_new_tokens), eos_id, pad_id, start_id


def _ids(eos_id, pad_id, start_id):
    """The special ids as traced int32 scalars (so other ids reuse the compiled program)."""
    return (jnp.int32(0 if eos_id is None else eos_id), jnp.int32(pad_id), jnp.int32(start_id))


# ----------------------------------------------------------------------------- greedy

@functools.partial(jax.jit, static_argnames=("module", "max_new_tokens", "use_eos"))
def _greedy(module, params, input_ids, mask, eos_id, pad_id, start_id, *, max_new_tokens, use_eos):
    b = input_ids.shape[0]
    encoded = _encode(module, params, input_ids, mask)
    cache = init_decoder_cache(module, params, encoded, mask, max_new_tokens)

    def cond(carry):
        i, _, _, finished, _ = carry
        return (i < max_new_tokens) & ~jnp.all(finished)

    def body(carry):
        i, cache, tok, finished, out = carry
        logits, cache = _decode_step(module, params, cache, tok, encoded, mask)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if use_eos:
            nxt = jnp.where(finished, pad_id, nxt)
            finished = finished | (nxt == eos_id)
        out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, i))
        return i + 1, cache, nxt, finished, out

    carry = (jnp.array(0), cache, jnp.full((b,), start_id, jnp.int32), jnp.zeros((b,), bool),
             jnp.full((b, max_new_tokens), pad_id, jnp.int32))
    return jax.lax.while_loop(cond, body, carry)[-1]


def greedy_search(module, params, input_ids, attention_mask=None, *, max_new_tokens: int,
                  eos_id: int | None = None, pad_id: int | None = None,
                  decoder_start_id: int | None = None) -> Array:
    """Greedy decoding: (B, S) source ids -> (B, max_new_tokens) generated ids.

    Equals HF's ``generate(do_sample=False, num_beams=1, max_new_tokens=...)`` minus the
    leading decoder start token. ``attention_mask`` (B, S): 1 = real source token. Special
    ids default to the model config's. Source ids (padding included) and the decoder start
    id outside the model's vocabulary are a UserError before anything runs (also for
    :func:`beam_search`).
    """
    input_ids, mask, n, eos_id, pad_id, start_id = _prepare(
        module, input_ids, attention_mask, max_new_tokens, eos_id, pad_id, decoder_start_id)
    return _greedy(module, params, input_ids, mask, *_ids(eos_id, pad_id, start_id),
                   max_new_tokens=n, use_eos=eos_id is not None)


# ----------------------------------------------------------------------------- beam search

def _gather(x: Array, index: Array) -> Array:
    """x (B, M, ...) rows ``index`` (B, K) along axis 1 -> (B, K, ...)."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1)


@functools.partial(jax.jit, static_argnames=("module", "num_beams", "max_new_tokens", "use_eos"))
def _beam(module, params, input_ids, mask, norm, stop_when_full, best_at_max_len, eos_id, pad_id,
          start_id, *, num_beams, max_new_tokens, use_eos):
    """norm (L,) fp32: len ** length_penalty for len = 1..L; stop_when_full: early_stopping is
    True; best_at_max_len: early_stopping == "never" and length_penalty > 0 (traced, so the
    options share one compiled program)."""
    b, k, steps = input_ids.shape[0], num_beams, max_new_tokens
    keep = 2 * k                                     # HF: max(2, 1 + number of eos ids) * k
    top_mask = jnp.arange(keep) < k                  # only the best k continuations may finish

    encoded = _encode(module, params, input_ids, mask)
    encoded = jnp.repeat(encoded, k, axis=0)         # (B k, S, D): beams of one input adjacent
    mask = jnp.repeat(mask, k, axis=0)
    cache = init_decoder_cache(module, params, encoded, mask, steps)

    def cond(carry):
        return (carry[0] < steps) & carry[1]

    def body(carry):
        (i, _, cache, tok, run_seq, run_scores, seqs, scores, finished, open_) = carry
        logits, cache = _decode_step(module, params, cache, tok, encoded, mask)
        vocab = logits.shape[-1]
        logp = jax.nn.log_softmax(logits, axis=-1).reshape(b, k, vocab) + run_scores[..., None]
        top_lp, top_idx = jax.lax.top_k(logp.reshape(b, k * vocab), keep)        # (B, K)
        src_beam, new_tok = top_idx // vocab, (top_idx % vocab).astype(jnp.int32)
        top_seq = _gather(run_seq, src_beam)                                      # (B, K, L)
        top_seq = jnp.where(jnp.arange(steps) == i, new_tok[..., None], top_seq)
        hits = jnp.broadcast_to(i + 1 >= steps, new_tok.shape)
        if use_eos:
            hits = hits | (new_tok == eos_id)

        # live beams for the next step: the k best continuations that did not finish
        live_lp = top_lp + hits.astype(jnp.float32) * _NEG
        nxt = jax.lax.top_k(live_lp, k)[1]                                        # (B, k)
        run_seq, run_scores = _gather(top_seq, nxt), _gather(live_lp, nxt)
        parent = _gather(src_beam, nxt)

        # finished hypotheses: merge the new ones into the k best kept so far
        done_now = hits & top_mask[None, :]
        fin_lp = top_lp / norm[i]
        full = jnp.all(finished, -1, keepdims=True) & stop_when_full
        fin_lp = fin_lp + full.astype(jnp.float32) * _NEG
        fin_lp = fin_lp + (~open_).astype(jnp.float32) * _NEG
        fin_lp = fin_lp + (~done_now).astype(jnp.float32) * _NEG
        sel = jax.lax.top_k(jnp.concatenate([scores, fin_lp], 1), k)[1]
        seqs = _gather(jnp.concatenate([seqs, top_seq], 1), sel)
        scores = _gather(jnp.concatenate([scores, fin_lp], 1), sel)
        finished = _gather(jnp.concatenate([finished, done_now], 1), sel)

        cache = _reorder(cache, (jnp.arange(b)[:, None] * k + parent).reshape(-1))
        tok = run_seq[:, :, i].reshape(-1)

        # can the best live beam still beat the worst kept hypothesis?
        best_norm = jnp.where(best_at_max_len, norm[steps - 1], norm[i])
        best_live = run_scores[:, :1] / best_norm
        worst = jnp.where(finished, jnp.min(scores, axis=1, keepdims=True), _NEG)
        open_ = open_ & jnp.any(best_live > worst, axis=-1, keepdims=True)
        go = jnp.any(open_) & ~(jnp.all(finished) & stop_when_full) & ~jnp.all(hits)
        return (i + 1, go, cache, tok, run_seq, run_scores, seqs, scores, finished, open_)

    fill = jnp.full((b, k, steps), pad_id, jnp.int32)
    run_scores = jnp.where(jnp.arange(k) == 0, 0.0, _NEG).astype(jnp.float32)
    carry = (jnp.array(0), jnp.array(True), cache, jnp.full((b * k,), start_id, jnp.int32), fill,
             jnp.broadcast_to(run_scores, (b, k)), fill, jnp.full((b, k), _NEG, jnp.float32),
             jnp.zeros((b, k), bool), jnp.ones((b, 1), bool))
    carry = jax.lax.while_loop(cond, body, carry)
    seqs, scores = carry[6], carry[7]
    return BeamSearchOutput(seqs[:, 0], scores[:, 0], seqs, scores)


def beam_search(module, params, input_ids, attention_mask=None, *, num_beams: int,
                max_new_tokens: int, length_penalty: float = 1.0,
                early_stopping: bool | str = False, eos_id: int | None = None,
                pad_id: int | None = None, decoder_start_id: int | None = None) -> BeamSearchOutput:
    """Beam search (see the module docstring): (B, S) source ids -> :class:`BeamSearchOutput`.

    Equals HF's ``generate(num_beams=num_beams, do_sample=False, length_penalty=...,
    early_stopping=..., max_new_tokens=...)`` (sequences minus the decoder start token;
    ``scores`` are HF's ``sequences_scores``). With ``num_beams=1`` and ``early_stopping``
    True or False the result is the greedy one (``"never"`` with a positive length penalty may
    keep a lower-scoring beam running past an eos that greedy would stop at).
    """
    if not isinstance(num_beams, (int, np.integer)) or num_beams < 1:
        raise UserError(f"num_beams must be an int >= 1, got {num_beams!r}")
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise UserError(f"early_stopping must be True, False or 'never' (HF's options), got "
                        f"{early_stopping!r}")
    try:
        length_penalty = float(length_penalty)
    except (TypeError, ValueError):
        raise UserError(f"length_penalty must be a number, got {length_penalty!r}") from None
    input_ids, mask, n, eos_id, pad_id, start_id = _prepare(
        module, input_ids, attention_mask, max_new_tokens, eos_id, pad_id, decoder_start_id)
    vocab = getattr(module.config, "vocab_size", None)
    if vocab is not None and 2 * num_beams > num_beams * vocab:
        raise UserError(f"num_beams={num_beams} needs a vocabulary of at least 2 tokens")
    # len ** length_penalty in double, rounded once to fp32, as HF divides fp32 scores by the
    # Python float.
    norm = np.array([float(length) ** length_penalty for length in range(1, n + 1)], np.float32)
    return _beam(module, params, input_ids, mask, jnp.asarray(norm),
                 jnp.asarray(early_stopping is True),
                 jnp.asarray(early_stopping == "never" and length_penalty > 0.0),
                 *_ids(eos_id, pad_id, start_id), num_beams=int(num_beams), max_new_tokens=n,
                 use_eos=eos_id is not None)


def strip_after_eos(sequences: Any, eos_id: int | None) -> list[list[int]]:
    """(B, L) ids -> lists cut after the first ``eos`` (kept) — for decoding to text."""
    rows = []
    for row in np.asarray(sequences).tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        rows.append(row)
    return rows
