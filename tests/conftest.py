"""Fixtures shared by every test package."""

from __future__ import annotations

import gc
import importlib
import os
import ssl
from collections.abc import Iterator
from typing import Any, Protocol

import pytest
from hypothesis import settings

from velox_lab.mock import MockUpstream

# Hypothesis fails an example that takes longer than 200 ms by default, and again when a rerun
# is quicker ("unreliable timings"): on a busy 2-core host a plain state-table example took
# 393 ms once and 17 ms on its rerun. How long an example takes is not what these tests
# check (the benchmarks measure speed), so no example has a deadline.
settings.register_profile("velox", deadline=None)
settings.load_profile("velox")


# Every httpx client makes an SSL context as it is made, loading the CA bundle: 22-28 ms of
# CPU, though the gateways under test speak plain HTTP. The tests make thousands of clients
# (the SDKs' own are httpx2's, openai's and anthropic's): 685 in five of the e2e files, 10.9 s
# of the 24.5 s of CPU their test process used. The default context (verify=True, no client
# certificate, the same SSL_CERT_* variables) is made once per library and shared: one
# SSLContext serves any number of connections, with the settings each client would have
# made. Clients given their own `verify` (the mock's CA, a context) are not affected.
def _share_the_default_ssl_context(transports: Any) -> None:
    make = transports.create_ssl_context
    made: dict[tuple[object, ...], ssl.SSLContext] = {}

    def shared(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)  # type: ignore[no-any-return]
        key = (trust_env, os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        if key not in made:
            made[key] = make(verify=True, cert=None, trust_env=trust_env)
        return made[key]

    transports.create_ssl_context = shared


for _library in ("httpx", "httpx2"):
    _share_the_default_ssl_context(importlib.import_module(f"{_library}._transports.default"))


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


# Why the collector runs after every test, and why on so few objects: what a test left
# unclosed in a reference cycle must be found at its end, so the ResourceWarning (an error:
# pyproject's filterwarnings) names that test rather than whichever test the collector ran in
# next. A full collection walks every tracked object, though: with the SDKs, hypothesis and
# the product imported, 0.05-0.2 s a test on a busy 2-core host, about a third of the unit
# suite's time. So what is alive once a test has been collected is frozen (gc.freeze: left out
# of later collections); each test's collection then walks only the objects made since, which
# are all a test can have leaked. What a module's or the session's fixtures hold outlives their
# tests: it is unfrozen and collected when they end (below), so their leaks are still found,
# at the teardown of the scope that made them.


@pytest.fixture(autouse=True, scope="session")
def _collect_what_the_session_left() -> Iterator[None]:
    gc.collect()  # what collection (imports, parametrizations) left behind
    gc.freeze()
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _collect_what_the_module_left() -> Iterator[None]:
    yield
    # Autouse, so set up before the module's other fixtures and torn down after them.
    gc.unfreeze()
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _close_the_tests_clients() -> Iterator[None]:
    yield
    while OPEN_CLIENTS:
        OPEN_CLIENTS.pop().close()
    gc.collect()  # only what this test made (see above)
    gc.freeze()


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
