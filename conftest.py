"""Project-wide pytest configuration.

`pytest` runs the tests in tests/; `pytest --benchmark` runs the benchmark suite in benches/
instead (pytest-benchmark does the timing). Keeping them apart keeps `make test` fast and keeps
timing out of the tests, where a shared machine's noise would make assertions flaky.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).parent
BENCHES = ROOT / "benches"
TESTS = ROOT / "tests"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--benchmark",
        action="store_true",
        default=False,
        help="run the benchmark suite in benches/ instead of the tests",
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Initial paths (testpaths) are always visited; filter what lies under them instead.
    benchmarking = config.getoption("--benchmark")
    excluded = TESTS if benchmarking else BENCHES
    if collection_path != excluded and collection_path.is_relative_to(excluded):
        return True
    return None
