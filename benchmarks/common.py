"""Shared pieces of the benchmark suite: process setup, alternating timing, machine facts, output.

Timing rule of the suite: the implementations being compared run in ONE process, on the
same inputs, and are called in alternation (round-robin, the starting implementation
rotating every round) after their warm-up, so that load from anything else on the
machine hits all of them alike; each timed call starts after a short pause (``SETTLE_S``),
so that no implementation starts in the wake of another's spinning worker threads; every
figure is the median of its rounds.

``setup_process()`` must run before JAX starts its backend: it applies the same host
allocator tuning as the ``transformer-jax`` CLI (``transformer_jax.host_memory``), which
the PyTorch peers in the same process then share.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
if str(REPO_ROOT) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_MALLOC_TUNED: bool | None = None


def setup_process() -> bool:
    """Allocator tuning as in the CLI (before any JAX computation). Returns whether applied."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED is None:
        from transformer_jax.host_memory import tune_malloc_if_cpu
        _MALLOC_TUNED = tune_malloc_if_cpu()
    return _MALLOC_TUNED


# ----------------------------------------------------------------------------- timing

# Pause before each timed call. PyTorch's OpenMP worker threads keep spinning for a few
# milliseconds after each of its parallel regions, and XLA's threads then share the two
# cores with them: measured here (2026-11-30), an XLA program of 12 small batched matmuls
# took 18.1-18.4 ms right after a torch matmul and 12.3-13.6 ms after a 30 ms pause (the
# same program after another XLA call: 11.3-13.8 ms either way; torch after XLA: no
# difference). The rotation in ``alternate`` keeps the cyclic order, so without the pause
# the same implementation would always start in the wake of the same peer.
SETTLE_S = 0.03


def alternate(fns: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1,
              settle_s: float = SETTLE_S) -> dict[str, list[float]]:
    """Wall seconds of each call: ``warmup`` untimed calls each, then ``rounds`` rounds in
    which every function runs once, the first one of a round rotating. Each timed call
    starts ``settle_s`` seconds (untimed) after the previous one returned."""
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if settle_s:
                time.sleep(settle_s)
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def round_ratios(peer_s: list[float], ours_s: list[float]) -> dict[str, Any]:
    """Peer time / our time of each round (the two calls of a round ran seconds apart), and
    their median and quartiles. A drift of the machine's speed over a run moves both calls
    of a round alike, so these ratios spread less than the two sides' times do; the
    quartiles say how far one run's ratio can be trusted."""
    if len(peer_s) != len(ours_s) or not ours_s:
        raise ValueError(f"need one time per round on each side, got {len(peer_s)} and {len(ours_s)}")
    ratios = [p / o for p, o in zip(peer_s, ours_s)]
    q1, med, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"ratios": ratios, "median": med, "q1": q1, "q3": q3}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


# ----------------------------------------------------------------------------- machine

def measure_memory_bandwidth(mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """Memory bandwidth in bytes/s of two streams over ``mib`` MiB, best of ``repeats`` each:

    * ``copy``: a numpy copy into a preallocated (already faulted-in) buffer, read + write
      bytes counted;
    * ``read``: a jitted matrix-vector product that reads a (rows, 1024) fp32 matrix once,
      the access pattern of a decode step (every weight read once, on all cores).

    ``roofline`` is the larger of the two. A copy alone understates what a read-only stream
    gets: here (2026-11-30) the copy measured 24.8 GB/s and the matrix-vector read 28.3,
    and a decode step at batch 1 ran at 102% of the copy figure.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    def best(fn):  # seconds of the fastest of ``repeats`` calls, after one untimed call
        fn()
        return min(timed(fn)[1] for _ in range(repeats))

    src = np.ones(mib * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    copy = 2 * src.nbytes / best(lambda: np.copyto(dst, src))
    dst = None   # frees the buffer (the timed lambda above still names it, so no `del`)
    mat = jnp.asarray(src.reshape(-1, 1024))
    vec = jnp.ones((1024,), jnp.float32)
    matvec = jax.jit(lambda m, v: m @ v)
    read = src.nbytes / best(lambda: matvec(mat, vec).block_until_ready())
    return {"copy": copy, "read": read, "roofline": max(copy, read)}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The widest x86 vector extension the CPU has ("avx512", "avx2", ...), with its family
    and model numbers (e.g. "avx512, family 25 model 17": AMD Zen 4), or the machine type."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    isa = next((name for name, flag in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"),
                                        ("sse4.2", "sse4_2")) if flag in flags), platform.machine())
    return f"{isa}, family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"


def machine_info() -> dict[str, Any]:
    import jax
    info: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu_model(), "cpu_isa": cpu_isa(), "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind, "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "malloc_tuned": bool(_MALLOC_TUNED),
        "load_average_1_5_15min": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    try:
        import torch
        import transformers
        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                    transformers=transformers.__version__)
    except ImportError:
        pass
    return info


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


# ----------------------------------------------------------------------------- output

def md_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_results(stem: str, payload: dict[str, Any], markdown: str,
                  out_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """``<out_dir>/<stem>.json`` and ``<stem>.md``; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    js.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    md.write_text(markdown.rstrip() + "\n")
    return js, md


def report(stem: str, title: str, result: dict[str, Any]) -> None:
    """Print a benchmark's markdown and write ``<stem>.{json,md}`` (titled) to RESULTS_DIR."""
    print("\n" + result["markdown"])
    js, md = write_results(stem, result, f"# {title}\n\n" + result["markdown"])
    print(f"\nwrote {js} and {md}")


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    return str(x)


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)
