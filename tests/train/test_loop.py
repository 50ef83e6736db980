"""The training loop's parts: pause (``stop_at``) and resume, the ``on_log``/``on_eval``
callbacks, one host fetch per log step and none in between, the NaN stop between log
steps, and the prefetcher's data position."""
import jax
import numpy as np
import pytest
from jax._src.array import ArrayImpl

from transformer_jax.errors import UserError
from transformer_jax.train import loop
from transformer_jax.train.checkpoint import CheckpointManager
from transformer_jax.train.loop import NonFiniteLossError, Prefetcher
from transformer_jax.run import train
from transformer_jax.train.monitor import read_metrics

from ..helpers import tiny_cfg


def train_rows(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(workdir) if "loss" in r}


def eval_rows(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(workdir) if "eval_loss" in r}


def saved_steps(workdir) -> list[int]:
    with CheckpointManager(workdir / "checkpoints", read_only=True) as mgr:
        return mgr.all_steps()


# --------------------------------------------------------------------------- pause, resume

@pytest.mark.colab
def test_stop_at_pauses_and_resume_gives_the_uninterrupted_losses(tmp_path, data_dir):
    """A notebook's pattern: train with callbacks, pause at step 8 (a checkpoint there,
    though save_every is 5), continue with resume=True; every loss and eval equals the
    uninterrupted run's bit for bit, and the callbacks saw exactly the rows in metrics.jsonl."""
    cfg = tiny_cfg(data_dir, steps=14)
    logged, evals = [], []
    on_log = lambda step, row: logged.append((step, row))  # noqa: E731
    on_eval = lambda step, metrics: evals.append((step, metrics))  # noqa: E731
    paused = train(cfg, tmp_path / "run", progress=False, stop_at=8, on_log=on_log, on_eval=on_eval)
    assert paused["final_step"] == 8 and paused["paused"] and paused["interrupted"] is None
    assert saved_steps(tmp_path / "run") == [5, 8]
    assert [s for s, _ in logged] == list(range(1, 9)) and [s for s, _ in evals] == [5]
    assert paused["loss"] == logged[-1][1]["loss"]
    resumed = train(cfg, tmp_path / "run", resume=True, progress=False, on_log=on_log, on_eval=on_eval)
    assert resumed["start_step"] == 8 and resumed["final_step"] == 14 and not resumed["paused"]
    assert [s for s, _ in logged] == list(range(1, 15)) and [s for s, _ in evals] == [5, 10, 14]
    reference = train(cfg, tmp_path / "reference", progress=False)
    got, want = train_rows(tmp_path / "run"), train_rows(tmp_path / "reference")
    assert sorted(got) == sorted(want) == list(range(1, 15))
    for key in ("loss", "grad_norm", "accuracy"):
        np.testing.assert_array_equal([got[s][key] for s in got], [want[s][key] for s in got], key)
    assert eval_rows(tmp_path / "run") == eval_rows(tmp_path / "reference")
    assert resumed["eval_loss"] == reference["eval_loss"]
    # the callbacks received exactly what metrics.jsonl holds
    assert {s: row for s, row in logged} == {s: {k: v for k, v in r.items() if k != "step"}
                                              for s, r in got.items()}
    assert {s: m for s, m in evals} == {s: {k: v for k, v in r.items() if k != "step"}
                                         for s, r in eval_rows(tmp_path / "run").items()}


def test_stop_at_must_be_after_the_start(tmp_path, data_dir):
    cfg = tiny_cfg(data_dir, steps=6, eval_every=100)
    train(cfg, tmp_path, progress=False, stop_at=3)
    with pytest.raises(UserError, match=r"stop_at=3 is not after the step this run starts from \(3\)"):
        train(cfg, tmp_path, resume=True, progress=False, stop_at=3)
    assert train(cfg, tmp_path, resume=True, progress=False, stop_at=99)["final_step"] == 6


# --------------------------------------------------------------------------- host syncs

def test_one_host_fetch_per_log_step_and_none_in_between(tmp_path, data_dir, monkeypatch):
    """Over 12 steps with log_every=4 the loop fetches from the devices 3 times (steps 4, 8,
    12), and each fetch brings the losses of every step since the previous one. The per-step
    work (the step itself and the bookkeeping in MetricsLog.record) copies nothing to the host:
    it runs with a counter on jax.Array's host value (float(), .item(), device_get ...) and
    under jax.transfer_guard_device_to_host("disallow_explicit") (which the CPU backend does
    not enforce: its arrays already live in host memory; on GPU/TPU it does)."""
    fetched, in_step, copies_in_step = [], [False], []
    real_fetch, real_value = loop.fetch, ArrayImpl._value

    def counting_value(self):
        if in_step[0]:
            copies_in_step.append(self.shape)
        return real_value.fget(self)

    def per_step(fn):
        def wrapped(*args):
            in_step[0] = True
            try:
                with jax.transfer_guard_device_to_host("disallow_explicit"):
                    return fn(*args)
            finally:
                in_step[0] = False
        return wrapped

    def allowed(fn):
        def wrapped(*args):
            was, in_step[0] = in_step[0], False
            try:
                with jax.transfer_guard_device_to_host("allow"):
                    return fn(*args)
            finally:
                in_step[0] = was
        return wrapped

    def fetch(tree):
        fetched.append(tree)
        return real_fetch(tree)

    monkeypatch.setattr(ArrayImpl, "_value", property(counting_value))
    monkeypatch.setattr(loop, "fetch", allowed(fetch))
    monkeypatch.setattr(loop, "_advance", per_step(loop._advance))
    monkeypatch.setattr(loop.MetricsLog, "record", per_step(loop.MetricsLog.record))
    monkeypatch.setattr(loop.MetricsLog, "_start_copy", staticmethod(allowed(loop.MetricsLog._start_copy)))
    cfg = tiny_cfg(data_dir, steps=12, log_every=4, eval_every=100, save_every=100)
    summary = train(cfg, tmp_path, progress=False)
    assert len(fetched) == 3 and copies_in_step == []
    assert [len(losses) for _, losses in fetched] == [4, 4, 4]
    rows = train_rows(tmp_path)
    assert sorted(rows) == [4, 8, 12]
    assert [float(losses[-1]) for _, losses in fetched] == [rows[s]["loss"] for s in (4, 8, 12)]
    assert summary["loss"] == rows[12]["loss"]


def _poison_after(call: int, monkeypatch):
    """Make the parameters NaN right after the ``call``-th train step (so the next step's
    loss is the first non-finite one)."""
    real, calls = loop._advance, [0]

    def advance(run):
        metrics = real(run)
        calls[0] += 1
        if calls[0] == call:
            run.state = run.state.replace(params=jax.tree_util.tree_map(
                lambda p: p * np.float32("nan"), run.state.params))
        return metrics
    monkeypatch.setattr(loop, "_advance", advance)


def test_nan_between_log_steps_is_caught_before_the_next_save(tmp_path, data_dir, monkeypatch):
    """log_every=5, save_every=3: the loss of step 8 is the first NaN, between the log steps
    5 and 10; the save due at step 9 checks every loss since step 5 first, so the run stops
    there, names step 8 and keeps step 6 as the last (finite) checkpoint."""
    _poison_after(7, monkeypatch)
    cfg = tiny_cfg(data_dir, steps=20, log_every=5, save_every=3, eval_every=100)
    with pytest.raises(NonFiniteLossError, match=r"loss became nan at step 8; .* checkpoint step 6 in .* is from before the blow-up; .* --resume \(it restores step 6"):
        train(cfg, tmp_path, progress=False)
    assert saved_steps(tmp_path) == [3, 6]
    assert sorted(train_rows(tmp_path)) == [5]
    with CheckpointManager(tmp_path / "checkpoints", read_only=True) as mgr:
        state, _, _ = mgr.restore()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state["params"]))


def test_nan_is_caught_at_the_next_log_step_when_no_save_comes_first(tmp_path, data_dir, monkeypatch):
    _poison_after(6, monkeypatch)
    cfg = tiny_cfg(data_dir, steps=20, log_every=4, save_every=100, eval_every=100)
    with pytest.raises(NonFiniteLossError, match=r"loss became nan at step 7; .* no checkpoint from before the blow-up exists;"):
        train(cfg, tmp_path, progress=False)
    assert sorted(train_rows(tmp_path)) == [4] and saved_steps(tmp_path) == []


# --------------------------------------------------------------------------- prefetch

class _Counter:
    """An endless iterator of numbered batches with a savable position."""

    def __init__(self):
        self.n = 0

    def __next__(self):
        self.n += 1
        return {"x": np.full((2,), self.n - 1)}

    def get_state(self):
        return {"next": self.n}


def test_prefetcher_places_ahead_and_reports_the_consumed_position():
    placed = []
    it = _Counter()
    pre = Prefetcher(it, lambda b: placed.append(int(b["x"][0])) or ("on device", b), depth=2)
    assert pre.position() == {"next": 0}
    first = next(pre)
    assert first[0] == "on device" and int(first[1]["x"][0]) == 0
    assert placed == [0, 1, 2] and it.n == 3          # two batches placed ahead
    assert pre.position() == {"next": 1}              # what a checkpoint stores: after batch 0
    for want in (1, 2, 3):
        assert int(next(pre)[1]["x"][0]) == want
    assert pre.position() == {"next": 4} and it.n == 6
