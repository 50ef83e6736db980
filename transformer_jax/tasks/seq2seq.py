"""Sequence to sequence: source text -> target text with an encoder-decoder (T5, Transformer).

Data (``cfg.dataset``):

* ``python_stdlib`` (the embedded corpus, offline): **identifier transformations**. The
  examples are the distinct identifiers of the corpus's modules (sorted, so the example
  set is a pure function of the corpus), mapped by the task option ``transform``:

    ``snake_to_camel`` (default)  lowercase snake_case names of two or more words (regex
        ``_*[a-z][a-z0-9]*(_[a-z0-9]+)+_*``) -> CamelCase: the underscores are dropped and
        each word's first character is upper-cased, ``_make_key`` -> ``MakeKey``,
        ``utf_8_decode`` -> ``Utf8Decode``. Python 3.11: 5,633 train names, 388 held out.
    ``reverse``  every identifier of two or more characters -> its characters reversed,
        ``get_item`` -> ``meti_teg``.

  Train examples come from the corpus's train modules; eval examples are the validation
  modules' identifiers that never occur in a train module (held-out names). Pairs longer
  than the model's lengths (below) are left out.
* any other TFDS name with a source and a target text feature, e.g.
  ``wmt14_translate/de-en`` or ``wmt_t2t_translate/de-en`` (options ``source_key`` "de",
  ``target_key`` "en"); over-long sentences are truncated (eos kept). Examples are read by
  random access (``tfds.data_source``), so the split is never held in memory.
* an ``hf:`` dataset with the two text columns, or a ``translation`` column of
  ``{language: text}`` (``hf:wmt/wmt14:de-en``: keys "de" and "en"; no TensorFlow needed).

Tokens: ``cfg.tokenizer`` (bytes by default: pad 0, eos 1; or ``sentencepiece[:PATH]``,
trained on the train split's sources and targets into the workdir; or a checkpoint's own
``hf:DIR``). Special ids (:func:`seq2seq_special_ids`): the tokenizer's pad and eos (T5: 0
and 1; a tokenizer without an eos ends sequences with its [SEP], one without a pad pads with
its eos), and as decoder start the tokenizer's ``decoder_start_id`` (T5: the pad, 0; the
model config's ``decoder_start_token_id`` where the directory has one), else the pad; the
model's ``pad_token_id`` / ``eos_token_id`` / ``decoder_start_token_id`` are set to them.
Batches (numpy)::

    inputs       (B, S) int32   source ids + eos, right-padded with pad   (S = cfg.seq_len)
    input_mask   (B, S) int32   1 on real source tokens (eos included)
    targets      (B, T) int32   decoder input: [decoder start] + target ids
    labels       (B, T) int32   target ids + eos                         (T = max_target_len)
    weights      (B, T) float32 1 on the labels of real examples (eos included)

Training shuffles the examples with a fresh permutation per epoch (``data.permutation``)
and drops each epoch's last partial batch; its state ``{"epoch", "index"}`` resumes exactly.
Eval is one ordered pass; the last batch is filled with weight-0 rows.

Loss: token cross-entropy on ``labels`` (teacher forcing). Metrics: ``eval_loss`` (nats per
target token; ``eval_ppl`` is its exp), ``eval_accuracy`` (teacher-forced token accuracy)
and, from decoding the first ``decode_batches`` eval batches with greedy (``beam_size=1``)
or beam search, ``eval_exact_match``: the fraction of examples whose decoded output equals the target
exactly, and ``eval_bleu``: corpus BLEU (sacrebleu; tokenizer ``bleu_tokenize``, by default
"char" for the identifier transforms and "13a", WMT's, for TFDS datasets). ``generate`` decodes the prompt as a source (sampling flags are ignored; the task
decodes greedily or with ``beam_size`` beams).

Options: ``transform``, ``max_target_len`` (T; default ``cfg.seq_len``), ``source_key``,
``target_key``, ``beam_size`` (1), ``length_penalty`` (1.0), ``decode_batches`` (4),
``bleu_tokenize`` (None: by dataset).
"""
from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Sequence

import numpy as np

from .. import data as data_lib
from ..beam_search import beam_search, greedy_search
from ..data.shuffle import EpochIterator
from ..data.sources import (base_name, check_split, check_tfds_dataset, is_stdlib, open_source,
                            read_examples)
from ..errors import UserError
from ..losses import head_loss, hidden_kwargs
from ..models import FAMILIES
from .base import Task, register_task

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SNAKE = re.compile(r"_*[a-z][a-z0-9]*(?:_[a-z0-9]+)+_*")


# ----------------------------------------------------------------------------- transforms

def snake_to_camel(name: str) -> str:
    """``_make_key`` -> ``MakeKey``: words split on ``_``, each first character upper-cased."""
    return "".join(w[:1].upper() + w[1:] for w in name.split("_") if w)


def reverse(name: str) -> str:
    return name[::-1]


#: transform name -> (accepts an identifier?, maps it to the target).
TRANSFORMS: dict[str, tuple[Callable[[str], bool], Callable[[str], str]]] = {
    "snake_to_camel": (lambda s: _SNAKE.fullmatch(s) is not None, snake_to_camel),
    "reverse": (lambda s: len(s) >= 2, reverse),
}

#: TFDS builders whose modules tfds does not import by itself (they register on import).
_BUILDER_MODULES = {
    "wmt14_translate": "tensorflow_datasets.translate.wmt14",
    "wmt15_translate": "tensorflow_datasets.translate.wmt15",
    "wmt16_translate": "tensorflow_datasets.translate.wmt16",
    "wmt17_translate": "tensorflow_datasets.translate.wmt17",
    "wmt18_translate": "tensorflow_datasets.translate.wmt18",
    "wmt19_translate": "tensorflow_datasets.translate.wmt19",
    "wmt_t2t_translate": "tensorflow_datasets.translate.wmt_t2t",
}


def identifiers(texts: Sequence[str]) -> set[str]:
    """Every distinct identifier-shaped word of ``texts``."""
    out: set[str] = set()
    for text in texts:
        out.update(_IDENTIFIER.findall(text))
    return out


def identifier_pairs(train_texts: Sequence[str], eval_texts: Sequence[str] | None,
                     transform: str) -> list[tuple[str, str]]:
    """(source, target) pairs, sorted: the train texts' identifiers, or (with ``eval_texts``)
    the eval texts' identifiers that do not occur in the train texts."""
    if transform not in TRANSFORMS:
        raise UserError(f"unknown seq2seq transform {transform!r}; choose one of {sorted(TRANSFORMS)}")
    accept, fn = TRANSFORMS[transform]
    names = identifiers(train_texts)
    if eval_texts is not None:
        names = identifiers(eval_texts) - names
    return [(n, fn(n)) for n in sorted(names) if accept(n)]


# ----------------------------------------------------------------------------- sources

class _TFDSPairs:
    """(source, target) texts read by index from a TFDS split."""

    def __init__(self, dataset: str, split: str, data_dir: str | None, source_key: str,
                 target_key: str):
        module = _BUILDER_MODULES.get(base_name(dataset))
        if not dataset.startswith("hf:"):
            check_tfds_dataset(dataset, data_dir)
        if module is not None:
            importlib.import_module(module)
        self.source, self.name = open_source(dataset, split, data_dir=data_dir)
        self.keys = (source_key, target_key)

    def __len__(self) -> int:
        return len(self.source)

    def get(self, indices: Sequence[int]) -> list[tuple[str, str]]:
        out = []
        for example in read_examples(self.source, indices):
            texts = []
            pair = example.get("translation")   # an hf: translation set's {lang: text}
            if isinstance(pair, dict):
                example = {**pair, **example}
            for key in self.keys:
                if key not in example:
                    raise UserError(f"{self.name}: examples have no feature {key!r} (features: "
                                    f"{sorted(example)}); set task.source_key / task.target_key")
                value = example[key]
                if isinstance(value, np.ndarray) and value.shape == ():
                    value = value.item()
                texts.append(value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value))
            out.append((texts[0], texts[1]))
        return out


class _ListPairs:
    def __init__(self, pairs: list[tuple[str, str]]):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def get(self, indices: Sequence[int]) -> list[tuple[str, str]]:
        return [self.pairs[int(i)] for i in indices]


# ----------------------------------------------------------------------------- batches

def seq2seq_special_ids(tokenizer) -> tuple[int, int, int]:
    """``(pad_id, eos_id, decoder_start_id)`` the task uses (module docstring)."""
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else getattr(tokenizer, "sep_id", None)
    if eos is None:
        raise UserError(f"tokenizer {tokenizer!r} has no eos (nor [SEP]) token to end "
                        "sequences with; use a tokenizer that has one")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else eos
    start = getattr(tokenizer, "decoder_start_id", None)
    return pad, eos, pad if start is None else start


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]], valid: np.ndarray, src_len: int,
                 tgt_len: int, start_id: int) -> dict[str, np.ndarray]:
    """Pairs -> a batch (module docstring); rows with ``valid`` False are padding (weight 0).

    Sources are cut to ``src_len - 1`` ids and targets to ``tgt_len - 1`` before the eos.
    Pad and eos are the tokenizer's (the task passes one with its own: ``with_special_ids``);
    ``input_mask`` marks the source ids and eos by position, so a pad equal to the eos
    (GPT-2's vocabulary) still leaves the eos unmasked.
    """
    b = len(pairs)
    pad, eos = tokenizer.pad_id, tokenizer.eos_id
    inputs = np.full((b, src_len), pad, np.int32)
    input_mask = np.zeros((b, src_len), np.int32)
    targets = np.full((b, tgt_len), pad, np.int32)
    labels = np.full((b, tgt_len), pad, np.int32)
    weights = np.zeros((b, tgt_len), np.float32)
    for r, ((src, tgt), ok) in enumerate(zip(pairs, valid)):
        if not ok:
            continue
        s = list(tokenizer.encode(src))[: src_len - 1] + [eos]
        t = list(tokenizer.encode(tgt))[: tgt_len - 1]
        inputs[r, : len(s)] = s
        input_mask[r, : len(s)] = 1
        targets[r, 0] = start_id
        targets[r, 1: len(t) + 1] = t
        labels[r, : len(t) + 1] = t + [eos]
        weights[r, : len(t) + 1] = 1.0
    return {"inputs": inputs, "input_mask": input_mask, "targets": targets,
            "labels": labels, "weights": weights}


class PairIterator(EpochIterator):
    """Batches of encoded pairs (:func:`encode_pairs`) in the order of
    :class:`~transformer_jax.data.shuffle.EpochIterator`: a fresh permutation per epoch
    (train) or one ordered pass, whose last batch has weight-0 rows (eval)."""

    kind = "seq2seq"

    def __init__(self, pairs, tokenizer, *, batch_size: int, src_len: int, tgt_len: int,
                 start_id: int, seed: int, shuffle: bool, repeat: bool, process_index: int,
                 process_count: int, describe: str):
        self.pairs, self.tokenizer = pairs, tokenizer
        self.src_len, self.tgt_len, self.start_id = src_len, tgt_len, start_id
        super().__init__(len(pairs), batch_size=batch_size, seed=seed, shuffle=shuffle,
                         repeat=repeat, process_index=process_index,
                         process_count=process_count, describe=describe)

    def make_batch(self, rows, valid):
        return encode_pairs(self.tokenizer, self.pairs.get(rows), valid, self.src_len,
                            self.tgt_len, self.start_id)


def seq2seq_loss(apply_fn, params, batch, rngs, deterministic: bool, smoothing: float,
                 loss_chunk: int = 0):
    """Teacher-forced cross-entropy: ``model(inputs, targets, input_mask)`` vs ``labels``;
    packed pairs (a batch with ``segment_ids``/``positions`` (B, S) of the inputs and
    ``decoder_segment_ids``/``decoder_positions`` (B, T) of the targets) pass them on;
    ``loss_chunk`` positions of each row at a time when set (``losses.head_loss``)."""
    packed = {key: batch[key] for key in ("segment_ids", "positions", "decoder_segment_ids",
                                          "decoder_positions") if key in batch}
    out = apply_fn({"params": params}, batch["inputs"], batch["targets"], batch["input_mask"],
                   deterministic=deterministic, rngs=rngs, **packed, **hidden_kwargs(loss_chunk))
    return head_loss(out, batch["labels"], batch["weights"], smoothing, loss_chunk)


seq2seq_loss.chunks = True   # takes loss_chunk (train/step.py)


def cut_at_eos(row: Sequence[int], eos_id: int) -> list[int]:
    """The ids up to and including the first ``eos`` (all of them if there is none)."""
    row = [int(x) for x in row]
    return row[: row.index(eos_id) + 1] if eos_id in row else row


# ----------------------------------------------------------------------------- BLEU

#: sacrebleu's tokenizers: "13a" (WMT's standard, the default for TFDS datasets), "char"
#: (each character a token: the default for the identifier transforms, whose outputs are
#: single words), "intl", "none".
BLEU_TOKENIZERS = ("13a", "char", "intl", "none")


def corpus_bleu(hypotheses: Sequence[str], references: Sequence[str], *, tokenize: str = "13a") -> float:
    """Corpus BLEU (0-100) of detokenized strings against one reference each, computed by
    ``sacrebleu`` (the standard implementation: 4-grams, brevity penalty, no smoothing)."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise UserError(f"corpus_bleu needs one reference per hypothesis; got "
                        f"{len(hypotheses)} hypotheses and {len(references)} references")
    if not hypotheses:
        return 0.0
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)], tokenize=tokenize).score)


# ----------------------------------------------------------------------------- task

@register_task
class Seq2SeqTask(Task):
    """Encoder-decoder training on text pairs (module docstring)."""
    name = "seq2seq"
    MODELS = ("t5", "transformer")
    OPTIONS = {"transform": "snake_to_camel", "max_target_len": None, "source_key": "de",
               "target_key": "en", "beam_size": 1, "length_penalty": 1.0, "decode_batches": 4,
               "bleu_tokenize": None}
    loss_fn = staticmethod(seq2seq_loss)
    PERPLEXITY = {"loss": "ppl"}   # eval_ppl: per target token
    ID_FIELDS = {"inputs": "vocab_size", "targets": "vocab_size", "labels": "vocab_size"}
    BATCH = {"inputs": ("int32", ("S",)), "input_mask": ("int32", ("S",)),
             "targets": ("int32", ("T",)), "labels": ("int32", ("T",)),
             "weights": ("float32", ("T",))}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        module_cls = FAMILIES.get(cfg.model, (None, None))[1]
        if module_cls is None or not all(hasattr(module_cls, m) for m in ("encode", "decode")):
            raise UserError(f"task 'seq2seq' needs an encoder-decoder model (model=t5 or "
                            f"model=transformer); got model={cfg.model!r}")
        o = self.options
        if o["transform"] not in TRANSFORMS:
            raise UserError(f"task option transform={o['transform']!r} is unknown; choose one of "
                            f"{sorted(TRANSFORMS)}")
        for name in ("beam_size", "decode_batches"):
            if not isinstance(o[name], int) or o[name] < (1 if name == "beam_size" else 0):
                raise UserError(f"task option {name}={o[name]!r} must be an int >= "
                                f"{1 if name == 'beam_size' else 0}")
        if o["bleu_tokenize"] is not None and o["bleu_tokenize"] not in BLEU_TOKENIZERS:
            raise UserError(f"task option bleu_tokenize={o['bleu_tokenize']!r} is unknown; choose "
                            f"one of {list(BLEU_TOKENIZERS)} (sacrebleu's tokenizers)")
        self.src_len = cfg.seq_len
        self.tgt_len = cfg.seq_len if o["max_target_len"] is None else int(o["max_target_len"])
        if self.src_len < 2 or self.tgt_len < 2:
            raise UserError(f"seq2seq needs seq_len >= 2 and max_target_len >= 2 (room for a "
                            f"token and eos); got {self.src_len}, {self.tgt_len}")
        self.stdlib = is_stdlib(cfg.dataset)
        self._pairs_cache: dict[str, Any] = {}
        self.tokenizer, self.tokenizer_spec = self._tokenizer(spec)
        self.pad_id, self.eos_id, self.start_id = seq2seq_special_ids(self.tokenizer)
        #: the tokenizer with the task's pad and eos (bytes, SentencePiece, T5: itself)
        self.pair_tokenizer = data_lib.with_special_ids(self.tokenizer, pad_id=self.pad_id,
                                                        eos_id=self.eos_id)

    @classmethod
    def check_split(cls, cfg, options, split) -> None:
        """The embedded corpus: the split exists; an ``hf:`` set: it holds a row, and its
        first row the source and target texts (columns, or keys of ``translation``);
        another TFDS set is read by its builder when the task is built."""
        if not isinstance(cfg.dataset, str):
            return
        hf = cfg.dataset.startswith("hf:")
        if hf or is_stdlib(cfg.dataset):
            check_split(cfg.dataset, split, data_dir=cfg.data_dir)
        if hf:
            _TFDSPairs(cfg.dataset, split, cfg.data_dir, options["source_key"],
                       options["target_key"]).get([0])

    # -- data ---------------------------------------------------------------------
    def _texts(self, split: str) -> list[str]:
        return data_lib.load_texts(self.cfg.dataset, split, data_dir=self.cfg.data_dir)

    def _raw_pairs(self, split: str, *, train: bool):
        """All pairs of a split (stdlib: a list; TFDS: read by index), before length filtering."""
        if self.stdlib:
            pairs = identifier_pairs(self._texts("train"), None if train else self._texts(split),
                                     self.options["transform"])
            return _ListPairs(pairs)
        return _TFDSPairs(self.cfg.dataset, split, self.cfg.data_dir, self.options["source_key"],
                          self.options["target_key"])

    def _pairs(self, split: str, *, train: bool):
        key = f"{split}:{train}"
        if key not in self._pairs_cache:
            out = self._raw_pairs(split, train=train)
            if self.stdlib:   # identifiers that do not fit are left out (translations: truncated)
                tok = self.tokenizer
                out = _ListPairs([(s, t) for s, t in out.pairs
                                  if len(tok.encode(s)) < self.src_len
                                  and len(tok.encode(t)) < self.tgt_len])
            self._pairs_cache[key] = out
        return self._pairs_cache[key]

    def _tokenizer(self, spec):
        if spec is not None:
            return data_lib.get_tokenizer(spec["tokenizer"]), spec["tokenizer"]
        cfg = self.cfg
        if cfg.tokenizer == "sentencepiece":
            path = self.workdir / "spm.model"
            if not path.exists():
                pairs = self._raw_pairs("train", train=True)
                rows = pairs.get(range(min(len(pairs), 200_000)))
                data_lib.train_sentencepiece([t for pair in rows for t in pair],
                                             cfg.sentencepiece_vocab_size, str(path))
            spec_str = f"sentencepiece:{path}"   # absolute, or gs://
        else:
            spec_str = data_lib.canonical_spec(cfg.tokenizer)   # hf:DIR absolute
        return data_lib.get_tokenizer(spec_str), spec_str

    def spec(self) -> dict:
        return {"tokenizer": self.tokenizer_spec, "transform": self.options["transform"],
                "src_len": self.src_len, "tgt_len": self.tgt_len}

    def model_overrides(self) -> dict:
        return {"vocab_size": self.tokenizer.vocab_size, "pad_token_id": self.pad_id,
                "eos_token_id": self.eos_id, "decoder_start_token_id": self.start_id}

    def generation_ids(self) -> dict:
        return {"eos_token_id": self.eos_id, "pad_token_id": self.pad_id,
                "decoder_start_token_id": self.start_id}

    def make_iterator(self, split, process_index, process_count, *, train: bool) -> PairIterator:
        cfg = self.cfg
        return PairIterator(
            self._pairs(split, train=train), self.pair_tokenizer, batch_size=cfg.batch_size,
            src_len=self.src_len, tgt_len=self.tgt_len, start_id=self.start_id,
            seed=cfg.seed, shuffle=train, repeat=train, process_index=process_index,
            process_count=process_count,
            describe=f"seq2seq {cfg.dataset!r} split {split!r}")

    def batch_dims(self) -> dict[str, int]:
        return {"S": self.src_len, "T": self.tgt_len}

    def init_args(self):
        import jax.numpy as jnp

        return (jnp.zeros((1, self.src_len), jnp.int32), jnp.zeros((1, self.tgt_len), jnp.int32))

    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * (self.src_len + self.tgt_len)

    def flops_per_step(self, model_cfg, adapted: tuple[int, int] | None = None) -> float:
        """``batch_size`` pairs (``Task.flops_per_step``; an adapter counts every token of
        the pair, source and target alike)."""
        frozen = adapted is not None
        return (self.cfg.batch_size * model_cfg.flops_per_example(
            self.src_len, self.tgt_len, frozen_base=frozen) + self.adapter_flops(adapted))

    # -- decoding -----------------------------------------------------------------
    def _decode(self, model, params, inputs, input_mask, max_new_tokens: int | None = None):
        n = self.tgt_len if max_new_tokens is None else max_new_tokens
        if self.options["beam_size"] == 1:
            return np.asarray(greedy_search(model, params, inputs, input_mask, max_new_tokens=n))
        return np.asarray(beam_search(model, params, inputs, input_mask,
                                      num_beams=self.options["beam_size"], max_new_tokens=n,
                                      length_penalty=self.options["length_penalty"]).sequences)

    def _decoded_batches(self, model, params, count: int):
        it = self.eval_batches(0, 1)
        for _ in range(count):
            batch = next(it, None)
            if batch is None:
                return
            yield batch, self._decode(model, params, batch["inputs"], batch["input_mask"])

    def extra_eval(self, model, params) -> dict[str, float]:
        count = self.options["decode_batches"]
        if count == 0:
            return {}
        tok = self.tokenizer
        hits = total = 0
        hypotheses, references = [], []
        for batch, out in self._decoded_batches(model, params, count):
            for row, label, w in zip(out, batch["labels"], batch["weights"]):
                if w[0] > 0:
                    total += 1
                    pred, want = cut_at_eos(row, self.eos_id), cut_at_eos(label, self.eos_id)
                    hits += pred == want
                    hypotheses.append(tok.decode(pred))
                    references.append(tok.decode(want))
        tokenize = self.options["bleu_tokenize"] or ("char" if self.stdlib else "13a")
        return {"exact_match": hits / max(total, 1), "decoded": float(total),
                "bleu": corpus_bleu(hypotheses, references, tokenize=tokenize)}

    def sample(self, model, params, step):
        if self.cfg.sample_tokens <= 0:
            return None
        batch, out = next(self._decoded_batches(model, params, 1))
        tok, lines = self.tokenizer, []
        for src, row, label, w in list(zip(batch["inputs"], out, batch["labels"], batch["weights"]))[:6]:
            if w[0] > 0:
                pred, want = tok.decode(cut_at_eos(row, self.eos_id)), tok.decode(label)
                mark = "ok" if pred == want else f"want {want!r}"
                lines.append(f"{tok.decode(src)!r} -> {pred!r}  ({mark})")
        return "\n".join(lines)

    def generate_text(self, model, params, prompt, *, max_new_tokens=None, say=None,
                      **ignored) -> str:
        """Decode ``prompt`` as a source sentence (greedy or ``beam_size`` beams). A source
        longer than the run's ``src_len`` and more new tokens than the model's ``max_len``
        are cut; ``say`` gets a line for each cut."""
        tok = self.tokenizer
        ids = list(tok.encode(prompt))
        if len(ids) > self.src_len - 1 and say is not None:
            say(f"the prompt is {len(ids)} tokens; this run's sources hold {self.src_len - 1} "
                f"and an eos: its last {len(ids) - self.src_len + 1} tokens cut")
        ids = ids[: self.src_len - 1] + [self.eos_id]
        self.check_prompt_ids([ids], model.config)       # before anything is compiled
        inputs = np.full((1, self.src_len), self.pad_id, np.int32)
        inputs[0, : len(ids)] = ids
        mask = (np.arange(self.src_len) < len(ids)).astype(np.int32)[None]
        n = self.tgt_len if max_new_tokens is None else max(1, int(max_new_tokens))
        limit = getattr(model.config, "max_len", n)      # sinusoidal models: table size
        if n > limit and say is not None:
            say(f"--max-new-tokens {n} exceeds the model's max_len={limit}: {n - limit} "
                f"tokens cut, at most {limit} generated")
        n = min(n, limit)
        out = self._decode(model, params, inputs, mask, n)
        return tok.decode(cut_at_eos(out[0], self.eos_id))
