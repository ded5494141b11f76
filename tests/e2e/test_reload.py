"""SIGHUP reloads the configuration: real gateways, the bundled mocks, the official SDK.

A gateway with two workers and a VELOX_CONFIG file routes model "m" to mock "a"; the file is
rewritten (mock "b" added, "m" routed to it) and the supervisor gets SIGHUP while a bounded
closed loop of 64 concurrent clients keeps calling. Every call must succeed, the workers must
all be new, and calls sent 2 s after the reload finished must all reach "b". A broken file is
refused with a log line naming file/table/key, and two SIGHUPs in a row are both honoured.
"""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import CLIENT_KEY, wait_for
from tests.e2e.test_routing import KEYS, start_mock, upstream_table
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

MESSAGES = [{"role": "user", "content": "hi"}]
ROUTE_TO = """
[[route]]
model = "m"
targets = [{{ upstream = "{name}" }}]
"""
DONE = "reload done: 2 worker(s) run the new configuration"


@pytest.fixture(scope="module")
def two_mocks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, MockUpstream]]:
    certdir = str(tmp_path_factory.mktemp("reload-certs"))
    started = {name: start_mock(name, certdir) for name in ("a", "b")}
    try:
        yield started
    finally:
        for mock in started.values():
            mock.stop()


def only_a(mocks: dict[str, MockUpstream]) -> str:
    return upstream_table("a", mocks["a"]) + ROUTE_TO.format(name="a")


def a_and_b_to_b(mocks: dict[str, MockUpstream]) -> str:
    return (upstream_table("a", mocks["a"]) + upstream_table("b", mocks["b"])
            + ROUTE_TO.format(name="b"))


def _gateway(tmp_path: Path, two_mocks: dict[str, MockUpstream], grace_s: int
             ) -> Iterator[tuple[GatewayProcess, Path]]:
    config = tmp_path / "velox.toml"
    config.write_text(only_a(two_mocks))
    env = {
        "VELOX_CONFIG": str(config), "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_SHUTDOWN_GRACE_S": str(grace_s), "VELOX_ACCESS_LOG": "0",
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}", **KEYS,
    }
    gw = GatewayProcess(env, log_path=tmp_path / "velox.log").start(wait_ready=True)
    try:
        yield gw, config
    finally:
        gw.stop()


@pytest.fixture
def gateway(tmp_path: Path, two_mocks: dict[str, MockUpstream]
            ) -> Iterator[tuple[GatewayProcess, Path]]:
    yield from _gateway(tmp_path, two_mocks, 5)


@pytest.fixture
def patient_gateway(tmp_path: Path, two_mocks: dict[str, MockUpstream]
                    ) -> Iterator[tuple[GatewayProcess, Path]]:
    """A grace period longer than a starved host takes to turn 64 busy keep-alive connections
    over to the new workers: past the grace, a draining worker closes what is left (as it
    should), and the clients sending on them then fail. With 5 s that happened at load 30.
    The drain ends as soon as the connections are gone, so the test takes no longer."""
    yield from _gateway(tmp_path, two_mocks, 30)


def stats(gw: GatewayProcess) -> dict[str, Any]:
    status, body = gw.admin_get("/stats")
    assert status == 200, body
    return orjson.loads(body)


def worker_pids(gw: GatewayProcess) -> set[int]:
    return {w["pid"] for w in stats(gw)["workers"]}


def upstream_of(gw: GatewayProcess) -> str:
    # Closed at once: an idle keep-alive connection would hold a reload's old worker draining
    # until its grace period ends.
    with openai.OpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY,
                       max_retries=0) as client:
        raw = client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        return raw.headers["x-velox-upstream"]


class Watch(threading.Thread):
    """Notes the monotonic time at which a line first appears in the gateway's log."""

    def __init__(self, gw: GatewayProcess, line: str, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.gw, self.line, self.timeout_s = gw, line, timeout_s
        self.seen_at: float | None = None

    def run(self) -> None:
        stop_at = time.monotonic() + self.timeout_s
        while time.monotonic() < stop_at:
            if self.line in self.gw.log():
                self.seen_at = time.monotonic()
                return
            time.sleep(0.05)


async def closed_loop(gw: GatewayProcess, concurrency: int, until: Any, max_s: float,
                      max_calls: int, fresh: bool = False) -> list[tuple[float, int | str, str]]:
    """(sent at, status or exception name, x-velox-upstream) per call; the SDK never retries.

    Runs until `until()` is true, bounded by `max_s` seconds and `max_calls` calls. `fresh`:
    every call on a new connection (the kernel hands each to one of the listening sockets).
    """
    out: list[tuple[float, int | str, str]] = []
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0)) if fresh \
        else None
    client = openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY,
                                max_retries=0, timeout=20, http_client=http)
    stop_at = time.monotonic() + max_s

    async def one() -> None:
        while len(out) < max_calls and time.monotonic() < stop_at and not until():
            sent = time.monotonic()
            try:
                raw = await client.chat.completions.with_raw_response.create(
                    model="m", messages=MESSAGES)
                out.append((sent, raw.status_code, raw.headers.get("x-velox-upstream", "?")))
            except openai.APIError as exc:
                cause = repr(exc.__cause__ or exc.__context__)[:160]
                out.append((sent, f"{type(exc).__name__}: {exc} ({cause})"[:300], "?"))

    try:
        await asyncio.gather(*(one() for _ in range(concurrency)))
    finally:
        await client.close()
    return out


def hup_under_load(gw: GatewayProcess, config: Path, text: str, line: str, before_s: float,
                   after_s: float, concurrency: int, fresh: bool = False,
                   ) -> tuple[list[tuple[float, int | str, str]], float, float]:
    """Calls for `before_s`, then `text` written to the file and SIGHUP, calls on until
    `after_s` after `line` shows in the log: (calls, when the HUP went, when `line` showed)."""
    watch = Watch(gw, line, timeout_s=90)
    hup_at: list[float] = []

    def until() -> bool:
        if not hup_at and time.monotonic() > started + before_s:
            hup_at.append(time.monotonic())
            config.write_text(text)
            gw.signal(signal.SIGHUP)
            watch.start()
        return watch.seen_at is not None and time.monotonic() > watch.seen_at + after_s

    started = time.monotonic()
    calls = asyncio.run(closed_loop(gw, concurrency, until, max_s=90, max_calls=100_000,
                                    fresh=fresh))
    assert watch.seen_at is not None, gw.log()[-3000:]
    return calls, hup_at[0], watch.seen_at


def test_sighup_under_load_switches_the_route_with_no_failed_request(
        patient_gateway: tuple[GatewayProcess, Path], two_mocks: dict[str, MockUpstream]) -> None:
    gw, config = patient_gateway
    assert upstream_of(gw) == "a"
    before = worker_pids(gw)
    # ~1.5 s of traffic before the HUP, then until 2.5 s after the reload is done.
    calls, hup_at, done_at = hup_under_load(gw, config, a_and_b_to_b(two_mocks), DONE,
                                            before_s=1.5, after_s=2.5, concurrency=64)
    failed = [c for c in calls if c[1] != 200]
    warnings = [line for line in gw.log().splitlines() if "WARNING" in line or "ERROR" in line]
    assert not failed, (len(failed), failed[:5], warnings[-20:])
    seen = Counter(up for _, _, up in calls)
    assert seen["a"] > 0 and seen["b"] > 0, seen
    late = [up for sent, _, up in calls if sent > done_at + 2.0]
    assert late and set(late) == {"b"}, Counter(late)
    early = [up for sent, _, up in calls if sent < hup_at]
    assert early and set(early) == {"a"}, Counter(early)
    after = worker_pids(gw)
    assert len(after) == 2 and not after & before, (before, after)
    for pid in before:  # the old workers drained and exited
        wait_for(lambda pid=pid: f"replaced worker pid {pid} exited (exit code 0)" in gw.log(),
                 timeout=15)
    # The admin server moved to the new shared state: both upstreams, b took the calls.
    ups = {u["name"]: u for u in stats(gw)["upstreams"]}
    assert set(ups) == {"a", "b"}, ups
    status, metrics = gw.admin_get("/metrics")
    assert status == 200 and b'upstream="b"' in metrics
    assert "died" not in gw.log()


def test_a_broken_table_is_refused_and_the_old_one_keeps_serving(
        gateway: tuple[GatewayProcess, Path], two_mocks: dict[str, MockUpstream]) -> None:
    gw, config = gateway
    before = worker_pids(gw)
    # A route to an upstream that does not exist: the tables loader names file, table, key.
    config.write_text(upstream_table("a", two_mocks["a"]) + ROUTE_TO.format(name="nope"))
    gw.signal(signal.SIGHUP)
    line = wait_for(lambda: [ln for ln in gw.log().splitlines()
                             if "configuration refused, the running one stays" in ln], timeout=15)
    assert str(config) in line[0] and "route" in line[0] and "nope" in line[0], line
    time.sleep(1.0)  # nothing else happens: no worker replaced
    assert worker_pids(gw) == before
    assert upstream_of(gw) == "a"
    # Not even TOML: refused the same way.
    config.write_text("[[upstream]\nname = ")
    gw.signal(signal.SIGHUP)
    wait_for(lambda: gw.log().count("configuration refused, the running one stays") == 2,
             timeout=15)
    assert worker_pids(gw) == before
    assert upstream_of(gw) == "a"
    assert "reload done" not in gw.log()


def test_after_a_reload_the_profiling_index_links_the_serving_workers(
        gateway: tuple[GatewayProcess, Path], two_mocks: dict[str, MockUpstream]) -> None:
    gw, config = gateway
    config.write_text(a_and_b_to_b(two_mocks))
    gw.signal(signal.SIGHUP)
    wait_for(lambda: DONE in gw.log(), timeout=60)
    serving = sorted(w["worker"] for w in stats(gw)["workers"])
    assert serving == [2, 3], serving  # the other half of the slots
    status, page = gw.admin_get("/debug/pprof/")
    assert status == 200
    linked = sorted(int(w) for w in re.findall(rb"worker=(\d+)\">worker", page))
    assert linked == serving, page.decode()
    for worker in linked:  # every link answers (the links' own 10 s, shortened)
        status, body = gw.admin_get(f"/debug/pprof/profile?seconds=0.3&worker={worker}"
                                    f"&format=text", timeout=30)
        assert status == 200, body[:300]
        assert f"velox worker {worker} (pid".encode() in body
    status, merged = gw.admin_get("/debug/pprof/profile?seconds=0.3&format=text", timeout=30)
    assert status == 200, merged[:300]
    assert b"2 velox workers merged: velox worker 2 (pid" in merged, merged[:600]
    assert b"; velox worker 3 (pid" in merged


def idle_keepalive_connections(gw: GatewayProcess, n: int) -> list[socket.socket]:
    """`n` client connections that made one request each and stay open, idle."""
    out = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", gw.port), timeout=5)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        out.append(sock)
    return out


def test_two_sighups_in_a_row_are_both_handled(
        gateway: tuple[GatewayProcess, Path], two_mocks: dict[str, MockUpstream]) -> None:
    gw, config = gateway
    first = {w["worker"]: w["pid"] for w in stats(gw)["workers"]}
    assert set(first) == {0, 1}
    # Idle keep-alive clients keep the replaced workers draining (up to the 5 s grace): the
    # second reload must wait for them before it reuses their slots.
    held = idle_keepalive_connections(gw, 8)
    try:
        config.write_text(a_and_b_to_b(two_mocks))
        gw.signal(signal.SIGHUP)
        wait_for(lambda: "SIGHUP: reloading the configuration" in gw.log(), timeout=15)
        gw.signal(signal.SIGHUP)  # during the first reload: queued, done once after
        wait_for(lambda: gw.log().count(DONE) == 2, timeout=90)
    finally:
        for sock in held:
            sock.close()
    for pid in first.values():
        wait_for(lambda pid=pid: f"replaced worker pid {pid} exited" in gw.log(), timeout=15)
    log = gw.log()
    assert "SIGHUP during a reload: queued" in log
    assert log.count("SIGHUP: reloading the configuration") == 2
    for slot, pid in first.items():  # back in slots 0 and 1, after their old workers left
        exited = log.index(f"replaced worker pid {pid} exited")
        assert exited < log.index(f"reload: worker {slot} (pid"), log[-4000:]
    after = worker_pids(gw)
    assert len(after) == 2 and not after & set(first.values())
    assert {w["worker"] for w in stats(gw)["workers"]} == {0, 1}
    assert upstream_of(gw) == "b"
    assert gw.proc is not None and gw.proc.poll() is None


def ready_within(config: Path, seconds: int) -> dict[str, str]:
    """A two-worker gateway on `config` whose reloads wait `seconds` for a new worker."""
    return {
        "VELOX_CONFIG": str(config), "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
        "VELOX_ACCESS_LOG": "0", "VELOX_RELOAD_READY_S": str(seconds),
        "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}", **KEYS, "KEY_DEAD": "sk-dead-0123456789",
    }


def test_a_new_worker_that_never_gets_ready_aborts_the_reload(
        tmp_path: Path, two_mocks: dict[str, MockUpstream]) -> None:
    config = tmp_path / "velox.toml"
    config.write_text(only_a(two_mocks))
    env = ready_within(config, 3)
    with GatewayProcess(env, log_path=tmp_path / "velox.log") as gw:  # started, then stopped
        before = worker_pids(gw)
        config.write_text(dead_route(two_mocks))
        gw.signal(signal.SIGHUP)
        wait_for(lambda: "reload aborted" in gw.log(), timeout=30)
        assert "was not ready within 3s (VELOX_RELOAD_READY_S)" in gw.log()
        wait_for(lambda: "replaced worker pid" in gw.log(), timeout=10)  # the new one, reaped
        assert worker_pids(gw) == before
        assert upstream_of(gw) == "a"
        assert "reload done" not in gw.log()
        ready = stats(gw)["workers"]
        assert len(ready) == 2 and all(w["ready"] for w in ready)


def dead_route(mocks: dict[str, MockUpstream]) -> str:
    """"m" routed only to an upstream nobody listens on: a worker running it is never ready."""
    dead = (f'[[upstream]]\nname = "dead"\norigin = "https://127.0.0.1:{free_port()}"\n'
            f'api_key_env = "KEY_DEAD"\nconnections = 1\n')
    return upstream_table("a", mocks["a"]) + dead + ROUTE_TO.format(name="dead")


def test_a_reload_that_cannot_serve_fails_no_request_under_load(
        tmp_path: Path, two_mocks: dict[str, MockUpstream]) -> None:
    """The new worker of a reload must not accept before it is ready: clients opening new
    connections while it starts (and when the aborted reload kills it) all get answers."""
    config = tmp_path / "velox.toml"
    config.write_text(only_a(two_mocks))
    with GatewayProcess(ready_within(config, 4), log_path=tmp_path / "velox.log") as gw:
        before = worker_pids(gw)
        # ~1 s of traffic, the HUP, then until 1.5 s after the new worker was killed.
        calls, hup_at, aborted_at = hup_under_load(
            gw, config, dead_route(two_mocks), "reload aborted", before_s=1.0, after_s=1.5,
            concurrency=16, fresh=True)
        failed = [c for c in calls if c[1] != 200]
        assert not failed, (len(failed), len(calls), failed[:5], gw.log()[-3000:])
        # New connections all through the ready window: calls started in each of its quarters
        # (a count would measure the host's speed; at load 20 the window saw 89 calls).
        quarter = (aborted_at - hup_at) / 4
        covered = {int((sent - hup_at) // quarter) for sent, _, _ in calls
                   if hup_at < sent < aborted_at}
        assert covered == {0, 1, 2, 3}, (covered, aborted_at - hup_at)
        assert Counter(up for _, _, up in calls) == {"a": len(calls)}
        assert "was not ready within 4s (VELOX_RELOAD_READY_S)" in gw.log()
        assert worker_pids(gw) == before
        assert "reload done" not in gw.log()
