"""BERT pretraining: masked LM and next-sentence prediction (NSP) together, as HF's
``BertForPreTraining`` trains them.

Sentences. Each document is cut into physical lines (at ``\\n``, each keeping its line end),
each line tokenized on its own (``cfg.tokenizer``: bytes by default, or ``hf:DIR``), and
consecutive lines are packed greedily into *chunks* of at most ``half = (seq_len - 3) // 2``
tokens (a line longer than that is a chunk of its own). A chunk is BERT's "sentence": a
span of consecutive text, about half of a row. Chunks never cross documents.

Pairs. Example ``k`` is a chunk A that has a next chunk in its document (the examples of a
split are those chunks, document by document). Its B is, with probability ``next_prob``
(0.5), the chunk right after A (``nsp_labels`` 0, IsNext: HF's ``next_sentence_label``
convention), else a random chunk that is itself some other document's "next" chunk (label
1, NotNext), so that B looks alike in both classes. A row is BERT's layout::

    [CLS] A [SEP] B [SEP] pad ...      token_type_ids  0 ... 0 (CLS, A, SEP)  1 ... 1 (B, SEP)  0 (pad)

cut to ``seq_len`` as ``tasks/classify.py``'s :func:`~transformer_jax.tasks.classify.encode_example`
does (B keeps its start, A its end: the text at the boundary stays whole). Then BERT's
masking (:func:`~transformer_jax.tasks.mlm.mask_tokens`, 15% of the non-special tokens,
80/10/10) corrupts the row; [CLS], [SEP] and pad are never selected. The vocabulary is
:class:`~transformer_jax.tasks.mlm.MLMVocab`'s (bytes: 262 ids).

Order and draws. Train: the examples in a fresh permutation per epoch, endless
(:class:`~transformer_jax.data.shuffle.EpochIterator`); eval: the held-out split
(``eval_split``: python_stdlib's 14 validation modules) in one fixed shuffled pass, its
last batch filled with empty rows (``nsp_labels`` -100, weight 0). The label, the random
B and the masks are SplitMix64 hashes of (seed, train/eval, batch number, global row), so
a resumed run (state ``{"epoch", "index"}``) and any process count see the same rows.

Batch (B rows, T = ``seq_len``): ``input_ids``, ``token_type_ids``, ``attention_mask``,
``targets`` int32 (B, T), ``weights`` float32 (B, T) (1 at the masked positions),
``nsp_labels`` int32 (B,) (0 IsNext, 1 NotNext, -100 empty row).

Objective (:func:`pretraining_loss`) = HF's: the mean MLM cross-entropy over masked tokens
plus the mean NSP cross-entropy over pairs. As sums its weight is the number of pairs
(``loss_sum = pairs * mlm_mean + nsp_sum``; under pmap the pairs and masked tokens of all
devices, so the step equals one device's), so accumulation over equal micro-batches
averages HF's per-batch losses, and ``eval_loss`` averages the eval batches' (it equals
``eval_mlm_loss + eval_nsp_loss`` with one eval batch). Metrics (train; eval with ``eval_``): ``loss`` (eval: the
objective without label smoothing), ``mlm_loss`` and ``mlm_accuracy`` per masked token,
``nsp_loss`` and ``nsp_accuracy`` per pair (their own weights ``mlm_weight`` and
``nsp_weight``: :func:`~transformer_jax.losses.metric_names`); ``tokens`` counts pairs. The eval's
one perplexity is the MLM's, ``eval_mlm_ppl = exp(eval_mlm_loss)``; ``eval_loss`` (MLM + NSP)
has none.

Options: ``next_prob`` (0.5), ``mask_prob`` (0.15), ``mask_token_prob`` (0.8),
``random_token_prob`` (0.1), ``text_key`` (the documents' field, ``text``: also what a
SentencePiece tokenizer trains on).
"""
from __future__ import annotations

import io
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .. import data as data_lib
from ..data.shuffle import EpochIterator
from ..errors import UserError
from ..losses import head_loss, hidden_kwargs, mean_loss, token_loss
from .base import Task, register_task
from .classify import encode_example
from ..data.shuffle import fold_key, grid_hashes, hash_uniform
from .mlm import MLMVocab, build_tokenizer, check_bert, jitted_apply
from .mlm import check_masking_options, mask_tokens, masking_options

IS_NEXT, NOT_NEXT, NO_PAIR = 0, 1, -100
# hash streams of the pair draws (mask_tokens uses 1, 2, 3 under the same key)
_LABEL_STREAM, _RANDOM_STREAM = 4, 5


# ----------------------------------------------------------------------------- chunks

def line_chunks(text: str, tokenizer, half: int) -> list[np.ndarray]:
    """The chunks of one document: its lines (split at ``\\n``, line ends kept), each
    tokenized alone, packed greedily into runs of at most ``half`` tokens (a longer line
    stands alone). Empty chunks are dropped."""
    chunks, current = [], []
    size = 0
    for line in io.StringIO(text).readlines():
        ids = tokenizer.encode_array(line)
        if current and size + len(ids) > half:
            chunks.append(np.concatenate(current))
            current, size = [], 0
        current.append(ids)
        size += len(ids)
    if size:
        chunks.append(np.concatenate(current))
    return [c.astype(np.int32) for c in chunks if len(c)]


class PairCorpus:
    """The chunks of a split, flat: ``chunks[i]`` (ids), ``doc[i]``; the examples are the
    chunks followed by one of their document (``first``/``count``: each document's slice of
    the examples, contiguous)."""

    def __init__(self, texts, tokenizer, half: int, describe: str):
        self.chunks: list[np.ndarray] = []
        doc = []
        for d, text in enumerate(texts):
            parts = line_chunks(text, tokenizer, half)
            self.chunks += parts
            doc += [d] * len(parts)
        self.doc = np.asarray(doc, np.int64)
        has_next = np.zeros(len(self.chunks), bool)
        has_next[:-1] = self.doc[:-1] == self.doc[1:]
        self.examples = np.nonzero(has_next)[0]                     # (N,) chunk index of A
        ex_doc = self.doc[self.examples]
        docs = int(self.doc.max()) + 1 if len(self.doc) else 0
        self.count = np.bincount(ex_doc, minlength=docs)            # examples per document
        self.first = np.concatenate([[0], np.cumsum(self.count)[:-1]]).astype(np.int64)
        if (self.count > 0).sum() < 2:
            raise UserError(f"{describe} has {(self.count > 0).sum()} document(s) with two chunks "
                            "or more; next-sentence pairs need at least two (a random B comes "
                            "from another document): use more or longer documents, or a larger "
                            "seq_len")

    def __len__(self) -> int:
        return len(self.examples)

    def random_next(self, k: np.ndarray, u: np.ndarray) -> np.ndarray:
        """For examples ``k`` and uint64 draws ``u``: the chunk after a uniformly drawn
        example of another document (what NotNext pairs take as B)."""
        d = self.doc[self.examples[k]]
        others = len(self.examples) - self.count[d]
        j = (u % others.astype(np.uint64)).astype(np.int64)
        j = np.where(j >= self.first[d], j + self.count[d], j)
        return self.examples[j] + 1


# ----------------------------------------------------------------------------- batches

class PairIterator(EpochIterator):
    """Masked sentence-pair batches over a :class:`PairCorpus` (module docstring).

    State: :class:`EpochIterator`'s ``{"epoch", "index"}``; the batch number that seeds the
    draws is ``epoch * batches_per_epoch + index``."""

    kind = "pretraining"

    def __init__(self, corpus: PairCorpus, vocab: MLMVocab, *, seq_len: int, seed: int,
                 stream: int, options: Mapping[str, float], **kw):
        self.corpus, self.vocab, self.seq_len = corpus, vocab, seq_len
        self.stream = stream
        self.next_prob = options["next_prob"]
        self.mask_options = masking_options(options)
        super().__init__(len(corpus), seed=seed, **kw)

    def __next__(self):
        self.count = self.epoch * self.batches_per_epoch + self.index
        return super().__next__()

    def make_batch(self, rows, valid):
        corpus, vocab, b = self.corpus, self.vocab, len(rows)
        row_offset = self.process_index * self.batch_size
        key = fold_key((self.seed, self.stream, self.count))
        is_next = hash_uniform(grid_hashes(key, _LABEL_STREAM, (b, 1), row_offset))[:, 0] < self.next_prob
        other = corpus.random_next(rows, grid_hashes(key, _RANDOM_STREAM, (b, 1), row_offset)[:, 0])
        a = corpus.examples[rows]
        b_chunk = np.where(is_next, a + 1, other)
        ids = np.full((b, self.seq_len), vocab.pad_id, np.int32)
        types = np.zeros((b, self.seq_len), np.int32)
        for r in np.nonzero(valid)[0]:
            ids[r], types[r] = encode_example(vocab, corpus.chunks[a[r]],
                                              corpus.chunks[b_chunk[r]], self.seq_len)
        batch = mask_tokens(ids, (self.seed, self.stream, self.count), mask_id=vocab.mask_id,
                            random_range=vocab.random_range, special_ids=vocab.special_ids,
                            row_offset=row_offset, **self.mask_options)
        batch["token_type_ids"] = types
        batch["attention_mask"] = (ids != vocab.pad_id).astype(np.int32)
        batch["nsp_labels"] = np.where(valid, np.where(is_next, IS_NEXT, NOT_NEXT),
                                       NO_PAIR).astype(np.int32)
        return batch


def pretraining_loss(apply_fn, params, batch, rngs, deterministic: bool, smoothing: float,
                     axis_name: str | None = None, loss_chunk: int = 0):
    """HF ``BertForPreTraining``'s loss as sums: ``(pairs * mlm_mean + nsp_sum, sums)``.

    sums: ``weight`` (pairs), ``nll`` (the same without label smoothing), ``mlm_weight``
    (masked tokens), ``mlm_loss`` and ``mlm_correct`` over them, ``nsp_weight`` (pairs),
    ``nsp_loss`` and ``nsp_correct``. Rows with ``nsp_labels`` < 0 are no pair. The MLM mean
    is over the whole batch's masked tokens: under ``pmap`` (``axis_name``) the pair and
    token counts are summed over the devices first, so the step equals one device's.
    ``loss_chunk``: the MLM read-out that many positions of each row at a time
    (``losses.head_loss``)."""
    out = apply_fn({"params": params}, batch["input_ids"], batch["token_type_ids"],
                   batch["attention_mask"], deterministic=deterministic, rngs=rngs,
                   **hidden_kwargs(loss_chunk))
    labels = batch["nsp_labels"]
    pair = (labels >= 0).astype(jnp.float32)
    mlm_sum, mlm = head_loss(out["mlm_logits"], batch["targets"], batch["weights"], smoothing,
                             loss_chunk)
    nsp_sum, nsp = token_loss(out["nsp_logits"], labels, pair, smoothing)
    pairs, masked = nsp["weight"], mlm["weight"]
    if axis_name is not None:
        pairs, masked = jax.lax.psum((pairs, masked), axis_name)
    per_token = mean_loss(pairs, masked)            # pairs per masked token (0 without any)
    loss_sum = per_token * mlm_sum + nsp_sum
    nll = per_token * mlm["nll"] + nsp["nll"]
    sg = jax.lax.stop_gradient
    return loss_sum, {"weight": nsp["weight"], "nll": sg(nll),
                      "mlm_weight": mlm["weight"], "mlm_loss": sg(mlm_sum),
                      "mlm_correct": mlm["correct"], "nsp_weight": nsp["weight"],
                      "nsp_loss": sg(nsp_sum), "nsp_correct": nsp["correct"]}


pretraining_loss.global_batch = True     # make_gradient_sums passes the pmap axis name
pretraining_loss.chunks = True           # takes loss_chunk (train/step.py)


# ----------------------------------------------------------------------------- task

@register_task
class PretrainTask(Task):
    """BERT pretraining, MLM + NSP (see the module docstring for data, options, metrics)."""
    name = "pretrain"
    MODELS = ("bert",)
    OPTIONS = {"next_prob": 0.5, "mask_prob": 0.15, "mask_token_prob": 0.8,
               "random_token_prob": 0.1, "text_key": "text"}
    TEXT_FIELDS = ("text_key",)   # checked in every split before a run starts
    loss_fn = staticmethod(pretraining_loss)
    PERPLEXITY = {"mlm_loss": "mlm_ppl"}   # eval_mlm_ppl; eval_loss adds NSP: no eval_ppl
    ID_FIELDS = {"input_ids": "vocab_size", "targets": "vocab_size",
                 "token_type_ids": "type_vocab_size"}
    BATCH = {"input_ids": ("int32", ("T",)), "token_type_ids": ("int32", ("T",)),
             "attention_mask": ("int32", ("T",)), "targets": ("int32", ("T",)),
             "weights": ("float32", ("T",)), "nsp_labels": ("int32", ())}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        check_bert(cfg, self.name, ("pretraining",))
        check_masking_options(self.options)
        if cfg.seq_len < 5:
            raise UserError(f"seq_len={cfg.seq_len} leaves no room for [CLS] A [SEP] B [SEP]")
        tokenizer, self.tokenizer_spec = build_tokenizer(cfg, self.workdir, spec,
                                                         (self.options["text_key"],))
        self.vocab = MLMVocab(tokenizer)
        self._corpora: dict[str, PairCorpus] = {}

    def corpus(self, split: str) -> PairCorpus:
        """The split's chunks and examples (built once)."""
        if split not in self._corpora:
            cfg = self.cfg
            texts = data_lib.load_texts(cfg.dataset, split, data_dir=cfg.data_dir,
                                        text_key=self.options["text_key"])
            self._corpora[split] = PairCorpus(texts, self.vocab.tokenizer, (cfg.seq_len - 3) // 2,
                                              f"dataset {cfg.dataset!r} split {split!r}")
        return self._corpora[split]

    def make_iterator(self, split, process_index, process_count, *, train: bool) -> PairIterator:
        # Eval is shuffled too (a fixed order: seed, epoch 0), so the first eval_batches
        # batches are a random sample of the held-out split rather than its first modules.
        return PairIterator(
            self.corpus(split), self.vocab, seq_len=self.cfg.seq_len, seed=self.cfg.seed,
            stream=0 if train else 1, options=self.options, batch_size=self.cfg.batch_size,
            shuffle=True, repeat=train, process_index=process_index, process_count=process_count,
            describe=f"dataset {self.cfg.dataset!r} split {split!r}")

    def spec(self) -> dict:
        return {"tokenizer": self.tokenizer_spec}

    def model_overrides(self) -> dict:
        return {"vocab_size": self.vocab.vocab_size, "head": "pretraining",
                "pad_token_id": self.vocab.pad_id}

    def init_args(self):
        z = jnp.zeros((1, self.cfg.seq_len), jnp.int32)
        return (z, z, jnp.ones_like(z))

    def sample(self, model, params, step):
        """The first eval pairs: masked text, the true label and the model's p(IsNext)."""
        if self.cfg.sample_tokens <= 0:
            return None
        batch = next(iter(self.eval_batches(0, 1)))
        keys = ("input_ids", "token_type_ids", "attention_mask")
        rows = {k: jnp.asarray(batch[k][:4]) for k in keys}
        out = jitted_apply(self, model)({"params": params}, *rows.values())
        p_next = np.asarray(jax.nn.softmax(out["nsp_logits"], axis=-1))[:, IS_NEXT]
        lines = []
        for r, p in enumerate(p_next):
            truth = "IsNext" if batch["nsp_labels"][r] == IS_NEXT else "NotNext"
            lines.append(f"{truth:>7} p(IsNext)={p:.2f}: "
                         f"{self.vocab.render(batch['input_ids'][r])!r}")
        return "\n".join(lines)
