"""Benchmark the sharded train step per mesh: step time and per-device state memory.

Runs on 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``, set here
before JAX starts unless ``XLA_FLAGS`` already asks for a device count). For each mesh
(one device; data, FSDP and tensor parallel meshes of 8; pmap) it builds the train state
with the shardings of ``transformer_jax.sharding`` (AdamW: params + two moments), compiles
the step, runs ``--warmup`` steps and reports the median of ``--steps`` timed steps, and
the bytes each device holds of the parameters and of the optimizer state, summed over the
arrays' shards on that device (the largest device is reported).

The memory columns are exact and hardware-independent. The step times are *not* a speed
measurement of any accelerator: the 8 "devices" share this machine's CPU cores, so they
show the cost of the extra collectives and resharding, not a speed-up.

Usage::

    python benchmarks/sharding.py            # GPT 4L/256, V=8192 (5.3M params), T=128, B=16
    python benchmarks/sharding.py --quick    # smaller model, fewer steps

Results: a markdown table on stdout and ``benchmarks/results/sharding.{json,md}``.
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

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from transformer_jax import sharding as sh  # noqa: E402
from transformer_jax.models import GPT, GPTConfig  # noqa: E402
from transformer_jax.train.optim import constant, make_optimizer  # noqa: E402
from transformer_jax.train.step import create_train_state, make_train_step  # noqa: E402

MESHES = ["1 device", "data=8", "fsdp=8", "data=2,fsdp=4", "data=2,fsdp=2,tensor=2",
          "data=4,tensor=2", "tensor=8", "pmap"]
MODEL = dict(vocab_size=8192, num_layers=4, d_model=256, num_heads=8, max_len=128)
QUICK = dict(vocab_size=512, num_layers=2, d_model=64, num_heads=8, max_len=64)


def bench_mesh(name: str, model: GPT, batch: dict, warmup: int, steps: int) -> dict:
    tx = make_optimizer(schedule=constant(1e-4))
    rng = jax.random.PRNGKey(0)
    create = lambda: create_train_state(model, tx, rng, batch["inputs"][:1])  # noqa: E731
    if name == "pmap":
        state = sh.pmap_replicate(jax.jit(create)())
        pstep = jax.pmap(make_train_step(axis_name="batch"), axis_name="batch", donate_argnums=(0,))
        n = jax.local_device_count()
        local = {k: v.reshape((n, -1) + v.shape[1:]) for k, v in batch.items()}
        step = lambda s: pstep(s, local)  # noqa: E731
        shape = {"data": n, "fsdp": 1, "tensor": 1}
    else:
        devices = jax.devices()[:1] if name == "1 device" else jax.devices()
        mesh = sh.make_mesh(None if name == "1 device" else name, devices=devices)
        abstract, shardings, notes = sh.train_state_shardings(
            create, lambda: model.init(rng, batch["inputs"][:1]), mesh)
        state = jax.jit(create, out_shardings=shardings)()
        jitted = jax.jit(make_train_step(), in_shardings=(shardings, sh.batch_sharding(mesh)),
                         out_shardings=(shardings, sh.replicated(mesh)), donate_argnums=(0,))
        placed = sh.shard_batch(batch, mesh)

        def step(s):
            with sh.use_mesh(mesh):
                return jitted(s, placed)
        shape = dict(mesh.shape)
    params_dev = sh.bytes_per_device(state.params)
    opt_dev = sh.bytes_per_device(state.opt_state)
    t0 = time.perf_counter()
    state, m = step(state)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        state, m = step(state)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    loss = float(np.asarray(m["loss"]).reshape(-1)[0])
    return {"mesh": name, "shape": shape, "devices": len(params_dev),
            "step_ms": statistics.median(times) * 1e3, "compile_s": compile_s, "loss": loss,
            "param_bytes_per_device": max(params_dev.values()),
            "opt_bytes_per_device": max(opt_dev.values()),
            "state_bytes_per_device": max(params_dev[d] + opt_dev.get(d, 0) for d in params_dev)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(REPO_ROOT / "benchmarks" / "results" / "sharding"))
    args = ap.parse_args()
    overrides, seq_len, batch_size = (QUICK, 32, 16) if args.quick else (MODEL, 128, 16)
    cfg = GPTConfig.preset("tiny", dropout_rate=0.0, attention_dropout_rate=0.0, **overrides)
    model = GPT(cfg)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
    batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": np.ones((batch_size, seq_len), np.float32)}
    print(f"{jax.device_count()} {jax.devices()[0].platform} devices; GPT {cfg.num_layers}L/{cfg.d_model}, "
          f"V={cfg.vocab_size}, {cfg.num_params() / 1e6:.2f}M params; T={seq_len}, B={batch_size}; AdamW")
    rows = []
    for name in MESHES:
        rows.append(bench_mesh(name, model, batch, 1 if args.quick else args.warmup,
                               2 if args.quick else args.steps))
        r = rows[-1]
        print(f"  {name}: {r['step_ms']:.0f} ms/step, {r['state_bytes_per_device'] / 2**20:.2f} MiB/device",
              flush=True)
    full = rows[0]["state_bytes_per_device"]
    lines = ["| mesh | step ms | params MiB/device | optimizer MiB/device | state MiB/device | vs. replicated | loss |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['step_ms']:.0f} | {r['param_bytes_per_device'] / 2**20:.2f} | "
                     f"{r['opt_bytes_per_device'] / 2**20:.2f} | {r['state_bytes_per_device'] / 2**20:.2f} | "
                     f"1/{full / r['state_bytes_per_device']:.1f} | {r['loss']:.6f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"benchmark": "sharding", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "cpu_count": os.cpu_count(), "load_average": list(os.getloadavg()),
            "model": overrides, "params": cfg.num_params(), "seq_len": seq_len, "batch": batch_size,
            "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=float) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
