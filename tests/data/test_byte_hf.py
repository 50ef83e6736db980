"""The byte tokenizer as Hugging Face files (``transformer_jax/data/byte_hf.py``): the ids
``AutoTokenizer`` gives with its defaults (no special token added) are the byte tokenizer's,
and ``is_byte_tokenizer`` tells those files (and ByT5's) from other tokenizers."""
import json

import pytest
import transformers

from tests.tokenizer_dirs import CORPUS, gpt2_dir
from transformer_jax.data.byte_hf import is_byte_tokenizer, write_byte_tokenizer
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.data.tokenizers import ByteTokenizer

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

TEXTS = [CORPUS[0][:3000], "def f(x):\n    return 'é'\t # 🙂 \x00\x7f", "", "  two  spaces  "]


def test_autotokenizer_gives_the_byte_ids_with_no_specials_added(tmp_path):
    assert write_byte_tokenizer(str(tmp_path), ["[CLS]", "[SEP]", "[MASK]"]) == [
        "tokenizer.json", "tokenizer_config.json"]
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours, read_back = ByteTokenizer(), HFTokenizer(str(tmp_path))
    for text in TEXTS:
        ids = ours.encode(text)
        assert theirs(text)["input_ids"] == ids                 # the default: no </s>
        assert read_back.encode(text, add_special=True) == ids
        assert theirs.decode(ids) == text
    assert (theirs.pad_token_id, theirs.eos_token_id, theirs.unk_token_id, theirs.bos_token_id) == (
        0, 1, 2, None)
    assert (theirs.cls_token_id, theirs.sep_token_id, theirs.mask_token_id, len(theirs)) == (
        259, 260, 261, 262)
    assert theirs.decode([75, 1, 108, 0]) == "H</s>i<pad>"
    assert theirs.decode([75, 1, 108, 0], skip_special_tokens=True) == ours.decode([75, 1, 108, 0])


def test_is_byte_tokenizer(tmp_path):
    written, gpt2, byt5, t5, empty = (tmp_path / n for n in ("w", "gpt2", "byt5", "t5", "empty"))
    for d in (written, byt5, t5, empty):
        d.mkdir()
    write_byte_tokenizer(str(written))
    gpt2_dir(gpt2)
    for d in (byt5, t5):
        (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    (t5 / "spiece.model").write_bytes(b"not bytes")
    assert [is_byte_tokenizer(str(d)) for d in (written, byt5, gpt2, t5, empty)] == [
        True, True, False, False, False]
