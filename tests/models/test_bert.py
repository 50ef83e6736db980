"""BERT: the model, the MLM masking recipe, and the mlm / classify tasks end to end.

HF parity lives in ``tests/interop/test_hf_bert.py``.
"""
import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds

from transformer_jax.data import ByteTokenizer, make_lm_iterator
from transformer_jax.errors import UserError
from transformer_jax.models import FAMILIES
from transformer_jax.layers.stack import stack_layers
from transformer_jax.models.bert import (HEADS, Bert, BertConfig, BertForMaskedLM, BertForPreTraining,
                                         BertForSequenceClassification, BertModel, _embedding_init)
from transformer_jax.tasks import make_task
from transformer_jax.tasks.classify import LINE_CLASSES, encode_example, line_roles
from transformer_jax.tasks.mlm import MLMIterator, MLMVocab, frame, mask_tokens
from transformer_jax.train.config import ExperimentConfig, apply_overrides
from transformer_jax.workdir import load_run
from transformer_jax.run import train
from transformer_jax.train.monitor import read_metrics

from ..helpers import assert_packed_like_alone

CFG = BertConfig.preset("tiny", vocab_size=50, max_len=16, num_layers=2, d_model=32,
                        num_heads=4, dropout_rate=0.0, attention_dropout_rate=0.0)
VOCAB = MLMVocab(ByteTokenizer())


def init(cfg, seed=0):
    """Random params of ``Bert(cfg)`` (shapes from ``eval_shape``; numpy draws: no XLA compile)."""
    shapes = jax.eval_shape(lambda: Bert(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(np.float32),
                                  nn.meta.unbox(shapes["params"]))


@pytest.fixture(scope="module")
def params():
    return init(CFG)


def ids_and_mask(seed=0, b=2, t=8, vocab=50):
    ids = np.random.default_rng(seed).integers(1, vocab, (b, t)).astype(np.int32)
    mask = np.ones((b, t), np.int32)
    mask[1, 5:] = 0
    return ids, mask


# ============================================================================ model

def test_config_presets_and_validation():
    base = BertConfig.preset("bert-base")
    assert (base.num_layers, base.d_model, base.num_heads, base.vocab_size, base.max_len,
            base.type_vocab_size, base.mlp_features) == (12, 768, 12, 30522, 512, 2, 3072)
    large = BertConfig.preset("bert-large")
    assert (large.num_layers, large.d_model, large.num_heads, large.mlp_features) == (24, 1024, 16, 4096)
    assert base.num_params() == 110_106_428            # BertForPreTraining (the default head)
    assert FAMILIES["bert"] == (BertConfig, Bert)
    with pytest.raises(ValueError, match="d_model=30 is not divisible by num_heads=4"):
        BertConfig.preset("tiny", d_model=30)
    with pytest.raises(ValueError, match="head='lm' is unknown.*pretraining"):
        BertConfig.preset("tiny", head="lm")
    with pytest.raises(ValueError, match="pad_token_id=600 is outside"):
        BertConfig.preset("tiny", pad_token_id=600)
    with pytest.raises(ValueError, match="Did you mean 'bert-base'"):
        BertConfig.preset("bert_base")


@pytest.mark.parametrize("head", HEADS)
def test_num_params_matches_init(head):
    cfg = CFG.replace(head=head, num_classes=5)
    shapes = jax.eval_shape(lambda: Bert(cfg).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))
    assert sum(x.size for x in jax.tree_util.tree_leaves(nn.meta.unbox(shapes))) == cfg.num_params()


def test_flops_per_token():
    cfg = BertConfig.preset("bert-base")
    n_mlm = cfg.num_params(non_embedding=True) + 30522 * 768          # tied read-out counts
    assert cfg.flops_per_token(128) == 6 * n_mlm + 12 * 12 * 768 * 128
    cls = cfg.replace(head="classification")
    assert cls.flops_per_token(128) == 6 * cls.num_params(non_embedding=True) + 12 * 12 * 768 * 128


@pytest.mark.parametrize("cls, head", [(BertForPreTraining, "pretraining"), (BertForMaskedLM, "mlm"),
                                       (BertModel, "base"), (BertForSequenceClassification, "classification")])
def test_heads_and_output_shapes(params, cls, head):
    module = cls(CFG.replace(num_classes=3))
    assert module.config.head == head
    ids, mask = ids_and_mask()
    p = init(module.config)
    out = module.apply({"params": p}, ids, np.zeros_like(ids), mask)
    if head == "pretraining":
        assert set(out) == {"mlm_logits", "nsp_logits"}
        assert out["mlm_logits"].shape == (2, 8, 50) and out["nsp_logits"].shape == (2, 2)
        assert out["mlm_logits"].dtype == out["nsp_logits"].dtype == jnp.float32
    elif head == "mlm":
        assert out.shape == (2, 8, 50) and "pooler" not in p["bert"]
    elif head == "base":
        assert out[0].shape == (2, 8, 32) and out[1].shape == (2, 32)
        assert float(jnp.abs(out[1]).max()) <= 1.0                       # tanh pooler
    else:
        assert out.shape == (2, 3) and out.dtype == jnp.float32


def test_mlm_head_is_tied_with_output_bias(params):
    """MLM logits = LayerNorm(gelu(Dense(h))) @ word_embeddings^T + bias, checked by hand."""
    cfg = CFG.replace(head="mlm")
    p = init(cfg)
    p["mlm"]["bias"] = jnp.arange(50, dtype=jnp.float32) / 50
    ids, mask = ids_and_mask(1)
    logits = Bert(cfg).apply({"params": p}, ids, None, mask)
    seq, _ = Bert(cfg.replace(head="base")).apply({"params": {**p, "bert": {**p["bert"], "pooler": {
        "kernel": jnp.zeros((32, 32)), "bias": jnp.zeros(32)}}}}, ids, None, mask)
    h = seq @ p["mlm"]["transform"]["kernel"] + p["mlm"]["transform"]["bias"]
    h = jax.nn.gelu(h, approximate=False)
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = (h - mu) / jnp.sqrt(var + 1e-12) * p["mlm"]["transform_norm"]["scale"] + p["mlm"]["transform_norm"]["bias"]
    expected = h @ p["bert"]["word_embeddings"]["embedding"].T + p["mlm"]["bias"]
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_padding_and_token_types(params):
    module = Bert(CFG.replace(head="base"))
    p = init(module.config)
    ids, mask = ids_and_mask(2)
    seq, _ = module.apply({"params": p}, ids, None, mask)
    junk = np.where(mask == 1, ids, 9)
    seq2, _ = module.apply({"params": p}, junk, None, mask)
    np.testing.assert_allclose(np.asarray(seq)[mask == 1], np.asarray(seq2)[mask == 1], rtol=1e-6, atol=1e-6)
    # token types add the type embedding before the embedding LayerNorm
    types = np.ones_like(ids)
    seq3, _ = module.apply({"params": p}, ids, types, mask)
    assert not np.allclose(np.asarray(seq3), np.asarray(seq))
    swapped = {**p, "bert": {**p["bert"], "token_type_embeddings": {
        "embedding": p["bert"]["token_type_embeddings"]["embedding"][::-1]}}}
    seq4, _ = module.apply({"params": swapped}, ids, None, mask)
    np.testing.assert_allclose(np.asarray(seq4), np.asarray(seq3), rtol=1e-6, atol=1e-6)


def test_pad_row_is_zero_at_init_and_gets_no_lookup_gradient():
    table = _embedding_init(0.02, 0)(jax.random.PRNGKey(0), (6, 4))
    assert float(jnp.abs(table[0]).max()) == 0.0 and float(jnp.abs(table[1:]).min()) > 0
    cfg = CFG.replace(head="base", pad_token_id=0)
    p = init(cfg)
    ids = np.array([[3, 4, 0, 0]])

    @jax.jit
    def grads(p):
        loss = lambda p, cfg: Bert(cfg).apply({"params": p}, ids)[0].sum()  # noqa: E731
        return (jax.grad(loss)(p, cfg)["bert"]["word_embeddings"]["embedding"],
                jax.grad(loss)(p, cfg.replace(pad_token_id=None))["bert"]["word_embeddings"]["embedding"])

    with_pad, without = grads(p)
    assert float(jnp.abs(with_pad[0]).max()) == 0.0 and float(jnp.abs(with_pad[3]).max()) > 0
    assert float(jnp.abs(without[0]).max()) > 0


def test_scan_and_remat_match_unscanned(params):
    ids, mask = ids_and_mask(3)
    ref = Bert(CFG).apply({"params": params}, ids, None, mask)
    scanned = {**params, "bert": stack_layers(params["bert"], 2, name="layer")}
    for flags in (dict(scan_layers=True), dict(scan_layers=True, remat=True)):
        out = Bert(CFG.replace(**flags)).apply({"params": scanned}, ids, None, mask)
        for k in ref:
            np.testing.assert_allclose(np.asarray(out[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-5)
    out = Bert(CFG.replace(remat=True)).apply({"params": params}, ids, None, mask)
    np.testing.assert_allclose(np.asarray(out["mlm_logits"]), np.asarray(ref["mlm_logits"]), rtol=1e-6)


def test_logical_axis_names():
    boxed = jax.eval_shape(lambda: Bert(CFG).init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))["params"]
    known = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "norm", None}
    leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    for path, leaf in leaves:
        assert isinstance(leaf, nn.Partitioned), jax.tree_util.keystr(path)
        assert len(leaf.names) == len(leaf.value.shape) and set(leaf.names) <= known, jax.tree_util.keystr(path)
    names = {jax.tree_util.keystr(p): l.names for p, l in leaves}
    assert names["['bert']['word_embeddings']['embedding']"] == ("vocab", "embed")
    assert names["['bert']['layer_0']['self_attn']['query']['kernel']"] == ("embed", "heads", "head_dim")
    assert names["['mlm']['bias']"] == ("vocab",)


def test_bf16_compute_keeps_fp32_logits(params):
    ids, mask = ids_and_mask(4)
    out = Bert(CFG.replace(dtype="bfloat16")).apply({"params": params}, ids, None, mask)
    ref = Bert(CFG).apply({"params": params}, ids, None, mask)
    assert out["mlm_logits"].dtype == out["nsp_logits"].dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out["mlm_logits"]), np.asarray(ref["mlm_logits"]), atol=0.1)


def test_dropout_is_active_only_in_training(params):
    cfg = CFG.replace(dropout_rate=0.5, attention_dropout_rate=0.5)
    ids, mask = ids_and_mask(5)
    module = Bert(cfg)
    a = module.apply({"params": params}, ids, None, mask)
    b = module.apply({"params": params}, ids, None, mask, deterministic=False,
                     rngs={"dropout": jax.random.PRNGKey(1)})
    np.testing.assert_allclose(np.asarray(a["mlm_logits"]),
                               np.asarray(Bert(CFG).apply({"params": params}, ids, None, mask)["mlm_logits"]))
    assert not np.allclose(np.asarray(a["mlm_logits"]), np.asarray(b["mlm_logits"]))


def test_bad_inputs_raise(params):
    module = Bert(CFG)
    with pytest.raises(ValueError, match="sequence length 17 exceeds the model's max_len=16"):
        module.apply({"params": params}, jnp.zeros((1, 17), jnp.int32))
    with pytest.raises(ValueError, match=r"token_type_ids must have the shape of input_ids \(1, 4\)"):
        module.apply({"params": params}, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"input_ids must be \(B, T\)"):
        module.apply({"params": params}, jnp.zeros((4,), jnp.int32))


# ============================================================================ masking recipe

MASK_ARGS = dict(mask_id=VOCAB.mask_id, random_range=VOCAB.random_range, special_ids=VOCAB.special_ids)


def test_mask_tokens_golden():
    """A fixed input and seed give fixed masks (pins the hash-based draws across platforms)."""
    ids = np.array([[259, 75, 108, 108, 111, 35, 119, 111, 114, 108, 103, 260, 0, 0],
                    [259, 35, 35, 35, 35, 35, 35, 35, 35, 35, 35, 35, 35, 260]], np.int32)
    out = mask_tokens(ids, (0, 0, 0), **MASK_ARGS, mask_prob=0.3)
    # row 0: 10 candidates -> 3 selected; row 1: 12 candidates -> 4 selected
    assert out["weights"].sum(axis=1).tolist() == [3, 4]
    assert out["input_ids"].tolist() == GOLDEN_INPUTS
    assert np.nonzero(out["weights"])[1].tolist() == GOLDEN_POSITIONS
    np.testing.assert_array_equal(out["targets"], np.where(out["weights"] > 0, ids, 0))


# Row 0 selects positions 3, 4 ([MASK]) and 7 (kept); row 1 selects 5, 7, 9 ([MASK]) and 6
# (random byte 40, i.e. "%"): all three fates appear.
GOLDEN_INPUTS = [[259, 75, 108, 261, 261, 35, 119, 111, 114, 108, 103, 260, 0, 0],
                 [259, 35, 35, 35, 35, 261, 40, 261, 35, 261, 35, 35, 35, 260]]
GOLDEN_POSITIONS = [3, 4, 7, 5, 6, 7, 9]


def test_mask_tokens_hand_checkable_cases():
    ids = np.array([[259, 10, 11, 12, 13, 260, 0, 0]], np.int32)
    everything = mask_tokens(ids, 1, **MASK_ARGS, mask_prob=1.0, mask_token_prob=1.0, random_token_prob=0.0)
    assert everything["input_ids"].tolist() == [[259, 261, 261, 261, 261, 260, 0, 0]]
    assert everything["targets"].tolist() == [[0, 10, 11, 12, 13, 0, 0, 0]]
    assert everything["weights"].tolist() == [[0, 1, 1, 1, 1, 0, 0, 0]]
    keep = mask_tokens(ids, 1, **MASK_ARGS, mask_prob=1.0, mask_token_prob=0.0, random_token_prob=0.0)
    assert keep["input_ids"].tolist() == ids.tolist() and keep["weights"].sum() == 4
    rand = mask_tokens(ids, 1, **MASK_ARGS, mask_prob=1.0, mask_token_prob=0.0, random_token_prob=1.0)
    assert ((rand["input_ids"][0, 1:5] >= 3) & (rand["input_ids"][0, 1:5] < 259)).all()
    one = mask_tokens(ids, 1, **MASK_ARGS, mask_prob=0.01)               # at least one token
    assert one["weights"].sum() == 1
    nothing = mask_tokens(np.array([[259, 260, 0]], np.int32), 1, **MASK_ARGS)
    assert nothing["weights"].sum() == 0 and nothing["input_ids"].tolist() == [[259, 260, 0]]
    with pytest.raises(ValueError, match="sum to at most 1"):
        mask_tokens(ids, 1, **MASK_ARGS, mask_token_prob=0.8, random_token_prob=0.3)
    with pytest.raises(ValueError, match="mask_prob must be in"):
        mask_tokens(ids, 1, **MASK_ARGS, mask_prob=1.5)


def test_mask_tokens_statistics():
    rng = np.random.default_rng(0)
    b, t = 512, 128
    ids = rng.integers(3, 259, (b, t)).astype(np.int32)
    ids[:, 0], ids[:, -1] = VOCAB.cls_id, VOCAB.sep_id
    lengths = rng.integers(20, t, b)
    ids[np.arange(t)[None, :] >= lengths[:, None]] = 0                  # right padding
    ids[np.arange(b), lengths - 1] = VOCAB.sep_id
    out = mask_tokens(ids, (7, 3), **MASK_ARGS)
    sel = out["weights"] > 0
    n = (~np.isin(ids, VOCAB.special_ids)).sum(axis=1)
    np.testing.assert_array_equal(sel.sum(axis=1), np.maximum(np.floor(0.15 * n + 0.5), 1))
    assert not (sel & np.isin(ids, VOCAB.special_ids)).any()
    np.testing.assert_array_equal(out["targets"][sel], ids[sel])
    np.testing.assert_array_equal(out["input_ids"][~sel], ids[~sel])
    got = out["input_ids"][sel]
    total = sel.sum()                                                    # ~9000 selections
    masked = (got == VOCAB.mask_id).mean()
    changed = ((got != VOCAB.mask_id) & (got != ids[sel])).mean()
    kept = (got == ids[sel]).mean()
    tol = 4 * np.sqrt(0.1 * 0.9 / total)                                 # 4 sigma
    assert abs(masked - 0.8) < 4 * np.sqrt(0.16 / total)
    assert abs(changed - 0.1 * 255 / 256) < tol and abs(kept - (0.1 + 0.1 / 256)) < tol
    randoms = got[(got != VOCAB.mask_id) & (got != ids[sel])]
    assert randoms.min() >= 3 and randoms.max() < 259
    # selection is uniform over positions: the first and second half of the candidates
    # are selected equally often
    pos = np.nonzero(sel)[1] / lengths[np.nonzero(sel)[0]]
    assert abs((pos < 0.5).mean() - 0.5) < 0.03
    # deterministic in the seed; another seed differs; a row's draws depend on its global row
    again = mask_tokens(ids, (7, 3), **MASK_ARGS)
    assert all(np.array_equal(again[k], out[k]) for k in out)
    assert not np.array_equal(mask_tokens(ids, (7, 4), **MASK_ARGS)["weights"], out["weights"])
    part = mask_tokens(ids[100:140], (7, 3), **MASK_ARGS, row_offset=100)
    assert all(np.array_equal(part[k], out[k][100:140]) for k in out)


def test_frame_places_cls_and_sep():
    content = np.array([[10, 11, 12], [10, 0, 0], [0, 0, 0]], np.int32)
    np.testing.assert_array_equal(frame(content, VOCAB), [[259, 10, 11, 12, 260],
                                                          [259, 10, 260, 0, 0],
                                                          [0, 0, 0, 0, 0]])


def test_mlm_iterator_resumes_exactly():
    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(60)]
    make = lambda: MLMIterator(  # noqa: E731
        make_lm_iterator(docs, "train", seq_len=14, batch_size=4, seed=3), VOCAB, seed=3, stream=0,
        row_offset=0, options=dict(mask_prob=0.15, mask_token_prob=0.8, random_token_prob=0.1))
    it = make()
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(4)]
    other = make()
    other.set_state(state)
    for a in expected:
        b = next(other)
        assert set(a) == {"input_ids", "attention_mask", "targets", "weights"}
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert expected[0]["input_ids"].shape == (4, 16) and (expected[0]["input_ids"][:, 0] == 259).all()
    # two processes' halves are the single-process batch
    halves = [MLMIterator(make_lm_iterator(docs, "train", seq_len=14, batch_size=4, seed=3,
                                           process_index=p, process_count=2),
                          VOCAB, seed=3, stream=0, row_offset=2 * p, options=it.options) for p in (0, 1)]
    whole = next(make())
    joined = [next(h) for h in halves]
    for k in whole:
        np.testing.assert_array_equal(np.concatenate([j[k] for j in joined]), whole[k], err_msg=k)


# ============================================================================ classification data

def test_line_roles():
    source = ('"""Module docstring.\n'
              '\n'
              'More prose."""\n'
              '# a comment\n'
              'x = """multi\n'
              'line string"""  # trailing\n'
              'def f(a):  # code first\n'
              '    "one-line docstring"\n'
              '    return a\n')
    assert line_roles(source) == [2, -1, 2, 1, 0, 2, 0, 2, 0]
    assert LINE_CLASSES == ("code", "comment", "string")


def test_encode_example_truncation():
    pair = encode_example(VOCAB, list(range(10, 30)), list(range(40, 60)), 16)
    # budget 13: b keeps its first 13 - min(20, 6) = 7; a keeps its last 6
    assert pair[0].tolist() == [259, 24, 25, 26, 27, 28, 29, 260, 40, 41, 42, 43, 44, 45, 46, 260]
    assert pair[1].tolist() == [0] * 8 + [1] * 8
    single = encode_example(VOCAB, [5, 6, 7], None, 8)
    assert single[0].tolist() == [259, 5, 6, 7, 260, 0, 0, 0] and single[1].tolist() == [0] * 8


# ============================================================================ tasks end to end

TINY = ["model=bert", "model_preset=tiny", "model.num_layers=1", "model.d_model=32",
        "model.num_heads=2", "model.max_len=64", "seq_len=32", "batch_size=8", "schedule=constant",
        "learning_rate=1e-3", "warmup_steps=1", "log_every=1", "eval_every=2", "save_every=2",
        "eval_batches=2", "sample_tokens=16"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


def cfg_for(data_dir, *extra) -> ExperimentConfig:
    return apply_overrides(ExperimentConfig(), TINY + [f"data_dir={data_dir}", *extra])


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory, data_dir):
    workdir = tmp_path_factory.mktemp("mlm")
    summary = train(cfg_for(data_dir, "task=mlm", "steps=2"), workdir, progress=False)
    return workdir, summary


def test_mlm_task_trains_and_reports(mlm_run):
    workdir, summary = mlm_run
    rows = read_metrics(workdir)
    first = next(r for r in rows if "loss" in r)
    assert abs(first["loss"] - np.log(262)) < 0.5                       # ~uniform at init
    assert 0 < summary["eval_tokens"] and 0 <= summary["eval_accuracy"] <= 1
    assert np.isfinite(summary["eval_loss"])
    run_config, model, params, task = load_run(workdir)
    assert model.config.head == "mlm" and model.config.vocab_size == 262
    assert run_config["task_spec"] == {"tokenizer": "byte"}
    assert "[MASK]" in (workdir / "samples.txt").read_text()


def test_classify_task_line_roles_data(data_dir, tmp_path):
    """The stdlib line-role data; one training step of the classify task is in the sst2 test
    (and ``experiments/bert_classify_stdlib.py`` trains on this data)."""
    task = make_task(cfg_for(data_dir, "task=classify"), tmp_path)
    assert task.classes == list(LINE_CLASSES)
    assert task.model_overrides() == {"vocab_size": 262, "head": "classification",
                                      "num_classes": 3, "pad_token_id": 0}
    enc = task.encoded("validation")
    assert enc["input_ids"].shape[1] == 32 and (enc["input_ids"][:, 0] == VOCAB.cls_id).all()
    assert set(np.unique(enc["token_type_ids"])) == {0, 1}
    counts = np.bincount(enc["labels"], minlength=3) / len(enc["labels"])
    assert counts[0] > 0.5 and counts[1] > 0.05 and counts[2] > 0.05    # code, comment, string
    batches = list(task.eval_batches(0, 1))
    assert len(batches) == -(-len(enc["labels"]) // 8)
    assert sum(b["weights"].sum() for b in batches) == len(enc["labels"])
    seen = np.concatenate([b["labels"][b["weights"] > 0] for b in batches])
    np.testing.assert_array_equal(np.sort(seen), np.sort(enc["labels"]))   # one pass, each once


def test_sst2_by_tfds_name_from_pretrained_mlm(mlm_run, tmp_path):
    mlm_dir, _ = mlm_run
    with tfds.testing.mock_data(num_examples=24):
        cfg = apply_overrides(ExperimentConfig(), TINY + [
            "task=classify", "dataset=glue/sst2", "steps=1", f"data_dir={tmp_path / 'tfds'}",
            f"task.pretrained={mlm_dir}"])
        task = make_task(cfg, tmp_path)
        assert task.classes == ["negative", "positive"]
        batch = next(task.train_iterator(0, 1))
        assert batch["input_ids"].shape == (8, 32) and batch["labels"].shape == (8,)
        assert set(np.unique(batch["labels"])) <= {0, 1} and (batch["token_type_ids"] == 0).all()
        # init_params copies the MLM encoder; the pooler (an MLM run has none) keeps its init
        _, _, pre, _ = load_run(mlm_dir)
        fresh = init(CFG.replace(head="classification", vocab_size=262, max_len=64, num_layers=1,
                                 num_heads=2))
        loaded = task.init_params(fresh)
        np.testing.assert_array_equal(loaded["bert"]["layer_0"]["mlp"]["wi"]["kernel"],
                                      pre["bert"]["layer_0"]["mlp"]["wi"]["kernel"])
        np.testing.assert_array_equal(loaded["bert"]["pooler"]["kernel"], fresh["bert"]["pooler"]["kernel"])
        with pytest.raises(ValueError, match="pretrained bert/.* has shape"):
            task.init_params(init(CFG.replace(head="classification", vocab_size=262, max_len=32,
                                              num_layers=1, num_heads=2)))
        summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["final_step"] == 1 and np.isfinite(summary["loss"])


def test_bad_task_options_raise(data_dir, tmp_path):
    with pytest.raises(ValueError, match="'mask_probability' \\(did you mean 'mask_prob'\\?\\)"):
        make_task(cfg_for(data_dir, "task=mlm", "task.mask_probability=0.2"), tmp_path)
    with pytest.raises(ValueError, match="mask_prob=1.5 must be a number in"):
        make_task(cfg_for(data_dir, "task=mlm", "task.mask_prob=1.5"), tmp_path)
    with pytest.raises(ValueError, match="random_token_prob = 1.1 exceed 1"):
        make_task(cfg_for(data_dir, "task=mlm", "task.random_token_prob=0.3"), tmp_path)
    with pytest.raises(ValueError, match="trains a BERT encoder; set model=bert"):
        make_task(cfg_for(data_dir, "task=mlm", "model=gpt"), tmp_path)
    with pytest.raises(ValueError, match=r"needs model.head in \('classification',\), got model.head='mlm'"):
        make_task(cfg_for(data_dir, "task=classify", "model.head=mlm"), tmp_path)
    with pytest.raises(ValueError, match="pretrained=.*no config.json"):
        make_task(cfg_for(data_dir, "task=classify", f"task.pretrained={tmp_path}/nope"), tmp_path)
    with pytest.raises(ValueError, match="context_lines=-1 must be an int >= 0"):
        make_task(cfg_for(data_dir, "task=classify", "task.context_lines=-1"), tmp_path)


def test_experiment_files_build(tmp_path):
    """The experiments' models are what their docstrings say (parameter counts quoted there)."""
    from transformer_jax.train.config import load_experiment
    from transformer_jax.run import build

    for name, head, count in (("bert_mlm_stdlib", "mlm", 860_550),
                              ("bert_classify_stdlib", "classification", 860_419)):
        cfg = load_experiment(name)
        model_cfg, _ = build(cfg, make_task(cfg, tmp_path / name).model_overrides())
        assert (model_cfg.head, model_cfg.num_params(), model_cfg.vocab_size) == (head, count, 262)
        doc = (Path(__file__).resolve().parents[2] / "experiments" / f"{name}.py").read_text()
        assert f"{count:,} parameters" in doc


# one path per family here (every path: test_attention.py and test_gpt.py)
@pytest.mark.parametrize("impl", ["xla"])
def test_packed_documents_equal_documents_alone(impl):
    # bidirectional attention within each document; learned positions restart at each one
    cfg = CFG.replace(head="mlm", attention_impl=impl, num_layers=1)
    model = Bert(cfg)

    def fn(params, inputs):
        ids, seg, pos, mask = inputs["tokens"]
        return model.apply({"params": params}, ids, attention_mask=mask, position_ids=pos,
                           segment_ids=seg)

    assert_packed_like_alone(fn, init(cfg), {"tokens": (5, 7)}, cfg.vocab_size)
    with pytest.raises(UserError, match=r"segment_ids must be integers of the tokens' shape \(1, 4\)"):
        model.apply({"params": init(cfg)}, jnp.ones((1, 4), jnp.int32),
                    segment_ids=jnp.ones((1, 5), jnp.int32))
