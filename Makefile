# Two commands for a fresh machine: `make demo` (the main job) and `make test` (every check CI runs).
# Both create the virtual environment .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest-xdist workers for `make test`: most tests wait on etcd, clusters and rank processes rather than compute,
# so six share two cores and keep both busy from the first test to the last (measured: idle under 2% of the run;
# 690 s on six against 762 s and 822 s on four, the same suite with other work beside it). The rank processes the
# tests start are forked from servers that imported torch once. `make test WORKERS=0` runs serially.
WORKERS ?= 6
# Where torch's CPU build comes from; `make install TORCH_INDEX_URL=` uses only the indexes pip is configured with.
TORCH_INDEX_URL ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test lint install clean bench-anchors

$(BIN)/stalwart: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch, from torch's index as the Dockerfile takes it: PyPI's torch for Linux is the CUDA
	# build (gigabytes of packages). An index that cannot be reached costs one short try, then the others serve.
	$(BIN)/python -m pip install -q --retries 1 --timeout 20 $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL)) torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[train,local,dev]'
	touch $@

install: $(BIN)/stalwart

demo: install
	$(BIN)/stalwart demo

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/mypy tools

# Each test's seconds go to build/test-durations.json; `python tools/slowest.py` prints the slowest.
# The lint runs beside the tests (most of which wait rather than compute), its output after theirs; either failing
# fails the target. Before the workers start, the sources are compiled once and pytest's cache of rewritten test
# modules written once (tools/rewrite_tests.py, on every CPU, importing nothing; then pytest's plugins, loaded by
# collecting a directory without tests, whose cache pytest writes itself even where PYTHONDONTWRITEBYTECODE is
# set): otherwise, on a clean clone with that variable set, each of the six workers rewrote every test module at
# once (27.6 s before the first test against 12.0 s cached) and every agent, rank and cluster process of the run
# compiled the modules it imports afresh. A whole collection did the same in 9.8 s; these two take 2.2 s.
test: install
	@mkdir -p build
	@$(MAKE) --no-print-directory lint > build/lint.log 2>&1 & lint=$$!; \
	$(BIN)/python -m compileall -q -j 0 stalwart tests bench tools > build/compile.log 2>&1; \
	$(BIN)/python tools/rewrite_tests.py tests > build/collect.log 2>&1; \
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest --collect-only -q -p no:cacheprovider build >> build/collect.log 2>&1; \
	$(BIN)/python -m pytest -n $(WORKERS) --dist loadgroup; tests=$$?; \
	wait $$lint; linted=$$?; cat build/lint.log; \
	if [ $$linted -ne 0 ]; then echo "make test: the lint failed (above)"; fi; \
	[ $$tests -eq 0 ] && [ $$linted -eq 0 ]

# The anchors some benchmarks compare with, not dependencies of stalwart: torchft 0.2.0 for bench/torchft_copy.py.
# --no-deps: its requirement on torch would otherwise replace the venv's CPU build; its other requirements follow.
bench-anchors: install
	$(BIN)/python -m pip install -q --no-deps torchft==0.2.0
	$(BIN)/python -m pip install -q opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http numpy

clean:
	rm -rf $(VENV) build *.egg-info
