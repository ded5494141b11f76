# Velox: `make demo` to try it, `make test` to check it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: all install build test test-native test-py demo bench clean

all: build

$(STAMP): pyproject.toml setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	$(PIP) install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Rebuilt on every run so edits to native/ are always picked up (it takes a second).
build: $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace

test-native:
	$(MAKE) -C native test

# The C suite already ran in test-native; its pytest wrapper (marked slow) is skipped here.
test-py: build
	$(VENV)/bin/pytest -q -m "not slow"

test: build test-native test-py

demo: build
	$(PY) -m velox demo

bench: build
	$(VENV)/bin/pytest --benchmark

clean:
	rm -rf build native/build velox/*.so .pytest_cache .benchmarks
	$(MAKE) -C native clean
