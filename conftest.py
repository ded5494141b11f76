"""Project-wide pytest configuration.

`pytest` runs the tests in tests/; `pytest --benchmark` runs the benchmark suite in benches/
instead (pytest-benchmark does the timing). Keeping them apart keeps `make test` fast and keeps
timing out of the tests, where a shared machine's noise would make assertions flaky.
"""

from __future__ import annotations

import os
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


def pytest_configure(config: pytest.Config) -> None:
    # VELOX_NATIVE_LIB=<dir>: the tests import velox._native from that directory (the
    # sanitizer build of `make -C native ext-asan`) instead of the one built in place; the
    # session stops at once if that is not the module it got, so a run can never pass by
    # testing the ordinary build.
    lib = os.environ.get("VELOX_NATIVE_LIB")
    if lib:
        import velox

        velox.__path__.insert(0, str(Path(lib).resolve()))
        from velox import _native

        if Path(_native.__file__).resolve().parent != Path(lib).resolve():
            raise pytest.UsageError(f"VELOX_NATIVE_LIB={lib}: imported {_native.__file__}")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Initial paths (testpaths) are always visited; filter what lies under them instead.
    benchmarking = config.getoption("--benchmark")
    excluded = TESTS if benchmarking else BENCHES
    if collection_path != excluded and collection_path.is_relative_to(excluded):
        return True
    return None
