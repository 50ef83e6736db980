"""GPU check: the one script to run when a GPU is lent (written for one NVIDIA H200).

What it measures, in the order it runs (except that decode rows after the first dtype
run last). Each measurement is wrapped: a failure is recorded and the run goes on; once
``--budget-s`` is spent, every measurement not yet started is recorded as skipped with the
reason; the results file is rewritten after every measurement, so a run killed from
outside still leaves what it had.

1. **matmul**: best bf16 (n, n) @ (n, n) TFLOP/s, what the chip's matmul units give XLA.
   The MFU peak itself is ``--peak-tflops`` (dense bf16 spec; default the H200's 989.4).
2. **train**: GPT-2 124M (``GPTConfig.preset("gpt2")``), T = ``--seq`` 1024, B =
   ``--batch`` 32; bf16 compute, fp32 parameters and Adam moments; dropout 0; AdamW +
   clipping (``make_optimizer``); one jitted step with the state donated. One row per
   ``--train-impls`` entry (default ``auto,cudnn,pallas,xla``): for each, the attention it
   resolved to on this platform (``models.base.attention_plan``), compile s, median step
   ms, tokens/s, model TFLOP/s (``flops_per_token``: 6 N + 12 L D T) and MFU against the
   peak, the first and last loss (every row starts from the same weights and trains on
   the same batch, so the rows agree up to bf16 rounding), the compiled step's
   conditionals and attention custom calls, the lowered step's optimization barriers (on
   a GPU the CPU tuning of ``layers/cpu_tuning.py`` is not compiled: expect 0 and 0), and
   the device's peak memory so far. Target: MFU >= 45% (llm.c reports ~41% on an H100
   for this model).
3. **attention**: ``dot_product_attention`` fwd+bwd, causal, bf16, 12 heads of 64,
   B x T = ``--attn-tokens`` 16k at each of ``--attn-seqs``, for ``--attn-impls`` (cudnn,
   pallas = the Triton kernels of ``layers/flash_attention.py``, xla); median ms, TFLOP/s
   (FlashAttention's convention: causal fwd = 2 B N T^2 H, bwd = 2.5 x fwd) and the max
   abs difference of the output and gradients from ``xla`` (bf16: ~1e-2 expected).
4. **decode**: ``transformer_jax.decode.generate`` greedy, GPT-2 124M, 32-token prompt +
   128 new tokens, at ``--decode-batches`` 1 and 16, for ``--decode-dtypes`` (bfloat16
   first, then float32; weights stored in that dtype): tokens/s (prefill included), ms
   per new token, and the share of the memory roofline (each step reads the weights and
   the KV cache once; ``--hbm-tbps``, default the H200's 4.8).
5. **float16**: ``--fp16-steps`` train steps of GPT-2 124M in float16 with dynamic loss
   scaling (``train.step.LossScale``) on one batch: the losses (finite, falling), the
   scale and the number of skipped (overflowed) steps.

Output: progress on stdout; ``benchmarks/results/gpu_check.{json,md}`` (the markdown
tables go into the README and docs as they are; ``gpu_check_smoke.*`` with ``--smoke``).

Usage::

    python benchmarks/gpu_check.py             # one H200: planned for < 8 min in all
    python benchmarks/gpu_check.py --train-impls auto,xla --attn-seqs 1024 --budget-s 200
    python benchmarks/gpu_check.py --smoke     # tiny sizes, any backend: 1-2 min on 2 CPUs

The default ``--budget-s`` (400) starts nothing after 400 s, and the longest single
measurement (a GPT-2 train-step compile) takes about a minute: the run fits an 8-minute
slot, results included. Without a GPU the full run refuses to start; ``--smoke`` then
checks the script itself (on the CPU, ``cudnn`` rows are skipped with their reason and
``pallas`` runs its kernels in interpret mode; the numbers say nothing about speed).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import fmt  # noqa: E402
from transformer_jax import decode  # noqa: E402
from transformer_jax.layers.attention import dot_product_attention  # noqa: E402
from transformer_jax.layers.attention_dispatch import (  # noqa: E402
    IMPLEMENTATIONS, cudnn_problems, resolve_implementation)
from transformer_jax.models import GPT, GPTConfig  # noqa: E402
from transformer_jax.models.base import attention_plan  # noqa: E402
from transformer_jax.train.optim import constant, make_optimizer  # noqa: E402
from transformer_jax.train.step import LossScale, create_train_state, make_train_step  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.4
H200_HBM_TBPS = 4.8
LEARNING_RATE = 6e-4        # constant; GPT-2 small's peak rate (the float16 losses must fall)
STARTED = time.perf_counter()

# XLA:CPU cannot reuse donated buffers; the warning says nothing about the measurement.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


class Skipped(Exception):
    """A measurement that cannot run here (e.g. cuDNN without a GPU); the message says why."""


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {msg}", flush=True)


def short_error(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[:3])[:400]}"


def platform_name() -> str:
    """This process's platform as ``resolve_implementation`` names it: cpu, gpu or tpu."""
    backend = jax.default_backend()
    return backend if backend in ("cpu", "gpu", "tpu") else "gpu"


def median_time(fn, repeats: int) -> float:
    """Median wall seconds of ``fn()`` (each call ended by block_until_ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def device_peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


def cudnn_obstacles(q, k, v) -> list[str]:
    """Why cuDNN attention cannot run (q, k, v) in this process ([] if it can)."""
    problems = list(cudnn_problems(q, k, v))
    if jax.default_backend() != "gpu":
        problems.insert(0, f"it needs a GPU (the backend is {jax.default_backend()!r})")
    return problems


def hlo_facts(lowered, compiled) -> dict:
    """What the CPU tuning and the attention dispatch left in a step: conditionals of the
    compiled program, optimization barriers of the lowered one (XLA expands them before the
    compiled text is printed), and the compiled program's custom-call targets."""
    text = compiled.as_text()
    targets = Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    attention = {t: n for t, n in targets.items()
                 if re.search(r"fmha|triton|tpu_custom_call|mosaic", t, re.I)}
    return {"conditionals": text.count(" conditional("),
            "optimization_barriers": lowered.as_text().count("stablehlo.optimization_barrier"),
            "attention_calls": attention, "custom_calls": dict(targets)}


# ----------------------------------------------------------------------------- models

def gpt_config(args, impl: str = "auto", dtype: str = "bfloat16",
               param_dtype: str = "float32") -> GPTConfig:
    """GPT-2 124M (tiny under ``--smoke``), dropout 0, long enough for train and decode."""
    preset = "tiny" if args.smoke else "gpt2"
    max_len = max(args.seq, args.prompt_len + args.new_tokens,
                  GPTConfig.preset(preset).max_len)
    return GPTConfig.preset(preset, max_len=max_len, dropout_rate=0.0,
                            attention_dropout_rate=0.0, attention_impl=impl, dtype=dtype,
                            param_dtype=param_dtype, scan_layers=args.scan_layers,
                            remat=args.remat)


def lm_batch(vocab: int, batch: int, seq: int, seed: int = 1) -> dict:
    ids = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq + 1), 0, vocab)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:],
            "weights": jnp.ones((batch, seq), jnp.float32)}


class InitialStates:
    """The initial train state of each model shape, built once (one jitted init) and copied
    for every use, since the steps donate it. Parameters are fp32 and depend neither on the
    attention implementation nor on the compute dtype: every row starts from the same
    weights."""

    def __init__(self, seq: int):
        self.seq = seq
        self._states: dict = {}

    def get(self, cfg: GPTConfig, loss_scale: LossScale | None = None):
        key = dataclasses.replace(cfg, attention_impl="xla", dtype="float32",
                                  param_dtype="float32")
        if key not in self._states:
            tx = make_optimizer(schedule=constant(LEARNING_RATE))
            ids = jnp.zeros((1, self.seq), jnp.int32)
            self._states[key] = jax.jit(lambda rng: create_train_state(GPT(key), tx, rng, ids))(
                jax.random.PRNGKey(0))
        state = jax.tree_util.tree_map(jnp.copy, self._states[key])
        return state.replace(apply_fn=GPT(cfg).apply, loss_scale=loss_scale)


def compile_step(state, batch):
    step = jax.jit(make_train_step(), donate_argnums=(0,))
    t0 = time.perf_counter()
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    return lowered, compiled, time.perf_counter() - t0


# ----------------------------------------------------------------------------- sections

def bench_matmul(n: int, repeats: int) -> dict:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    jax.block_until_ready(f(a, a))
    best = min(median_time(lambda: f(a, a), 1) for _ in range(repeats))
    return {"n": n, "best_s": best, "tflops": 2 * n ** 3 / best / 1e12}


def bench_train(args, states: InitialStates, impl: str) -> dict:
    """One GPT train-step row for attention implementation ``impl``."""
    cfg = gpt_config(args, impl)
    plan = attention_plan(cfg, args.seq, platform_name())
    shape = jax.ShapeDtypeStruct((args.batch, args.seq, cfg.num_heads, cfg.head_dim),
                                 jnp.dtype(cfg.dtype))
    if plan["train"] == "cudnn" and (problems := cudnn_obstacles(shape, shape, shape)):
        raise Skipped(f"{impl} -> cudnn cannot run here: " + "; ".join(problems))
    batch = lm_batch(cfg.vocab_size, args.batch, args.seq)
    state = states.get(cfg)
    lowered, compiled, compile_s = compile_step(state, batch)
    log(f"  train[{impl}] (-> {plan['train']}) compiled in {compile_s:.1f} s")
    state, metrics = compiled(state, batch)
    first_loss = float(metrics["loss"])
    for _ in range(args.warmup - 1):
        state, metrics = compiled(state, batch)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tokens = args.batch * args.seq
    flops = cfg.flops_per_token(args.seq) * tokens
    loss = float(metrics["loss"])
    return {"resolved": plan["train"], "plan": plan, "params": cfg.num_params(),
            "seq": args.seq, "batch": args.batch, "dtype": cfg.dtype,
            "param_dtype": cfg.param_dtype, "scan_layers": cfg.scan_layers, "remat": cfg.remat,
            "compile_s": compile_s, **hlo_facts(lowered, compiled),
            "step_ms": 1e3 * dt, "step_ms_all": [1e3 * t for t in times],
            "tokens_per_s": tokens / dt, "model_tflops": flops / dt / 1e12,
            "mfu": flops / dt / (args.peak_tflops * 1e12), "first_loss": first_loss,
            "final_loss": loss, "loss_finite": bool(math.isfinite(loss)),
            "device_peak_bytes": device_peak_bytes()}


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(fwd, fwd+bwd) FLOPs of causal attention, FlashAttention's convention."""
    fwd = 4 * batch * heads * seq * seq * head_dim / 2
    return fwd, 3.5 * fwd


def attention_inputs(args, seq: int):
    batch = max(1, args.attn_tokens // seq)
    shape = (batch, seq, args.attn_heads, args.attn_head_dim)
    keys = jax.random.split(jax.random.PRNGKey(seq), 4)
    return [jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) for kk in keys]


def bench_attention(args, impl: str, q, k, v, ct) -> tuple[dict, tuple]:
    """fwd+bwd and fwd timings of one implementation; also its (out, dq, dk, dv)."""
    if impl == "cudnn" and (problems := cudnn_obstacles(q, k, v)):
        raise Skipped("cudnn cannot run here: " + "; ".join(problems))

    def loss(q, k, v, ct):
        out = dot_product_attention(q, k, v, causal=True, attention_impl=impl)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

    fwd = jax.jit(lambda q, k, v: dot_product_attention(q, k, v, causal=True,
                                                         attention_impl=impl))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    t0 = time.perf_counter()
    grad_c = grad.lower(q, k, v, ct).compile()
    fwd_c = fwd.lower(q, k, v).compile()
    compile_s = time.perf_counter() - t0
    (dq, dk, dv), out = jax.block_until_ready(grad_c(q, k, v, ct))
    jax.block_until_ready(fwd_c(q, k, v))
    dt = median_time(lambda: grad_c(q, k, v, ct), args.attn_repeats)
    dt_fwd = median_time(lambda: fwd_c(q, k, v), args.attn_repeats)
    fwd_flops, total_flops = attention_flops(*q.shape[:3], q.shape[3])
    rec = {"compile_s": compile_s, "fwd_bwd_ms": 1e3 * dt, "fwd_ms": 1e3 * dt_fwd,
           "fwd_bwd_tflops": total_flops / dt / 1e12, "fwd_tflops": fwd_flops / dt_fwd / 1e12,
           "finite": bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))}
    return rec, (out, dq, dk, dv)


def max_abs_diffs(arrays, reference) -> dict:
    diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
             for a, b in zip(arrays, reference)]
    return {"max_abs_diff_out": diffs[0], "max_abs_diff_grad": max(diffs[1:])}


class DecodeBench:
    """Greedy ``decode.generate`` of the train rows' initial GPT, its weights stored in each
    measured dtype."""

    def __init__(self, args, states: InitialStates):
        self.args = args
        self.params = states.get(gpt_config(args, dtype="float32")).params

    def run(self, dtype: str, batch: int) -> dict:
        args = self.args
        cfg = gpt_config(args, dtype=dtype, param_dtype=dtype)
        model = GPT(cfg)
        params = jax.tree_util.tree_map(lambda p: p.astype(dtype), self.params)
        prompt = jax.random.randint(jax.random.PRNGKey(batch), (batch, args.prompt_len), 0,
                                    cfg.vocab_size)
        total = args.prompt_len + args.new_tokens

        def call():
            return decode.generate(model, params, prompt, max_new_tokens=args.new_tokens)

        t0 = time.perf_counter()
        first = np.asarray(jax.block_until_ready(call()))
        first_s = time.perf_counter() - t0
        outputs, times = [], []
        for _ in range(args.decode_repeats):
            t0 = time.perf_counter()
            outputs.append(np.asarray(jax.block_until_ready(call())))
            times.append(time.perf_counter() - t0)
        dt = statistics.median(times)
        describe = dict(dtype=dtype, head_dim=cfg.head_dim)
        itemsize = jnp.dtype(dtype).itemsize
        weight_bytes = sum(p.size * itemsize for p in jax.tree_util.tree_leaves(params))
        kv_width = (cfg.num_kv_heads or cfg.num_heads) * cfg.head_dim
        mean_filled = args.prompt_len + (args.new_tokens + 1) / 2
        kv_bytes = 2 * cfg.num_layers * batch * mean_filled * kv_width * itemsize
        roofline = batch * args.hbm_tbps * 1e12 / (weight_bytes + kv_bytes)
        new = first[:, args.prompt_len:]
        return {
            "prefill": resolve_implementation("auto", platform_name(), q_len=args.prompt_len,
                                              kv_len=total, **describe),
            "step": resolve_implementation("auto", platform_name(), q_len=1, kv_len=total,
                                           **describe),
            "params": cfg.num_params(), "compile_s": max(first_s - dt, 0.0), "call_ms": 1e3 * dt,
            "ms_per_token": 1e3 * dt / args.new_tokens,
            "tokens_per_s": batch * args.new_tokens / dt,
            "roofline_tokens_per_s": roofline, "roofline_share": batch * args.new_tokens / dt
            / roofline, "output_shape": list(first.shape),
            "prompt_kept": bool(np.array_equal(first[:, :args.prompt_len], np.asarray(prompt))),
            "tokens_in_vocab": bool(((new >= 0) & (new < cfg.vocab_size)).all()),
            "same_tokens_every_call": all(np.array_equal(o, first) for o in outputs)}


def bench_float16(args, states: InitialStates) -> dict:
    """A few steps in float16 with dynamic loss scaling, on one repeated batch."""
    cfg = gpt_config(args, dtype="float16")
    batch = lm_batch(cfg.vocab_size, args.fp16_batch, args.seq, seed=2)
    state = states.get(cfg, LossScale.create(args.fp16_init_scale))
    _, compiled, compile_s = compile_step(state, batch)
    history, times = [], []
    for _ in range(args.fp16_steps):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        history.append(metrics)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    history = jax.device_get(history)
    losses = [float(m["loss"]) for m in history]
    return {"resolved": attention_plan(cfg, args.seq, platform_name())["train"],
            "params": cfg.num_params(), "batch": args.fp16_batch, "seq": args.seq,
            "steps": args.fp16_steps, "compile_s": compile_s,
            "step_ms": 1e3 * statistics.median(times[1:] or times), "losses": losses,
            "loss_scales": [float(m["loss_scale"]) for m in history],
            "grad_norms": [float(m["grad_norm"]) for m in history],
            "skipped_steps": int(sum(float(m["skipped"]) for m in history)),
            "init_scale": args.fp16_init_scale, "final_scale": float(state.loss_scale.scale),
            "losses_finite": all(math.isfinite(x) for x in losses)}


# ----------------------------------------------------------------------------- report

def why(rec: dict) -> str:
    """A row's text where its numbers would be: the error, the reason it was skipped, or
    (in the files written while it runs) that it has not finished."""
    return rec.get("error") or rec.get("skipped") or "not finished"


def train_rows(result: dict) -> list[str]:
    lines = ["| attention | resolves to | B x T | compile s | step ms | tokens/s | "
             "model TFLOP/s | MFU | conditionals | opt. barriers | attention calls | loss | "
             "peak mem GiB |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in result["train"]:
        if "step_ms" not in r:
            lines.append(f"| {r['impl']} | {r.get('resolved', '')} | | | "
                         f"{why(r)} | | | | | | | | |")
            continue
        calls = ", ".join(f"{t} x{n}" for t, n in sorted(r["attention_calls"].items())) or "-"
        peak = r.get("device_peak_bytes")
        lines.append(
            f"| {r['impl']} | {r['resolved']} | {r['batch']} x {r['seq']} | {r['compile_s']:.1f}"
            f" | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.1f} | "
            f"{r['mfu']:.1%} | {r['conditionals']} | {r['optimization_barriers']} | {calls} | "
            f"{r['final_loss']:.3f} | {fmt(None if peak is None else peak / 2**30, '.1f')} |")
    return lines


def attention_rows(result: dict) -> list[str]:
    lines = ["| impl | T | B | fwd+bwd ms | TFLOP/s | fwd ms | fwd TFLOP/s | compile s | "
             "diff out | diff grad |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["attention"]:
        if "fwd_bwd_ms" not in r:
            lines.append(f"| {r['impl']} | {r['seq']} | {r.get('batch', '')} | "
                         f"{why(r)} | | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['seq']} | {r['batch']} | {r['fwd_bwd_ms']:.2f} | "
                     f"{r['fwd_bwd_tflops']:.1f} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.1f} | "
                     f"{r['compile_s']:.1f} | {fmt(r.get('max_abs_diff_out'), '.1e')} | "
                     f"{fmt(r.get('max_abs_diff_grad'), '.1e')} |")
    return lines


def decode_rows(result: dict) -> list[str]:
    lines = ["| dtype | batch | prompt + new | attention prefill / step | compile s | "
             "ms / token | tokens/s | roofline share |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in result["decode"]:
        head = f"| {r['dtype']} | {r['batch']} | {r['prompt_len']} + {r['new_tokens']} |"
        if "tokens_per_s" not in r:
            lines.append(f"{head} {why(r)} | | | | |")
            continue
        lines.append(f"{head} {r['prefill']} / {r['step']} | {r['compile_s']:.1f} | "
                     f"{r['ms_per_token']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['roofline_share']:.0%} |")
    return lines


def float16_rows(result: dict) -> list[str]:
    r = result["float16"]
    if r is None:       # not reached yet
        return []
    lines = ["| attention | B x T | steps | first loss | last loss | skipped steps | scale "
             "(start -> end) | step ms |", "|---|---|---:|---:|---:|---:|---|---:|"]
    if "losses" not in r:
        return lines + [f"| | | | {why(r)} | | | | |"]
    return lines + [f"| {r['resolved']} | {r['batch']} x {r['seq']} | {r['steps']} | "
                    f"{r['losses'][0]:.3f} | {r['losses'][-1]:.3f} | {r['skipped_steps']} | "
                    f"{r['init_scale']:g} -> {r['final_scale']:g} | {r['step_ms']:.1f} |"]


def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# GPU check ({meta['date']})", "",
             f"`{meta['device_kind']}` (backend `{meta['backend']}`), jax {meta['jax']}, "
             f"MFU peak {meta['peak_tflops']} TFLOP/s (dense bf16); runtime "
             f"{meta['runtime_s']:.0f} s{' (SMOKE: tiny sizes)' if meta['smoke'] else ''}.", ""]
    mm = result.get("matmul") or {}
    if "tflops" in mm:
        lines += [f"bf16 matmul {mm['n']}^3: {mm['tflops']:.0f} TFLOP/s "
                  f"({mm['tflops'] / meta['peak_tflops']:.0%} of the peak)", ""]
    model = "GPT tiny" if meta["smoke"] else "GPT-2 124M"
    lines += [f"## {model} train step (bf16 compute, fp32 params and Adam, state donated)", ""]
    lines += train_rows(result)
    lines += ["", "## Attention fwd+bwd (causal, bf16)", ""] + attention_rows(result)
    lines += ["", f"## {model} greedy decode (`decode.generate`)", ""] + decode_rows(result)
    lines += ["", f"## {model} in float16 with dynamic loss scaling", ""]
    lines += float16_rows(result)
    lines += ["", "Train: median step over the timed steps; MFU = flops_per_token(T) x "
              "tokens/s / peak; conditionals counted in the compiled step, optimization "
              "barriers in the lowered one. Attention: B x T constant; TFLOP/s counts causal "
              "fwd = 2 B N T^2 H, bwd = 2.5 x fwd; diffs are max |x - x_xla| (out, and max "
              "over dq, dk, dv). Decode: prefill included; roofline = batch x HBM bandwidth / "
              "(weight bytes + mean KV-cache bytes) per step.", ""]
    if result["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_impls(text: str, what: str) -> list[str]:
    impls = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [i for i in impls if i not in IMPLEMENTATIONS]
    if unknown:
        raise ValueError(f"{what}: unknown attention implementation(s) {unknown}; choose from "
                         f"{IMPLEMENTATIONS}")
    return impls


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on any backend (checks the script; numbers meaningless)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                   help="dense bf16 peak of one device for MFU (default: H200, 989.4)")
    p.add_argument("--hbm-tbps", type=float, default=H200_HBM_TBPS,
                   help="memory bandwidth for the decode roofline (default: H200, 4.8)")
    p.add_argument("--seq", type=int, default=None, help="train sequence length (default 1024)")
    p.add_argument("--batch", type=int, default=None, help="train batch (default 32)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (>= 1)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--train-impls", default="auto,cudnn,pallas,xla")
    p.add_argument("--scan-layers", action="store_true",
                   help="scan the blocks (faster compile, usually slightly slower steps)")
    p.add_argument("--remat", action="store_true",
                   help="rematerialise each block (adds optimization barriers of its own)")
    p.add_argument("--attn-impls", default="cudnn,pallas,xla")
    p.add_argument("--attn-seqs", default=None, help="default 1024,4096,8192")
    p.add_argument("--attn-tokens", type=int, default=None, help="B * T (default 16384)")
    p.add_argument("--attn-heads", type=int, default=12)
    p.add_argument("--attn-head-dim", type=int, default=64)
    p.add_argument("--attn-repeats", type=int, default=None)
    p.add_argument("--matmul-n", type=int, default=None)
    p.add_argument("--decode-batches", default=None, help="default 1,16")
    p.add_argument("--decode-dtypes", default="bfloat16,float32",
                   help="the first is measured before the float16 section, the rest after")
    p.add_argument("--prompt-len", type=int, default=None, help="default 32")
    p.add_argument("--new-tokens", type=int, default=None, help="default 128")
    p.add_argument("--decode-repeats", type=int, default=None)
    p.add_argument("--fp16-steps", type=int, default=None, help="default 8")
    p.add_argument("--fp16-batch", type=int, default=None, help="default 8")
    p.add_argument("--fp16-init-scale", type=float, default=2.0 ** 15)
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="start no measurement after this many seconds (default 400: the "
                        "longest one, a GPT-2 compile, takes about a minute, so a run ends "
                        "within ~8 min)")
    p.add_argument("--cache-dir", default=None,
                   help="persistent XLA compilation cache (speeds a rerun on the same machine)")
    p.add_argument("--out", type=Path, default=None,
                   help="output stem (default benchmarks/results/gpu_check[_smoke])")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)
    small = args.smoke
    defaults = dict(seq=64 if small else 1024, batch=2 if small else 32,
                    warmup=1 if small else 3, steps=2 if small else 20,
                    attn_seqs="64,128" if small else "1024,4096,8192",
                    attn_tokens=256 if small else 16384, attn_repeats=2 if small else 10,
                    matmul_n=256 if small else 8192, decode_batches="1,2" if small else "1,16",
                    prompt_len=8 if small else 32, new_tokens=8 if small else 128,
                    decode_repeats=2 if small else 3, fp16_steps=4 if small else 8,
                    fp16_batch=2 if small else 8)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup < 1 or args.steps < 1:
        p.error(f"--warmup and --steps must be >= 1 (got {args.warmup}, {args.steps})")
    if small:
        args.attn_heads, args.attn_head_dim = min(args.attn_heads, 2), min(args.attn_head_dim, 16)
    args.train_impls = parse_impls(args.train_impls, "--train-impls")
    args.attn_impls = parse_impls(args.attn_impls, "--attn-impls")
    args.attn_seqs = sorted(int(s) for s in args.attn_seqs.split(","))
    args.decode_batches = [int(s) for s in args.decode_batches.split(",")]
    args.decode_dtypes = [s.strip() for s in args.decode_dtypes.split(",") if s.strip()]
    args.out = args.out or REPO_ROOT / "benchmarks" / "results" / (
        "gpu_check_smoke" if small else "gpu_check")
    return args


class Run:
    """The result being built, the time budget, and the rewrite after every measurement."""

    def __init__(self, args):
        self.args = args
        self.states = InitialStates(args.seq)
        device = jax.devices()[0]
        self.result = {
            "meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "backend": jax.default_backend(), "platform": platform_name(),
                     "device_kind": device.device_kind, "device_count": jax.device_count(),
                     "jax": jax.__version__, "python": platform.python_version(),
                     "smoke": args.smoke, "peak_tflops": args.peak_tflops, "runtime_s": 0.0,
                     "budget_s": args.budget_s, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                     "args": {k: (str(v) if isinstance(v, Path) else v)
                              for k, v in vars(args).items()}},
            "sections": {}, "matmul": None, "train": [], "attention": [], "decode": [],
            "float16": None, "notes": []}

    def measure(self, section: str, rec: dict, fn, label: str) -> dict:
        """``rec`` (already in the result) updated with ``fn()``'s dict, or with why it
        was skipped or failed; then the result files are rewritten."""
        stats = self.result["sections"].setdefault(
            section, {"seconds": 0.0, "measured": 0, "skipped": 0, "failed": 0})
        t0 = time.perf_counter()
        if t0 - STARTED > self.args.budget_s:
            rec["skipped"] = f"time budget spent (--budget-s {self.args.budget_s:g})"
        else:
            try:
                rec.update(fn())
            except Skipped as why:
                rec["skipped"] = str(why)
            except Exception as exc:  # noqa: BLE001 - record it and go on
                rec["error"] = short_error(exc)
                if self.args.verbose:
                    traceback.print_exc()
        outcome = "failed" if "error" in rec else "skipped" if "skipped" in rec else "measured"
        stats[outcome] += 1
        stats["seconds"] += time.perf_counter() - t0
        if outcome != "measured":
            log(f"{label}: {outcome.upper()} {rec.get('error') or rec.get('skipped')}")
        self.save()
        return rec

    def save(self) -> tuple[Path, Path]:
        self.result["meta"]["runtime_s"] = time.perf_counter() - STARTED
        out = self.args.out
        out.parent.mkdir(parents=True, exist_ok=True)
        json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
        json_path.write_text(json.dumps(self.result, indent=2, default=float) + "\n")
        md_path.write_text(markdown(self.result))
        return json_path, md_path


def run_train(run: Run, impl: str) -> None:
    args = run.args
    rec = {"impl": impl}
    run.result["train"].append(rec)
    run.measure("train", rec, lambda: bench_train(args, run.states, impl), f"train[{impl}]")
    if "step_ms" in rec:
        log(f"  train[{impl}] -> {rec['resolved']}: {rec['step_ms']:.1f} ms/step, "
            f"{rec['tokens_per_s']:,.0f} tokens/s, MFU {rec['mfu']:.1%}, loss "
            f"{rec['final_loss']:.3f}, {rec['conditionals']} conditionals, "
            f"{rec['optimization_barriers']} optimization barriers")


def run_attention(run: Run) -> None:
    args = run.args
    impls = sorted(args.attn_impls, key=lambda name: name != "xla")   # the reference first
    for seq in args.attn_seqs:
        inputs, reference = [], None
        for impl in impls:
            rec = {"impl": impl, "seq": seq, "batch": max(1, args.attn_tokens // seq),
                   "heads": args.attn_heads, "head_dim": args.attn_head_dim}
            run.result["attention"].append(rec)
            arrays = {}

            def measure(impl=impl, seq=seq, inputs=inputs, arrays=arrays):
                inputs[:] = inputs or attention_inputs(args, seq)
                timing, arrays["out"] = bench_attention(args, impl, *inputs)
                if impl != "xla" and reference is not None:
                    timing.update(max_abs_diffs(arrays["out"], reference))
                return timing

            run.measure("attention", rec, measure, f"attention[{impl}] T={seq}")
            if impl == "xla" and "out" in arrays:
                reference = arrays["out"]
            if "fwd_bwd_ms" in rec:
                log(f"  attention[{impl}] T={seq}: fwd+bwd {rec['fwd_bwd_ms']:.2f} ms "
                    f"({rec['fwd_bwd_tflops']:.1f} TFLOP/s), fwd {rec['fwd_ms']:.2f} ms"
                    + (f", diff vs xla {rec['max_abs_diff_out']:.1e} / "
                       f"{rec['max_abs_diff_grad']:.1e}" if "max_abs_diff_out" in rec else ""))


def run_decode(run: Run, dtypes: list[str], bench: list) -> None:
    args = run.args
    for dtype in dtypes:
        for batch in args.decode_batches:
            def measure(dtype=dtype, batch=batch):
                if not bench:
                    bench.append(DecodeBench(args, run.states))
                return bench[0].run(dtype, batch)

            rec = {"dtype": dtype, "batch": batch, "prompt_len": args.prompt_len,
                   "new_tokens": args.new_tokens}
            run.result["decode"].append(rec)
            run.measure("decode", rec, measure, f"decode[{dtype}] B={batch}")
            if "tokens_per_s" in rec:
                log(f"  decode[{dtype}] B={batch}: {rec['tokens_per_s']:,.0f} tokens/s, "
                    f"{rec['ms_per_token']:.2f} ms/token, roofline {rec['roofline_share']:.0%}")


def main(argv=None) -> dict:
    global STARTED
    STARTED = time.perf_counter()       # the budget counts from here (also when imported)
    args = parse_args(argv)
    backend = jax.default_backend()
    if backend != "gpu" and not args.smoke:
        raise SystemExit(f"no GPU here (backend {backend!r}, {jax.devices()[0].device_kind}); "
                         "run with --smoke to check the script on this backend")
    if args.cache_dir:
        jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    run = Run(args)
    log(f"gpu_check: backend={backend} device={run.result['meta']['device_kind']} "
        f"jax={jax.__version__} smoke={args.smoke} budget={args.budget_s:g}s")
    if args.smoke:
        run.result["notes"].append("smoke run: tiny model and lengths; speeds are meaningless")
    if backend != "gpu":
        run.result["notes"].append(
            f"backend {backend}: cudnn is skipped, 'auto' takes the CPU's reference path "
            "with its tuning, and pallas runs its kernels in interpret mode")

    run.result["matmul"] = {}
    run.measure("matmul", run.result["matmul"], lambda: bench_matmul(args.matmul_n, 5), "matmul")
    if "tflops" in run.result["matmul"]:
        log(f"matmul bf16 {args.matmul_n}^3: {run.result['matmul']['tflops']:.1f} TFLOP/s")
    for impl in args.train_impls:
        log(f"train[{impl}]: B={args.batch} T={args.seq}")
        run_train(run, impl)
    log("attention fwd+bwd")
    run_attention(run)
    decode_bench: list = []
    log("decode")
    run_decode(run, args.decode_dtypes[:1], decode_bench)
    log("float16 with loss scaling")
    run.result["float16"] = {}     # filled by measure (or says why not)
    run.measure("float16", run.result["float16"], lambda: bench_float16(args, run.states),
                "float16")
    if "losses" in run.result["float16"]:
        r = run.result["float16"]
        log(f"  float16: loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}, "
            f"{r['skipped_steps']} skipped, scale {r['final_scale']:g}")
    run_decode(run, args.decode_dtypes[1:], decode_bench)

    json_path, md_path = run.save()
    print()
    print(markdown(run.result))
    counts = Counter()
    for stats in run.result["sections"].values():
        counts.update({k: stats[k] for k in ("measured", "skipped", "failed")})
    log(f"done in {run.result['meta']['runtime_s']:.0f} s: {counts['measured']} measured, "
        f"{counts['skipped']} skipped, {counts['failed']} failed; wrote {json_path} and {md_path}")
    return run.result


if __name__ == "__main__":
    main()
