"""``tokenizer="hf:DIR"``: a Hugging Face directory's own tokenizer (data/hf_tokenizer.py).

Small real tokenizers are trained offline once per module on a few standard-library modules:
a GPT-2 byte-level BPE, a BERT WordPiece and a T5 SentencePiece unigram, each saved by
``transformers`` (``save_pretrained``) beside a tiny model ``config.json``; T5 also as a
directory with ``spiece.model`` and no tokenizer.json (a legacy T5 checkpoint). Our ids,
special ids, vocabulary size and decoding are compared with ``transformers.AutoTokenizer``
loading the same directory; then the lm, mlm and seq2seq tasks are built with ``hf:DIR`` and
their batches compared with the HF tokenizer's ids.
"""
import json
import os
import shutil

import numpy as np
import pytest

from tests.tokenizer_dirs import CORPUS, EXTRA_IDS, bert_dir, gpt2_dir, spiece_model, t5_config
from transformer_jax import data
from transformer_jax.data.hf_tokenizer import HFTokenizer
from transformer_jax.errors import UserError
from transformer_jax.tasks import make_task
from transformer_jax.tasks.lm import lm_generation_ids
from transformer_jax.train.config import ExperimentConfig

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "def f(x):\n    return x + 1  # comment\n",
    CORPUS[1][:1500],                                   # code, with indentation and newlines
    "Naïve café — 日本語 ✓ 🙂 Ünïcödé ﬁ ①",               # accents, CJK, emoji, ligature
    "a  b\t\tc\n\n\n   d   ",                           # whitespace runs
    "  leading and trailing  ",
    "",
    "Hello World! It's   MIXED case, isn't it?",
    "special tokens in text: [MASK] [SEP] <|endoftext|> </s> <extra_id_0>x<extra_id_3> y",
]

@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """name -> directory: gpt2, bert, t5 (tokenizer.json), t5_spiece (spiece.model and a
    tokenizer_config.json with extra_ids), t5_legacy (spiece.model and config.json only:
    T5Tokenizer's default 100 sentinels)."""
    base = tmp_path_factory.mktemp("hf")
    out = {name: str(base / name) for name in ("gpt2", "bert", "t5", "t5_spiece", "t5_legacy")}
    gpt2_dir(out["gpt2"])
    bert_dir(out["bert"])
    spiece_model(os.path.join(out["t5_spiece"], "spiece.model"))
    with open(os.path.join(out["t5_spiece"], "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "T5Tokenizer", "extra_ids": EXTRA_IDS}, f)
    t5_config(out["t5_spiece"])
    os.makedirs(out["t5_legacy"])
    shutil.copy(os.path.join(out["t5_spiece"], "spiece.model"), out["t5_legacy"])
    t5_config(out["t5_legacy"])
    transformers.T5Tokenizer.from_pretrained(out["t5_spiece"]).save_pretrained(out["t5"])
    t5_config(out["t5"])
    assert "tokenizer.json" in os.listdir(out["t5"])
    assert "tokenizer.json" not in os.listdir(out["t5_spiece"])
    return out


@pytest.fixture(scope="module")
def hf(dirs):
    """name -> transformers.AutoTokenizer of that directory."""
    return {name: transformers.AutoTokenizer.from_pretrained(path) for name, path in dirs.items()}


@pytest.fixture(scope="module")
def ours(dirs):
    return {name: data.get_tokenizer(f"hf:{path}") for name, path in dirs.items()}


NAMES = ("gpt2", "bert", "t5", "t5_spiece", "t5_legacy")


# ----------------------------------------------------------------------------- ids

@pytest.mark.parametrize("name", NAMES)
def test_ids_equal_the_transformers_tokenizer(name, dirs, hf, ours):
    tok, ref = ours[name], hf[name]
    assert isinstance(tok, HFTokenizer) and tok.spec == f"hf:{dirs[name]}"
    assert tok.backend == ("sentencepiece" if name in ("t5_spiece", "t5_legacy") else "tokenizers")
    assert tok.vocab_size == len(ref)
    for text in TEXTS:
        want = ref(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) == want, (name, text)
        assert tok.encode(text, add_special=True) == ref(text)["input_ids"], (name, text)
        assert tok.encode_array(text).dtype == np.int32
        np.testing.assert_array_equal(tok.encode_array(text), want)
        assert tok.encode(text.encode("utf-8")) == want                # bytes hold UTF-8
        assert all(0 <= i < tok.vocab_size for i in tok.encode(text, add_special=True))
    text = TEXTS[0]
    if ref.eos_token_id is None:                     # BERT
        with pytest.raises(UserError, match="has no eos token to append"):
            tok.encode(text, add_eos=True)
    else:
        assert tok.encode(text, add_eos=True) == \
            ref(text, add_special_tokens=False)["input_ids"] + [ref.eos_token_id]


@pytest.mark.parametrize("name", NAMES)
def test_encode_batch_equals_one_by_one(name, ours):
    """One encode_batch call (tokenizers' batch API; a loop for SentencePiece) gives each
    text's encode_array ids."""
    tok = ours[name]
    texts = [*TEXTS, TEXTS[2].encode("utf-8")]
    batch = tok.encode_batch(texts)
    assert len(batch) == len(texts)
    for got, text in zip(batch, texts):
        np.testing.assert_array_equal(got, tok.encode_array(text))
        assert got.dtype == np.int32
    assert tok.encode_batch([]) == []


def test_special_token_forms(ours, hf):
    """BERT adds [CLS] ... [SEP], GPT-2 nothing, T5 </s>."""
    text = "x = 1"
    bert, gpt2, t5 = ours["bert"], ours["gpt2"], ours["t5"]
    assert bert.encode(text, add_special=True) == [bert.cls_id, *bert.encode(text), bert.sep_id]
    assert gpt2.encode(text, add_special=True) == gpt2.encode(text)
    for name in ("t5", "t5_spiece"):
        assert ours[name].encode(text, add_special=True) == [*ours[name].encode(text), 1]
    assert t5.encode("", add_special=True) == [1] == hf["t5"]("")["input_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_special_ids_equal_the_transformers_tokenizer(name, ours, hf):
    tok, ref = ours[name], hf[name]
    for attr in ("bos", "eos", "unk", "cls", "sep", "mask"):
        assert getattr(tok, f"{attr}_id") == getattr(ref, f"{attr}_token_id"), attr
    assert tok.pad_token_id == ref.pad_token_id
    if name == "gpt2":
        # no pad token: eos is the pad (the transformers convention for training)
        assert ref.pad_token_id is None and tok.pad_id == tok.eos_id == ref.eos_token_id
        assert tok.pad_is_eos and tok.eos_id == tok.vocab_size - 1
        assert (tok.decoder_start_id, tok.sentinel_ids, tok.cls_id) == (None, (), None)
    else:
        assert tok.pad_id == ref.pad_token_id and not tok.pad_is_eos
    if name == "bert":
        assert (tok.bos_id, tok.eos_id, tok.decoder_start_id, tok.sentinel_ids) == (None, None, None, ())
        assert tok.all_special_ids == set(ref.all_special_ids)
    if name.startswith("t5"):
        count = 100 if name == "t5_legacy" else EXTRA_IDS
        assert (tok.pad_id, tok.eos_id, tok.unk_id, tok.decoder_start_id) == (0, 1, 2, 0)
        assert len(tok.sentinel_ids) == count and tok.vocab_size == 600 + count
        assert tok.sentinel_ids[0] == ref.convert_tokens_to_ids("<extra_id_0>") == tok.vocab_size - 1
        assert list(tok.sentinel_ids) == ref.convert_tokens_to_ids(
            [f"<extra_id_{k}>" for k in range(count)])
        assert tok.token_to_id("<extra_id_1>") == tok.vocab_size - 2
        assert tok.all_special_ids == set(ref.all_special_ids)


@pytest.mark.parametrize("name, tokenizer_config", [
    ("gpt2", {"model_max_length": 1024}),                    # as openai-community/gpt2's
    ("bert", {"do_lower_case": True, "model_max_length": 512}),   # as bert-base-uncased's
])
def test_files_that_name_no_tokens_get_the_class_defaults(name, tokenizer_config, dirs, tmp_path):
    """The tokenizer class (here from config.json's model_type) supplies the special tokens
    the files do not name, as transformers does."""
    root = tmp_path / name
    shutil.copytree(dirs[name], root)
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tok, ref = HFTokenizer(root), transformers.AutoTokenizer.from_pretrained(root)
    for attr in ("bos", "eos", "unk", "pad", "cls", "sep", "mask"):
        assert tok.special_token_ids[attr] == getattr(ref, f"{attr}_token_id"), attr
    assert tok.eos_id is not None if name == "gpt2" else tok.cls_id is not None
    for text in TEXTS[:4]:
        assert tok.encode(text, add_special=True) == ref(text)["input_ids"]


def test_decoder_start_comes_from_the_model_config(dirs, tmp_path):
    root = tmp_path / "t5"
    shutil.copytree(dirs["t5"], root)
    with open(root / "config.json") as f:
        config = json.load(f)
    config["decoder_start_token_id"] = 5
    (root / "config.json").write_text(json.dumps(config))
    assert HFTokenizer(root).decoder_start_id == 5
    os.remove(root / "config.json")
    assert HFTokenizer(root).decoder_start_id == 0            # T5 without a config: the pad


def test_generation_ids_come_from_the_checkpoints_files(dirs, tmp_path):
    """``generation_ids``: generation_config.json first, then config.json, then its
    text_config, per name; ids outside the vocabulary (701 ids) are not taken. The lm
    task stops at them and at its own eos (``lm_generation_ids``)."""
    root = tmp_path / "gpt2"
    shutil.copytree(dirs["gpt2"], root)
    os.remove(root / "config.json")
    tok = HFTokenizer(root)
    assert tok.generation_ids == {"bos": None, "eos": (), "pad": None}
    assert lm_generation_ids(tok, 700, 700) == {"bos_token_id": 700, "eos_token_id": [700],
                                                "pad_token_id": 700}
    (root / "config.json").write_text(json.dumps({"model_type": "gemma3", "eos_token_id": [
        50256, 7], "text_config": {"bos_token_id": 3, "pad_token_id": 0}}))
    (root / "generation_config.json").write_text(json.dumps({"bos_token_id": 50256,
                                                             "eos_token_id": [9, 5]}))
    tok = HFTokenizer(root)
    assert tok.generation_ids == {"bos": 3, "eos": (9, 5), "pad": 0}
    assert lm_generation_ids(tok, 700, 700) == {"bos_token_id": 3, "eos_token_id": [9, 5, 700],
                                                "pad_token_id": 0}
    assert lm_generation_ids(data.get_tokenizer("byte"), 1, 0) == {
        "bos_token_id": None, "eos_token_id": [1], "pad_token_id": 0}


# ----------------------------------------------------------------------------- decode, cache key

@pytest.mark.parametrize("name", NAMES)
def test_decode_skips_special_tokens_like_transformers(name, ours, hf):
    tok, ref = ours[name], hf[name]
    for text in TEXTS:
        ids = tok.encode(text, add_special=True)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), (name, text)
        assert tok.decode(np.asarray(ids + [tok.pad_id] * 3)) == tok.decode(ids)   # padded row
        assert tok.decode(ids + [tok.vocab_size, tok.vocab_size + 7]) == tok.decode(ids)
    if name == "gpt2":          # byte-level BPE loses nothing
        for text in TEXTS:
            plain = text.replace("<|endoftext|>", "")
            assert tok.decode(tok.encode(plain)) == plain
    if name == "bert":          # lower case, words and punctuation as WordPiece splits them
        assert tok.decode(tok.encode("Hello World!")) == "hello world!"
    if name.startswith("t5"):
        assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x): return x"
    for text in TEXTS:          # special tokens kept
        ids = tok.encode(text, add_special=True)
        assert tok.decode(ids, skip_special=False) == ref.decode(ids), (name, text)


def test_cache_key_is_a_digest_of_the_files(dirs, ours, tmp_path):
    keys = {name: ours[name].cache_key for name in NAMES}
    assert len(set(keys.values())) == len(keys) and all(k.startswith("hf-") for k in keys.values())
    assert HFTokenizer(dirs["bert"]).cache_key == keys["bert"]             # stable
    root = tmp_path / "bert"
    shutil.copytree(dirs["bert"], root)
    assert HFTokenizer(root).cache_key == keys["bert"]                     # not the path
    with open(root / "tokenizer_config.json") as f:
        config = json.load(f)
    config["mask_token"] = "[SEP]"                                         # another mask id
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFTokenizer(root).cache_key != keys["bert"]


# ----------------------------------------------------------------------------- errors, specs

def test_errors_name_the_problem(dirs, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        data.get_tokenizer(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(UserError, match="names no directory"):
        data.get_tokenizer("hf:")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"holds no tokenizer.json and no spiece.model / "
                                        r"tokenizer.model \(found: nothing\)"):
        HFTokenizer(empty)
    (empty / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    (empty / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"found: config.json, vocab.txt\).*save_pretrained"):
        HFTokenizer(empty)
    with pytest.raises(UserError, match="is a file, not a directory"):
        HFTokenizer(os.path.join(dirs["bert"], "tokenizer.json"))
    for name, content, match in (
            ("tokenizer.json", '{"version": "1.0", "model": ', "tokenizer.json is damaged: not valid JSON"),
            ("tokenizer.json", '{"version": "1.0", "model": {"type": "Nope"}}',
             "tokenizer.json is damaged: the tokenizers library cannot read it"),
            ("tokenizer.json", "[1, 2]", "tokenizer.json is damaged"),
            ("tokenizer_config.json", "{not json", "tokenizer_config.json is damaged: not valid JSON"),
            ("config.json", "[]", "config.json is damaged: it holds a JSON list, not an object"),
    ):
        root = tmp_path / f"broken_{name}_{len(content)}"
        shutil.copytree(dirs["bert"], root)
        (root / name).write_text(content)
        with pytest.raises(UserError, match=match):
            HFTokenizer(root)
    root = tmp_path / "broken_spiece"
    shutil.copytree(dirs["t5_legacy"], root)
    (root / "spiece.model").write_bytes(b"not a model")
    with pytest.raises(UserError, match="spiece.model is damaged: sentencepiece cannot read it"):
        HFTokenizer(root)


def test_config_and_get_tokenizer_accept_hf_dir(dirs, tmp_path, monkeypatch):
    assert ExperimentConfig(tokenizer="hf:/some/dir").tokenizer == "hf:/some/dir"
    assert ExperimentConfig(tokenizer="hf:gs://bucket/dir").tokenizer == "hf:gs://bucket/dir"
    with pytest.raises(UserError, match="tokenizer='hf:' is unknown"):
        ExperimentConfig(tokenizer="hf:")
    monkeypatch.chdir(os.path.dirname(dirs["bert"]))
    assert data.canonical_spec("hf:bert") == f"hf:{dirs['bert']}"
    assert data.canonical_spec("hf:gs://b/d") == "hf:gs://b/d" and data.canonical_spec("byte") == "byte"
    assert data.get_tokenizer("hf:bert").cache_key == HFTokenizer(dirs["bert"]).cache_key


def test_byte_and_sentencepiece_have_no_own_specials():
    tok = data.ByteTokenizer()
    assert (tok.bos_id, tok.cls_id, tok.sep_id, tok.mask_id, tok.decoder_start_id) == (None,) * 5
    assert tok.sentinel_ids == ()
    assert data.with_special_ids(tok, eos_id=1, pad_id=0) is tok
    view = data.with_special_ids(tok, eos_id=5)
    assert (view.eos_id, view.pad_id, view.vocab_size) == (5, 0, 259)
    assert view.encode("a", add_eos=True) == [100, 5] and view.encode_array("a", add_eos=True).tolist() == [100, 5]
    assert view.cache_key != tok.cache_key and view.decode([100, 5]) == tok.decode([100, 5])


# ----------------------------------------------------------------------------- tasks

DOCS = ("def f(x):\n    return x + 1\n", "Naïve café ✓", "class A:\n    pass\n", "x = [1, 2]")


def _stream(ref, eos):
    return [i for doc in DOCS for i in ref(doc, add_special_tokens=False)["input_ids"] + [eos]]


def test_lm_task_packs_the_hf_ids_with_its_eos(dirs, hf, tmp_path):
    """GPT-2: documents end with <|endoftext|>, which is also the pad (no pad token); the
    eos targets weigh 1 and only the padding 0."""
    ref, t, b = hf["gpt2"], 8, 2
    cfg = ExperimentConfig(task="lm", dataset=DOCS, tokenizer=f"hf:{dirs['gpt2']}", seq_len=t,
                           batch_size=b)
    task = make_task(cfg, tmp_path)
    eos = ref.eos_token_id
    assert (task.eos_id, task.pad_id) == (eos, eos)
    assert task.model_overrides() == {"vocab_size": len(ref)}
    assert task.spec() == {"tokenizer": f"hf:{dirs['gpt2']}"}
    stream = _stream(ref, eos)
    n = len(stream)
    rows = [stream[k * t: k * t + t + 1] for k in range(-(-(n - 1) // t))]
    real = [len(r) - 1 for r in rows]
    rows = [r + [eos] * (t + 1 - len(r)) for r in rows]
    batches = list(task.eval_batches(0, 1))
    inputs = np.concatenate([x["inputs"] for x in batches])[: len(rows)]
    targets = np.concatenate([x["targets"] for x in batches])[: len(rows)]
    weights = np.concatenate([x["weights"] for x in batches])
    np.testing.assert_array_equal(inputs, np.array(rows)[:, :-1])
    np.testing.assert_array_equal(targets, np.array(rows)[:, 1:])
    np.testing.assert_array_equal(weights[: len(rows)],
                                  [[1.0] * k + [0.0] * (t - k) for k in real])
    assert weights.sum() == n - 1                       # every eos target counts, padding not
    assert (targets == eos).sum() > (weights[: len(rows)] == 0).sum()
    batch = next(task.train_iterator(0, 1))             # training: full windows, all weighted
    assert batch["weights"].all() and set(batch) == {"inputs", "targets", "weights"}
    assert task.train_iterator(0, 1).get_state() == {"mode": "memory", "epoch": 0, "index": 0}
    # load_run's path: the task rebuilt from its spec reads the same tokenizer
    again = make_task(cfg, tmp_path / "other", spec=task.spec())
    assert again.tokenizer.cache_key == task.tokenizer.cache_key


def test_mlm_task_uses_the_wordpiece_specials(dirs, hf, tmp_path):
    """BERT: [CLS]/[SEP]/[MASK]/[PAD] are the tokenizer's (nothing appended); documents end
    with [SEP]; random replacements come from the ordinary ids after the specials."""
    ref, t = hf["bert"], 10
    cfg = ExperimentConfig(task="mlm", model="bert", dataset=DOCS, seq_len=t, batch_size=2,
                           tokenizer=f"hf:{dirs['bert']}")
    task = make_task(cfg, tmp_path)
    vocab = task.vocab
    assert (vocab.cls_id, vocab.sep_id, vocab.mask_id, vocab.pad_id, vocab.eos_id) == (
        ref.cls_token_id, ref.sep_token_id, ref.mask_token_id, ref.pad_token_id, ref.sep_token_id)
    assert vocab.vocab_size == len(ref) == vocab.tokenizer.vocab_size
    assert task.model_overrides() == {"vocab_size": len(ref), "head": "mlm",
                                      "pad_token_id": ref.pad_token_id}
    assert vocab.random_range == (max(ref.all_special_ids) + 1, len(ref))
    assert set(ref.all_special_ids) <= set(vocab.special_ids)
    stream = _stream(ref, ref.sep_token_id)
    batches = list(task.eval_batches(0, 1))
    ids = np.concatenate([np.where(x["weights"] > 0, x["targets"], x["input_ids"]) for x in batches])
    got = []
    for row, mask in zip(ids, np.concatenate([x["attention_mask"] for x in batches])):
        real = row[mask > 0]
        if len(real):
            assert real[0] == ref.cls_token_id and real[-1] == ref.sep_token_id
            got.extend(real[1:-1].tolist())
    assert got == stream             # the whole stream, each document ended by [SEP]
    for x in batches:   # masked positions are ordinary tokens, never a special id
        assert x["weights"].sum() > 0
        assert not np.isin(x["targets"][x["weights"] > 0], list(ref.all_special_ids)).any()
    # GPT-2's vocabulary has none of BERT's specials nor a pad of its own: all four appended
    gpt2 = data.get_tokenizer(f"hf:{dirs['gpt2']}")
    from transformer_jax.tasks.mlm import MLMVocab

    v = MLMVocab(gpt2)
    n = gpt2.vocab_size
    assert (v.cls_id, v.sep_id, v.mask_id, v.pad_id, v.eos_id, v.vocab_size) == (
        n, n + 1, n + 2, n + 3, gpt2.eos_id, n + 4)
    assert v.stream_tokenizer.pad_id == n + 3 and v.stream_tokenizer.eos_id == gpt2.eos_id


def test_seq2seq_task_uses_the_t5_ids(dirs, hf, tmp_path):
    """T5: sources are the HF ids with </s>, labels the target ids with </s>, the decoder
    starts from the pad 0; the model's special ids are the tokenizer's."""
    ref, s, t = hf["t5"], 16, 12
    cfg = ExperimentConfig(task="seq2seq", model="t5", seq_len=s, batch_size=4,
                           tokenizer=f"hf:{dirs['t5']}",
                           task_options={"transform": "reverse", "max_target_len": t})
    task = make_task(cfg, tmp_path)
    task._texts = {"train": ["def get(ab, xy):\n    return ab\n"],
                   "validation": ["ab = pq + qq + rst + uv + wx\n"]}.__getitem__
    assert (task.pad_id, task.eos_id, task.start_id) == (0, 1, 0)
    assert task.model_overrides() == {"vocab_size": len(ref), "pad_token_id": ref.pad_token_id,
                                      "eos_token_id": ref.eos_token_id, "decoder_start_token_id": 0}
    assert task.spec()["tokenizer"] == f"hf:{dirs['t5']}"
    pairs = task._pairs("validation", train=False).pairs
    assert [p[0] for p in pairs] == ["pq", "qq", "rst", "uv", "wx"]
    batches = list(task.eval_batches(0, 1))
    rows = [(i, r) for i, x in enumerate(batches) for r in range(4) if x["weights"][r, 0] > 0]
    assert len(rows) == len(pairs)
    for (i, r), (src, tgt) in zip(rows, pairs):
        x = batches[i]
        want_src = ref(src)["input_ids"]                          # ids + </s>
        want_tgt = ref(tgt)["input_ids"]
        assert x["inputs"][r].tolist() == want_src + [0] * (s - len(want_src))
        assert x["input_mask"][r].tolist() == [1] * len(want_src) + [0] * (s - len(want_src))
        assert x["labels"][r].tolist() == want_tgt + [0] * (t - len(want_tgt))
        assert x["targets"][r].tolist() == [0] + want_tgt[:-1] + [0] * (t - len(want_tgt))
        assert x["weights"][r].sum() == len(want_tgt)
