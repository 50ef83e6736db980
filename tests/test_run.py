"""The training stack end to end: steps, accumulation, resume, interruption, clear errors."""
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.cli import main as cli_main
from transformer_jax.models import GPT, GPTConfig
from transformer_jax.train.config import ExperimentConfig, apply_overrides, load_experiment
from transformer_jax.train.loop import NonFiniteLossError
from transformer_jax.workdir import load_run
from transformer_jax.run import train
from transformer_jax.train.monitor import read_metrics
from transformer_jax.train.optim import constant, make_optimizer
from transformer_jax.train.step import create_train_state, make_train_step

from .helpers import TINY_RUN, tiny_cfg


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(workdir) if "loss" in r}


def cli(args, **kw):
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "transformer_jax.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, **kw)


def cli_args(workdir, data_dir, steps, *extra):
    sets = [x for s in TINY_RUN + [f"data_dir={data_dir}"] for x in ("--set", s)]
    return ["train", "--workdir", str(workdir), "--steps", str(steps), "--no-progress", *sets, *extra]


# --------------------------------------------------------------------------- in process

@pytest.mark.colab
def test_default_run_learns_and_writes_everything(tmp_path, data_dir):
    cfg = tiny_cfg(data_dir, steps=30, learning_rate=1e-2)
    summary = train(cfg, tmp_path, progress=False)
    ls = losses(tmp_path)
    assert sorted(ls) == list(range(1, 31))
    assert ls[1] > 5.0                       # ~ln(259) at init
    assert np.mean([ls[s] for s in range(26, 31)]) < ls[1] - 1.5
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows if "eval_loss" in r] == [5, 10, 15, 20, 25, 30]
    assert summary["final_step"] == 30 and summary["eval_loss"] < 4.5
    for name in ("config.json", "loss.png", "samples.txt", "metrics.jsonl"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "samples.txt").read_text().count("=== step") == 6
    # the workdir alone rebuilds the model
    run_config, model, params, task = load_run(tmp_path)
    assert run_config["model"]["d_model"] == 32 and task.tokenizer.vocab_size == 259
    assert model.config.vocab_size == 259
    # the attention path "auto" resolved to, for this run's platform
    assert run_config["attention"] == {"attention_impl": "auto", "platform": "cpu",
                                       "train": "xla", "eval": "xla",
                                       "why": "no kernels here; the exact reference up to "
                                              "4096 x 4096 logits"}


def test_gradient_accumulation_equals_full_batch():
    model = GPT(GPTConfig.preset("tiny", dropout_rate=0.0, attention_dropout_rate=0.0))
    tx = optax.sgd(0.5)   # linear in the gradient, so parameters compare the gradients exactly
    rng = jax.random.PRNGKey(0)
    ids = jax.random.randint(rng, (8, 17), 0, 512)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:],
             "weights": jnp.ones((8, 16)).at[5, 10:].set(0.0)}
    s0 = create_train_state(model, tx, rng, batch["inputs"])
    full, m_full = jax.jit(make_train_step(accum_steps=1))(s0, batch)
    acc, m_acc = jax.jit(make_train_step(accum_steps=4))(s0, batch)
    np.testing.assert_allclose(m_acc["loss"], m_full["loss"], rtol=1e-6)
    np.testing.assert_allclose(m_acc["grad_norm"], m_full["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(acc.params), jax.tree_util.tree_leaves(full.params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_label_smoothing_changes_objective_not_nll():
    model = GPT(GPTConfig.preset("tiny"))
    tx = make_optimizer(schedule=constant(1e-3))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 9), 0, 512)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": jnp.ones((2, 8))}
    s0 = create_train_state(model, tx, jax.random.PRNGKey(0), batch["inputs"])
    _, plain = jax.jit(make_train_step())(s0, batch)
    _, smooth = jax.jit(make_train_step(label_smoothing=0.1))(s0, batch)
    np.testing.assert_allclose(smooth["nll"], plain["nll"], rtol=1e-6)   # same dropout key
    assert abs(float(smooth["loss"]) - float(plain["loss"])) > 1e-4


def test_non_finite_loss_stops_and_names_what_to_do(tmp_path, data_dir):
    cfg = tiny_cfg(data_dir, steps=60, learning_rate=1e30, clip_norm=None, eval_every=100)
    with pytest.raises(NonFiniteLossError) as stop:
        train(cfg, tmp_path, progress=False)
    # warmup: step 1's learning rate is 0, the first real update (step 2) gives NaN at step 3,
    # so no checkpoint is from before the blow-up: the message says so, and how to start again
    assert str(stop.value) == (
        "loss became nan at step 3; the run stopped without saving this state; no checkpoint "
        "from before the blow-up exists; lower learning_rate (or clip_norm) and start again: "
        "the same --workdir works, without --resume.")
    from transformer_jax.train.checkpoint import CheckpointManager
    mgr = CheckpointManager(tmp_path / "checkpoints", read_only=True)
    steps = mgr.all_steps()
    bad_step = max(losses(tmp_path), default=0) + 1
    assert all(s < bad_step for s in steps)
    if steps:   # whatever was saved is finite
        state, _, _ = mgr.restore()
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state["params"]))
    mgr.close()


def test_overrides_merge_into_model_and_task_dicts():
    cfg = ExperimentConfig(model_overrides={"num_layers": 4, "d_model": 128})
    got = apply_overrides(cfg, ["model.num_heads=2", "model_overrides={'num_layers': 2}",
                                "task_options={'beam_size': 4}", "task.length_penalty=0.6",
                                "learning_rate=1e-3"])
    assert got.model_overrides == {"num_layers": 2, "d_model": 128, "num_heads": 2}
    assert got.task_options == {"beam_size": 4, "length_penalty": 0.6}
    assert got.learning_rate == 1e-3 and cfg.model_overrides == {"num_layers": 4, "d_model": 128}
    with pytest.raises(ValueError, match="model_overrides must be a dict"):
        apply_overrides(cfg, ["model_overrides=3"])


def test_clear_errors(tmp_path, data_dir, capsys):
    def run(*args):
        code = cli_main(list(args))
        return code, capsys.readouterr().err
    code, err = run("train", "--experiment", "no_such_experiment", "--workdir", str(tmp_path / "a"))
    assert code == 2 and "unknown experiment 'no_such_experiment'" in err and "stdlib_gpt" in err
    code, err = run("train", "--set", "learnig_rate=1", "--workdir", str(tmp_path / "a"))
    assert code == 2 and "unknown config field 'learnig_rate'" in err and "learning_rate" in err
    code, err = run("train", "--set", "model.num_layer=1", "--workdir", str(tmp_path / "a"))
    assert code == 2 and "num_layer" in err and "did you mean 'num_layers'" in err
    code, err = run(*cli_args(tmp_path / "b", data_dir, 5, "--set", "seq_len=100"))
    assert code == 2 and "seq_len=100 exceeds the model's max_len=64" in err
    code, err = run("eval", "--workdir", str(tmp_path / "nothing"))
    assert code == 2 and "no checkpoints" in err
    # a finished run, then a resume with another model, and a fresh run into a used workdir
    assert run(*cli_args(tmp_path / "c", data_dir, 5))[0] == 0
    code, err = run(*cli_args(tmp_path / "c", data_dir, 10, "--resume", "--set", "model.d_model=64"))
    assert code == 2 and "does not match the config" in err and "d_model" in err
    code, err = run(*cli_args(tmp_path / "c", data_dir, 10))
    assert code == 2 and "already holds checkpoints" in err and "--resume" in err
    # eval and generate rebuild the model from the workdir alone
    assert run("eval", "--workdir", str(tmp_path / "c"), "--batches", "1")[0] == 0
    code = cli_main(["generate", "--workdir", str(tmp_path / "c"), "--prompt", "import ",
                     "--max-new-tokens", "5"])
    assert code == 0 and capsys.readouterr().out.startswith("import ")


def test_empty_dataset_is_a_clear_error(tmp_path, capsys):
    import tensorflow_datasets as tfds
    with tfds.testing.mock_data(num_examples=0):
        code = cli_main(cli_args(tmp_path, tmp_path / "tfds", 3, "--set", "dataset=lm1b"))
    err = capsys.readouterr().err
    assert code == 2 and "lm1b" in err and "empty" in err.lower()


def test_lm1b_by_name_under_mock_data(tmp_path):
    import tensorflow_datasets as tfds
    cfg = tiny_cfg(tmp_path / "tfds", dataset="lm1b", eval_split="test", steps=3, eval_every=3)
    with tfds.testing.mock_data(num_examples=64):
        summary = train(cfg, tmp_path / "run", progress=False)
    assert summary["final_step"] == 3 and np.isfinite(summary["eval_loss"])


def test_experiment_files_load():
    assert load_experiment("stdlib_gpt") == ExperimentConfig()
    big = load_experiment("gpt2_124m_lm1b")
    assert big.model_preset == "gpt2" and big.dataset == "lm1b"


# --------------------------------------------------------------------------- subprocesses

@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
    """``reference(final)``: the losses of steps 1..final of one uninterrupted CLI run, shared
    by the interrupted runs (a step's loss does not depend on the run's total --steps, as
    the interrupted runs' own 400 shows). Trained once to 48 steps, in a subprocess as the
    runs it is compared with (the same process settings, so the same numbers to the bit);
    retrained longer only if a run stopped unusually late."""
    longest: dict[int, float] = {}      # step -> loss of the longest reference run so far

    def losses_to(final):
        if max(longest, default=0) < final:
            steps = max(final, 48)
            ref_dir = tmp_path_factory.mktemp("reference") / "run"
            out, _ = cli(cli_args(ref_dir, data_dir, steps)).communicate(timeout=300)
            got = losses(ref_dir)
            assert sorted(got) == list(range(1, steps + 1)), out
            longest.clear()
            longest.update(got)
        return {s: loss for s, loss in longest.items() if s <= final}
    return losses_to


def _wait_for_rows(workdir, n, proc, timeout=120):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if len(losses(workdir)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()}")
        time.sleep(0.05)
    raise AssertionError("run made no progress")


@pytest.mark.slow
def test_sigterm_then_kill9_then_resume_matches_uninterrupted(tmp_path, data_dir, reference):
    """One run stopped twice: SIGTERM (exit 143, a ``--resume`` hint), resumed; then
    ``kill -9`` wherever it is (mid-step, mid-log or mid-save; tests/test_checkpoint.py pins
    the mid-save case), which loses nothing before the last periodic checkpoint; resumed
    again: the losses of every step are those of an uninterrupted run, to the bit. (One run
    for both stops: three processes instead of the four of two runs.)"""
    run_dir = tmp_path / "interrupted"
    proc = cli(cli_args(run_dir, data_dir, 400))
    _wait_for_rows(run_dir, 6, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, out
    assert "stopped by SIGTERM" in out and "--resume" in out
    stopped = max(losses(run_dir))
    assert stopped < 400

    proc = cli(cli_args(run_dir, data_dir, 400, "--resume"))
    _wait_for_rows(run_dir, stopped + 13, proc)     # two periodic checkpoints (every 5) past it
    proc.kill()
    proc.communicate(timeout=60)
    killed_at = max(losses(run_dir))
    from transformer_jax.train.checkpoint import CheckpointManager
    mgr = CheckpointManager(run_dir / "checkpoints", read_only=True)
    last = mgr.latest_step()
    mgr.close()
    assert last is not None and last % 5 == 0 and stopped < last <= killed_at

    final = last + 6
    resumed = cli(cli_args(run_dir, data_dir, final, "--resume"))
    out, _ = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, out
    got, want = losses(run_dir), reference(final)
    assert sorted(got) == sorted(want) == list(range(1, final + 1))
    np.testing.assert_array_equal([got[s] for s in range(1, final + 1)],
                                  [want[s] for s in range(1, final + 1)])


def test_mixed_precision_step_keeps_fp32_params_and_optimizer():
    cfg = GPTConfig.preset("tiny", dtype="bfloat16", dropout_rate=0.0, attention_dropout_rate=0.0)
    model32 = GPT(cfg.replace(dtype="float32"))
    tx = make_optimizer(schedule=constant(1e-3))
    ids = jax.random.randint(jax.random.PRNGKey(2), (4, 33), 0, 512)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": jnp.ones((4, 32))}
    s_bf = create_train_state(GPT(cfg), tx, jax.random.PRNGKey(0), batch["inputs"])
    s_32 = create_train_state(model32, tx, jax.random.PRNGKey(0), batch["inputs"])
    new_bf, m_bf = jax.jit(make_train_step())(s_bf, batch)
    _, m_32 = jax.jit(make_train_step())(s_32, batch)
    dtypes = {x.dtype for x in jax.tree_util.tree_leaves((new_bf.params, new_bf.opt_state))
              if jnp.issubdtype(x.dtype, jnp.floating)}
    assert dtypes == {jnp.dtype("float32")}
    # bf16 compute changes the loss only at bf16 resolution (documented tolerance 2e-2)
    assert abs(float(m_bf["loss"]) - float(m_32["loss"])) < 2e-2


def test_sentencepiece_tokenizer_is_trained_into_the_workdir(tmp_path, data_dir):
    # the corpus's first documents up to ~200k characters, in memory: SentencePiece trains
    # in about a second on them (on the whole 4 MB corpus it takes most of a minute)
    from transformer_jax.data import load_texts
    docs, size = [], 0
    for doc in load_texts("python_stdlib", "train", data_dir=data_dir):
        if size >= 200_000:
            break
        docs.append(doc)
        size += len(doc)
    cfg = tiny_cfg(data_dir, tokenizer="sentencepiece", sentencepiece_vocab_size=400, steps=3,
                   eval_every=3).replace(dataset=docs)
    summary = train(cfg, tmp_path, progress=False)
    assert (tmp_path / "spm.model").exists() and np.isfinite(summary["eval_loss"])
    run_config, model, _, task = load_run(tmp_path)
    tok = task.tokenizer
    assert run_config["task_spec"]["tokenizer"] == f"sentencepiece:{(tmp_path / 'spm.model').resolve()}"
    assert model.config.vocab_size == tok.vocab_size <= 400
    assert tok.decode(tok.encode("def main():\n    return 0")) == "def main():\n    return 0"


# a 4 x 32 eval batch of a 1-layer model in fp32: the kernels' blockwise softmax and the
# reference's whole-row one may differ in the last bits of the per-token losses (measured
# 2026-12-07 on this CPU: equal, for both kernels)
KERNEL_EVAL_ATOL = 1e-5


@pytest.mark.parametrize("impl", ["splash", "pallas"])
def test_a_forced_kernel_trains_evaluates_samples_and_saves(tmp_path, data_dir, capsys, impl):
    """``model.attention_impl=splash`` (``pallas``) on the CPU (interpret mode): the run
    trains and evaluates with the kernel, samples at eval through the KV cache by the decode
    path's own implementation (one line says so, once) and saves its checkpoint; its eval
    loss is the reference's on the same params."""
    from transformer_jax.train.loop import evaluate

    cfg = tiny_cfg(data_dir, steps=2, eval_every=2, save_every=2, eval_batches=1,
                   sample_tokens=4, **{"model.attention_impl": impl})
    summary = train(cfg, tmp_path, progress=False)
    lines = capsys.readouterr().out.splitlines()
    notice = (f"attention: {impl} for training and the eval loss; KV-cache sampling (samples "
              "at eval, generate) takes the decode path's own: auto -> xla (one query row a "
              "step)")
    assert lines.count(notice) == 1 and f"attention: {impl} -> {impl} (cpu)" in lines
    assert summary["final_step"] == 2 and (tmp_path / "checkpoints" / "2").is_dir()
    assert (tmp_path / "samples.txt").read_text().startswith(
        f"=== step 2 (eval loss {summary['eval_loss']:.3f})\n")
    run_config, model, params, task = load_run(tmp_path)
    assert (run_config["attention"]["train"], run_config["attention"]["eval"]) == (impl, impl)
    reference = model.clone(config=model.config.replace(attention_impl="xla"))
    loss = evaluate(params, reference.apply, task, model=reference)["eval_loss"]
    assert abs(loss - summary["eval_loss"]) <= KERNEL_EVAL_ATOL
