# Two commands for a newcomer; each sets up its own virtual environment in .venv first.
#   make train   train the default GPT on the embedded Python-stdlib corpus (~3.5 min on 2 CPU cores)
#   make test    run the test suite (what CI runs)
#   make test-colab  the tests marked `colab` against the versions Colab ships (.venv-colab; CI too)
#   make bench   the benchmark suite against PyTorch (~10 min; ARGS=--quick)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: train test test-colab bench clean

# uv writes no bytecode at install; Python writes it at the first import instead, so that the
# suite's many processes (xdist workers, notebook kernels, CLI subprocesses) do not each compile
# torch, TensorFlow and JAX from source where the environment sets PYTHONDONTWRITEBYTECODE.
unexport PYTHONDONTWRITEBYTECODE

# pip takes torch, honouring this machine's pip settings (a local CPU wheel where there is one),
# and uv; uv installs the rest in a fraction of pip's time (about 20 s against 150 s).
$(BIN)/.installed: pyproject.toml .ci/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -c .ci/constraints.txt torch uv
	$(BIN)/uv pip install -q --python $(BIN)/python -c .ci/constraints.txt -e ".[test,tpu,eval,docs,wandb]"
	touch $@

train: $(BIN)/.installed
	$(BIN)/transformer-jax train --workdir runs/stdlib_gpt $(ARGS)

test: $(BIN)/.installed
	$(BIN)/python -m pytest -q -n auto --dist worksteal --durations=40 $(ARGS)

# Colab's runtimes: Python 3.13 and the versions in .ci/colab-constraints.txt (no TensorFlow, and
# no torch: PyPI has only CUDA torch wheels for 3.13, gigabytes, so the torch tests are not here).
COLAB_VENV   ?= .venv-colab
COLAB_BIN     = $(COLAB_VENV)/bin
COLAB_PYTHON ?= $(firstword $(wildcard /root/.pyenv/versions/3.13*/bin/python3.13) $(shell command -v python3.13))
COLAB_DEPS    = pytest pytest-xdist filelock nbclient nbformat ipykernel jupyter-client transformers grain datasets
# the files holding the tests marked `colab` (naming them spares collecting the whole suite)
COLAB_TESTS   = tests/data tests/models/test_gpt.py tests/layers/test_attention.py tests/tasks/test_lm.py \
                tests/test_nnx.py tests/train/test_checkpoint.py tests/train/test_loop.py tests/test_run.py \
                tests/test_tpu_compile.py tests/test_notebooks.py

$(COLAB_BIN)/.installed: pyproject.toml .ci/colab-constraints.txt
	@py="$(COLAB_PYTHON)"; if [ -z "$$py" ]; then py="$(PYTHON)"; \
	  echo "test-colab: no python3.13 found (Colab runs 3.13); using $$($$py --version) instead"; fi; \
	  $$py -m venv $(COLAB_VENV)
	$(COLAB_BIN)/python -m pip install -q -c .ci/colab-constraints.txt uv
	$(COLAB_BIN)/uv pip install -q --python $(COLAB_BIN)/python -c .ci/colab-constraints.txt -e ".[tpu]" $(COLAB_DEPS)
	touch $@

test-colab: $(COLAB_BIN)/.installed
	$(COLAB_BIN)/python -m pytest -q -n auto --dist worksteal --durations=10 -m colab $(COLAB_TESTS) $(ARGS)

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks $(ARGS)

clean:
	rm -rf $(VENV) $(COLAB_VENV) runs .pytest_cache
