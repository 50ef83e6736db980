"""Keep XLA:CPU's per-step buffers in the process instead of re-faulting them every step.

XLA:CPU allocates every execution's temporary buffer and its fresh outputs with
``malloc``. glibc serves each request above 32 MiB with its own ``mmap`` and gives it back
with ``munmap`` on ``free``, so the next step page-faults the whole buffer in again.

:func:`tune_malloc` asks glibc (``mallopt``) to keep that memory: one malloc arena (the
per-thread arenas cannot grow past 64 MiB and fall back to ``mmap``), no ``mmap`` for large
blocks, the heap grown 512 MiB at a time and not trimmed below 2 GiB. Freed memory stays
with the process (its resident size stays at its high-water mark). What it saves per step
is in docs/performance.md.

It has to run before the first JAX computation creates XLA's worker threads (each thread
keeps the arena it got first). ``transformer-jax`` calls :func:`tune_malloc_if_cpu` first
thing; set ``TRANSFORMER_JAX_TUNE_MALLOC=0`` to turn that off. It changes nothing off
Linux/glibc and nothing on GPU/TPU hosts (device memory has its own allocator).
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import sys
import warnings

ENV_VAR = "TRANSFORMER_JAX_TUNE_MALLOC"

# glibc <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_TRIM_THRESHOLD = 2**31 - 1          # mallopt takes an int: the largest value it accepts
_TOP_PAD = 2**29                     # grow the heap 512 MiB at a time (untouched pages cost nothing)

_tuned = False


def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version        # absent on musl and other C libraries
        return libc
    except (OSError, AttributeError):
        return None


def _backends_started() -> bool:
    """Whether JAX has already created its backends (then XLA's threads hold their arenas)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):   # a JAX without this helper: assume not started
        return False


def tune_malloc(*, warn: bool = True) -> bool:
    """Make glibc keep large freed blocks (see the module docstring). True if applied.

    Idempotent. Returns False (and changes nothing) off Linux/glibc, and when JAX's
    backends already exist (XLA's threads would keep their arenas; with ``warn``, says so).
    """
    global _tuned
    if _tuned:
        return True
    libc = _glibc()
    if libc is None:
        return False
    if _backends_started():
        if not warn:
            return False
        warnings.warn("tune_malloc() called after JAX created its backends; it only helps when "
                      "called before the first JAX computation (e.g. right after the imports)",
                      RuntimeWarning, stacklevel=2)
        return False
    ok = all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
        (_M_TOP_PAD, _TOP_PAD)))
    _tuned = ok
    return ok


def cpu_only_host() -> bool:
    """Whether JAX will run on the CPU: ``JAX_PLATFORMS`` says so, or no accelerator plugin is
    installed (no ``jax_plugins`` entry point, no ``jax_plugins`` package, no ``libtpu``)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    if importlib.util.find_spec("libtpu") or importlib.util.find_spec("jax_plugins"):
        return False
    return not importlib.metadata.entry_points(group="jax_plugins")


def tune_malloc_if_cpu() -> bool:
    """:func:`tune_malloc` on CPU-only hosts unless ``TRANSFORMER_JAX_TUNE_MALLOC=0``; silently
    nothing when JAX already runs (e.g. the CLI's ``main`` called from a live process)."""
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return cpu_only_host() and tune_malloc(warn=False)
