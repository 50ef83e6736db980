"""Float16 with dynamic loss scaling: the scale's rule, a skipped overflowing step (nothing
changes but the scale), recovery and learning, checkpoint/resume of the scale, the jit and
pmap placements on 4 devices, and the default experiment in float16 against float32."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.errors import UserError
from transformer_jax.models import GPT, GPTConfig
from transformer_jax.train.checkpoint import CheckpointManager
from transformer_jax.train.config import ExperimentConfig, apply_overrides, load_experiment
from transformer_jax.run import train
from transformer_jax.train.monitor import read_metrics
from transformer_jax.train.optim import constant, make_optimizer
from transformer_jax.train.step import LossScale, create_train_state, make_train_step

HERE = Path(__file__).resolve().parent
TINY16 = [
    "model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.max_len=64",
    "model.dtype=float16", "seq_len=32", "batch_size=4", "schedule=constant",
    "learning_rate=3e-3", "warmup_steps=2", "log_every=1", "eval_every=100", "save_every=100",
    "eval_batches=2", "sample_tokens=0",
]


def rows(workdir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(workdir) if "loss" in r}


def leaves_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a),
                                                   jax.tree_util.tree_leaves(b)))


# --------------------------------------------------------------------------- the rule

def test_loss_scale_halves_on_overflow_and_doubles_after_a_run_of_good_steps():
    s = LossScale.create(8.0, growth_interval=3)
    seen = []
    for finite in (True, True, True, True, False, False, True):
        s = s.update(jnp.asarray(finite))
        seen.append((float(s.scale), int(s.good_steps)))
    assert seen == [(8.0, 1), (8.0, 2), (16.0, 0), (16.0, 1), (8.0, 0), (4.0, 0), (4.0, 1)]
    tiny = LossScale.create(2.0 ** -14).update(jnp.asarray(False))
    assert float(tiny.scale) == 2.0 ** -14            # never below min_scale


def test_auto_scales_float16_only_and_dynamic_none_override():
    cfg = ExperimentConfig()
    assert cfg.dynamic_loss_scale("float16") and not cfg.dynamic_loss_scale("bfloat16")
    assert not cfg.dynamic_loss_scale("float32")
    assert cfg.replace(loss_scale="dynamic").dynamic_loss_scale("float32")
    assert not cfg.replace(loss_scale="none").dynamic_loss_scale("float16")
    with pytest.raises(UserError, match="loss_scale_init=0"):
        cfg.replace(loss_scale_init=0)


# --------------------------------------------------------------------------- the step

def test_an_overflowing_step_is_skipped_and_training_recovers_and_learns():
    """Scale 2**40: the float16 backward overflows. The step keeps params and optimizer
    state bit for bit, reports skipped=1, halves the scale, and still counts the step. Each
    following step halves it again until the gradients fit; from there the run learns (one
    fixed batch: the loss falls by more than 1 nat)."""
    model = GPT(GPTConfig.preset("tiny", num_layers=1, d_model=64, num_heads=4, max_len=32,
                                 dtype="float16", dropout_rate=0.0, attention_dropout_rate=0.0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, 512)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": jnp.ones((4, 16))}
    tx = make_optimizer(schedule=constant(3e-3))
    state = create_train_state(model, tx, jax.random.PRNGKey(0), batch["inputs"],
                               loss_scale=LossScale.create(2.0 ** 40))
    before = jax.device_get(state)
    step = jax.jit(make_train_step())
    state, m = step(state, batch)
    assert float(m["skipped"]) == 1.0 and float(m["loss_scale"]) == 2.0 ** 40
    assert not np.isfinite(float(m["grad_norm"])) and np.isfinite(float(m["loss"]))
    assert leaves_equal(state.params, before.params)
    assert leaves_equal(state.opt_state, before.opt_state)
    assert float(state.loss_scale.scale) == 2.0 ** 39 and int(state.step) == 1
    history = [(float(m["skipped"]), float(m["loss_scale"]), float(m["loss"]))]
    for _ in range(45):
        state, m = step(state, batch)
        history.append((float(m["skipped"]), float(m["loss_scale"]), float(m["loss"])))
    skipped = [h[0] for h in history]
    first_good = skipped.index(0.0)
    assert skipped[:first_good] == [1.0] * first_good and 10 <= first_good <= 30
    assert [h[1] for h in history[:first_good + 1]] == [2.0 ** (40 - i) for i in range(first_good + 1)]
    assert sum(skipped[first_good:]) == 0
    assert history[-1][2] < history[first_good][2] - 1.0


# --------------------------------------------------------------------------- the loop

def test_checkpoint_and_resume_keep_the_scale(tmp_path, data_dir):
    """float16 turns scaling on by itself (loss_scale="auto"). Start at 2**20 with growth
    after 3 good steps, so the scale moves during the run; pause at step 7, resume to 12:
    the checkpoint holds the scale and its counter, and losses, scales and skips equal the
    uninterrupted run's."""
    cfg = apply_overrides(ExperimentConfig(), TINY16 + [
        f"data_dir={data_dir}", "steps=12", "loss_scale_init=1048576", "loss_scale_growth_interval=3"])
    train(cfg, tmp_path / "run", progress=False, stop_at=7)
    with CheckpointManager(tmp_path / "run" / "checkpoints", read_only=True) as mgr:
        saved, run_config, _ = mgr.restore(7)
    assert run_config["loss_scaling"] is True and set(saved["loss_scale"]) == {"scale", "good_steps"}
    train(cfg, tmp_path / "run", resume=True, progress=False)
    train(cfg, tmp_path / "reference", progress=False)
    got, want = rows(tmp_path / "run"), rows(tmp_path / "reference")
    assert sorted(got) == sorted(want) == list(range(1, 13))
    for key in ("loss", "loss_scale", "skipped", "grad_norm"):
        np.testing.assert_array_equal([got[s][key] for s in got], [want[s][key] for s in got], key)
    scales = [want[s]["loss_scale"] for s in sorted(want)]
    assert len(set(scales)) > 1 and scales[0] == 2.0 ** 20            # the scale did move
    assert float(saved["loss_scale"]["scale"]) == got[8]["loss_scale"]  # step 8 used the saved scale
    assert int(saved["loss_scale"]["good_steps"]) in (0, 1, 2)


def test_resuming_with_another_loss_scaling_is_a_clear_error(tmp_path, data_dir):
    cfg = apply_overrides(ExperimentConfig(), TINY16 + [f"data_dir={data_dir}", "steps=2"])
    train(cfg, tmp_path, progress=False)
    with pytest.raises(UserError, match=r"loss scaling: checkpoint has, config does not \(loss_scale\)"):
        train(cfg.replace(steps=3, loss_scale="none"), tmp_path, resume=True, progress=False)


# --------------------------------------------------------------------------- devices

def test_jit_and_pmap_on_four_devices_skip_together_and_match_one_device():
    """tests/train/loss_scale_worker.py on 4 simulated devices (data=4 jit, pmap), float16,
    plain SGD: at scale 2**40 both skip, keep the initial parameters bit for bit (pmap: on
    every device) and halve the scale; at 2**10 two ordinary steps agree with one device to
    float16's resolution (updates within 1e-2 of the largest, measured up to 4e-3; losses
    within 1e-5, measured up to 2.4e-6)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip())
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(HERE / "loss_scale_worker.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4
    for name in ("jit data=4", "pmap"):
        (skip,) = out[f"{name} scale 2**40"]
        assert skip["skipped"] == 1.0 and skip["params_equal_init"] and skip["replicas_agree"]
        assert skip["opt_state_equal_reference"] and skip["update_rel"] == 0.0
        assert (skip["loss_scale_used"], skip["scale_after"]) == (2.0 ** 40, 2.0 ** 39)
        for i, row in enumerate(out[f"{name} scale 2**10"]):
            assert row["skipped"] == 0.0 and row["replicas_agree"] and not row["params_equal_init"]
            assert row["scale_after"] == 2.0 ** 10 and row["good_steps"] == i + 1
            assert row["update_rel"] < 1e-2 and row["loss_rel"] < 1e-5, (name, i, row)


# --------------------------------------------------------------------------- float16 vs float32

@pytest.mark.slow
def test_default_experiment_in_float16_tracks_float32(tmp_path, data_dir):
    """experiments/stdlib_gpt.py cut down to one layer and 16-row batches (its width, heads,
    context, optimiser and schedule as they are: warmup to step 50), paused at step 10, once
    as it is and once with --set model.dtype=float16 (scaling on by itself). No step is
    skipped at the default initial scale; the training losses agree within 1e-3 nats at
    every step (measured: at most 1.7e-4) and the eval loss at step 10 within 1e-3
    (measured: 1.8e-5), while both fall by more than 0.5 nats (measured: 0.72)."""
    base = apply_overrides(load_experiment("stdlib_gpt"), [
        f"data_dir={data_dir}", "model.num_layers=1", "batch_size=16", "log_every=1",
        "eval_every=10", "eval_batches=4", "sample_tokens=0"])
    f32 = train(base, tmp_path / "f32", progress=False, stop_at=10)
    f16 = train(apply_overrides(base, ["model.dtype=float16"]), tmp_path / "f16", progress=False,
                stop_at=10)
    a, b = rows(tmp_path / "f32"), rows(tmp_path / "f16")
    assert sorted(a) == sorted(b) == list(range(1, 11))
    assert all(b[s]["skipped"] == 0.0 and b[s]["loss_scale"] == 2.0 ** 15 for s in b)
    assert "loss_scale" not in a[1]
    diffs = [abs(a[s]["loss"] - b[s]["loss"]) for s in a]
    assert max(diffs) < 1e-3, diffs
    assert a[10]["loss"] < a[1]["loss"] - 0.5 and b[10]["loss"] < b[1]["loss"] - 0.5   # both learned
    assert abs(f32["eval_loss"] - f16["eval_loss"]) < 1e-3
