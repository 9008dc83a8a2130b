# Two entry points on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint test-slow bench clean fashion-mnist chromium

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# One pytest worker per core; a test file stays on one worker (its module fixtures, e.g. one local Ray, start
# once); files are handed out in collection order, the longest first (tests/conftest.py).
PYTEST_WORKERS := -n auto --dist loadfile --no-loadscope-reorder

test: $(STAMP) chromium lint
	$(BIN)/python -m pytest $(PYTEST_WORKERS)

# pyflakes-level checks everywhere, types on the core packages (settings in pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/mypy

# Debian's headless browser for the dashboard's browser tests; apt only when it is missing (they skip without it).
chromium:
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || (apt-get update -q && apt-get install -y -q chromium chromium-driver) || echo "chromium not installed: the dashboard's browser tests will skip"

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow $(PYTEST_WORKERS)

# Debian's Fashion-MNIST for bench/batching.py and bench/cse.py; apt only when the files are missing (it falls back to mnist5k).
FASHION := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
fashion-mnist:
	test -e $(FASHION) || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist) || echo "dataset-fashion-mnist not installed"

bench: $(STAMP) fashion-mnist
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/space_freeze.py
	$(BIN)/python bench/zoo_trace.py
	$(BIN)/python bench/bookkeeping.py
	$(BIN)/python bench/random_search.py
	$(BIN)/python bench/nb201_quality.py
	$(BIN)/python bench/batching.py
	$(BIN)/python bench/cse.py

clean:
	rm -rf $(VENV) build src/*.egg-info
