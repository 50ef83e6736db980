"""The ``mlm`` task: its batches ([CLS] window [SEP] rows, seeded masks, the options' rates on a
large sample) and its metrics (cross-entropy and accuracy over masked positions only, the eval
sample). mask_tokens' own goldens and end-to-end training are in tests/models/test_bert.py."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data import ByteTokenizer
from transformer_jax.tasks import make_task
from transformer_jax.tasks.mlm import MLMTask, MLMVocab, mask_tokens, mlm_loss
from transformer_jax.train.config import ExperimentConfig
from transformer_jax.train.loop import evaluate

VOCAB = MLMVocab(ByteTokenizer())
CLS, SEP, MASK, V = 259, 260, 261, 262

# Byte ids are the UTF-8 byte + 3 (pad 0, eos 1): a=100 ... j=109. The stream is the
# documents, each followed by eos; with seq_len 6 each row holds 6 - 2 = 4 consecutive stream
# tokens framed as [CLS] tokens [SEP]; eval keeps the short last window, right-padded.
DOCS = ("ab", "cde", "f", "ghij")
STREAM = [100, 101, 1, 102, 103, 104, 1, 105, 1, 106, 107, 108, 109, 1]
FRAMED = np.array([[CLS, 100, 101, 1, 102, SEP],
                   [CLS, 103, 104, 1, 105, SEP],
                   [CLS, 1, 106, 107, 108, SEP],
                   [CLS, 109, 1, SEP, 0, 0]], np.int32)       # (4 rows, T = 6)
MASK_ARGS = dict(mask_id=MASK, random_range=(3, 259), special_ids=(0, 1, CLS, SEP, MASK))


def mlm_task(tmp_path, docs=DOCS, **fields) -> MLMTask:
    """The task over in-memory documents (``make_lm_iterator`` takes a sequence of strings)."""
    fields = {"seq_len": 6, "batch_size": 2, **fields}
    cfg = ExperimentConfig(task="mlm", model="bert", dataset=docs, **fields)
    return make_task(cfg, tmp_path)


def original_ids(batch) -> np.ndarray:
    """The uncorrupted (B, T) ids: targets where a position was selected, inputs elsewhere."""
    return np.where(batch["weights"] > 0, batch["targets"], batch["input_ids"])


# ----------------------------------------------------------------------------- vocabulary

def test_vocab_layout_render_and_task_overrides(tmp_path):
    assert (VOCAB.cls_id, VOCAB.sep_id, VOCAB.mask_id, VOCAB.vocab_size) == (CLS, SEP, MASK, V)
    assert VOCAB.pad_id == 0 and VOCAB.special_ids == (0, 1, CLS, SEP, MASK)
    assert VOCAB.random_range == (3, 259)                         # every byte, no special
    # specials written out, pad dropped, eos dropped by the byte tokenizer's decode
    assert VOCAB.render([CLS, 100, 101, MASK, 1, 102, SEP, 0, 0]) == "[CLS]ab[MASK]c[SEP]"
    task = mlm_task(tmp_path)
    assert task.model_overrides() == {"vocab_size": V, "head": "mlm", "pad_token_id": 0}
    assert task.spec() == {"tokenizer": "byte"}
    (ids,) = task.init_args()
    assert ids.shape == (1, 6) and not ids.any()


# ----------------------------------------------------------------------------- batches

def test_eval_batches_frame_the_stream_and_mask_one_token_per_row(tmp_path):
    task = mlm_task(tmp_path, seed=5)
    batches = list(task.eval_batches(0, 1))
    assert len(batches) == 2
    got = np.concatenate([original_ids(b) for b in batches])
    np.testing.assert_array_equal(got, FRAMED)
    for i, batch in enumerate(batches):
        rows = FRAMED[2 * i: 2 * i + 2]
        assert set(batch) == {"input_ids", "attention_mask", "targets", "weights"}
        np.testing.assert_array_equal(batch["attention_mask"], (rows != 0).astype(np.int32))
        sel = batch["weights"] > 0
        # specials (pad, eos, [CLS], [SEP]) are never selected; each row has 3, 3, 3 and 1
        # ordinary tokens, and round(0.15 n) = 0 is raised to the minimum of one
        assert not (sel & np.isin(rows, MASK_ARGS["special_ids"])).any()
        assert sel.sum(axis=1).tolist() == [1, 1]
        np.testing.assert_array_equal(batch["targets"], np.where(sel, rows, 0))
        np.testing.assert_array_equal(batch["input_ids"][~sel], rows[~sel])
        # the draws are the documented pure function of (seed, stream 1 = eval, batch number)
        want = mask_tokens(rows, (5, 1, i), **MASK_ARGS)
        for key in want:
            np.testing.assert_array_equal(batch[key], want[key], err_msg=key)


def test_train_batches_use_their_own_stream_and_repeat_exactly(tmp_path):
    task = mlm_task(tmp_path, seed=5)
    it = task.train_iterator(0, 1)
    batches = [next(it) for _ in range(3)]           # 13 // 4 = 3 full windows: 1 batch an epoch
    for i, batch in enumerate(batches):
        rows = original_ids(batch)
        # every row is a framed full window (the padded fourth never appears in training)
        assert all(any(np.array_equal(r, f) for f in FRAMED[:3]) for r in rows)
        want = mask_tokens(rows, (5, 0, i), **MASK_ARGS)      # stream 0 = train
        for key in want:
            np.testing.assert_array_equal(batch[key], want[key], err_msg=key)
    assert it.get_state() == {"windows": {"mode": "memory", "epoch": 3, "index": 0}, "count": 3}
    again = mlm_task(tmp_path, seed=5).train_iterator(0, 1)
    for batch in batches:
        other = next(again)
        assert all(np.array_equal(batch[k], other[k]) for k in batch)


LETTERS = np.random.default_rng(1)
BIG_DOCS = tuple("".join(chr(97 + c) for c in LETTERS.integers(0, 26, n))
                 for n in LETTERS.integers(20, 80, 250))       # ~12,500 bytes in 250 documents
RATES = {"mask_prob": 0.25, "mask_token_prob": 0.6, "random_token_prob": 0.3}


def eval_pass(task) -> dict[str, np.ndarray]:
    batches = list(task.eval_batches(0, 1))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_task_options_set_the_masking_rates_on_a_large_sample(tmp_path):
    """mask_prob 0.25 with a 60/30/10 split: each row selects exactly round(0.25 n) (at least
    one) of its n ordinary tokens; of ~3,100 selections 60% become [MASK], 30% a random byte (equal to the
    original 1 time in 256) and the rest stay; within 4 binomial standard deviations."""
    task = mlm_task(tmp_path, docs=BIG_DOCS, seq_len=66, batch_size=8, task_options=RATES)
    out = eval_pass(task)
    ids = original_ids(out)                                   # (B = all rows, T = 66)
    sel = out["weights"] > 0
    n = (~np.isin(ids, MASK_ARGS["special_ids"])).sum(axis=1)
    assert n.sum() == sum(len(d) for d in BIG_DOCS)               # every byte is in one row
    # (all-padding rows that fill the last batch have n = 0 and select nothing)
    np.testing.assert_array_equal(sel.sum(axis=1), np.maximum(np.floor(0.25 * n + 0.5), n > 0))
    got, orig = out["input_ids"][sel], ids[sel]
    total = sel.sum()
    assert total > 3000
    for name, frac, p in (("mask", (got == MASK).mean(), 0.6),
                          ("random", ((got != MASK) & (got != orig)).mean(), 0.3 * 255 / 256),
                          ("kept", (got == orig).mean(), 0.1 + 0.3 / 256)):
        assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / total), (name, frac, p)
    randoms = got[(got != MASK) & (got != orig)]
    assert randoms.min() >= 3 and randoms.max() < 259               # bytes, never a special
    # exactly reproducible for a fixed seed; another seed draws other masks
    again = eval_pass(mlm_task(tmp_path, docs=BIG_DOCS, seq_len=66, batch_size=8, task_options=RATES))
    assert all(np.array_equal(out[k], again[k]) for k in out)
    other = eval_pass(mlm_task(tmp_path, docs=BIG_DOCS, seq_len=66, batch_size=8, seed=1,
                               task_options=RATES))
    np.testing.assert_array_equal(original_ids(other), ids)
    assert not np.array_equal(other["weights"], out["weights"])


def test_default_rate_is_fifteen_percent(tmp_path):
    out = eval_pass(mlm_task(tmp_path, docs=BIG_DOCS, seq_len=66, batch_size=8))
    ids = original_ids(out)
    n = (~np.isin(ids, MASK_ARGS["special_ids"])).sum(axis=1)
    sel = (out["weights"] > 0).sum(axis=1)
    np.testing.assert_array_equal(sel, np.maximum(np.floor(0.15 * n + 0.5), n > 0))
    # ~15% overall: rounding moves each row (all have n >= 7) by at most half a token
    rows = (n > 0).sum()
    assert n[n > 0].min() >= 7 and abs(sel.sum() - 0.15 * n.sum()) <= 0.5 * rows
    assert abs(sel.sum() / n.sum() - 0.15) < 0.01


# ----------------------------------------------------------------------------- metrics

TABLE = np.random.default_rng(0).normal(size=(V, V)).astype(np.float32)   # (V, V) logits per input id
TABLE[np.arange(V), np.arange(V)] += 10.0   # predicts its input: right where the token was kept


def numpy_mlm(batches, logits_of=lambda b: TABLE[b["input_ids"]]) -> dict[str, float]:
    """Cross-entropy and accuracy of ``logits_of(batch)`` (B, T, V) at the selected positions
    (float64)."""
    nll, hits = [], []
    for b in batches:
        sel = b["weights"] > 0
        logits = np.asarray(logits_of(b), np.float64)[sel]                    # (masked, V)
        lse = np.log(np.exp(logits).sum(-1))
        nll += list(lse - logits[np.arange(len(logits)), b["targets"][sel]])
        hits += list(logits.argmax(-1) == b["targets"][sel])
    return {"loss": float(np.mean(nll)), "accuracy": float(np.mean(hits)), "tokens": len(nll)}


def test_mlm_loss_counts_masked_positions_only(tmp_path):
    """Unselected positions weigh nothing, even where the model's logits are NaN; the model
    sees the corrupted ids, no token types and the batch's attention mask; a bare array and
    the ``{"mlm_logits": ...}`` dict of the pretraining head give the same sums."""
    batch = next(iter(mlm_task(tmp_path, seed=5).eval_batches(0, 1)))
    logits = TABLE[batch["input_ids"]]                                       # (B, T, V)
    first = tuple(np.argwhere(batch["weights"] > 0)[0])                      # a masked position
    logits[first + (batch["targets"][first],)] += 20.0                       # predicted right
    logits[batch["weights"] == 0] = np.nan
    seen = []

    def apply(variables, ids, token_types, mask, deterministic, rngs):
        assert token_types is None
        jax.debug.callback(lambda *args: seen.append(args), ids, mask)    # the values, from jit
        return variables["params"]["out"]

    def jitted(apply_fn):
        return jax.jit(lambda p, b: mlm_loss(apply_fn, p, b, None, True, 0.0))

    loss_sum, sums = jitted(apply)({"out": logits}, batch)
    want = numpy_mlm([batch], lambda b: logits)
    assert float(sums["weight"]) == want["tokens"] == 2
    assert float(loss_sum) == pytest.approx(want["loss"] * 2, rel=1e-5)
    assert want["accuracy"] >= 0.5 and float(sums["correct"]) == want["accuracy"] * 2
    jax.effects_barrier()                 # the debug callbacks have run
    ids, mask = seen[0]
    np.testing.assert_array_equal(ids, batch["input_ids"])
    np.testing.assert_array_equal(mask, batch["attention_mask"])
    as_dict = lambda variables, *a, **k: {"mlm_logits": variables["params"]["out"],  # noqa: E731
                                          "nsp_logits": jnp.zeros((2, 2))}
    loss2, sums2 = jitted(as_dict)({"out": logits}, batch)
    assert float(loss2) == float(loss_sum) and float(sums2["correct"]) == float(sums["correct"])


def test_eval_metrics_are_per_masked_token(tmp_path):
    task = mlm_task(tmp_path, docs=BIG_DOCS, seq_len=66, batch_size=8, eval_batches=3)

    def apply(variables, ids, token_types, mask, deterministic=True, rngs=None):
        return {"mlm_logits": variables["params"]["table"][ids]}

    got = evaluate({"table": TABLE}, apply, task)
    want = numpy_mlm(list(task.eval_batches(0, 1))[:3])
    assert 0.0 < want["accuracy"] < 0.3          # the kept tokens (~10%) and no others
    assert got["eval_tokens"] == want["tokens"]
    assert got["eval_loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["eval_accuracy"] == pytest.approx(want["accuracy"], abs=1e-7)
    assert got["eval_ppl"] == pytest.approx(math.exp(want["loss"]), rel=1e-5)


def test_sample_shows_original_masked_and_filled_rows(tmp_path):
    """The eval sample: the first eval row, its masked form and the model's argmax at the
    selected positions (a stand-in model that always answers the byte "x")."""
    task = mlm_task(tmp_path, seed=5, sample_tokens=4)

    class AlwaysX:
        def apply(self, variables, ids, token_types, mask):
            return {"mlm_logits": jnp.zeros(ids.shape + (V,)).at[..., ord("x") + 3].set(1.0)}

    text = task.sample(AlwaysX(), {}, step=0)
    batch = next(iter(task.eval_batches(0, 1)))
    row = batch["input_ids"][0]                       # sample_tokens + 2 = all 6 ids of row 0
    pos = int(np.nonzero(batch["weights"][0])[0][0])
    assert pos in (1, 2, 4)                           # one of "a", "b", "c"
    masked = VOCAB.render(row)
    filled = list("abc")
    filled[[1, 2, 4].index(pos)] = "x"
    assert text.splitlines() == ["original: '[CLS]abc[SEP]'", f"masked:   {masked!r}",
                                 f"filled:   '[CLS]{''.join(filled)}[SEP]'"]
    assert mlm_task(tmp_path, sample_tokens=0).sample(AlwaysX(), {}, step=0) is None


def test_mlm_loss_passes_packed_documents_to_the_model():
    seen = {}

    def spy_apply(variables, input_ids, token_type_ids, attention_mask, deterministic=True,
                  rngs=None, **packed):
        seen.update(packed)
        return jnp.zeros(input_ids.shape + (4,), jnp.float32)       # uniform over 4 ids

    ids = np.array([[1, 1, 1, 2, 2]], np.int32)
    batch = {"input_ids": ids, "attention_mask": np.ones((1, 5), np.int32), "targets": ids,
             "weights": np.array([[1, 0, 0, 1, 0]], np.float32), "segment_ids": ids,
             "positions": np.array([[0, 1, 2, 0, 1]], np.int32)}
    loss, sums = mlm_loss(spy_apply, {}, batch, None, True, 0.0)
    assert sorted(seen) == ["position_ids", "segment_ids"]
    np.testing.assert_array_equal(seen["position_ids"], [[0, 1, 2, 0, 1]])
    assert float(loss) == pytest.approx(2 * math.log(4), rel=1e-6)


def test_mlm_loss_chunked_equals_plain():
    """BERT's MLM head with ``loss_chunk=5``: the transform and its norm run on the hidden
    states, then the tied decoder and its bias in chunks; the loss, its sums and every
    gradient (word embeddings, the head's bias) equal the plain loss's within 1e-6."""
    import flax.linen as nn

    from tests.helpers import assert_chunked_loss_matches
    from transformer_jax.models import Bert, BertConfig
    cfg = BertConfig.preset("tiny", head="mlm", num_layers=1, d_model=32, num_heads=2)
    model = Bert(cfg)
    ks = jax.random.split(jax.random.PRNGKey(4), 3)
    ids = jax.random.randint(ks[0], (2, 11), 0, cfg.vocab_size)
    weights = (jax.random.uniform(ks[1], (2, 11)) > 0.5).astype(np.float32)
    targets = jnp.where(weights > 0, jax.random.randint(ks[2], (2, 11), 0, cfg.vocab_size), -100)
    batch = {"input_ids": ids, "attention_mask": jnp.ones((2, 11), jnp.int32).at[1, 9:].set(0),
             "targets": targets, "weights": weights}
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), ids)["params"])
    _, grads = assert_chunked_loss_matches(mlm_loss, model.apply, params, batch)
    assert float(jnp.abs(grads["mlm"]["bias"]).max()) > 0
