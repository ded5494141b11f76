"""Pure-Python reference twins of the balancer's native hashing (native/vx_health.c).

`hash64` names a target and a request's affinity key with a hash that is the same in every
worker, run and host; `Rendezvous` ranks a route's targets for a key by weighted rendezvous
hashing. These twins say what the C computes in a few lines each (the same integer mixing, the
same libm `log` of the same doubles) and tests/native/test_hash_twins.py drives both with
generated inputs and compares every result bit for bit. The native ones cost about 0.1 us a
call, these about 3 to 30: the gateway hashes with them only with VELOX_NATIVE=0
(velox.routing.balance.use).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi: spreads the length and each word
_INT64 = (-(1 << 63), (1 << 63) - 1)
MAX_TARGETS = 64


def _mix64(x: int) -> int:
    """Stafford's mix13 (the murmur3 finaliser variant the C uses), on 64-bit words."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def hash64(data: bytes | bytearray | memoryview, seed: int = 0, /) -> int:
    """vx_hash64: little-endian 8-byte words mixed in order, then the tail and the length."""
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}")
    seed = min(max(seed, _INT64[0]), _INT64[1]) & _MASK  # to_i64 saturates, then uint64
    raw = bytes(data)
    n = len(raw)
    h = _mix64(seed ^ ((_GOLDEN * (n + 1)) & _MASK))
    whole = n - n % 8
    for at in range(0, whole, 8):
        h = (_mix64(h ^ int.from_bytes(raw[at:at + 8], "little")) * _GOLDEN) & _MASK
    tail = int.from_bytes(raw[whole:], "little")
    return _mix64(h ^ tail ^ (((n % 8) << 56) & _MASK))


class Rendezvous:
    """The native Rendezvous' API: 1 to 64 targets named by 64-bit seeds, weights in (0, 1e9]."""

    def __init__(self, seeds: Sequence[int], weights: Sequence[float]) -> None:
        if not 1 <= len(seeds) <= MAX_TARGETS or len(weights) != len(seeds):
            raise ValueError("seeds and weights must have the same length, 1 to 64")
        self.seeds = [int(s) & _MASK for s in seeds]  # the C masks to uint64 as well
        self.weights = [float(w) for w in weights]
        for w in self.weights:
            if not 0.0 < w <= 1e9:
                raise ValueError(f"weights must be in (0, 1e9], got {w!r}")

    def __len__(self) -> int:
        return len(self.seeds)

    def rank(self, key_hash: int, /) -> tuple[int, ...]:
        """Indices best first: u = 53 random bits of mix(key ^ seed) in (0, 1); score
        weight / -ln(u), or u alone when every weight is equal (the same order); ties keep the
        lower index first, as the C's insertion sort does."""
        key = key_hash & _MASK
        equal = all(w == self.weights[0] for w in self.weights)
        scores = []
        for seed, weight in zip(self.seeds, self.weights, strict=True):
            u = ((_mix64(key ^ seed) >> 11) + 0.5) * 2.0 ** -53
            scores.append(u if equal else weight / -math.log(u))
        return tuple(sorted(range(len(scores)), key=lambda i: -scores[i]))

    def first(self, key_hash: int, /) -> int:
        return self.rank(key_hash)[0]
