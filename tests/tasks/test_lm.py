"""The ``lm`` task: its batches (packed next-token windows of a hand-built stream; eval one
padded pass, train shuffled full windows) and its metrics (eval loss, accuracy, perplexity and
token count against a numpy bigram model). Iterator internals are in tests/data/test_data.py."""
import math

import jax
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.tasks import make_task
from transformer_jax.tasks.lm import LMTask
from transformer_jax.train.config import ExperimentConfig
from transformer_jax.train.loop import evaluate

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

# Byte ids are the UTF-8 byte + 3 (pad 0, eos 1): a=100 ... j=109. Each document is followed
# by eos and the documents are concatenated into one stream of N = 14 tokens.
DOCS = ("ab", "cde", "f", "ghij")
STREAM = [100, 101, 1, 102, 103, 104, 1, 105, 1, 106, 107, 108, 109, 1]
T, B = 3, 2
# Window k is STREAM[k T : k T + T + 1] (consecutive windows share one token); eval keeps the
# last partial window, right-padded with 0.
WINDOWS = [[100, 101, 1, 102],
           [102, 103, 104, 1],
           [1, 105, 1, 106],
           [106, 107, 108, 109],
           [109, 1, 0, 0]]


def lm_task(tmp_path, **fields) -> LMTask:
    """The task over the in-memory DOCS (``make_lm_iterator`` takes a sequence of strings)."""
    cfg = ExperimentConfig(task="lm", dataset=DOCS, seq_len=T, batch_size=B, **fields)
    return make_task(cfg, tmp_path)


def expected_eval_windows():
    """(5 windows + 1 all-padding row filling the last batch, T + 1), built from STREAM."""
    n = len(STREAM)
    rows = [STREAM[k * T: k * T + T + 1] for k in range(math.ceil((n - 1) / T))]
    rows = [r + [0] * (T + 1 - len(r)) for r in rows]
    assert rows == WINDOWS
    return np.array(rows + [[0] * (T + 1)], np.int32)


# ----------------------------------------------------------------------------- batches

def test_eval_batches_are_the_packed_stream_in_order(tmp_path):
    task = lm_task(tmp_path)
    batches = list(task.eval_batches(0, 1))
    want = expected_eval_windows()                                   # (3 B, T+1)
    assert len(batches) == 3
    for i, batch in enumerate(batches):
        w = want[i * B: (i + 1) * B]
        assert set(batch) == {"inputs", "targets", "weights"}
        assert batch["inputs"].dtype == np.int32 and batch["weights"].dtype == np.float32
        np.testing.assert_array_equal(batch["inputs"], w[:, :-1])      # (B, T)
        np.testing.assert_array_equal(batch["targets"], w[:, 1:])      # inputs shifted by one
        np.testing.assert_array_equal(batch["weights"], (w[:, 1:] != 0).astype(np.float32))
    # the last batch: one padded window, one all-padding row of weight 0
    np.testing.assert_array_equal(batches[2]["weights"], [[1, 0, 0], [0, 0, 0]])
    # every stream token after the first is a weighted target exactly once
    assert sum(b["weights"].sum() for b in batches) == len(STREAM) - 1
    # two processes' rows, stacked in process order, are the single-process batches
    halves = [list(task.eval_batches(p, 2)) for p in (0, 1)]
    for i, batch in enumerate(batches):
        for key in batch:
            np.testing.assert_array_equal(
                np.concatenate([halves[0][i][key], halves[1][i][key]]), batch[key])


def test_train_iterator_shuffles_full_windows_per_epoch(tmp_path):
    full = {tuple(w) for w in WINDOWS[:4]}          # (N - 1) // T = 4 full windows, no padding
    orders = []
    for seed in range(4):
        it = lm_task(tmp_path, seed=seed).train_iterator(0, 1)
        epoch = [next(it) for _ in range(2)]        # 4 windows // B = 2 batches per epoch
        rows = [tuple(i) + (int(t[-1]),) for b in epoch for i, t in zip(b["inputs"], b["targets"])]
        assert set(rows) == full                    # each full window exactly once per epoch
        for b in epoch:
            np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
            np.testing.assert_array_equal(b["weights"], np.ones((B, T), np.float32))
        assert it.get_state() == {"mode": "memory", "epoch": 1, "index": 0}    # endless
        orders.append(rows)
        # a fresh task with the same seed repeats the order exactly
        again = lm_task(tmp_path, seed=seed).train_iterator(0, 1)
        assert [tuple(i) + (int(t[-1]),) for b in (next(again), next(again))
                for i, t in zip(b["inputs"], b["targets"])] == rows
    assert len({tuple(o) for o in orders}) > 1      # the seed changes the order


def test_train_tokens_trains_on_the_first_tokens_and_evaluates_on_all(tmp_path):
    """task.train_tokens=7: the train stream is STREAM[:7] (2 windows of T + 1 = 4: one
    batch per epoch); the eval pass still reads every window."""
    task = lm_task(tmp_path, task_options={"train_tokens": 7})
    it = task.train_iterator(0, 1)
    batch = next(it)
    rows = {tuple(i) + (int(t[-1]),) for i, t in zip(batch["inputs"], batch["targets"])}
    assert rows == {tuple(WINDOWS[0]), tuple(WINDOWS[1])}
    assert it.get_state() == {"mode": "memory", "epoch": 1, "index": 0}
    evals = [np.concatenate([b["inputs"], b["targets"][:, -1:]], 1) for b in task.eval_batches(0, 1)]
    np.testing.assert_array_equal(np.concatenate(evals)[:5], WINDOWS)
    for bad in (1, 2.5, "7", True):
        with pytest.raises(UserError, match=f"task.train_tokens={bad!r} must be an int >= 2"):
            lm_task(tmp_path, task_options={"train_tokens": bad})


def test_task_fixes_vocab_init_args_and_spec(tmp_path):
    task = lm_task(tmp_path)
    assert task.model_overrides() == {"vocab_size": 259}          # 256 bytes + pad, eos, unk
    (ids,) = task.init_args()
    assert ids.shape == (1, T) and ids.dtype == np.int32 and not ids.any()
    assert task.spec() == {"tokenizer": "byte"}
    assert task.tokens_per_step() == B * T
    # a saved spec rebuilds the same tokenizer
    rebuilt = make_task(task.cfg, tmp_path, spec=task.spec())
    assert rebuilt.tokenizer.encode("ab") == [100, 101]


# ----------------------------------------------------------------------------- metrics

V = 259
TABLE = np.random.default_rng(0).normal(size=(V, V)).astype(np.float32)   # (V, V) bigram logits
TABLE[0] = np.nan          # the model's output after a pad input; pads are never weighted
for _a, _b in [(100, 101), (102, 103), (106, 107), (108, 109)]:
    TABLE[_a, _b] += 10.0  # 4 of the stream's 13 next tokens predicted right, the rest wrong


def bigram_apply(variables, inputs, deterministic=True, rngs=None):
    """A stand-in model: logits (B, T, V) = the table row of each input token."""
    return variables["params"]["table"][inputs]


def numpy_metrics(windows: np.ndarray) -> dict[str, float]:
    """Cross-entropy, accuracy and weight of the bigram model on windows (R, T+1), in float64."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    real = targets != 0
    logits = TABLE.astype(np.float64)[inputs[real]]                  # (tokens, V)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = lse - logits[np.arange(len(logits)), targets[real]]
    hits = logits.argmax(-1) == targets[real]
    return {"loss": nll.mean(), "accuracy": hits.mean(), "tokens": float(real.sum())}


@pytest.mark.parametrize("eval_batches", [16, 2])
def test_eval_metrics_equal_numpy_cross_entropy(tmp_path, eval_batches):
    """``evaluate`` on the task: eval_loss is the mean NLL per real target token, eval_accuracy
    the top-1 hit rate, eval_ppl exp(eval_loss); only the first ``eval_batches`` batches count,
    and padding (whose logits here are NaN) contributes exactly nothing."""
    task = lm_task(tmp_path, eval_batches=eval_batches)
    got = evaluate({"table": TABLE}, bigram_apply, task)
    want = numpy_metrics(expected_eval_windows()[: eval_batches * B])
    assert got["eval_tokens"] == want["tokens"] == (13 if eval_batches > 2 else 12)
    assert got["eval_loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert set(got) == {"eval_loss", "eval_accuracy", "eval_ppl", "eval_tokens"}
    assert want["accuracy"] == (4 / 13 if eval_batches > 2 else 4 / 12)
    assert got["eval_accuracy"] == pytest.approx(want["accuracy"], abs=1e-7)
    assert got["eval_ppl"] == pytest.approx(math.exp(want["loss"]), rel=1e-5)
    assert all(np.isfinite(v) for v in got.values())


def test_loss_fn_sums_label_smoothing_over_real_tokens(tmp_path):
    """The task's loss_fn (train step objective) with smoothing 0.1: (1 - eps) NLL + eps times
    the mean over the vocabulary of -log p, summed over real tokens; nll stays the plain sum."""
    task = lm_task(tmp_path)
    batch = next(iter(task.eval_batches(0, 1)))          # the first two windows: all real
    loss_fn = jax.jit(lambda p, b: task.loss_fn(bigram_apply, p, b, None, True, 0.1))
    loss_sum, sums = loss_fn({"table": TABLE}, batch)
    logits = TABLE.astype(np.float64)[batch["inputs"]]                                  # (B, T, V)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]           # (B, T)
    smooth = 0.9 * nll - 0.1 * logp.mean(-1)
    assert float(loss_sum) == pytest.approx(smooth.sum(), rel=1e-5)
    assert float(sums["nll"]) == pytest.approx(nll.sum(), rel=1e-5)
    assert float(sums["weight"]) == B * T


def test_generate_text_rejects_a_prompt_longer_than_the_model(tmp_path):
    class Config:
        max_len = 4

    class Model:
        config = Config()

    with pytest.raises(ValueError, match="the prompt is 4 tokens; the model's max_len is 4"):
        lm_task(tmp_path).generate_text(Model(), {}, "abcd")


def test_document_packing_feeds_segments_and_positions_to_the_model(tmp_path):
    task = lm_task(tmp_path, task_options={"packing": "document"})
    batches = list(task.eval_batches(0, 1))
    # windows [100 101 1 102] [102 103 104 1] | [1 105 1 106] [106 107 108 109] | [109 1 pad pad]
    np.testing.assert_array_equal(batches[1]["segment_ids"], [[1, 2, 2], [1, 1, 1]])
    np.testing.assert_array_equal(batches[1]["positions"], [[0, 0, 1], [0, 1, 2]])
    np.testing.assert_array_equal(batches[1]["weights"], [[0, 1, 0], [1, 1, 1]])
    # the eos inputs (3 of them in the eval pass) no longer predict the next document
    assert sum(b["weights"].sum() for b in batches) == len(STREAM) - 1 - 3
    seen = {}

    def spy_apply(variables, inputs, deterministic=True, rngs=None, **packed):
        seen.update(packed)
        return bigram_apply(variables, inputs)
    loss_sum, sums = task.loss_fn(spy_apply, {"table": TABLE}, batches[1], None, True, 0.0)
    assert sorted(seen) == ["position_ids", "segment_ids"]
    np.testing.assert_array_equal(seen["position_ids"], batches[1]["positions"])
    assert float(sums["weight"]) == 4.0
    shapes = task.batch_shapes()
    assert (shapes["segment_ids"].shape, str(shapes["positions"].dtype)) == ((B, T), "int32")
    with pytest.raises(UserError, match="task.packing='rows' is unknown; choose 'concatenate'"):
        lm_task(tmp_path, task_options={"packing": "rows"})


# ----------------------------------------------------------------------------- chunked loss

def _lm_batch(vocab: int, b: int = 2, t: int = 9) -> dict:
    ks = jax.random.split(jax.random.PRNGKey(7), 3)
    inputs = jax.random.randint(ks[0], (b, t), 0, vocab)
    targets = jax.random.randint(ks[1], (b, t), 0, vocab).at[1, -2:].set(-100)
    weights = (jax.random.uniform(ks[2], (b, t)) > 0.2).astype(np.float32)
    return {"inputs": inputs, "targets": targets, "weights": weights.at[1, -2:].set(0.0)}


@pytest.mark.parametrize("preset, change", [
    ("gpt:tiny", {}),                                            # tied wte read-out
    ("gpt:llama-tiny", {}),                                      # untied lm_head
    ("gemma:gemma3-tiny", {"final_logit_softcap": 3.0}),         # tied, tanh cap
    ("gemma:gemma3-tiny", {"tie_embeddings": False, "final_logit_softcap": 3.0}),
])
def test_lm_loss_chunked_equals_plain(preset, change):
    """``loss_chunk=5`` (rows of 9 positions: not a multiple) gives the plain loss, its sums and the
    gradient of every parameter (embedding and lm_head included) within 1e-6 relative."""
    import flax.linen as nn

    from tests.helpers import assert_chunked_loss_matches
    from transformer_jax.losses import lm_loss
    from transformer_jax.models import Gemma, GemmaConfig, GPT, GPTConfig
    family, name = preset.split(":")
    cls, config_cls = (GPT, GPTConfig) if family == "gpt" else (Gemma, GemmaConfig)
    cfg = config_cls.preset(name, num_layers=1, **change)
    model = cls(cfg)
    batch = _lm_batch(cfg.vocab_size)
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), batch["inputs"])["params"])
    loss, grads = assert_chunked_loss_matches(lm_loss, model.apply, params, batch)
    head = grads["wte"]["embedding"] if cfg.tie_embeddings else grads["lm_head"]["kernel"]
    assert loss > 0 and float(np.abs(head).max()) > 0


def test_lm_loss_chunked_refuses_a_lora_adapter_on_the_head():
    """The chunked loss reads ``lm_head``'s weights itself, so an adapter there (which its
    matmul would add) is refused in one line naming both fixes."""
    import flax.linen as nn

    from transformer_jax.losses import lm_loss
    from transformer_jax.models import GPT, GPTConfig
    cfg = GPTConfig.preset("llama-tiny", lora=dict(rank=2, targets="lm_head"))
    model = GPT(cfg)
    batch = _lm_batch(cfg.vocab_size)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), batch["inputs"])["params"])
    loss_sum, _ = lm_loss(model.apply, params, batch, None, True, 0.0)     # plain: fine
    assert np.isfinite(float(loss_sum))
    with pytest.raises(UserError, match="lm_head: loss_chunk reads the weights of this layer, "
                                        "which a LoRA adapter targets; leave it out of "
                                        "lora.targets, or set loss_chunk=0"):
        lm_loss(model.apply, params, batch, None, True, 0.0, loss_chunk=4)


def test_flops_per_step_counts_a_frozen_base_at_4_and_what_trains_at_6(tmp_path):
    """MFU's model FLOPs of a LoRA run, by hand for a 1-layer GPT-2 (D 16, MLP 64, tied
    embedding of V = 259 byte ids, 2 heads) with rank-2 adapters on the query and value
    projections: the N = 7,456 base weights (per layer 4 D^2 + 2 D F attention and MLP
    weights, 3 D + D + F + D biases, two layer norms; the final norm; the V D read-out)
    cost 4 a token over the frozen base (forward and input gradient) where full training
    costs 6; the A = 2 x 2 (16 + 16) = 128 adapter weights cost 6; attention 12 L D T."""
    import flax.linen as nn

    from transformer_jax.models.gpt import GPT, GPTConfig
    from transformer_jax.train import finetune

    task = lm_task(tmp_path)
    d, f, v, tokens = 16, 64, 259, B * T
    n = 4 * d * d + 2 * d * f + 5 * d + f + 4 * d + 2 * d + v * d
    cfg = GPTConfig(vocab_size=v, max_len=8, num_layers=1, num_heads=2, d_model=d, mlp_dim=f,
                    lora=dict(rank=2, targets="attn/(query|value)"))
    assert n == 7_456 and cfg.num_params(non_embedding=True) + v * d == n
    shapes = nn.meta.unbox(jax.eval_shape(lambda: GPT(cfg).init(
        jax.random.PRNGKey(0), np.zeros((1, T), np.int32))))["params"]
    adapted = finetune.trainable_counts(finetune.make_split(cfg, None, "gpt"), shapes)
    assert adapted == (0, 2 * 2 * (16 + 16))
    attention = 12 * 1 * d * T
    assert task.flops_per_step(cfg) == (6 * n + attention) * tokens
    assert task.flops_per_step(cfg, adapted) == (4 * n + 6 * 128 + attention) * tokens
    assert task.flops_per_step(cfg, (10, 128)) == (4 * n + 2 * 10 + 6 * 128 + attention) * tokens
