"""Tests for transformer_jax.train.checkpoint.CheckpointManager."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.train.checkpoint import CheckpointManager, read_config

pytestmark = pytest.mark.colab   # also run against Colab's versions: make test-colab

CONFIG = {
    "model": {"d_model": 64, "num_heads": 4, "dropout": 0.1, "tie_embeddings": True},
    "vocab": ["<pad>", "<s>", "</s>"],
    "schedule": None,
}


def _make_state(seed: int = 0):
    """Nested state with several dtypes, scalars, NaNs and a Python int."""
    rng = np.random.default_rng(seed)
    return {
        "params": {
            "dense": {
                "kernel": jnp.asarray(rng.normal(size=(3, 5)), jnp.bfloat16),
                "bias": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
            },
            "embed": {"embedding": jnp.asarray(rng.normal(size=(7, 3)), jnp.float16)},
        },
        "opt": {
            "count": jnp.int32(41 + seed),
            "mu": jnp.asarray(rng.normal(size=(4,)), jnp.float32).at[1].set(jnp.nan),
            "tokens": jnp.asarray(rng.integers(-5, 5, size=(2, 3)), jnp.int8),
            "mask": jnp.asarray(rng.integers(0, 2, size=(6,)), jnp.bool_),
        },
        "host": {"rng": np.asarray(rng.integers(0, 2**31, size=(2,)), np.uint32),
                 "scalar": np.int32(7)},
        "epoch": 3,
    }


def _assert_trees_equal(got, want):
    """Exact equality of structure, dtypes, shapes and values (NaN == NaN)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        if isinstance(w, (int, float)) and not isinstance(w, np.generic):
            assert g == w and type(g) is type(w), path
            continue
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (path, g.dtype, w.dtype)
        assert g.shape == w.shape, path
        np.testing.assert_array_equal(g, w, err_msg=str(path))


# ---------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------


def test_round_trip_exact_without_target(tmp_path):
    state = _make_state()
    data_state = {"epoch": np.int64(2), "offset": 12345, "seed": 0, "files": ["a", "b"]}
    with CheckpointManager(tmp_path / "ckpt", save_every=10) as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.maybe_save(10, state, config=CONFIG, data_state=data_state)
        ckpt.wait()
        restored, config, data = ckpt.restore()
    _assert_trees_equal(restored, state)
    # Arrays come back as the kind that was saved.
    assert isinstance(restored["params"]["dense"]["kernel"], jax.Array)
    assert isinstance(restored["host"]["rng"], np.ndarray)
    assert config == CONFIG
    assert data == {"epoch": 2, "offset": 12345, "seed": 0, "files": ["a", "b"]}


def test_round_trip_with_abstract_and_concrete_target(tmp_path):
    state = _make_state(1)
    with CheckpointManager(tmp_path, save_every=1) as ckpt:
        ckpt.maybe_save(5, state, config=CONFIG, data_state={"i": 5})
    device = jax.local_devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding)
        if not isinstance(x, int) else x,
        state,
    )
    with CheckpointManager(tmp_path, save_every=1) as ckpt:
        restored, config, data = ckpt.restore(target=abstract)
        # A concrete target with other values: the checkpoint's values win.
        zeros = jax.tree.map(lambda x: jnp.zeros_like(x) if not isinstance(x, int) else 0, state)
        restored_concrete, _, _ = ckpt.restore(5, target=zeros)
    for tree in (restored, restored_concrete):
        for leaf, want in zip(jax.tree.leaves(tree), jax.tree.leaves(state)):
            if not isinstance(want, int):
                assert isinstance(leaf, jax.Array) and leaf.sharding == sharding
        _assert_trees_equal(
            jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree),
            jax.tree.map(lambda x: np.asarray(x) if not isinstance(x, int) else x, state),
        )
    assert config == CONFIG and data == {"i": 5}


def test_flax_train_state_round_trip(tmp_path):
    import flax.linen as nn
    import optax
    from flax.training import train_state

    model = nn.Dense(3)
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))
    state = train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)
    )
    grads = jax.tree.map(jnp.ones_like, state.params)
    state = jax.jit(lambda s: s.apply_gradients(grads=grads))(state)
    with CheckpointManager(tmp_path, save_every=1) as ckpt:
        ckpt.maybe_save(int(state.step), state, config=CONFIG, data_state={})
        fresh = train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)
        )
        restored, _, _ = ckpt.restore(target=jax.eval_shape(lambda: fresh))
    assert type(restored) is train_state.TrainState
    assert int(restored.step) == 1
    _assert_trees_equal(restored.params, state.params)
    _assert_trees_equal(restored.opt_state, state.opt_state)


def test_nan_state_is_saved_like_any_other(tmp_path):
    state = {"w": jnp.full((3,), jnp.nan, jnp.float32), "step": jnp.int32(9)}
    with CheckpointManager(tmp_path, save_every=1) as ckpt:
        assert ckpt.maybe_save(9, state, config={}, data_state={},
                               metrics={"eval_loss": float("nan")})
        restored, _, _ = ckpt.restore()
        assert ckpt.best_step() is None  # a NaN loss is never "best"
    _assert_trees_equal(restored, state)


def test_async_save_survives_buffer_donation(tmp_path):
    """maybe_save returns only after device buffers are copied: a train step
    may donate (delete) them right away while the write continues."""
    x = jnp.asarray(np.random.default_rng(0).random((512, 512), dtype=np.float32))
    want = np.asarray(x)
    with CheckpointManager(tmp_path, save_every=1, async_save=True) as ckpt:
        assert ckpt.maybe_save(1, {"x": x}, config={}, data_state={})
        x.delete()
        ckpt.wait()
        np.testing.assert_array_equal(ckpt.restore()[0]["x"], want)


def test_read_config(tmp_path):
    with CheckpointManager(tmp_path, save_every=1, keep=None) as ckpt:
        ckpt.maybe_save(1, _make_state(), config={"v": 1}, data_state={})
        ckpt.maybe_save(2, _make_state(), config={"v": 2, "name": "gpt"}, data_state={})
    assert read_config(tmp_path) == {"v": 2, "name": "gpt"}
    assert read_config(str(tmp_path), step=1) == {"v": 1}
    with pytest.raises(UserError, match="No checkpoint found"):
        read_config(tmp_path / "missing")
    assert not (tmp_path / "missing").exists()  # read-only: nothing created
    with pytest.raises(UserError, match=r"available steps: \[1, 2\]"):
        read_config(tmp_path, step=3)


# ---------------------------------------------------------------------------
# Save schedule and retention
# ---------------------------------------------------------------------------


def test_save_every_force_and_step_order(tmp_path):
    state = {"x": jnp.zeros(2)}
    with CheckpointManager(tmp_path, save_every=3, keep=None, async_save=False) as ckpt:
        saved = [s for s in range(1, 8)
                 if ckpt.maybe_save(s, state, config={}, data_state={"s": s})]
        assert saved == [3, 6]
        assert ckpt.maybe_save(7, state, config={}, data_state={"s": 7}, force=True)
        # Same step again (final forced save right after a periodic one): no-op.
        assert not ckpt.maybe_save(7, state, config={}, data_state={}, force=True)
        with pytest.raises(UserError, match="newer step 7"):
            ckpt.maybe_save(6, state, config={}, data_state={}, force=True)
        assert ckpt.all_steps() == [3, 6, 7]
        assert ckpt.restore(6)[2] == {"s": 6}
        with pytest.raises(UserError, match="No checkpoint for step 4"):
            ckpt.restore(4)
        with pytest.raises(TypeError, match="config"):
            ckpt.maybe_save(9, state, config={"bad": object()}, data_state={})


LOSSES = [5.0, 4.0, 3.0, 1.0, 2.5, 2.4, 2.3, 2.2, 2.1, 2.0]  # best at step 4


def test_keeps_last_k_plus_best(tmp_path):
    state = {"x": jnp.zeros(4)}
    with CheckpointManager(tmp_path, save_every=1, keep=2) as ckpt:
        for step, loss in enumerate(LOSSES, start=1):
            ckpt.maybe_save(step, {"x": jnp.full(4, step)}, config={}, data_state={},
                            metrics={"eval_loss": loss, "accuracy": 0.5})
        ckpt.wait()
        assert ckpt.all_steps() == [4, 9, 10]
        assert ckpt.best_step() == 4
        assert ckpt.metrics(4) == {"eval_loss": 1.0, "accuracy": 0.5}
    assert sorted(int(n) for n in os.listdir(tmp_path) if n.isdigit()) == [4, 9, 10]
    with CheckpointManager(tmp_path, read_only=True) as reader:
        np.testing.assert_array_equal(reader.restore(4)[0]["x"], np.full(4, 4.0))
        with pytest.raises(RuntimeError, match="read-only"):
            reader.maybe_save(20, state, config={}, data_state={})

    # Metrics persist across restarts: the best is still known after reopening.
    with CheckpointManager(tmp_path, save_every=1, keep=2) as ckpt:
        assert ckpt.all_steps() == [4, 9, 10]
        ckpt.maybe_save(11, state, config={}, data_state={}, metrics={"eval_loss": 3.0})
        ckpt.maybe_save(12, state, config={}, data_state={})  # no metrics
        ckpt.wait()
        assert ckpt.all_steps() == [4, 11, 12]
        assert ckpt.metrics(12) == {}
        ckpt.maybe_save(13, state, config={}, data_state={}, metrics={"eval_loss": 0.5})
        ckpt.wait()
        assert ckpt.all_steps() == [12, 13]
        assert ckpt.best_step() == 13


def test_keep_best_disabled(tmp_path):
    with CheckpointManager(tmp_path, save_every=1, keep=2, keep_best=False) as ckpt:
        for step, loss in enumerate(LOSSES, start=1):
            ckpt.maybe_save(step, {"x": jnp.zeros(1)}, config={}, data_state={},
                            metrics={"eval_loss": loss})
        ckpt.wait()
        assert ckpt.all_steps() == [9, 10]


def test_custom_best_metric(tmp_path):
    with CheckpointManager(tmp_path, save_every=1, keep=1, best_metric="bleu_neg") as ckpt:
        for step, value in enumerate([-20.0, -30.0, -25.0], start=1):
            ckpt.maybe_save(step, {"x": jnp.zeros(1)}, config={}, data_state={},
                            metrics={"bleu_neg": value, "eval_loss": 100.0 - step})
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]


# ---------------------------------------------------------------------------
# Atomicity: SIGKILL during a save
# ---------------------------------------------------------------------------

# The child saves a good step 1, then starts saving ~64 MB at step 2. To make
# the kill land before the commit every time (and not depend on disk speed),
# the rename that commits step 2 is stalled. The parent kills the child as
# soon as step 2's temporary directory appears (nothing written yet), or once
# array data of step 2 is on disk (other items still in their own temporary
# directories), or once everything incl. the commit marker is written and only
# the final rename is left.
_CHILD = textwrap.dedent(
    """
    import pathlib, sys, time
    import jax.numpy as jnp
    import numpy as np
    from orbax.checkpoint._src.path import async_path
    from transformer_jax.train.checkpoint import CheckpointManager

    directory, flag = sys.argv[1], pathlib.Path(sys.argv[2])
    real_rename = async_path.rename

    async def stalled_rename(src, dst, *args, **kwargs):
        if pathlib.Path(str(dst)).name == "2":
            flag.touch()
            time.sleep(3600)  # stand-in for a very slow disk
        return await real_rename(src, dst, *args, **kwargs)

    async_path.rename = stalled_rename
    ckpt = CheckpointManager(directory, save_every=1, keep=3)
    ckpt.maybe_save(1, {"w": jnp.arange(10, dtype=jnp.float32), "step": jnp.int32(1)},
                    config={"model": "good"}, data_state={"offset": 100})
    ckpt.wait()
    print("READY", flush=True)
    # Random values: orbax compresses, and constant arrays would shrink to KBs.
    noise = np.random.default_rng(0).random((4, 4_000_000), dtype=np.float32)
    big = {"w": jnp.asarray(noise), "step": jnp.int32(2)}
    ckpt.maybe_save(2, big, config={"model": "bad"}, data_state={"offset": 200})
    ckpt.wait()
    print("UNEXPECTED: step 2 committed", flush=True)
    """
)


def _tmp_dirs(directory, step):
    return [n for n in os.listdir(directory) if n.startswith(f"{step}.orbax-checkpoint-tmp")]


def _array_data_written(directory, step):
    """True once some array data of ``step`` is in its temporary directory."""
    for name in _tmp_dirs(directory, step):
        for root, _, files in os.walk(os.path.join(directory, name, "state")):
            if os.path.basename(root) == "d" and files:
                return True
    return False


def _kill_point_reached(kill_when, directory, flag):
    if not directory.exists():
        return False
    if kill_when == "save_started":
        return bool(_tmp_dirs(directory, 2))
    if kill_when == "arrays_written":
        return _array_data_written(directory, 2)
    return flag.exists()  # "before_rename"


@pytest.mark.parametrize("kill_when", ["save_started", "arrays_written", "before_rename"])
def test_sigkill_mid_save_keeps_previous_checkpoint(tmp_path, kill_when):
    directory, flag = tmp_path / "ckpt", tmp_path / "stalled"
    log = open(tmp_path / "child.log", "w+")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory), str(flag)],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not _kill_point_reached(kill_when, directory, flag):
            assert child.poll() is None, f"child exited early:\n{open(log.name).read()}"
            assert time.monotonic() < deadline, f"timeout:\n{open(log.name).read()}"
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        log.close()
    assert child.returncode == -signal.SIGKILL

    # The interrupted save left only a temporary directory behind.
    assert _tmp_dirs(directory, 2), os.listdir(directory)
    assert not (directory / "2").exists()

    # A reader sees step 1 only, despite the leftover, and restores it exactly.
    reader = CheckpointManager(directory, read_only=True)
    assert reader.latest_step() == 1 and reader.all_steps() == [1]
    state, config, data = reader.restore()
    _assert_trees_equal(state, {"w": np.arange(10, dtype=np.float32), "step": np.int32(1)})
    assert config == {"model": "good"} and data == {"offset": 100}
    assert read_config(directory) == {"model": "good"}
    assert _tmp_dirs(directory, 2)  # read-only managers do not clean up
    reader.close()

    # A new writer cleans up the leftover and can save step 2 again.
    with CheckpointManager(directory, save_every=1, keep=3) as ckpt:
        assert ckpt.latest_step() == 1
        new = {"w": jnp.full((3,), 2.0, jnp.bfloat16), "step": jnp.int32(2)}
        assert ckpt.maybe_save(2, new, config={"model": "retry"}, data_state={"offset": 200})
        ckpt.wait()
        assert ckpt.all_steps() == [1, 2]
        state, config, data = ckpt.restore()
    _assert_trees_equal(state, new)
    assert config == {"model": "retry"} and data == {"offset": 200}
    assert not [n for n in os.listdir(directory) if "orbax-checkpoint-tmp" in n]


# ---------------------------------------------------------------------------
# Fallback past unreadable steps
# ---------------------------------------------------------------------------


def _truncate(path, keep=10):
    path.write_bytes(path.read_bytes()[:keep])


def _largest_array_file(step_dir):
    files = [p for p in (step_dir / "state" / "ocdbt.process_0" / "d").iterdir()]
    return max(files, key=lambda p: p.stat().st_size)


# (how to break step 20, what the warning names)
CORRUPTIONS = {
    "array data truncated": (lambda d: _truncate(_largest_array_file(d), 1000),
                             "state/ (the array params.big): Requested byte range"),
    "array data deleted": (lambda d: _largest_array_file(d).unlink(),
                           "state/ (the array params.big)"),
    "state metadata": (lambda d: _truncate(d / "state" / "_METADATA"),
                       "state/_METADATA: not valid JSON"),
    "state metadata deleted": (lambda d: (d / "state" / "_METADATA").unlink(),
                               "state/_METADATA: missing"),
    "array metadata": (lambda d: _truncate(d / "state" / "array_metadatas" / "process_0"),
                       "state/array_metadatas/process_0: not valid JSON"),
    "data-iterator state": (lambda d: _truncate(d / "data" / "metadata"),
                            "data/metadata: not valid JSON"),
    "config": (lambda d: _truncate(d / "config" / "metadata"), "config/metadata: not valid JSON"),
    "config deleted": (lambda d: (d / "config" / "metadata").unlink(), "config/metadata: missing"),
}


def _two_steps(directory):
    """Steps 10 and 20 of a state with one array large enough for its own data file."""
    states = {}
    with CheckpointManager(directory, save_every=10, keep=None) as ckpt:
        for step in (10, 20):
            big = np.random.default_rng(step).normal(size=(64, 64)).astype(np.float32)
            state = {"params": {"big": jnp.asarray(big), "b": jnp.arange(3.0) + step}}
            ckpt.maybe_save(step, state, config={"step": step}, data_state={"offset": step})
            states[step] = state
    return states


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_an_unreadable_latest_step_falls_back_and_is_moved_aside(tmp_path, kind):
    directory = tmp_path / "ckpt"
    states = _two_steps(directory)
    corrupt, named = CORRUPTIONS[kind]
    corrupt(directory / "20")
    warnings = []
    # eval/generate: read-only, nothing moves
    with CheckpointManager(directory, read_only=True) as reader:
        step, state, config, data = reader.restore_readable(warn=warnings.append)
    assert (step, config, data) == (10, {"step": 10}, {"offset": 10})
    _assert_trees_equal(state, states[10])
    assert sorted(p.name for p in directory.iterdir()) == ["10", "20"]
    # a resumed run: the bad step moves to 20.corrupt
    with CheckpointManager(directory, read_only=True) as reader:
        step, *_ = reader.restore_readable(warn=warnings.append, set_aside=True)
        assert step == 10 and reader.all_steps() == [10]
    assert sorted(p.name for p in directory.iterdir()) == ["10", "20.corrupt"]
    prefix = f"checkpoint step 20 in {directory} is unreadable: "
    assert warnings[0].startswith(prefix + named) and warnings[0].endswith("; restoring step 10 instead")
    assert warnings[1].startswith(prefix + named)
    assert warnings[1].endswith(f"; moved it to {directory}/20.corrupt; restoring step 10 instead")
    # a writer resumes from 10 and saves 20 again beside the kept 20.corrupt
    with CheckpointManager(directory, save_every=10) as ckpt:
        assert ckpt.latest_step() == 10
        assert ckpt.maybe_save(20, states[20], config={"step": 20}, data_state={"offset": 20})
    assert sorted(p.name for p in directory.iterdir()) == ["10", "20", "20.corrupt"]


def test_an_explicit_unreadable_step_and_no_readable_step_are_one_error(tmp_path):
    directory = tmp_path / "ckpt"
    _two_steps(directory)
    _truncate(directory / "20" / "data" / "metadata")
    with CheckpointManager(directory, read_only=True) as reader:
        with pytest.raises(UserError, match=r"checkpoint step 20 in .* is unreadable: step 20 "
                           r"\(data/metadata: not valid JSON .*\); pick another step \(10, 20\)"):
            reader.restore_readable(20)
    _truncate(directory / "10" / "config" / "metadata")
    warnings = []
    with CheckpointManager(directory, read_only=True) as reader:
        with pytest.raises(UserError, match=r"no checkpoint in .* reads: step 20 \(data/metadata: "
                           r"not valid JSON .*\); step 10 \(config/metadata: not valid JSON .*\)"):
            reader.restore_readable(warn=warnings.append)
    assert len(warnings) == 2
    assert warnings[1].endswith("config/metadata: not valid JSON (Expecting ',' delimiter: line 1 "
                                "column 11 (char 10))")


def test_a_state_that_does_not_fit_the_target_is_refused_not_moved(tmp_path):
    directory = tmp_path / "ckpt"
    _two_steps(directory)
    target = {"params": {"big": jnp.zeros((64, 64)), "b": jnp.zeros(3), "extra": jnp.zeros(2)}}
    with CheckpointManager(directory, read_only=True) as reader:
        with pytest.raises(UserError, match="the train state in checkpoint step 20 of .* does not "
                           "fit this run's model and optimizer"):
            reader.restore_readable(target=target, set_aside=True)
    assert sorted(p.name for p in directory.iterdir()) == ["10", "20"]


def test_check_config_refuses_before_the_state_is_read(tmp_path):
    directory = tmp_path / "ckpt"
    _two_steps(directory)
    _truncate(_largest_array_file(directory / "20"), 1000)   # would fall back if it were read

    def check(config):
        raise UserError(f"config of step {config['step']} does not match")

    with CheckpointManager(directory, read_only=True) as reader:
        with pytest.raises(UserError, match="config of step 20 does not match"):
            reader.restore_readable(check_config=check, set_aside=True)
    assert sorted(p.name for p in directory.iterdir()) == ["10", "20"]
