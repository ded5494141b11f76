"""The gateway keys' shared limits: one native `Limits` and the per-key refusal counters.

Made by the supervisor before it forks (`SharedStats` holds it), used by every worker's keys
stage (velox.admission.keys) and read by /stats and /metrics. Key i owns two entries of the
`Limits`: 2i is its request bucket and its gauge of requests in flight, 2i+1 its token bucket;
buckets hold one minute's worth (burst = the limit). A reload keeps the buckets and gauges
when the list of key names is unchanged (the same `Limits`, reconfigured: levels kept, capped
at the new limits); otherwise the new configuration's keys start afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from velox._native import Counters, Limits
from velox.config.tables import MAX_KEYS, KeySpec
from velox.core.fields import KF, REFUSAL_REASONS


def rpm_index(key: int) -> int:
    """The Limits entry of key i's request bucket and gauge."""
    return 2 * key


def tpm_index(key: int) -> int:
    """The Limits entry of key i's token bucket."""
    return 2 * key + 1


class SharedKeys:
    """The keys' buckets, gauges and counters, in shared memory; made by the supervisor."""

    __slots__ = ("keys", "slots", "limits", "counters")

    def __init__(self, keys: Sequence[KeySpec], slots: int,
                 previous: SharedKeys | None = None) -> None:
        # The configuration refuses more (velox.config.tables); a Counters row holds 4,096 fields.
        assert len(keys) <= MAX_KEYS, len(keys)
        self.keys = tuple(keys)
        self.slots = slots
        same = previous is not None and previous.slots == slots and \
            [k.name for k in previous.keys] == [k.name for k in keys]
        if same:
            assert previous is not None
            self.limits = previous.limits
            self.counters = previous.counters
        else:
            self.limits = Limits(max(1, 2 * len(keys)), slots=slots)
            self.counters = tuple(Counters(slots, max(1, len(keys))) for _ in KF)
        for i, key in enumerate(self.keys):
            # One minute's worth: a key may spend its whole minute at once, then the rate.
            if key.rpm:
                self.limits.configure(rpm_index(i), key.rpm, key.rpm)
            if key.tpm:
                self.limits.configure(tpm_index(i), key.tpm, key.tpm)

    def forget_slot(self, slot: int) -> int:
        """A worker of `slot` died: give back the places it held (see Limits.forget_slot)."""
        return self.limits.forget_slot(slot)

    def snapshot(self) -> list[dict[str, Any]]:
        """Per key, for /stats: limits, what is left, in flight, counts."""
        totals = [c.totals() for c in self.counters]
        return [self._row(i, totals) for i in range(len(self.keys))]

    def metrics_rows(self, own: int) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """For /metrics: the rows of the first `own` keys (file order), and the others summed
        (requests, in flight, refusals; None when there are no others). Only those keys are
        read: a scrape with thousands of keys costs the supervisor what `own` keys cost."""
        totals = [c.totals() for c in self.counters]
        own = min(own, len(self.keys))
        rows = [self._row(i, totals) for i in range(own)]
        if own == len(self.keys):
            return rows, None
        limits, rest = self.limits, range(own, len(self.keys))
        other = {
            "keys": len(rest),
            "requests": sum(limits.entered(rpm_index(i)) for i in rest),
            "active": sum(limits.active(rpm_index(i)) for i in rest),
            "refused": {reason: sum(totals[KF.REFUSED_RPM + n][own:])
                        for n, reason in enumerate(REFUSAL_REASONS)},
        }
        return rows, other

    def _row(self, i: int, totals: list[list[int]]) -> dict[str, Any]:
        key, limits = self.keys[i], self.limits
        return {
            "name": key.name,
            "rpm": key.rpm, "tpm": key.tpm, "max_parallel": key.max_parallel,
            "models": list(key.models) if key.models is not None else None,
            "remaining_requests": limits.level(rpm_index(i)) if key.rpm else None,
            "remaining_tokens": limits.level(tpm_index(i)) if key.tpm else None,
            "tokens_taken": limits.taken(tpm_index(i)) if key.tpm else 0,
            "active": limits.active(rpm_index(i)),
            "requests": limits.entered(rpm_index(i)),
            "refused": {reason: totals[KF.REFUSED_RPM + n][i]
                        for n, reason in enumerate(REFUSAL_REASONS)},
        }
