"""EleutherAI's lm-evaluation-harness over a transformer_jax model: ``transformer-jax eval --tasks``.

:class:`HarnessLM` is an ``lm_eval`` language model (``lm_eval.api.model.TemplateLM``) built
from ``(module, params, tokenizer)``, or from a directory with :meth:`HarnessLM.from_dir`: a
Hugging Face ``save_pretrained`` directory or a transformer_jax workdir (its latest
checkpoint), read as ``--init-from`` reads them. It answers the harness's three requests the
way its Hugging Face backend (``lm_eval --model hf``) does, so the two report the same
numbers for the same weights (``tests/eval/test_harness.py`` checks it to 1e-4):

* ``loglikelihood(context, continuation)``: the pair is encoded as ``HFLM`` encodes it
  (``TemplateLM._encode_pair``: the context's trailing whitespace moves to the
  continuation, the whole text is encoded and split where the context's tokens end; an
  empty context is the prefix token), left-truncated to ``max_len + 1`` tokens. Requests
  are sorted by length and batched; each batch is padded on the right to one of a few
  lengths (powers of two up to ``max_len``) and rows, so that a run compiles a handful of
  programs. One jitted forward per batch returns, per row, the sum of the continuation's
  log-probabilities (float32 log-softmax, highest matmul precision) and whether every
  continuation token is the argmax.
* ``loglikelihood_rolling(text)``: the text's tokens in disjoint windows of ``max_len``
  (``lm_eval.utils.get_rolling_token_windows`` + ``make_disjoint_window``, the first
  conditioned on the prefix token: bos, else eos), each scored as above, summed.
* ``generate_until(context, gen_kwargs)``: greedy decoding with the KV cache
  (:func:`transformer_jax.decode.generate`), the context left-truncated to leave room for
  ``max_gen_toks`` (default 256), stopped at eos, the text cut at the first stop sequence
  (``until``, eos's text added). Sampling (``do_sample``/``temperature > 0``) is refused.

Families: decoder-only models (``GPTConfig``: GPT-2, Llama, Mistral, Qwen; ``GemmaConfig``:
Gemma 3). Anything else is a UserError. An encoder-decoder (T5) would need the harness's ``seq2seq`` path: the context
through the encoder, the continuation scored by the decoder from ``decoder_start_id`` (no
left truncation of the continuation, no rolling windows through the decoder), and
generation with an encoder-decoder cache; none of that is here yet.

Placement (``--dtype``, ``--mesh``): the parameters and compute are float32 by default (the
parity above) or bfloat16, and the parameters sit on a mesh as training's ``--mesh``
places them (:mod:`transformer_jax.sharding`'s logical rules): replicated over ``data``
(the default), split along their embed axis by ``fsdp`` and along heads, MLP units and
vocabulary by ``tensor``. An 8B Llama in bfloat16 over ``fsdp=8`` holds 2 GiB of
parameters per chip of a v5e-8 instead of 32 GB float32 on each.

Several processes (``jax.distributed``; a TPU pod): process 0 runs the harness, the others
call :meth:`HarnessLM.follow`. Each batch process 0 scores is broadcast first, and every
process runs the same jitted forward on it, the rows split over all devices; generation
runs the same replicated program everywhere. :func:`evaluate` does this for the CLI.

``lm_eval`` is optional: ``pip install -e '.[eval]'``. Importing this module without it is a
UserError that says so.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from . import sharding as sh
from .decode import argmax, generate
from .errors import UserError

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval import utils as lm_utils
    from lm_eval.models.utils import (handle_stop_sequences, normalize_gen_kwargs,
                                      postprocess_generated_text)
except ImportError:   # pragma: no cover - the message is the point
    raise UserError("the lm-evaluation-harness is not installed: pip install -e '.[eval]' "
                    "(or pip install 'lm_eval>=0.4.13,<0.5')") from None

#: the shortest padded length a batch of requests gets (then 2x, 4x, ... up to max_len)
MIN_BUCKET = 16
DEFAULT_BATCH_SIZE = 16
DEFAULT_MAX_GEN_TOKS = 256


def buckets(max_len: int, smallest: int = MIN_BUCKET) -> list[int]:
    """The padded lengths: powers of two from ``smallest`` below ``max_len``, then ``max_len``."""
    out, n = [], smallest
    while n < max_len:
        out.append(n)
        n *= 2
    return out + [max_len]


def bucket_of(length: int, sizes: Sequence[int]) -> int:
    """The smallest size in ``sizes`` (ascending) that holds ``length``."""
    for size in sizes:
        if length <= size:
            return size
    raise ValueError(f"length {length} exceeds the largest bucket {sizes[-1]}")


def score_tokens(module, params, tokens, targets, mask):
    """Continuation scores of a right-padded batch: the reference the harness jits.

    Args:
      tokens: (B, T) int32 model inputs (any padding after each row's last real token).
      targets: (B, T) int32, the token that follows each input position.
      mask: (B, T) bool, True at the positions whose target is a continuation token.

    Returns:
      ``(logprob, greedy)``: (B,) float32, the sum over masked positions of
      ``log_softmax(logits)[target]``; (B,) bool, whether every masked target is the argmax.
    """
    with jax.default_matmul_precision("highest"):
        logits = module.apply({"params": params}, tokens).astype(jnp.float32)   # (B, T, V)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]      # (B, T)
    logprob = jnp.sum(jnp.where(mask, picked, 0.0), axis=-1)
    greedy = jnp.all(jnp.where(mask, argmax(logits) == targets, True), axis=-1)
    return logprob, greedy


#: the dtypes ``--dtype`` takes: parameters and compute alike (float32: parity with ``--model hf``)
DTYPES = ("float32", "bfloat16")


def harness_dtype(dtype: str) -> str:
    """``dtype`` if the harness runs in it (:data:`DTYPES`), else a UserError."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one the harness runs in; choose "
                        f"{' or '.join(DTYPES)} (bfloat16 halves the parameters' memory)")
    return dtype


def harness_module(module, dtype: str):
    """``module`` rebuilt with its parameters and compute in ``dtype`` (:data:`DTYPES`)."""
    harness_dtype(dtype)
    return type(module)(module.config.replace(dtype=dtype, param_dtype=dtype))


def param_shardings(module, params, mesh: Mesh):
    """Shardings of ``params`` (concrete or abstract) on ``mesh``: each leaf by the logical
    axes the model gives it (:mod:`transformer_jax.sharding`'s rules: ``fsdp`` splits the
    embed axis, ``tensor`` heads, MLP units and vocabulary); leaves the model does not
    create (a stored quantized kernel) are replicated. Only shapes are computed."""
    boxed = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0),
                                               jnp.zeros((1, 1), jnp.int32)))["params"]
    return sh.shardings_like_params(params, nn.meta.unbox(boxed),
                                    sh.param_shardings(boxed, mesh), mesh)


def score_program(module, mesh: Mesh, param_sh):
    """The jitted :func:`score_tokens` the harness runs: ``(params, tokens, targets, mask)``
    with the parameters as ``param_sh`` places them and the rows split over ``data`` x
    ``fsdp``; its results replicated. Call (and trace) it inside ``sharding.use_mesh(mesh)``."""
    rows = sh.batch_sharding(mesh)
    return jax.jit(functools.partial(score_tokens, module),
                   in_shardings=(param_sh, rows, rows, rows),
                   out_shardings=NamedSharding(mesh, P()))


def _cast(x, dtype):
    """A floating leaf in ``dtype`` (device arrays stay on their devices, host ones on the
    host); integer leaves (quantized kernels) as they are."""
    if not isinstance(x, jax.Array):
        x = np.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
        return x
    return x.astype(dtype)


def _is_gpt(module) -> bool:
    from .models.gemma import Gemma
    from .models.gpt import GPT
    return isinstance(module, (GPT, Gemma))


class HarnessLM(TemplateLM):
    """An ``lm_eval`` model over a decoder-only transformer_jax model (module docstring).

    Args:
      module, params: a ``GPT`` and its parameters (unscanned or scanned alike).
      tokenizer: a transformer_jax tokenizer (``hf:DIR``, byte, SentencePiece).
      batch_size: rows per forward (and per generation batch).
      dtype: the parameters' and compute dtype (:data:`DTYPES`; float32 for parity with
        ``--model hf``, bfloat16 for half the memory).
      mesh: the device mesh (a ``Mesh``, or ``"fsdp=-1"`` / ``"tensor=4"`` / ... as
        training's ``--mesh``; default: every device on ``data``, the parameters
        replicated); the parameters are sharded by the model's logical axes
        (:func:`param_shardings`), the rows of each batch split over ``data`` x ``fsdp``.
    """

    def __init__(self, module, params, tokenizer, *, batch_size: int = DEFAULT_BATCH_SIZE,
                 dtype: str = "float32", mesh: str | Mesh | None = None,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
        super().__init__()
        if not _is_gpt(module):
            raise UserError(f"the lm-evaluation-harness runs decoder-only models (GPT-2, Llama, "
                            f"Mistral, Qwen, Gemma 3); this is a {type(module).__name__}")
        if batch_size < 1:
            raise UserError(f"--batch-size must be >= 1, got {batch_size}")
        self.module = harness_module(module, dtype)
        config = self.module.config
        self.tokenizer_ = tokenizer
        # the positions a sequence may use: a prefix-tuned model's prefix takes its first P
        self.max_len = config.max_len - (getattr(config, "prefix_tokens", 0) or 0)
        self._batch_size = batch_size
        self._max_gen_toks = max_gen_toks
        self.mesh = mesh if isinstance(mesh, Mesh) else sh.make_mesh(mesh)
        params = jax.tree_util.tree_map(functools.partial(_cast, dtype=jnp.dtype(dtype)),
                                        nn.meta.unbox(params))
        self.param_shardings = param_shardings(self.module, params, self.mesh)
        self.params = sh.put_global(params, self.param_shardings)
        self._score = score_program(self.module, self.mesh, self.param_shardings)
        self.buckets = buckets(self.max_len)
        self._leader = jax.process_count() > 1 and jax.process_index() == 0
        self.forwards = 0   # batches scored (for the benchmark)

    # -- construction --------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | os.PathLike, **kwargs) -> "HarnessLM":
        """From a transformer_jax workdir (its latest checkpoint as it trained: LoRA
        adapters, a prefix, a quantized base, with its run's tokenizer) or a Hugging Face
        ``save_pretrained`` directory (with its tokenizer files), streamed onto the devices
        in ``dtype`` on ``mesh`` (the host never holds the whole model)."""
        from . import storage
        from .data.tokenizers import get_tokenizer

        if (storage.path(path) / "checkpoints").is_dir():
            from .train.checkpoint import load_params

            run_config, params = load_params(path)
            family, model_config = run_config["family"], run_config["model"]
            spec = (run_config.get("task_spec") or {}).get("tokenizer")
            where = os.fspath(path)
        else:
            from .train.finetune import load_source

            # streamed tensor by tensor onto the devices, in the harness's dtype and sharding
            kwargs["mesh"] = mesh = sh.make_mesh(kwargs.get("mesh"))
            source = load_source(path, param_dtype=harness_dtype(kwargs.get("dtype", "float32")),
                                 mesh=mesh)
            family, model_config, params = source.family, source.model_config, source.params
            spec, where = source.tokenizer, source.path
        if family not in ("gpt", "gemma"):
            raise UserError(f"{where}: a {family} model; the lm-evaluation-harness runs "
                            "decoder-only models here (GPT-2, Llama, Mistral, Qwen, Gemma 3)")
        if spec is None:
            raise UserError(f"{where} holds no tokenizer (tokenizer.json, tokenizer.model, "
                            "spiece.model, or ByT5's tokenizer_config.json); save the "
                            "tokenizer with the model")
        from .models import model_from_config
        _, module = model_from_config(family, model_config)
        return cls(module, params, get_tokenizer(spec), **kwargs)

    # -- what lm_eval asks of a model ------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer_.eos_id

    @property
    def prefix_token_id(self) -> int:
        bos = getattr(self.tokenizer_, "bos_id", None)
        return bos if bos is not None else self.tokenizer_.eos_id

    @property
    def max_length(self) -> int:
        return self.max_len

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer_, "spec", type(self.tokenizer_).__name__)

    def _encode(self, text: str, special: bool) -> list[int]:
        from .data.hf_tokenizer import HFTokenizer
        if isinstance(self.tokenizer_, HFTokenizer):
            return self.tokenizer_.encode(text, add_special=special)
        return self.tokenizer_.encode(text)

    def _decode(self, ids, skip_special: bool = True) -> str:
        from .data.hf_tokenizer import HFTokenizer
        if isinstance(self.tokenizer_, HFTokenizer):
            return self.tokenizer_.decode(ids, skip_special=skip_special)
        return self.tokenizer_.decode(ids)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs) -> list[int]:
        """As ``HFLM.tok_encode``: the tokenizer's special tokens (Llama's bos) unless the
        text already starts with the prefix token's text."""
        special = True if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None:
            prefix = self._decode([self.prefix_token_id], skip_special=False)
            if prefix and string.startswith(prefix):
                special = False
        ids = self._encode(string, special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    # -- scoring -----------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        """``(sum logprob, is_greedy)`` of each ``(key, context_ids, continuation_ids)``."""
        rows = []
        for _, context, continuation in requests:
            if not context or not continuation or len(continuation) > self.max_len:
                raise UserError(f"a request with {len(context)} context and {len(continuation)} "
                                f"continuation tokens (max_len {self.max_len}) cannot be scored")
            full = (list(context) + list(continuation))[-(self.max_len + 1):]
            rows.append((full, len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self._batch_size):
            chunk = order[start:start + self._batch_size]
            scores = self._call("score", [rows[i] for i in chunk])
            for i, score in zip(chunk, scores):
                out[i] = score
        return out

    def _score_rows(self, rows: list) -> list[tuple[float, bool]]:
        """One padded batch through the jitted forward (on every process alike)."""
        split = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        b = max(self._batch_size, len(rows))
        b = -(-b // split) * split
        t = bucket_of(max(len(full) - 1 for full, _ in rows), self.buckets)
        tokens = np.zeros((b, t), np.int32)
        targets = np.zeros((b, t), np.int32)
        mask = np.zeros((b, t), bool)
        for r, (full, n_cont) in enumerate(rows):
            n = len(full) - 1
            tokens[r, :n], targets[r, :n] = full[:-1], full[1:]
            mask[r, n - n_cont:n] = True
        rows_sharding = P(sh.BATCH_AXES)
        with sh.use_mesh(self.mesh):
            logprob, greedy = self._score(self.params, self._global(tokens, rows_sharding),
                                          self._global(targets, rows_sharding),
                                          self._global(mask, rows_sharding))
        self.forwards += 1
        logprob, greedy = np.asarray(logprob), np.asarray(greedy)
        return [(float(logprob[r]), bool(greedy[r])) for r in range(len(rows))]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for k, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(lm_utils.make_disjoint_window,
                                             lm_utils.get_rolling_token_windows(
                                                 token_list=self.tok_encode(text),
                                                 prefix_token=self.prefix_token_id,
                                                 max_seq_len=self.max_len, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[k] += logprob
        return totals

    # -- generation --------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos_text = self._decode([self.eot_token_id], skip_special=False)
        groups: dict[str, list[int]] = {}
        for k, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(k)
        out: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self._max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen = int(kwargs.pop("max_gen_toks"))
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise UserError("generate_until with sampling (do_sample / temperature > 0) is not "
                                "supported here; the harness decodes greedily")
            if max_gen >= self.max_len:
                raise UserError(f"max_gen_toks {max_gen} leaves no room for a context in "
                                f"max_len {self.max_len}")
            prompts = [self.tok_encode(requests[k].args[0], left_truncate_len=self.max_len - max_gen)
                       for k in indices]
            order = sorted(range(len(indices)), key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self._batch_size):
                chunk = order[start:start + self._batch_size]
                new = self._call("generate", {"prompts": [prompts[i] for i in chunk],
                                              "max_gen": max_gen})
                for i, ids in zip(chunk, new):
                    out[indices[i]] = postprocess_generated_text(self._decode(ids), until, None)
        return out

    def _generate_rows(self, payload: dict) -> list[list[int]]:
        """Greedy continuations (cut after eos) of left-padded prompts, bucketed in length."""
        prompts, max_gen = payload["prompts"], payload["max_gen"]
        room = self.max_len - max_gen
        t0 = min(bucket_of(max(map(len, prompts)), self.buckets), room)
        b = max(self._batch_size, len(prompts))
        eos = self.tokenizer_.eos_id
        pad = self.tokenizer_.pad_id if self.tokenizer_.pad_id is not None else (eos or 0)
        ids = np.full((b, t0), pad, np.int32)
        mask = np.zeros((b, t0), np.int32)
        for r, p in enumerate(prompts):
            ids[r, t0 - len(p):], mask[r, t0 - len(p):] = p, 1
        mask[len(prompts):, -1] = 1          # filler rows: one real token each
        with jax.default_matmul_precision("highest"), sh.use_mesh(self.mesh):
            result = generate(self.module, self.params, self._global(ids, P()), max_new_tokens=max_gen,
                              eos_id=eos, pad_id=pad, prompt_mask=self._global(mask, P()))
        result = np.asarray(result)[:len(prompts), t0:].tolist()
        return [row[:row.index(eos) + 1] if eos in row else row for row in result]

    # -- several processes -------------------------------------------------------------
    def _global(self, tree, spec: P):
        """Host arrays (the same on every process) as arrays over the whole mesh."""
        sharding = NamedSharding(self.mesh, spec)
        if jax.process_count() == 1:
            return jax.device_put(tree, sharding)
        return jax.tree_util.tree_map(
            lambda x: jax.make_array_from_callback(np.shape(x), sharding,
                                                   lambda index, x=x: np.asarray(x)[index]), tree)

    def _ops(self) -> dict[str, Callable[[Any], Any]]:
        return {"score": self._score_rows, "generate": self._generate_rows}

    def _call(self, op: str, payload: Any):
        """Run ``op`` here; with several processes, broadcast it first so the others run it too."""
        if self._leader:
            from .train.distributed import broadcast_json
            broadcast_json({"op": op, "payload": payload})
        return self._ops()[op](payload)

    def follow(self) -> None:
        """On processes other than 0: run what process 0 broadcasts until it stops."""
        from .train.distributed import broadcast_json
        while True:
            message = broadcast_json(None)
            if message["op"] == "stop":
                return
            self._ops()[message["op"]](message["payload"])

    def stop_followers(self) -> None:
        """On process 0: release the processes in :meth:`follow`."""
        if self._leader:
            from .train.distributed import broadcast_json
            broadcast_json({"op": "stop", "payload": None})


# ----------------------------------------------------------------------------- the CLI's run

#: seconds the Hugging Face Hub has to answer one request before the harness runs offline
HUB_PROBE_SECONDS = 3.0


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached from here, or None where it can: offline
    mode is set (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), or the endpoint did not
    answer one request within :data:`HUB_PROBE_SECONDS` (no retries; any HTTP answer counts)."""
    import datasets
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.is_offline_mode() or datasets.config.HF_HUB_OFFLINE:
        return "offline mode is set: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE"
    try:
        get_session().head(constants.ENDPOINT, timeout=HUB_PROBE_SECONDS)
    except Exception as e:  # noqa: BLE001 - any failure to connect means: not reachable
        return f"{constants.ENDPOINT} did not answer: {type(e).__name__}"
    return None


@contextlib.contextmanager
def hub_offline():
    """The Hub client and ``datasets`` in offline mode inside (a cached dataset loads from
    its cache, another fails at once instead of retrying for a minute), as before after."""
    import datasets
    from huggingface_hub import constants

    saved = (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE,
             datasets.config.HF_DATASETS_OFFLINE)
    constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    datasets.config.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        (constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE,
         datasets.config.HF_DATASETS_OFFLINE) = saved


def _failing_task(error: BaseException) -> tuple[str | None, str | None]:
    """``(task name, dataset path)`` of the innermost harness task being built where
    ``error`` was raised (its traceback's frames), or Nones."""
    from lm_eval.api.task import Task

    found, tb = (None, None), error.__traceback__
    while tb is not None:
        task = tb.tb_frame.f_locals.get("self")
        if isinstance(task, Task) and getattr(task, "config", None) is not None:
            found = (getattr(task.config, "task", None), getattr(task.config, "dataset_path", None))
        tb = tb.tb_next
    return found


def offline_message(error: BaseException, tasks: Sequence[str], why: str | None) -> str:
    """One line for a harness task whose data the Hub was to give and did not: the task,
    the dataset, why, and the fixes."""
    import datasets

    task, path = _failing_task(error)
    quoted = re.search(r"(?:reach|dataset) '([^']+)'", str(error))   # datasets' own words
    path = path or (quoted.group(1) if quoted else "its data")
    name = repr(task) if task else ", ".join(map(repr, tasks))
    what = f"the dataset {path!r}" if path != "its data" else path
    return (f"harness task {name} needs {what} from the Hugging Face Hub, which "
            f"cannot be reached ({why or f'{type(error).__name__}: {error}'}), and the datasets "
            f"cache ({datasets.config.HF_DATASETS_CACHE}) does not hold it: run the eval once "
            "where there is a network (the dataset is cached, then loads offline), set "
            "HF_DATASETS_CACHE (or HF_HOME) to a cache that holds it, or evaluate a local task "
            "(--include-path DIR)")


def run_harness(lm: HarnessLM, tasks: Sequence[str], *, include_path: str | None = None,
                num_fewshot: int | None = None, limit: float | None = None,
                bootstrap_iters: int = 100000, log_samples: bool = False,
                include_defaults: bool = True) -> dict | None:
    """``lm_eval.simple_evaluate`` with ``lm`` on process 0 (the others follow); its results
    dict on process 0, None elsewhere. ``include_defaults=False``: only the tasks in
    ``include_path`` (the harness then skips indexing its thousands of task files). Where
    the Hub cannot be reached (:func:`hub_unreachable`) the harness runs offline: datasets
    from the cache, and one that is not there is a UserError naming the task and the fixes."""
    if jax.process_index() != 0:
        lm.follow()
        return None
    try:                       # whatever fails here, the other processes are released
        import lm_eval
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
        known = set(manager.all_tasks)
        unknown = [t for t in tasks if t not in known and not os.path.isfile(t)]
        if unknown:
            raise UserError(f"unknown harness task(s) {unknown}"
                            + ("" if include_path else "; for task YAMLs of your own, add "
                               "--include-path DIR")
                            + " (`lm_eval ls tasks` lists the harness's own)")
        why = hub_unreachable()   # then offline: the cache, or one error at once
        with hub_offline() if why else contextlib.nullcontext():
            try:
                return lm_eval.simple_evaluate(
                    model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                    task_manager=manager, bootstrap_iters=bootstrap_iters,
                    log_samples=log_samples)
            except ConnectionError as e:
                raise UserError(offline_message(e, tasks, why)) from None
    finally:
        lm.stop_followers()


def flat_metrics(results: dict) -> dict[str, float]:
    """``{"harness/<task>/<metric>": value}``: the numbers of ``results["results"]`` (metric
    ``acc,none`` as ``acc``, another filter as ``acc/<filter>``; no stderr)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            name, filt = key.split(",", 1)
            out[f"harness/{task}/{name if filt == 'none' else f'{name}/{filt}'}"] = float(value)
    return out


def harness_setting(tasks: Sequence[str], num_fewshot: int | None, limit: float | None,
                    results: dict) -> dict:
    """What a metrics row's harness numbers were measured with: the tasks, ``--num-fewshot``
    as given (None: each task's default), the shots each task ran with (the harness's
    ``n-shot``) and ``--limit`` (None: every document)."""
    shots = {task: int(n) for task, n in (results.get("n-shot") or {}).items()
             if isinstance(n, (int, float))}
    return {"tasks": list(tasks), "num_fewshot": num_fewshot, "n_shot": shots, "limit": limit}


def checkpoint_step(workdir: str | os.PathLike) -> int | None:
    """The latest checkpoint step of a workdir, or None for another directory."""
    from . import storage
    from .train.checkpoint import CheckpointManager

    ckpt_dir = storage.path(workdir) / "checkpoints"
    if not ckpt_dir.is_dir():
        return None
    manager = CheckpointManager(ckpt_dir, read_only=True)
    try:
        return manager.latest_step()
    finally:
        manager.close()


def append_metrics(workdir: str | os.PathLike, step: int, row: dict) -> None:
    """One ``{"step": step, **row}`` line appended to the workdir's metrics.jsonl."""
    from . import storage

    path = storage.path(workdir) / "metrics.jsonl"
    text = storage.read_text(path) if path.exists() else ""
    if text and not text.endswith("\n"):
        text += "\n"
    storage.write_text(path, text + json.dumps({"step": int(step), **row}) + "\n")
