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
  qlora-start  the real ``--init-from DIR`` start of a QLoRA run (``run.setup``: NF4 base,
               LoRA rank 8 on every attention and MLP projection, bf16, AdamW), up to the
               train state on the devices. Measured after the same start from a one-layer
               checkpoint of the same widths (which prepares the corpus and compiles the
               quantization of each kernel shape): the peak (VmHWM, reset then) above the
               RSS then, so it counts the data, not XLA's compiler nor the data pipeline
  qlora-whole  the same start the way it went before 2026-12-07: the base streamed
               unquantized, a fresh init of the whole model, the base filled in, then
               quantized on the devices

On the CPU backend the loaded params themselves are host memory too (the "params" column:
for qlora-start the whole train state, frozen base, adapters and their AdamW moments).

Usage::

    python benchmarks/load_memory.py            # llama-3.2-1b (2.5 GB of bf16; minutes)
    python benchmarks/load_memory.py --smoke    # llama-tiny
    python benchmarks/load_memory.py --ways qlora-start     # one way only
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

WAYS = ("old-fp32", "stream-bf16", "stream-nf4", "qlora-start", "qlora-whole")


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


def qlora_config(directory: str, data_dir: str):
    """The QLoRA run the ``qlora-start`` way starts: ``--init-from directory``, NF4 base,
    rank-8 LoRA on the attention and MLP projections, bf16 params, the embedded corpus."""
    from transformer_jax.train.config import ExperimentConfig, apply_overrides

    return apply_overrides(ExperimentConfig(), [
        "task=lm", "model=gpt", f"data_dir={data_dir}", "seq_len=32", "batch_size=4",
        "steps=2", "schedule=constant", "lora.rank=8", "lora.targets=attn/|mlp/", "lora.quantize=nf4",
        "model.param_dtype=bfloat16"]).replace(init_from=str(directory))


def _memory_status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _qlora_start(directory: str, whole: bool = False) -> dict:
    """In this process: the QLoRA ``--init-from`` start of :func:`qlora_config`, measured
    from after the data is prepared (the peak reset there) to the placed train state;
    ``whole``: the whole-tree way (the base streamed unquantized)."""
    import jax

    from transformer_jax import run as run_module
    if whole:
        placement = run_module._source_placement
        run_module._source_placement = lambda cfg: {
            k: v for k, v in placement(cfg).items() if k not in ("quantize", "scan_layers")}

    from transformer_jax.layers.quant import param_bytes
    from transformer_jax.run import setup
    from transformer_jax.tasks import make_task

    from transformer_jax.interop.hf.llama import llama_config_from_hf

    with tempfile.TemporaryDirectory(prefix="qlora_start_") as tmp:
        data = os.path.join(tmp, "data")
        one = os.path.join(tmp, "one-layer")      # the same widths: the same kernel shapes
        with open(os.path.join(directory, "config.json")) as f:
            write_checkpoint(one, llama_config_from_hf(json.load(f)).replace(num_layers=1))
        warm = setup(qlora_config(one, data), os.path.join(tmp, "warm"), progress=False)
        jax.block_until_ready(warm.state)   # the corpus prepared, each kernel shape compiled
        warm.ckpt.close()
        del warm
        cfg = qlora_config(directory, data)
        with open("/proc/self/clear_refs", "w") as f:              # VmHWM := VmRSS
            f.write("5")
        base = _memory_status("VmRSS")
        start = time.perf_counter()
        run = setup(cfg, os.path.join(tmp, "run"), progress=False)
        jax.block_until_ready(run.state)
        seconds = time.perf_counter() - start
        peak = _memory_status("VmHWM")
        run.ckpt.close()
        sizes = {part: param_bytes(getattr(run.state, part))["total"]
                 for part in ("frozen", "params", "opt_state")}
    return {"way": "qlora-whole" if whole else "qlora-start", "peak_rss_growth": peak - base, "baseline_rss": base,
            "params_bytes": sum(sizes.values()), "state_bytes": sizes, "seconds": seconds}


def _load(directory: str, way: str) -> dict:
    """In this process: load ``directory`` the given way; the peak RSS growth (bytes) over
    the baseline after the imports, and the loaded params' bytes."""
    import resource

    import jax

    from transformer_jax.interop.hf import convert, from_hf
    from transformer_jax.layers.lora import LoraConfig
    from transformer_jax.layers.quant import param_bytes

    if way in ("qlora-start", "qlora-whole"):
        return _qlora_start(directory, whole=way == "qlora-whole")
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
        for way in args.ways:
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
        "its baseline after the imports (qlora-*: VmHWM above the RSS after a one-layer warm-up "
        "start, see the module docstring); on the CPU backend the params are host memory too.",
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
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                   help="the ways to measure (default: all)")
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
