"""The balancer's per-upstream tpm (velox.routing.balance with a plain-Python token bucket): a
target whose bucket cannot cover the estimate is skipped, the attempt holds its reservation, a
failed or retried attempt gives it back, and when no target can take the tokens the 429 carries the
bucket's wait."""

from __future__ import annotations

import random

from tests.unit.test_balance import FakeState, route, tables
from velox.core.errors import RateLimited
from velox.routing.balance import Event, Router, verdict_of
from velox.state.health import NEUTRAL, SUCCESS


class FakeTokens:
    """balance.TokenBuckets: levels per upstream (None: no tpm), no refill."""

    def __init__(self, levels: dict[int, int]) -> None:
        self.levels = dict(levels)

    def reserve(self, u: int, tokens: int) -> tuple[int, int]:
        if u not in self.levels:
            return 0, 0
        if self.levels[u] < tokens:
            return 0, 7_500_000  # 7.5 s
        self.levels[u] -= tokens
        return tokens, 0

    def give(self, u: int, tokens: int) -> None:
        self.levels[u] += tokens


def make(levels: dict[int, int]) -> tuple[Router, FakeState, FakeTokens]:
    state = FakeState(3)
    tpm = FakeTokens(levels)
    r = route("m", (0, 100, 0), (1, 1, 1), (2, 1, 2))  # 0 first, then 1, then 2
    router = Router(tables([r], 3), state, rng=random.Random(1), tpm=tpm)
    return router, state, tpm


def test_a_target_that_cannot_cover_the_estimate_is_skipped() -> None:
    router, state, tpm = make({0: 250})
    held = []
    for expect in (0, 0, 1):
        plan = router.plan("m")
        assert plan is not None
        plan.tokens = 100
        attempt = plan.first()
        assert not isinstance(attempt, Exception)
        assert attempt.upstream == expect
        assert attempt.tokens == (100 if expect == 0 else 0)  # 1 has no tpm: nothing held
        held.append((plan, attempt))
    assert tpm.levels[0] == 50
    assert state.in_flight_ == [2, 1, 0]  # the refusal took no in-flight place on 0
    # finish() gives back what an attempt still holds (nobody settled it)
    plan, attempt = held[0]
    plan.finish(attempt, SUCCESS)
    assert tpm.levels[0] == 150 and attempt.tokens == 0


def test_a_settled_attempt_gives_nothing_back_twice() -> None:
    router, _state, tpm = make({0: 500})
    plan = router.plan("m")
    assert plan is not None
    plan.tokens = 100
    attempt = plan.first()
    assert not isinstance(attempt, Exception)
    attempt.tokens = 0  # what the meter does after settling with the upstream's usage
    plan.finish(attempt, SUCCESS)
    assert tpm.levels[0] == 400


def test_a_retried_attempt_returns_its_reservation() -> None:
    router, state, tpm = make({0: 500, 1: 500})
    plan = router.plan("m")
    assert plan is not None
    plan.tokens = 120
    first = plan.first()
    assert not isinstance(first, Exception) and first.upstream == 0
    nxt = plan.retry(first, verdict_of(Event.RESPONSE, 503))
    assert nxt is not None and nxt.upstream == 1 and nxt.tokens == 120
    assert tpm.levels == {0: 500, 1: 380}
    plan.finish(nxt, NEUTRAL)
    assert tpm.levels == {0: 500, 1: 500}
    assert state.idle()


def test_no_target_with_tokens_is_429_with_the_buckets_wait() -> None:
    router, state, tpm = make({0: 10, 1: 10, 2: 10})
    plan = router.plan("m")
    assert plan is not None
    plan.tokens = 100
    refused = plan.first()
    assert isinstance(refused, RateLimited)
    assert refused.retry_after_s == 8  # 7.5 s rounded up
    assert state.idle() and tpm.levels == {0: 10, 1: 10, 2: 10}


def test_without_an_estimate_nothing_is_reserved() -> None:
    router, _state, tpm = make({0: 0})
    plan = router.plan("m")
    assert plan is not None
    attempt = plan.first()  # plan.tokens == 0: a request nobody estimated
    assert not isinstance(attempt, Exception) and attempt.upstream == 0
    assert attempt.tokens == 0 and tpm.levels[0] == 0
