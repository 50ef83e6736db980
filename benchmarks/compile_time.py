"""Compile time of the GPT train step, layers unrolled vs ``scan_layers=True``.

For GPT-2-shaped models (12 and 24 layers, width 768/1024, T=256, B=8, vocab 50257) the
jitted train step (``make_train_step`` + AdamW, state donated) is traced and lowered
(``jax.jit(...).lower``) and compiled by XLA (``.compile()``), on abstract arguments
(``jax.eval_shape``: no parameters are materialised). Reported: trace + lower seconds,
XLA compile seconds and their sum, each the fastest of ``--repeats`` fresh attempts (a new
Python function each time, so JAX's tracing caches do not help).

Usage::

    python benchmarks/compile_time.py           # 12 and 24 layers (~2-3 min here)
    python benchmarks/compile_time.py --quick   # 4 and 8 layers
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

common.setup_process()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from transformer_jax.models import GPT, GPTConfig  # noqa: E402
from transformer_jax.train.optim import constant, make_optimizer  # noqa: E402
from transformer_jax.train.step import create_train_state, make_train_step  # noqa: E402


def compile_once(cfg: GPTConfig, seq: int, batch: int) -> tuple[float, float]:
    """(trace + lower seconds, XLA compile seconds) of a fresh train step."""
    model = GPT(cfg)
    tx = make_optimizer(schedule=constant(1e-4))
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    state = jax.eval_shape(lambda: create_train_state(model, tx, jax.random.PRNGKey(0),
                                                      jnp.zeros((batch, seq), jnp.int32)))
    batch_ = {"inputs": ids, "targets": ids, "weights": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}
    inner = make_train_step()

    def train_step(state, batch):        # a new function object: no cached trace
        return inner(state, batch)

    t0 = time.perf_counter()
    lowered = jax.jit(train_step, donate_argnums=(0,)).lower(state, batch_)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1


def run(args) -> dict:
    shapes = ([(4, 256, 4), (8, 256, 4)] if args.quick
              else [(12, 768, 12), (24, 1024, 16)])
    print(f"# compile time: GPT train step, layers {[s[0] for s in shapes]}, unrolled vs scan",
          flush=True)
    rows = []
    for layers, width, heads in shapes:
        for scan in (False, True):
            cfg = GPTConfig(num_layers=layers, d_model=width, num_heads=heads, max_len=args.seq,
                            dropout_rate=0.0, attention_dropout_rate=0.0, scan_layers=scan)
            attempts = [compile_once(cfg, args.seq, args.batch) for _ in range(args.repeats)]
            lower_s, compile_s = min(a[0] for a in attempts), min(a[1] for a in attempts)
            rows.append({"layers": layers, "width": width, "scan_layers": scan,
                         "params": cfg.num_params(), "lower_s": lower_s, "compile_s": compile_s,
                         "total_s": lower_s + compile_s, "attempts": attempts})
            print(f"  {layers}L/{width} scan={scan}: trace+lower {lower_s:.1f} s, "
                  f"compile {compile_s:.1f} s", flush=True)
    for r in rows:
        if r["scan_layers"]:
            unrolled = next(u for u in rows if u["layers"] == r["layers"] and not u["scan_layers"])
            r["speedup_vs_unrolled"] = unrolled["total_s"] / r["total_s"]
    header = ["model", "params", "scan_layers", "trace+lower s", "XLA compile s", "total s",
              "unrolled/scan"]
    body = [[f"GPT {r['layers']}L/{r['width']}", f"{r['params'] / 1e6:.0f}M", r["scan_layers"],
             f"{r['lower_s']:.1f}", f"{r['compile_s']:.1f}", f"{r['total_s']:.1f}",
             common.fmt(r.get("speedup_vs_unrolled"), ".1f") + ("x" if "speedup_vs_unrolled" in r else "")]
            for r in rows]
    md = (common.md_table(header, body) + "\n\n"
          f"Train step (AdamW, donated state), T={args.seq}, B={args.batch}, vocab 50257; "
          f"fastest of {args.repeats} fresh compilations.")
    return {"benchmark": "compile_time", "machine": common.machine_info(), "seq": args.seq,
            "batch": args.batch, "rows": rows, "markdown": md}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 and 8 layers")
    add_args(p)
    args = p.parse_args(argv)
    result = run(args)
    common.report("compile_time", "Compile time", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
