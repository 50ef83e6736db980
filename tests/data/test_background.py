"""``data.background.Background``: batches made on a thread, the same as the plain
iterator's, with the consumer's state (checkpoint/resume stays exact)."""
import threading

import numpy as np
import pytest

from transformer_jax import data
from transformer_jax.data.background import Background

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

DOCS = [f"document {i}: " + "abcdefghij"[: i % 10] * (i % 7 + 1) for i in range(60)]


def make(**kw):
    return data.make_lm_iterator(DOCS, "train", seq_len=8, batch_size=4, seed=5, **kw)


def assert_same(a, b):
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_same_batches_and_states_as_the_plain_iterator(mode):
    plain, bg = make(mode=mode), Background(make(mode=mode), depth=2)
    assert bg.get_state() == plain.get_state()
    for _ in range(40):          # across epoch boundaries (memory: 7 batches per epoch)
        assert_same(next(bg), next(plain))
        assert bg.get_state() == plain.get_state()
    bg.close()


def test_state_is_the_consumers_not_the_producers():
    bg = Background(make(), depth=3)
    next(bg)
    states = [bg.get_state()]
    for _ in range(5):           # let the producer run ahead
        threading.Event().wait(0.05)
        states.append(bg.get_state())
    assert states == [{"mode": "memory", "epoch": 0, "index": 1}] * 6
    bg.close()


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_set_state_then_continue_is_the_plain_sequence(mode):
    plain = make(mode=mode)
    expected = [next(plain) for _ in range(20)]
    bg = Background(make(mode=mode), depth=2)
    for _ in range(9):
        next(bg)
    saved = bg.get_state()
    for _ in range(4):           # taken, then rewound
        next(bg)
    bg.set_state(saved)
    assert bg.get_state() == saved
    for want in expected[9:]:
        assert_same(next(bg), want)
    resumed = Background(make(mode=mode))   # a fresh run restoring the checkpoint
    resumed.set_state(saved)
    for want in expected[9:]:
        assert_same(next(resumed), want)
    bg.close(), resumed.close()


class _Failing:
    """Batches {"x": [i]} for i = 0, 1, ...; raises at batch ``fail_at``."""

    def __init__(self, fail_at):
        self.i, self.fail_at = 0, fail_at

    def __next__(self):
        if self.i == self.fail_at:
            raise ValueError(f"bad record at batch {self.i}")
        self.i += 1
        return {"x": np.array([self.i - 1])}

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = state["i"]


def test_an_exception_in_the_producer_surfaces_in_next():
    bg = Background(_Failing(fail_at=3), depth=2)
    assert [int(next(bg)["x"][0]) for _ in range(3)] == [0, 1, 2]
    assert bg.get_state() == {"i": 3}
    with pytest.raises(ValueError, match="bad record at batch 3"):
        next(bg)
    bg.set_state({"i": 1})       # a failed producer can be restarted from a position
    assert int(next(bg)["x"][0]) == 1


def test_a_finite_iterator_ends_and_close_stops_the_thread():
    ev = dict(seq_len=16, batch_size=4)
    plain = list(data.make_lm_iterator(DOCS, "validation", repeat=False, **ev))
    bg = Background(data.make_lm_iterator(DOCS, "validation", repeat=False, **ev))
    got = list(bg)
    assert len(got) == len(plain) == 30
    for a, b in zip(got, plain):
        assert_same(a, b)
    with pytest.raises(StopIteration):
        next(bg)
    endless = Background(make(), depth=1)
    next(endless)
    thread = endless._thread
    assert thread.is_alive()
    endless.close()
    assert not thread.is_alive()
    assert endless.batch_size == 4 and endless.mode == "memory"   # the iterator's attributes
    with pytest.raises(ValueError, match="depth=0"):
        Background(make(), depth=0)
