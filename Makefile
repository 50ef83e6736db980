# Two commands for a newcomer; each sets up its own virtual environment in .venv first.
#   make train   train the default GPT on the embedded Python-stdlib corpus (~3.5 min on 2 CPU cores)
#   make test    run the test suite (what CI runs)
#   make bench   the benchmark suite against PyTorch (~10 min; ARGS=--quick)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: train test bench clean

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

bench: $(BIN)/.installed
	$(BIN)/python -m benchmarks $(ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
