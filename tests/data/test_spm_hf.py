"""A SentencePiece model as Hugging Face files (``transformer_jax/data/spm_hf.py``): the ids
``AutoTokenizer`` gives with its defaults (no special token added) are
``SentencePieceTokenizer``'s, for the models ``train_sentencepiece`` trains (unigram, BPE) and
a T5-layout one (NFKC, dummy prefix, extra whitespace removed); ``sentencepiece_export`` tells
those files (and the older exports') from other tokenizers."""
import json
import os
import shutil

import pytest
import transformers

from tests.tokenizer_dirs import CORPUS, spiece_model
from transformer_jax.data.byte_hf import is_byte_tokenizer
from transformer_jax.data.harness_tasks import docstrings
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.data.spm_hf import (OLD_CONFIG, sentencepiece_export,
                                         write_sentencepiece_tokenizer)
from transformer_jax.data.tokenizers import SentencePieceTokenizer, train_sentencepiece

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

pytest.importorskip("sentencepiece")

STDLIB = os.path.dirname(os.__file__)
#: source files the models did not train on, line by line (leading spaces, tabs, unicode)
HELD_OUT = ("difflib.py", "codecs.py", "locale.py", "encodings/cp1252.py", "html/entities.py")
EDGE = ["", " ", "  ", "a", " a", "  a  b   c  ", "\n", "\n\n  x\n", "\t\tx\t", "   leading",
        "trailing   ", "line1\r\nline2\r", "é ü ß 中文 日本語 🙂🙂 \u200b \x00 \x7f \ufffd",
        "ﬁ ＡＢＣ ① a\u00a0b \U0010ffff", "x" * 500, "<s> <0x4> <::::>", "don't , . ? !"]


def texts() -> list[str]:
    """Lines of code, paragraphs of docstrings, and EDGE: short texts (module docstring of
    spm_hf.py: a long text's near-ties may go either way)."""
    lines = []
    for name in HELD_OUT:
        with open(os.path.join(STDLIB, name), encoding="utf-8") as f:
            lines += f.read().splitlines(keepends=True)
    paragraphs = [p for doc in docstrings().values() for p in doc.split("\n\n")]
    return [*paragraphs, *lines, *EDGE]


def near_tie(tok, ids, other) -> bool:
    """Two segmentations of one text whose scores SentencePiece's float32 running sum cannot
    tell apart (the same length's sum of float32 roundings)."""
    score = tok._processor.get_score
    a, b = sum(score(i) for i in ids), sum(score(i) for i in other)
    return (tok.decode(ids) == tok.decode(other)
            and abs(a - b) <= 2 * max(len(ids), len(other)) * 2.0 ** -24 * max(abs(a), abs(b)))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> a serialized SentencePiece model: ours (unigram, BPE; 800 pieces) and T5's
    layout (600)."""
    root = tmp_path_factory.mktemp("spm")
    out = {kind: train_sentencepiece(CORPUS, 800, root / f"{kind}.model", model_type=kind,
                                     num_threads=1).model_path
           for kind in ("unigram", "bpe")}
    spiece_model(str(root / "t5.model"))
    out["t5"] = str(root / "t5.model")
    return {name: open(path, "rb").read() for name, path in out.items()}


@pytest.mark.parametrize("name", ["unigram", "bpe", "t5"])
def test_autotokenizer_gives_the_sentencepiece_ids(models, name, tmp_path):
    assert write_sentencepiece_tokenizer(models[name], str(tmp_path)) == [
        "spiece.model", "tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours, read_back = SentencePieceTokenizer(models[name]), HFTokenizer(str(tmp_path))
    checked, ties = 0, 0
    for text in texts():
        ids, hf_ids = ours.encode(text), theirs(text)["input_ids"]   # the default: no </s>
        assert read_back.encode(text, add_special=True) == hf_ids
        if hf_ids != ids:                # a near-tie (module docstring of spm_hf.py)
            assert near_tie(ours, ids, hf_ids) and name != "bpe", text
            ties += 1
        if ours.unk_id not in ids:       # SentencePiece writes unk as " ⁇ ", HF skips it
            assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
        checked += len(ids)
    assert checked > 50_000 and ties <= len(texts()) // 100, ties
    assert (theirs.pad_token_id, theirs.eos_token_id, theirs.unk_token_id, theirs.bos_token_id,
            len(theirs)) == (0, 1, 2, None, ours.vocab_size)
    # a special token's literal string is that token for HF, characters for SentencePiece
    assert theirs("a</s>")["input_ids"] == [*ours.encode("a"), 1] != ours.encode("a</s>")
    if name == "unigram":                # and a byte piece's, with byte fallback
        byte = ours._processor.piece_to_id("<0x41>")
        assert theirs("<0x41>")["input_ids"] == [byte] != ours.encode("<0x41>")


def test_our_models_decode_to_the_text(models, tmp_path):
    """The models train_sentencepiece trains keep text exactly (byte fallback, no
    normalization): decoding gives the text back, byte pieces and spaces included."""
    write_sentencepiece_tokenizer(models["unigram"], str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in EDGE + CORPUS[:1]:
        assert theirs.decode(theirs(text)["input_ids"]) == text


def test_bert_specials_follow_the_pieces(models, tmp_path):
    write_sentencepiece_tokenizer(models["unigram"], str(tmp_path), ["[CLS]", "[SEP]", "[MASK]"])
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    size = SentencePieceTokenizer(models["unigram"]).vocab_size
    assert (theirs.cls_token_id, theirs.sep_token_id, theirs.mask_token_id, len(theirs)) == (
        size, size + 1, size + 2, size + 3)
    assert theirs("x [MASK]")["input_ids"][-1] == size + 2
    assert sentencepiece_export(str(tmp_path)) == str(tmp_path / "spiece.model")


def test_sentencepiece_export(models, tmp_path):
    """This export and the older one (spiece.model + T5Tokenizer with no extra ids) are the
    SentencePiece model; a T5 directory, an edited tokenizer.json, a damaged model are not."""
    dirs = {n: tmp_path / n for n in ("now", "old", "t5", "edited", "damaged", "none")}
    for d in dirs.values():
        d.mkdir()
    for name in ("now", "edited", "damaged"):
        write_sentencepiece_tokenizer(models["unigram"], str(dirs[name]))
    shutil.copyfile(dirs["now"] / "spiece.model", dirs["old"] / "spiece.model")
    (dirs["old"] / "tokenizer_config.json").write_text(json.dumps(OLD_CONFIG))
    shutil.copyfile(dirs["now"] / "spiece.model", dirs["t5"] / "spiece.model")
    (dirs["t5"] / "tokenizer_config.json").write_text(json.dumps({**OLD_CONFIG, "extra_ids": 10}))
    edited = json.loads((dirs["edited"] / "tokenizer.json").read_text())
    edited["post_processor"] = {"type": "TemplateProcessing", "single": [], "pair": [],
                                "special_tokens": {}}
    (dirs["edited"] / "tokenizer.json").write_text(json.dumps(edited))
    (dirs["damaged"] / "spiece.model").write_bytes(b"not a model")
    assert {n: sentencepiece_export(str(d)) for n, d in dirs.items()} == {
        "now": str(dirs["now"] / "spiece.model"), "old": str(dirs["old"] / "spiece.model"),
        "t5": None, "edited": None, "damaged": None, "none": None}
    assert not is_byte_tokenizer(str(dirs["now"]))      # a Unigram's vocab is a list
