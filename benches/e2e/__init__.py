"""End-to-end load benchmark: Velox against direct, nginx (cleartext and TLS upstream) and
LiteLLM, on one machine.

`python -m benches.e2e run` (`make bench-e2e`) starts the bundled mock upstream, Velox, nginx
as a plain reverse proxy and LiteLLM's proxy, drives them with wrk and the project's own load
generator, and writes benches/results/e2e.json and e2e.csv; `python -m benches.e2e soak`
(`make bench-soak`) is the long memory run. See docs/benchmarks.md for the method.

Modules: machine (facts, /proc accounting, lock), workload (the requests), targets (the
processes), wrk and loadgen (the generators), bench (one measured run), sections (what a run
measures), summary (medians, overheads, goals), results (files), soak, litellm (its venv).

Importing this package is cheap: nothing is started or imported until a command runs.
"""
