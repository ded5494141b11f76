# Velox: `make demo` to try it, `make test` to check it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: all install build test test-native test-py typecheck lint demo bench bench-deps bench-litellm bench-e2e \
	bench-routing bench-cache bench-batching bench-soak bench-report redis-server chromium bench-cluster \
	bench-native docs clean

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

# -j2: the normal, TSan and ASan+UBSan builds compile every source again (about 115 s of CPU
# in all); two jobs at a time use both cores of a 2-core box. Each suite still runs its
# programs one after another.
test-native:
	$(MAKE) -C native -j2 test

# The C suite already ran in test-native; its pytest wrapper (marked slow) is skipped here.
# Two pytest processes (pytest-xdist), each taking whole files (--dist loadfile), so a module's
# shared gateway or mocks start once: most tests wait on sockets and child processes, and
# the suite took about 15 minutes in one process on a busy 2-core box. Ports are free ones
# picked per gateway/mock, and temporary directories are per process.
test-py: build
	$(VENV)/bin/pytest -q -m "not slow" -n 2 --dist loadfile

# The egress contracts (velox/egress/interfaces.py) are Protocols: mypy checks both sides.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# ruff over every Python file ([tool.ruff] in pyproject.toml), then the import contract
# ([tool.importlinter]): the layers of velox/, no cycles, and the lab (velox_lab/) kept out of
# the product.
lint: $(STAMP)
	$(VENV)/bin/ruff check
	$(VENV)/bin/lint-imports

# The several-hosts mode (VELOX_REDIS_URL) is tested and demonstrated against a real Redis:
# Debian's redis-server, installed when missing (the tests start their own on a free port).
redis-server:
	@command -v redis-server >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# The console's browser tests drive Debian's headless chromium through its chromedriver
# (Selenium, from the dev extra): installed when missing, nothing downloaded at run time.
chromium:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver; }

test: build typecheck lint test-native redis-server chromium test-py

demo: build
	$(PY) -m velox demo

# The generated docs: the configuration reference (from the settings and table parsers), the
# README's variable table and tables example, and every example block in README.md and docs/
# (from a real gateway in front of the mock). `make test` checks all of them are current.
docs: build
	$(PY) -m velox.config.reference > docs/reference/configuration.md
	$(PY) -m velox_lab.docs_examples

bench: build
	$(VENV)/bin/pytest --benchmark

# End-to-end benchmarks (benches/e2e, docs/benchmarks.md): wrk and nginx from Debian if missing,
# matplotlib for the report, LiteLLM in its own venv (.bench/) from a hash-pinned lock.
BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(PIP) install --quiet -c constraints.txt -e '.[bench]'
	touch $(BENCH_STAMP)

bench-deps: build $(BENCH_STAMP)
	@command -v wrk >/dev/null && command -v nginx >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq wrk nginx-light; }

bench-litellm: $(STAMP)
	$(PY) -m benches.e2e install-litellm

bench-e2e: bench-deps bench-litellm
	$(PY) -m benches.e2e run

# Three upstreams against one, and failover with one of three down (benches/e2e/routing.py).
bench-routing: bench-deps
	$(PY) -m benches.e2e routing

# The cache's hit path against a proxied miss, and a repeat workload (benches/e2e/cache.py).
bench-cache: bench-deps
	$(PY) -m benches.e2e cache

# Embeddings batching on and off at 1, 64 and 256 connections (benches/e2e/batching.py).
bench-batching: bench-deps
	$(PY) -m benches.e2e batching
	$(PY) -m benches.report --only batching

# Issue 12's comparison alone (about 12 minutes): Velox, direct, nginx and nginx in front of the
# TLS mock at 1 and 64 connections, the stream section, Velox's HTTP/1.1 cleartext egress, and
# Velox without its access log (nginx runs with access_log off).
bench-native: bench-deps
	$(PY) -m benches.e2e run --no-litellm --sections fixed,stream,arch --concurrencies 1,64 \
		--arch "default;egress=http1 cleartext;access_log=0" --name e2e-native

bench-soak: bench-deps
	$(PY) -m benches.e2e soak

# Three hosts sharing one Redis, at three times a 600 rpm limit for 60 s with Redis killed
# for 20 s in the middle (benches/e2e/cluster.py): benches/results/cluster.json.
bench-cluster: bench-deps redis-server
	$(PY) -m benches.e2e cluster

bench-report: bench-deps
	$(PY) -m benches.report

clean:
	rm -rf build native/build velox/*.so .pytest_cache .benchmarks
	$(MAKE) -C native clean
