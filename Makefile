# Two entry points on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

bench: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/space_freeze.py
	$(BIN)/python bench/zoo_trace.py
	$(BIN)/python bench/bookkeeping.py
	$(BIN)/python bench/random_search.py
	$(BIN)/python bench/nb201_quality.py

clean:
	rm -rf $(VENV) build src/*.egg-info
