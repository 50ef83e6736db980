"""The byte tokenizer (:class:`~transformer_jax.data.tokenizers.ByteTokenizer`) as Hugging
Face tokenizer files, and how ``--init-from`` recognises them.

:func:`write_byte_tokenizer` writes ``tokenizer.json``: a ``tokenizers`` byte-level BPE with
no merges (byte ``b`` -> ``b + 3``; ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2; BERT's ``[CLS]``,
``[SEP]``, ``[MASK]`` after 259 where a run appended them) and no post-processor, with a
``tokenizer_config.json`` for ``PreTrainedTokenizerFast``. ``AutoTokenizer(DIR)(text)``
adds no special token, so its ids are ``ByteTokenizer().encode(text)``: what
``lm_eval --model hf`` (which encodes with the tokenizer's defaults) scores is what the run
trained on. HF's ``ByT5Tokenizer`` would append ``</s>`` to every text. One difference
remains: a text that holds a special token's literal string (``</s>``) gets that token's id,
as with every HF tokenizer, where the byte tokenizer encodes its bytes.

:func:`is_byte_tokenizer` tells such a directory, or one whose ``tokenizer_config.json``
alone names ``ByT5Tokenizer`` (the same ids; older exports wrote that), so that a model
exported from a byte-level run is read back with the ``"byte"`` tokenizer.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

__all__ = ["write_byte_tokenizer", "is_byte_tokenizer"]

BYTE_OFFSET = 3
SPECIALS = ("<pad>", "</s>", "<unk>")          # ids 0, 1, 2
#: tokenizer_config.json's name of each of BERT's special tokens
BERT_TOKEN_NAMES = {"[CLS]": "cls_token", "[SEP]": "sep_token", "[MASK]": "mask_token"}


def byte_symbols() -> list[str]:
    """The character a byte-level BPE stands each byte for (GPT-2's ``bytes_to_unicode``):
    printable Latin-1 bytes as themselves, the others as 256 + n."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + shifted)
            shifted += 1
    return [symbols[b] for b in range(256)]


def _vocab(extra_specials: Sequence[str]) -> dict[str, int]:
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({s: b + BYTE_OFFSET for b, s in enumerate(byte_symbols())})
    vocab.update({token: 256 + BYTE_OFFSET + i for i, token in enumerate(extra_specials)})
    return vocab


def write_byte_tokenizer(out_dir: str, extra_specials: Sequence[str] = ()) -> list[str]:
    """``tokenizer.json`` + ``tokenizer_config.json`` of the byte tokenizer in ``out_dir``
    (``extra_specials``: BERT's tokens appended after the bytes, in id order); the names."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    extra_specials = list(extra_specials)
    tok = Tokenizer(models.BPE(vocab=_vocab(extra_specials), merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*SPECIALS, *extra_specials])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>",
              "eos_token": "</s>", "unk_token": "<unk>",
              **{BERT_TOKEN_NAMES[t]: t for t in extra_specials if t in BERT_TOKEN_NAMES}}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return ["tokenizer.json", "tokenizer_config.json"]


def read_json_object(path: str) -> dict:
    """The JSON object in ``path``; ``{}`` for a missing or unreadable file or another value."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def is_byte_tokenizer(directory: str) -> bool:
    """Whether ``directory``'s tokenizer files are the byte tokenizer's ids (module docstring)."""
    config = read_json_object(os.path.join(directory, "tokenizer_config.json"))
    tokenizer = read_json_object(os.path.join(directory, "tokenizer.json"))
    if not tokenizer:
        return (config.get("tokenizer_class") == "ByT5Tokenizer"
                and not any(os.path.isfile(os.path.join(directory, name))
                            for name in ("spiece.model", "tokenizer.model")))
    model = tokenizer.get("model") or {}
    vocab = model.get("vocab") or {}
    if model.get("type") != "BPE" or not isinstance(vocab, dict):     # a Unigram's is a list
        return False
    extra = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i >= 256 + BYTE_OFFSET]
    return (model.get("type") == "BPE" and not model.get("merges")
            and tokenizer.get("normalizer") is None and tokenizer.get("post_processor") is None
            and (tokenizer.get("pre_tokenizer") or {}).get("type") == "ByteLevel"
            and set(extra) <= set(BERT_TOKEN_NAMES) and vocab == _vocab(extra))
