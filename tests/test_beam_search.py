"""Greedy and beam search (torch-free checks; HF equality is in tests/interop/test_hf_t5.py)
and the ``seq2seq`` task that decodes with them: data, batches, exact resume, training."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.beam_search import _beam, beam_search, greedy_search, strip_after_eos
from transformer_jax.models.t5 import T5, T5Config
from transformer_jax.models.transformer import Transformer, TransformerConfig
from transformer_jax.tasks import make_task
from transformer_jax.tasks.seq2seq import (PairIterator, _ListPairs, corpus_bleu, cut_at_eos,
                                           encode_pairs, identifier_pairs, reverse, snake_to_camel)
from transformer_jax.data import ByteTokenizer
from transformer_jax.train.config import ExperimentConfig, apply_overrides, load_experiment
from transformer_jax.workdir import load_run
from transformer_jax.run import train

MODELS = {
    "t5": T5(T5Config(vocab_size=8, d_model=32, num_heads=4, head_dim=8, mlp_dim=48, num_layers=1,
                      num_decoder_layers=2, relative_attention_num_buckets=8,
                      relative_attention_max_distance=20, dropout_rate=0.0)),
    "transformer": Transformer(TransformerConfig(vocab_size=8, max_len=16, num_layers=1,
                                                 num_decoder_layers=2, d_model=32, num_heads=4,
                                                 mlp_dim=48, dropout_rate=0.0)),
}
_PARAMS: dict = {}


def model_and_params(name):
    if name not in _PARAMS:
        model = MODELS[name]
        ids = jnp.zeros((1, 4), jnp.int32)
        params = jax.jit(lambda r: model.init(r, ids, ids)["params"])(jax.random.PRNGKey(1))
        # sharpen the output distribution so that beams disagree and eos is sometimes likely
        params = jax.tree_util.tree_map(lambda x: x * 1.5, jax.device_get(params))
        _PARAMS[name] = model, jax.tree_util.tree_map(jnp.asarray, params)
    return _PARAMS[name]


def sources(seed=0, b=4, s=7):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, 8, (b, s)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    return ids, mask


def cut(row, eos):
    row = [int(x) for x in row]
    return row[: row.index(eos) + 1] if eos in row else row


# ----------------------------------------------------------------------------- search

def test_one_beam_equals_greedy():
    model, params = model_and_params("t5")
    ids, mask = sources()
    # an eos that row 0 emits within 3 steps while another row runs to the limit (the eos id
    # is a traced argument: trying several costs no compilation)
    for eos in range(1, 8):
        greedy = np.asarray(greedy_search(model, params, ids, mask, max_new_tokens=8, eos_id=eos))
        lengths = [len(cut(r, eos)) for r in greedy]
        if lengths[0] <= 3 and max(lengths) == 8:
            break
    else:
        pytest.fail("no eos candidate gives both an early stop and a full-length row")
    for row in greedy:                             # pad (0) after eos
        assert all(t == 0 for t in row[len(cut(row, eos)):])
    for early_stopping in (False, True):
        beam = beam_search(model, params, ids, mask, num_beams=1, max_new_tokens=8, eos_id=eos,
                           early_stopping=early_stopping)
        np.testing.assert_array_equal(np.asarray(beam.sequences), greedy)


@functools.lru_cache(maxsize=None)
def _log_probs(model):
    return jax.jit(lambda p, *a: jax.nn.log_softmax(model.apply({"params": p}, *a), axis=-1))


def _rescored(model, params, ids, mask, seqs, eos, length_penalty):
    """sum log p(token) over each hypothesis (up to its eos) / len ** length_penalty."""
    start = np.zeros((seqs.shape[0], 1), np.int32)
    dec = np.concatenate([start, seqs[:, :-1]], axis=1)
    logp = _log_probs(model)(params, ids, dec, mask)
    picked = np.take_along_axis(np.asarray(logp), seqs[..., None], axis=-1)[..., 0]
    lengths = np.array([len(cut(r, eos)) for r in seqs])
    valid = np.arange(seqs.shape[1])[None] < lengths[:, None]
    return (picked * valid).sum(1) / lengths.astype(np.float64) ** length_penalty


def test_beam_scores_are_length_normalised_log_probs():
    model, params = model_and_params("transformer")
    ids, mask = sources(1)
    out = beam_search(model, params, ids, mask, num_beams=3, max_new_tokens=8, length_penalty=0.7)
    b, k, L = out.beam_sequences.shape
    seqs = np.asarray(out.beam_sequences).reshape(b * k, L)
    want = _rescored(model, params, np.repeat(ids, k, 0), np.repeat(mask, k, 0), seqs, 1, 0.7)
    np.testing.assert_allclose(np.asarray(out.beam_scores).reshape(-1), want, rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(np.asarray(out.beam_scores), axis=1) <= 0)      # best first
    assert len({len(cut(r, 1)) for r in seqs}) > 1                        # eos ends some early


def test_rows_are_independent_and_options_do_not_recompile():
    model, params = model_and_params("transformer")
    ids, mask = sources(2)
    out = beam_search(model, params, ids, mask, num_beams=3, max_new_tokens=8, eos_id=3)
    size = _beam._cache_size()
    perm = np.array([2, 0, 3, 1])
    again = beam_search(model, params, ids[perm], mask[perm], num_beams=3, max_new_tokens=8,
                        eos_id=3)
    np.testing.assert_array_equal(np.asarray(again.sequences), np.asarray(out.sequences)[perm])
    np.testing.assert_allclose(np.asarray(again.scores), np.asarray(out.scores)[perm], rtol=1e-6)
    for lp, es, eos in ((0.0, True, 3), (2.0, "never", 5)):
        beam_search(model, params, ids, mask, num_beams=3, max_new_tokens=8, length_penalty=lp,
                    early_stopping=es, eos_id=eos)
    assert _beam._cache_size() == size


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_beams=0), "num_beams must be an int >= 1"),
    (dict(early_stopping="sometimes"), "early_stopping must be True, False or 'never'"),
    (dict(length_penalty="long"), "length_penalty must be a number"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=17), "exceeds the model's max_len=16"),
    (dict(attention_mask=np.ones((4, 3))), "attention_mask shape"),
])
def test_bad_arguments_raise(kwargs, match):
    model, params = model_and_params("transformer")
    ids, mask = sources()
    args = {**dict(num_beams=2, max_new_tokens=4, attention_mask=mask), **kwargs}
    with pytest.raises(ValueError, match=match):
        beam_search(model, params, ids, **args)


def test_strip_after_eos():
    assert strip_after_eos([[5, 1, 0, 0], [4, 4, 4, 4]], 1) == [[5, 1], [4, 4, 4, 4]]


# ----------------------------------------------------------------------------- seq2seq data

def test_transforms_golden():
    assert snake_to_camel("_make_key") == "MakeKey"
    assert snake_to_camel("utf_8_decode") == "Utf8Decode"
    assert snake_to_camel("__init_subclass__") == "InitSubclass"
    assert reverse("get_item") == "meti_teg"
    train = ["def load_file(path):\n    file_name = path\n", "x = MAX_SIZE"]
    held_out = ["file_name = load_all_files()\nnew_name = 1"]
    assert identifier_pairs(train, None, "snake_to_camel") == [("file_name", "FileName"),
                                                               ("load_file", "LoadFile")]
    assert identifier_pairs(train, held_out, "snake_to_camel") == [("load_all_files", "LoadAllFiles"),
                                                                   ("new_name", "NewName")]
    with pytest.raises(ValueError, match="unknown seq2seq transform 'upper'"):
        identifier_pairs(train, None, "upper")


def test_encode_pairs_layout():
    tok = ByteTokenizer()
    batch = encode_pairs(tok, [("ab_c", "AbC"), ("zz", "Z")], np.array([True, False]), 6, 5, 0)
    np.testing.assert_array_equal(batch["inputs"], [[100, 101, 98, 102, 1, 0], [0] * 6])
    np.testing.assert_array_equal(batch["input_mask"], [[1, 1, 1, 1, 1, 0], [0] * 6])
    np.testing.assert_array_equal(batch["targets"], [[0, 68, 101, 70, 0], [0] * 5])
    np.testing.assert_array_equal(batch["labels"], [[68, 101, 70, 1, 0], [0] * 5])
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1, 1, 0], [0] * 5])
    cut_batch = encode_pairs(tok, [("abcdefgh", "ABCDEFGH")], np.array([True]), 4, 3, 0)
    np.testing.assert_array_equal(cut_batch["inputs"], [[100, 101, 102, 1]])   # eos kept
    np.testing.assert_array_equal(cut_batch["labels"], [[68, 69, 1]])


def _iterator(**kw):
    pairs = _ListPairs([(f"w{i}_x", f"W{i}X") for i in range(10)])
    args = dict(batch_size=4, src_len=8, tgt_len=8, start_id=0, seed=3, shuffle=True, repeat=True,
                process_index=0, process_count=1, describe="test pairs")
    return PairIterator(pairs, ByteTokenizer(), **{**args, **kw})


def test_iterator_epochs_resume_and_eval_padding():
    it = _iterator()
    batches = [next(it) for _ in range(5)]                 # 2 batches per epoch: 3 epochs
    state = it.get_state()
    assert state == {"epoch": 2, "index": 1}
    later = [next(it) for _ in range(3)]
    fresh = _iterator()
    fresh.set_state(json.loads(json.dumps(state)))
    for a, b in zip(later, [next(fresh) for _ in range(3)]):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    first_epoch = np.concatenate([b["inputs"][:, 1] for b in batches[:2]])     # the digit
    assert len(set(first_epoch.tolist())) == 8             # no repeats within an epoch
    assert not np.array_equal(batches[0]["inputs"], batches[2]["inputs"])       # reshuffled
    halves = [_iterator(process_index=p, process_count=2) for p in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([next(h)["inputs"] for h in halves]),
                                  batches[0]["inputs"])
    ev = list(_iterator(shuffle=False, repeat=False))
    assert len(ev) == 3 and ev[2]["weights"][:2].sum() > 0 and ev[2]["weights"][2:].sum() == 0
    with pytest.raises(ValueError, match="not a seq2seq iterator state"):
        fresh.set_state({"epoch": 0})


# ----------------------------------------------------------------------------- seq2seq task

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


TINY_RUN = ["model_preset=tiny", "model.num_layers=1", "model.d_model=32", "model.num_heads=2",
            "model.mlp_dim=64", "seq_len=24", "task.max_target_len=24", "batch_size=8", "steps=3",
            "eval_every=3", "save_every=3", "eval_batches=1", "task.decode_batches=1",
            "sample_tokens=1", "log_every=1", "warmup_steps=1"]


def test_stdlib_task_trains_and_generates(tmp_path, data_dir):
    cfg = apply_overrides(load_experiment("transformer_stdlib_seq2seq"),
                          TINY_RUN + [f"data_dir={data_dir}", "model.max_len=24"])
    task = make_task(cfg, tmp_path / "run")
    assert task.model_overrides() == {"vocab_size": 259, "pad_token_id": 0, "eos_token_id": 1,
                                      "decoder_start_token_id": 0}
    assert len(task._pairs("train", train=True)) > 5000 and len(task._pairs("validation", train=False)) > 300
    summary = train(cfg, tmp_path / "run", progress=False)
    assert np.isfinite(summary["loss"]) and 0.0 <= summary["eval_exact_match"] <= 1.0
    assert summary["eval_decoded"] == 8.0
    assert (tmp_path / "run" / "samples.txt").read_text().count("->") >= 1
    _, model, params, loaded = load_run(tmp_path / "run")
    assert isinstance(model, Transformer)
    assert isinstance(loaded.generate_text(model, params, "get_file_name", max_new_tokens=128), str)
    # the metrics' plumbing, with a decoder that returns the labels (every other row cut short)
    labels = next(loaded.eval_batches(0, 1))["labels"]
    oracle = labels.copy()
    oracle[::2, 3:] = loaded.tokenizer.pad_id
    oracle[::2, 2] = loaded.tokenizer.eos_id
    loaded._decode = lambda *a, **k: oracle
    metrics = loaded.extra_eval(model, params)
    want = [loaded.tokenizer.decode(cut_at_eos(r, 1)) for r in labels]
    got = [loaded.tokenizer.decode(cut_at_eos(r, 1)) for r in oracle]
    assert metrics["exact_match"] == 0.5 and metrics["decoded"] == 8.0
    assert metrics["bleu"] == pytest.approx(corpus_bleu(got, want, tokenize="char"))
    assert 0 < metrics["bleu"] < 100


def test_corpus_bleu_golden():
    assert corpus_bleu(["MakeKey", "AddItem"], ["MakeKey", "AddItem"], tokenize="char") == pytest.approx(100.0)
    # characters: 1-gram precision 4/5, 2-gram 3/4, 3-gram 2/3, 4-gram 1/2, equal lengths
    # (brevity penalty 1): BLEU = 100 * (4/5 * 3/4 * 2/3 * 1/2) ** (1/4)
    assert corpus_bleu(["abcde"], ["abcdf"], tokenize="char") == pytest.approx(100 * 0.2 ** 0.25, abs=1e-4)
    # words (WMT's 13a tokenizer), a shorter hypothesis: precisions 5/5, 3/4, 2/3, 1/2 and the
    # brevity penalty exp(1 - 6/5)
    assert corpus_bleu(["the cat sat on mat"], ["the cat sat on the mat"]) == pytest.approx(
        100 * np.exp(1 - 6 / 5) * (1 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25, abs=1e-4)
    with pytest.raises(ValueError, match="one reference per hypothesis"):
        corpus_bleu(["a"], [])


def test_t5_experiment_config_and_task_errors(tmp_path, data_dir):
    cfg = load_experiment("t5_stdlib_seq2seq")
    assert (cfg.task, cfg.model, cfg.dataset) == ("seq2seq", "t5", "python_stdlib")
    with pytest.raises(ValueError, match="needs an encoder-decoder model"):
        make_task(ExperimentConfig(task="seq2seq", model="gpt"), tmp_path)
    with pytest.raises(ValueError, match="transform='upper' is unknown"):
        make_task(apply_overrides(cfg, ["task.transform=upper"]), tmp_path)
    with pytest.raises(ValueError, match="beam_size=0 must be an int >= 1"):
        make_task(apply_overrides(cfg, ["task.beam_size=0"]), tmp_path)
    with pytest.raises(ValueError, match="did you mean 'beam_size'"):
        make_task(apply_overrides(cfg, ["task.beam_sise=2"]), tmp_path)


def test_wmt14_translation_pairs_with_mock_data(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    cfg = apply_overrides(ExperimentConfig(), ["task=seq2seq", "model=t5", "seq_len=16",
                                               "task.max_target_len=12", "batch_size=4",
                                               "dataset=wmt14_translate/de-en"])
    task = make_task(cfg, tmp_path)
    with tfds.testing.mock_data(num_examples=6):
        batch = next(task.train_iterator(0, 1))
        source = task._pairs("train", train=True)
        de, en = source.get([0])[0]
        ev = list(task.eval_batches(0, 1))
    assert batch["inputs"].shape == (4, 16) and batch["labels"].shape == (4, 12)
    assert batch["weights"].sum() > 0
    tok = ByteTokenizer()
    assert batch["weights"].dtype == np.float32 and isinstance(de, str) and isinstance(en, str)
    row = encode_pairs(tok, [(de, en)], np.array([True]), 16, 12, 0)
    assert any(np.array_equal(row["inputs"][0], r) for r in batch["inputs"])
    assert len(ev) == 2 and ev[-1]["weights"][2:].sum() == 0        # 6 examples, batches of 4
