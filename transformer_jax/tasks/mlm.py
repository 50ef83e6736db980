"""Masked-language-model pretraining (BERT) on packed text, with the 80/10/10 masking recipe.

Vocabulary. The base tokenizer (``cfg.tokenizer``: bytes by default, SentencePiece, or a
checkpoint's own ``hf:DIR``) keeps its ids. BERT's specials are the tokenizer's own when it
has them (a BERT WordPiece's [CLS], [SEP], [MASK], [PAD]: nothing is appended and
``vocab_size`` is the tokenizer's); those it lacks are appended after its last id, in the
order [CLS], [SEP], [MASK], then [PAD] when the tokenizer has no pad distinct from its eos
(GPT-2) (:class:`MLMVocab`). Bytes and SentencePiece (pad 0, eos 1, unk 2, ordinary tokens
from 3) have none of the three::

    [CLS] = base.vocab_size     [SEP] = base.vocab_size + 1     [MASK] = base.vocab_size + 2

so the byte-level model has 259 + 3 = 262 ids ([CLS] 259, [SEP] 260, [MASK] 261), and
``vocab_size`` is set from the tokenizer. Padding is the base pad id 0, and ``pad_token_id=0``.
The packed documents end with the tokenizer's eos, or with [SEP] when it has none (BERT).

Sequences. The training text is packed exactly as for language modelling
(:func:`transformer_jax.data.make_lm_iterator`: documents + eos, concatenated, shuffled
windows with a savable position); each row holds ``seq_len - 2`` consecutive stream tokens
framed as ``[CLS] tokens [SEP]``. Eval uses the held-out split in order, one pass; its last
window is shorter and right-padded (``attention_mask`` 0 on padding).

Masking (:func:`mask_tokens`, a pure function of the ids and a seed): in each row, exactly
``round(mask_prob * n)`` of the ``n`` non-special tokens (at least one) are selected, a
uniformly random subset; of those, 80% become [MASK], 10% a random ordinary token, 10%
stay unchanged (each token draws its fate independently). Targets are the original ids at
the selected positions and weights 1 there, 0 elsewhere. Special = pad, eos, [CLS], [SEP],
[MASK] (and, for ``hf:DIR``, every special token of the tokenizer). A random token is drawn
from ``random_range``: ids 3 up to the base vocabulary (``hf:DIR``: the longest run of ids
that holds no special token, e.g. 104 .. 30521 for bert-base-uncased, after its [MASK] 103).
The random draws are SplitMix64 hashes of (seed, batch number, global row,
position) -- the same on every platform, and the same rows whatever the process count --
so a resumed run sees exactly the masks the uninterrupted run saw.

Metrics: ``eval_loss`` (MLM cross-entropy per masked token, nats), ``eval_ppl`` (its
perplexity, ``exp(eval_loss)``) and ``eval_accuracy`` (masked-token accuracy).
"""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import data as data_lib
from .. import storage
from ..data.shuffle import MASK64, fold_key, grid_hashes, hash_uniform
from ..errors import UserError
from ..losses import head_loss, hidden_kwargs, packed_kwargs
from .base import Task, register_task


# ----------------------------------------------------------------------------- vocabulary

@dataclasses.dataclass(frozen=True)
class MLMVocab:
    """A base tokenizer plus BERT's specials: the tokenizer's own, else appended after its
    last id (module docstring)."""
    tokenizer: data_lib.Tokenizer

    @functools.cached_property
    def _layout(self) -> dict[str, int]:
        tok = self.tokenizer
        size = tok.vocab_size
        ids: dict[str, int] = {}
        for name in ("cls_id", "sep_id", "mask_id"):
            own = getattr(tok, name, None)
            ids[name] = size if own is None else own
            size += own is None
        eos = tok.eos_id if tok.eos_id is not None else ids["sep_id"]
        pad = tok.pad_id
        if pad is None or pad == eos:          # no pad of its own (GPT-2): [PAD] appended
            pad, size = size, size + 1
        return {**ids, "eos_id": eos, "pad_id": pad, "vocab_size": size}

    @property
    def base_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def cls_id(self) -> int:
        return self._layout["cls_id"]

    @property
    def sep_id(self) -> int:
        return self._layout["sep_id"]

    @property
    def mask_id(self) -> int:
        return self._layout["mask_id"]

    @property
    def vocab_size(self) -> int:
        return self._layout["vocab_size"]

    @property
    def pad_id(self) -> int:
        return self._layout["pad_id"]

    @property
    def eos_id(self) -> int:
        """The id that ends each packed document: the tokenizer's eos, else [SEP]."""
        return self._layout["eos_id"]

    @property
    def stream_tokenizer(self) -> data_lib.Tokenizer:
        """The tokenizer the text is packed with: the base tokenizer with this vocabulary's
        eos and pad (bytes and SentencePiece: the base tokenizer itself)."""
        return data_lib.with_special_ids(self.tokenizer, eos_id=self.eos_id, pad_id=self.pad_id)

    @property
    def special_ids(self) -> tuple[int, ...]:
        own = (self.pad_id, self.eos_id, self.cls_id, self.sep_id, self.mask_id)
        more = sorted(set(getattr(self.tokenizer, "all_special_ids", ())) - set(own))
        return own + tuple(more)

    @property
    def random_range(self) -> tuple[int, int]:
        """[low, high): the ordinary tokens a masked position may be replaced by: ids 3 up
        to the base vocabulary, or (a tokenizer that lists its ``all_special_ids``: hf:DIR)
        the longest run of base ids holding no special token."""
        specials = getattr(self.tokenizer, "all_special_ids", None)
        if specials is None:
            return 3, self.base_size
        best, start = (0, 0), 0
        for i in [*sorted(s for s in specials if 0 <= s < self.base_size), self.base_size]:
            if i - start > best[1] - best[0]:
                best = (start, i)
            start = i + 1
        if best[1] <= best[0]:
            raise UserError(f"tokenizer {self.tokenizer!r} has no ordinary token to draw "
                            "random replacements from")
        return best

    def render(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with the specials written as [CLS] [SEP] [MASK]; pad dropped."""
        names = {self.cls_id: "[CLS]", self.sep_id: "[SEP]", self.mask_id: "[MASK]"}
        out, run = [], []
        for i in np.asarray(ids).reshape(-1).tolist():
            if i in names or i == self.pad_id:
                out.append(self.tokenizer.decode(run))
                run = []
                out.append(names.get(i, ""))
            else:
                run.append(i)
        out.append(self.tokenizer.decode(run))
        return "".join(out)


def build_tokenizer(cfg, workdir: str | Path, spec: Mapping[str, Any] | None,
                    text_keys: Sequence[str] = ("text",)):
    """``(tokenizer, spec string)`` from a saved task spec, or from ``cfg.tokenizer``.

    ``"sentencepiece"`` trains a model into ``workdir/spm.model`` once, on the texts of the
    train split's ``text_keys`` fields (the task's own: both sentences of a pair), up to
    200k documents each.
    """
    if spec is not None:
        return data_lib.get_tokenizer(spec["tokenizer"]), spec["tokenizer"]
    if cfg.tokenizer == "sentencepiece":
        path = storage.path(workdir) / "spm.model"
        if not path.exists():
            texts = [text for key in text_keys
                     for text in data_lib.load_texts(cfg.dataset, "train", data_dir=cfg.data_dir,
                                                     text_key=key, max_documents=200_000)]
            data_lib.train_sentencepiece(texts, cfg.sentencepiece_vocab_size, str(path))
        spec_str = f"sentencepiece:{path}"   # absolute, or gs://
    else:
        spec_str = data_lib.canonical_spec(cfg.tokenizer)   # hf:DIR absolute
    return data_lib.get_tokenizer(spec_str), spec_str


# ----------------------------------------------------------------------------- masking

def mask_tokens(ids: np.ndarray, seed: int | Sequence[int], *, mask_id: int,
                random_range: tuple[int, int], special_ids: Sequence[int] = (),
                mask_prob: float = 0.15, mask_token_prob: float = 0.8,
                random_token_prob: float = 0.1, row_offset: int = 0) -> dict[str, np.ndarray]:
    """BERT's masking recipe on (B, T) ids; pure and seeded (see the module docstring).

    Args:
      ids: int (B, T) token ids.
      seed: an int or a sequence of ints (e.g. ``(run seed, batch number)``).
      mask_id: the [MASK] id.
      random_range: ``[low, high)`` of the ids a "random token" is drawn from (uniformly).
      special_ids: ids never selected (pad, [CLS], [SEP], ...).
      mask_prob: fraction of each row's non-special tokens selected (rounded half up; at
        least one when the row has any and ``mask_prob > 0``).
      mask_token_prob, random_token_prob: of the selected tokens, the probability of
        becoming [MASK], and of becoming a random token; the rest stay unchanged.
      row_offset: global index of row 0 (a process's first row), so each row's draws
        depend on its global position only.

    Returns:
      ``{"input_ids": int32 (B, T) corrupted ids, "targets": int32 (B, T) original ids at
      the selected positions and 0 elsewhere, "weights": float32 (B, T) 1 at the selected
      positions}``.
    """
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"ids must be an integer (B, T) array; got {ids.dtype} {ids.shape}")
    if not 0.0 <= mask_prob <= 1.0:
        raise UserError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if mask_token_prob < 0 or random_token_prob < 0 or mask_token_prob + random_token_prob > 1:
        raise UserError(f"mask_token_prob={mask_token_prob} and random_token_prob="
                        f"{random_token_prob} must be >= 0 and sum to at most 1")
    low, high = random_range
    if not 0 <= low < high:
        raise UserError(f"random_range must be [low, high) with 0 <= low < high, got {random_range}")
    key = fold_key(seed)
    shape = ids.shape
    candidate = ~np.isin(ids, np.asarray(list(special_ids), dtype=ids.dtype))
    n = candidate.sum(axis=1)
    k = np.floor(n * mask_prob + 0.5).astype(np.int64)
    if mask_prob > 0:
        k = np.maximum(k, np.minimum(n, 1))
    # A uniformly random subset of k candidates per row: the k smallest hashes.
    order_key = np.where(candidate, grid_hashes(key, 1, shape, row_offset), np.uint64(MASK64))
    rank = np.empty(shape, np.int64)
    np.put_along_axis(rank, np.argsort(order_key, axis=1, kind="stable"),
                      np.arange(shape[1])[None, :].repeat(shape[0], 0), axis=1)
    selected = candidate & (rank < k[:, None])
    fate = hash_uniform(grid_hashes(key, 2, shape, row_offset))
    to_mask = selected & (fate < mask_token_prob)
    to_random = selected & (fate >= mask_token_prob) & (fate < mask_token_prob + random_token_prob)
    random_ids = low + (grid_hashes(key, 3, shape, row_offset) % np.uint64(high - low)).astype(np.int64)
    corrupted = np.where(to_mask, mask_id, np.where(to_random, random_ids, ids))
    return {"input_ids": corrupted.astype(np.int32),
            "targets": np.where(selected, ids, 0).astype(np.int32),
            "weights": selected.astype(np.float32)}


# ----------------------------------------------------------------------------- batches

def frame(content: np.ndarray, vocab: MLMVocab) -> np.ndarray:
    """(B, T-2) stream tokens (right-padded with pad) -> (B, T) ``[CLS] tokens [SEP] pad...``.

    An all-padding row stays all padding.
    """
    b, n = content.shape
    ids = np.full((b, n + 2), vocab.pad_id, np.int32)
    real = (content != vocab.pad_id).sum(axis=1)
    ids[:, 1:-1] = content
    rows = np.nonzero(real)[0]
    ids[rows, 0] = vocab.cls_id
    ids[rows, real[rows] + 1] = vocab.sep_id
    return ids


class MLMIterator(Iterator[dict]):
    """Masked batches over an :class:`~transformer_jax.data.LMIterator` of content windows.

    ``next`` -> ``{"input_ids", "attention_mask", "targets": int32 (B, T), "weights":
    float32 (B, T)}``. ``get_state()`` = ``{"windows": the packing iterator's state,
    "count": batches drawn}``; the masks depend on (seed, count, global row), so
    ``set_state`` resumes exactly.
    """

    def __init__(self, windows, vocab: MLMVocab, *, seed: int, stream: int,
                 row_offset: int, options: Mapping[str, float]):
        self.windows, self.vocab = windows, vocab
        self.seed, self.stream, self.row_offset = seed, stream, row_offset
        self.options = masking_options(options)
        self.count = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = next(self.windows)
        ids = frame(batch["inputs"], self.vocab)
        masked = mask_tokens(
            ids, (self.seed, self.stream, self.count), mask_id=self.vocab.mask_id,
            random_range=self.vocab.random_range, special_ids=self.vocab.special_ids,
            row_offset=self.row_offset, **self.options)
        self.count += 1
        masked["attention_mask"] = (ids != self.vocab.pad_id).astype(np.int32)
        return masked

    def get_state(self) -> dict:
        return {"windows": self.windows.get_state(), "count": self.count}

    def set_state(self, state: dict) -> None:
        if not isinstance(state, dict) or set(state) != {"windows", "count"}:
            raise UserError(f"not an MLM iterator state: {state!r}")
        self.windows.set_state(state["windows"])
        self.count = int(state["count"])


def mlm_loss(apply_fn, params, batch, rngs, deterministic: bool, smoothing: float,
             loss_chunk: int = 0):
    """MLM cross-entropy over the selected positions (``weights``), summed; packed documents
    (a batch with ``segment_ids`` and ``positions``) pass them on; ``loss_chunk`` positions
    of each row at a time when set (``losses.head_loss``)."""
    out = apply_fn({"params": params}, batch["input_ids"], None, batch["attention_mask"],
                   deterministic=deterministic, rngs=rngs, **packed_kwargs(batch),
                   **hidden_kwargs(loss_chunk))
    logits = out["mlm_logits"] if isinstance(out, Mapping) else out
    return head_loss(logits, batch["targets"], batch["weights"], smoothing, loss_chunk)


mlm_loss.chunks = True   # takes loss_chunk (train/step.py)


# ----------------------------------------------------------------------------- task

def jitted_apply(task: Task, model):
    """``jax.jit(model.apply)``, kept on the task so evals after the first reuse it."""
    if getattr(task, "_jit_model", None) is not model:
        task._jit_model, task._jit_apply = model, jax.jit(model.apply)
    return task._jit_apply


def check_bert(cfg, task: str, heads: tuple[str, ...]) -> None:
    """The run must build a BERT with one of ``heads`` (the task sets the first by default)."""
    if cfg.model != "bert":
        raise UserError(f"task {task!r} trains a BERT encoder; set model=bert (got "
                        f"model={cfg.model!r})")
    head = cfg.model_overrides.get("head", heads[0])
    if head not in heads:
        raise UserError(f"task {task!r} needs model.head in {heads}, got model.head={head!r}; "
                        "drop the override")


#: the task options :func:`mask_tokens` takes (the rest: the task's own, e.g. ``text_key``)
MASKING_OPTIONS = ("mask_prob", "mask_token_prob", "random_token_prob")


def masking_options(options: Mapping[str, Any]) -> dict[str, float]:
    """The :data:`MASKING_OPTIONS` of a task's ``options``, for :func:`mask_tokens`."""
    return {k: options[k] for k in MASKING_OPTIONS}


def check_masking_options(options: Mapping[str, Any]) -> None:
    """Every probability option in [0, 1]; some tokens masked; [MASK] + random <= 1;
    ``text_key`` a field name."""
    for name, value in options.items():
        if name == "text_key":
            if not isinstance(value, str):
                raise UserError(f"task.text_key={value!r} must be the name of the documents' "
                                "text field, e.g. text or content")
        elif not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
            raise UserError(f"task option {name}={value!r} must be a number in [0, 1]")
    if options["mask_prob"] == 0:
        raise UserError("task option mask_prob=0 selects no tokens: nothing to learn")
    total = options["mask_token_prob"] + options["random_token_prob"]
    if total > 1:
        raise UserError(f"task options mask_token_prob + random_token_prob = {total:g} "
                        "exceed 1")


@register_task
class MLMTask(Task):
    """BERT masked-LM pretraining. Options: ``mask_prob`` (0.15), ``mask_token_prob`` (0.8),
    ``random_token_prob`` (0.1), ``text_key`` (the documents' field, ``text``); tokenizer,
    dataset and lengths are config fields."""
    name = "mlm"
    MODELS = ("bert",)
    OPTIONS = {"mask_prob": 0.15, "mask_token_prob": 0.8, "random_token_prob": 0.1,
               "text_key": "text"}
    TEXT_FIELDS = ("text_key",)   # checked in every split before a run starts
    loss_fn = staticmethod(mlm_loss)
    PERPLEXITY = {"loss": "ppl"}   # eval_ppl: per masked token
    ID_FIELDS = {"input_ids": "vocab_size", "targets": "vocab_size"}
    BATCH = {"input_ids": ("int32", ("T",)), "targets": ("int32", ("T",)),
             "weights": ("float32", ("T",)), "attention_mask": ("int32", ("T",))}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        check_bert(cfg, self.name, ("mlm", "pretraining"))
        check_masking_options(self.options)
        if cfg.seq_len < 3:
            raise UserError(f"seq_len={cfg.seq_len} leaves no room for text between [CLS] and [SEP]")
        tokenizer, self.tokenizer_spec = build_tokenizer(cfg, self.workdir, spec,
                                                         (self.options["text_key"],))
        self.vocab = MLMVocab(tokenizer)

    def spec(self) -> dict:
        return {"tokenizer": self.tokenizer_spec}

    def model_overrides(self) -> dict:
        return {"vocab_size": self.vocab.vocab_size, "head": "mlm",
                "pad_token_id": self.vocab.pad_id}

    def make_iterator(self, split, process_index, process_count, *, train: bool) -> MLMIterator:
        cfg = self.cfg
        windows = data_lib.make_lm_iterator(
            cfg.dataset, split, tokenizer=self.vocab.stream_tokenizer, seq_len=cfg.seq_len - 2,
            batch_size=cfg.batch_size, seed=cfg.seed, shuffle=train, repeat=train,
            data_dir=cfg.data_dir, process_index=process_index, process_count=process_count,
            text_key=self.options["text_key"])
        return MLMIterator(windows, self.vocab, seed=cfg.seed, stream=0 if train else 1,
                           row_offset=process_index * windows.batch_size, options=self.options)

    def init_args(self):
        return (jnp.zeros((1, self.cfg.seq_len), jnp.int32),)

    def sample(self, model, params, step):
        """The first eval row, masked, and the model's fill-in at the masked positions."""
        if self.cfg.sample_tokens <= 0:
            return None
        batch = next(iter(self.eval_batches(0, 1)))
        ids = batch["input_ids"][:1, : self.cfg.sample_tokens + 2]
        mask = batch["attention_mask"][:1, : ids.shape[1]]
        apply = jitted_apply(self, model)
        out = apply({"params": params}, jnp.asarray(ids), None, jnp.asarray(mask))
        logits = out["mlm_logits"] if isinstance(out, Mapping) else out
        guess = np.asarray(jnp.argmax(logits, axis=-1))
        chosen = batch["weights"][:1, : ids.shape[1]] > 0
        filled = np.where(chosen, guess, ids)
        original = np.where(chosen, batch["targets"][:1, : ids.shape[1]], ids)
        return (f"original: {self.vocab.render(original)!r}\n"
                f"masked:   {self.vocab.render(ids)!r}\n"
                f"filled:   {self.vocab.render(filled)!r}")
