"""Fixtures of the spend tests: the real redis-server of the several-hosts tests."""

from tests.cluster.conftest import redis_server  # noqa: F401 - a fixture, used by name
