# The two front-door commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test demo bench extrapolation clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	bash launch/demo.sh

bench: $(STAMP)
	$(PY) benchmarks/run.py

extrapolation: $(STAMP)
	$(PY) benchmarks/length_extrapolation.py

clean:
	rm -rf $(VENV) build *.egg-info
