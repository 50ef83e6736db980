"""Ids checked on the host before anything runs: every train and eval batch of a task
against the model the run builds (``Task.ID_FIELDS``, tasks/base.py), the prompts of the
tasks' ``generate_text``, and the library's ``generate`` / ``greedy_search`` /
``beam_search``, which refuse bad prompt ids before compiling anything."""
import dataclasses

import jax
import numpy as np
import pytest

from transformer_jax import beam_search as beam_lib
from transformer_jax import decode as decode_lib
from transformer_jax.data.tokenizers import ByteTokenizer
from transformer_jax.decode import generate
from transformer_jax.errors import UserError
from transformer_jax.models import GPT, GPTConfig, T5, T5Config
from transformer_jax.tasks import make_task
from transformer_jax.train.config import ExperimentConfig

# Byte ids are the UTF-8 byte + 3: a=100 ... j=109 (tests/tasks/test_lm.py); the packed
# stream of DOCS is 100 101 1 102 103 104 1 105 1 106 107 108 109 1.
DOCS = ("ab", "cde", "f", "ghij")
T, B = 3, 2
LM_ADVICE = ("the tokenizer ('byte') yields ids the model does not have: the tokenizer and the "
             "model's vocab_size disagree (the model must be built for this tokenizer: drop a "
             "model.vocab_size override that is too small, or fix a tokenizer whose vocab_size "
             "undercounts its ids)")


class UndercountingBytes(ByteTokenizer):
    """A tokenizer whose ``vocab_size`` (105) undercounts its ids ('f' = 105 ... 'j' = 109)."""

    @property
    def vocab_size(self) -> int:
        return 105


def lm_task(tmp_path, **fields):
    """The task over the in-memory DOCS (``make_lm_iterator`` takes a sequence of strings;
    the config itself wants a dataset name, so DOCS go in after it is checked)."""
    cfg = ExperimentConfig(task="lm", seq_len=T, batch_size=B, **fields)
    object.__setattr__(cfg, "dataset", DOCS)
    return make_task(cfg, tmp_path)


# ----------------------------------------------------------------------------- batches

def test_an_eval_batch_with_ids_past_the_model_vocabulary_is_refused(tmp_path):
    task = lm_task(tmp_path)
    task.tokenizer = UndercountingBytes()             # the model gets vocab_size 105
    assert task.run_model_config().vocab_size == 105
    batches = task.eval_batches(0, 1)
    first = next(batches)                             # windows 100 101 1 102 / 102 103 104 1
    np.testing.assert_array_equal(first["inputs"], [[100, 101, 1], [102, 103, 104]])
    with pytest.raises(UserError) as info:            # inputs [[1 105 1] [106 107 108]]
        next(batches)
    assert str(info.value) == (
        "task 'lm', dataset ('ab', 'cde', 'f', 'ghij'), split 'validation': inputs[0, 1] = 105 "
        "is outside the vocabulary [0, 105) of GPTConfig.vocab_size (bad ids in inputs: 4 of "
        f"6); {LM_ADVICE}")


def test_a_train_batch_is_checked_against_a_too_small_vocab_size_override(tmp_path):
    task = lm_task(tmp_path, model_overrides={"num_layers": 1, "d_model": 32, "num_heads": 2,
                                              "vocab_size": 101})
    it = task.train_iterator(0, 1)
    with pytest.raises(UserError, match=r"^task 'lm', dataset \('ab', 'cde', 'f', 'ghij'\), "
                                        r"split 'train': inputs\[\d, \d\] = 1\d\d is outside the "
                                        r"vocabulary \[0, 101\) of GPTConfig.vocab_size"):
        next(it)


def test_checked_batches_are_the_iterators_batches_and_keep_its_state(tmp_path):
    task = lm_task(tmp_path, seed=3)
    it, plain = task.train_iterator(0, 1), task.make_iterator("train", 0, 1, train=True)
    assert type(it).__name__ == "Background"                 # made on a thread,
    assert type(it.iterator).__name__ == "CheckedBatches"    # checked there
    for _ in range(4):
        a, b = next(it), next(plain)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    state = it.get_state()                            # get_state / set_state pass through
    assert state == plain.get_state()
    after = next(it)
    it.set_state(state)
    np.testing.assert_array_equal(next(it)["inputs"], after["inputs"])
    assert [len(b["inputs"]) for b in task.eval_batches(0, 1)] == [2, 2, 2]


def test_image_labels_outside_num_classes_are_refused(tmp_path):
    cfg = ExperimentConfig(task="image_classification", model="vit", model_preset="tiny",
                           model_overrides={}, dataset="digits", eval_split="test",
                           batch_size=64, task_options={"image_size": 8})
    task = make_task(cfg, tmp_path)
    task.info = dataclasses.replace(task.info, num_classes=5)   # metadata that undercounts
    batch = next(task.make_iterator("test", 0, 1, train=False))
    bad = np.flatnonzero(batch["labels"] >= 5)
    with pytest.raises(UserError) as info:
        next(task.eval_batches(0, 1))
    assert str(info.value) == (
        f"task 'image_classification', dataset 'digits', split 'test': labels[{bad[0]}] = "
        f"{batch['labels'][bad[0]]} is outside the classes [0, 5) of ViTConfig.num_classes (bad "
        f"ids in labels: {len(bad)} of 64); the dataset's labels and the model's num_classes "
        "disagree (drop a model.num_classes override, or relabel the data)")


# ----------------------------------------------------------------------------- generate

V = 50                    # below the byte ids of letters (100 ...)
GPT_CFG = GPTConfig.preset("tiny", vocab_size=V, max_len=16, num_layers=1, d_model=32,
                           num_heads=2)
T5_CFG = T5Config.preset("tiny", vocab_size=V, num_layers=1, d_model=32, num_heads=2,
                         head_dim=16)


@pytest.fixture(scope="module")
def gpt():
    model = GPT(GPT_CFG)
    return model, model.init(jax.random.PRNGKey(0), np.zeros((1, 4), np.int32))["params"]


@pytest.fixture(scope="module")
def t5():
    model = T5(T5_CFG)
    z = np.zeros((1, 4), np.int32)
    return model, model.init(jax.random.PRNGKey(0), z, z)["params"]


@pytest.fixture
def nothing_runs(monkeypatch):
    """The jitted loops fail the test if they are reached (traced, compiled or run)."""
    def fail(*args, **kwargs):
        raise AssertionError("a search ran")
    for mod, name in ((decode_lib, "jitted_generate"), (beam_lib, "_greedy"), (beam_lib, "_beam")):
        monkeypatch.setattr(mod, name, fail)


def test_generate_refuses_prompt_ids_outside_the_vocabulary(gpt, nothing_runs):
    model, params = gpt
    prompt = np.array([[1, 2, 3], [4, V, -1]])
    with pytest.raises(UserError) as info:
        generate(model, params, prompt, max_new_tokens=2)
    assert str(info.value) == (
        f"prompt_ids[1, 1] = {V} is outside the vocabulary [0, {V}) of GPTConfig.vocab_size "
        "(bad ids in prompt_ids: 2 of 6); token ids must come from the tokenizer the model was "
        "built for (whose ids fit the config's vocab_size), and padding such as -1 or -100 "
        "must be replaced by a real pad id")
    # ragged prompts: the position is prompt_ids[i][j] as given, before the left padding
    with pytest.raises(UserError, match=r"^prompt_ids\[1, 2\] = 70 is outside the vocabulary "
                                        r"\[0, 50\) of GPTConfig.vocab_size \(bad ids in "
                                        r"prompt_ids: 1 of 5\)"):
        generate(model, params, [[1, 2], [3, 4, 70]], max_new_tokens=2)
    with pytest.raises(UserError, match=r"^pad_id=-1 is outside the vocabulary \[0, 50\) of "
                                        r"GPTConfig.vocab_size: it left-pads the shorter "
                                        r"prompts; pass an id the model has$"):
        generate(model, params, [[1, 2], [3, 4, 5]], max_new_tokens=2, pad_id=-1)


def test_generate_with_valid_ids_still_runs(gpt):
    model, params = gpt
    out = generate(model, params, [[1, 2], [3, 4, 5]], max_new_tokens=2, pad_id=0)
    assert [len(r) for r in out] == [4, 5]


def test_searches_refuse_bad_source_ids_and_start_ids(t5, nothing_runs):
    model, params = t5
    src = np.array([[5, 6, 7, 1], [5, 99, 1, 0]])
    for search, kw in ((beam_lib.greedy_search, {}), (beam_lib.beam_search, {"num_beams": 2})):
        with pytest.raises(UserError, match=r"^input_ids\[1, 1\] = 99 is outside the vocabulary "
                                            r"\[0, 50\) of T5Config.vocab_size \(bad ids in "
                                            r"input_ids: 1 of 8\)"):
            search(model, params, src, max_new_tokens=3, **kw)
        with pytest.raises(UserError, match=r"^decoder_start_id=50 is outside the vocabulary "
                                            r"\[0, 50\) of T5Config.vocab_size: every output "
                                            r"starts from it; pass an id the model has$"):
            search(model, params, src % V, max_new_tokens=3, decoder_start_id=V, **kw)


def test_the_tasks_generate_text_names_the_tokenizer(tmp_path, gpt, t5):
    """A model whose vocabulary (50) lacks the tokenizer's letters (100 ...): refused
    before ``generate`` (params=None: nothing may run)."""
    with pytest.raises(UserError) as info:
        lm_task(tmp_path).generate_text(gpt[0], None, "hi")
    assert str(info.value) == (
        "prompt[0, 0] = 107 is outside the vocabulary [0, 50) of GPTConfig.vocab_size (bad ids "
        f"in prompt: 2 of 2); {LM_ADVICE}")
    cfg = ExperimentConfig(task="seq2seq", model="t5", seq_len=8, batch_size=2,
                           task_options={"transform": "reverse", "max_target_len": 8})
    with pytest.raises(UserError, match=r"^prompt\[0, 0\] = 100 is outside the vocabulary "
                                        r"\[0, 50\) of T5Config.vocab_size \(bad ids in prompt: "
                                        r"1 of 2\); the tokenizer \('byte'\)"):
        make_task(cfg, tmp_path / "s2s").generate_text(t5[0], None, "a")
