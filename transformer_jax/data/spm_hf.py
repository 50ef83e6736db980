"""A SentencePiece model (:class:`~transformer_jax.data.tokenizers.SentencePieceTokenizer`)
as Hugging Face tokenizer files, and how ``--init-from`` recognises them.

:func:`write_sentencepiece_tokenizer` writes the model as ``spiece.model`` and as a
``tokenizer.json`` built here with the ``tokenizers`` library: the same pieces and scores
(Unigram, or BPE with merges read off the pieces), the model's normalization (its
precompiled character map, extra-whitespace removal), ``" "`` -> ``"▁"``, the dummy prefix
where the model adds one, byte fallback, the user-defined symbols (``\\n``, ``\\t`` of
:func:`~transformer_jax.data.tokenizers.train_sentencepiece`) as added tokens, and no
post-processor; plus a ``tokenizer_config.json`` for ``PreTrainedTokenizerFast``.
``AutoTokenizer(DIR)(text)`` adds no special token, so its ids are
``SentencePieceTokenizer.encode(text)``: what ``lm_eval --model hf`` scores is what the run
trained on. HF's ``T5Tokenizer`` (what exports before wrote) appends ``</s>`` to every text.

Two differences remain. A text holding a special token's or a byte piece's literal string
(``</s>``, ``<0x41>``) gets that token's id, as with every HF tokenizer, where SentencePiece
encodes its characters. And SentencePiece sums a unigram segmentation's piece scores in
float32, ``tokenizers`` in float64: where two segmentations score the same, or within
float32's rounding of the running sum, the two may pick different ones (the same text, one
or two pieces apart). Runs of spaces make such ties (``▁▁`` + ``x`` against ``▁`` + ``▁x``;
eight spaces + ``for`` against seven + ``▁for``): in ``tests/data/test_spm_hf.py``, 0.4% of
the lines of code and docstring paragraphs; in whole source files, one place in 2,000-10,000
tokens. Prose without such runs encodes the same.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from ..errors import UserError
from .byte_hf import BERT_TOKEN_NAMES, read_json_object

__all__ = ["tokenizer_json", "write_sentencepiece_tokenizer", "sentencepiece_export"]

SPACE = "▁"
#: tokenizer_config.json of the exports written before tokenizer.json was (T5Tokenizer)
OLD_CONFIG = {"tokenizer_class": "T5Tokenizer", "extra_ids": 0, "eos_token": "</s>",
              "pad_token": "<pad>", "unk_token": "<unk>"}
# ModelProto enums (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_UNIGRAM, _BPE = 1, 2


def _proto(model: bytes) -> Any:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    return proto


def _bpe_merges(pieces: list[tuple[str, float, int]], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Each way of splitting a piece into two pieces, best piece score first (SentencePiece's
    BPE merges the adjacent pair whose union scores highest)."""
    merges = []
    for piece, score, kind in pieces:
        if kind not in (_NORMAL, _USER_DEFINED):
            continue
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((-score, vocab[piece], vocab[left], vocab[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def _normalizer(spec: Any, prefix: bool) -> Any:
    """The model's normalization before segmentation: its character map, then extra
    whitespace removed (leading, trailing, runs of spaces), the dummy prefix ``"▁"`` where
    ``prefix``, then ``" "`` -> ``"▁"``."""
    from tokenizers import Regex, normalizers

    steps = []
    if spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""),
                  normalizers.Replace(Regex(" {2,}"), " ")]
    if prefix:                  # not on an empty text, as SentencePiece
        steps.append(normalizers.Prepend(" "))
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", SPACE))
    return normalizers.Sequence(steps) if steps else None


def tokenizer_json(model: bytes, extra_specials: Sequence[str] = ()) -> Any:
    """The ``tokenizers.Tokenizer`` of a serialized SentencePiece model (module docstring);
    ``extra_specials``: BERT's tokens appended after the pieces, in id order."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    proto = _proto(model)
    trainer, spec = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type not in (_UNIGRAM, _BPE):
        raise UserError("the run's SentencePiece model is a word or character model, which "
                        "has no Hugging Face tokenizer.json; export a run whose model is "
                        "unigram or BPE (transformer_jax.data.train_sentencepiece trains one)")
    if trainer.treat_whitespace_as_suffix:
        raise UserError("the run's SentencePiece model treats whitespace as a suffix, which "
                        "a Hugging Face tokenizer.json cannot; export a run whose model puts "
                        "it in front (transformer_jax.data.train_sentencepiece's default)")
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
    unk_id = next(i for i, (_, _, kind) in enumerate(pieces) if kind == _UNKNOWN)
    if trainer.model_type == _UNIGRAM:
        tok = Tokenizer(models.Unigram([(piece, score) for piece, score, _ in pieces],
                                       unk_id=unk_id, byte_fallback=trainer.byte_fallback))
    else:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_bpe_merges(pieces, vocab),
                                   unk_token=pieces[unk_id][0], fuse_unk=True,
                                   byte_fallback=trainer.byte_fallback))
    # the dummy prefix: on the whole text; with user-defined symbols split out first, on
    # the first part only (after them the normalizer's would prefix each part)
    user_defined = [piece for piece, _, kind in pieces if kind == _USER_DEFINED]
    in_normalizer = spec.add_dummy_prefix and not user_defined
    tok.normalizer = _normalizer(spec, in_normalizer)
    prepend = "first" if spec.add_dummy_prefix and not in_normalizer else "never"
    space = SPACE if spec.escape_whitespaces else " "
    # no split: the whole text is one lattice, as in SentencePiece (whitespace-only pieces)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=space, prepend_scheme=prepend,
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else []))
    # user-defined symbols are matched before normalization, as SentencePiece does
    tok.add_tokens([AddedToken(piece, normalized=False, special=False) for piece in user_defined])
    tok.add_special_tokens([AddedToken(piece, normalized=False, special=True)
                            for piece, _, kind in pieces if kind in (_CONTROL, _UNKNOWN)])
    tok.add_special_tokens([AddedToken(name, normalized=False, special=True)
                            for name in extra_specials])
    return tok


def write_sentencepiece_tokenizer(model: bytes, out_dir: str,
                                  extra_specials: Sequence[str] = ()) -> list[str]:
    """``spiece.model``, ``tokenizer.json`` and ``tokenizer_config.json`` of a serialized
    SentencePiece model in ``out_dir`` (module docstring); the names written."""
    from .tokenizers import SentencePieceTokenizer

    tok = SentencePieceTokenizer(model)          # pad 0 and eos 1, or a UserError
    names = {i: tok._processor.id_to_piece(i) for i in (tok.pad_id, tok.eos_id, tok.unk_id)}
    hf = tokenizer_json(model, extra_specials)
    with open(os.path.join(out_dir, "spiece.model"), "wb") as f:
        f.write(model)
    hf.save(os.path.join(out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": names[tok.pad_id],
              "eos_token": names[tok.eos_id], "unk_token": names[tok.unk_id],
              **{BERT_TOKEN_NAMES[t]: t for t in extra_specials if t in BERT_TOKEN_NAMES}}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return ["spiece.model", "tokenizer.json", "tokenizer_config.json"]


def sentencepiece_export(directory: str) -> str | None:
    """The ``spiece.model`` of a directory whose tokenizer files are that model's export
    (module docstring), else None."""
    path = os.path.join(directory, "spiece.model")
    try:
        with open(path, "rb") as f:
            model = f.read()
        from .tokenizers import SentencePieceTokenizer
        SentencePieceTokenizer(model)
    except Exception:                       # no file, not a model, not pad 0 / eos 1
        return None
    written = read_json_object(os.path.join(directory, "tokenizer.json"))
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        others = ("special_tokens_map.json", "added_tokens.json", "tokenizer.model")
        old = (read_json_object(os.path.join(directory, "tokenizer_config.json")) == OLD_CONFIG
               and not any(os.path.isfile(os.path.join(directory, n)) for n in others))
        return path if old else None
    size = len(_proto(model).pieces)
    extra = [t.get("content") for t in written.get("added_tokens", [])
             if isinstance(t, dict) and isinstance(t.get("id"), int) and t["id"] >= size]
    if not set(extra) <= set(BERT_TOKEN_NAMES):
        return None
    try:
        expected = json.loads(tokenizer_json(model, extra).to_str())
    except UserError:                       # a word or character model: no tokenizer.json
        return None
    strip = ("version", "truncation", "padding")
    same = ({k: v for k, v in written.items() if k not in strip}
            == {k: v for k, v in expected.items() if k not in strip})
    return path if same else None
