"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling.

The whole loop (prefill + every new token) is one jitted function: a ``lax.while_loop``
over a fixed-size cache, so no token triggers a recompilation. Calls with the same
(batch, prompt length, max_new_tokens, sampling mode) reuse the compiled program.

Decoder-only models work here when they follow this protocol (``GPT`` does):
  * ``module.config.max_len``: the longest sequence the model accepts;
  * ``module.apply(variables, ids, attention_mask=..., position_ids=..., decode=True,
    mutable=["cache"])`` appends ``ids`` (B, T) to the KV cache held in the ``cache``
    collection and returns logits (B, T, V); ``attention_mask`` is (B, S_max), 1 = real
    token, over the whole cache.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .errors import UserError
from .models.base import ID_ADVICE, check_id_range, check_special_id, id_range_message

Array = jax.Array


def argmax(x: Array) -> Array:
    """``jnp.argmax(x, axis=-1)`` as int32, computed with two plain reductions.

    The first index of the maximum (ties and NaN as ``jnp.argmax``: a NaN counts as the
    maximum). XLA:CPU runs ``jnp.argmax`` as one (value, index) reduction that is ~6x
    slower than a max followed by a min over the matching indices, e.g. over GPT-2's
    50257 logits at batch 16; on GPU/TPU both are cheap.
    """
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x == top
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(hit, index, x.shape[-1]), axis=-1)


def sample_logits(logits: Array, rng: Array | None, *, temperature: float | Array = 0.0,
                  top_k: int | None = None, top_p: float | Array | None = None,
                  greedy: bool | None = None) -> Array:
    """Pick next tokens from logits (B, V) -> (B,) int32.

    ``greedy`` (default: ``temperature == 0``) takes the argmax. Otherwise logits are divided
    by ``temperature``; ``top_k`` keeps the k largest; ``top_p`` keeps the smallest set of
    most likely tokens whose probability reaches p (the most likely token is always kept);
    then one token is drawn.
    """
    if greedy is None:
        greedy = isinstance(temperature, (int, float)) and temperature == 0.0
    logits = logits.astype(jnp.float32)
    if greedy:
        return argmax(logits)
    if rng is None:
        raise UserError("sampling (temperature > 0) needs an rng: pass rng=jax.random.PRNGKey(seed)")
    logits = logits / temperature
    neg = jnp.finfo(jnp.float32).min
    if top_k is not None:
        if top_k < 1:
            raise UserError(f"top_k must be >= 1, got {top_k}")
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs       # mass of strictly better tokens
        keep = mass_before < top_p
        keep = keep.at[..., 0].set(True)
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < threshold, neg, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def check_prompt_ids(module, prompt_ids, pad_id: int | None = None) -> None:
    """Prompt ids in ``module.config``'s vocabulary, checked on the host (before anything
    is compiled or run): a (B, T0) array, or ragged rows (the error's position ``[i, j]``
    is ``prompt_ids[i][j]``), whose shorter rows are left-padded with ``pad_id``. A module
    whose config has no ``vocab_size`` is not checked."""
    config = getattr(module, "config", None)
    if getattr(config, "vocab_size", None) is None:
        return
    if hasattr(prompt_ids, "shape"):
        check_id_range("prompt_ids", prompt_ids, config)
        return
    rows = [np.asarray(r, np.int64).reshape(-1) for r in prompt_ids]
    size = config.vocab_size
    bad = [(i, int(j)) for i, r in enumerate(rows) for j in np.flatnonzero((r < 0) | (r >= size))]
    if bad:
        (i, j), total = bad[0], sum(r.size for r in rows)
        raise UserError(id_range_message(
            "prompt_ids", (i, j), int(rows[i][j]), len(bad), total, size,
            f"{type(config).__name__}.vocab_size", ID_ADVICE["vocab_size"]))
    if len({len(r) for r in rows}) > 1:
        check_special_id("pad_id", pad_id, config, "it left-pads the shorter prompts")


def decodes_past_max_len(config) -> bool:
    """Whether a model decodes on past its ``max_len``: a sliding window (``attention_window``:
    a ring of W cache slots) over rotary positions (no position table to run out of), without
    a prefix (which the cache's creation sizes against ``max_len``)."""
    return (getattr(config, "attention_window", None) is not None
            and getattr(config, "position", None) == "rope"
            and getattr(config, "attention", "softmax") == "softmax"
            and not getattr(config, "prefix_tokens", 0))


def init_cache(module, batch_size: int, max_len: int) -> Any:
    """A zero KV cache for ``batch_size`` sequences of up to ``max_len`` tokens (no params built)."""
    shapes = jax.eval_shape(
        lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((batch_size, max_len), jnp.int32),
                            decode=True))["cache"]
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def eos_ids(eos_id: int | Sequence[int] | None) -> tuple[int, ...]:
    """``generate``'s ``eos_id`` as a tuple of ids: () for None, one id, or several (a
    checkpoint's ``generation_config.json`` may name several, e.g. Llama 3 Instruct's
    ``<|eot_id|>`` and ``<|end_of_text|>``)."""
    if eos_id is None:
        return ()
    if isinstance(eos_id, (int, np.integer)):
        return (int(eos_id),)
    return tuple(int(i) for i in eos_id)


@functools.partial(jax.jit, static_argnames=("module", "max_new_tokens", "greedy", "top_k",
                                             "use_top_p", "eos_id", "pad_id"))
def jitted_generate(module, params, prompt, prompt_mask, rng, temperature, top_p, *,
                    max_new_tokens, greedy, top_k, use_top_p, eos_id, pad_id):
    """The compiled decoding loop behind :func:`generate` (its arguments already checked;
    ``eos_id``: None, an id or a tuple of ids, :func:`eos_ids`)."""
    b, t0 = prompt.shape
    total = t0 + max_new_tokens
    cache = init_cache(module, b, total)
    mask = jnp.concatenate([prompt_mask, jnp.ones((b, max_new_tokens), prompt_mask.dtype)], axis=1)
    # Positions count real tokens only, so left-padded prompts get the positions they
    # would have had without padding (as HF's generate does).
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    logits, state = module.apply({"params": params, "cache": cache}, prompt,
                                 attention_mask=mask, position_ids=positions, decode=True,
                                 mutable=["cache"])
    pick = functools.partial(sample_logits, temperature=temperature, top_k=top_k,
                             top_p=top_p if use_top_p else None, greedy=greedy)

    def cond(carry):
        i, _, _, _, _, finished, _ = carry
        return (i < max_new_tokens) & ~jnp.all(finished)

    def body(carry):
        i, cache, last_logits, pos, rng, finished, out = carry
        rng, step_rng = jax.random.split(rng)
        tok = pick(last_logits, step_rng)
        tok = jnp.where(finished, pad_id, tok)
        out = jax.lax.dynamic_update_slice(out, tok[:, None], (0, i))
        for stop in eos_ids(eos_id):
            finished = finished | (tok == stop)
        logits, state = module.apply({"params": params, "cache": cache}, tok[:, None],
                                     attention_mask=mask, position_ids=pos[:, None], decode=True,
                                     mutable=["cache"])
        return i + 1, state["cache"], logits[:, -1], pos + 1, rng, finished, out

    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32)
    carry = (jnp.array(0), state["cache"], logits[:, -1], positions[:, -1] + 1, rng,
             jnp.zeros((b,), bool), out)
    carry = jax.lax.while_loop(cond, body, carry)
    return jnp.concatenate([prompt, carry[-1]], axis=1)


def generate(module, params, prompt_ids: Array | Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             rng: Array | None = None, eos_id: int | Sequence[int] | None = None,
             pad_id: int | None = None, prompt_mask: Array | None = None):
    """Extend prompts by ``max_new_tokens`` tokens with the KV cache.

    Args:
      module, params: a decoder-only model (see the module docstring) and its parameters.
      prompt_ids: (B, T0) ints, or a list of token lists of different lengths (then they are
        left-padded internally and the result is a list of lists). An id outside
        ``module.config.vocab_size`` is a UserError before anything runs
        (:func:`check_prompt_ids`).
      max_new_tokens: how many tokens to add; T0 + max_new_tokens must fit ``max_len``,
        unless the model decodes past it (:func:`decodes_past_max_len`: a sliding window
        over RoPE positions), where only the prompt must.
      temperature: 0 = greedy; otherwise sample from softmax(logits / temperature).
      top_k, top_p: restrict sampling to the k most likely tokens / the nucleus of mass p.
      rng: a PRNG key; required when sampling.
      eos_id: once a row emits it (or, for a list of ids, any of them: where transformers'
        ``generate`` stops with a list as ``eos_token_id``), the rest of that row is
        ``pad_id`` and the loop stops early when every row has finished.
      pad_id: filler after eos and for internal left padding (default: the (first) eos_id,
        else 0).
      prompt_mask: (B, T0), 1 = real token, for prompts that are already left-padded.

    Returns:
      (B, T0 + max_new_tokens) int32: the prompt followed by the new tokens; for list input,
      a list of lists holding each prompt and its new tokens (cut after the first eos).
    """
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    greedy = temperature == 0.0
    if not greedy and rng is None:
        raise UserError("sampling (temperature > 0) needs an rng: pass rng=jax.random.PRNGKey(seed)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p must be in (0, 1], got {top_p}")
    stops = eos_ids(eos_id)
    pad_id = pad_id if pad_id is not None else (stops[0] if stops else 0)

    ragged = not hasattr(prompt_ids, "shape")
    if ragged:
        rows = [list(map(int, r)) for r in prompt_ids]
        if not rows or min(map(len, rows)) == 0:
            raise UserError("every prompt needs at least one token")
        t0 = max(map(len, rows))
        check_prompt_ids(module, rows, pad_id)
        ids = np.full((len(rows), t0), pad_id, np.int32)
        pmask = np.zeros((len(rows), t0), np.int32)
        for i, r in enumerate(rows):
            ids[i, t0 - len(r):] = r
            pmask[i, t0 - len(r):] = 1
        prompt, prompt_mask = jnp.asarray(ids), jnp.asarray(pmask)
    else:
        prompt = jnp.asarray(prompt_ids, jnp.int32)
        if prompt.ndim != 2 or prompt.shape[1] == 0:
            raise UserError(f"prompt_ids must be (B, T0) with T0 >= 1; got shape {prompt.shape}")
        # the ids as given (before the int32 cast), padding under prompt_mask included
        check_prompt_ids(module, prompt_ids if isinstance(prompt_ids, np.ndarray) else prompt)
        prompt_mask = (jnp.ones_like(prompt) if prompt_mask is None
                       else jnp.asarray(prompt_mask, jnp.int32))
        if prompt_mask.shape != prompt.shape:
            raise UserError(f"prompt_mask shape {prompt_mask.shape} != prompt shape {prompt.shape}")
    max_len = module.config.max_len
    if prompt.shape[1] > max_len or (prompt.shape[1] + max_new_tokens > max_len
                                     and not decodes_past_max_len(module.config)):
        raise UserError(f"prompt length {prompt.shape[1]} + max_new_tokens {max_new_tokens} exceeds "
                        f"the model's max_len={max_len}")

    out = jitted_generate(module, params, prompt, prompt_mask,
                              rng if rng is not None else jax.random.PRNGKey(0),
                              jnp.float32(temperature if not greedy else 1.0),
                              jnp.float32(top_p if top_p is not None else 1.0),
                              max_new_tokens=max_new_tokens, greedy=greedy, top_k=top_k,
                              use_top_p=top_p is not None, eos_id=stops, pad_id=pad_id)
    if not ragged:
        return out
    result = []
    out_np = np.asarray(out)
    t0 = prompt.shape[1]
    for i, r in enumerate(rows):
        new = out_np[i, t0:].tolist()
        end = next((j for j, tok in enumerate(new) if tok in stops), None)
        if end is not None:
            new = new[: end + 1]
        result.append(r + new)
    return result
