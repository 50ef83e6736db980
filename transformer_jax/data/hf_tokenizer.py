"""A Hugging Face checkpoint's own tokenizer: ``tokenizer="hf:DIR"``.

``DIR`` is a directory that ``transformers`` wrote with ``save_pretrained`` (a model's or
a tokenizer's, local or ``gs://``). :class:`HFTokenizer` reads it without ``transformers``:

* ``tokenizer.json`` (any "fast" tokenizer: GPT-2's byte-level BPE, BERT's WordPiece, T5's
  Unigram, ...) through the ``tokenizers`` library, with the normalizer, pre-tokenizer and
  post-processor as saved;
* otherwise ``spiece.model`` (T5) or ``tokenizer.model``: a SentencePiece model, through
  ``sentencepiece``, with the added tokens (T5's sentinels ``<extra_id_N>``, the special
  tokens) split out of the text first, as ``transformers`` does.

Ids. ``encode(text)`` is ``AutoTokenizer.from_pretrained(DIR)(text,
add_special_tokens=False)["input_ids"]`` and ``encode(text, add_special=True)`` is
``AutoTokenizer.from_pretrained(DIR)(text)["input_ids"]`` (BERT: ``[CLS] ... [SEP]``; GPT-2:
nothing added; T5: ``... </s>``). Checked against ``transformers`` 5 for GPT-2 byte-level
BPE, BERT WordPiece and T5 (``tokenizer.json``, and ``spiece.model`` alone) in
``tests/data/test_hf_tokenizer.py``. What ``transformers`` does on loading is mirrored: a
named special token missing from the vocabulary is added after it, and an explicit
``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` rebuilds the
post-processor as ``[bos] $A [eos]``.

Special ids (attributes; ``None`` where the tokenizer has none): ``bos_id``, ``eos_id``,
``unk_id``, ``pad_id``, ``cls_id``, ``sep_id``, ``mask_id``, from the token names in
``tokenizer_config.json``, else ``special_tokens_map.json``, else the defaults of the
tokenizer class ``transformers`` would use (GPT-2: ``<|endoftext|>``; BERT: ``[CLS]``...;
T5: ``<pad>``, ``</s>``, ``<unk>``), else the model's ``config.json`` (``eos_token_id``...).

* ``pad_id``: a tokenizer without a pad token (GPT-2) gets its eos as pad, the convention of
  ``transformers`` for training (``tokenizer.pad_token = tokenizer.eos_token``);
  ``pad_is_eos`` tells (tasks that need padding distinct from eos take care of it), and
  ``pad_token_id`` is the pad the files name (None for GPT-2).
* ``decoder_start_id``: the model config's ``decoder_start_token_id``; for T5 without one,
  the pad id (0); None otherwise.
* ``sentinel_ids``: the ids of ``<extra_id_0>``, ``<extra_id_1>``, ... (T5: ``<extra_id_0>``
  is ``vocab_size - 1``, counting down), ``()`` without sentinels.
* ``all_special_ids``: every special token's id (named, sentinels, added tokens marked
  special).
* ``generation_ids``: what a model saved in the directory names for generation
  (``generation_config.json``, else ``config.json``): ``{"bos": id, "eos": (ids...), "pad":
  id}`` (None / ``()`` where it names none in the vocabulary); a language model stops at
  these eos ids and exports them (``tasks/lm.py``'s ``lm_generation_ids``).

``vocab_size`` counts every id, added tokens included (``len(AutoTokenizer(...))``; it may
be less than the model's ``vocab_size``, e.g. T5's 32,100 vs 32,128). ``decode`` skips
special tokens and ids outside the vocabulary. ``cache_key`` is a digest of the tokenizer
files and the special ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax import storage
from transformer_jax.data.tokenizer_base import Tokenizer, ids_as_list
from transformer_jax.errors import UserError

__all__ = ["HFTokenizer"]

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_FILES = ("spiece.model", "tokenizer.model")
#: files read besides the vocabulary; all are optional
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "config.json", "generation_config.json")
SPECIAL_NAMES = ("bos", "eos", "unk", "pad", "cls", "sep", "mask")
_SENTINEL = re.compile(r"<extra_id_(\d+)>")

#: The special tokens a transformers tokenizer class has by default (its ``__init__``
#: defaults), for directories whose files do not name them (e.g. ``gpt2``'s and
#: ``bert-base-uncased``'s tokenizer_config.json name none).
_CLASS_DEFAULTS = {
    "gpt2": {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>"},
    "bert": {"unk": "[UNK]", "sep": "[SEP]", "pad": "[PAD]", "cls": "[CLS]", "mask": "[MASK]"},
    "t5": {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"},
    "roberta": {"bos": "<s>", "eos": "</s>", "sep": "</s>", "cls": "<s>", "unk": "<unk>",
                "pad": "<pad>", "mask": "<mask>"},
}
#: tokenizer class (without "Tokenizer"/"TokenizerFast", lower case) or model type -> defaults
_FAMILY = {"gpt2": "gpt2", "bert": "bert", "distilbert": "bert", "electra": "bert",
           "t5": "t5", "mt5": "t5", "umt5": "t5", "longt5": "t5", "switch_transformers": "t5",
           "roberta": "roberta"}
_T5_FAMILY = "t5"


def _content(value: Any) -> str | None:
    """A token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _token_list(value: Any) -> list[str]:
    """additional_special_tokens / extra_special_tokens (a list, or a dict of named ones)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return [c for c in (_content(v) for v in items) if c is not None]


def _first_int(value: Any) -> int | None:
    """An id from config.json (``eos_token_id`` may be a list: its first)."""
    if isinstance(value, list) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class _Files:
    """The directory's files: listing, raw bytes and parsed JSON, each error a UserError."""

    def __init__(self, directory: str):
        self.directory = directory
        root = storage.path(directory)
        if not root.exists():
            raise UserError(
                f"tokenizer 'hf:{directory}': the directory {directory!r} does not exist; give "
                "the directory a Hugging Face model or tokenizer was saved to (save_pretrained), "
                "holding tokenizer.json or spiece.model")
        if not root.is_dir():
            raise UserError(
                f"tokenizer 'hf:{directory}': {directory!r} is a file, not a directory; give "
                "the directory that holds tokenizer.json (or spiece.model), e.g. "
                f"'hf:{os.path.dirname(directory) or '.'}'")
        self.root = root
        self.names = sorted(p.name for p in root.iterdir())
        self._bytes: dict[str, bytes] = {}

    def path(self, name: str) -> str:
        return os.fspath(self.root / name)

    def read(self, name: str) -> bytes:
        if name not in self._bytes:
            self._bytes[name] = storage.read_bytes(self.path(name))
        return self._bytes[name]

    def text(self, name: str) -> str:
        try:
            return self.read(name).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{self.path(name)} is damaged: not UTF-8 text ({e}); save the "
                            "tokenizer again (save_pretrained)") from None

    def json(self, name: str) -> dict:
        """The file's JSON object; ``{}`` when the file is absent."""
        if name not in self.names:
            return {}
        try:
            value = json.loads(self.text(name))
        except json.JSONDecodeError as e:
            raise UserError(f"{self.path(name)} is damaged: not valid JSON ({e}); save the "
                            "tokenizer again (save_pretrained)") from None
        if not isinstance(value, dict):
            raise UserError(f"{self.path(name)} is damaged: it holds a JSON "
                            f"{type(value).__name__}, not an object; save the tokenizer again")
        return value

    def digest(self, names):
        h = hashlib.sha256()
        for name in names:
            if name in self.names:
                data = self.read(name)
                h.update(f"{name}\0{len(data)}\0".encode())
                h.update(data)
        return h


class HFTokenizer(Tokenizer):
    """The tokenizer saved in a Hugging Face directory (module docstring).

    Args:
      directory: the directory (local or ``gs://``) ``save_pretrained`` wrote.

    Raises:
      UserError: the directory is missing, holds no tokenizer.json nor spiece.model /
        tokenizer.model (the message lists what it holds), or a file is damaged.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        files = _Files(self.directory)
        self.tokenizer_config = files.json("tokenizer_config.json")
        self.special_tokens_map = files.json("special_tokens_map.json")
        self.added_tokens_json = files.json("added_tokens.json")
        self.model_config = files.json("config.json")
        self.family = self._family()
        if TOKENIZER_JSON in files.names:
            self.backend, self.vocab_file = "tokenizers", TOKENIZER_JSON
        else:
            found = [n for n in SENTENCEPIECE_FILES if n in files.names]
            if not found:
                raise UserError(self._nothing_found_message(files.names))
            self.backend, self.vocab_file = "sentencepiece", found[0]
            if self.vocab_file == "spiece.model" and self.family is None:
                self.family = _T5_FAMILY
        self._names = self._token_names()
        if self.backend == "tokenizers":
            self._load_tokenizers(files)
        else:
            self._load_sentencepiece(files)
        self._set_special_ids()
        self.generation_ids = self._generation_ids(files.json("generation_config.json"))
        key = files.digest((self.vocab_file, *CONFIG_FILES[:3]))
        key.update(json.dumps(self.special_token_ids, sort_keys=True).encode())
        key.update(repr((self.decoder_start_id, self.sentinel_ids)).encode())
        self._cache_key = "hf-" + key.hexdigest()[:16]

    # -- loading ---------------------------------------------------------------------
    def _nothing_found_message(self, names: list[str]) -> str:
        shown = ", ".join(names[:20]) + (f", ... ({len(names)} files)" if len(names) > 20 else "")
        hint = ""
        if "vocab.txt" in names or {"vocab.json", "merges.txt"} <= set(names):
            hint = (" It holds a vocabulary without its tokenizer.json: write one with "
                    "transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)).")
        return (f"tokenizer 'hf:{self.directory}': the directory holds no tokenizer.json and no "
                f"{' / '.join(SENTENCEPIECE_FILES)} (found: {shown or 'nothing'}); give the "
                f"directory a Hugging Face tokenizer was saved to (save_pretrained).{hint}")

    def _family(self) -> str | None:
        """"gpt2", "bert", "t5", "roberta" or None: whose class defaults apply."""
        cls = self.tokenizer_config.get("tokenizer_class")
        if isinstance(cls, str):
            name = re.sub(r"Tokenizer(Fast)?$", "", cls).lower()
            if name in _FAMILY:
                return _FAMILY[name]
        model_type = self.model_config.get("model_type")
        return _FAMILY.get(model_type) if isinstance(model_type, str) else None

    def _token_names(self) -> dict[str, str | None]:
        """name -> token text: tokenizer_config.json, special_tokens_map.json, the class
        defaults; a name a file sets to null stays None."""
        defaults = _CLASS_DEFAULTS.get(self.family, {})
        out = {}
        for name in SPECIAL_NAMES:
            key = f"{name}_token"
            if key in self.tokenizer_config:
                out[name] = _content(self.tokenizer_config[key])
            elif key in self.special_tokens_map:
                out[name] = _content(self.special_tokens_map[key])
            else:
                out[name] = defaults.get(name)
        return out

    def _extra_special_tokens(self) -> list[str]:
        seen: list[str] = []
        for source in (self.tokenizer_config, self.special_tokens_map):
            for key in ("additional_special_tokens", "extra_special_tokens"):
                for token in _token_list(source.get(key)):
                    if token not in seen:
                        seen.append(token)
        return seen

    def _decoder_entries(self) -> list[tuple[int, dict]]:
        """tokenizer_config.json's ``added_tokens_decoder``: (id, entry) sorted by id."""
        entries = self.tokenizer_config.get("added_tokens_decoder")
        out = []
        if isinstance(entries, dict):
            for key, entry in entries.items():
                if isinstance(entry, dict) and _content(entry) is not None and str(key).isdigit():
                    out.append((int(key), entry))
        return sorted(out, key=lambda e: e[0])

    def _load_tokenizers(self, files: _Files) -> None:
        try:
            from tokenizers import AddedToken, Tokenizer as Backend, processors
        except ImportError:
            raise UserError("tokenizer 'hf:DIR' with a tokenizer.json needs the 'tokenizers' "
                            "package: pip install tokenizers") from None
        path = files.path(TOKENIZER_JSON)
        text = files.text(TOKENIZER_JSON)
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is damaged: not valid JSON ({e}); save the tokenizer "
                            "again (save_pretrained)") from None
        try:
            tok = Backend.from_str(text)
        except Exception as e:   # the library's own exception type: a malformed tokenizer
            raise UserError(f"{path} is damaged: the tokenizers library cannot read it "
                            f"({str(e).strip()[:300]})") from None
        tok.no_truncation()      # transformers applies none unless asked for
        tok.no_padding()
        # transformers adds the tokens its files name but the vocabulary lacks
        vocab = tok.get_vocab(with_added_tokens=True)
        missing = []
        for _, entry in self._decoder_entries():
            content = _content(entry)
            if content not in vocab:
                missing.append(AddedToken(content, single_word=bool(entry.get("single_word")),
                                          lstrip=bool(entry.get("lstrip")),
                                          rstrip=bool(entry.get("rstrip")),
                                          normalized=bool(entry.get("normalized", False)),
                                          special=bool(entry.get("special", True))))
        for content in [*self._names.values(), *self._extra_special_tokens()]:
            if content is not None and content not in vocab and \
                    all(content != m.content for m in missing):
                missing.append(AddedToken(content, special=True, normalized=False))
        if missing:
            tok.add_tokens(missing)
        if "add_bos_token" in self.tokenizer_config or "add_eos_token" in self.tokenizer_config:
            self._rebuild_post_processor(tok, processors)
        self._tok = tok
        self._model_type = type(tok.model).__name__
        model = spec.get("model") if isinstance(spec, dict) else None
        self._model_unk = _content(model.get("unk_token")) if isinstance(model, dict) else None
        if self._model_unk is None and isinstance(model, dict) and \
                isinstance(model.get("unk_id"), int) and isinstance(model.get("vocab"), list):
            piece = model["vocab"][model["unk_id"]]       # Unigram: [piece, score]
            self._model_unk = piece[0] if isinstance(piece, list) and piece else None
        added = tok.get_added_tokens_decoder()
        self._flagged_special = {i for i, t in added.items() if t.special}
        self._size = max([tok.get_vocab_size(with_added_tokens=True), *(i + 1 for i in added)])

    def _rebuild_post_processor(self, tok, processors) -> None:
        """``[bos] $A [eos]`` as transformers' ``update_post_processor`` builds it."""
        use = {}
        for name in ("bos", "eos"):
            token = self._names[name]
            token_id = tok.token_to_id(token) if token is not None else None
            if self.tokenizer_config.get(f"add_{name}_token") and token_id is not None:
                use[name] = (token, token_id)
        bos = [use["bos"][0]] if "bos" in use else []
        eos = [use["eos"][0]] if "eos" in use else []
        single = [f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos]
        pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=list(use.values()))

    def _load_sentencepiece(self, files: _Files) -> None:
        import sentencepiece as spm   # a dependency of transformer_jax

        proto = files.read(self.vocab_file)
        try:
            sp = spm.SentencePieceProcessor(model_proto=proto)
        except Exception as e:   # sentencepiece raises RuntimeError / OSError variants
            raise UserError(f"{files.path(self.vocab_file)} is damaged: sentencepiece cannot "
                            f"read it ({str(e).strip()[:300]})") from None
        self._sp = sp
        size = sp.get_piece_size()

        def piece_id(piece: str) -> int | None:
            i = sp.piece_to_id(piece)
            return i if sp.id_to_piece(i) == piece else None

        # content -> [id, special, lstrip, rstrip]; matched in the text before sentencepiece
        added: dict[str, list] = {}
        for i in range(size):
            if sp.is_control(i) or sp.is_unknown(i):
                added[sp.id_to_piece(i)] = [i, True, False, False]
        extra = self._extra_special_tokens()
        count = self.tokenizer_config.get("extra_ids")
        if not isinstance(count, int) or count < 0:
            count = sum(1 for t in extra if _SENTINEL.fullmatch(t))
            if count == 0 and self.family == _T5_FAMILY:
                count = 100                         # T5Tokenizer's default extra_ids
        if count and piece_id("<extra_id_0>") is None:
            for k in range(count):                  # appended in reverse: <extra_id_0> last
                added[f"<extra_id_{k}>"] = [size + count - 1 - k, True, False, False]
        for token, token_id in self.added_tokens_json.items():
            if isinstance(token_id, int):
                added.setdefault(token, [token_id, False, False, False])
        for token_id, entry in self._decoder_entries():
            added[_content(entry)] = [token_id, bool(entry.get("special", False)),
                                      bool(entry.get("lstrip")), bool(entry.get("rstrip"))]
        top = max([size - 1, *(v[0] for v in added.values())])
        for token in [*self._names.values(), *extra]:   # named tokens the vocabulary lacks
            if token is not None and token not in added and piece_id(token) is None:
                top += 1
                added[token] = [top, True, False, False]
            elif token is not None and token in added:
                added[token][1] = True
            elif token is not None:
                added[token] = [piece_id(token), True, False, False]
        self._added = {k: tuple(v) for k, v in added.items()}
        self._added_by_id = {v[0]: k for k, v in self._added.items()}
        self._flagged_special = {v[0] for v in self._added.values() if v[1]}
        self._size = top + 1
        self._model_type = "sentencepiece"
        self._model_unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
        tokens = sorted((t for t in self._added if t), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None
        cls_name = self.tokenizer_config.get("tokenizer_class", "")
        llama = isinstance(cls_name, str) and cls_name.startswith("Llama")   # adds bos
        self._add_bos = bool(self.tokenizer_config.get("add_bos_token", llama))
        self._add_eos = bool(self.tokenizer_config.get("add_eos_token",
                                                       self.family == _T5_FAMILY))

    def _generation_ids(self, generation_config: dict) -> dict[str, Any]:
        """What the directory's checkpoint names for generation: per name the first of
        ``generation_config.json``, ``config.json`` and its ``text_config`` (Gemma 3's) that
        names an id inside the vocabulary (HF's class defaults saved with a smaller model,
        e.g. GPT-2's 50256 over 701 ids, name none): ``bos`` and ``pad`` an id or None,
        ``eos`` a tuple of ids (Llama 3 Instruct's generation_config.json names three)."""
        text_config = self.model_config.get("text_config")
        sources = [generation_config, self.model_config,
                   text_config if isinstance(text_config, dict) else {}]
        out: dict[str, Any] = {}
        for name in ("bos", "eos", "pad"):
            found: list[int] = []
            for source in sources:
                value = source.get(f"{name}_token_id")
                found = [i for i in (value if isinstance(value, list) else [value])
                         if isinstance(i, int) and not isinstance(i, bool)
                         and 0 <= i < self.vocab_size]
                if found:
                    break
            out[name] = tuple(found) if name == "eos" else (found[0] if found else None)
        return out

    def _id_of(self, token: str | None) -> int | None:
        if token is None:
            return None
        if self.backend == "tokenizers":
            return self._tok.token_to_id(token)
        if token in self._added:
            return self._added[token][0]
        i = self._sp.piece_to_id(token)
        return i if self._sp.id_to_piece(i) == token else None

    def _set_special_ids(self) -> None:
        ids = {name: self._id_of(token) for name, token in self._names.items()}
        if ids["unk"] is None:
            ids["unk"] = self._id_of(self._model_unk)
        for name in SPECIAL_NAMES:          # the model's config.json, for ids still unknown
            if ids[name] is None and f"{name}_token" not in self.tokenizer_config:
                ids[name] = _first_int(self.model_config.get(f"{name}_token_id"))
        #: the special ids as the files name them (pad None for GPT-2)
        self.special_token_ids = dict(ids)
        self.bos_id, self.eos_id, self.unk_id = ids["bos"], ids["eos"], ids["unk"]
        self.cls_id, self.sep_id, self.mask_id = ids["cls"], ids["sep"], ids["mask"]
        self.pad_token_id = ids["pad"]
        self.pad_id = ids["pad"] if ids["pad"] is not None else ids["eos"]
        self.pad_is_eos = self.pad_id is not None and self.pad_id == self.eos_id
        sentinels = {}
        for token in self._vocab_tokens():
            m = _SENTINEL.fullmatch(token)
            if m:
                sentinels[int(m.group(1))] = self._id_of(token)
        n = 0
        while n in sentinels:
            n += 1
        self.sentinel_ids: tuple[int, ...] = tuple(sentinels[k] for k in range(n))
        start = _first_int(self.model_config.get("decoder_start_token_id"))
        if start is None and (self.family == _T5_FAMILY or self.sentinel_ids):
            start = self.pad_id
        self.decoder_start_id = start
        named = {i for i in ids.values() if i is not None}
        self.all_special_ids = frozenset(named | set(self.sentinel_ids) | self._flagged_special)

    def _vocab_tokens(self):
        if self.backend == "tokenizers":
            return self._tok.get_vocab(with_added_tokens=True)
        return [*self._added, *(self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size()))]

    # -- the interface ---------------------------------------------------------------
    @property
    def spec(self) -> str:
        """The spec string :func:`~transformer_jax.data.get_tokenizer` rebuilds this from."""
        return f"hf:{self.directory}"

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def cache_key(self) -> str:
        return self._cache_key

    def encode(self, text: str | bytes, add_eos: bool = False, *,
               add_special: bool = False) -> list[int]:
        """The ids of ``text``; ``add_special``: with the special tokens the tokenizer adds
        (``AutoTokenizer(text)["input_ids"]``); ``add_eos``: ``eos_id`` appended."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        if self.backend == "tokenizers":
            ids = self._tok.encode(text, add_special_tokens=add_special).ids
        else:
            ids = self._encode_sentencepiece(text, add_special)
        if add_eos:
            if self.eos_id is None:
                raise UserError(f"tokenizer {self.spec!r} has no eos token to append")
            ids.append(self.eos_id)
        return ids

    def encode_array(self, text: str | bytes, add_eos: bool = False, *,
                     add_special: bool = False) -> np.ndarray:
        return np.asarray(self.encode(text, add_eos, add_special=add_special), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        """The ids of each text, as ``encode_array`` (no special tokens added): one
        ``encode_batch`` call of ``tokenizers`` (its threads); a loop for SentencePiece."""
        if self.backend != "tokenizers":
            return super().encode_batch(texts)
        texts = [bytes(t).decode("utf-8", errors="replace") if isinstance(t, (bytes, bytearray))
                 else t for t in texts]
        encodings = self._tok.encode_batch(texts, add_special_tokens=False) if texts else []
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def _encode_sentencepiece(self, text: str, add_special: bool) -> list[int]:
        pieces = self._split.split(text) if self._split is not None else [text]
        ids: list[int] = []
        # pieces alternate: text, added token, text, ...; lstrip/rstrip eat the whitespace
        # next to a token, as the tokenizers library does
        for k in range(1, len(pieces), 2):
            _, _, lstrip, rstrip = self._added[pieces[k]]
            if lstrip:
                pieces[k - 1] = pieces[k - 1].rstrip()
            if rstrip:
                pieces[k + 1] = pieces[k + 1].lstrip()
        for k, piece in enumerate(pieces):
            if k % 2:
                ids.append(self._added[piece][0])
            elif piece:
                ids.extend(self._sp.encode(piece, out_type=int))
        if add_special:
            if self._add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self._add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    def decode(self, ids: Any, skip_special: bool = True) -> str:
        """The text of ``ids``; special tokens (pad, eos, ...) skipped unless
        ``skip_special=False``; ids outside the vocabulary always dropped."""
        drop = self.all_special_ids if skip_special else frozenset()
        kept = [i for i in ids_as_list(ids) if 0 <= i < self._size and i not in drop]
        if self.backend == "tokenizers":
            text = self._tok.decode(kept, skip_special_tokens=skip_special)
            if self.tokenizer_config.get("clean_up_tokenization_spaces") and \
                    self._model_type != "BPE":          # as transformers 5 does
                text = _clean_up_tokenization(text)
            return text
        if self.family == _T5_FAMILY:
            return self._decode_metaspace(kept)
        out, run = [], []
        size = self._sp.get_piece_size()
        for i in kept:
            if i < size and i not in self._added_by_id:
                run.append(i)
                continue
            out.append(self._sp.decode(run))
            run = []
            if i in self._added_by_id:
                out.append(self._added_by_id[i])
        out.append(self._sp.decode(run))
        return "".join(out)

    def _decode_metaspace(self, ids: list[int]) -> str:
        """T5's decoding in transformers (the tokenizers library's Metaspace decoder): the
        pieces joined, U+2581 a space, and dropped in the first piece."""
        size = self._sp.get_piece_size()
        pieces = [self._added_by_id[i] if i in self._added_by_id or i >= size
                  else self._sp.id_to_piece(i) for i in ids if i in self._added_by_id or i < size]
        return "".join(p.replace("\u2581", "" if k == 0 else " ") for k, p in enumerate(pieces))

    def token_to_id(self, token: str) -> int | None:
        """The id of one token (vocabulary or added), or None."""
        return self._id_of(token)

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.directory!r}, backend={self.backend!r}, "
                f"vocab_size={self.vocab_size})")


def _clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: no space before punctuation and clitics."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
