"""Tests for transformer_jax.data: tokenizers, the python_stdlib dataset, LM batches.

Everything runs offline: the embedded dataset is built from the running
interpreter's standard library into a temporary data_dir (once per session),
and lm1b is replaced by tfds.testing.mock_data.
"""

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer_jax import data
from transformer_jax.data import stdlib_corpus
from transformer_jax.data.tokenizers import ByteTokenizer
from transformer_jax.errors import UserError

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

# -------------------------------------------------------------------------
# Helpers and fixtures.


@pytest.fixture(scope="session")
def tfds_dir(tmp_path_factory):
    """A data_dir holding python_stdlib, built once (offline) for the session."""
    path = str(tmp_path_factory.mktemp("tfds"))
    for split in ("train", "validation"):
        data.open_source("python_stdlib", split, data_dir=path)
    return path


def _batches(it, n):
    return [next(it) for _ in range(n)]


def _assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.keys() == y.keys()
        assert x.keys() in ({"inputs", "targets", "weights"},
                            {"inputs", "targets", "weights", "segment_ids", "positions"})
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


def _assert_resumes(make, steps_before, steps_after=3):
    """Saving after `steps_before` batches and restoring in a fresh iterator
    yields the same next `steps_after` batches as the uninterrupted one."""
    it = make()
    _batches(it, steps_before)
    state = json.loads(json.dumps(it.get_state()))  # must survive JSON
    expected = _batches(it, steps_after)
    restored = make()
    restored.set_state(state)
    _assert_same_batches(_batches(restored, steps_after), expected)
    return state


# Small in-memory corpus: 60 documents of distinct, varied lengths.
_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
CORPUS = [
    f"doc{i}: " + " ".join(_WORDS[(i * 7 + j) % len(_WORDS)] for j in range(i % 9 + 1))
    for i in range(60)
]


# -------------------------------------------------------------------------
# Tokenizers.


def test_byte_tokenizer_golden_ids():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.unk_id) == (259, 0, 1, 2)
    assert tok.encode("Hi!") == [75, 108, 36]  # ord + 3
    assert tok.encode("é") == [0xC3 + 3, 0xA9 + 3] == [198, 172]
    assert tok.encode("a", add_eos=True) == [100, 1]
    assert tok.encode(b"\x00\xff") == [3, 258]
    assert tok.encode("") == []
    arr = tok.encode_array("Hi", add_eos=True)
    assert arr.dtype == np.int32 and arr.tolist() == [75, 108, 1]


def test_byte_tokenizer_round_trip_and_decode_rules():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本語 🙂\n\tdef f(x):\r\n    return x"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(np.array(ids + [1, 0, 0])) == text  # eos and pad dropped
    assert tok.decode([75, 1, 108, 0]) == "Hi"  # eos inside is dropped too
    assert tok.decode([75, 300, 108, -1]) == "Hi"  # ids outside the vocab dropped
    assert tok.decode([75, 2, 108]) == "H\ufffdi"  # unk -> U+FFFD
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"  # cut multi-byte char
    assert tok.decode([0xFF + 3]) == "\ufffd"  # invalid UTF-8


def test_encode_batch_equals_one_by_one():
    """The byte tokenizer's (the loop) and a special-ids view's (its base's) encode_batch."""
    texts = ["Hi", "", "héllo ✓ 日本\n\tx = 1", b"bytes \xff", *CORPUS[:2]]
    for tok in (data.ByteTokenizer(), data.with_special_ids(data.ByteTokenizer(), eos_id=2)):
        batch = tok.encode_batch(texts)
        assert len(batch) == len(texts)
        for got, text in zip(batch, texts):
            np.testing.assert_array_equal(got, tok.encode_array(text))
            assert got.dtype == np.int32
    assert data.ByteTokenizer().encode_batch([]) == []


def test_get_tokenizer():
    assert isinstance(data.get_tokenizer("byte"), ByteTokenizer)
    assert isinstance(data.get_tokenizer(None), ByteTokenizer)
    tok = ByteTokenizer()
    assert data.get_tokenizer(tok) is tok
    with pytest.raises(ValueError, match="unknown tokenizer"):
        data.get_tokenizer("wordpiece")
    with pytest.raises(UserError, match="does not exist"):
        data.get_tokenizer("sentencepiece:/nonexistent/spm.model")


def test_sentencepiece_trained_locally(tfds_dir, tmp_path):
    pytest.importorskip("sentencepiece")
    texts = data.load_texts("python_stdlib", "train", data_dir=tfds_dir, max_documents=12)
    path = str(tmp_path / "spm" / "stdlib.model")
    tok = data.train_sentencepiece(texts, vocab_size=600, model_path=path)
    assert os.path.isfile(path)
    assert (tok.pad_id, tok.eos_id, tok.unk_id) == (0, 1, 2)
    assert 300 <= tok.vocab_size <= 600
    sample = data.load_texts("python_stdlib", "validation", data_dir=tfds_dir)[0][:3000]
    sample += "\n# non-ASCII: héllo ✓ 日本\n\tx = 1\n"
    ids = tok.encode(sample)
    assert all(3 <= i < tok.vocab_size for i in ids)
    assert len(ids) < len(sample.encode("utf-8")) / 1.5  # it does compress code
    assert tok.decode(ids) == sample
    assert tok.decode(ids + [1, 0, 0]) == sample
    assert tok.encode("x", add_eos=True)[-1] == 1
    # The factory loads the same model; the pipeline accepts it.
    same = data.get_tokenizer(f"sentencepiece:{path}")
    assert same.encode(sample) == ids and same.cache_key == tok.cache_key
    it = data.make_lm_iterator(CORPUS, "train", tokenizer=same, seq_len=8, batch_size=2)
    batch = next(it)
    assert batch["inputs"].max() < tok.vocab_size
    batch_texts = [sample, "", "x", sample.encode("utf-8"), *texts[:3]]
    one_by_one = [tok.encode_array(t) for t in batch_texts]
    for got, want in zip(tok.encode_batch(batch_texts), one_by_one, strict=True):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32
    with pytest.raises(ValueError, match="at least 300"):
        data.train_sentencepiece(texts, vocab_size=100, model_path=path)


# -------------------------------------------------------------------------
# Packing.


def test_pack_documents_golden():
    docs = [[10, 11, 12], [20, 21], [], [30, 31, 32, 33]]
    # Stream: 10 11 12 1 20 21 1 30 31 32 33 1 (empty doc skipped), stride 3.
    windows = data.pack_documents(docs, seq_len=3, eos_id=1)
    assert windows.dtype == np.int32
    np.testing.assert_array_equal(
        windows, [[10, 11, 12, 1], [1, 20, 21, 1], [1, 30, 31, 32]]
    )
    padded = data.pack_documents(docs, seq_len=3, eos_id=1, pad_final=True)
    np.testing.assert_array_equal(padded[-1], [32, 33, 1, 0])
    assert padded.shape == (4, 4)
    assert data.pack_documents([[5]], seq_len=4).tolist() == []
    assert data.pack_documents([[5]], seq_len=4, pad_final=True).tolist() == [[5, 1, 0, 0, 0]]


def test_train_batches_golden():
    # Byte ids: a=100 b=101 c=102 d=103 e=104 f=105; stream
    # 100 101 1 102 103 104 1 105 1 -> windows of 3 with stride 2:
    # [100 101 1] [1 102 103] [103 104 1] [1 105 1].
    it = data.make_lm_iterator(
        ["ab", "cde", "f"], "train", seq_len=2, batch_size=2, shuffle=False
    )
    assert (it.num_windows, it.batches_per_epoch, it.mode) == (4, 2, "memory")
    b0, b1, b2 = _batches(it, 3)
    assert b0["inputs"].dtype == np.int32 and b0["weights"].dtype == np.float32
    np.testing.assert_array_equal(b0["inputs"], [[100, 101], [1, 102]])
    np.testing.assert_array_equal(b0["targets"], [[101, 1], [102, 103]])
    np.testing.assert_array_equal(b1["inputs"], [[103, 104], [1, 105]])
    np.testing.assert_array_equal(b1["targets"], [[104, 1], [105, 1]])
    np.testing.assert_array_equal(b0["weights"], np.ones((2, 2)))
    _assert_same_batches([b2], [b0])  # epoch 1, unshuffled
    assert it.get_state() == {"mode": "memory", "epoch": 1, "index": 1}


def test_eval_batches_are_padded_not_dropped():
    # Stream 100 101 1 102 103 104 1 105 1 with T=3: windows
    # [100 101 1 102] [102 103 104 1] [1 105 1 <pad>].
    it = data.make_lm_iterator(
        ["ab", "cde", "f"], "validation", seq_len=3, batch_size=2,
        shuffle=False, repeat=False,
    )
    b0, b1 = list(it)
    np.testing.assert_array_equal(b0["inputs"], [[100, 101, 1], [102, 103, 104]])
    np.testing.assert_array_equal(b0["targets"], [[101, 1, 102], [103, 104, 1]])
    np.testing.assert_array_equal(b1["inputs"], [[1, 105, 1], [0, 0, 0]])
    np.testing.assert_array_equal(b1["targets"], [[105, 1, 0], [0, 0, 0]])
    np.testing.assert_array_equal(b1["weights"], [[1, 1, 0], [0, 0, 0]])
    # Every token after the first is a weighted target exactly once.
    assert sum(b["weights"].sum() for b in (b0, b1)) == 9 - 1
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_document_packing_golden(mode):
    # Stream 100 101 1 | 102 103 104 1 | 105 1 ("ab", "cde", "f"; a document is its ids and
    # its eos) with T=3: windows [100 101 1 102] [102 103 104 1] [1 105 1 <pad>].
    it = data.make_lm_iterator(["ab", "cde", "f"], "validation", seq_len=3, batch_size=2,
                               shuffle=False, repeat=False, mode=mode, packing="document")
    b0, b1 = list(it)
    np.testing.assert_array_equal(b0["inputs"], [[100, 101, 1], [102, 103, 104]])
    np.testing.assert_array_equal(b0["segment_ids"], [[1, 1, 1], [1, 1, 1]])
    np.testing.assert_array_equal(b0["positions"], [[0, 1, 2], [0, 1, 2]])
    # the input eos of "ab" predicts "c", of another document: weight 0
    np.testing.assert_array_equal(b0["weights"], [[1, 1, 0], [1, 1, 1]])
    np.testing.assert_array_equal(b1["inputs"], [[1, 105, 1], [0, 0, 0]])
    np.testing.assert_array_equal(b1["segment_ids"], [[1, 2, 2], [0, 0, 0]])
    np.testing.assert_array_equal(b1["positions"], [[0, 0, 1], [0, 0, 0]])
    np.testing.assert_array_equal(b1["weights"], [[0, 1, 0], [0, 0, 0]])
    assert b1["segment_ids"].dtype == b1["positions"].dtype == np.int32
    # T=4, training: [100 101 1 102 103] [103 104 1 105 1]
    train = data.make_lm_iterator(["ab", "cde", "f"], "train", seq_len=4, batch_size=2,
                                  shuffle=False, mode=mode, packing="document")
    b = next(train)
    np.testing.assert_array_equal(b["inputs"], [[100, 101, 1, 102], [103, 104, 1, 105]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2], [1, 1, 1, 2]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0], [0, 1, 2, 0]])
    np.testing.assert_array_equal(b["weights"], [[1, 1, 0, 1], [1, 1, 0, 1]])
    with pytest.raises(UserError, match="packing='rows' is unknown; choose 'concatenate'"):
        data.make_lm_iterator(["ab"], "train", seq_len=4, batch_size=2, packing="rows")


def test_document_packing_when_pad_is_eos():
    # pad = eos = 1: the padding is told from the eos by each window's length
    windows = np.array([[100, 1, 102, 1, 1]], np.int32)
    batch = data.packing.batch_from_windows(windows, 1, eos_id=1, lengths=np.array([4]))
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 2, 2]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 0, 1]])
    np.testing.assert_array_equal(batch["weights"], [[1, 0, 1, 0]])


def test_pack_examples_golden():
    # prompt + completion + eos (1): 10 11|20 21 22 1 (5 input slots), 12|23 1 (2),
    # 13 14 15|24 1 (4); rows of 6: first fit puts the third example after the second
    examples = [([10, 11], [20, 21, 22]), ([12], [23]), ([13, 14, 15], [24])]
    b = data.packing.pack_examples(examples, 6, eos_id=1)
    np.testing.assert_array_equal(b["inputs"], [[10, 11, 20, 21, 22, 0], [12, 23, 13, 14, 15, 24]])
    np.testing.assert_array_equal(b["targets"], [[11, 20, 21, 22, 1, 0], [23, 1, 14, 15, 24, 1]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1, 1, 0], [1, 1, 2, 2, 2, 2]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3, 4, 0], [0, 1, 0, 1, 2, 3]])
    # loss only where the target is a completion token or the eos
    np.testing.assert_array_equal(b["weights"], [[0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 1, 1]])
    alone = data.packing.pack_examples(examples, 6, eos_id=1, pack=False)
    np.testing.assert_array_equal(alone["inputs"], [[10, 11, 20, 21, 22, 0], [12, 23, 0, 0, 0, 0],
                                                    [13, 14, 15, 24, 0, 0]])
    np.testing.assert_array_equal(alone["weights"].sum(1), [4, 2, 2])
    with pytest.raises(UserError, match="example 0 has 6 tokens .* never split"):
        data.packing.pack_examples(examples, 4, eos_id=1)


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_targets_are_inputs_shifted(mode):
    it = data.make_lm_iterator(CORPUS, "train", seq_len=16, batch_size=4, mode=mode)
    for batch in _batches(it, 5):
        assert batch["inputs"].shape == batch["targets"].shape == (4, 16)
        np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
        np.testing.assert_array_equal(batch["weights"], np.ones((4, 16), np.float32))


def test_stream_mode_matches_memory_mode_in_eval():
    kwargs = dict(seq_len=7, batch_size=3, shuffle=False, repeat=False)
    memory = list(data.make_lm_iterator(CORPUS, "validation", mode="memory", **kwargs))
    stream = list(data.make_lm_iterator(CORPUS, "validation", mode="stream", **kwargs))
    assert len(memory) == -(-((sum(len(t) + 1 for t in CORPUS) - 1) // 7 + 1) // 3)
    _assert_same_batches(stream, memory)


def test_permutation_is_fixed():
    # Pinned values: the order must not depend on NumPy's RNG algorithms.
    assert data.permutation(8, seed=0, epoch=0).tolist() == [3, 7, 2, 4, 1, 5, 6, 0]
    assert data.permutation(8, seed=0, epoch=1).tolist() == [6, 0, 7, 5, 4, 3, 1, 2]
    assert data.permutation(8, seed=1, epoch=0).tolist() == [0, 2, 1, 6, 4, 7, 3, 5]
    assert sorted(data.permutation(1000, seed=7, epoch=3).tolist()) == list(range(1000))


# -------------------------------------------------------------------------
# The python_stdlib dataset.


def test_stdlib_file_list_is_fixed():
    files = stdlib_corpus.STDLIB_FILES
    assert len(files) == 147 and list(files) == sorted(set(files))
    assert stdlib_corpus.file_list_digest() == (
        "c9df04215629c71355cde108f54f666821dfe5e077a414bd47686d75cba4b987"
    )
    train, val = set(stdlib_corpus.TRAIN_FILES), set(stdlib_corpus.VALIDATION_FILES)
    assert len(train) == 133 and len(val) == 14
    assert not train & val and train | val == set(files)
    assert data.STDLIB_FILES is files  # lazy re-export


def test_stdlib_dataset_builds_offline(tfds_dir):
    root = stdlib_corpus.default_stdlib_dir()
    paths = {}
    for split in ("train", "validation"):
        source, _ = data.open_source("python_stdlib", split, data_dir=tfds_dir)
        examples = [source[i] for i in range(len(source))]
        paths[split] = sorted(e["path"].decode() for e in examples)
        # Texts are the files, byte for byte.
        for e in examples[:3]:
            with open(os.path.join(root, e["path"].decode()), "rb") as f:
                assert e["text"] == f.read()
    assert paths["train"] == list(stdlib_corpus.TRAIN_FILES)
    assert paths["validation"] == list(stdlib_corpus.VALIDATION_FILES)
    assert not set(paths["train"]) & set(paths["validation"])
    version = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert os.path.isdir(os.path.join(tfds_dir, "python_stdlib", version, "1.0.0"))
    texts = data.load_texts("python_stdlib", "validation", data_dir=tfds_dir)
    assert len(texts) == 14 and 300_000 < sum(len(t) for t in texts) < 700_000


def test_stdlib_missing_file_is_named(tmp_path):
    partial = tmp_path / "stdlib"
    partial.mkdir()
    (partial / "__future__.py").write_text("x = 1\n")
    builder = stdlib_corpus.PythonStdlib(
        data_dir=str(tmp_path / "tfds"), stdlib_dir=str(partial)
    )
    config = tfds.download.DownloadConfig(try_download_gcs=False)
    with pytest.raises(UserError, match="'_collections_abc.py'"):
        builder.download_and_prepare(download_config=config)


def test_stdlib_iterator_and_cache(tfds_dir):
    it = data.make_lm_iterator(
        "python_stdlib", "train", seq_len=512, batch_size=16, data_dir=tfds_dir
    )
    assert it.mode == "memory" and it.num_documents == 133
    assert 3_500_000 // 512 < it.num_windows < 5_000_000 // 512
    batch = next(it)
    assert batch["inputs"].shape == (16, 512)
    assert batch["inputs"].min() >= 1 and batch["inputs"].max() < 259
    cache = os.listdir(os.path.join(tfds_dir, "transformer_jax_cache"))
    assert any(name.startswith("python_stdlib") and "-train-byte-" in name for name in cache)
    # Reopening uses the cache and gives the same batches.
    again = data.make_lm_iterator(
        "python_stdlib", "train", seq_len=512, batch_size=16, data_dir=tfds_dir
    )
    _assert_same_batches([next(again)], [batch])


def _windows_of(it, n):
    """The (T+1)-token windows of n batches: inputs plus the last target of each row."""
    out = []
    for b in _batches(it, n):
        out += [tuple(np.append(i, t[-1])) for i, t in zip(b["inputs"], b["targets"])]
    return out


def test_max_tokens_trains_on_nested_prefixes(tfds_dir):
    """The first N tokens of the split's stream, from the cached stream of the stdlib corpus
    and, for an in-memory corpus, read document by document (the same tokens); N=4,096 in
    windows of 33 is 127 windows: 7 batches of 16 per epoch, every window a slice of the
    first 4,096 tokens, and the 4,096 a prefix of the 16,384."""
    full = data.make_lm_iterator("python_stdlib", "train", seq_len=32, batch_size=16,
                                 data_dir=tfds_dir, shuffle=False)
    stream = np.asarray(full._stream)
    small = data.make_lm_iterator("python_stdlib", "train", seq_len=32, batch_size=16,
                                  data_dir=tfds_dir, max_tokens=4096)
    larger = data.make_lm_iterator("python_stdlib", "train", seq_len=32, batch_size=16,
                                   data_dir=tfds_dir, max_tokens=16384)
    assert (small.mode, small.num_windows, small.batches_per_epoch) == ("memory", 127, 7)
    np.testing.assert_array_equal(small._stream, stream[:4096])
    np.testing.assert_array_equal(larger._stream[:4096], small._stream)
    starts = {tuple(stream[k * 32: k * 32 + 33]) for k in range(127)}
    epoch = _windows_of(small, 7)
    assert set(epoch) <= starts and len(set(epoch)) == 7 * 16   # one epoch: 112 of the 127 windows
    # in memory (no cache): read document by document until there are enough tokens
    tok = ByteTokenizer()
    corpus_stream = np.concatenate([tok.encode_array(t, add_eos=True) for t in CORPUS])
    it = data.make_lm_iterator(CORPUS, "train", seq_len=8, batch_size=2, max_tokens=100)
    np.testing.assert_array_equal(it._stream, corpus_stream[:100])
    with pytest.raises(UserError, match=f"holds {len(corpus_stream)} tokens, fewer than the "
                                        "100000 asked for; lower the subset size"):
        data.make_lm_iterator(CORPUS, "train", seq_len=8, batch_size=2, max_tokens=100_000)
    with pytest.raises(UserError, match="max_tokens=1 must be an int >= 2"):
        data.make_lm_iterator(CORPUS, "train", seq_len=8, batch_size=2, max_tokens=1)


# -------------------------------------------------------------------------
# Shuffling, state, sharding.


def test_shuffle_is_deterministic_per_seed(tfds_dir):
    def make(seed):
        return data.make_lm_iterator(
            "python_stdlib", "train", seq_len=256, batch_size=8, seed=seed,
            data_dir=tfds_dir,
        )

    first = _batches(make(0), 3)
    _assert_same_batches(_batches(make(0), 3), first)
    other = _batches(make(1), 3)
    assert not np.array_equal(other[0]["inputs"], first[0]["inputs"])
    unshuffled = data.make_lm_iterator(
        "python_stdlib", "train", seq_len=256, batch_size=8, shuffle=False,
        data_dir=tfds_dir,
    )
    assert not np.array_equal(next(unshuffled)["inputs"], first[0]["inputs"])


def test_epochs_are_reshuffled():
    it = data.make_lm_iterator(CORPUS, "train", seq_len=8, batch_size=4, seed=3)
    per_epoch = it.batches_per_epoch
    epoch0 = np.concatenate([b["inputs"] for b in _batches(it, per_epoch)])
    epoch1 = np.concatenate([b["inputs"] for b in _batches(it, per_epoch)])
    assert not np.array_equal(epoch0, epoch1)
    # Same windows each epoch (up to the dropped remainder), other order.
    common = Counter(r.tobytes() for r in epoch0) & Counter(r.tobytes() for r in epoch1)
    assert sum(common.values()) >= len(epoch0) - (it.num_windows % 4)


def test_state_restore_memory_mode(tfds_dir):
    def make():
        return data.make_lm_iterator(
            "python_stdlib", "train", seq_len=1024, batch_size=32, seed=5,
            data_dir=tfds_dir,
        )

    per_epoch = make().batches_per_epoch
    assert _assert_resumes(make, 0) == {"mode": "memory", "epoch": 0, "index": 0}
    assert _assert_resumes(make, 7) == {"mode": "memory", "epoch": 0, "index": 7}
    # Across the epoch boundary: the saved position is the last batch of epoch 0.
    state = _assert_resumes(make, per_epoch - 1)
    assert state == {"mode": "memory", "epoch": 0, "index": per_epoch - 1}
    _assert_resumes(make, per_epoch + 2)


@pytest.mark.parametrize("packing", ["concatenate", "document"])
def test_state_restore_stream_mode(packing):
    def make():
        return data.make_lm_iterator(
            CORPUS, "train", seq_len=16, batch_size=4, seed=2, mode="stream", packing=packing,
        )

    assert make().get_state()["mode"] == "stream"
    mid = _assert_resumes(make, 3)
    assert mid["epoch"] == 0 and mid["doc_pos"] > 0 and mid["token_offset"] >= 0
    # Find the step at which the stream crosses into epoch 1; resume around it.
    it, crossing = make(), 0
    while it.get_state()["epoch"] == 0:
        next(it)
        crossing += 1
    for steps in (crossing - 1, crossing, crossing + 1):
        _assert_resumes(make, steps, steps_after=4)
    # Eval: restoring at the end yields nothing more.
    ev = data.make_lm_iterator(CORPUS, "v", seq_len=16, batch_size=4, mode="stream",
                               repeat=False, shuffle=False)
    n = len(list(ev))
    end_state = ev.get_state()
    fresh = data.make_lm_iterator(CORPUS, "v", seq_len=16, batch_size=4, mode="stream",
                                  repeat=False, shuffle=False)
    fresh.set_state(end_state)
    assert list(fresh) == [] and n > 0


@pytest.mark.parametrize("packing", ["concatenate", "document"])
def test_state_restore_eval_memory_mode(packing):
    def make():
        return data.make_lm_iterator(CORPUS, "v", seq_len=16, batch_size=4,
                                     shuffle=False, repeat=False, packing=packing)

    n = make().batches_per_epoch
    _assert_resumes(make, n - 2, steps_after=2)
    it = make()
    list(it)
    assert it.get_state() == {"mode": "memory", "epoch": 0, "index": n}


def test_set_state_rejects_foreign_state():
    it = data.make_lm_iterator(CORPUS, "train", seq_len=16, batch_size=4)
    with pytest.raises(ValueError, match="mode"):
        it.set_state({"mode": "stream", "epoch": 0, "doc_pos": 0, "token_offset": 0})
    with pytest.raises(ValueError, match="out of range"):
        it.set_state({"mode": "memory", "epoch": 0, "index": 10**6})
    st = data.make_lm_iterator(CORPUS, "train", seq_len=16, batch_size=4, mode="stream")
    state = st.get_state()
    other = data.make_lm_iterator(CORPUS, "train", seq_len=16, batch_size=4,
                                  mode="stream", process_index=1, process_count=2)
    with pytest.raises(ValueError, match="process"):
        other.set_state(state)


def test_process_sharding_memory_mode(tfds_dir):
    def make(index, count, repeat=True):
        return data.make_lm_iterator(
            "python_stdlib", "validation", seq_len=512, batch_size=8, seed=1,
            repeat=repeat, data_dir=tfds_dir, process_index=index, process_count=count,
        )

    single = make(0, 1)
    shards = [make(p, 4) for p in range(4)]
    assert all(s.batch_size == 2 for s in shards)
    seen = []
    for _ in range(5):
        full = next(single)
        parts = [next(s) for s in shards]
        for key in full:  # union over processes == the single stream, by rows
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), full[key])
        seen.append([{r.tobytes() for r in p["inputs"]} for p in parts])
    per_process = [set().union(*(step[p] for step in seen)) for p in range(4)]
    for p in range(4):  # disjoint within the epoch
        for q in range(p + 1, 4):
            assert not per_process[p] & per_process[q]
    # In eval every process yields the same number of (padded) batches.
    counts = {len(list(make(p, 4, repeat=False))) for p in range(4)}
    assert counts == {make(0, 1, repeat=False).batches_per_epoch}


def _stream_documents(batches, eos_id=1):
    """Rebuilds the documents read by one stream-mode eval iterator."""
    tokens = [int(batches[0]["inputs"][0, 0])]
    for b in batches:
        tokens += b["targets"][b["weights"] > 0].tolist()
    docs, current = [], []
    for t in tokens:
        if t == eos_id:
            docs.append(ByteTokenizer().decode(current))
            current = []
        else:
            current.append(t)
    assert not current
    return docs


def test_process_sharding_stream_mode():
    shards = []
    for p in range(3):
        it = data.make_lm_iterator(
            CORPUS, "validation", seq_len=16, batch_size=6, seed=4, mode="stream",
            repeat=False, process_index=p, process_count=3,
        )
        shards.append(_stream_documents(list(it)))
    assert [len(s) for s in shards] == [20, 20, 20]
    for p in range(3):
        for q in range(p + 1, 3):
            assert not set(shards[p]) & set(shards[q])  # disjoint
    assert sorted(sum(shards, [])) == sorted(CORPUS)  # union is the split
    assert shards[0] != CORPUS[0::3]  # documents were shuffled


# -------------------------------------------------------------------------
# Other datasets through TFDS, errors, imports.


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_lm1b_through_mock_data(tmp_path, mode):
    with tfds.testing.mock_data(num_examples=40):
        texts = data.load_texts("lm1b", "train", data_dir=str(tmp_path))
        it = data.make_lm_iterator(
            "lm1b", "train", tokenizer="byte", seq_len=16, batch_size=4,
            shuffle=False, data_dir=str(tmp_path), mode=mode,
        )
        batches = _batches(it, 3)
        shuffled = next(data.make_lm_iterator(
            "lm1b", "train", seq_len=16, batch_size=4, data_dir=str(tmp_path), mode=mode,
        ))
    assert len(texts) == 40 and all(isinstance(t, str) and t for t in texts)
    tok = ByteTokenizer()
    expected_stream = np.concatenate([tok.encode_array(t, add_eos=True) for t in texts])
    got = np.concatenate(
        [batches[0]["inputs"][:, :1].reshape(-1)[:1]]
        + [b["targets"].reshape(-1) for b in batches]
    )
    np.testing.assert_array_equal(got, expected_stream[: len(got)])
    assert not np.array_equal(shuffled["inputs"], batches[0]["inputs"])


def test_empty_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match=r"dataset '<in-memory list>' split 'train' is empty"):
        data.make_lm_iterator([], "train", seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="hold no text"):
        data.make_lm_iterator(["", ""], "train", seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="too small.*batch_size"):
        data.make_lm_iterator(["abc"], "train", seq_len=8, batch_size=2)
    stream = data.make_lm_iterator(["", ""], "train", seq_len=8, batch_size=2, mode="stream")
    with pytest.raises(ValueError, match="hold no text"):
        next(stream)
    with tfds.testing.mock_data(num_examples=0):
        with pytest.raises(ValueError, match=r"dataset 'lm1b' split 'test' is empty"):
            data.make_lm_iterator("lm1b", "test", seq_len=8, batch_size=2,
                                  data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="divisible"):
        data.make_lm_iterator(CORPUS, "train", seq_len=8, batch_size=3, process_count=2)


def test_import_is_cheap():
    code = (
        "import sys, transformer_jax.data; "
        "print('tensorflow' in sys.modules, 'tensorflow_datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]
