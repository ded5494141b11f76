"""Fixtures shared by every test package."""

from __future__ import annotations

import pytest

from velox.mock import MockUpstream


@pytest.fixture(scope="module")
def logged_mock(tmp_path_factory):
    """One mock upstream per test module (HTTP/2 + TLS), its stderr kept: a callback that blew
    up inside the mock fails the module even when every answer looked right."""
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(log_path=str(log)) as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()
