"""GPU check: GPT-2 124M train-step throughput and MFU, and attention kernels fwd+bwd.

Written for one NVIDIA H200 (runs on any CUDA GPU; ``--smoke`` runs tiny sizes on any
backend, CPU included, to check the script itself). Sections, in order of importance;
each is timed, wrapped so that a failure is recorded and the run goes on, and skipped
(recorded as such) once ``--budget-s`` is spent:

1. **matmul**: best-of-N bf16 (n, n) @ (n, n) matmul TFLOP/s (what the chip's matmul units
   give to XLA; the MFU peak itself is ``--peak-tflops``, dense bf16 spec, default H200's
   989.4).
2. **train** with ``--train-impls`` (default ``jax`` = cuDNN flash attention where cuDNN
   can run it): GPT-2 124M (``GPTConfig.preset("gpt2")``), sequence ``--seq`` 1024, batch
   ``--batch`` 16, library dtype policy: bf16 compute (``dtype="bfloat16"``), fp32
   parameters and Adam moments, fp32 softmax/norms/logits; dropout 0 (cuDNN and the
   Pallas kernels have no attention dropout); AdamW + clipping (``make_optimizer``), one
   jitted step with the state donated. Reported: compile s, median step ms over
   ``--steps`` steps after ``--warmup``, tokens/s, model TFLOP/s
   (``GPTConfig.flops_per_token``: 6 N + 12 L D T per token) and MFU = that / peak, the
   final loss (a finite number), and the device's peak memory so far.
3. **attention**: ``dot_product_attention`` fwd+bwd (grads of sum(out * ct) w.r.t. q, k,
   v), causal, bf16, N=12 heads of H=64 (GPT-2's), B*T = ``--attn-tokens`` (16k) tokens
   at each of ``--attn-seqs``, for ``--attn-impls`` (default ``cudnn,xla,pallas``;
   ``pallas`` = the Triton kernels of ``transformer_jax/layers/flash_attention.py``, if
   they compile). Reported: median ms (fwd+bwd and fwd only), TFLOP/s in the
   FlashAttention convention (causal fwd = 2 B N T^2 H, bwd = 2.5 x fwd), and the max abs
   difference of out/grads from ``xla`` at the same size (bf16: expect ~1e-2).
4. **train** once more for every other entry of ``--train-impls``: by default
   ``jax+plain`` (the ``jax`` step traced without ``store_gradient_once``, so the two rows
   show what its conditional per sublayer costs on this GPU), ``xla`` and ``pallas``.

Output: progress on stdout; ``benchmarks/results/gpu_check.{json,md}``
(``gpu_check_smoke.{json,md}`` with ``--smoke``).

Usage::

    python benchmarks/gpu_check.py                   # H200: ~4-6 min, compile included
    python benchmarks/gpu_check.py --train-impls jax,xla --attn-seqs 1024,4096 --budget-s 300
    python benchmarks/gpu_check.py --smoke           # tiny sizes, any backend (~1 min on CPU)
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import fmt  # noqa: E402
from transformer_jax.layers import blocks  # noqa: E402
from transformer_jax.layers.attention import _cudnn_problems, dot_product_attention  # noqa: E402
from transformer_jax.models import GPT, GPTConfig  # noqa: E402
from transformer_jax.train.optim import constant, make_optimizer  # noqa: E402
from transformer_jax.train.step import create_train_state, make_train_step  # noqa: E402

H200_BF16_DENSE_TFLOPS = 989.4
STARTED = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {msg}", flush=True)


def short_error(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {' | '.join(lines[:3])[:400]}"


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    """Median wall seconds of ``fn()`` (each call ended by block_until_ready)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def device_peak_bytes() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None
    return None if not stats else stats.get("peak_bytes_in_use")


# ----------------------------------------------------------------------------- matmul

def bench_matmul(n: int, repeats: int) -> dict:
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    jax.block_until_ready(f(a, a))
    best = min(median_time(lambda: f(a, a), 1)[0] for _ in range(repeats))
    return {"n": n, "best_s": best, "tflops": 2 * n ** 3 / best / 1e12}


# ----------------------------------------------------------------------------- train

def gpt_config(args, impl: str) -> GPTConfig:
    if args.smoke:
        return GPTConfig.preset("tiny", max_len=args.seq, dropout_rate=0.0,
                                attention_dropout_rate=0.0, attention_impl=impl,
                                dtype="bfloat16", param_dtype="float32")
    return GPTConfig.preset("gpt2", max_len=max(1024, args.seq), dropout_rate=0.0,
                            attention_dropout_rate=0.0, attention_impl=impl,
                            dtype="bfloat16", param_dtype="float32",
                            scan_layers=args.scan_layers, remat=args.remat)


@contextlib.contextmanager
def plain_residual_gradient(on: bool):
    """While tracing: pre-norm blocks without ``store_gradient_once`` (its conditional per
    sublayer), for the ``+plain`` train variants that measure what it costs on this GPU."""
    saved = blocks.store_gradient_once
    if on:
        blocks.store_gradient_once = lambda x: x
    try:
        yield
    finally:
        blocks.store_gradient_once = saved


def split_impl(impl: str) -> tuple[str, bool]:
    """'jax+plain' -> ('jax', True): attention implementation, and whether the step is
    traced without ``store_gradient_once``."""
    base, _, variant = impl.partition("+")
    if variant not in ("", "plain"):
        raise ValueError(f"train impl {impl!r}: the only variant is '+plain' (e.g. 'jax+plain')")
    return base, variant == "plain"


class Trainer:
    """One jitted init (parameters do not depend on the attention implementation) shared
    by the train benchmarks of every implementation."""

    def __init__(self, args):
        self.args = args
        cfg = gpt_config(args, "xla")
        ids = jax.random.randint(jax.random.PRNGKey(1), (args.batch, args.seq + 1), 0,
                                 cfg.vocab_size)
        self.batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:],
                      "weights": jnp.ones((args.batch, args.seq), jnp.float32)}
        tx = make_optimizer(schedule=constant(1e-4))
        self._init = jax.jit(lambda rng: create_train_state(GPT(cfg), tx, rng,
                                                            self.batch["inputs"]))

    def run(self, impl: str) -> dict:
        args = self.args
        attention, plain = split_impl(impl)
        cfg = gpt_config(args, attention)
        state = self._init(jax.random.PRNGKey(0)).replace(apply_fn=GPT(cfg).apply)
        step = jax.jit(make_train_step(), donate_argnums=(0,))
        t0 = time.perf_counter()
        with plain_residual_gradient(plain):
            compiled = step.lower(state, self.batch).compile()
        compile_s = time.perf_counter() - t0
        conditionals = compiled.as_text().count(" conditional(")   # not part of compile_s
        log(f"  train[{impl}] compiled in {compile_s:.1f} s")
        for _ in range(args.warmup):
            state, metrics = compiled(state, self.batch)
        jax.block_until_ready(metrics)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            state, metrics = compiled(state, self.batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        dt = statistics.median(times)
        tokens = args.batch * args.seq
        flops = cfg.flops_per_token(args.seq) * tokens
        loss = float(metrics["loss"])
        return {"impl": impl, "params": cfg.num_params(), "seq": args.seq, "batch": args.batch,
                "dtype": cfg.dtype, "param_dtype": cfg.param_dtype,
                "scan_layers": cfg.scan_layers, "remat": cfg.remat, "compile_s": compile_s,
                "conditionals": conditionals, "step_ms": 1e3 * dt,
                "step_ms_all": [1e3 * t for t in times],
                "tokens_per_s": tokens / dt, "model_tflops": flops / dt / 1e12,
                "mfu": flops / dt / (args.peak_tflops * 1e12), "final_loss": loss,
                "loss_finite": bool(jnp.isfinite(loss)),
                "cudnn_used": cudnn_used_by_model(cfg, args),
                "device_peak_bytes": device_peak_bytes()}


def cudnn_used_by_model(cfg: GPTConfig, args) -> bool | None:
    """Whether the model's attention calls go to cuDNN (GPT passes a causal mask)."""
    if cfg.attention_impl not in ("jax", "cudnn"):
        return None
    shape = (args.batch, args.seq, cfg.num_heads, cfg.head_dim)
    x = jax.ShapeDtypeStruct(shape, jnp.dtype(cfg.dtype))
    return not _cudnn_problems(x, x, x, True)


# ----------------------------------------------------------------------------- attention

def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(fwd, fwd+bwd) FLOPs of causal attention, FlashAttention's convention."""
    fwd = 4 * batch * heads * seq * seq * head_dim / 2
    return fwd, 3.5 * fwd


def bench_attention(args, seq: int, impls: list[str]) -> list[dict]:
    batch = max(1, args.attn_tokens // seq)
    heads, head_dim = args.attn_heads, args.attn_head_dim
    shape = (batch, seq, heads, head_dim)
    keys = jax.random.split(jax.random.PRNGKey(seq), 4)
    q, k, v, ct = (jax.random.normal(kk, shape, jnp.float32).astype(jnp.bfloat16) for kk in keys)
    fwd_flops, total_flops = attention_flops(batch, heads, seq, head_dim)
    records, reference = [], None
    for impl in impls:
        rec = {"impl": impl, "seq": seq, "batch": batch, "heads": heads, "head_dim": head_dim}
        records.append(rec)
        if impl in ("cudnn",):
            problems = _cudnn_problems(q, k, v, False)
            if problems:
                rec["skipped"] = "; ".join(problems)
                log(f"  attention[{impl}] T={seq}: skipped ({rec['skipped']})")
                continue
        try:
            def loss(q, k, v, ct, impl=impl):
                out = dot_product_attention(q, k, v, causal=True, implementation=impl)
                return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

            fwd = jax.jit(lambda q, k, v, impl=impl: dot_product_attention(
                q, k, v, causal=True, implementation=impl))
            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
            t0 = time.perf_counter()
            grad_c = grad.lower(q, k, v, ct).compile()
            fwd_c = fwd.lower(q, k, v).compile()
            rec["compile_s"] = time.perf_counter() - t0
            (dq, dk, dv), out = jax.block_until_ready(grad_c(q, k, v, ct))
            jax.block_until_ready(fwd_c(q, k, v))
            dt, _ = median_time(lambda: grad_c(q, k, v, ct), args.attn_repeats)
            dt_fwd, _ = median_time(lambda: fwd_c(q, k, v), args.attn_repeats)
            rec.update(fwd_bwd_ms=1e3 * dt, fwd_ms=1e3 * dt_fwd,
                       fwd_bwd_tflops=total_flops / dt / 1e12, fwd_tflops=fwd_flops / dt_fwd / 1e12,
                       finite=bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))))
            arrays = (out, dq, dk, dv)
            if impl == "xla":
                reference = arrays
            elif reference is not None:
                diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                         for a, b in zip(arrays, reference)]
                rec["max_abs_diff_out"], rec["max_abs_diff_grad"] = diffs[0], max(diffs[1:])
            log(f"  attention[{impl}] T={seq} B={batch}: fwd+bwd {rec['fwd_bwd_ms']:.2f} ms "
                f"({rec['fwd_bwd_tflops']:.1f} TFLOP/s), fwd {rec['fwd_ms']:.2f} ms, "
                f"compile {rec['compile_s']:.1f} s"
                + (f", diff vs xla out {rec['max_abs_diff_out']:.1e} grad "
                   f"{rec['max_abs_diff_grad']:.1e}" if "max_abs_diff_out" in rec else ""))
        except Exception as exc:  # noqa: BLE001 - record, go on (e.g. a kernel that won't compile)
            rec["error"] = short_error(exc)
            log(f"  attention[{impl}] T={seq}: ERROR {rec['error']}")
            if args.verbose:
                traceback.print_exc()
    return records


# ----------------------------------------------------------------------------- report

def markdown(result: dict) -> str:
    meta = result["meta"]
    lines = [f"# GPU check ({meta['date']})", "",
             f"`{meta['device_kind']}` (backend `{meta['backend']}`), jax {meta['jax']}, "
             f"peak for MFU {meta['peak_tflops']} TFLOP/s (dense bf16); runtime "
             f"{meta['runtime_s']:.0f} s{' (SMOKE: tiny sizes)' if meta['smoke'] else ''}.", ""]
    mm = result.get("matmul")
    if mm and "tflops" in mm:
        lines += [f"bf16 matmul {mm['n']}^3: {mm['tflops']:.0f} TFLOP/s "
                  f"({mm['tflops'] / meta['peak_tflops']:.0%} of the peak)", ""]
    lines += ["## GPT-2 train step", "",
              "| attention | params | B x T | compile s | step ms | tokens/s | model TFLOP/s | "
              "MFU | loss | peak mem GiB |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["train"]:
        if "step_ms" not in r:
            lines.append(f"| {r['impl']} | | | | {r.get('error') or r.get('skipped')} | | | | | |")
            continue
        name = r["impl"] + (" (cuDNN)" if r.get("cudnn_used") else "")
        peak = r.get("device_peak_bytes")
        lines.append(f"| {name} | {r['params'] / 1e6:.1f}M | {r['batch']} x {r['seq']} | "
                     f"{r['compile_s']:.1f} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['model_tflops']:.1f} | {r['mfu']:.1%} | {r['final_loss']:.3f} | "
                     f"{fmt(None if peak is None else peak / 2**30, '.1f')} |")
    lines += ["", "## Attention fwd+bwd (causal, bf16)", "",
              "| impl | T | B | fwd+bwd ms | TFLOP/s | fwd ms | fwd TFLOP/s | compile s | "
              "diff out | diff grad |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["attention"]:
        if "fwd_bwd_ms" not in r:
            lines.append(f"| {r['impl']} | {r['seq']} | {r.get('batch', '')} | "
                         f"{r.get('error') or r.get('skipped')} | | | | | | |")
            continue
        lines.append(f"| {r['impl']} | {r['seq']} | {r['batch']} | {r['fwd_bwd_ms']:.2f} | "
                     f"{r['fwd_bwd_tflops']:.1f} | {r['fwd_ms']:.2f} | {r['fwd_tflops']:.1f} | "
                     f"{r['compile_s']:.1f} | {fmt(r.get('max_abs_diff_out'), '.1e')} | "
                     f"{fmt(r.get('max_abs_diff_grad'), '.1e')} |")
    lines += ["", "Train: median step over the timed steps, state donated; MFU = "
              "flops_per_token(T) x tokens/s / peak. Attention: B x T = constant tokens; "
              "TFLOP/s counts causal fwd = 2 B N T^2 H, bwd = 2.5 x fwd; diffs are max |x - "
              "x_xla| (out, and max over dq, dk, dv).", ""]
    if result["notes"]:
        lines += ["Notes:", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on any backend (checks the script, numbers meaningless)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                   help="dense bf16 peak of one device for MFU (default: H200, 989.4)")
    p.add_argument("--seq", type=int, default=None, help="train sequence length (default 1024)")
    p.add_argument("--batch", type=int, default=None, help="train batch (default 16)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--train-impls", default="jax,jax+plain,xla,pallas",
                   help="attention implementations of the train benchmark; the first is run "
                        "before the attention section, the others after it; '+plain' traces "
                        "the step without store_gradient_once (what its conditionals cost)")
    p.add_argument("--scan-layers", action="store_true", help="scan the 12 blocks (faster "
                   "compile, usually a little slower steps)")
    p.add_argument("--remat", action="store_true")
    p.add_argument("--attn-impls", default="cudnn,xla,pallas")
    p.add_argument("--attn-seqs", default=None, help="default 1024,2048,4096,8192")
    p.add_argument("--attn-tokens", type=int, default=None, help="B * T (default 16384)")
    p.add_argument("--attn-heads", type=int, default=12)
    p.add_argument("--attn-head-dim", type=int, default=64)
    p.add_argument("--attn-repeats", type=int, default=None)
    p.add_argument("--matmul-n", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="start no new measurement after this many seconds (default 360; "
                        "one GPT-2 compile takes up to ~1 min, so the run ends well within 8 min)")
    p.add_argument("--out", type=Path, default=None,
                   help="output stem (default benchmarks/results/gpu_check[_smoke])")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)
    small = args.smoke
    defaults = dict(seq=64 if small else 1024, batch=2 if small else 16,
                    warmup=1 if small else 3, steps=2 if small else 20,
                    attn_seqs="64,128" if small else "1024,2048,4096,8192",
                    attn_tokens=256 if small else 16384, attn_repeats=2 if small else 10,
                    matmul_n=256 if small else 8192)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if small:
        args.attn_heads, args.attn_head_dim = min(args.attn_heads, 2), min(args.attn_head_dim, 16)
    args.out = args.out or REPO_ROOT / "benchmarks" / "results" / (
        "gpu_check_smoke" if small else "gpu_check")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = jax.default_backend()
    device = jax.devices()[0]
    if backend != "gpu" and not args.smoke:
        raise SystemExit(f"no GPU here (backend {backend!r}, {device.device_kind}); "
                         "run with --smoke to check the script on this backend")
    log(f"gpu_check: backend={backend} device={device.device_kind} jax={jax.__version__} "
        f"smoke={args.smoke} budget={args.budget_s:.0f}s")
    notes = []
    if args.smoke:
        notes.append("smoke run: tiny model and lengths; throughput and MFU are meaningless")
    if backend != "gpu":
        notes.append(f"backend {backend}: 'cudnn' is skipped, 'jax' is XLA's path, and "
                     "'pallas' runs its kernels in interpret mode")
    result = {"meta": {}, "matmul": None, "train": [], "attention": [], "notes": notes}

    def over_budget(what: str) -> bool:
        if time.perf_counter() - STARTED > args.budget_s:
            log(f"budget of {args.budget_s:.0f} s spent: skipping {what}")
            return True
        return False

    def train_one(trainer, impl):
        if over_budget(f"train[{impl}]"):
            result["train"].append({"impl": impl, "skipped": "time budget spent"})
            return
        log(f"train[{impl}]: GPT {'tiny' if args.smoke else 'gpt2 124M'} B={args.batch} "
            f"T={args.seq} bf16")
        try:
            r = trainer.run(impl)
            result["train"].append(r)
            log(f"  train[{impl}]: {r['step_ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
                f"{r['model_tflops']:.1f} TFLOP/s, MFU {r['mfu']:.1%}, loss {r['final_loss']:.3f}")
        except Exception as exc:  # noqa: BLE001 - record and go on
            result["train"].append({"impl": impl, "error": short_error(exc)})
            log(f"  train[{impl}]: ERROR {short_error(exc)}")
            if args.verbose:
                traceback.print_exc()

    try:
        result["matmul"] = bench_matmul(args.matmul_n, 5)
        log(f"matmul bf16 {args.matmul_n}^3: {result['matmul']['tflops']:.1f} TFLOP/s")
    except Exception as exc:  # noqa: BLE001
        result["matmul"] = {"error": short_error(exc)}
        log(f"matmul: ERROR {short_error(exc)}")

    train_impls = [s.strip() for s in args.train_impls.split(",") if s.strip()]
    trainer = None
    try:
        trainer = Trainer(args)
    except Exception as exc:  # noqa: BLE001
        result["train"] = [{"impl": i, "error": short_error(exc)} for i in train_impls]
        log(f"train setup: ERROR {short_error(exc)}")
    if trainer and train_impls:
        train_one(trainer, train_impls[0])

    attn_impls = [s.strip() for s in args.attn_impls.split(",") if s.strip()]
    if "xla" in attn_impls:  # the reference of the diffs goes first
        attn_impls.sort(key=lambda name: name != "xla")
    for seq in sorted(int(s) for s in args.attn_seqs.split(",")):
        if over_budget(f"attention T={seq}"):
            result["attention"] += [{"impl": i, "seq": seq, "skipped": "time budget spent"}
                                    for i in attn_impls]
            continue
        log(f"attention T={seq}")
        result["attention"] += bench_attention(args, seq, attn_impls)

    if trainer:
        for impl in train_impls[1:]:
            train_one(trainer, impl)

    runtime = time.perf_counter() - STARTED
    result["meta"] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "backend": backend,
        "device_kind": device.device_kind, "device_count": jax.device_count(),
        "jax": jax.__version__, "python": platform.python_version(), "smoke": args.smoke,
        "peak_tflops": args.peak_tflops, "runtime_s": runtime,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    json_path.write_text(json.dumps(result, indent=2, default=float) + "\n")
    md_path.write_text(markdown(result))
    print()
    print(markdown(result))
    errors = [r for r in result["train"] + result["attention"] if "error" in r]
    log(f"done in {runtime:.0f} s, {len(errors)} failed measurement(s); wrote {json_path} "
        f"and {md_path}")


if __name__ == "__main__":
    main()
