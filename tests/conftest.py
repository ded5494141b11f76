"""Fixtures shared by every test package."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any, Protocol

import pytest

from velox_lab.mock import MockUpstream


class Closable(Protocol):
    def close(self) -> None: ...


# Clients the tests' helpers make (tests/e2e/conftest.py: client_for, raw) are closed when the
# test ends: their pooled keep-alive connections would otherwise be closed by the garbage
# collector, in whatever test runs then, with a ResourceWarning (an error: pyproject.toml's
# filterwarnings).
OPEN_CLIENTS: list[Closable] = []


def closed_after_the_test(client: Closable) -> Closable:
    OPEN_CLIENTS.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_the_tests_clients() -> Iterator[None]:
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()
    # What the test left unclosed is found now, so the ResourceWarning (an error: pyproject's
    # filterwarnings) names this test rather than whichever test the collector ran in next.
    gc.collect()


@pytest.fixture(scope="module")
def logged_mock(tmp_path_factory):
    """One mock upstream per test module (HTTP/2 + TLS), its stderr kept: a callback that blew
    up inside the mock fails the module even when every answer looked right."""
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(log_path=str(log)) as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()


@pytest.fixture
def receiver() -> Iterator[Any]:
    """A real OTLP/HTTP traces receiver on 127.0.0.1 (tests/otlp.py), closed after the test."""
    from tests.otlp import Receiver  # opentelemetry-proto: only for the tests that use it

    r = Receiver()
    yield r
    r.close()
