"""Peak host memory of loading a bf16 Hugging Face checkpoint: the float32 path vs streaming.

Builds a Llama ``save_pretrained`` directory of random bf16 weights (the real HF key names
and shapes of a ``GPTConfig`` preset, default ``llama-3.2-1b``: vocab 128256, 16 layers, D
2048, 32 / 8 heads, F 8192, tied embeddings; written tensor by tensor, sharded into ~1 GB
files with a ``model.safetensors.index.json``), then loads it in a fresh subprocess per way
and reports the peak resident memory (``ru_maxrss``) above the subprocess's own baseline
after its imports:

  old-fp32     the whole-tree conversion (``from_hf_state_dict``), fp32 params as before
  stream-bf16  ``from_hf(dir, param_dtype="bfloat16")``: tensor by tensor, bf16 kept
  stream-nf4   the same with ``quantize=LoraConfig(quantize="nf4")``: the QLoRA base

On the CPU backend the loaded params themselves are host memory too (the "params" column).

Usage::

    python benchmarks/load_memory.py            # llama-3.2-1b (2.5 GB of bf16; minutes)
    python benchmarks/load_memory.py --smoke    # llama-tiny
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

WAYS = ("old-fp32", "stream-bf16", "stream-nf4")


def tensor_table(cfg) -> list[tuple[str, tuple[int, ...]]]:
    """``(HF key, shape)`` of every tensor of a Llama checkpoint of ``cfg``, in HF order."""
    from transformer_jax.interop.hf.llama import llama_tensor_maps
    return [(m.key, tuple(m.shape)) for m in llama_tensor_maps(cfg)]


def _write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], rng) -> None:
    """One safetensors file of random bf16 tensors (N(0, 0.02)), written one at a time."""
    import ml_dtypes

    header, offset = {}, 0
    for key, shape in tensors:
        size = 2 * math.prod(shape)
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, shape in tensors:
            n, done = math.prod(shape), 0
            while done < n:                       # chunks of 8M values: little host memory
                k = min(n - done, 1 << 23)
                chunk = rng.standard_normal(k, dtype=np.float32) * np.float32(0.02)
                f.write(chunk.astype(ml_dtypes.bfloat16).tobytes())
                done += k


def write_checkpoint(directory: str | Path, cfg, shard_bytes: int = 1 << 30, seed: int = 0) -> int:
    """A sharded Llama ``save_pretrained`` directory of random bf16 weights; returns its bytes."""
    from transformer_jax.interop.hf import hf_config

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf = hf_config(cfg).to_dict()
    hf["torch_dtype"] = hf["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(hf))
    shards, current, size = [], [], 0
    for key, shape in tensor_table(cfg):
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((key, shape))
        size += nbytes
    shards.append(current)
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_shard(directory / name, tensors, rng)
        weight_map.update({key: name for key, _ in tensors})
        total += sum(2 * math.prod(s) for _, s in tensors)
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def _load(directory: str, way: str) -> dict:
    """In this process: load ``directory`` the given way; the peak RSS growth (bytes) over
    the baseline after the imports, and the loaded params' bytes."""
    import resource

    import jax

    from transformer_jax.interop.hf import convert, from_hf
    from transformer_jax.layers.lora import LoraConfig
    from transformer_jax.layers.quant import param_bytes

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if way == "old-fp32":
        config, state_dict = convert._load_local_dir(directory)
        _, params = convert.from_hf_state_dict(config, state_dict)
    elif way == "stream-bf16":
        _, params = from_hf(directory, param_dtype="bfloat16")
    elif way == "stream-nf4":
        _, params = from_hf(directory, param_dtype="bfloat16", quantize=LoraConfig(quantize="nf4"))
    else:
        raise SystemExit(f"unknown way {way!r}; one of {WAYS}")
    jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"way": way, "peak_rss_growth": peak - base, "baseline_rss": base,
            "params_bytes": param_bytes(params)["total"], "seconds": seconds}


def measure(directory: str | Path, way: str) -> dict:
    """:func:`_load` in a fresh subprocess (its result: the last line of its stdout)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "benchmarks.load_memory", "--load",
                           str(directory), way], capture_output=True, text=True, env=env,
                          cwd=root)
    if done.returncode:
        raise RuntimeError(f"load {way} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> dict:
    from benchmarks import common
    from transformer_jax.models import GPTConfig

    cfg = GPTConfig.preset(args.preset)
    with tempfile.TemporaryDirectory(prefix="load_memory_") as tmp:
        total = write_checkpoint(tmp, cfg, shard_bytes=args.shard_bytes)
        files = sorted(p.name for p in Path(tmp).iterdir() if p.suffix == ".safetensors")
        print(f"# load memory: {args.preset}, {total / 2**30:.2f} GiB of bf16 in "
              f"{len(files)} shards", flush=True)
        rows = []
        for way in WAYS:
            rows.append(measure(tmp, way))
            print(f"{way}: peak RSS growth {rows[-1]['peak_rss_growth'] / 2**30:.2f} GiB", flush=True)
    machine = common.machine_info()
    header = ["way", "peak RSS growth GiB", "x bf16 checkpoint", "params GiB", "seconds"]
    body = [[r["way"], f"{r['peak_rss_growth'] / 2**30:.2f}",
             f"{r['peak_rss_growth'] / total:.2f}", f"{r['params_bytes'] / 2**30:.2f}",
             f"{r['seconds']:.1f}"] for r in rows]
    md = "\n".join([
        common.md_table(header, body), "",
        f"{args.preset} ({cfg.num_params() / 1e9:.2f}B parameters): {total:,} bytes of bf16 "
        f"safetensors in {len(files)} shards. Peak RSS (ru_maxrss) of a fresh process above "
        "its baseline after the imports; on the CPU backend the params are host memory too.",
        f"- Machine: {machine['cpu']}, jax {machine['jax']} ({machine['backend']}), "
        f"{time.strftime('%Y-%m-%d')}.",
    ])
    return {"benchmark": "load_memory", "machine": machine, "preset": args.preset,
            "checkpoint_bytes": total, "shards": len(files), "rows": rows, "markdown": md}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="llama-tiny instead")
    p.add_argument("--preset", default=None, help="GPTConfig preset (default llama-3.2-1b)")
    p.add_argument("--shard-bytes", type=int, default=1 << 30, help="bytes per shard file")
    p.add_argument("--load", nargs=2, metavar=("DIR", "WAY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.preset = args.preset or ("llama-tiny" if args.smoke else "llama-3.2-1b")
    if args.smoke:
        args.shard_bytes = min(args.shard_bytes, 1 << 16)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.load:
        print(json.dumps(_load(*args.load)), flush=True)
        return
    from benchmarks import common
    common.setup_process()
    result = run(args)
    common.report("load_memory_smoke" if args.smoke else "load_memory",
                  "Peak host memory of loading a bf16 checkpoint", result)


if __name__ == "__main__":
    main()
