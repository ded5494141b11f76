"""What a keyed request's lookup and admission cost as the key table grows (velox.state.keys.
KeyTable: segments of 4,096 keys on memfds).

The request path finds its key by one dict lookup of the credential's digest, then makes one
native `Limits.admit` on the key's own segment (a key holds its segment's Limits and its
local entry, so no second lookup is made). Per request, for 1,024 different present keys in
turn (so caches are not always warm), at 10, 10,000 and 100,000 keys:

* `today`: the one anonymous Limits sized by the keys, as SharedKeys makes it before this
  table (4,096 keys at most, so 10 only);
* `table`: the same calls on KeyTable segments (100,000 keys: 25 segments).

Buckets are configured so large that nothing is refused: the admitted path is measured.
Run: `pytest --benchmark benches/bench_keytable.py -s`.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest

from velox.state.keys import KeyTable, rpm_index
from velox.state.limits import Limits

BIG = 10**9  # rate and burst: never refused within a run
PROBES = 1024


def _digests(keys: int) -> list[bytes]:
    return [hashlib.sha256(os.urandom(16)).digest() for _ in range(keys)]


def _run(benchmark: Any, by_digest: dict[bytes, tuple[Any, int]], keys: int, shape: str) -> None:
    digests = list(by_digest)
    probe = [digests[(i * 7919) % keys] for i in range(PROBES)]
    get = by_digest.get

    def requests() -> None:
        for d in probe:
            admit, entry = get(d)  # type: ignore[misc]
            admit(entry, -1, 0, entry, 0, 0)

    benchmark(requests)
    per_ns = benchmark.stats.stats.median / PROBES * 1e9
    benchmark.extra_info.update(keys=keys, shape=shape, ns_per_request=round(per_ns, 1))
    print(f"\n{shape}, {keys:,} keys: {per_ns:.1f} ns per lookup + admit")


def test_today_one_limits(benchmark: Any) -> None:
    keys = 10
    limits = Limits(2 * keys, slots=2)
    by_digest = {}
    for i, d in enumerate(_digests(keys)):
        limits.configure(rpm_index(i), BIG, BIG)
        by_digest[d] = (limits.admit, rpm_index(i))
    _run(benchmark, by_digest, keys, "today")


@pytest.mark.parametrize("keys", [10, 10_000, 100_000])
def test_key_table(benchmark: Any, keys: int) -> None:
    table = KeyTable(slots=2)
    while table.capacity < keys:
        table.grow()
    by_digest = {}
    for i, d in enumerate(_digests(keys)):
        segment, k = table.locate(i)
        segment.limits.configure(rpm_index(k), BIG, BIG)
        by_digest[d] = (segment.limits.admit, rpm_index(k))
    _run(benchmark, by_digest, keys, "table")
