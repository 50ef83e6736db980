"""The ``classify`` task: its batches (line-role examples as [CLS] a [SEP] b [SEP] by hand, one
seeded pass padded with weight-0 rows) and its metrics (loss and accuracy of a hand-scored rule
classifier, the eval sample). line_roles goldens and training are in tests/models/test_bert.py."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.data import ByteTokenizer
from transformer_jax.tasks import classify, make_task
from transformer_jax.tasks.classify import (LINE_CLASSES, ClassifyTask, classify_loss,
                                            encode_example, line_role_examples, line_roles)
from transformer_jax.tasks.mlm import MLMVocab
from transformer_jax.train.config import ExperimentConfig
from transformer_jax.train.loop import evaluate

VOCAB = MLMVocab(ByteTokenizer())
CLS, SEP = 259, 260
CODE, COMMENT, STRING = 0, 1, 2

# Two small modules; the roles of their non-blank lines, by hand:
#   '"""Doc' string, 'more."""' string, '# note' comment, 'x = 1  # set' code (a code token),
#   'y = """a' code, 'b"""' string (only string text);  'def f():' code, '    # inner'
#   comment, '    return 1' code.
MODULE = '"""Doc\nmore."""\n\n# note\nx = 1  # set\ny = """a\nb"""\n'
OTHER = "def f():\n    # inner\n    return 1\n"
ROLES = [STRING, STRING, COMMENT, CODE, CODE, STRING, CODE, COMMENT, CODE]


def b(text: str) -> list[int]:
    """Byte ids: the UTF-8 byte + 3."""
    return [c + 3 for c in text.encode()]


@pytest.fixture
def local_texts(monkeypatch):
    """The task reads MODULE + OTHER as its validation and its train split (no TFDS)."""
    texts = {"validation": [MODULE, OTHER], "train": [MODULE, OTHER]}
    monkeypatch.setattr(classify.data_lib, "load_texts",
                        lambda dataset, split, data_dir=None: texts[split])


def classify_task(tmp_path, **fields) -> ClassifyTask:
    fields = {"seq_len": 48, "batch_size": 4, **fields}
    return make_task(ExperimentConfig(task="classify", model="bert", **fields), tmp_path)


# ----------------------------------------------------------------------------- examples

def test_line_role_examples_with_and_without_context():
    assert list(line_role_examples([MODULE], 2)) == [
        ("", '"""Doc', STRING),
        ('"""Doc\n', 'more."""', STRING),
        ('more."""\n\n', "# note", COMMENT),          # the blank line is context, not an example
        ("\n# note\n", "x = 1  # set", CODE),
        ("# note\nx = 1  # set\n", 'y = """a', CODE),
        ('x = 1  # set\ny = """a\n', 'b"""', STRING)]
    assert list(line_role_examples([MODULE, OTHER], 0)) == [
        ('"""Doc', None, STRING), ('more."""', None, STRING), ("# note", None, COMMENT),
        ("x = 1  # set", None, CODE), ('y = """a', None, CODE), ('b"""', None, STRING),
        ("def f():", None, CODE), ("    # inner", None, COMMENT), ("    return 1", None, CODE)]


def test_lines_are_numbered_as_tokenize_numbers_them():
    """A form feed (common between sections of older modules) or another character at which
    str.splitlines breaks is inside a line for tokenize; the roles must not shift after it."""
    source = "x = 1\n\x0c\n# c\ny = 2  # \u2028 note\nz = 3\n"
    assert line_roles(source) == [CODE, -1, COMMENT, CODE, CODE]
    assert [(a, r) for a, _, r in line_role_examples([source], 0)] == [
        ("x = 1", CODE), ("# c", COMMENT), ("y = 2  # \u2028 note", CODE), ("z = 3", CODE)]


def test_encode_example_budget_cases():
    # a short: b takes what a leaves of seq_len - 3 = 7 (here 7 - 2 = 5 of its 8)
    ids, types = encode_example(VOCAB, [5, 6], list(range(20, 28)), 10)
    assert ids.tolist() == [CLS, 5, 6, SEP, 20, 21, 22, 23, 24, SEP]
    assert types.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    # no context: [CLS] [SEP] b [SEP], b cut to the whole budget
    ids, types = encode_example(VOCAB, [], list(range(20, 30)), 8)
    assert ids.tolist() == [CLS, SEP, 20, 21, 22, 23, 24, SEP]
    assert types.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    # both fit: nothing cut, right-padded with 0, padding has token type 0
    ids, types = encode_example(VOCAB, [5], [20, 21], 8)
    assert ids.tolist() == [CLS, 5, SEP, 20, 21, SEP, 0, 0]
    assert types.tolist() == [0, 0, 0, 1, 1, 1, 0, 0]


# ----------------------------------------------------------------------------- batches

def test_encoded_split_by_hand(tmp_path, monkeypatch):
    texts = {"validation": ["x = 1\n# hi\n"]}
    monkeypatch.setattr(classify.data_lib, "load_texts", lambda dataset, split, data_dir=None: texts[split])
    task = classify_task(tmp_path, seq_len=12, task_options={"context_lines": 1})
    enc = task.encoded("validation")
    # line 1: no context -> [CLS] [SEP] "x = 1" [SEP]; line 2: budget 9 keeps b = "# hi" (4)
    # and the last 5 bytes of a = "x = 1\n" (" = 1\n")
    assert enc["input_ids"].tolist() == [
        [CLS, SEP, *b("x = 1"), SEP, 0, 0, 0, 0],
        [CLS, *b(" = 1\n"), SEP, *b("# hi"), SEP]]
    assert enc["token_type_ids"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
                                              [0] * 7 + [1] * 5]
    assert enc["attention_mask"].tolist() == [[1] * 8 + [0] * 4, [1] * 12]
    assert enc["labels"].tolist() == [CODE, COMMENT]
    assert enc["labels"].dtype == np.int32 and enc["input_ids"].dtype == np.int32
    assert task.encoded("validation") is enc                          # cached


def test_batches_are_one_seeded_pass_with_padding_rows(tmp_path, local_texts):
    task = classify_task(tmp_path, seed=3)
    enc = task.encoded("validation")
    assert enc["labels"].tolist() == ROLES
    ev = list(task.eval_batches(0, 1))
    assert len(ev) == 3                                              # ceil(9 / 4)
    weights = np.concatenate([x["weights"] for x in ev])
    np.testing.assert_array_equal(weights, [1] * 9 + [0] * 3)        # the last 3 rows pad
    assert set(ev[0]) == {"input_ids", "token_type_ids", "attention_mask", "labels", "weights"}
    ids = np.concatenate([x["input_ids"] for x in ev])[:9]            # (9 real rows, T)
    # each example exactly once, with its own label, type ids and mask
    order = [next(i for i in range(9) if np.array_equal(row, enc["input_ids"][i])) for row in ids]
    assert sorted(order) == list(range(9))
    for key in ("labels", "token_type_ids", "attention_mask"):
        np.testing.assert_array_equal(np.concatenate([x[key] for x in ev])[:9], enc[key][order])
    assert order != list(range(9))                                   # shuffled, not file order
    # the eval order is the first training epoch's (seed, epoch 0) over the same 9 examples;
    # training drops 9 mod 4 = 1 and repeats
    train = task.train_iterator(0, 1)
    np.testing.assert_array_equal(np.concatenate([next(train)["input_ids"] for _ in range(2)]),
                                  ids[:8])
    assert train.get_state() == {"epoch": 1, "index": 0}
    other = classify_task(tmp_path, seed=4)
    assert not np.array_equal(next(iter(other.eval_batches(0, 1)))["input_ids"], ev[0]["input_ids"])


def test_task_classes_spec_and_init_args(tmp_path):
    task = classify_task(tmp_path)
    assert task.classes == list(LINE_CLASSES) == ["code", "comment", "string"]
    assert task.spec() == {"tokenizer": "byte", "classes": ["code", "comment", "string"]}
    ids, types, mask = task.init_args()
    assert ids.shape == types.shape == mask.shape == (1, 48)
    assert not ids.any() and not types.any() and mask.all()


# ----------------------------------------------------------------------------- metrics

def comment_rule(variables, ids, types, mask, deterministic=True, rngs=None):
    """A stand-in classifier: logit 4 on ``comment`` when segment b starts with "#", else on
    ``code``; 0 elsewhere. logits (B, V = 3 classes)."""
    first_b = jnp.take_along_axis(ids, jnp.argmax(types, axis=1)[:, None], axis=1)[:, 0]   # (B,)
    is_comment = (first_b == ord("#") + 3)[:, None]
    return jnp.where(is_comment, jnp.array([0.0, 4.0, 0.0]), jnp.array([4.0, 0.0, 0.0]))


def test_eval_accuracy_and_loss_of_a_rule_classifier(tmp_path, local_texts):
    """By hand: the rule is right on '# note', 'x = 1  # set', 'y = \"\"\"a', 'def f():' and
    '    return 1' (5 of 9): the strings and the indented comment are wrong. A right answer
    costs log(e^4 + 2) - 4, a wrong one log(e^4 + 2); padding rows count for nothing."""
    task = classify_task(tmp_path, eval_batches=16)
    got = evaluate({}, comment_rule, task)
    lse = math.log(math.exp(4) + 2)
    want_loss = (5 * (lse - 4) + 4 * lse) / 9
    assert got["eval_tokens"] == 9
    assert got["eval_accuracy"] == pytest.approx(5 / 9, abs=1e-7)
    assert got["eval_loss"] == pytest.approx(want_loss, rel=1e-6)
    assert set(got) == {"eval_loss", "eval_accuracy", "eval_tokens"}   # classes: no perplexity


def test_classify_loss_weights_examples():
    """Per-example cross-entropy, weighted; a weight-0 row adds nothing even with NaN logits."""
    logits = np.array([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0], [np.nan] * 3], np.float32)   # (B, V = 3 classes)
    batch = {"input_ids": np.ones((3, 4), np.int32), "token_type_ids": np.zeros((3, 4), np.int32),
             "attention_mask": np.ones((3, 4), np.int32), "labels": np.array([0, 2, 1], np.int32),
             "weights": np.array([1.0, 1.0, 0.0], np.float32)}
    seen = []

    def apply(variables, ids, types, mask, deterministic, rngs):
        jax.debug.callback(lambda *args: seen.append(args), ids, types, mask)   # values, from jit
        return variables["params"]

    loss_sum, sums = jax.jit(lambda p, b: classify_loss(apply, p, b, None, True, 0.0))(logits, batch)
    lse = np.log(np.exp(logits[:2].astype(np.float64)).sum(-1))
    assert float(loss_sum) == pytest.approx((lse[0] - 2.0) + (lse[1] - 0.0), rel=1e-6)
    assert float(sums["weight"]) == 2.0 and float(sums["correct"]) == 1.0     # row 0 right
    jax.effects_barrier()                 # the debug callbacks have run
    assert all(np.array_equal(s, batch[k]) for s, k in
               zip(seen[0], ("input_ids", "token_type_ids", "attention_mask")))


def test_sample_lists_predicted_and_true_classes(tmp_path, local_texts):
    task = classify_task(tmp_path, sample_tokens=1)

    class Model:
        apply = staticmethod(comment_rule)

    lines = task.sample(Model(), {}, step=0).splitlines()
    first = next(iter(task.eval_batches(0, 1)))                # the same 4 seeded examples
    want = []
    for ids, types, label in zip(first["input_ids"], first["token_type_ids"], first["labels"]):
        line = VOCAB.tokenizer.decode(ids[types == 1])             # segment b: the line itself
        pred = "comment" if line.startswith("#") else "code"
        want.append(f"{pred:>8} (true {LINE_CLASSES[label]}): {VOCAB.render(ids)!r}")
    assert lines == want
    assert classify_task(tmp_path, sample_tokens=0).sample(Model(), {}, step=0) is None
