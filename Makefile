# Two commands for a fresh machine: `make demo` (the main job) and `make test` (every check CI runs).
# Both create the virtual environment .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint install clean

$(BIN)/stalwart: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch; any other torch requirement pulls gigabytes of CUDA packages.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[train,local,dev]'
	touch $@

install: $(BIN)/stalwart

demo: install
	$(BIN)/stalwart demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
