"""Fixtures for the several-hosts tests: a real redis-server on a free port of 127.0.0.1."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from velox_lab.launch import RedisProcess


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisProcess]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run `make redis-server` (Debian's package)")
    server = RedisProcess(log_path=tmp_path / "redis.log")
    with server:
        yield server
