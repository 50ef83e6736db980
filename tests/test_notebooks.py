"""The Colab notebooks in ``colab/``: stored without outputs, and runnable top to bottom.

Each notebook is executed on the CPU in smoke mode (``TRANSFORMER_JAX_SMOKE=1``) by
``nbclient``, in its own IPython kernel: a subprocess of *this* interpreter. The test writes
a private kernelspec whose ``argv[0]`` is ``sys.executable`` into a temporary directory and
hands nbclient a kernel manager that looks only there, so neither a missing kernelspec (a
fresh virtual environment) nor a ``python3`` kernelspec registered for another interpreter
(user or system wide) changes which Python runs the notebook.

Asserted for every notebook: each cell runs without error within ``CELL_TIMEOUT``; the
install cell does nothing (the package is importable here); at least one ``image/png``
output (the plots render); every printed ``parity NAME: max |diff| = D (tolerance T)``
line has ``D <= T`` (the notebooks also assert their own checks), and the notebooks that
compare numbers with a reference print at least one such line. The notebooks that build
models print what ``attention_impl="auto"`` resolves to (``attention: auto -> ...``).

Notebook 02 trains in one ``train()`` call drawn live from its ``on_log``/``on_eval``
callbacks, paused with ``stop_at`` and continued with ``resume=True``: its printed lines must
show a pause and a resume that together logged every log step once, a curve redrawn at least
at every logged row, and losses equal, bit for bit, to those of an uninterrupted run.

Notebook 07_scaling_laws runs 8 tiny members of ``experiments/scaling_laws.py`` with
``run_sweep``: its panels must be redrawn after each member (``drawn after k/8 members``),
and the work directory it prints must hold the fits (``fit.json`` with every law's keys,
``scaling.png``, ``scaling.md``).

The kernels share one TFDS data directory (the embedded corpus is built once), run without
network access to the Hugging Face Hub, and compile with ``--xla_backend_optimization_level=0``
(the smoke-sized programs are tiny, so XLA's compile time dominates the run time).
"""
import ast
import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="needs the test extra: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="needs the test extra: pip install -e '.[test]'")

from jupyter_client import AsyncKernelManager  # noqa: E402
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402

COLAB = Path(__file__).resolve().parents[1] / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
EXPECTED = {"01_attention_from_scratch", "02_train_gpt", "03_bert_t5_vit", "04_scaling_tpu",
            "05_hf_pytorch_weights", "06_finetune", "07_scaling_laws"}
# Notebooks that compare numbers with a reference (PyTorch, HF, another device layout).
PARITY_NOTEBOOKS = {"01_attention_from_scratch", "02_train_gpt", "04_scaling_tpu",
                    "05_hf_pytorch_weights", "06_finetune"}
# Notebooks that build a model and print what attention_impl="auto" runs on this platform.
ATTENTION_NOTEBOOKS = {"02_train_gpt", "03_bert_t5_vit", "04_scaling_tpu", "05_hf_pytorch_weights",
                       "06_finetune", "07_scaling_laws"}
ATTENTION_LINE = re.compile(r"^attention: auto -> xla \(cpu: no kernels here; the exact "
                            r"reference up to 4096 x 4096 logits\)$", re.MULTILINE)
# Notebook 02: one line per train() call, and one per compared loss.
RUN_LINE = re.compile(r"^(?P<how>paused|finished|stopped) at step (?P<step>\d+) \(this call started at "
                      r"step (?P<start>\d+)\); on_log: steps (?P<logged>\[[\d, ]*\]); on_eval: steps "
                      r"(?P<evals>\[[\d, ]*\]); curve drawn (?P<draws>\d+) times", re.MULTILINE)
LOSS_LINE = re.compile(r"^step (?P<step>\d+): loss (?P<ours>\S+) paused and resumed, (?P<ref>\S+) "
                       r"uninterrupted", re.MULTILINE)
# Notebook 07_scaling_laws: one line per redraw of its panels, and where its sweep ran.
DRAWN_LINE = re.compile(r"^drawn after (?P<done>\d+)/(?P<total>\d+) members", re.MULTILINE)
WORKDIR_LINE = re.compile(r"^work directory: (?P<path>.+)$", re.MULTILINE)
FIT_KEYS = {"alpha_N", "alpha_N_ci", "E_N", "r2_N", "gamma_C", "gamma_C_ci", "r2_C", "beta_D",
            "beta_D_ci", "r2_D", "n_opt_exponent", "members"}
PARITY_LINE = re.compile(r"^parity (?P<name>.+?): max \|diff\| = (?P<diff>\S+) \(tolerance (?P<tol>\S+)\)$",
                         re.MULTILINE)
BADGE = "https://colab.research.google.com/github/transformer-jax/transformer_jax/blob/main/colab/{}"
REPO_URL = 'REPO_URL = "https://github.com/transformer-jax/transformer_jax"'
KERNEL_NAME = "transformer-jax-test"
# Torch-free notebooks that also run against Colab's versions (make test-colab): training with
# a pause and resume, and the encoder families.
COLAB_NOTEBOOKS = {"02_train_gpt", "03_bert_t5_vit"}
CELL_TIMEOUT = 300        # seconds per cell; the slowest smoke-mode cell takes ~25 s on 2 busy cores


def read(path: Path):
    return nbformat.read(path, as_version=4)


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def test_the_notebooks_are_all_there():
    assert {p.stem for p in NOTEBOOKS} == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_stripped(path):
    nb = read(path)
    nbformat.validate(nb)
    for i, cell in enumerate(code_cells(nb)):
        assert cell.outputs == [], f"{path.name}: code cell {i} has stored outputs; clear them"
        assert cell.execution_count is None, f"{path.name}: code cell {i} has an execution count"
    for i, cell in enumerate(nb.cells):
        assert "execution" not in cell.metadata, f"{path.name}: cell {i} stores execution timings"
    assert "widgets" not in nb.metadata, f"{path.name}: widget state stored in the metadata"
    first = nb.cells[0]
    assert first.cell_type == "markdown" and BADGE.format(path.name) in first.source, \
        f"{path.name} must open with its 'Open in Colab' badge"
    install = code_cells(nb)[:2]
    assert any(REPO_URL in c.source and "pip" in c.source for c in install), \
        f"{path.name}: an install cell with {REPO_URL} must come first"


@pytest.fixture(scope="module")
def kernel_spec_manager(tmp_path_factory):
    """A kernelspec for this interpreter, in a directory of its own."""
    kernels = tmp_path_factory.mktemp("jupyter") / "kernels"
    spec_dir = kernels / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"Python ({sys.executable})", "language": "python"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    env = dict(os.environ)
    env.update(
        TRANSFORMER_JAX_SMOKE="1",
        TFDS_DATA_DIR=str(tmp_path_factory.mktemp("tfds")),
        JAX_PLATFORMS="cpu",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TF_CPP_MIN_LOG_LEVEL="2",
        XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip(),
    )
    env.pop("MPLBACKEND", None)     # the kernel's own default: matplotlib-inline
    return env


def test_kernelspec_runs_this_interpreter(kernel_spec_manager):
    spec = kernel_spec_manager.get_kernel_spec(KERNEL_NAME)
    assert spec.argv[0] == sys.executable
    assert kernel_spec_manager.find_kernel_specs().keys() == {KERNEL_NAME}


def outputs(nb):
    for cell in code_cells(nb):
        yield from cell.outputs


def printed_text(nb) -> str:
    parts = []
    for out in outputs(nb):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.colab] * (p.stem in COLAB_NOTEBOOKS))
                                  for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path, kernel_spec_manager, kernel_env):
    nb = read(path)
    km = AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=kernel_spec_manager)
    client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT, allow_errors=False,
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute(env=kernel_env)      # raises CellExecutionError naming the failing cell
    print(f"{path.name}: {time.perf_counter() - start:.1f} s")

    install = next(c for c in code_cells(nb) if REPO_URL in c.source)
    install_text = "".join(o.get("text", "") for o in install.outputs)
    assert "already importable; nothing to install" in install_text, install_text

    images = [o for o in outputs(nb) if "image/png" in o.get("data", {})]
    assert images, f"{path.name} displayed no image/png output"

    text = printed_text(nb)
    checks = [(m["name"], float(m["diff"]), float(m["tol"])) for m in PARITY_LINE.finditer(text)]
    for name, diff, tol in checks:
        assert diff <= tol, f"{path.name}: parity {name}: {diff:g} > tolerance {tol:g}"
    if path.stem in PARITY_NOTEBOOKS:
        assert checks, f"{path.name} printed no parity line"
    if path.stem in ATTENTION_NOTEBOOKS:   # the kernel runs on the CPU: "auto" is the reference
        assert ATTENTION_LINE.search(text), f"{path.name} did not print 'attention: auto -> xla (cpu: ...)'"
    if path.stem == "02_train_gpt":
        check_paused_and_resumed(text)
    if path.stem == "07_scaling_laws":
        check_scaling_sweep(text, tmp_path)


def check_paused_and_resumed(text: str) -> None:
    """Notebook 02's printed record of its two train() calls and of the resume check."""
    calls = [m.groupdict() for m in RUN_LINE.finditer(text)]
    assert [c["how"] for c in calls] == ["paused", "finished"], calls
    paused, resumed = calls
    pause = int(paused["step"])
    assert int(paused["start"]) == 0 and int(resumed["start"]) == pause < int(resumed["step"]), calls
    before, after = ast.literal_eval(paused["logged"]), ast.literal_eval(resumed["logged"])
    every = before[0]
    assert before + after == list(range(every, int(resumed["step"]) + 1, every)), (before, after)
    assert max(before) <= pause < min(after), (pause, before, after)
    assert ast.literal_eval(resumed["evals"]), "on_eval was not called after the resume"
    # smoke mode redraws at every logged row and eval, and once more at the end of each call
    draws = [int(paused["draws"]), int(resumed["draws"]) - int(paused["draws"])]
    for call, n in zip(calls, draws):
        logged, evals = ast.literal_eval(call["logged"]), ast.literal_eval(call["evals"])
        assert n == len(logged) + len(evals) + 1, (call, n)

    losses = {int(m["step"]): (float(m["ours"]), float(m["ref"])) for m in LOSS_LINE.finditer(text)}
    compared = sorted(losses)
    assert compared == [s for s in before + after if s <= compared[-1]], compared
    assert [s for s in compared if s > pause], f"no loss compared after the pause at {pause}"
    for step, (ours, reference) in losses.items():
        assert ours == reference, f"step {step}: resumed loss {ours!r} != uninterrupted {reference!r}"


def check_scaling_sweep(text: str, cwd: Path) -> None:
    """Notebook 07_scaling_laws: its panels redrawn after each of the 8 smoke members, and the
    fits written into the work directory it printed."""
    drawn = [(int(m["done"]), int(m["total"])) for m in DRAWN_LINE.finditer(text)]
    assert drawn == [(k, 8) for k in range(1, 9)], drawn
    workdir = cwd / WORKDIR_LINE.search(text)["path"].strip()   # an absolute path stays one
    fit = json.loads((workdir / "fit.json").read_text())
    assert FIT_KEYS <= fit.keys(), sorted(FIT_KEYS - fit.keys())
    assert len(fit["members"]) == 8, [m["member"] for m in fit["members"]]
    assert {m["group"] for m in fit["members"]} == {"size", "data"}, fit["members"]
    assert (workdir / "scaling.png").stat().st_size and (workdir / "scaling.md").stat().st_size
