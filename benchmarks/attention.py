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

**Long-context mode** (``--long``, issue 22): T = 1k, 2k, ..., 64k, B=1, N=4, H=64, causal,
fp32, for the paths (``--paths``)

* ``xla``: the reference, (B, N, T, T) logits: O(T^2) time and memory;
* ``chunked``: full causal ``"chunked"`` attention: O(T) memory, O(T^2) time;
* ``window``: a causal sliding window of ``--window`` keys (``AttentionPattern("window")``),
  ``"chunked"`` on CPU (blocks of ``--window-chunk``) and ``"pallas"`` on GPU/TPU, which
  skip the key blocks outside the window: O(T W);
* ``strided``: Child et al.'s strided sparse pattern (``AttentionPattern("strided",
  --stride)``: the ``stride`` nearest keys plus every stride-th earlier key), same
  implementations: its (query, key) pairs are T (stride + T / stride), still O(T^2) for a
  fixed stride (and a block of queries x keys wider than the stride always holds one of
  its diagonals, so with the default 512-blocks no block is skipped);
* ``linear``: ``attention="linear"`` (linear attention, a chunked scan when causal):
  O(T).

The lengths of one path are timed in alternation (the suite's rule, ``common.alternate``):
round after round, each round calling every length once (short ones several times in a
row, averaged), at least ``--repeats`` rounds (default 5) and more (up to 7) while they
fit in ``--time-budget`` seconds; a length's time is the median over rounds, and a growth
ratio the median over rounds of the two lengths' ratio in the same round, so that the
shared machine's slow spells hit both sides of a ratio alike. The process CPU time of the
same calls (all threads; unlike wall time, not inflated while other processes hold the
cores) is recorded beside it, with its own ratios, as a check on the wall-time ones.

The O(T^2) paths (xla, chunked, strided) run up to ``--quadratic-max-seq`` (8192), are
compiled for ``memory_analysis()`` only up to ``--compile-max-seq`` and skipped beyond;
each row says which. Accuracy: every softmax path against ``"xla"`` with the same pattern
(as a mask), ``linear`` against the naive O(T^2) causal linear attention written here,
up to ``--check-max-seq``. Then, per path and doubling of T, the time and temp-memory
ratios, and PASS/FAIL lines for the issue's targets (window and linear grow at most 2.2x in
memory and 2.3x in time per doubling; a benchmark result, not an assertion), next to the
ratio of the exact work (the allowed (query, key) pairs). Results:
``benchmarks/results/attention_long.{json,md}`` and a log-log plot (``--plot``, default
``docs/attention_scaling.png``).

Usage::

    python benchmarks/attention.py                       # 512 ... 8192, ~3-4 min on 2 CPU cores
    python benchmarks/attention.py --quick               # two short lengths, < 1 min
    python benchmarks/attention.py --seq 1024,4096 --impls xla,chunked --heads 8
    python benchmarks/attention.py --long                # 1k ... 64k, ~5 min on 2 CPU cores
    python benchmarks/attention.py --long --paths window,linear --seq 4096,8192
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
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

from transformer_jax.layers.attention import dot_product_attention  # noqa: E402
from transformer_jax.layers.attention_dispatch import IMPLEMENTATIONS  # noqa: E402
from transformer_jax.layers.masks import AttentionPattern  # noqa: E402
from transformer_jax.layers.chunked_attention import default_chunk  # noqa: E402
from benchmarks import common  # noqa: E402

MiB = 2**20
DEFAULT_SEQ = (512, 1024, 2048, 4096, 8192)
QUICK_SEQ = (1024, 2048)  # 2 and 4 key blocks of the default chunk size
# XLA:CPU (jax 0.10) hands dots fused with their consumers to YNNPACK; the intermediates
# of such library fusions live inside YNNPACK, not in XLA's buffer assignment, so
# memory_analysis() does not count them. This (experimental) flag turns those fusions off.
NO_CPU_LIBRARY_FUSIONS_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
# --long (issue 22)
LONG_SEQ = tuple(1024 * 2**i for i in range(7))        # 1k ... 64k
LONG_PATHS = ("xla", "chunked", "window", "strided", "linear")
TARGET_PATHS = ("window", "linear")                     # the paths the issue wants O(T)
TARGET_MEMORY_GROWTH = 2.2                              # per doubling of T
TARGET_TIME_GROWTH = 2.3
ROUND_CALL_S = 0.25    # within a round, a length is called until ~this long (<= 10 calls)


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


def grad_step(attention):
    """(q, k, v, ct) -> ((dq, dk, dv), out): grads of sum(out * ct), out as aux."""
    def loss(q, k, v, ct):
        out = attention(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), out

    return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)


def make_step(impl: str, cfg: Config):
    """``grad_step`` of causal ``dot_product_attention`` with ``impl``."""
    # --q-chunk/--kv-chunk size the "chunked" blocks; "pallas" keeps its per-platform
    # defaults (flash_attention.DEFAULT_BLOCK_SIZES), sized for GPU/TPU on-chip memory.
    chunks = dict(q_chunk=cfg.q_chunk, kv_chunk=cfg.kv_chunk) if impl == "chunked" else {}
    return grad_step(partial(dot_product_attention, causal=True, attention_impl=impl, **chunks))


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


def compile_step(step, inputs, record: dict):
    """Lower and compile ``jax.jit(step)`` for ``inputs``; times and memory into ``record``."""
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(*inputs)
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
    return compiled


def time_calls(compiled, inputs, record: dict, repeats: int):
    """One warm-up call, then ``repeats`` timed calls (each ended by ``block_until_ready``);
    their times and median into ``record``; returns the warm-up's outputs."""
    outputs = jax.block_until_ready(compiled(*inputs))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    record["times_ms"] = [1e3 * t for t in times]
    record["fwd_bwd_ms"] = 1e3 * statistics.median(times)
    return outputs


def as_arrays(outputs) -> dict:
    """((dq, dk, dv), out) -> {"out", "dq", "dk", "dv"} as fp32 numpy arrays."""
    (dq, dk, dv), out = outputs
    return {name: np.asarray(x, np.float32)
            for name, x in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}


def measure(impl: str, seq: int, cfg: Config) -> tuple[dict, dict | None]:
    """Compile, analyse and (unless skipped) time one (implementation, length).

    Returns the result record and, when executed, the arrays used for the accuracy check
    ({"out", "dq", "dk", "dv"} as fp32 numpy arrays).
    """
    record: dict = {"impl": impl, "seq": seq}
    inputs = make_inputs(seq, cfg)
    compiled = compile_step(make_step(impl, cfg), inputs, record)
    if is_quadratic(impl, cfg) and seq > cfg.xla_max_seq:
        record["skipped"] = f"not executed: T > --xla-max-seq={cfg.xla_max_seq}"
        return record, None

    record["rss_before_run_bytes"] = current_rss_bytes()
    outputs = time_calls(compiled, inputs, record, cfg.repeats)
    stats = device_memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        record["device_peak_bytes"] = int(stats["peak_bytes_in_use"])
    return record, as_arrays(outputs)


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


# ----------------------------------------------------------------------------- long context

@dataclasses.dataclass(frozen=True)
class LongPath:
    """One path of ``--long``: an implementation, maybe a pattern, maybe block sizes."""
    name: str
    attention_impl: str
    pattern: AttentionPattern | None = None
    chunks: tuple[int, int] | None = None      # (q_chunk, kv_chunk); None: the impl's own
    quadratic: bool = False                   # O(T^2) time: executed up to a max length
    attention: str = "softmax"                # or "linear" (linear attention)

    def function(self):
        chunks = {"q_chunk": self.chunks[0], "kv_chunk": self.chunks[1]} if self.chunks else {}
        return partial(dot_product_attention, causal=True, attention=self.attention,
                       attention_impl=self.attention_impl, pattern=self.pattern, **chunks)

    def describe(self) -> str:
        text = "linear" if self.attention == "linear" else self.attention_impl
        if self.pattern is not None:
            text += f", {self.pattern.kind} {self.pattern.size}"
        if self.chunks:
            text += f", blocks {self.chunks[0]}x{self.chunks[1]}"
        return text


@dataclasses.dataclass(frozen=True)
class LongSettings:
    """What ``--long`` runs, beyond the shared ``Config``."""
    paths: tuple[LongPath, ...]
    seqs: tuple[int, ...]
    quadratic_max_seq: int     # the O(T^2) paths are executed up to this T ...
    compile_max_seq: int       # ... compiled for memory_analysis() up to this one, then skipped
    check_max_seq: int         # accuracy references up to this T
    min_rounds: int            # timing rounds per path: at least this many, then more ...
    max_rounds: int
    time_budget_s: float       # ... while the path's rounds took less than this


def long_paths(names: list[str], args: argparse.Namespace, backend: str) -> list[LongPath]:
    """The ``--long`` paths by name; window and strided use ``"chunked"`` on CPU and the
    Pallas kernel on GPU/TPU (with its per-platform block sizes)."""
    block_impl = "chunked" if backend == "cpu" else "pallas"
    on_cpu = block_impl == "chunked"
    window_pattern = AttentionPattern("window", args.window)
    window_chunk = args.window_chunk or default_chunk(window_pattern)
    known = {
        "xla": LongPath("xla", "xla", quadratic=True),
        "chunked": LongPath("chunked", "chunked", chunks=(args.q_chunk, args.kv_chunk),
                            quadratic=True),
        "window": LongPath("window", block_impl, window_pattern,
                           chunks=(window_chunk, window_chunk) if on_cpu else None),
        "strided": LongPath("strided", block_impl, AttentionPattern("strided", args.stride),
                            chunks=(args.q_chunk, args.kv_chunk) if on_cpu else None,
                            quadratic=True),
        "linear": LongPath("linear", "auto", attention="linear"),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown --paths {unknown}; choose from {LONG_PATHS}")
    return [known[n] for n in sorted(set(names), key=LONG_PATHS.index)]


def allowed_pairs(path: LongPath, seq: int) -> int | None:
    """The (query, key) pairs a causal softmax path must compute at length ``seq``: its exact
    work, whatever the blocks (None for linear attention, which forms no pairs)."""
    i = np.arange(seq, dtype=np.int64)
    if path.attention == "linear":
        return None
    if path.pattern is None:
        return int(np.sum(i + 1))
    size = path.pattern.size
    if path.pattern.kind == "window":
        return int(np.sum(np.minimum(i + 1, size)))
    if path.pattern.kind == "strided":       # |i - j| < size, or j = i - m * size (m >= 1)
        return int(np.sum(np.minimum(i + 1, size) + i // size))
    return int(np.asarray(path.pattern.mask(seq, causal=True)).sum())


def causal_linear_reference(q, k, v, eps: float = 1e-6):
    """Causal linear attention (elu + 1 features) with the whole (T, T) matrix: O(T^2),
    written independently of ``linear_attention.py`` as its accuracy reference."""
    hp = jax.lax.Precision.HIGHEST
    qf, kf = jax.nn.elu(q.astype(jnp.float32)) + 1, jax.nn.elu(k.astype(jnp.float32)) + 1
    t = q.shape[1]
    a = jnp.einsum("btnh,bsnh->bnts", qf, kf, precision=hp) * jnp.tril(jnp.ones((t, t)))
    num = jnp.einsum("bnts,bsnv->btnv", a, v.astype(jnp.float32), precision=hp)
    den = jnp.sum(a, axis=-1).transpose(0, 2, 1)                  # (B, T, N)
    return (num / (den[..., None] + eps)).astype(v.dtype)


def reference_for(path: LongPath):
    """(key, attention) of the path's accuracy reference; None for ``xla`` itself."""
    if path.name == "xla":
        return None
    if path.attention == "linear":
        return "naive O(T^2) linear attention", causal_linear_reference
    if path.pattern is None:
        return "xla", partial(dot_product_attention, causal=True, attention_impl="xla")
    return (f"xla + {path.pattern.kind} mask",
            partial(dot_product_attention, causal=True, attention_impl="xla",
                    pattern=path.pattern))


def prepare_long(path: LongPath, seq: int, cfg: Config, lc: LongSettings, cache: dict):
    """Compile one (path, length), and unless it is O(T^2) beyond --quadratic-max-seq, call
    it once (warm-up: finiteness, and the accuracy check up to --check-max-seq).

    Returns (record, (compiled, inputs) to time, or None); the record's "status" says
    whether it will run or was compiled only (memory) or skipped, and why."""
    record: dict = {"path": path.name, "impl": path.describe(), "seq": seq,
                    "pairs": allowed_pairs(path, seq)}
    if path.quadratic and seq > lc.compile_max_seq:
        record.update(status="skipped", note=f"O(T^2): T > --compile-max-seq={lc.compile_max_seq}")
        return record, None
    inputs = make_inputs(seq, cfg)
    compiled = compile_step(grad_step(path.function()), inputs, record)
    if path.quadratic and seq > lc.quadratic_max_seq:
        record.update(status="compile only",
                      note=f"O(T^2) time: T > --quadratic-max-seq={lc.quadratic_max_seq}; "
                           "memory_analysis() of the compiled step only")
        return record, None
    start = time.perf_counter()
    arrays = as_arrays(jax.block_until_ready(compiled(*inputs)))
    record["warmup_ms"] = 1e3 * (time.perf_counter() - start)
    record["status"] = "run"
    record["finite"] = all(bool(np.all(np.isfinite(a))) for a in arrays.values())
    if seq <= lc.check_max_seq:
        if path.name == "xla":
            cache[("xla", seq)] = arrays
        else:
            record.update(check_long(path, seq, cfg, arrays, cache))
    return record, (compiled, inputs)


def check_long(path: LongPath, seq: int, cfg: Config, arrays: dict, cache: dict) -> dict:
    """Max abs differences against the path's reference (computed once per reference and
    length, untimed; ``cache`` holds them, and the ``xla`` path's own arrays)."""
    ref = reference_for(path)
    if ref is None:
        return {}
    name, attention = ref
    if (name, seq) not in cache:
        cache[(name, seq)] = as_arrays(jax.jit(grad_step(attention))(*make_inputs(seq, cfg)))
    return {"reference": name, **compare(arrays, cache[(name, seq)])}


def time_rounds(runs: dict[int, tuple], lc: LongSettings) -> tuple[dict, dict, dict]:
    """Time the lengths of one path in alternation (``common.alternate``'s rule): each
    round calls every length, the first one rotating, each call after a pause. In the
    first round a length is called until its calls took ROUND_CALL_S (at most 10 calls),
    in the later rounds as many times; its round time is the mean of those calls (not the
    fastest: the minimum of more calls is lower, which would bias the ratios between a
    short length, called often, and a long one). Rounds: at least ``lc.min_rounds``, more
    (up to ``lc.max_rounds``) while they took less than ``lc.time_budget_s`` in all. A slow
    spell of the machine then hits the lengths of a round alike. Returns ({T: [wall
    seconds per round]}, {T: [process CPU seconds per round]}, {T: calls per round})."""
    seqs = sorted(runs)
    calls: dict[int, int] = {}
    wall: dict[int, list[float]] = {seq: [] for seq in seqs}
    cpu: dict[int, list[float]] = {seq: [] for seq in seqs}
    started = time.perf_counter()
    rounds = 0
    while rounds < lc.min_rounds or (rounds < lc.max_rounds
                                     and time.perf_counter() - started < lc.time_budget_s):
        for seq in seqs[rounds % len(seqs):] + seqs[:rounds % len(seqs)]:
            compiled, inputs = runs[seq]
            took, took_cpu = [], []
            while len(took) < calls.get(seq, 10) and (seq in calls or sum(took) < ROUND_CALL_S):
                time.sleep(common.SETTLE_S)
                cpu_start, start = time.process_time(), time.perf_counter()
                jax.block_until_ready(compiled(*inputs))
                took.append(time.perf_counter() - start)
                took_cpu.append(time.process_time() - cpu_start)
            calls.setdefault(seq, len(took))
            wall[seq].append(sum(took) / len(took))
            cpu[seq].append(sum(took_cpu) / len(took_cpu))
        rounds += 1
    return wall, cpu, calls


def run_long(cfg: Config, lc: LongSettings) -> list[dict]:
    """Path by path: compile and warm up every length, then time them in alternation;
    progress on stdout. (xla, first, leaves its arrays for chunked's accuracy check.)"""
    records, cache = [], {}
    for path in lc.paths:
        runs, mine = {}, {}
        for seq in lc.seqs:
            try:
                record, run = prepare_long(path, seq, cfg, lc, cache)
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory; keep going
                record, run = {"path": path.name, "impl": path.describe(), "seq": seq,
                               "status": "error",
                               "note": f"{type(exc).__name__}: {str(exc)[:200]}"}, None
            if run is not None:
                runs[seq] = run
            mine[seq] = record
            shown = (f"warm-up {record['warmup_ms']:,.1f} ms" if run is not None
                     else f"{record['status']}: {record.get('note', '')}")
            print(f"  {path.name:8s} T={seq:6d}  compile {_num(record.get('compile_s'), '.2f')} s  "
                  f"temp {_mib(record.get('temp_bytes'))} MiB  {shown}", flush=True)
        if runs:
            times, cpu, calls = time_rounds(runs, lc)
            for seq, round_s in times.items():
                mine[seq].update(round_ms=[1e3 * t for t in round_s], calls_per_round=calls[seq],
                                 fwd_bwd_ms=1e3 * statistics.median(round_s),
                                 round_cpu_ms=[1e3 * t for t in cpu[seq]],
                                 cpu_ms=1e3 * statistics.median(cpu[seq]))
            print(f"  {path.name:8s} {len(round_s)} rounds: " + ", ".join(
                f"T={seq} {mine[seq]['fwd_bwd_ms']:,.1f} ms" for seq in times), flush=True)
        records += list(mine.values())
    return records


def long_growth(records: list[dict]) -> dict[str, list[dict]]:
    """Per path, each step to the next length: the time ratio (the median, and quartiles,
    of the ratios of the two lengths' times in the same round), the temp and the work
    (allowed pairs) ratios; also stored on the longer length's record (``time_growth``,
    ``temp_growth``, ``pairs_growth``)."""
    growth: dict[str, list[dict]] = {}
    by_path: dict[str, list[dict]] = {}
    for rec in records:
        by_path.setdefault(rec["path"], []).append(rec)
    for name, recs in by_path.items():
        recs = sorted(recs, key=lambda r: r["seq"])
        for prev, rec in itertools.pairwise(recs):
            step = {"from": prev["seq"], "to": rec["seq"]}
            if prev.get("round_ms") and rec.get("round_ms"):
                ratios = common.round_ratios(rec["round_ms"], prev["round_ms"])
                step.update(time=ratios["median"], time_q1=ratios["q1"], time_q3=ratios["q3"])
                rec["time_growth"] = ratios["median"]
                step["cpu"] = rec["cpu_growth"] = common.round_ratios(
                    rec["round_cpu_ms"], prev["round_cpu_ms"])["median"]
            for key, value in (("temp", "temp_bytes"), ("pairs", "pairs")):
                if prev.get(value) and rec.get(value) is not None:
                    step[key] = rec[key + "_growth"] = rec[value] / prev[value]
            growth.setdefault(name, []).append(step)
    return growth


def target_verdicts(growth: dict[str, list[dict]]) -> tuple[dict, list[str]]:
    """PASS/FAIL of the issue's targets: window and linear grow at most 2.2x in temp memory
    and 2.3x in time per doubling of T, at every doubling measured."""
    verdicts: dict = {}
    lines = []
    for name in TARGET_PATHS:
        for key, target in (("temp", TARGET_MEMORY_GROWTH), ("time", TARGET_TIME_GROWTH)):
            steps = [s for s in growth.get(name, []) if s["to"] == 2 * s["from"] and key in s]
            label = f"{name} {'memory' if key == 'temp' else 'time'} per doubling <= {target}x"
            if not steps:
                verdicts[f"{name}_{key}"] = None
                lines.append(f"N/A  {label}: no doubling measured")
                continue
            worst = max(steps, key=lambda s: s[key])
            ok = worst[key] <= target
            verdicts[f"{name}_{key}"] = {"pass": ok, "max": worst[key], "target": target,
                                         "ratios": [s[key] for s in steps]}
            spread = (f", rounds {worst['time_q1']:.2f}-{worst['time_q3']:.2f}"
                      if key == "time" else "")
            line = (f"{'PASS' if ok else 'FAIL'} {label}: max {worst[key]:.2f}x "
                    f"({worst['from']}->{worst['to']}{spread}) over {len(steps)} doublings "
                    f"{steps[0]['from']}->{steps[-1]['to']}: "
                    + " ".join(f"{s[key]:.2f}" for s in steps))
            if key == "time":
                line += " (process CPU time: " + " ".join(f"{s['cpu']:.2f}" for s in steps) + ")"
            bad = [s for s in steps if s[key] > target and s.get("pairs", 0) > target]
            if bad:
                line += ("; the exact work (allowed (query, key) pairs) itself grows "
                         + ", ".join(f"{s['pairs']:.2f}x at {s['from']}->{s['to']}" for s in bad))
            lines.append(line)
    judged = [v["pass"] for v in verdicts.values() if v is not None]
    verdicts["all_pass"] = bool(judged) and all(judged)
    lines.append(f"{'PASS' if verdicts['all_pass'] else 'FAIL'} issue 22 targets (window, "
                 f"linear: memory <= {TARGET_MEMORY_GROWTH}x, time <= {TARGET_TIME_GROWTH}x "
                 "per doubling)")
    return verdicts, lines


def long_table(records: list[dict]) -> str:
    header = ["path", "impl", "T", "status", "compile s", "fwd+bwd ms", "calls x rounds",
              "time x", "cpu x", "temp MiB", "temp x", "pairs x", "max abs diff out",
              "max abs diff grad"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]

    def ratio(r, key):
        return "-" if r.get(key) is None else f"{r[key]:.2f}"

    for r in records:
        timed = r.get("round_ms") is not None
        cells = [r["path"], r["impl"], str(r["seq"]), r.get("status", "-"),
                 _num(r.get("compile_s"), ".2f"),
                 _num(r.get("fwd_bwd_ms"), ",.1f") if timed else "not run",
                 f"{r['calls_per_round']} x {len(r['round_ms'])}" if timed else "-",
                 ratio(r, "time_growth"), ratio(r, "cpu_growth"), _mib(r.get("temp_bytes")),
                 ratio(r, "temp_growth"),
                 ratio(r, "pairs_growth"), _num(r.get("max_abs_diff_out"), ".1e"),
                 _num(r.get("max_abs_diff_grad"), ".1e")]
        if r.get("status") == "error":
            cells[3] = f"error: {r.get('note', '')}"
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def growth_lines(growth: dict[str, list[dict]]) -> list[str]:
    """One line per path: its time and temp ratios per step of T."""
    lines = []
    for name in LONG_PATHS:
        for key, label in (("time", "time"), ("cpu", "cpu time"), ("temp", "temp memory")):
            steps = [s for s in growth.get(name, []) if key in s]
            if steps:
                lines.append(f"- {name:8s} {label:11s} x prev: " + ", ".join(
                    f"{s['from'] // 1024}k->{s['to'] // 1024}k {s[key]:.2f}" if s["from"] >= 1024
                    else f"{s['from']}->{s['to']} {s[key]:.2f}" for s in steps))
    return lines


def _plot_series(records: list[dict]):
    """Per path: (impl, timed (T, s), memory (T, MiB) of run lengths, of compile-only ones)."""
    series = {}
    for name in LONG_PATHS:
        recs = sorted((r for r in records if r["path"] == name), key=lambda r: r["seq"])
        ran = [r for r in recs if r.get("round_ms")]
        mem = [r for r in recs if r.get("temp_bytes") is not None]
        if not mem:
            continue
        series[name] = (recs[0]["impl"],
                        [(r["seq"], r["fwd_bwd_ms"] / 1e3) for r in ran],
                        [(r["seq"], r["temp_bytes"] / MiB) for r in mem if r in ran],
                        [(r["seq"], r["temp_bytes"] / MiB) for r in mem if r not in ran])
    return series


def plot_long(records: list[dict], path: Path, title: str) -> None:
    """Log-log time and temp memory against T, one line per path (Agg backend); memory of
    compile-only lengths dashed with open markers; dotted guides of slope 1 and 2."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    series = _plot_series(records)
    seqs = sorted({r["seq"] for r in records})
    for name, (impl, timed, mem_run, mem_compiled) in series.items():
        style = {"color": f"C{LONG_PATHS.index(name)}", "marker": "osD^v"[LONG_PATHS.index(name)]}
        if timed:
            ax_t.plot(*zip(*timed), label=f"{name} ({impl})", **style)
        if mem_run:
            ax_m.plot(*zip(*mem_run), label=name, **style)
        if mem_compiled:
            ax_m.plot(*zip(*(mem_run[-1:] + mem_compiled)), linestyle="--", mfc="none",
                      label=f"{name}, compiled only", **style)
    for ax, points in ((ax_t, [p for s in series.values() for p in s[1]]),
                       (ax_m, [p for s in series.values() for p in s[2] + s[3]])):
        if len({t for t, _ in points}) > 1:
            t0, t1 = min(t for t, _ in points), max(t for t, _ in points)
            y0 = min(y for t, y in points if t == t0) / 3
            for slope, text in ((1, "∝ T"), (2, "∝ T²")):
                ax.plot([t0, t1], [y0, y0 * (t1 / t0) ** slope], color="gray", linestyle=":",
                        linewidth=1)
                ax.annotate(text, (t1, y0 * (t1 / t0) ** slope), color="gray", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(seqs, [f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in seqs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("sequence length T")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("fwd + bwd time, s")
    ax_m.set_ylabel("temp memory, MiB (memory_analysis)")
    ax_t.legend(fontsize=8)
    ax_m.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def long_settings(args: argparse.Namespace, backend: str) -> tuple[Config, LongSettings]:
    """``--long``'s Config (fp32 unless --dtype) and LongSettings from the arguments."""
    cfg = Config(batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                 dtype=args.dtype or "float32", q_chunk=args.q_chunk, kv_chunk=args.kv_chunk,
                 repeats=args.repeats or 5, xla_max_seq=args.quadratic_max_seq)
    names = args.paths.split(",") if args.paths else list(LONG_PATHS)
    seqs = sorted({int(s) for s in args.seq.split(",")}) if args.seq else list(LONG_SEQ)
    lc = LongSettings(paths=tuple(long_paths([n.strip() for n in names if n.strip()], args,
                                             backend)),
                      seqs=tuple(seqs), quadratic_max_seq=args.quadratic_max_seq,
                      compile_max_seq=args.compile_max_seq, check_max_seq=args.check_max_seq,
                      min_rounds=cfg.repeats, max_rounds=max(cfg.repeats, 7),
                      time_budget_s=args.time_budget)
    return cfg, lc


def long_main(args: argparse.Namespace) -> dict:
    """``--long``: run, print, write ``attention_long.{json,md}`` and the plot; the result."""
    started = time.perf_counter()
    backend = jax.default_backend()
    cfg, lc = long_settings(args, backend)
    cpu = {"model": common.cpu_model(), "isa": common.cpu_isa()}
    load_before = os.getloadavg()
    device = jax.devices()[0]
    print(f"# attention --long: backend={backend} device={device.device_kind} "
          f"jax={jax.__version__} cpu={cpu['model']} ({cpu['isa']}, {os.cpu_count()} cores) "
          f"load={load_before[0]:.2f}")
    print(f"# B={cfg.batch} N={cfg.heads} H={cfg.head_dim} dtype={cfg.dtype} causal=True "
          f"T={','.join(map(str, lc.seqs))}; paths: "
          + "; ".join(f"{p.name} = {p.describe()}" for p in lc.paths))
    records = run_long(cfg, lc)
    growth = long_growth(records)
    verdicts, verdict_lines = target_verdicts(growth)
    elapsed = time.perf_counter() - started
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "backend": backend, "device_kind": device.device_kind, "jax": jax.__version__,
        "python": platform.python_version(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "load_before": load_before, "load_after": os.getloadavg(),
        "config": dataclasses.asdict(cfg),
        "paths": {p.name: p.describe() for p in lc.paths},
        "settings": {k: v for k, v in dataclasses.asdict(lc).items() if k != "paths"},
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "runtime_s": elapsed,
    }
    result = {"meta": meta, "results": records, "growth": growth, "targets": verdicts}
    write_long(result, growth, verdict_lines, args)
    return result


def plot_title(meta: dict) -> str:
    cfg = meta["config"]
    return (f"causal attention, forward + backward: B={cfg['batch']} N={cfg['heads']} "
            f"H={cfg['head_dim']} {cfg['dtype']}; {meta['cpu']['model']} ({meta['cpu']['isa']}), "
            f"{meta['cpu_count']} cores, {meta['date'][:10]}")


def write_long(result: dict, growth: dict, verdict_lines: list[str],
               args: argparse.Namespace) -> None:
    """Print the table and summaries; write the JSON, the markdown and the plot."""
    meta, records, cfg = result["meta"], result["results"], result["meta"]["config"]
    table = long_table(records)
    legend = ("fwd+bwd ms = time of the grads of sum(out * ct) w.r.t. q, k, v: the lengths "
              "of a path are timed in alternation, round by round (calls x rounds: within a "
              "round a length is called `calls` times in a row, averaged); "
              "the median over rounds. time x = the median over rounds of the ratio to the "
              "previous length's time in the same round; cpu x the same for the process CPU "
              "time of those calls (all threads). temp = "
              "memory_analysis().temp_size_in_bytes of the compiled step; temp x = ratio "
              "to the previous length of the same path; pairs x = ratio of the allowed (query, "
              "key) pairs, the exact work of a softmax path; diffs = max |x - x_ref| (out, and "
              "max over dq, dk, dv) against the reference of each path (JSON `reference`). "
              "Rows 'compile only' were compiled for memory_analysis() but not executed; "
              "'skipped' rows were not compiled.")
    config = (f"B={cfg['batch']} N={cfg['heads']} H={cfg['head_dim']} {cfg['dtype']}, "
              f"causal; " + "; ".join(f"{k} = {v}" for k, v in meta["paths"].items()))
    machine = (f"backend `{meta['backend']}` ({meta['device_kind']}), CPU {meta['cpu']['model']} "
               f"({meta['cpu']['isa']}), "
               f"{meta['cpu_count']} cores, jax {meta['jax']}; load average "
               f"{meta['load_before'][0]:.2f} before, {meta['load_after'][0]:.2f} after; "
               f"runtime {meta['runtime_s']:.0f} s")
    summary = ["Growth per step of T (time: median of the per-round ratios; temp memory):"] \
        + growth_lines(growth)
    print("\n" + table + "\n\n" + "\n".join(summary) + "\n\n" + "\n".join(verdict_lines))
    print(f"\n{legend}\n\ntotal runtime {meta['runtime_s']:.1f} s")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = args.out_dir / "attention_long.json", args.out_dir / "attention_long.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Long-context attention benchmark ({meta['date']})", "", machine + ".", "",
          config + ".", "", table, "", *summary, "", "```", *verdict_lines, "```", "", legend, ""]
    md_path.write_text("\n".join(md))
    if args.plot is not None:
        plot_long(records, args.plot, plot_title(meta))
    print(f"wrote {json_path}, {md_path}" + (f" and {args.plot}" if args.plot else ""))


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
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls (default 3, quick 2); with --long: timing rounds (default 5)")
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
    long = p.add_argument_group("long-context mode (--long)")
    long.add_argument("--long", action="store_true",
                      help=f"T = {LONG_SEQ[0]} ... {LONG_SEQ[-1]} (or --seq) for the --paths, "
                           "fp32; results in attention_long.{json,md} and --plot")
    long.add_argument("--paths", type=str, default=None,
                      help=f"comma-separated, default all of {','.join(LONG_PATHS)}")
    long.add_argument("--window", type=int, default=512, help="sliding window W (default 512)")
    long.add_argument("--stride", type=int, default=128,
                      help="stride of the strided sparse pattern (default 128)")
    long.add_argument("--window-chunk", type=int, default=None,
                      help="query and key block of the window path on CPU ('chunked'; default: "
                           "the library's, chunked_attention.default_chunk: 128 for W=512, 5 "
                           "blocks of 128 keys per block of queries, 1.25x the window's pairs, "
                           "against 2x with 512-blocks)")
    long.add_argument("--quadratic-max-seq", type=int, default=8192,
                      help="execute the O(T^2) paths (xla, chunked, strided) up to this T")
    long.add_argument("--compile-max-seq", type=int, default=LONG_SEQ[-1],
                      help="beyond --quadratic-max-seq, compile the O(T^2) paths for "
                           "memory_analysis() up to this T; skip them beyond")
    long.add_argument("--check-max-seq", type=int, default=2048,
                      help="compare with the reference (xla with the same pattern; naive "
                           "linear attention) up to this T")
    long.add_argument("--time-budget", type=float, default=30.0,
                      help="timing rounds of a path (each calls all its lengths): at least "
                           "--repeats (default 5), more while they took less than this many "
                           "seconds in all (default 30), at most 7")
    long.add_argument("--plot", type=Path, default=REPO_ROOT / "docs" / "attention_scaling.png",
                      help="the log-log plot (default docs/attention_scaling.png)")
    p.add_argument("--_worker", type=str, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def default_notes(args: argparse.Namespace, impls: list[str], isolate: bool) -> list[str]:
    """What the default mode's figures mean on this backend."""
    backend = jax.default_backend()
    notes = []
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
    return notes


def run_default(impls: list[str], seqs: list[int], cfg: Config, isolate: bool) -> list[dict]:
    """Every (length, implementation), "xla" first at each length as the reference."""
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
    return records


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args._worker is not None:
        worker_main(args._worker)
        return None
    if args.cpu_library_fusions == "off":  # before the backend starts; children inherit it
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " "
                                   + NO_CPU_LIBRARY_FUSIONS_FLAG).strip()
    if args.long:
        return long_main(args)
    default_main(args)
    return None


def default_main(args: argparse.Namespace) -> None:
    """The default mode: the implementations at 512 ... 8192 (or --seq / --quick)."""
    started = time.perf_counter()
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
    notes += default_notes(args, impls, isolate)

    device = jax.devices()[0]
    print(f"# attention benchmark: backend={backend} device={device.device_kind} "
          f"jax={jax.__version__}")
    print(f"# B={cfg.batch} N={cfg.heads} H={cfg.head_dim} dtype={cfg.dtype} causal=True "
          f"q_chunk={cfg.q_chunk} kv_chunk={cfg.kv_chunk} repeats={cfg.repeats} "
          f"isolate={isolate} impls={','.join(impls)} T={','.join(map(str, seqs))}")
    for note in notes:
        print(f"# note: {note}")

    records = run_default(impls, seqs, cfg, isolate)
    add_growth(records)
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "backend": backend, "device_kind": device.device_kind, "jax": jax.__version__,
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "config": dataclasses.asdict(cfg), "seqs": seqs, "impls": impls,
        "isolate": isolate, "xla_flags": os.environ.get("XLA_FLAGS", ""), "notes": notes,
        "runtime_s": time.perf_counter() - started,
    }
    write_default(records, meta, args.out_dir)


def write_default(records: list[dict], meta: dict, out_dir: Path) -> None:
    """Print the table and growth summary; write attention.{json,md}."""
    show_device_peak = any("device_peak_bytes" in r for r in records)
    show_rss = any("rss_run_delta_bytes" in r for r in records)
    table = markdown_table(records, show_device_peak, show_rss)
    summary, summary_text = growth_summary(records)
    elapsed, cfg, notes = meta["runtime_s"], meta["config"], meta["notes"]

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

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention.json").write_text(
        json.dumps({"meta": meta, "results": records, "growth": summary}, indent=2) + "\n")
    md = [f"# Attention benchmark ({meta['date']})", "",
          f"backend `{meta['backend']}` ({meta['device_kind']}), jax {meta['jax']}, "
          f"{meta['cpu_count']} CPUs; B={cfg['batch']} N={cfg['heads']} H={cfg['head_dim']} "
          f"{cfg['dtype']}, causal, q_chunk={cfg['q_chunk']} kv_chunk={cfg['kv_chunk']}, "
          f"median of {cfg['repeats']}; runtime {elapsed:.0f} s.", ""]
    md += [f"- note: {n}" for n in notes] + ([""] if notes else [])
    md += [table, "", summary_text, "", legend, ""]
    (out_dir / "attention.md").write_text("\n".join(md))
    print(f"wrote {out_dir / 'attention.json'} and {out_dir / 'attention.md'}")


if __name__ == "__main__":
    main()
