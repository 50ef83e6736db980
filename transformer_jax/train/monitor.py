"""What a run shows and keeps: metrics.jsonl, TensorBoard events, a loss-curve PNG, and MFU.

MFU (model FLOPs utilisation) = achieved training FLOP/s / peak FLOP/s. Achieved FLOPs
follow the PaLM/nanoGPT convention (``GPTConfig.flops_per_token``). The peak comes from a
table for known accelerators and is *measured* on CPUs (a large fp32 matmul), so CPU MFU
is relative to what this machine's matmuls can actually do.
"""
from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per device, as reported by jax.devices()[i].device_kind.
# TPU v2/v3 expose each core as a device (half a chip).
PEAK_FLOPS = {
    "TPU v2": 22.5e12, "TPU v3": 61.5e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
    "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12,
    "NVIDIA H100": 989e12, "NVIDIA H200": 989e12, "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12, "Tesla T4": 65e12, "NVIDIA A10G": 125e12, "Tesla V100": 125e12,
}


def measure_matmul_peak(n: int = 2048, repeats: int = 5, dtype=jnp.float32) -> float:
    """Best-of-``repeats`` FLOP/s of an (n, n) @ (n, n) matmul on the default device."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


@functools.lru_cache(maxsize=None)
def peak_flops_per_device() -> tuple[float, str]:
    """``(FLOP/s, how it was obtained)`` for one device of the default backend."""
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_FLOPS.items():
        if kind.startswith(name):
            return peak, f"{kind} bf16 spec"
    return measure_matmul_peak(), f"{kind} measured fp32 matmul"


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` and scalars to TensorBoard (``tb/``) in a workdir.

    On resume, rows past ``resume_step`` (logged after the checkpoint the run resumes
    from) are dropped so the file reads as one uninterrupted run. Only process 0 writes.
    """

    def __init__(self, workdir: Path, *, resume_step: int | None = None, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(workdir) / "metrics.jsonl"
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(k + "\n" for k in kept))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        try:
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(str(Path(workdir) / "tb"),
                                     purge_step=None if resume_step is None else resume_step + 1)
        except ImportError:  # TensorBoard events are optional; metrics.jsonl is not
            self._tb = None

    def write(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in row.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def text(self, tag: str, step: int, text: str) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    return float(v) if isinstance(v, float) else v


def read_metrics(workdir: Path) -> list[dict[str, Any]]:
    path = Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(workdir: Path, out: Path | None = None) -> Path | None:
    """Write ``loss.png`` (train loss, and eval loss where present) from metrics.jsonl."""
    rows = read_metrics(workdir)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if not train and not evals:
        return None
    # a Figure of its own (Agg canvas): no pyplot state, the caller's backend (e.g. a
    # notebook's inline backend) is left as it was
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(Path(workdir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = out or Path(workdir) / "loss.png"
    fig.tight_layout()
    fig.savefig(out)
    return out
