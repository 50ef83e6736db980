"""Language modelling: packed next-token prediction on a text dataset (TFDS, ``hf:``, the
embedded corpus), its documents read from the field the ``text_key`` option names.

Special ids (:func:`lm_special_ids`): each packed document ends with the tokenizer's eos
(bytes and SentencePiece: 1; ``hf:DIR``: its eos, e.g. GPT-2's ``<|endoftext|>``; a
vocabulary without an eos, such as BERT's WordPiece, ends documents with its ``[SEP]``); the
eval pass pads with the tokenizer's pad (0), or with the eos when the tokenizer has no pad
of its own (GPT-2, ``pad_is_eos``). Padding never weighs: when pad and eos are one id the
batches still weigh every eos target 1 and only the padding 0 (:class:`PadAsEos`).

Generation (:func:`lm_generation_ids`) stops at the eos ids a checkpoint's
``generation_config.json`` names (an ``hf:DIR`` tokenizer's directory: the ``--init-from``
one), and at the run's eos; ``export`` writes the same ids into ``config.json`` and
``generation_config.json``, so that transformers' ``generate`` stops where ours does.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import data as data_lib
from ..decode import decodes_past_max_len, generate
from ..errors import UserError
from ..losses import lm_loss
from .base import Task, register_task, tasks_for


#: what the packing pads with while pad and eos are one id (never a token id: the weights
#: the pipeline computes from it tell padding from eos); replaced by the pad id afterwards
_PAD_PLACEHOLDER = -1


def lm_special_ids(tokenizer) -> tuple[int, int]:
    """``(eos_id, pad_id)`` the LM packs with: the tokenizer's eos (else its [SEP]), and its
    pad (else the eos, the convention of transformers for GPT-2)."""
    eos = tokenizer.eos_id if tokenizer.eos_id is not None else getattr(tokenizer, "sep_id", None)
    if eos is None:
        raise UserError(f"tokenizer {tokenizer!r} has no eos (nor [SEP]) token to end the "
                        "packed documents with; use a tokenizer that has one")
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else eos
    return eos, pad


def lm_generation_ids(tokenizer, eos_id: int, pad_id: int) -> dict:
    """The special ids a language model generates with, and its export writes
    (``config.json``, ``generation_config.json``): ``bos_token_id``, ``eos_token_id`` (a
    list: generation stops at any of them) and ``pad_token_id``. What a checkpoint saved
    with an ``hf:DIR`` tokenizer names comes first (``HFTokenizer.generation_ids``: the
    ``--init-from`` directory's generation_config.json, else its config.json); the run's
    ``eos_id`` (what its documents end with) always stops generation too; the rest is the
    tokenizer's: its bos (bytes and SentencePiece: none) and the run's ``pad_id``."""
    named = getattr(tokenizer, "generation_ids", None) or {}
    eos = list(named.get("eos", ()))
    if eos_id not in eos:
        eos.append(eos_id)
    bos = named.get("bos") if named.get("bos") is not None else tokenizer.bos_id
    pad = named.get("pad") if named.get("pad") is not None else pad_id
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


class PadAsEos:
    """Batches of ``batches`` (packed with :data:`_PAD_PLACEHOLDER` as pad, so their weights
    are 0 on padding only) with the placeholder replaced by ``pad_id`` (= the eos id).
    ``get_state`` / ``set_state`` and other attributes pass through."""

    def __init__(self, batches, pad_id: int):
        self.batches, self.pad_id = batches, pad_id

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        batch = dict(next(self.batches))
        for key in ("inputs", "targets"):
            batch[key] = np.where(batch[key] == _PAD_PLACEHOLDER, self.pad_id,
                                  batch[key]).astype(np.int32)
        return batch

    def __getattr__(self, name: str):
        if name in ("batches", "pad_id"):
            raise AttributeError(name)
        return getattr(self.batches, name)


@register_task
class LMTask(Task):
    """Decoder-only LM. Option ``train_tokens``: train on the first N tokens of the train
    split only (nested subsets, for data-scaling studies; None: all of it); ``text_key``:
    the documents' text field (default ``text``); ``packing``: ``concatenate`` (documents
    joined by eos, attention across them) or ``document`` (segment ids and positions per
    document: each document is trained on as if alone in its row). The tokenizer, the
    dataset and the lengths are config fields."""
    name = "lm"
    MODELS = ("gpt", "gemma")
    OPTIONS = {"train_tokens": None, "text_key": "text", "packing": "concatenate"}
    TEXT_FIELDS = ("text_key",)   # checked in every split before a run starts
    loss_fn = staticmethod(lm_loss)
    ID_FIELDS = {"inputs": "vocab_size", "targets": "vocab_size"}
    PERPLEXITY = {"loss": "ppl"}   # eval_ppl: per next token
    BATCH = {"inputs": ("int32", ("T",)), "targets": ("int32", ("T",)),
             "weights": ("float32", ("T",))}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        if cfg.model not in self.MODELS:
            raise UserError(f"task 'lm' trains a decoder-only model (model=gpt: GPT-2, Llama, "
                            f"Mistral; model=gemma: Gemma 3), got model={cfg.model!r}; set "
                            f"model=gpt or model=gemma, or the task a "
                            f"{cfg.model} model trains (--set task="
                            + " or task=".join(tasks_for(cfg.model)) + ")")
        if not isinstance(self.options["text_key"], str):
            raise UserError(f"task.text_key={self.options['text_key']!r} must be the name of "
                            "the documents' text field, e.g. text or content")
        data_lib.check_packing(self.options["packing"], "task.packing")
        if self.options["packing"] == "document":
            self.BATCH = {**self.BATCH, "segment_ids": ("int32", ("T",)),
                          "positions": ("int32", ("T",))}
        self.tokenizer, self.tokenizer_spec = self._tokenizer(spec)
        self.eos_id, self.pad_id = lm_special_ids(self.tokenizer)
        self.generation = lm_generation_ids(self.tokenizer, self.eos_id, self.pad_id)
        limit = self.options["train_tokens"]
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 2):
            raise UserError(f"task.train_tokens={limit!r} must be an int >= 2 (the size of the "
                            "training subset in tokens) or None (the whole train split)")

    def _tokenizer(self, spec):
        if spec is not None:
            return data_lib.get_tokenizer(spec["tokenizer"]), spec["tokenizer"]
        cfg = self.cfg
        if cfg.tokenizer == "sentencepiece":
            path = self.workdir / "spm.model"
            if not path.exists():
                texts = data_lib.load_texts(cfg.dataset, "train", data_dir=cfg.data_dir,
                                            text_key=self.options["text_key"],
                                            max_documents=200_000)
                data_lib.train_sentencepiece(texts, cfg.sentencepiece_vocab_size, str(path))
            spec_str = f"sentencepiece:{path}"   # absolute, or gs://
        else:
            spec_str = data_lib.canonical_spec(cfg.tokenizer)   # hf:DIR absolute
        return data_lib.get_tokenizer(spec_str), spec_str

    def spec(self) -> dict:
        return {"tokenizer": self.tokenizer_spec}

    def model_overrides(self) -> dict:
        return {"vocab_size": self.tokenizer.vocab_size}

    def generation_ids(self) -> dict:
        return {**self.generation, "eos_token_id": list(self.generation["eos_token_id"])}

    def make_iterator(self, split, process_index, process_count, *, train: bool):
        cfg = self.cfg
        same = self.pad_id == self.eos_id
        stream_tokenizer = data_lib.with_special_ids(   # bytes, SentencePiece: the tokenizer
            self.tokenizer, eos_id=self.eos_id, pad_id=_PAD_PLACEHOLDER if same else self.pad_id)
        it = data_lib.make_lm_iterator(
            cfg.dataset, split, tokenizer=stream_tokenizer, seq_len=cfg.seq_len,
            batch_size=cfg.batch_size, seed=cfg.seed, shuffle=train, repeat=train,
            data_dir=cfg.data_dir, process_index=process_index, process_count=process_count,
            text_key=self.options["text_key"],
            max_tokens=self.options["train_tokens"] if train else None,
            packing=self.options["packing"])
        return PadAsEos(it, self.pad_id) if same else it

    def init_args(self):
        return (jnp.zeros((1, self.cfg.seq_len), jnp.int32),)

    def sample(self, model, params, step):
        if self.cfg.sample_tokens <= 0:
            return None
        return self.generate_text(model, params, self.cfg.sample_prompt,
                                  max_new_tokens=self.cfg.sample_tokens, seed=step)

    def generate_text(self, model, params, prompt, *, max_new_tokens=128, temperature=0.8,
                      top_k=40, top_p=None, seed=0, say=None) -> str:
        """``prompt`` and up to ``max_new_tokens`` sampled tokens (fewer after an eos). A model
        that decodes past its ``max_len`` (a sliding window over RoPE positions) generates
        them all; any other stops at ``max_len``, and ``say`` gets one line with the number
        of tokens cut."""
        tok = self.tokenizer
        ids = tok.encode(prompt) or [self.eos_id]
        self.check_prompt_ids([ids], model.config)       # before anything is compiled
        max_len = model.config.max_len
        room = max_len - len(ids)
        if room < 1:
            raise UserError(f"the prompt is {len(ids)} tokens; the model's max_len is {max_len}; "
                            "give a shorter prompt")
        if max_new_tokens > room and not decodes_past_max_len(model.config):
            if say is not None:
                why = ("its learned position table ends there" if model.config.position == "learned"
                       else "only a sliding window over RoPE positions decodes past max_len")
                say(f"the prompt ({len(ids)} tokens) and --max-new-tokens {max_new_tokens} exceed "
                    f"the model's max_len={max_len}: at most {room} new tokens, "
                    f"{max_new_tokens - room} cut ({why}); a shorter prompt leaves more room")
            max_new_tokens = room
        out = self.generate_ids(model, params, ids, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        return tok.decode(out)

    def generate_ids(self, model, params, ids, *, max_new_tokens, temperature=0.8, top_k=40,
                     top_p=None, seed=0) -> list[int]:
        """``ids`` and up to ``max_new_tokens`` new ids, cut after the first eos of
        :func:`lm_generation_ids` (where an export's transformers ``generate`` stops)."""
        out = generate(model, params, [list(ids)], max_new_tokens=max_new_tokens,
                       temperature=temperature, top_k=top_k or None, top_p=top_p,
                       rng=jax.random.PRNGKey(seed),
                       eos_id=tuple(self.generation["eos_token_id"]), pad_id=self.pad_id)
        return out[0]
