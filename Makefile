# The two front-door commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# `make test` (what CI runs): every test but those marked `integration`, in two parts: the
# suite in two pytest workers (pytest-xdist, a module at a time each, longest first:
# tests/conftest.py), the modules that mostly wait out timeouts beside the ones that compute;
# then the tests marked `alone` (timing tests with seconds-long allowances) in one process,
# with the machine to themselves. Fails if either part fails; one part that selects no test
# (exit 5) is not a failure, both are. TEST_WORKERS=0: the first part in one process.
# `make test-integration`: the tests marked `integration` (whole-system runs of minutes each:
# the real Slurm cluster, long hang and conversion faults, the GPU report's CPU smoke, CPU
# Adam), the same two parts. `make test-all`: both.
TEST_WORKERS ?= 2

.PHONY: install test test-integration test-all demo bench gpu-report extrapolation clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# $(call suite,<marker expression>): the two parts over the tests it selects.
suite = rc=0; none=0; echo "== $(1): $(TEST_WORKERS) workers (the tests marked 'alone' follow) =="; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m '($(1)) and not alone' $(PYTEST_ARGS) || { code=$$?; [ $$code -eq 5 ] && none=1 || rc=$$code; }; \
	echo "== $(1): the tests that run alone (marked 'alone') =="; \
	$(PY) -m pytest -m '($(1)) and alone' $(PYTEST_ARGS) || { code=$$?; [ $$code -eq 5 ] && [ $$none -eq 0 ] || rc=$$code; }; \
	exit $$rc

test: $(STAMP)
	@$(call suite,not integration)

test-integration: $(STAMP)
	@$(call suite,integration)

test-all: $(STAMP)
	@rc=0; $(MAKE) --no-print-directory test || rc=1; \
	$(MAKE) --no-print-directory test-integration || rc=1; exit $$rc

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
