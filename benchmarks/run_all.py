"""The benchmark suite in one command: train step, decode, attention and compile time.

    python -m benchmarks                 # the whole suite (~15 min on 2 CPU cores)
    python -m benchmarks --quick         # small sizes, a few minutes
    python -m benchmarks --only train,decode

Sections (each also runs on its own, see its module docstring):

* ``train``        (``benchmarks/train.py``): train-step tokens/s and MFU for GPT, BERT, T5
  and ViT at two sizes each, against HF transformers PyTorch eager and ``torch.compile``
  with the same config, batch and AdamW, alternating in this process; jit-cache,
  donation and data-pipeline checks.
* ``floor``        (``benchmarks/matmul_floor.py``): the GPT 6L/384 train step's own dots
  alone, in XLA and in torch, next to both steps: how far each step is from its matmuls
  and the highest ours/eager ratio these XLA kernels allow.
* ``decode``       (``benchmarks/decode_gpt2.py``): GPT-2 124M greedy decoding with the KV
  cache vs HF ``generate`` at batch 1 and 16 (identical tokens asserted), and the share of
  the memory-bandwidth roofline measured in the same run.
* ``attention``    (``benchmarks/attention.py``, run as a subprocess): forward+backward
  time and memory against sequence length for each attention implementation.
* ``compile``      (``benchmarks/compile_time.py``): train-step compile time, layers
  unrolled vs ``scan_layers=True``.

Results: ``benchmarks/results/<section>.{json,md}`` per section and the combined
``benchmarks/results/suite.{json,md}`` (the markdown holds every table and the ratios).
The process applies the CLI's host-allocator tuning (``transformer_jax.host_memory``)
before JAX starts; the PyTorch peers run in the same process and share it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402

common.setup_process()

SECTIONS = ("train", "floor", "decode", "attention", "compile")


def run_attention(quick: bool) -> dict:
    """benchmarks/attention.py in a subprocess (it may isolate configs itself); its JSON."""
    cmd = [sys.executable, str(common.REPO_ROOT / "benchmarks" / "attention.py")]
    if quick:
        cmd.append("--quick")
    else:   # up to 8192; the quadratic paths ('xla', 'jax') only compiled (memory) at 8192
        cmd += ["--seq", "512,1024,2048,4096,8192", "--xla-max-seq", "4096"]
    print(f"# attention: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"attention benchmark failed ({proc.returncode}): "
                           + (proc.stderr or proc.stdout)[-500:])
    data = json.loads((common.RESULTS_DIR / "attention.json").read_text())
    md = (common.RESULTS_DIR / "attention.md").read_text()
    # the table and the growth summary, without the file's own title
    data["markdown"] = "\n".join(line for line in md.splitlines() if not line.startswith("# "))
    return data


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (minutes)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run, of {','.join(SECTIONS)}")
    args = p.parse_args(argv)
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")

    from benchmarks import compile_time, decode_gpt2, matmul_floor, train

    started = time.perf_counter()
    results: dict[str, dict] = {}
    failures: list[str] = []
    for section in sections:
        t0 = time.perf_counter()
        try:
            if section == "train":
                ns = argparse.Namespace(quick=args.quick, families=None, rounds=3 if args.quick else 9,
                                        warmup=1 if args.quick else 2, no_compile=False, no_data=False)
                results[section] = train.run(ns)
                stem, title = "train", "Train step"
            elif section == "floor":
                ns = matmul_floor.parse_args(matmul_floor.QUICK_ARGS if args.quick else [])
                results[section] = matmul_floor.run(ns)
                stem, title = "matmul_floor", "Matmul floor"
            elif section == "decode":
                ns = argparse.Namespace(batches="1,16", prompt_len=32,
                                        new_tokens=32 if args.quick else 128,
                                        repeats=1 if args.quick else 5, seed=0, logit_scale=4.0)
                results[section] = decode_gpt2.run(ns)
                stem, title = "decode_gpt2", "Decode"
            elif section == "attention":
                results[section] = run_attention(args.quick)
                stem = None
            else:
                ns = argparse.Namespace(quick=args.quick, seq=256, batch=8, repeats=1)
                results[section] = compile_time.run(ns)
                stem, title = "compile_time", "Compile time"
            if stem:
                common.write_results(stem, results[section], f"# {title}\n\n" + results[section]["markdown"])
        except Exception as e:  # noqa: BLE001 - one failing section must not lose the others
            failures.append(f"{section}: {type(e).__name__}: {e}")
            results[section] = {"error": f"{type(e).__name__}: {e}"[:1000]}
            print(f"  {section} FAILED: {e}", flush=True)
        results[section]["section_s"] = time.perf_counter() - t0
        print(f"# {section} done in {results[section]['section_s']:.0f} s", flush=True)

    elapsed = time.perf_counter() - started
    machine = common.machine_info()
    titles = {"train": "Train step (ours vs HF PyTorch eager / torch.compile)",
              "floor": "The GPT step's matmuls alone (XLA vs torch kernels)",
              "decode": "KV-cache decoding, GPT-2 124M (ours vs HF generate)",
              "attention": "Attention forward+backward vs sequence length",
              "compile": "Compile time, unrolled vs scan over layers"}
    md = [f"# Benchmark suite ({machine['date']})", "",
          f"`python -m benchmarks{' --quick' if args.quick else ''}` on {machine['cpu']} "
          f"({machine['cpu_count']} cores), backend {machine['backend']}, jax {machine['jax']}, "
          f"torch {machine.get('torch')}, transformers {machine.get('transformers')}; "
          f"host allocator tuned: {machine['malloc_tuned']}; load average at the end "
          f"{machine['load_average_1_5_15min']}; total {elapsed / 60:.1f} min.", ""]
    for section in sections:
        md += [f"## {titles[section]}", ""]
        r = results[section]
        md += [r.get("markdown") or f"FAILED: {r.get('error')}", ""]
    payload = {"benchmark": "suite", "quick": args.quick, "machine": machine,
               "elapsed_s": elapsed, "sections": results}
    js, mdp = common.write_results("suite", payload, "\n".join(md))
    print("\n".join(md))
    print(f"wrote {js} and {mdp}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
