"""Sequence classification with a BERT encoder: ``[CLS] a [SEP] (b [SEP])`` -> pooled -> class.

Data (``cfg.dataset``):

* ``python_stdlib`` (the embedded corpus): **line roles**. Every non-blank physical line of
  every module is one example, labelled by Python's own tokenizer (``tokenize``):

    0 ``code``     the line holds a code token (a name, keyword, operator, number...)
    1 ``comment``  the line holds only a comment
    2 ``string``   the line holds only string-literal text: docstrings, mostly, including
                   the lines inside a multi-line string that carry no quote at all

  Segment a is the ``context_lines`` lines before it (0 = none), segment b the line itself
  (token types 0 and 1), so a line in the middle of a docstring is decidable by reading
  upwards to the opening quotes. Class frequencies (Python 3.11 train split): code 70.7%,
  string 18.3%, comment 11.0% -- always answering ``code`` scores 70.7% (the baseline).
  Splits: the corpus's file split (133 train / 14 validation modules), so validation lines
  come from modules never seen in training.
* any other TFDS name, e.g. ``glue/sst2``, or an ``hf:`` dataset, e.g.
  ``hf:nyu-mll/glue:sst2`` (no TensorFlow needed): examples ``text_key`` (default
  ``sentence``), optional ``text_b_key`` and integer ``label_key`` (default ``label``); the
  number of classes comes from the dataset's ``ClassLabel`` (or option ``num_classes``).

Tokens: the base tokenizer (``cfg.tokenizer``, bytes by default; ``sentencepiece`` trains
on the train split's ``text_key`` and ``text_b_key`` fields) with BERT's [CLS]/[SEP]/
[MASK]: its own where it has them (a WordPiece ``hf:DIR``), else appended
(:class:`~transformer_jax.tasks.mlm.MLMVocab`). Over-long inputs are cut
to ``seq_len``: b keeps its start, and a keeps its *end* when b follows it (the context
nearest the line) or its start when it stands alone. With ``pretrained`` set the tokenizer
is the pretraining run's, whatever ``cfg.tokenizer`` says.

Options: ``pretrained`` (an MLM workdir: its ``bert`` encoder initialises this model, the
pooler and classifier stay freshly initialised when it has none), ``context_lines`` (2),
``text_key``, ``text_b_key``, ``label_key``, ``num_classes``. Metric: ``eval_accuracy``.
"""
from __future__ import annotations

import io
import json
import tokenize
from pathlib import Path
import jax
import jax.numpy as jnp
import numpy as np

from .. import data as data_lib
from .. import storage
from ..data.shuffle import EpochIterator, permutation
from ..data.hf_datasets import is_hf_dataset, open_hf_source
from ..data.sources import (check_split, check_tfds_dataset, document_text, is_stdlib,
                            open_source, read_examples)
from ..errors import UserError
from ..losses import token_loss
from ..train.checkpoint import load_params
from .base import Task, register_task
from .mlm import MLMVocab, build_tokenizer, check_bert, jitted_apply

LINE_CLASSES = ("code", "comment", "string")
_IGNORED = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
            tokenize.ENCODING}
_STRING_TYPES = {tokenize.STRING} | {getattr(tokenize, n) for n in
                                     ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                                     if hasattr(tokenize, n)}


# ----------------------------------------------------------------------------- line roles

def physical_lines(source: str) -> list[str]:
    """The lines of ``source`` as ``tokenize`` numbers them: split at ``\n`` only (not at the
    form feeds, ``\x1c``-``\x1e``, ``\x85`` or ``\u2028`` that ``str.splitlines`` also
    breaks at), without their line ends."""
    return [line.rstrip("\r\n") for line in io.StringIO(source).readlines()]


def line_roles(source: str) -> list[int]:
    """The role of each physical line of Python ``source``: an index into ``LINE_CLASSES``,
    or -1 for a blank line. A line covered by a code token is ``code``; else by a string
    token ``string``; else by a comment ``comment``."""
    lines = physical_lines(source)
    code, string, comment = (np.zeros(len(lines) + 2, bool) for _ in range(3))
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type in _IGNORED:
                continue
            target = (string if tok.type in _STRING_TYPES
                      else comment if tok.type == tokenize.COMMENT else code)
            target[tok.start[0]: tok.end[0] + 1] = True
    except (tokenize.TokenError, SyntaxError) as e:
        raise UserError(f"cannot tokenize a document as Python ({e}); the line-role task "
                        "needs Python source (dataset python_stdlib)") from e
    roles = []
    for r, line in enumerate(lines, start=1):
        if not line.strip():
            roles.append(-1)
        else:
            roles.append(0 if code[r] else 2 if string[r] else 1 if comment[r] else -1)
    return roles


def line_role_examples(texts, context_lines: int):
    """``(text_a, text_b | None, label)`` for every non-blank line of every document."""
    for text in texts:
        lines = physical_lines(text)
        for i, role in enumerate(line_roles(text)):
            if role < 0:
                continue
            if context_lines > 0:
                context = "".join(line + "\n" for line in lines[max(0, i - context_lines): i])
                yield context, lines[i], role
            else:
                yield lines[i], None, role


# ----------------------------------------------------------------------------- features

def encode_example(vocab: MLMVocab, a: list[int], b: list[int] | None, seq_len: int):
    """``[CLS] a [SEP] (b [SEP])`` cut to ``seq_len`` -> (ids, token types), each (seq_len,)."""
    if b is None:
        a = a[: seq_len - 2]
        ids = [vocab.cls_id, *a, vocab.sep_id]
        types = [0] * len(ids)
    else:
        budget = seq_len - 3
        b = b[: max(budget - min(len(a), budget // 2), 0)]
        a = a[len(a) - min(len(a), budget - len(b)):]
        ids = [vocab.cls_id, *a, vocab.sep_id, *b, vocab.sep_id]
        types = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    out_ids = np.full((seq_len,), vocab.pad_id, np.int32)
    out_types = np.zeros((seq_len,), np.int32)
    out_ids[: len(ids)] = ids
    out_types[: len(types)] = types
    return out_ids, out_types


class ExampleIterator(EpochIterator):
    """Batches of pre-encoded examples in the order of
    :class:`~transformer_jax.data.shuffle.EpochIterator` (a fresh permutation per epoch, or
    one pass). ``next`` -> ``{"input_ids", "token_type_ids", "attention_mask", "labels":
    int32, "weights": float32 (B,)}``; the last eval batch is filled with weight-0 rows.
    """

    kind = "classification"

    def __init__(self, arrays: dict[str, np.ndarray], *, batch_size: int, seed: int,
                 shuffle: bool, repeat: bool, process_index: int, process_count: int,
                 describe: str):
        self.arrays = arrays
        super().__init__(len(arrays["labels"]), batch_size=batch_size, seed=seed,
                         shuffle=shuffle, repeat=repeat, process_index=process_index,
                         process_count=process_count, describe=describe)

    def make_batch(self, rows, valid):
        batch = {k: v[rows] for k, v in self.arrays.items()}
        batch["weights"] = valid.astype(np.float32)
        return batch


def classify_loss(apply_fn, params, batch, rngs, deterministic: bool, smoothing: float):
    """Cross-entropy of the (B, C) logits against ``labels``, weighted per example."""
    logits = apply_fn({"params": params}, batch["input_ids"], batch["token_type_ids"],
                      batch["attention_mask"], deterministic=deterministic, rngs=rngs)
    return token_loss(logits, batch["labels"], batch["weights"], smoothing)


# ----------------------------------------------------------------------------- task

def _read_pretrained_config(path: str | Path) -> dict:
    config = storage.path(path) / "config.json"
    if not config.is_file():
        raise UserError(f"task option pretrained={str(path)!r}: no config.json there; give the "
                        "workdir of a finished `transformer-jax train` MLM run")
    run = json.loads(config.read_text())
    if run.get("family") != "bert":
        raise UserError(f"task option pretrained={str(path)!r} is a {run.get('family')!r} run; "
                        "it must be a BERT (model=bert) run, e.g. task=mlm")
    return run


@register_task
class ClassifyTask(Task):
    """BERT sequence classification (see the module docstring for data and options)."""
    name = "classify"
    MODELS = ("bert",)
    OPTIONS = {"pretrained": None, "context_lines": 2, "text_key": "sentence",
               "text_b_key": None, "label_key": "label", "num_classes": None}
    loss_fn = staticmethod(classify_loss)
    TEXT_FIELDS, LABEL_FIELDS = ("text_key", "text_b_key"), ("label_key",)
    ID_FIELDS = {"input_ids": "vocab_size", "token_type_ids": "type_vocab_size",
                 "labels": "num_classes"}
    BATCH = {"input_ids": ("int32", ("T",)), "token_type_ids": ("int32", ("T",)),
             "attention_mask": ("int32", ("T",)), "labels": ("int32", ()),
             "weights": ("float32", ())}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        check_bert(cfg, self.name, ("classification",))
        ctx = self.options["context_lines"]
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 0:
            raise UserError(f"task option context_lines={ctx!r} must be an int >= 0")
        if cfg.seq_len < 4:
            raise UserError(f"seq_len={cfg.seq_len} is too short for [CLS] a [SEP] b [SEP]")
        self.stdlib = is_stdlib(cfg.dataset)
        self.classes = (list(spec["classes"]) if spec is not None else self._class_names())
        self.class_ids = {name: i for i, name in enumerate(self.classes)}
        tok_spec = spec
        if spec is None and self.options["pretrained"] is not None:
            tok_spec = _read_pretrained_config(self.options["pretrained"])["task_spec"]
        # SentencePiece trains on the fields the examples are read from
        keys = ("text",) if self.stdlib else tuple(
            self.options[k] for k in ("text_key", "text_b_key") if self.options[k] is not None)
        tokenizer, self.tokenizer_spec = build_tokenizer(cfg, self.workdir, tok_spec, keys)
        self.vocab = MLMVocab(tokenizer)
        self._encoded: dict[str, dict[str, np.ndarray]] = {}

    @classmethod
    def check_split(cls, cfg, options, split) -> None:
        """The embedded corpus: the split exists; an ``hf:`` set: the text and label fields
        of every row (:meth:`Task.check_split`), and the eval split's string labels among
        the train split's; another TFDS set is read by its builder when the task is built."""
        if not isinstance(cfg.dataset, str):
            return
        if is_stdlib(cfg.dataset):
            check_split(cfg.dataset, split, data_dir=cfg.data_dir)
        elif is_hf_dataset(cfg.dataset):
            super().check_split(cfg, options, split)
        if split == "train" or not is_hf_dataset(cfg.dataset):
            return
        label = options["label_key"]
        train = open_hf_source(cfg.dataset, "train").label_strings(label)
        if train is not None:
            open_hf_source(cfg.dataset, split).refuse_unknown_labels(label, train)

    # -- data -------------------------------------------------------------------------
    def _class_names(self) -> list[str]:
        """The classes: the line roles; or, for a label column of strings, its distinct
        strings sorted (ids as ``datasets``' ``class_encode_column`` gives them); else
        ``num_classes`` numbered ones, or the names of the label's ``ClassLabel``."""
        if self.stdlib:
            return list(LINE_CLASSES)
        k, label = self.options["num_classes"], self.options["label_key"]
        source = self._source("train")[0] if k is None or is_hf_dataset(self.cfg.dataset) else None
        strings = source.label_strings(label) if hasattr(source, "label_strings") else None
        if strings is not None:
            if k is not None and int(k) != len(strings):
                raise UserError(f"task.num_classes={k}, but the {label!r} labels of "
                                f"{self.cfg.dataset!r} (train split) are {len(strings)} strings "
                                f"{list(strings)[:10]}; drop task.num_classes (string labels "
                                "are mapped to ids, sorted)")
            return list(strings)
        if k is not None:
            return [str(i) for i in range(int(k))]
        feature = getattr(source, "features", None)   # an hf: dataset's
        if feature is None:
            feature = getattr(getattr(source, "dataset_info", None), "features", {})
        try:
            return list(feature[label].names)
        except (KeyError, TypeError, AttributeError):
            raise UserError(f"cannot tell the number of classes of {self.cfg.dataset!r} (its "
                            f"{label!r} feature is no ClassLabel, nor strings); set "
                            "--set task.num_classes=N") from None

    def _label(self, value, name: str, split: str, row: int) -> int:
        """A row's class id: an int as it is, a string by the run's classes."""
        value = value.item() if isinstance(value, np.ndarray) and value.shape == () else value
        if not isinstance(value, str):
            if value is None:
                raise UserError(f"{name!r} split {split!r} row {row} has no label (an empty "
                                "cell); drop the rows without a label, or fill them")
            return int(value)
        if value not in self.class_ids:
            raise UserError(f"{name!r} split {split!r} row {row} has label {value!r}, not one of "
                            f"the run's classes {self.classes[:10]} (the train split's labels); "
                            "drop those rows or relabel them")
        return self.class_ids[value]

    def _source(self, split):
        if not self.stdlib and not self.cfg.dataset.startswith("hf:"):
            check_tfds_dataset(self.cfg.dataset, self.cfg.data_dir)
            import tensorflow_datasets.text  # noqa: F401  (registers glue & co. for data_source)
        return open_source(self.cfg.dataset, split, data_dir=self.cfg.data_dir)

    def _examples(self, split):
        if self.stdlib:
            texts = data_lib.load_texts(self.cfg.dataset, split, data_dir=self.cfg.data_dir)
            yield from line_role_examples(texts, self.options["context_lines"])
            return
        source, name = self._source(split)
        a_key, b_key, label_key = (self.options[k] for k in ("text_key", "text_b_key", "label_key"))
        for start in range(0, len(source), 512):
            rows = range(start, min(start + 512, len(source)))
            for row, ex in zip(rows, read_examples(source, rows)):
                if label_key not in ex:
                    raise UserError(f"{name!r} examples have no field {label_key!r} (fields: "
                                    f"{sorted(ex)}); set --set task.label_key=FIELD")
                yield (document_text(ex, a_key),
                       None if b_key is None else document_text(ex, b_key, "task.text_b_key"),
                       self._label(ex[label_key], name, split, row))

    def encoded(self, split: str) -> dict[str, np.ndarray]:
        """All examples of ``split`` as arrays (cached): input_ids, token_type_ids,
        attention_mask (N, T) and labels (N,)."""
        if split not in self._encoded:
            tok, t, k = self.vocab.tokenizer, self.cfg.seq_len, len(self.classes)
            ids, types, labels = [], [], []
            for a, b, label in self._examples(split):
                if not 0 <= label < k:
                    raise UserError(f"{self.cfg.dataset!r} split {split!r} has label {label}, "
                                    f"outside [0, {k}) (unlabelled test split?); evaluate on a "
                                     "labelled split (eval_split=validation)")
                i, y = encode_example(self.vocab, tok.encode(a), None if b is None else tok.encode(b), t)
                ids.append(i), types.append(y), labels.append(label)
            if not ids:
                raise UserError(f"{self.cfg.dataset!r} split {split!r} has no examples")
            ids = np.stack(ids)
            self._encoded[split] = {"input_ids": ids, "token_type_ids": np.stack(types),
                                    "attention_mask": (ids != self.vocab.pad_id).astype(np.int32),
                                    "labels": np.asarray(labels, np.int32)}
        return self._encoded[split]

    def make_iterator(self, split, process_index, process_count, *, train: bool):
        # Eval is shuffled too (a fixed order: seed, epoch 0), so the first eval_batches
        # batches are a random sample of the split rather than its first modules.
        return ExampleIterator(
            self.encoded(split), batch_size=self.cfg.batch_size, seed=self.cfg.seed,
            shuffle=True, repeat=train, process_index=process_index,
            process_count=process_count, describe=f"{self.cfg.dataset!r} split {split!r}")

    # -- Task API ---------------------------------------------------------------------
    def spec(self) -> dict:
        return {"tokenizer": self.tokenizer_spec, "classes": self.classes}

    def model_overrides(self) -> dict:
        return {"vocab_size": self.vocab.vocab_size, "head": "classification",
                "num_classes": len(self.classes), "pad_token_id": self.vocab.pad_id}

    def init_args(self):
        z = jnp.zeros((1, self.cfg.seq_len), jnp.int32)
        return (z, z, jnp.ones_like(z))

    def init_params(self, params):
        """With ``pretrained``: the pretraining run's ``bert`` leaves replace ours (shapes
        must match); leaves it lacks (the pooler of an MLM-only run) keep their init."""
        path = self.options["pretrained"]
        if path is None:
            return params
        from ..interop.common import flatten_params, unflatten_params  # only for this option

        _, pre = load_params(path)
        if "bert" not in pre:
            raise UserError(f"pretrained run {path!r} has no 'bert' encoder params")
        theirs = flatten_params(pre["bert"])
        ours = flatten_params(params["bert"])
        for key, value in theirs.items():
            if key not in ours:
                raise UserError(f"pretrained run {path!r} has bert/{'/'.join(key)}, which this "
                                "model lacks (scan_layers or num_layers differ?); use the same "
                                "model settings as the pretraining run")
            if ours[key].shape != value.shape:
                raise UserError(f"pretrained bert/{'/'.join(key)} has shape {value.shape}, this "
                                f"model {ours[key].shape}; use the same model settings "
                                "(d_model, num_layers, max_len, ...) as the pretraining run")
            ours[key] = jnp.asarray(value, ours[key].dtype)
        return {**params, "bert": unflatten_params(ours)}

    def sample(self, model, params, step):
        """A few eval examples with the predicted and true class."""
        if self.cfg.sample_tokens <= 0:
            return None
        arrays = self.encoded(self.cfg.eval_split)
        rows = permutation(len(arrays["labels"]), self.cfg.seed, 0)[:4]
        apply = jitted_apply(self, model)
        logits = apply({"params": params}, *(jnp.asarray(arrays[k][rows]) for k in
                                             ("input_ids", "token_type_ids", "attention_mask")))
        pred = np.asarray(jax.device_get(jnp.argmax(logits, -1)))
        lines = []
        for r, p in zip(rows, pred):
            text = self.vocab.render(arrays["input_ids"][r])
            lines.append(f"{self.classes[p]:>8} (true {self.classes[arrays['labels'][r]]}): {text!r}")
        return "\n".join(lines)
