"""What a run shows and keeps: metrics.jsonl, TensorBoard events, a loss-curve PNG, and MFU.

All three files go through :mod:`transformer_jax.storage`, so the workdir may be a bucket.
With ``log.wandb`` the same rows, samples and plot also go to Weights & Biases
(:mod:`transformer_jax.train.wandb_log`).

MFU (model FLOPs utilisation) = achieved training FLOP/s / peak FLOP/s. Achieved FLOPs
follow the PaLM/nanoGPT convention (``GPTConfig.flops_per_token``: 6 per weight per token),
except over a frozen base (LoRA, QLoRA, prefix tuning; ``Task.flops_per_step``): 4 per
frozen weight (forward and input gradient, no weight gradient), 6 per trained one. The
peak comes from a table for known accelerators and is *measured* on CPUs (a large fp32
matmul), so CPU MFU is relative to what this machine's matmuls can actually do.
"""
from __future__ import annotations

import functools
import io
import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from .. import storage
from ..storage import PathLike, TextLog
from ..tpu import GENERATIONS, generation_of

# Dense bf16 peak FLOP/s per device, as reported by jax.devices()[i].device_kind.
# TPU v2/v3 expose each core as a device (half a chip).
PEAK_FLOPS = {   # GPUs; TPUs by generation from transformer_jax.tpu (a v5p says "TPU v5")
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
    generation = generation_of(kind)
    if generation is not None:
        return GENERATIONS[generation].peak_bf16, f"{kind} bf16 spec"
    for name, peak in PEAK_FLOPS.items():
        if kind.startswith(name):
            return peak, f"{kind} bf16 spec"
    return measure_matmul_peak(), f"{kind} measured fp32 matmul"


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` and scalars to TensorBoard (``tb/``) in a workdir.

    The workdir may be local or in a bucket (see :mod:`transformer_jax.storage`); in a bucket
    rows and events are rewritten at most every ``flush_secs`` and by :meth:`flush` and
    :meth:`close`, so call :meth:`flush` before each checkpoint. On resume, rows past
    ``resume_step`` (logged after the checkpoint the run resumes from) are dropped so the
    file reads as one uninterrupted run. Only process 0 writes. ``wandb``: a
    :class:`~transformer_jax.train.wandb_log.WandbLog` that gets every row, text and image
    too, and is finished by :meth:`close`.
    """

    def __init__(self, workdir: PathLike, *, resume_step: int | None = None, enabled: bool = True,
                 flush_secs: float = 30.0, wandb=None):
        self.enabled = enabled
        self.wandb = wandb if enabled else None
        self.path = storage.path(workdir) / "metrics.jsonl"
        self._log = self._tb = None
        if not enabled:
            return
        kept = ""
        if resume_step is not None and self.path.exists():
            rows = _parse_rows(self.path, storage.read_text(self.path))
            kept = "".join(json.dumps(row) + "\n" for row in rows if row["step"] <= resume_step)
        self._log = TextLog(self.path, kept, flush_secs=flush_secs)
        try:
            from tensorboardX import SummaryWriter
        except ImportError:  # TensorBoard events are optional; metrics.jsonl is not
            return
        tb = storage.path(workdir) / "tb"
        if not storage.is_remote(tb):
            tb.mkdir(parents=True, exist_ok=True)
        self._tb = SummaryWriter(os.fspath(tb), flush_secs=int(flush_secs),
                                 purge_step=None if resume_step is None else resume_step + 1)

    def write(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), **{k: _plain(v) for k, v in row.items()}}
        self._log.append(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.write(step, {k: v for k, v in row.items() if k != "step"})

    def text(self, tag: str, step: int, text: str) -> None:
        if self.enabled and self._tb is not None:
            self._tb.add_text(tag, text, step)
        if self.wandb is not None:
            self.wandb.text(tag, step, text)

    def image(self, tag: str, png) -> None:
        """A PNG file (the loss curve) for W&B; TensorBoard and metrics.jsonl keep none."""
        if self.wandb is not None and png is not None:
            self.wandb.image(tag, png)

    def flush(self) -> None:
        """Stores every row and event written so far (in a bucket: rewrites the objects)."""
        if self._log is not None:
            self._log.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self, failed: bool = False) -> None:
        """Stores and closes every file; finishes the W&B run (``failed``: as crashed)."""
        if self._log is not None:
            self._log.close()
        if self._tb is not None:
            self._tb.close()
        if self.wandb is not None:
            self.wandb.finish(failed)
            self.wandb = None


def _plain(v: Any) -> Any:
    if hasattr(v, "item"):
        v = v.item()
    return float(v) if isinstance(v, float) else v


class _ObjectRecordWriter:
    """tensorboardX's record writer for an event file in a bucket.

    An object cannot be appended to, so the file's bytes stay in memory and each flush
    (tensorboardX's flush thread, ``SummaryWriter.flush``, close) rewrites the object through
    the storage layer. Event files of scalars and samples stay small.
    """

    def __init__(self, path: str):
        self.path = path
        self._data = io.BytesIO()
        self._stored = -1

    def write(self, data: bytes) -> None:
        self._data.write(data)

    def flush(self) -> None:
        if self._data.tell() != self._stored:
            storage.write_bytes(self.path, self._data.getvalue())
            self._stored = self._data.tell()

    def close(self) -> None:
        self.flush()


class _ObjectRecordWriterFactory:
    """What tensorboardX's ``register_writer_factory`` takes: opens event files in a bucket."""

    def open(self, path: str) -> _ObjectRecordWriter:
        return _ObjectRecordWriter(path)

    def directory_check(self, path: str) -> None:
        storage.makedirs(path)   # directories are implicit; checks that the bucket exists


def _register_tensorboard_writer() -> None:
    try:
        from tensorboardX import record_writer
    except ImportError:
        return
    # replaces tensorboardX's own gs:// writer (google-cloud-storage, outside the storage layer)
    record_writer.register_writer_factory("gs", _ObjectRecordWriterFactory())


_register_tensorboard_writer()


def read_metrics(workdir: PathLike) -> list[dict[str, Any]]:
    """The rows of ``workdir/metrics.jsonl`` (local or in a bucket); [] if there is none."""
    path = storage.path(workdir) / "metrics.jsonl"
    if not path.exists():
        return []
    return _parse_rows(path, storage.read_text(path))


def _parse_rows(path, text: str, warn: bool = True) -> list[dict]:
    """The JSON rows of a metrics.jsonl text. A line that does not parse (torn by a crash
    mid-write, or edited) is skipped with one warning naming the file and the line."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            if warn:
                print(f"warning: {path} line {number} is not a metrics row (torn by an "
                      f"interrupted write?): {line[:60]!r}; skipped it", file=sys.stderr, flush=True)
            continue
        rows.append(row)
    return rows


def plot_loss(workdir: PathLike, out: PathLike | None = None):
    """Write ``loss.png`` (train loss, and eval loss where present) from metrics.jsonl.

    Returns the path written (an ``epath.Path``; local or in a bucket), or None without rows.
    """
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
    ax.set_title(storage.path(workdir).name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = storage.path(out) if out is not None else storage.path(workdir) / "loss.png"
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    storage.write_bytes(out, png.getvalue())
    return out
