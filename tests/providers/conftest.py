"""The mock upstream the provider tests talk to over HTTP/2 + TLS (one process per module)."""

from __future__ import annotations

import pytest

from velox_lab.mock import MockUpstream


@pytest.fixture(scope="module")
def mock(tmp_path_factory):
    log = tmp_path_factory.mktemp("mock") / "stderr.log"
    with MockUpstream(log_path=str(log), name="providers") as m:
        yield m
    assert "Traceback" not in m.log_text(), m.log_text()  # no callback blew up in the mock
