"""The speed-related pieces: argmax, the gather-free cross-entropy, one compilation per train
step with donated state, the host allocator tuning, the benchmark timing helper, and the GPU
check script in smoke mode.

No timings are asserted here (they depend on the machine); ``python -m benchmarks`` measures.
"""
import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import host_memory
from transformer_jax.decode import argmax
from transformer_jax.models import GPT, GPTConfig
from transformer_jax.losses import label_smoothed_cross_entropy
from transformer_jax.train.optim import constant, make_optimizer
from transformer_jax.train.step import create_train_state, make_train_step


def test_argmax_equals_jnp_argmax_with_ties_nan_and_inf():
    x = np.array(jax.random.normal(jax.random.PRNGKey(0), (6, 50)))
    x[0, [3, 7, 9]] = 5.0                  # ties: the first index wins
    x[1, [4, 8]] = np.nan                  # NaN counts as the maximum, first one wins
    x[2] = -np.inf                         # all equal
    x[3, 0] = np.inf
    x[4, -1] = 9.0
    got = np.asarray(jax.jit(argmax)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
    np.testing.assert_array_equal(got[:5], [3, 4, 0, 0, 49])
    ints = jnp.array([[1, 3, 3], [0, 0, 0], [-2, -1, -5]])
    np.testing.assert_array_equal(argmax(ints), [1, 0, 1])
    assert argmax(ints).dtype == jnp.int32


def _reference_ce(logits, targets, weights, smoothing):
    """The textbook form: log-softmax, gather the target, mean of -log p for smoothing."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    per = (1 - smoothing) * nll + smoothing * -jnp.mean(logp, axis=-1)
    return jnp.sum(jnp.where(weights != 0, per * weights, 0.0))


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_value_and_gradient_match_log_softmax_gather(smoothing):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    logits = 3.0 * jax.random.normal(k1, (4, 7, 33))
    targets = jax.random.randint(k2, (4, 7), 0, 33)
    weights = (jax.random.uniform(k3, (4, 7)) > 0.3).astype(jnp.float32)
    ours = jax.value_and_grad(lambda l: label_smoothed_cross_entropy(l, targets, weights, smoothing)[0])
    ref = jax.value_and_grad(lambda l: _reference_ce(l, targets, weights, smoothing))
    (v1, g1), (v2, g2) = ours(logits), ref(logits)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    np.testing.assert_allclose(g1, g2, rtol=1e-5, atol=1e-7)


def test_cross_entropy_ignores_minus_inf_logits_off_target():
    logits = jnp.array([[0.0, -jnp.inf, 1.0], [2.0, 0.5, -jnp.inf]])
    targets = jnp.array([2, 0])
    loss, weight = label_smoothed_cross_entropy(logits, targets)
    want = -(1.0 - np.log(1 + np.e)) - (2.0 - np.log(np.exp(2.0) + np.exp(0.5)))
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert float(weight) == 2.0
    grad = jax.grad(lambda l: label_smoothed_cross_entropy(l, targets)[0])(logits)
    assert np.all(np.isfinite(grad))


def test_train_step_compiles_once_and_consumes_the_donated_state():
    cfg = GPTConfig.preset("tiny", dropout_rate=0.0, attention_dropout_rate=0.0)
    ids = jax.random.randint(jax.random.PRNGKey(0), (2, 17), 0, cfg.vocab_size)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": jnp.ones((2, 16))}
    state = create_train_state(GPT(cfg), make_optimizer(schedule=constant(1e-3)),
                               jax.random.PRNGKey(1), batch["inputs"])
    step = jax.jit(make_train_step(), donate_argnums=(0,))
    first_leaf = jax.tree_util.tree_leaves(state.params)[0]
    for _ in range(3):
        state, metrics = step(state, batch)
    assert step._cache_size() == 1            # the initial state has the signature of later ones
    assert first_leaf.is_deleted()            # donation took effect
    assert int(state.step) == 3 and np.isfinite(float(metrics["loss"]))


def test_tune_malloc_applies_in_a_fresh_process_and_jax_still_computes():
    code = ("from transformer_jax.host_memory import tune_malloc, _glibc\n"
            "import jax.numpy as jnp\n"
            "ok = tune_malloc()\n"
            "x = jnp.arange(2**22, dtype=jnp.float32)\n"     # 16 MiB buffers: heap, not mmap
            "print(ok == (_glibc() is not None), float((x * 2).sum() / 2 - x.sum()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "0.0"]


def test_tune_malloc_after_jax_started_is_a_noop_with_a_warning(monkeypatch):
    monkeypatch.setattr(host_memory, "_tuned", False)
    jnp.ones(2).block_until_ready()           # backends exist now
    if host_memory._glibc() is None:
        pytest.skip("not Linux/glibc")
    with pytest.warns(RuntimeWarning, match="after JAX created its backends"):
        assert host_memory.tune_malloc() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert host_memory.tune_malloc_if_cpu() is False     # the CLI path: silent


def test_cpu_only_host_follows_jax_platforms_and_the_off_switch(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert not host_memory.cpu_only_host()
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert host_memory.cpu_only_host()
    monkeypatch.setenv(host_memory.ENV_VAR, "0")
    monkeypatch.setattr(host_memory, "tune_malloc", lambda **kw: pytest.fail("must not be called"))
    assert host_memory.tune_malloc_if_cpu() is False


def _benchmarks(module: str):
    """``benchmarks.<module>`` from this checkout (the suite is not an installed package)."""
    import importlib
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"benchmarks.{module}")


def test_benchmark_alternate_rotates_the_order_and_times_every_round():
    alternate = _benchmarks("common").alternate

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = alternate(fns, rounds=3, warmup=1, settle_s=0)
    assert calls == ["a", "b", "c",                       # warm-up
                     "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}


def test_benchmark_alternate_pauses_before_every_timed_call(monkeypatch):
    """The pause (for the peer's spinning worker threads) comes before each timed call,
    not before warm-ups, and is not part of the call's time."""
    common = _benchmarks("common")
    calls, clock = [], [0.0]
    monkeypatch.setattr(common.time, "sleep", lambda s: calls.append(("sleep", s)))
    monkeypatch.setattr(common.time, "perf_counter", lambda: clock[0])

    def call(name):
        calls.append(name)
        clock[0] += {"a": 1.0, "b": 2.0}[name]
    times = common.alternate({"a": lambda: call("a"), "b": lambda: call("b")}, rounds=2,
                             warmup=1, settle_s=0.25)
    assert calls == ["a", "b", ("sleep", 0.25), "a", ("sleep", 0.25), "b",
                     ("sleep", 0.25), "b", ("sleep", 0.25), "a"]
    assert times == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    assert common.SETTLE_S > 0


def test_benchmark_round_ratios_pair_the_calls_of_each_round():
    """Each round's peer/ours ratio, then their median and quartiles: a run in which the
    machine slows down halfway keeps ratios that its medians would blur."""
    round_ratios = _benchmarks("common").round_ratios
    ours = [1.0, 1.0, 2.0, 2.0, 2.0]                   # the machine halves its speed
    peer = [1.2, 1.1, 2.4, 2.6, 2.2]
    got = round_ratios(peer, ours)
    np.testing.assert_allclose(got["ratios"], [1.2, 1.1, 1.2, 1.3, 1.1])
    np.testing.assert_allclose([got["q1"], got["median"], got["q3"]], [1.1, 1.2, 1.2])
    # the ratio of the medians would say 2.2 / 2.0 = 1.1
    assert round_ratios([3.0], [2.0]) == {"ratios": [1.5], "median": 1.5, "q1": 1.5, "q3": 1.5}
    with pytest.raises(ValueError, match="one time per round on each side, got 2 and 3"):
        round_ratios([1.0, 1.0], [1.0, 1.0, 1.0])


def test_memory_bandwidth_roofline_is_the_faster_of_a_copy_and_a_read():
    bw = _benchmarks("common").measure_memory_bandwidth(mib=8, repeats=2)
    assert set(bw) == {"copy", "read", "roofline"}
    assert bw["roofline"] == max(bw["copy"], bw["read"])
    # any machine this runs on streams 8 MiB at more than 100 MB/s and less than 10 TB/s
    assert all(1e8 < bw[k] < 1e13 for k in ("copy", "read")), bw


def test_matmul_floor_reads_every_dot_of_a_compiled_program():
    """The dots of the optimised HLO, fused or not: forms, shapes, counts and FLOPs."""
    mf = _benchmarks("matmul_floor")
    a, b, c, d = jnp.ones((8, 16)), jnp.ones((16, 12)), jnp.ones((3, 5, 4)), jnp.ones((3, 6, 4))
    f = jax.jit(lambda a, b, c, d: (a @ b, jnp.tanh(a) @ b, jnp.einsum("bik,bjk->bij", c, d),
                                    a.T @ jnp.ones((8, 12))))
    dots = mf.compiled_dots(f, a, b, c, d)
    nn_, bt, tn = (mf.Dot((8, 16), (16, 12), (), (), (1,), (0,)),
                   mf.Dot((3, 5, 4), (3, 6, 4), (0,), (0,), (2,), (2,)),
                   mf.Dot((8, 16), (8, 12), (), (), (0,), (0,)))
    assert dots == {nn_: 2, bt: 1, tn: 1}
    assert (nn_.flops, bt.flops, tn.flops) == (2 * 8 * 16 * 12, 2 * 3 * 5 * 6 * 4, 2 * 16 * 8 * 12)
    # names resolve across computations; an operand without a definition is an error
    text = ("%fused (p0: f32[4,6], p1: f32[6,2]) -> f32[4,2] {\n"
            "  %p0 = f32[4,6]{1,0} parameter(0)\n  %p1 = f32[6,2]{1,0} parameter(1)\n"
            "  ROOT %dot.1 = f32[4,2]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, "
            "rhs_contracting_dims={0}, metadata={op_name=\"x\"}\n}\n")
    assert mf.hlo_dots(text) == {mf.Dot((4, 6), (6, 2), (), (), (1,), (0,)): 1}
    with pytest.raises(ValueError, match="'q' has no definition"):
        mf.hlo_dots(text.replace("dot(%p0, %p1)", "dot(%q, %p1)"))


@pytest.mark.parametrize("dims", [
    ((6, 5), (5, 7), (), (), (1,), (0,)),                 # x @ w
    ((6, 5), (7, 5), (), (), (1,), (1,)),                 # dy @ w^T
    ((6, 5), (6, 7), (), (), (0,), (0,)),                 # x^T @ dy (the weight gradient)
    ((2, 3, 4, 8), (2, 3, 5, 8), (0, 1), (0, 1), (3,), (3,)),   # q k^T
    ((2, 3, 4, 5), (2, 3, 4, 8), (0, 1), (0, 1), (2,), (2,)),   # p^T dv
])
def test_matmul_floor_torch_dot_equals_dot_general(dims):
    """The torch side runs the same contraction as ``lax.dot_general``, output order included."""
    torch = pytest.importorskip("torch")
    mf = _benchmarks("matmul_floor")
    dot = mf.Dot(*dims)
    rng = np.random.default_rng(0)
    lhs, rhs = rng.standard_normal(dot.lhs, np.float32), rng.standard_normal(dot.rhs, np.float32)
    want = jax.lax.dot_general(lhs, rhs, dot.dimension_numbers, precision="highest")
    got = mf.torch_dot(torch, dot, torch.from_numpy(lhs), torch.from_numpy(rhs)).numpy()
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)


def test_attention_benchmark_long_mode_at_tiny_sizes(tmp_path):
    """``benchmarks/attention.py --long`` at T=256, 512 (one head of 16, window 64): window
    and linear run at both lengths, finite, within 1e-4 of their references (xla with the
    window as a mask; the naive O(T^2) linear attention); xla past --quadratic-max-seq is
    compiled only (its memory, no time); the growth ratios are those of the recorded
    figures, the verdicts follow from them, and the table and the plot are written."""
    import statistics
    attention = _benchmarks("attention")
    plot = tmp_path / "scaling.png"
    result = attention.main(["--long", "--paths", "xla,window,linear", "--seq", "256,512",
                             "--heads", "1", "--head-dim", "16", "--window", "64",
                             "--window-chunk", "64", "--quadratic-max-seq", "256",
                             "--check-max-seq", "256", "--repeats", "2", "--time-budget", "0",
                             "--out-dir", str(tmp_path), "--plot", str(plot)])
    assert json.loads((tmp_path / "attention_long.json").read_text()) == json.loads(
        json.dumps(result))
    rec = {(r["path"], r["seq"]): r for r in result["results"]}
    assert len(rec) == 6
    xla_short, xla_long = rec["xla", 256], rec["xla", 512]
    assert xla_short["status"] == "run" and xla_long["status"] == "compile only"
    assert "round_ms" not in xla_long and "time_growth" not in xla_long
    assert xla_long["temp_bytes"] > 3 * xla_short["temp_bytes"]          # (T, T) logits
    for name in ("window", "linear"):
        short, long_ = rec[name, 256], rec[name, 512]
        assert short["status"] == long_["status"] == "run" and short["finite"] and long_["finite"]
        assert len(short["round_ms"]) == len(long_["round_ms"]) == 2
        assert short["max_abs_diff_out"] <= 1e-4 and short["max_abs_diff_grad"] <= 1e-4, short
        assert long_["time_growth"] == statistics.median(
            [b / a for a, b in zip(short["round_ms"], long_["round_ms"])])
        assert long_["temp_growth"] == long_["temp_bytes"] / short["temp_bytes"]
        for key, target in (("temp", 2.2), ("time", 2.3)):
            verdict = result["targets"][f"{name}_{key}"]
            assert verdict["ratios"] == [long_[f"{key}_growth"]]
            assert verdict["pass"] == (long_[f"{key}_growth"] <= target)
    assert rec["window", 256]["reference"] == "xla + window mask"
    assert rec["linear", 256]["reference"] == "naive O(T^2) linear attention"
    mask = attention.AttentionPattern("window", 64).mask(512, causal=True)
    assert rec["window", 512]["pairs"] == int(np.sum(mask))
    md = (tmp_path / "attention_long.md").read_text()
    assert "| window | chunked, window 64, blocks 64x64 | 512 | run |" in md
    assert "issue 22 targets (window, linear: memory <= 2.2x, time <= 2.3x" in md
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_gpu_check_refuses_unknown_attention_implementations():
    gpu_check = _benchmarks("gpu_check")
    with pytest.raises(ValueError, match=r"--train-impls: unknown attention implementation"
                                         r"\(s\) \['jax\+plain'\]"):
        gpu_check.parse_args(["--smoke", "--train-impls", "auto,jax+plain"])


def test_gpu_check_out_of_budget_records_every_measurement_as_skipped(tmp_path):
    """With no time left nothing runs, and still every measurement is in the results with
    the reason, and both files are written."""
    gpu_check = _benchmarks("gpu_check")
    out = tmp_path / "none"
    result = gpu_check.main(["--smoke", "--budget-s", "0", "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(
        json.dumps(result, default=float))
    records = ([result["matmul"], result["float16"]] + result["train"] + result["attention"]
               + result["decode"])
    assert len(records) == 2 + 4 + 2 * 3 + 2 * 2
    assert all(r["skipped"] == "time budget spent (--budget-s 0)" for r in records), records
    assert {name: s["skipped"] for name, s in result["sections"].items()} == {
        "matmul": 1, "train": 4, "attention": 6, "decode": 4, "float16": 1}
    assert "time budget spent" in out.with_suffix(".md").read_text()


@pytest.mark.slow
def test_gpu_check_script_runs_as_it_stands_in_smoke_mode(tmp_path):
    """``benchmarks/gpu_check.py --smoke`` on this (GPU-less) host: "auto" resolves to the
    reference ("xla") and its compiled train step keeps the CPU tuning (one residual
    conditional per sublayer, 2 layers x 2; optimization barriers in the lowered step);
    cuDNN rows are skipped with the reason; the Pallas kernels (interpret mode) match
    XLA's attention; greedy decode repeats its tokens; float16 with loss scaling trains."""
    gpu_check = _benchmarks("gpu_check")
    out = tmp_path / "smoke"
    result = gpu_check.main(["--smoke", "--train-impls", "auto,cudnn", "--attn-seqs", "64",
                             "--attn-impls", "cudnn,pallas,xla", "--decode-batches", "2",
                             "--decode-dtypes", "bfloat16", "--fp16-steps", "3",
                             "--budget-s", "1e9", "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(
        json.dumps(result, default=float))
    assert result["meta"]["platform"] == "cpu"
    assert result["sections"]["train"] == {**result["sections"]["train"], "measured": 1,
                                           "skipped": 1, "failed": 0}
    assert all(s["failed"] == 0 for s in result["sections"].values()), result["sections"]

    auto, cudnn = result["train"]
    assert (auto["impl"], auto["resolved"]) == ("auto", "xla")
    assert auto["plan"] == {"attention_impl": "auto", "platform": "cpu", "train": "xla",
                            "eval": "xla", "why": "no kernels here; the exact reference up to "
                                                  "4096 x 4096 logits"}
    assert auto["conditionals"] == 4 and auto["optimization_barriers"] > 0
    assert auto["attention_calls"] == {}
    assert 5.0 < auto["first_loss"] < 7.0      # ~ln(vocab 512) = 6.24 at the start
    assert auto["final_loss"] < auto["first_loss"]
    assert auto["tokens_per_s"] > 0 and 0 < auto["mfu"] < 1e-3
    assert auto["tokens_per_s"] == pytest.approx(2 * 64 / (auto["step_ms"] / 1e3))
    assert cudnn["impl"] == "cudnn" and "needs a GPU (the backend is 'cpu')" in cudnn["skipped"]

    attention = {r["impl"]: r for r in result["attention"]}
    assert "needs a GPU" in attention["cudnn"]["skipped"]
    assert attention["xla"]["finite"] and attention["xla"]["fwd_bwd_ms"] > 0
    assert attention["pallas"]["max_abs_diff_out"] <= 2e-2
    assert attention["pallas"]["max_abs_diff_grad"] <= 5e-2

    (dec,) = result["decode"]
    assert (dec["dtype"], dec["batch"], dec["prefill"], dec["step"]) == ("bfloat16", 2, "xla",
                                                                        "xla")
    assert dec["output_shape"] == [2, 8 + 8] and dec["prompt_kept"] and dec["tokens_in_vocab"]
    assert dec["same_tokens_every_call"] and dec["tokens_per_s"] > 0

    fp16 = result["float16"]
    assert fp16["losses_finite"] and len(fp16["losses"]) == 3
    assert fp16["loss_scales"] == [2.0 ** 15] * 3 and fp16["skipped_steps"] == 0
    assert fp16["final_scale"] == 2.0 ** 15
    assert fp16["losses"][-1] < fp16["losses"][0] - 0.05     # the updates were applied
    md = out.with_suffix(".md").read_text()
    assert "| auto | xla | 2 x 64 |" in md and "| xla | 2 x 64 | 3 |" in md


def test_compare_commits_imports_a_commit_beside_this_checkout(tmp_path):
    """The exported HEAD is a second, independent package whose train step gives this
    checkout's loss on the same case; the two sides alternate and both are timed."""
    import importlib
    compare = _benchmarks("compare_commits")
    name = compare.export("HEAD", tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        row = compare.compare_train(name, "gpt_tiny", rounds=2)
        assert importlib.import_module(name).__file__.startswith(str(tmp_path))
    finally:
        sys.path.remove(str(tmp_path))
    before, after = row["first_loss"]
    assert before == after and 3.0 < after < 5.0           # ~ln(64) at init
    assert row["before_s"] > 0 and row["after_s"] > 0 and row["q1"] <= row["ratio"] <= row["q3"]


def test_finetune_memory_quick_lora_optimizer_state_is_a_sliver_of_full_fine_tuning(tmp_path):
    """``benchmarks/finetune_memory.py --quick`` (a 2-layer GPT of width 256): LoRA's Adam
    state is under 2% of full fine-tuning's, and every figure follows from the shapes: fp32
    Adam keeps 2 x 4 bytes per trainable parameter plus its int32 step counts, LoRA (q, v;
    rank 8) trains 2 layers x 2 projections x (256 x 8 + 8 x 256) parameters over a frozen
    fp32 base, QLoRA stores that base smaller, and the compiled steps need less memory."""
    fm = _benchmarks("finetune_memory")
    out = tmp_path / "quick"
    result = fm.main(["--quick", "--methods", "full,lora_qv,qlora_nf4", "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text()) == json.loads(
        json.dumps(result, default=fm.common._json_default))
    assert not result["timed"] and result["model_config"]["d_model"] == 256
    records = {r["name"]: r for r in result["records"]}
    assert all("error" not in r for r in records.values()), records
    full, lora, qlora = records["full"], records["lora_qv"], records["qlora_nf4"]
    n_model = fm.base_config(quick=True).num_params()
    assert full["trainable_params"] == n_model and full["frozen_bytes"] == 0
    assert lora["trainable_params"] == qlora["trainable_params"] == 2 * 2 * (256 * 8 + 8 * 256)
    for r in records.values():
        n = r["trainable_params"]
        assert 8 * n < r["opt_state_bytes"] <= 8 * n + 64, r       # moments + step counts
        assert r["trainable_bytes"] == 4 * n
        assert 0 < r["peak_bytes"] and r["memory"]["alias"] > 0    # the state was donated
    assert full["param_bytes"] == 4 * n_model
    assert lora["param_bytes"] == 4 * (n_model + lora["trainable_params"])   # base kept fp32
    assert qlora["frozen_bytes"] < lora["frozen_bytes"] / 2
    ratio = result["ratios"]["lora_qv_over_full_opt"]
    assert ratio == lora["opt_state_bytes"] / full["opt_state_bytes"] and ratio < 0.02
    assert lora["peak_bytes"] < full["peak_bytes"]
    assert "optimizer bytes / full fine-tuning's: 0.9" in out.with_suffix(".md").read_text()


def test_quant_bytes_smoke_nf4_block_kernels_are_over_3_5x_smaller_than_bf16(tmp_path):
    """``benchmarks/quant_bytes.py --smoke`` (tiny GPT): the block kernels' bytes in each
    format are those of the arrays ``quantize_params`` returns (its eval_shape, checked
    against really quantized ones); NF4 takes 4 + 32/64 = 4.5 bits a parameter, so bf16 /
    NF4 = 3.56 (GPT-2 124M: the same, its kernels are whole blocks too)."""
    qb = _benchmarks("quant_bytes")
    out = tmp_path / "smoke"
    result = qb.main(["--smoke", "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text())["ratios"] == result["ratios"]
    assert result["checked_real_arrays"] == {"int8": True, "nf4": True, "nf4+dq": True}
    bits = {r["format"]: r["bits_per_param"] for r in result["rows"]}
    assert (bits["fp32"], bits["bf16"], bits["nf4"]) == (32, 16, 4.5)
    assert 4.12 < bits["nf4+dq"] < 4.14 and 8 < bits["int8"] < 8.5
    ratios = result["ratios"]
    assert ratios["bf16_over_nf4"] >= 3.5 and ratios["bf16_over_nf4dq"] > ratios["bf16_over_nf4"]
    assert "| nf4 | " in out.with_suffix(".md").read_text()


def test_compare_torch_drift_table_row_from_a_short_run(tmp_path):
    """``benchmarks/compare_torch_drift.py`` for one experiment and 6 steps, with the float64
    reference: the row carries the comparison's figures (the JAX-PyTorch differences at
    float32 rounding this early, both sides' against float64) and the table shows them."""
    drift = _benchmarks("compare_torch_drift")
    result = drift.run([6], ["vit_digits"], tmp_path, [6])
    (row,) = result["rows"]
    assert row["experiment"] == "vit_digits" and row["steps"] == 6 and row["within"]
    assert 0 < row["max_loss_diff"] < 1e-5 and row["max_lr_diff"] < 1e-6
    assert 0 < row["max_loss_jax_vs_f64"] < 1e-5 and 0 < row["max_loss_torch_vs_f64"] < 1e-5
    assert f"| `vit_digits` | 6 | {row['max_loss_diff']:.1e} |" in result["markdown"]
    assert (tmp_path / "vit_digits_6" / "compare.png").exists()


def test_input_pipeline_demand_needs_no_dataset(monkeypatch):
    """The FLOPs per example of every row's experiment come from its config alone, where
    TensorFlow and TFDS cannot be imported (imagenet2012 is not opened): ViT-B/16's
    ``flops_per_image`` (1.055e11), GPT-2 124M's ``flops_per_token`` at seq_len 1024 and the
    configured SentencePiece vocabulary of 32,000 (the planned task's)."""
    from transformer_jax.models import build_model
    from transformer_jax.train.config import load_experiment
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    ip = _benchmarks("input_pipeline")
    got = {name: ip.experiment_flops(name) for name in sorted({e for e, _ in ip.ROWS})}
    for name, (flops, unit) in got.items():
        cfg = load_experiment(name)
        fixed = {"num_classes": 1000, "num_channels": 3} if unit == "image" else {
            "vocab_size": 32_000}
        model_cfg, _ = build_model(cfg.model, cfg.model_preset, {**fixed, **cfg.model_overrides})
        want = (model_cfg.flops_per_image() if unit == "image"
                else model_cfg.flops_per_token(cfg.seq_len))
        assert (flops, unit) == (pytest.approx(want, rel=1e-12),
                                 "image" if cfg.model == "vit" else "token"), name
    assert got["vit_b16_tpu_v5e_1"][0] == pytest.approx(1.055e11, rel=1e-3)


def test_input_pipeline_smoke_cores_needed_are_what_the_chips_consume_over_the_per_core_rate(
        tmp_path):
    """``benchmarks/input_pipeline.py`` at tiny sizes, workers 0 and 1, with given FLOPs per
    example: a v5e chip (197 TFLOP/s) at 40% MFU on 1.97e11 FLOPs an image consumes 400
    images/s; the cores needed are 1.5 x consumed / the per-core rate (images per CPU second
    at 1 worker; tokens: the stream iterator's per CPU second); a v4-32 host feeds a quarter
    of its 16 chips."""
    ip = _benchmarks("input_pipeline")
    jpegs = ip.make_jpegs(2, 40, 30)
    assert ip.JpegSource(jpegs)[1]["image"].shape == (30, 40, 3)
    assert jpegs[0][:2] == b"\xff\xd8" and jpegs[0] != jpegs[1]
    out = tmp_path / "ip"
    rows = [("img", "v5e-1"), ("img", "v4-32"), ("lm", "v6e-1")]
    result = ip.main(["--workers", "0,1", "--images", "8", "--width", "40", "--height", "30",
                      "--image-size", "16", "--batch", "4", "--batches", "2",
                      "--text-chars", "20000", "--vocab", "400", "--seq-len", "64",
                      "--out", str(out)],
                     rows=rows, flops={"img": (1.97e11, "image"), "lm": (9.18e8, "token")})
    measured = result["measured"]
    assert result["per_core_per_s"] == {
        "image": measured["images_per_cpu_s"][1],
        "token": measured["stream_sentencepiece_tokens_per_cpu_s"]}
    assert all(v > 0 for v in measured["images_per_s"].values())
    assert ip._cpu_seconds([]) > 0
    v5e, v4, v6e = result["rows"]
    assert v5e["consumed_per_s"][0.4] == pytest.approx(400.0)
    assert v5e["consumed_per_s"][0.6] == pytest.approx(600.0)
    assert v4["consumed_per_s"][0.4] == pytest.approx(4 * 275e12 * 0.4 / 1.97e11)
    assert v6e["consumed_per_s"][0.6] == pytest.approx(918e12 * 0.6 / 9.18e8)   # 600k tokens/s
    for row in result["rows"]:
        rate = result["per_core_per_s"][row["unit"]]
        for mfu in (0.4, 0.6):
            need = 1.5 * row["consumed_per_s"][mfu] / rate
            assert row["cores_needed"][mfu] == pytest.approx(need)
            assert row["reaches"][mfu] == (need <= row["host_cores"])
    assert (v5e["host_cores"], v6e["host_cores"], v4["host_cores"]) == (24, 44, 240)
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["rows"][0]["cores_needed"]["0.4"] == pytest.approx(v5e["cores_needed"][0.4])
    assert "| `img` | v5e-1 | 1.97e+11 | 400 / 600 images/s |" in out.with_suffix(".md").read_text()
