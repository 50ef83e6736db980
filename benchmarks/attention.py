"""Benchmark the implementations of ``dot_product_attention``: time, memory, accuracy.

For every implementation available on the current backend and every sequence length
(self-attention, T = S, ``causal=True``) this measures

* **fwd+bwd time**: a jitted function returning the gradients of ``sum(out * ct)`` with
  respect to q, k and v (``ct`` a fixed random cotangent) and, as an auxiliary output,
  ``out`` itself. It is lowered and compiled ahead of time (reported separately as
  "compile s"), called once to warm up, then timed as the median of ``--repeats`` calls,
  each ended by ``block_until_ready``.
* **memory**: from the compiled executable's ``memory_analysis()``:
  ``temp`` = ``temp_size_in_bytes`` (XLA's scratch buffers: logits, residuals saved for
  the backward pass, ...; the number that shows how an implementation scales), and
  ``peak est`` = ``temp + argument + output - alias`` bytes (everything the executable
  holds at once, assuming no overlap is exploited between them). On GPU it also records
  ``jax.devices()[0].memory_stats()["peak_bytes_in_use"]``; that counter is a process-wide
  high-water mark, so by default each configuration then runs in its own subprocess
  (``--isolate``). With ``--isolate`` on Linux, the child's measured "RSS delta" (peak
  resident set size minus the resident size just before the first execution) is also
  reported: on CPU it catches memory that ``memory_analysis()`` does not see (the
  YNNPACK library fusions of XLA:CPU, see ``--cpu-library-fusions``).
* **accuracy**: max abs difference of ``out`` and of the gradients against the ``"xla"``
  reference at the same length (when the reference was run).

The ``"xla"`` path (and ``"jax"`` unless it is cuDNN, i.e. off GPU or in fp32) materialises
(B, N, T, T) fp32 logits; past ``--xla-max-seq`` those implementations are compiled for
``memory_analysis()`` only, not executed.

Results: a markdown table on stdout, plus ``benchmarks/results/attention.json`` and
``benchmarks/results/attention.md``.

Usage::

    python benchmarks/attention.py                       # 512 ... 8192, ~3-4 min on 2 CPU cores
    python benchmarks/attention.py --quick               # two short lengths, < 1 min
    python benchmarks/attention.py --seq 1024,4096 --impls xla,chunked --heads 8
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from transformer_jax.layers.attention import IMPLEMENTATIONS, dot_product_attention  # noqa: E402

MiB = 2**20
DEFAULT_SEQ = (512, 1024, 2048, 4096, 8192)
QUICK_SEQ = (1024, 2048)  # 2 and 4 key blocks of the default chunk size
# XLA:CPU (jax 0.10) hands dots fused with their consumers to YNNPACK; the intermediates
# of such library fusions live inside YNNPACK, not in XLA's buffer assignment, so
# memory_analysis() does not count them. This (experimental) flag turns those fusions off.
NO_CPU_LIBRARY_FUSIONS_FLAG = "--xla_cpu_experimental_ynn_fusion_type="


# ----------------------------------------------------------------------------- config

@dataclasses.dataclass(frozen=True)
class Config:
    """Problem shape and measurement settings shared by every run."""
    batch: int
    heads: int
    head_dim: int
    dtype: str
    q_chunk: int
    kv_chunk: int
    repeats: int
    xla_max_seq: int

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)


def is_quadratic(impl: str, cfg: Config) -> bool:
    """Whether ``impl`` materialises the full (B, N, T, S) logits here.

    ``"jax"`` only becomes cuDNN flash attention on GPU for fp16/bf16 inputs; elsewhere it
    is the same XLA code as ``"xla"``.
    """
    if impl == "xla":
        return True
    if impl == "jax":
        return not (jax.default_backend() == "gpu" and cfg.dtype in ("float16", "bfloat16"))
    return False


def available_impls(requested: list[str]) -> tuple[list[str], list[str]]:
    """Filter ``requested`` to what runs on this backend; returns (impls, notes)."""
    impls, notes = [], []
    for impl in requested:
        if impl not in IMPLEMENTATIONS:
            raise SystemExit(f"unknown implementation {impl!r}; choose from {IMPLEMENTATIONS}")
        if impl == "cudnn" and jax.default_backend() != "gpu":
            notes.append(f"skipping 'cudnn': it needs a GPU (backend is {jax.default_backend()!r})")
            continue
        impls.append(impl)
    # "xla" first: it is the reference the others are compared against.
    impls.sort(key=lambda name: name != "xla")
    return impls, notes


# ----------------------------------------------------------------------------- one run

def make_inputs(seq: int, cfg: Config, seed: int = 0):
    """Deterministic q, k, v and output cotangent of shape (B, seq, N, H)."""
    shape = (cfg.batch, seq, cfg.heads, cfg.head_dim)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(k, shape, jnp.float32).astype(cfg.jnp_dtype) for k in keys)


def make_step(impl: str, cfg: Config):
    """(q, k, v, ct) -> ((dq, dk, dv), out): grads of sum(out * ct), out as aux."""
    # --q-chunk/--kv-chunk size the "chunked" blocks; "pallas" keeps its per-platform
    # defaults (flash_attention.DEFAULT_BLOCK_SIZES), sized for GPU/TPU on-chip memory.
    chunks = dict(q_chunk=cfg.q_chunk, kv_chunk=cfg.kv_chunk) if impl == "chunked" else {}
    attention = partial(dot_product_attention, causal=True, implementation=impl, **chunks)

    def loss(q, k, v, ct):
        out = attention(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)


def current_rss_bytes() -> int | None:
    """Resident set size of this process now (Linux), else None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_bytes() -> int:
    """High-water resident set size of this process (ru_maxrss: KiB on Linux, B on macOS)."""
    scale = 1 if platform.system() == "Darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def device_memory_stats() -> dict | None:
    """The default device's allocator statistics, or None where the backend has none."""
    try:
        return jax.devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - some backends raise instead of returning None
        return None


def measure(impl: str, seq: int, cfg: Config) -> tuple[dict, dict | None]:
    """Compile, analyse and (unless skipped) time one (implementation, length).

    Returns the result record and, when executed, the arrays used for the accuracy check
    ({"out", "dq", "dk", "dv"} as fp32 numpy arrays).
    """
    record: dict = {"impl": impl, "seq": seq}
    q, k, v, ct = make_inputs(seq, cfg)

    t0 = time.perf_counter()
    lowered = jax.jit(make_step(impl, cfg)).lower(q, k, v, ct)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    record["lower_s"] = t1 - t0
    record["compile_s"] = t2 - t0  # trace + lower + XLA compile

    mem = compiled.memory_analysis()
    if mem is not None:
        record["temp_bytes"] = int(mem.temp_size_in_bytes)
        record["argument_bytes"] = int(mem.argument_size_in_bytes)
        record["output_bytes"] = int(mem.output_size_in_bytes)
        record["alias_bytes"] = int(mem.alias_size_in_bytes)
        record["peak_est_bytes"] = (record["temp_bytes"] + record["argument_bytes"]
                                    + record["output_bytes"] - record["alias_bytes"])

    if is_quadratic(impl, cfg) and seq > cfg.xla_max_seq:
        record["skipped"] = f"not executed: T > --xla-max-seq={cfg.xla_max_seq}"
        return record, None

    record["rss_before_run_bytes"] = current_rss_bytes()
    (dq, dk, dv), out = jax.block_until_ready(compiled(q, k, v, ct))  # warm-up
    times = []
    for _ in range(cfg.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, ct))
        times.append(time.perf_counter() - start)
    record["times_ms"] = [1e3 * t for t in times]
    record["fwd_bwd_ms"] = 1e3 * statistics.median(times)

    stats = device_memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        record["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
    arrays = {name: np.asarray(x, np.float32)
              for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}
    return record, arrays


def compare(arrays: dict, reference: dict) -> dict:
    """Max abs differences of the output and of the gradients against the reference."""
    return {
        "max_abs_diff_out": float(np.max(np.abs(arrays["out"] - reference["out"]))),
        "max_abs_diff_grad": max(float(np.max(np.abs(arrays[g] - reference[g])))
                                 for g in ("dq", "dk", "dv")),
    }


# ----------------------------------------------------------------------------- isolation

def run_isolated(impl: str, seq: int, cfg: Config, workdir: Path) -> tuple[dict, dict | None]:
    """Run ``measure`` in a fresh Python process, so per-process peaks are per-config."""
    arrays_path = workdir / f"{impl}_{seq}.npz"
    job = {"impl": impl, "seq": seq, "config": dataclasses.asdict(cfg),
           "arrays_path": str(arrays_path)}
    proc = subprocess.run([sys.executable, __file__, "--_worker", json.dumps(job)],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"impl": impl, "seq": seq,
                "error": f"worker exited with {proc.returncode}: {' | '.join(tail)}"}, None
    record = json.loads(lines[-1][len("RESULT "):])
    arrays = dict(np.load(arrays_path)) if arrays_path.exists() else None
    return record, arrays


def worker_main(job_json: str) -> None:
    """Entry point of an isolated child: one measurement, result as a 'RESULT {json}' line."""
    job = json.loads(job_json)
    cfg = Config(**job["config"])
    record, arrays = measure(job["impl"], job["seq"], cfg)
    record["rss_peak_bytes"] = peak_rss_bytes()
    if record.get("rss_before_run_bytes") is not None:
        # Valid when the process peaked while executing (true unless the sizes are tiny).
        record["rss_run_delta_bytes"] = record["rss_peak_bytes"] - record["rss_before_run_bytes"]
    if arrays is not None:
        np.savez(job["arrays_path"], **arrays)
    print("RESULT " + json.dumps(record), flush=True)


# ----------------------------------------------------------------------------- report

def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.1f}"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def add_growth(records: list[dict]) -> None:
    """temp / peak-estimate growth of each implementation vs its previous (shorter) length."""
    previous: dict[str, dict] = {}
    for rec in sorted(records, key=lambda r: (r["impl"], r["seq"])):
        prev = previous.get(rec["impl"])
        for key in ("temp_bytes", "peak_est_bytes"):
            if prev and prev.get(key) and rec.get(key) is not None:
                rec[key.replace("_bytes", "_growth")] = rec[key] / prev[key]
        if rec.get("temp_bytes") is not None:
            previous[rec["impl"]] = rec


def markdown_table(records: list[dict], show_device_peak: bool, show_rss: bool) -> str:
    header = ["impl", "T", "compile s", "fwd+bwd ms", "temp MiB", "temp growth",
              "peak est MiB", "max abs diff out", "max abs diff grad"]
    if show_device_peak:
        header.append("device peak MiB")
    if show_rss:
        header.append("RSS delta MiB")
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in records:
        if "error" in r:
            rows.append(f"| {r['impl']} | {r['seq']} | error: {r['error']} |")
            continue
        ms = "not run" if "skipped" in r else _num(r.get("fwd_bwd_ms"), ",.1f")
        growth = r.get("temp_growth")
        cells = [r["impl"], str(r["seq"]), _num(r.get("compile_s"), ".2f"), ms,
                 _mib(r.get("temp_bytes")), "-" if growth is None else f"{growth:.2f}x",
                 _mib(r.get("peak_est_bytes")), _num(r.get("max_abs_diff_out"), ".2e"),
                 _num(r.get("max_abs_diff_grad"), ".2e")]
        if show_device_peak:
            cells.append(_mib(r.get("device_peak_bytes")))
        if show_rss:
            cells.append(_mib(r.get("rss_run_delta_bytes")))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def growth_summary(records: list[dict], chunked_target: float = 2.2) -> tuple[dict, str]:
    """Memory growth between the two largest lengths, chunked vs xla, on temp bytes."""
    by_impl: dict[str, dict[int, dict]] = {}
    for r in records:
        if r.get("temp_bytes"):
            by_impl.setdefault(r["impl"], {})[r["seq"]] = r
    summary: dict = {}
    lines = []
    common = sorted(set(by_impl.get("chunked", {})) & set(by_impl.get("xla", {})))
    if len(common) < 2:
        return summary, "(growth summary needs 'chunked' and 'xla' at >= 2 common lengths)"
    lo, hi = common[-2], common[-1]
    summary["from_seq"], summary["to_seq"] = lo, hi
    for impl in ("xla", "chunked", "pallas"):
        if lo not in by_impl.get(impl, {}) or hi not in by_impl[impl]:
            continue
        a, b = by_impl[impl][lo], by_impl[impl][hi]
        summary[impl] = {"temp_growth": b["temp_bytes"] / a["temp_bytes"],
                         "peak_est_growth": b["peak_est_bytes"] / a["peak_est_bytes"]}
        lines.append(f"- {impl:8s} temp {_mib(a['temp_bytes'])} -> {_mib(b['temp_bytes'])} MiB: "
                     f"x{summary[impl]['temp_growth']:.2f} "
                     f"(peak est x{summary[impl]['peak_est_growth']:.2f})")
    ratio = summary["xla"]["temp_growth"] / summary["chunked"]["temp_growth"]
    summary["xla_over_chunked_growth"] = ratio
    lines.append(f"- xla grows {ratio:.2f}x faster than chunked from T={lo} to T={hi}")
    if (lo, hi) == (4096, 8192):
        ok = summary["chunked"]["temp_growth"] <= chunked_target
        summary["chunked_target"] = chunked_target
        summary["chunked_meets_target"] = ok
        lines.append(f"- target (chunked temp growth 4k->8k <= {chunked_target}x): "
                     f"{'MET' if ok else 'NOT MET'}")
    head = f"Memory growth T={lo} -> T={hi} (on temp_size_in_bytes; ideal: linear = {hi / lo:.1f}x, " \
           f"quadratic = {(hi / lo) ** 2:.1f}x):"
    return summary, head + "\n" + "\n".join(lines)


# ----------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"lengths {','.join(map(str, QUICK_SEQ))} and 2 repeats (< 1 min)")
    p.add_argument("--seq", type=str, default=None,
                   help=f"comma-separated lengths (default {','.join(map(str, DEFAULT_SEQ))})")
    p.add_argument("--impls", type=str, default=None,
                   help=f"comma-separated implementations (default: all of {','.join(IMPLEMENTATIONS)} "
                        "that run on this backend)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4,
                   help="query = key/value heads N (default 4: keeps the xla path at T=8192 to "
                        "~4 GiB of temp (~8 GiB measured) and the default run to ~4 min "
                        "on 2 CPU cores)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", type=str, default=None,
                   help="input dtype (default float32 on CPU, bfloat16 on GPU/TPU)")
    p.add_argument("--q-chunk", type=int, default=512)
    p.add_argument("--kv-chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=None, help="timed calls (default 3, quick 2)")
    p.add_argument("--xla-max-seq", type=int, default=8192,
                   help="compile (for memory_analysis) but do not execute the quadratic "
                        "implementations ('xla', 'jax') beyond this length")
    p.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                   help="one subprocess per configuration (auto: on GPU only, where the "
                        "device peak counter is process-wide)")
    p.add_argument("--cpu-library-fusions", choices=("default", "off"), default="default",
                   help="off: add XLA_FLAGS=" + NO_CPU_LIBRARY_FUSIONS_FLAG + " so that XLA:CPU "
                        "does not hand dots to YNNPACK fusions, whose intermediates "
                        "memory_analysis() does not count (changes the code being timed)")
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--_worker", type=str, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._worker is not None:
        worker_main(args._worker)
        return

    started = time.perf_counter()
    if args.cpu_library_fusions == "off":  # before the backend starts; children inherit it
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                   + NO_CPU_LIBRARY_FUSIONS_FLAG).strip()
    backend = jax.default_backend()
    if args.seq:
        seqs = sorted({int(s) for s in args.seq.split(",")})
    else:
        seqs = list(QUICK_SEQ if args.quick else DEFAULT_SEQ)
    requested = args.impls.split(",") if args.impls else list(IMPLEMENTATIONS)
    impls, notes = available_impls([s.strip() for s in requested if s.strip()])
    cfg = Config(batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                 dtype=args.dtype or ("float32" if backend == "cpu" else "bfloat16"),
                 q_chunk=args.q_chunk, kv_chunk=args.kv_chunk,
                 repeats=args.repeats or (2 if args.quick else 3),
                 xla_max_seq=args.xla_max_seq)
    isolate = args.isolate == "yes" or (args.isolate == "auto" and backend == "gpu")
    if backend == "cpu" and "pallas" in impls:
        notes.append("'pallas' on CPU runs its kernels in interpret mode (XLA loops over the "
                     "kernel grid): exact, but its time and memory say nothing about GPU/TPU")
    if backend == "cpu" and "jax" in impls:
        notes.append("'jax' on CPU is jax.nn.dot_product_attention's XLA path (quadratic, "
                     "like 'xla')")
    if backend == "cpu" and args.cpu_library_fusions == "default":
        notes.append("XLA:CPU runs dot fusions in YNNPACK, whose intermediates memory_analysis() "
                     "does not count: for 'xla'/'jax' temp is then a lower bound (see "
                     "--isolate yes for measured RSS, --cpu-library-fusions off)")
    if not isolate and backend != "cpu":
        notes.append("device peak_bytes_in_use is a process-wide high-water mark here "
                     "(use --isolate yes for per-configuration peaks)")

    device = jax.devices()[0]
    print(f"# attention benchmark: backend={backend} device={device.device_kind} "
          f"jax={jax.__version__}")
    print(f"# B={cfg.batch} N={cfg.heads} H={cfg.head_dim} dtype={cfg.dtype} causal=True "
          f"q_chunk={cfg.q_chunk} kv_chunk={cfg.kv_chunk} repeats={cfg.repeats} "
          f"isolate={isolate} impls={','.join(impls)} T={','.join(map(str, seqs))}")
    for note in notes:
        print(f"# note: {note}")

    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="attn_bench_") as tmp:
        for seq in seqs:
            reference = None
            for impl in impls:
                try:
                    if isolate:
                        record, arrays = run_isolated(impl, seq, cfg, Path(tmp))
                    else:
                        record, arrays = measure(impl, seq, cfg)
                except Exception as exc:  # noqa: BLE001 - e.g. out of memory; keep going
                    record, arrays = {"impl": impl, "seq": seq,
                                      "error": f"{type(exc).__name__}: {str(exc)[:200]}"}, None
                if impl == "xla":
                    reference = arrays
                elif arrays is not None and reference is not None:
                    record.update(compare(arrays, reference))
                records.append(record)
                status = record.get("error") or record.get("skipped") or \
                    f"{record['fwd_bwd_ms']:,.1f} ms"
                print(f"  {impl:8s} T={seq:6d}  compile {_num(record.get('compile_s'), '.2f')} s  "
                      f"temp {_mib(record.get('temp_bytes'))} MiB  {status}", flush=True)

    add_growth(records)
    show_device_peak = any("device_peak_bytes" in r for r in records)
    show_rss = any("rss_run_delta_bytes" in r for r in records)
    table = markdown_table(records, show_device_peak, show_rss)
    summary, summary_text = growth_summary(records)
    elapsed = time.perf_counter() - started

    legend = ("temp = memory_analysis().temp_size_in_bytes of the compiled fwd+bwd executable; "
              "peak est = temp + argument + output - alias bytes; temp growth = temp / temp at "
              "the previous length of the same impl; diffs are max |x - x_xla| at the same T "
              "(out and max over dq, dk, dv).")
    if show_device_peak:
        legend += " device peak = memory_stats()['peak_bytes_in_use']."
    if show_rss:
        legend += (" RSS delta = peak resident set size of the isolated worker minus its size "
                   "just before the first execution (what executing really took).")
    print()
    print(table)
    print()
    print(summary_text)
    print()
    print(legend)
    print(f"\ntotal runtime {elapsed:.1f} s")

    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "backend": backend, "device_kind": device.device_kind, "jax": jax.__version__,
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "config": dataclasses.asdict(cfg), "seqs": seqs, "impls": impls,
        "isolate": isolate, "xla_flags": os.environ.get("XLA_FLAGS", ""), "notes": notes,
        "runtime_s": elapsed,
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "attention.json").write_text(
        json.dumps({"meta": meta, "results": records, "growth": summary}, indent=2) + "\n")
    md = [f"# Attention benchmark ({meta['date']})", "",
          f"backend `{backend}` ({device.device_kind}), jax {jax.__version__}, "
          f"{os.cpu_count()} CPUs; B={cfg.batch} N={cfg.heads} H={cfg.head_dim} "
          f"{cfg.dtype}, causal, q_chunk={cfg.q_chunk} kv_chunk={cfg.kv_chunk}, "
          f"median of {cfg.repeats}; runtime {elapsed:.0f} s.", ""]
    md += [f"- note: {n}" for n in notes] + ([""] if notes else [])
    md += [table, "", summary_text, "", legend, ""]
    (args.out_dir / "attention.md").write_text("\n".join(md))
    print(f"wrote {args.out_dir / 'attention.json'} and {args.out_dir / 'attention.md'}")


if __name__ == "__main__":
    main()
