# The two commands a newcomer runs: `make run` and `make test`. Both set up .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU torch first, from the wheel pip finds locally; a bare `torch` would pull a CUDA build.
TORCH := torch==2.13.0

.PHONY: run test venv dev lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed
dev: $(VENV)/.installed-dev

run: venv
	$(BIN)/veriloco train configs/default.toml $(ARGS)

# the suite on 2 pytest processes (pytest-xdist): most multi-process tests wait on deadlines and
# heartbeats, so two at once finish in about 70% of the time on 2 cores; PYTEST_ARGS= runs it on one
PYTEST_ARGS ?= -n 2
test: dev
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: dev
	$(BIN)/ruff check src tests bench examples

clean:
	rm -rf $(VENV) runs .pytest_cache
