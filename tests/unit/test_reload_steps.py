"""The supervisor's reload state machine, socket-free: no fork, fake pids and signals.

The real thing runs in tests/e2e/test_reload.py; this covers what a real run cannot make
happen on demand: the second new worker dying after the first slot was already switched, which
must switch that slot back so one configuration serves at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from typing import Any

import pytest

from velox import supervisor
from velox.config import settings as config
from velox.config.settings import Settings
from velox.core.fields import F
from velox.supervisor import Supervisor


@pytest.fixture
def sup(monkeypatch: pytest.MonkeyPatch) -> Any:
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(supervisor, "_signal", lambda pid, sig: sent.append((pid, sig)))
    s = Supervisor(Settings(workers=2, port=0, admin_addr="off", pin_workers=False))
    spawned: list[tuple[int, int, Settings]] = []
    deferred: list[bool] = []

    def fake_spawn(slot: int, defer: bool = False) -> int:
        pid = 1000 + len(spawned)
        spawned.append((pid, slot, s.generation[slot][0]))
        deferred.append(defer)
        s.children[pid] = slot
        return pid

    monkeypatch.setattr(s, "_spawn", fake_spawn)
    for slot in range(2):
        s._spawn(slot)
        s.shared.counters.set(slot, F.READY, 1)
    s.sent, s.spawned, s.deferred = sent, spawned, deferred  # type: ignore[attr-defined]
    yield s
    for sock in s.listeners:
        sock.close()


def test_the_second_new_worker_dying_switches_the_first_slot_back(
        sup: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "velox.supervisor")
    old = sup.settings
    new = dataclasses.replace(old, batch_max=old.batch_max + 1)
    monkeypatch.setattr(config, "load", lambda: new)
    shared = sup.shared
    sup._reload()
    sup._reload_step()  # logical slot 0: new worker in physical slot 2
    assert sup.spawned[-1][1:] == (2, new)
    sup._reload_step()  # not ready yet: nothing changes
    assert shared.active_slots() == [0, 1] and not sup.sent
    shared.counters.set(2, F.READY, 1)
    sup._reload_step()  # ready: 2 serves instead of 0, whose worker hands off; then slot 3
    assert shared.active_slots() == [1, 2]
    assert sup.sent == [(1000, signal.SIGUSR2)]
    assert sup.spawned[-1][1:] == (3, new)
    sup.reload.failed = "died with signal 9"  # what _reap records for the new worker
    del sup.children[sup.spawned[-1][0]]
    sup._reload_step()  # abort: switch slot 0 back to the running configuration
    assert "reload aborted: the new worker 3" in caplog.text
    sup._reload_step()  # physical slot 0's old worker is still draining: wait for it
    assert len(sup.spawned) == 4
    del sup.children[1000]  # it exited
    sup._reload_step()
    assert sup.spawned[-1][1:] == (0, old)
    shared.counters.set(0, F.READY, 1)
    sup._reload_step()
    assert shared.active_slots() == [0, 1]
    assert sup.sent[-1] == (sup.spawned[2][0], signal.SIGUSR2)  # the new-config worker
    sup._reload_step()
    assert sup.reload is None and sup.settings is old
    assert "every worker runs the previous configuration again" in caplog.text
    assert "reload done" not in caplog.text
    # Every worker a reload starts (the way back included) accepts only once it is ready;
    # the first ones accept at once (nobody else serves their sockets).
    assert sup.deferred == [False, False, True, True, True]


def test_a_refused_configuration_starts_nothing(
        sup: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> Settings:
        raise config.ConfigError("velox.toml: [[route]] 1: upstream 'nope' is not defined")

    monkeypatch.setattr(config, "load", broken)
    sup._reload()
    sup._reload_step()
    assert sup.reload is None and len(sup.spawned) == 2 and not sup.sent
    assert ("configuration refused, the running one stays: velox.toml: [[route]] 1: "
            "upstream 'nope'") in caplog.text
