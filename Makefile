# The two front-door commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Two pytest workers, a module at a time each, longest modules first (tests/conftest.py): the
# modules that mostly wait out timeouts run beside the ones that compute. TEST_WORKERS=0: one
# process, as plain `pytest` runs.
TEST_WORKERS ?= 2

.PHONY: install test demo bench gpu-report extrapolation clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

demo: $(STAMP)
	bash launch/demo.sh

bench: $(STAMP)
	$(PY) benchmarks/run.py

# On a CUDA machine: correctness, kernel speed, sweep, end-to-end -> docs/gpu/<gpu-model>/.
# The whole report: a 540 s run on a fresh H100 covered about a third of it (mostly Triton
# compiling; a warm cache is faster). `python benchmarks/gpu_report.py` alone stops at 540 s,
# marked PARTIAL.
gpu-report: $(STAMP)
	$(PY) benchmarks/gpu_report.py --time-budget 1800

extrapolation: $(STAMP)
	$(PY) benchmarks/length_extrapolation.py

clean:
	rm -rf $(VENV) build *.egg-info
