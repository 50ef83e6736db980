"""The ``pretrain`` task (BERT MLM + NSP): line chunks, the pair layout, the IsNext/NotNext
draws, exact resume and process sharding, the objective against HF ``BertForPreTraining``,
and the metrics' two weights (pairs, masked tokens) in the train step's and the eval
loop's normalisation. The CLI runs are in tests/train/test_pretrain_cli.py."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import losses
from transformer_jax.data import ByteTokenizer
from transformer_jax.tasks import make_task
from transformer_jax.tasks.pretrain import PretrainTask, line_chunks, pretraining_loss
from transformer_jax.train.config import ExperimentConfig
from transformer_jax.train.loop import evaluate

BYTES = ByteTokenizer()
CLS, SEP, MASK = 259, 260, 261

# seq_len 13: budget 13 - 3 = 10 tokens, chunks of at most 5. Lines of 3 bytes ("ab\n") are
# one chunk each (3 + 3 > 5): doc 0 has chunks ab, cd, ef (examples: ab->cd, cd->ef), doc 1
# gh, ij (example: gh->ij).
DOCS = ("ab\ncd\nef\n", "gh\nij\n")


def task(docs=DOCS, **fields) -> PretrainTask:
    fields = {"seq_len": 13, "batch_size": 3, **fields}
    return make_task(ExperimentConfig(task="pretrain", model="bert", dataset=docs, **fields), "/tmp")


def original_ids(batch) -> np.ndarray:
    """The uncorrupted (B, T) ids: targets where a position was masked, inputs elsewhere."""
    return np.where(batch["weights"] > 0, batch["targets"], batch["input_ids"])


def text(ids) -> str:
    return BYTES.decode([i for i in ids if i < 259])


def pair_texts(batch):
    """(A text, B text, label) per valid row, from the uncorrupted ids; checks each row's
    layout on the way: [CLS] A [SEP] (type 0) B [SEP] (type 1), then padding (type 0)."""
    ids = original_ids(batch)
    out = []
    for r in range(len(ids)):
        if batch["nsp_labels"][r] < 0:
            continue
        seps = np.nonzero(ids[r] == SEP)[0]
        assert ids[r, 0] == CLS and len(seps) == 2 and not ids[r, seps[1] + 1:].any()
        t = ids.shape[1]
        assert batch["token_type_ids"][r].tolist() == (
            [0] * (seps[0] + 1) + [1] * (seps[1] - seps[0]) + [0] * (t - seps[1] - 1))
        out.append((text(ids[r, 1:seps[0]]), text(ids[r, seps[0] + 1: seps[1]]),
                    int(batch["nsp_labels"][r])))
    return out


def many_docs(n_docs=40, lines=30):
    """Documents of numbered lines, each line naming its document: "d07 l12 .....\n"."""
    return tuple("".join(f"d{d:02d} l{i:02d} {'.' * ((d * 7 + i * 3) % 11)}\n" for i in range(lines))
                 for d in range(n_docs))


# ----------------------------------------------------------------------------- chunks

def test_lines_pack_greedily_into_chunks_of_at_most_half_the_budget():
    got = [BYTES.decode(c) for c in line_chunks("a\nbb\nccc\nlong line!\nd", BYTES, 5)]
    # "a\n" + "bb\n" = 5 fits; "ccc\n" would make 9; the 11-byte line stands alone; the last
    # line has no line end
    assert got == ["a\nbb\n", "ccc\n", "long line!\n", "d"]
    assert line_chunks("", BYTES, 5) == []


# ----------------------------------------------------------------------------- layout

def test_pair_layout_token_types_and_seps():
    t = task(seed=3)
    assert t.model_overrides() == {"vocab_size": 262, "head": "pretraining", "pad_token_id": 0}
    corpus = t.corpus("validation")
    assert len(corpus) == 3 and corpus.examples.tolist() == [0, 1, 3]
    (batch,) = list(t.eval_batches(0, 1))
    assert set(batch) == set(PretrainTask.BATCH)
    ids = original_ids(batch)
    for r in range(3):
        a, b = ids[r, 1:4], ids[r, 5:8]                       # 3 bytes each
        assert ids[r, 0] == CLS and ids[r, 4] == SEP and ids[r, 8] == SEP
        assert (ids[r, 9:] == 0).all()
        assert batch["token_type_ids"][r].tolist() == [0] * 5 + [1] * 4 + [0] * 4
        assert batch["attention_mask"][r].tolist() == [1] * 9 + [0] * 4
        assert text(a).endswith("\n") and text(b).endswith("\n")
    # specials and padding are never masked; 15% of 6 bytes rounds to 1 per row
    assert batch["weights"].sum(axis=1).tolist() == [1, 1, 1]
    assert not (batch["weights"] * np.isin(ids, (0, CLS, SEP))).any()
    pairs = pair_texts(batch)
    nexts = {"ab\n": "cd\n", "cd\n": "ef\n", "gh\n": "ij\n"}
    for a, b, label in pairs:
        if label == 0:
            assert b == nexts[a]
        else:      # a next chunk of the other document
            assert b in ({"ij\n"} if a in ("ab\n", "cd\n") else {"cd\n", "ef\n"})


def test_long_pairs_are_cut_keeping_the_text_at_the_boundary():
    # seq_len 13 (chunks <= 5): a 9-byte line is a chunk alone; A keeps its end, B its start
    t = task(("x\n12345678\nabcdefgh\n", "p\nq\nr\n"), seq_len=13, batch_size=4,
             task_options={"next_prob": 1.0})
    pairs = pair_texts(next(iter(t.eval_batches(0, 1))))
    assert {a: b for a, b, label in pairs} == {     # 2 + 8 and 5 + 5: the budget of 10
        "x\n": "12345678", "5678\n": "abcde", "p\nq\n": "r\n"}


# ----------------------------------------------------------------------------- draws

def test_half_the_pairs_are_is_next_and_those_are_consecutive_text():
    docs = many_docs()
    t = task(docs, seq_len=43, batch_size=64)     # chunks <= 20 bytes: no pair is cut
    it = t.train_iterator(0, 1)
    labels, checked = [], 0
    for _ in range(50):                                       # 3,200 rows
        batch = next(it)
        labels.append(batch["nsp_labels"])
        for a, b, label in pair_texts(batch):
            doc_a = int(a[1:3])
            if label == 0:            # B is the text right after A, in A's document
                assert a + b in docs[doc_a]
                checked += 1
            else:                     # B comes from another document, and is not its start
                assert int(b[1:3]) != doc_a and not docs[int(b[1:3])].startswith(b)
    labels = np.concatenate(labels)
    assert set(labels.tolist()) == {0, 1} and checked > 1000
    # a fair coin over 3,200 rows: the rate is within 0.03 (3.4 standard deviations) of 1/2
    assert abs(labels.mean() - 0.5) < 0.03
    assert labels.sum() == 1615                                # the seeded draws, pinned


def test_next_prob_option_sets_the_rate():
    t = task(many_docs(), seq_len=24, batch_size=64, task_options={"next_prob": 0.8})
    it = t.train_iterator(0, 1)
    labels = np.concatenate([next(it)["nsp_labels"] for _ in range(20)])
    assert abs((labels == 0).mean() - 0.8) < 0.04              # 1,280 rows: sd 0.011


# ----------------------------------------------------------------------------- state

def test_resume_gives_the_same_batches_across_an_epoch_boundary():
    t = task(many_docs(6, 10), seq_len=24, batch_size=8)
    it = t.train_iterator(0, 1)
    per_epoch = it.batches_per_epoch
    for _ in range(per_epoch - 1):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(3)]                       # crosses into epoch 1
    resumed = t.train_iterator(0, 1)
    resumed.set_state(state)
    for w, g in zip(want, [next(resumed) for _ in range(3)]):
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)
    assert state == {"epoch": 0, "index": per_epoch - 1}


@pytest.mark.parametrize("train", [True, False])
def test_two_processes_rows_are_one_processs_rows(train):
    t = task(many_docs(8, 12), seq_len=24, batch_size=8)
    split = "train" if train else "validation"
    one = t.make_iterator(split, 0, 1, train=train)
    two = [t.make_iterator(split, p, 2, train=train) for p in (0, 1)]
    for _ in range(4):
        whole = next(one)
        halves = [next(i) for i in two]
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key],
                                          err_msg=key)


def test_the_last_eval_batch_is_filled_with_empty_rows():
    t = task(batch_size=2)
    batches = list(t.eval_batches(0, 1))
    assert len(batches) == 2
    last = batches[1]
    assert last["nsp_labels"][1] == -100
    assert not last["input_ids"][1].any() and not last["weights"][1].any()


# ----------------------------------------------------------------------------- objective

def test_objective_equals_hf_bert_for_pretraining_loss():
    """Same weights (interop.from_hf), same batch, fp32: HF's loss within 1e-5, on a full
    batch and on an eval batch with an empty row (HF ignores the -100 labels); two equal
    micro-batches' sums give the mean of their two HF losses (gradient accumulation)."""
    torch = pytest.importorskip("torch")
    from tests.interop.conftest import bert_model
    from transformer_jax.interop import from_hf

    hf = bert_model("pretraining", vocab_size=262, max_position_embeddings=32, type_vocab_size=2)
    module, params = from_hf(hf)
    t = task(many_docs(5, 12), seq_len=32, batch_size=4)
    train = next(t.train_iterator(0, 1))
    evals = list(t.eval_batches(0, 1))
    assert (evals[-1]["nsp_labels"] == -100).any() and (evals[-1]["nsp_labels"] >= 0).any()

    def hf_loss(batch):
        long = lambda k: torch.as_tensor(np.asarray(batch[k]), dtype=torch.long)  # noqa: E731
        labels = np.where(batch["weights"] > 0, batch["targets"], -100)
        with torch.no_grad():
            return float(hf(input_ids=long("input_ids"), attention_mask=long("attention_mask"),
                            token_type_ids=long("token_type_ids"),
                            labels=torch.as_tensor(labels, dtype=torch.long),
                            next_sentence_label=long("nsp_labels")).loss)

    def ours(batch):
        loss_sum, sums = pretraining_loss(module.apply, params, jax.tree_util.tree_map(
            jnp.asarray, batch), None, True, 0.0)
        return loss_sum, sums

    for batch in (train, evals[-1]):
        loss_sum, sums = ours(batch)
        assert float(loss_sum / sums["weight"]) == pytest.approx(hf_loss(batch), abs=1e-5)
        assert float(sums["nll"]) == pytest.approx(float(loss_sum), abs=1e-5)
    halves = [{k: v[i * 2:(i + 1) * 2] for k, v in train.items()} for i in (0, 1)]
    parts = [ours(h) for h in halves]
    mean = sum(float(p[0]) for p in parts) / sum(float(p[1]["weight"]) for p in parts)
    assert mean == pytest.approx((hf_loss(halves[0]) + hf_loss(halves[1])) / 2, abs=1e-5)


# ----------------------------------------------------------------------------- metrics

def test_metric_names_divide_each_group_by_its_weight():
    names = losses.metric_names(["weight", "nll", "correct", "mlm_weight", "mlm_loss",
                                 "mlm_correct", "nsp_weight", "nsp_correct", "other_x"])
    assert names == {"nll": ("nll", "weight"), "correct": ("accuracy", "weight"),
                     "mlm_loss": ("mlm_loss", "mlm_weight"),
                     "mlm_correct": ("mlm_accuracy", "mlm_weight"),
                     "nsp_correct": ("nsp_accuracy", "nsp_weight"),
                     "other_x": ("other_x", "weight")}


def fake_apply(variables, ids, types, mask, deterministic=True, rngs=None):
    """Logits that guess the visible token at every position and always IsNext (except
    where the first token after [CLS] is odd: NotNext)."""
    mlm = jax.nn.one_hot(ids, 262) * 5.0
    odd = (ids[:, 1] % 2).astype(jnp.float32)
    nsp = jnp.stack([1.0 - odd, odd], axis=-1) * 3.0
    return {"mlm_logits": mlm, "nsp_logits": nsp}


def test_nsp_and_mlm_accuracy_are_per_pair_and_per_masked_token():
    """A hand-made batch of 4 rows, one of them empty: nsp_accuracy = correct / 3 pairs,
    mlm_accuracy = correct / masked tokens; the loss is per pair."""
    ids = np.array([[CLS, 100, SEP, 7, SEP], [CLS, 101, SEP, 8, SEP], [CLS, 102, SEP, 9, SEP],
                    [0, 0, 0, 0, 0]], np.int32)
    batch = {"input_ids": ids, "token_type_ids": np.zeros_like(ids),
             "attention_mask": (ids > 0).astype(np.int32),
             # masked: row 0 pos 1 (target = visible id: a hit), row 1 pos 1 and 3 (misses)
             "targets": np.array([[0, 100, 0, 0, 0], [0, 5, 0, 6, 0], [0] * 5, [0] * 5], np.int32),
             "weights": np.array([[0, 1, 0, 0, 0], [0, 1, 0, 1, 0], [0] * 5, [0] * 5], np.float32),
             # guesses: IsNext, NotNext (101 odd), IsNext -> hits on rows 0 and 1
             "nsp_labels": np.array([0, 1, 1, -100], np.int32)}
    loss_sum, sums = pretraining_loss(fake_apply, None, batch, None, True, 0.0)
    assert float(sums["weight"]) == 3 and float(sums["mlm_weight"]) == 3
    m = {k: float(v) for k, v in losses.per_weight_means(loss_sum, sums).items()}
    assert m["nsp_accuracy"] == pytest.approx(2 / 3) and m["mlm_accuracy"] == pytest.approx(1 / 3)
    # cross-entropies of logits 5 on one class of 262, and 3 on one class of 2
    hit, miss = np.log(261 + np.exp(5)) - 5, np.log(261 + np.exp(5))
    nsp_hit, nsp_miss = np.log(1 + np.exp(3)) - 3, np.log(1 + np.exp(3))
    assert m["mlm_loss"] == pytest.approx((hit + 2 * miss) / 3, rel=1e-5)
    assert m["nsp_loss"] == pytest.approx((2 * nsp_hit + nsp_miss) / 3, rel=1e-5)
    assert m["loss"] == pytest.approx(m["mlm_loss"] + m["nsp_loss"], rel=1e-5)
    assert set(m) == {"loss", "nll", "mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy"}


def test_eval_metrics_add_up_over_batches_before_dividing():
    t = task(many_docs(6, 12), seq_len=24, batch_size=8, eval_batches=3)
    batches = list(t.eval_batches(0, 1))[:3]
    got = evaluate(None, fake_apply, t)
    labels = np.concatenate([b["nsp_labels"] for b in batches])
    first = np.concatenate([b["input_ids"][:, 1] for b in batches])
    pairs = labels >= 0
    assert got["eval_tokens"] == pairs.sum()
    assert got["eval_nsp_accuracy"] == pytest.approx((labels == first % 2)[pairs].mean())
    weights = np.concatenate([b["weights"].ravel() for b in batches])
    hits = np.concatenate([(b["targets"] == b["input_ids"]).ravel() for b in batches])
    assert got["eval_mlm_accuracy"] == pytest.approx(hits[weights > 0].mean())
    assert set(got) == {"eval_loss", "eval_mlm_loss", "eval_mlm_accuracy", "eval_mlm_ppl",
                        "eval_nsp_loss", "eval_nsp_accuracy", "eval_tokens"}
    # the one perplexity is the MLM's, exp(cross-entropy per masked token) by hand (a hit
    # costs log(261 + e^5) - 5, a miss log(261 + e^5)); eval_loss (MLM + NSP) has none
    hit = hits[weights > 0]
    want_mlm = (np.log(261 + np.exp(5)) - 5 * hit).mean()
    assert got["eval_mlm_loss"] == pytest.approx(want_mlm, rel=1e-5)
    assert got["eval_mlm_ppl"] == pytest.approx(math.exp(want_mlm), rel=1e-5)


def test_the_experiment_builds_the_model_its_docstring_describes(tmp_path):
    from pathlib import Path

    from transformer_jax.train.config import load_experiment
    from transformer_jax.run import build

    cfg = load_experiment("bert_pretrain_stdlib")
    model_cfg, _ = build(cfg, make_task(cfg, tmp_path).model_overrides())
    assert (model_cfg.head, model_cfg.num_params(), model_cfg.vocab_size) == ("pretraining", 480_776, 262)
    doc = (Path(__file__).resolve().parents[2] / "experiments" / "bert_pretrain_stdlib.py").read_text()
    assert "480,776 parameters" in doc


def test_pretraining_loss_chunked_equals_plain():
    """BERT pretraining with ``loss_chunk=4``: the MLM read-out in chunks, NSP as before; the
    objective, its sums and every gradient equal the plain loss's within 1e-6."""
    import flax.linen as nn

    from tests.helpers import assert_chunked_loss_matches
    from transformer_jax.models import Bert, BertConfig
    cfg = BertConfig.preset("tiny", num_layers=1, d_model=32, num_heads=2)
    model = Bert(cfg)
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    ids = jax.random.randint(ks[0], (3, 10), 0, cfg.vocab_size)
    weights = (jax.random.uniform(ks[1], (3, 10)) > 0.6).astype(np.float32)
    targets = jnp.where(weights > 0, jax.random.randint(ks[2], (3, 10), 0, cfg.vocab_size), -100)
    batch = {"input_ids": ids, "token_type_ids": jnp.zeros((3, 10), jnp.int32).at[:, 5:].set(1),
             "attention_mask": jnp.ones((3, 10), jnp.int32), "targets": targets,
             "weights": weights, "nsp_labels": jnp.array([0, 1, -100])}
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), ids)["params"])
    assert_chunked_loss_matches(pretraining_loss, model.apply, params, batch, chunk=4)
