"""The shape checks of Redis replies (velox.cache.redis.lookup_values,
velox.cluster.leases.lease_replies): a reply that is not what its command answers is an error like a
lost connection, never a crash further on. Socket-free; the real-socket test is
tests/cluster/test_cache_redis.py's server answering +OK to everything."""

from __future__ import annotations

import pytest

from velox.cache.redis import lookup_values
from velox.cluster.leases import ReplyShapeError, lease_replies


def test_lookup_values_accepts_what_set_and_mget_answer() -> None:
    assert lookup_values([True, b"OK", [b"v", None]], 2, 2) == [b"v", None]
    assert lookup_values([True], 1, 0) == []


@pytest.mark.parametrize("replies,writes,asks", [
    (b"OK", 0, 1),  # not a list at all
    ([b"OK"], 0, 1),  # MGET answered +OK
    ([[b"v"]], 0, 2),  # too few values
    ([[7]], 0, 1),  # a value that is not a string
    ([False, [None]], 1, 1),  # SET not OK
    ([True], 1, 1),  # a reply missing
])
def test_lookup_values_refuses_other_shapes(replies: object, writes: int, asks: int) -> None:
    with pytest.raises(ReplyShapeError):
        lookup_values(replies, writes, asks)


def test_lease_replies_reads_the_scripts_answers() -> None:
    assert lease_replies([[3, 4, 0, 1, 250]], [[4, 5]]) == (3, [(4, 0), (1, 250)])
    assert lease_replies([[2], [3, 0, 0]], [[], [-5]]) == (3, [(0, 0)])


@pytest.mark.parametrize("results,chunks", [
    (b"OK", [[1]]),
    ([b"OK"], [[1]]),
    ([[1, 1]], [[1]]),  # a pair missing
    ([[0, 1, 0]], [[1]]),  # no host alive: not the script's answer
    ([[1, 5, 0]], [[4]]),  # more granted than asked
    ([[1, b"1", 0]], [[1]]),  # not integers
])
def test_lease_replies_refuses_other_shapes(results: object, chunks: list[list[int]]) -> None:
    with pytest.raises(ReplyShapeError):
        lease_replies(results, chunks)
