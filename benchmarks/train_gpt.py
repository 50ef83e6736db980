"""Benchmark the GPT train step (forward + backward + AdamW): tokens/s and MFU.

MFU = achieved model FLOP/s / peak FLOP/s. Model FLOPs follow the PaLM/nanoGPT convention
(``GPTConfig.flops_per_token``: 6 N + 12 L D T per token). On CPU the peak is *measured in
the same run* (best of several 2048^3 fp32 matmuls, ``train.monitor.measure_matmul_peak``),
so the figure says how close the step gets to what this machine's matmuls can do.

Each configuration: build the model and the train state, compile the jitted step (donated
state), run ``--warmup`` steps, then time ``--steps`` steps (block_until_ready each step)
and report the median step time.

Usage::

    python benchmarks/train_gpt.py            # default-experiment GPT and a GPT-2-shaped 6L/384
    python benchmarks/train_gpt.py --quick    # one small configuration, few steps

Results: a markdown table on stdout and ``benchmarks/results/train_gpt.{json,md}``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


from transformer_jax.models import GPT, GPTConfig  # noqa: E402
from transformer_jax.train.monitor import measure_matmul_peak  # noqa: E402
from transformer_jax.train.optim import constant, make_optimizer  # noqa: E402
from transformer_jax.train.step import create_train_state, make_train_step  # noqa: E402

# name -> (model overrides on the "tiny" preset, seq_len, batch)
CONFIGS = {
    "default-experiment (4L/128, T=128, B=32)": (
        dict(vocab_size=259, num_layers=4, d_model=128, num_heads=4, max_len=256), 128, 32),
    "gpt2-shaped 6L/384 (T=256, B=8, V=8192)": (
        dict(vocab_size=8192, num_layers=6, d_model=384, num_heads=6, max_len=256), 256, 8),
}
QUICK = {"small 2L/64 (T=64, B=8)": (dict(vocab_size=259, num_layers=2, d_model=64, num_heads=4,
                                          max_len=64), 64, 8)}


def bench_one(overrides: dict, seq_len: int, batch: int, warmup: int, steps: int) -> dict:
    cfg = GPTConfig.preset("tiny", dropout_rate=0.0, attention_dropout_rate=0.0, **overrides)
    model = GPT(cfg)
    rng = jax.random.PRNGKey(0)
    ids = jax.random.randint(rng, (batch, seq_len + 1), 0, cfg.vocab_size)
    batch_ = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": jnp.ones((batch, seq_len))}
    state = create_train_state(model, make_optimizer(schedule=constant(1e-4)), rng, batch_["inputs"])
    step = jax.jit(make_train_step(), donate_argnums=(0,))
    t0 = time.perf_counter()
    state, m = step(state, batch_)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, m = step(state, batch_)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch_)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    tokens = batch * seq_len
    return {"params": cfg.num_params(), "seq_len": seq_len, "batch": batch,
            "compile_s": compile_s, "step_ms": dt * 1e3, "tokens_per_s": tokens / dt,
            "model_flops_per_step": cfg.flops_per_token(seq_len) * tokens,
            "achieved_flops": cfg.flops_per_token(seq_len) * tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "train_gpt"))
    args = ap.parse_args()
    configs = QUICK if args.quick else CONFIGS
    steps = 3 if args.quick else args.steps
    peak = measure_matmul_peak()
    print(f"backend {jax.default_backend()}, {jax.devices()[0].device_kind}; measured fp32 matmul "
          f"peak {peak / 1e9:.0f} GFLOP/s")
    rows = []
    for name, (overrides, seq_len, batch) in configs.items():
        r = bench_one(overrides, seq_len, batch, 1 if args.quick else args.warmup, steps)
        r.update(name=name, mfu=r["achieved_flops"] / peak)
        rows.append(r)
    peak_after = measure_matmul_peak()
    lines = ["| config | params | step ms | tokens/s | GFLOP/s | MFU | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['params'] / 1e6:.2f}M | {r['step_ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['achieved_flops'] / 1e9:.0f} | {r['mfu']:.0%} | "
                     f"{r['compile_s']:.1f} |")
    table = "\n".join(lines)
    print(table)
    print(f"(peak measured before/after: {peak / 1e9:.0f} / {peak_after / 1e9:.0f} GFLOP/s; MFU uses "
          "the first)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"benchmark": "train_gpt", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "jax": jax.__version__, "backend": jax.default_backend(), "cpu_count": os.cpu_count(),
            "peak_flops": peak, "peak_flops_after": peak_after,
            "load_average": list(os.getloadavg()), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=float) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")



if __name__ == "__main__":
    main()
