"""Test-wide settings.

* fp32 parity needs full-precision matmuls on every backend.
* The package is imported first: with libtpu installed (``make test`` installs it for the
  TPU compile tests) and no TPU, it keeps JAX from starting the TPU runtime and sets the
  variables that keep libtpu quiet, for this process and the subprocesses tests start.
* XLA:CPU compiles at backend (LLVM) optimisation level 0 unless ``XLA_FLAGS`` names a
  level: the test programs are small, compiling dominates their time, and level 0 cuts it
  by about a third. The suite passed at both levels (2026-12-01), the tests that read
  compiled HLO included. LLVM's expensive passes are skipped too
  (``--xla_llvm_disable_expensive_passes``: about 12% less CPU time on the GPT tests), and
  XLA:CPU's MLIR fusion emitters are off (``--xla_cpu_use_fusion_emitters=false``: the older
  elemental emitters compile the same fusions in less time, 15-20% less wall time on the
  model and interop tests, 2026-12-06).
* One persistent compilation cache per test run, shared by the xdist workers and the
  subprocesses they start: many tests compile the same small train steps, and a cache hit
  skips XLA's compile. It lives under pytest's temporary directory for this run (so every
  run starts empty and pytest removes old ones); a test that must see XLA compile drops
  ``JAX_COMPILATION_CACHE_DIR`` from its subprocess's environment.
* The modules with tests marked ``slow`` run first, each module's tests kept together (their
  module-scoped fixtures start subprocesses and train reference runs once): under
  ``pytest-xdist --dist worksteal`` the fast modules then fill the gaps, and no long test is
  left to run alone at the end.
"""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
for _flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
              "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

import transformer_jax  # noqa: E402,F401 - with libtpu on this CPU host: no TPU start, quiet

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    factory = getattr(config, "_tmp_path_factory", None)   # set by pytest's tmp_path plugin
    if factory is None:
        return
    base = factory.getbasetemp()
    run_dir = base.parent if hasattr(config, "workerinput") else base   # xdist: popen-gwN/..
    settings = {
        "jax_compilation_cache_dir": str(run_dir / "jax_compilation_cache"),
        "jax_persistent_cache_min_compile_time_secs": 0.2,
        "jax_compilation_cache_max_size": 4 << 30,   # a size limit makes jax lock the directory
    }
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)        # for the subprocesses tests start


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    slow_modules = {item.module.__name__ for item in items
                    if item.get_closest_marker("slow") is not None}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (item.module.__name__ not in slow_modules, order[id(item)]))


@pytest.fixture
def here(capfd, caplog):
    """``here(*ARGS)``: ``transformer-jax ARGS`` in this process (``tests/helpers.py``
    ``cli_here``), read at the file descriptors: (exit status, stdout, warning:/error: lines)."""
    import functools

    from tests.helpers import cli_here
    return functools.partial(cli_here, capfd=capfd, caplog=caplog)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data directory per test module, where the embedded corpus is prepared once."""
    return str(tmp_path_factory.mktemp("tfds"))
