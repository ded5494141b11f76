"""The gateway's global limit (velox.admission.ratelimit.Limiter): entry 0 of a native Limits,
clock-refilled alone, leased with Redis. Socket-free: the real shared bucket, no clock tricks
beyond what one minute of refill at the rates used here cannot disturb."""

from __future__ import annotations

from velox.admission.ratelimit import GLOBAL, Limiter


def test_no_limit_admits_everything() -> None:
    limiter = Limiter.create(0, 0)
    assert not limiter.enabled and limiter.take(1000) == 1000 and limiter.available() == -1


def test_a_batch_takes_the_prefix_the_bucket_holds_then_waits_for_the_rate() -> None:
    limiter = Limiter.create(6, 5)  # one token every 10 s: no refill within the test
    assert limiter.enabled and limiter.available() == 5
    assert limiter.take(8) == 5  # the first five of the batch
    assert limiter.take(3) == 0 and limiter.available() == 0
    assert limiter.retry_after_s() == 10  # a whole token at 6 per minute


def test_retry_after_is_at_least_a_second() -> None:
    limiter = Limiter.create(600_000, 1)  # refills faster than a second
    assert limiter.take(1) == 1
    assert limiter.retry_after_s() == 1


def test_shared_mode_is_a_leased_entry_filled_only_by_give() -> None:
    limiter = Limiter.create(600, 100, shared=True)
    assert limiter.shared and limiter.limits is not None
    assert limiter.take(4) == 0  # not configured until the Redis refresher adds it
    limiter.limits.configure(GLOBAL, 0, 100)  # what velox.cluster.leases does: rate 0, leased
    assert limiter.take(4) == 0  # nothing leased yet
    assert limiter.retry_after_s() == 1
    limiter.limits.give(GLOBAL, 3)  # a lease
    assert limiter.take(4) == 3 and limiter.available() == 0
