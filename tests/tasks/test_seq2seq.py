"""The ``seq2seq`` task: its batches (held-out, length-filtered pairs; teacher forcing shift and
padding by hand) and its metrics (teacher-forced loss/accuracy, exact match and BLEU of decoded
rows, the prompt ``generate`` decodes). Search and training are in tests/test_beam_search.py."""
import math

import jax
import numpy as np
import pytest
import sacrebleu

from transformer_jax.tasks import make_task
from transformer_jax.tasks.seq2seq import Seq2SeqTask, cut_at_eos, seq2seq_loss
from transformer_jax.train.config import ExperimentConfig
from transformer_jax.train.loop import evaluate

S, T, B = 8, 6, 4          # source length (seq_len), target length (max_target_len), batch
EOS = 1
# Identifiers: train "ab", "def", "get", "xy" ("return" -> "nruter" is 6 >= T ids: left out);
# held out (not in train) "pq", "qq", "rst", "uv", "wx" ("longname" is 8 >= S ids: left out).
TEXTS = {"train": ["def get(ab, xy):\n    return ab\n"],
         "validation": ["ab = pq + qq + rst + uv + wx + longname\n"]}


def b(text: str) -> list[int]:
    """Byte ids: the UTF-8 byte + 3 (pad 0, eos 1)."""
    return [c + 3 for c in text.encode()]


def row(ids: list[int], n: int) -> list[int]:
    return ids + [0] * (n - len(ids))


# The eval batches by hand (reverse transform): batch 0 holds pq, qq, rst, uv; batch 1 holds
# wx and three all-padding rows of weight 0.
EVAL = [{
    "inputs": [row(b(s) + [EOS], S) for s in ("pq", "qq", "rst", "uv")],
    "targets": [row([0] + b(t), T) for t in ("qp", "qq", "tsr", "vu")],      # [start = pad] + t
    "labels": [row(b(t) + [EOS], T) for t in ("qp", "qq", "tsr", "vu")],      # t + eos
    "weights": [row([1] * (len(t) + 1), T) for t in ("qp", "qq", "tsr", "vu")],
}, {
    "inputs": [row(b("wx") + [EOS], S)] + [[0] * S] * 3,
    "targets": [row([0] + b("xw"), T)] + [[0] * T] * 3,
    "labels": [row(b("xw") + [EOS], T)] + [[0] * T] * 3,
    "weights": [row([1] * 3, T)] + [[0] * T] * 3,
}]


def s2s_task(tmp_path, seed=0, **options) -> Seq2SeqTask:
    """The identifier task over TEXTS (its text loader replaced: no corpus is read)."""
    cfg = ExperimentConfig(task="seq2seq", model="t5", seq_len=S, batch_size=B, seed=seed,
                           task_options={"transform": "reverse", "max_target_len": T, **options})
    task = make_task(cfg, tmp_path)
    task._texts = TEXTS.__getitem__
    return task


# ----------------------------------------------------------------------------- batches

def test_pairs_are_held_out_and_length_filtered(tmp_path):
    task = s2s_task(tmp_path)
    assert task._pairs("train", train=True).pairs == [("ab", "ba"), ("def", "fed"),
                                                      ("get", "teg"), ("xy", "yx")]
    assert task._pairs("validation", train=False).pairs == [
        ("pq", "qp"), ("qq", "qq"), ("rst", "tsr"), ("uv", "vu"), ("wx", "xw")]
    camel = s2s_task(tmp_path, transform="snake_to_camel")
    camel._texts = {"train": ["get_x = a_b_c + long_name_x + MAX_SIZE\n"]}.__getitem__
    # "long_name_x" (11 >= S ids) does not fit; MAX_SIZE is not lowercase snake_case
    assert camel._pairs("train", train=True).pairs == [("a_b_c", "ABC"), ("get_x", "GetX")]


def test_eval_batches_by_hand(tmp_path):
    batches = list(s2s_task(tmp_path).eval_batches(0, 1))
    assert len(batches) == 2
    for got, want in zip(batches, EVAL):
        assert set(got) == {"inputs", "input_mask", "targets", "labels", "weights"}
        assert got["inputs"].shape == (B, S) and got["labels"].shape == (B, T)
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        np.testing.assert_array_equal(got["input_mask"], np.array(want["inputs"]) != 0)
        assert got["weights"].dtype == np.float32 and got["inputs"].dtype == np.int32


def test_train_batches_teacher_forcing_and_epochs(tmp_path):
    task = s2s_task(tmp_path, seed=2)
    it = task.train_iterator(0, 1)
    tok = task.tokenizer
    epochs = []
    for _ in range(3):                                  # 4 pairs, B = 4: one batch an epoch
        batch = next(it)
        # decoder input = labels shifted right by one, the start (pad) first, no eos
        assert (batch["targets"][:, 0] == 0).all()
        prev = batch["labels"][:, :-1]
        np.testing.assert_array_equal(batch["targets"][:, 1:], np.where(prev == EOS, 0, prev))
        np.testing.assert_array_equal(batch["weights"], (batch["labels"] != 0).astype(np.float32))
        sources = [tok.decode(r) for r in batch["inputs"]]
        assert [tok.decode(r) for r in batch["labels"]] == [s[::-1] for s in sources]
        assert sorted(sources) == ["ab", "def", "get", "xy"]      # every pair once per epoch
        epochs.append(sources)
    assert len({tuple(e) for e in epochs}) > 1                     # reshuffled per epoch
    assert it.get_state() == {"epoch": 3, "index": 0}


def test_task_overrides_spec_and_sizes(tmp_path):
    task = s2s_task(tmp_path)
    assert task.model_overrides() == {"vocab_size": 259, "pad_token_id": 0, "eos_token_id": 1,
                                      "decoder_start_token_id": 0}
    assert task.spec() == {"tokenizer": "byte", "transform": "reverse", "src_len": S, "tgt_len": T}
    src, tgt = task.init_args()
    assert src.shape == (1, S) and tgt.shape == (1, T)
    assert task.tokens_per_step() == B * (S + T)


# ----------------------------------------------------------------------------- metrics

V = 259
TABLE = np.random.default_rng(0).normal(size=(V, V)).astype(np.float32)  # (V, V) logits per decoder input
TABLE[0, b("q")[0]] += 10.0         # start -> "q": right for "qp" and "qq"
TABLE[b("q")[0], b("p")[0]] += 10.0  # "q" -> "p": right in "qp", wrong in "qq" (twice)


def bigram_decoder(variables, inputs, targets, input_mask, deterministic=True, rngs=None):
    """A stand-in encoder-decoder: logits (B, T, V) depend on the decoder input only."""
    return variables["params"]["table"][targets]


def test_eval_metrics_are_teacher_forced_per_target_token(tmp_path):
    """eval_loss/accuracy over the 16 label tokens (eos included) of the 5 real examples; the
    golden comes from the hand-built EVAL arrays."""
    got = evaluate({"table": TABLE}, bigram_decoder, s2s_task(tmp_path))
    nll, hits = [], []
    for batch in EVAL:
        targets, labels = np.array(batch["targets"]), np.array(batch["labels"])
        real = np.array(batch["weights"]) > 0
        logits = TABLE.astype(np.float64)[targets[real]]                       # (tokens, V)
        lse = np.log(np.exp(logits).sum(-1))
        nll += list(lse - logits[np.arange(len(logits)), labels[real]])
        hits += list(logits.argmax(-1) == labels[real])
    assert got["eval_tokens"] == len(nll) == 3 + 3 + 4 + 3 + 3
    assert sum(hits) == 3                                                      # 3 of 16 right
    assert got["eval_loss"] == pytest.approx(np.mean(nll), rel=1e-5)
    assert got["eval_accuracy"] == pytest.approx(np.mean(hits), abs=1e-7)
    assert got["eval_ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)


def test_seq2seq_loss_feeds_source_decoder_input_and_mask(tmp_path):
    batch = next(iter(s2s_task(tmp_path).eval_batches(0, 1)))
    seen = []

    def apply(variables, inputs, targets, mask, deterministic, rngs):
        jax.debug.callback(lambda *args: seen.append(args), inputs, targets, mask)   # from jit
        return bigram_decoder(variables, inputs, targets, mask)

    loss_fn = jax.jit(lambda p, b: seq2seq_loss(apply, p, b, None, True, 0.0))
    loss_sum, sums = loss_fn({"table": TABLE}, batch)
    jax.effects_barrier()                 # the debug callbacks have run
    for got, key in zip(seen[0], ("inputs", "targets", "input_mask")):
        np.testing.assert_array_equal(got, batch[key])
    assert float(sums["weight"]) == 13 and float(sums["nll"]) == float(loss_sum)


# A stand-in decoder for extra_eval: the reversed source, except "qq" (a wrong answer) and "uv"
# (right characters, then no eos but junk "/" = id 50); other rows carry junk after their eos,
# which does not count. Rows are T ids, as greedy search returns.
DECODED = {"pq": b("qp") + [EOS, 50, 50, 50], "qq": b("qx") + [EOS, 0, 0, 0],
           "rst": b("tsr") + [EOS, 7, 7], "uv": b("vu") + [50] * 4, "wx": b("xw") + [EOS, 0, 0, 0],
           "": [50] * T}          # the all-padding rows


def stub_decode(task, calls):
    def decode(model, params, inputs, input_mask, max_new_tokens=None):
        calls.append((np.array(inputs), np.array(input_mask), max_new_tokens))
        return np.array([DECODED[task.tokenizer.decode(r)] for r in inputs], np.int32)
    return decode


@pytest.mark.parametrize("decode_batches, hits, decoded", [(4, 3, 5), (1, 2, 4)])
def test_extra_eval_exact_match_and_bleu_over_real_rows(tmp_path, decode_batches, hits, decoded):
    """Exact match compares the decoded ids up to the first eos with the labels; padding rows
    are not scored; at most ``decode_batches`` batches are decoded. BLEU is sacrebleu's
    character-level corpus BLEU of the same strings, written out here by hand."""
    task = s2s_task(tmp_path, decode_batches=decode_batches)
    calls = []
    task._decode = stub_decode(task, calls)
    got = task.extra_eval(model=None, params=None)
    assert got["exact_match"] == hits / decoded and got["decoded"] == decoded
    hyps = ["qp", "qx", "tsr", "vu////", "xw"][:decoded]
    refs = ["qp", "qq", "tsr", "vu", "xw"][:decoded]
    assert got["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs], tokenize="char").score)
    assert len(calls) == min(decode_batches, 2)
    np.testing.assert_array_equal(calls[0][0], EVAL[0]["inputs"])
    np.testing.assert_array_equal(calls[0][1], np.array(EVAL[0]["inputs"]) != 0)
    assert s2s_task(tmp_path, decode_batches=0).extra_eval(None, None) == {}


def test_sample_lines_mark_right_and_wrong(tmp_path):
    task = s2s_task(tmp_path, decode_batches=1)
    task._decode = stub_decode(task, [])
    assert task.sample(None, None, step=0).splitlines() == [
        "'pq' -> 'qp'  (ok)", "'qq' -> 'qx'  (want 'qq')", "'rst' -> 'tsr'  (ok)",
        "'uv' -> 'vu////'  (want 'vu')"]


def test_generate_text_decodes_the_prompt_as_one_source(tmp_path):
    """The prompt is cut to S - 1 ids + eos and right-padded; the decode length is T, or
    ``max_new_tokens``, at most the model's ``max_len`` (sinusoidal tables); the answer is
    the text up to eos."""
    task = s2s_task(tmp_path)
    calls = []

    def decode(model, params, inputs, input_mask, max_new_tokens=None):
        calls.append((np.array(inputs), np.array(input_mask), max_new_tokens))
        return np.array([b("hi") + [EOS] + b("junk")[:T - 3]], np.int32)

    task._decode = decode

    class Sinusoidal:
        class config:
            max_len = 4

    class Relative:                       # T5: relative positions, no max_len
        class config:
            pass

    assert task.generate_text(Sinusoidal(), {}, "abcdefghij") == "hi"
    inputs, mask, n = calls[-1]
    np.testing.assert_array_equal(inputs, [b("abcdefg") + [EOS]])        # (1, S)
    np.testing.assert_array_equal(mask, np.ones((1, S)))
    assert n == 4                                                         # min(T, max_len)
    task.generate_text(Sinusoidal(), {}, "ab", max_new_tokens=2)
    np.testing.assert_array_equal(calls[-1][0], [row(b("ab") + [EOS], S)])
    assert calls[-1][2] == 2
    task.generate_text(Relative(), {}, "ab")
    assert calls[-1][2] == T
    said = []                             # what the CLI prints as warning: lines
    task.generate_text(Sinusoidal(), {}, "abcdefghij", max_new_tokens=6, say=said.append)
    assert said == ["the prompt is 10 tokens; this run's sources hold 7 and an eos: its last 3 "
                    "tokens cut",
                    "--max-new-tokens 6 exceeds the model's max_len=4: 2 tokens cut, at most 4 "
                    "generated"]
    task.generate_text(Sinusoidal(), {}, "ab", max_new_tokens=4, say=said.append)
    assert len(said) == 2


def test_cut_at_eos():
    assert cut_at_eos([5, 6, 1, 7, 1], 1) == [5, 6, 1]
    assert cut_at_eos(np.array([1, 4]), 1) == [1]
    assert cut_at_eos([5, 6], 1) == [5, 6]


def test_seq2seq_loss_passes_packed_pairs_to_the_model():
    seen = {}

    def spy_apply(variables, inputs, targets, input_mask, deterministic=True, rngs=None,
                  **packed):
        seen.update(packed)
        return np.zeros(targets.shape + (5,), np.float32)          # uniform over 5 ids

    ids = np.array([[1, 1, 2, 2]], np.int32)
    batch = {"inputs": ids, "targets": ids[:, :3], "input_mask": np.ones((1, 4), np.int32),
             "labels": ids[:, :3], "weights": np.ones((1, 3), np.float32),
             "segment_ids": ids, "positions": np.array([[0, 1, 0, 1]], np.int32),
             "decoder_segment_ids": ids[:, :3], "decoder_positions": np.array([[0, 1, 0]])}
    loss, sums = seq2seq_loss(spy_apply, {}, batch, None, True, 0.0)
    assert sorted(seen) == ["decoder_positions", "decoder_segment_ids", "positions",
                            "segment_ids"]
    np.testing.assert_array_equal(seen["decoder_positions"], [[0, 1, 0]])
    assert float(loss) == pytest.approx(3 * math.log(5), rel=1e-6)


@pytest.mark.parametrize("family", ["t5", "transformer"])
def test_seq2seq_loss_chunked_equals_plain(family):
    """``loss_chunk=5`` on T5 (tied read-out, decoder output scaled by D^-1/2) and the
    Transformer (untied lm_head): loss, sums and gradients equal the plain loss's (1e-6)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from tests.helpers import assert_chunked_loss_matches
    from transformer_jax.models import T5, T5Config, Transformer, TransformerConfig
    if family == "t5":
        model = T5(T5Config(vocab_size=40, d_model=32, num_heads=4, head_dim=8, mlp_dim=48,
                            num_layers=1, num_decoder_layers=1, relative_attention_num_buckets=8,
                            relative_attention_max_distance=20, dropout_rate=0.0))
    else:
        model = Transformer(TransformerConfig(vocab_size=40, max_len=16, num_layers=1,
                                              num_decoder_layers=1, d_model=32, num_heads=4,
                                              mlp_dim=48, dropout_rate=0.0, tie_embeddings=False))
    ks = jax.random.split(jax.random.PRNGKey(6), 4)
    src = jax.random.randint(ks[0], (2, 7), 1, 40)
    tgt = jax.random.randint(ks[1], (2, 6), 1, 40)
    weights = (jax.random.uniform(ks[2], (2, 6)) > 0.2).astype(np.float32)
    labels = jnp.where(weights > 0, jax.random.randint(ks[3], (2, 6), 0, 40), -100)
    batch = {"inputs": src, "targets": tgt, "input_mask": jnp.ones((2, 7), jnp.int32).at[0, 5:].set(0),
             "labels": labels, "weights": weights}
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), src, tgt)["params"])
    _, grads = assert_chunked_loss_matches(seq2seq_loss, model.apply, params, batch)
    head = grads["shared"]["embedding"] if family == "t5" else grads["lm_head"]["kernel"]
    assert float(jnp.abs(head).max()) > 0
