"""Operations hardening, on real gateways: SIGHUP, the admin token and bind rule, the admin
connection cap, descriptors inherited by restarted workers, hung workers, oversubscription.

Every test starts its own gateway (python -m velox) in front of the session's mock upstream,
sends real signals to real PIDs, and stops what it started.
"""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from velox.admin.server import MAX_CONNECTIONS, READ_TIMEOUT_S
from velox.system.ports import listening_inodes
from velox_lab.launch import GatewayProcess, free_port, http_get, raw_request
from velox_lab.mock import MockUpstream

from .conftest import GatewayFactory, client_for, gateway_env, wait_for

TOKEN = "admin-TOKEN-0123456789abcdef"


def stats(gw: GatewayProcess) -> dict[str, Any]:
    status, body = gw.admin_get("/stats")
    assert status == 200, body
    return orjson.loads(body)


def worker_pids(gw: GatewayProcess) -> list[int]:
    return [w["pid"] for w in stats(gw)["workers"]]


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def chat_ok(gw: GatewayProcess) -> None:
    reply = client_for(gw).chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content


def raw_admin(gw: GatewayProcess, request: bytes, timeout: float = 5.0) -> bytes:
    """Send one raw request to the admin port and read until the server closes."""
    url = gw.admin_url
    assert url is not None
    host, _, port = url.removeprefix("http://").rpartition(":")
    return raw_request(host, int(port), request, timeout)


# --- finding 5: SIGHUP --------------------------------------------------------------------


def test_sighup_to_workers_kills_nothing_and_to_the_supervisor_reloads(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="2")
    before = worker_pids(gw)
    for pid in before:  # a closed terminal signals the workers too: they ignore it
        os.kill(pid, signal.SIGHUP)
    time.sleep(1.0)  # long enough for a killed worker to be reaped and logged as died
    assert gw.proc is not None and gw.proc.poll() is None, gw.log()
    assert worker_pids(gw) == before
    assert "died" not in gw.log()
    gw.signal(signal.SIGHUP)  # the supervisor reloads: same configuration, new workers
    wait_for(lambda: "reload done: 2 worker(s) run the new configuration" in gw.log(),
             timeout=40)
    assert gw.proc.poll() is None, gw.log()
    after = worker_pids(gw)
    assert len(after) == 2 and not set(after) & set(before), (before, after)
    assert "died" not in gw.log()
    chat_ok(gw)


# --- finding 7: admin token, bind rule, read timeout, connection cap -----------------------


def test_admin_token_guards_every_path_but_healthz(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_ADMIN_TOKEN=TOKEN)
    url = gw.admin_url
    assert url is not None
    host, _, port = url.removeprefix("http://").rpartition(":")
    for path in ("/stats", "/metrics", "/debug/pprof/", "/debug/pprof/last"):
        status, body = http_get(host, int(port), path)
        assert status == 401, (path, body)
        assert b"VELOX_ADMIN_TOKEN" in body
        status, _ = http_get(host, int(port), path, headers={"Authorization": "Bearer wrong"})
        assert status == 401, path
        status, _ = http_get(host, int(port), path,
                             headers={"Authorization": f"Bearer {TOKEN}x"})
        assert status == 401, path
    head = raw_admin(gw, b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401")
    assert b'WWW-Authenticate: Bearer realm="velox-admin"' in head
    post = raw_admin(gw, b"POST /stats HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                     b"Connection: close\r\n\r\n")
    assert post.startswith(b"HTTP/1.1 401")
    assert gw.admin_get("/stats")[0] == 200  # admin_get carries the token
    assert gw.admin_get("/metrics")[0] == 200
    status, body = http_get(host, int(port), "/healthz")  # probes need no token
    assert status == 200 and orjson.loads(body)["status"] == "ok"
    assert TOKEN not in gw.log()


def test_admin_refuses_a_public_address_without_a_token(
        upstream: MockUpstream, tmp_path: Path) -> None:
    addr = f"0.0.0.0:{free_port()}"
    gw = GatewayProcess(gateway_env(upstream, VELOX_ADMIN_ADDR=addr),
                        log_path=tmp_path / "velox.log")
    with pytest.raises(RuntimeError, match="exited"):
        gw.start(timeout=20)
    assert gw.proc is not None and gw.proc.returncode != 0
    log = gw.log()
    assert f"VELOX_ADMIN_ADDR={addr} is not a loopback address" in log
    assert "set VELOX_ADMIN_TOKEN" in log and "bind 127.0.0.1" in log
    # With a token the same address is accepted (traffic still goes to 127.0.0.1 only).
    env = gateway_env(upstream, VELOX_ADMIN_ADDR=addr, VELOX_ADMIN_TOKEN=TOKEN)
    with GatewayProcess(env, log_path=tmp_path / "velox-2.log") as ok:
        port = int(addr.rpartition(":")[2])
        assert http_get("127.0.0.1", port, "/stats",
                        headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert http_get("127.0.0.1", port, "/stats")[0] == 401
        assert ok.proc is not None and ok.proc.poll() is None


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(65536) == b""
    except OSError:
        return True


def test_admin_slowloris_holds_no_slot_and_is_cut_at_the_head_deadline(
        start_gateway: GatewayFactory) -> None:
    """Connections trickling a head byte by byte (and more idle ones than the server serves at
    once) leave /healthz and authorized paths answering, hold no thread, and are closed within
    READ_TIMEOUT_S of their start however often they send."""
    gw = start_gateway(VELOX_ADMIN_TOKEN=TOKEN)
    url = gw.admin_url
    assert url is not None
    host, _, port = url.removeprefix("http://").rpartition(":")
    threads_before = len(os.listdir(f"/proc/{gw.pid}/task"))
    slow: list[socket.socket] = []
    try:
        for _ in range(4 * MAX_CONNECTIONS):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /stats HTTP/1.1\r\n")
            slow.append(sock)
        started = time.monotonic()
        assert raw_admin(gw, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                         ).startswith(b"HTTP/1.1 200")
        answer = raw_admin(gw, b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           b"Authorization: bearer " + TOKEN.encode() + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]  # the scheme in any case
        assert raw_admin(gw, b"GET /stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
                         ).startswith(b"HTTP/1.1 401")
        threads = len(os.listdir(f"/proc/{gw.pid}/task"))
        assert threads <= threads_before + 2, (threads_before, threads)
        # One byte a second on each: a per-recv timeout would never fire.
        open_ = list(slow)
        while open_ and time.monotonic() - started < READ_TIMEOUT_S + 20:
            for sock in list(open_):
                if _closed_by_server(sock):
                    open_.remove(sock)
                    continue
                try:
                    sock.sendall(b"x")
                except OSError:
                    open_.remove(sock)
            time.sleep(1.0)
        assert not open_, f"{len(open_)} trickling connection(s) still open"
        assert time.monotonic() - started >= READ_TIMEOUT_S - 2  # cut by the deadline, not at once
    finally:
        for sock in slow:
            sock.close()
    assert gw.admin_get("/stats")[0] == 200


# --- finding 8: descriptors a restarted worker inherits ------------------------------------


def test_a_restarted_worker_holds_no_admin_sockets(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_ACCESS_LOG="0")
    url = gw.admin_url
    assert url is not None
    host, _, port = url.removeprefix("http://").rpartition(":")
    first = worker_pids(gw)
    baseline = fd_count(first[0])
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CONNECTIONS - 4):  # keep-alive clients, each answered once
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held.append(sock)
        os.kill(first[0], signal.SIGKILL)
        fresh = wait_for(lambda: (p := worker_pids(gw))[0] != first[0] and p[0] and p[0],
                         timeout=20)
        wait_for(lambda: stats(gw)["workers"][0]["ready"], timeout=20)
        # Only its slot's listening socket, which the supervisor holds for every worker.
        listening = {f"socket:[{i}]" for i in listening_inodes(gw.host, gw.port)}
        shared = socket_inodes(fresh) & socket_inodes(gw.pid)
        assert len(shared & listening) == 1, (shared, listening)
        shared -= listening
        assert not shared, f"the restarted worker shares {len(shared)} socket(s) with the admin"
        assert fd_count(fresh) <= baseline + 2, (baseline, fd_count(fresh))
    finally:
        for sock in held:
            sock.close()
    chat_ok(gw)


# --- finding 9: a hung worker --------------------------------------------------------------


def _continue_if_stopped(pid: int, parent: int) -> None:
    """Undo our SIGSTOP if the process is still that stopped worker of ours."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return
    if fields[0] == "T" and int(fields[1]) == parent:
        os.kill(pid, signal.SIGCONT)


def test_a_stopped_worker_is_marked_not_ready_then_replaced(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKER_HANG_S="4", VELOX_ACCESS_LOG="0")
    victim = worker_pids(gw)[0]
    # /readyz answered from a worker's live pool state; its READY gauge follows on its tick.
    wait_for(lambda: stats(gw)["workers"][0]["ready"], timeout=10)
    os.kill(victim, signal.SIGSTOP)
    try:
        def silent() -> dict[str, Any] | None:
            doc = stats(gw)
            w = doc["workers"][0]
            return doc if w["pid"] == victim and not w["ready"] else None

        doc = wait_for(silent, timeout=10)
        assert doc["workers"][0]["heartbeat_age_ms"] >= 1000
        health = orjson.loads(gw.admin_get("/healthz")[1])
        assert health["workers_ready"] <= 1

        def readyz() -> int | None:  # the stopped worker never answers: short timeouts
            try:
                return http_get(gw.host, gw.port, "/readyz", timeout=0.5)[0]
            except OSError:
                return None

        wait_for(lambda: readyz() == 503, timeout=10)  # the live worker says: not all ready
        # The replacement: the stopped pid is SIGKILLed and slot 0 runs a new worker.
        fresh = wait_for(lambda: (p := worker_pids(gw)[0]) != victim and p, timeout=30)
        wait_for(lambda: all(w["ready"] for w in stats(gw)["workers"]), timeout=30)
    finally:
        _continue_if_stopped(victim, gw.pid)
    assert fresh != victim
    assert not Path(f"/proc/{victim}").exists()  # killed and reaped, not left stopped
    log = gw.log()
    assert re.search(rf"worker 0 \(pid {victim}\): event loop silent for [\d.]+s; marked not "
                     r"ready", log), log
    assert re.search(rf"worker 0 \(pid {victim}\): event loop silent for [\d.]+s "
                     r"\(VELOX_WORKER_HANG_S=4\); killing it", log), log
    metrics = gw.admin_get("/metrics")[1].decode()
    kills = {s.labels["worker"]: s.value
             for f in text_string_to_metric_families(metrics) if f.name == "velox_worker_hang_kills"
             for s in f.samples if s.name.endswith("_total")}
    assert kills == {"0": 1.0, "1": 0.0}
    assert stats(gw)["hang_kills"] == 1
    chat_ok(gw)


# --- finding 10: more workers than cores ---------------------------------------------------


def test_more_workers_than_cores_warns_and_pins_none(upstream: MockUpstream,
                                                    tmp_path: Path) -> None:
    mine = os.sched_getaffinity(0)
    one = {min(mine)}
    os.sched_setaffinity(0, one)  # the gateway inherits one usable core
    try:
        gw = GatewayProcess(gateway_env(upstream, VELOX_WORKERS="2"),
                            log_path=tmp_path / "velox.log")
        gw.start()
    finally:
        os.sched_setaffinity(0, mine)
    try:
        assert "VELOX_WORKERS=2 is more than the 1 usable core(s)" in gw.log()
        cores = [w["core"] for w in stats(gw)["workers"]]
        assert cores == [-1, -1]
        for pid in worker_pids(gw):
            assert os.sched_getaffinity(pid) == one
        chat_ok(gw)
    finally:
        gw.stop()


# --- doctor and the token ------------------------------------------------------------------


def run_doctor(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "velox", "doctor"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent,
                          check=False)


def test_doctor_uses_the_token_and_flags_a_public_bind(start_gateway: GatewayFactory,
                                                      upstream: MockUpstream) -> None:
    gw = start_gateway(VELOX_ADMIN_TOKEN=TOKEN)
    base = {"PATH": os.environ.get("PATH", "")}
    env = {**base, **{k: v for k, v in gw.env.items() if k.startswith("VELOX_")}}
    good = run_doctor(env)
    assert re.search(r"^PASS  admin-port .*/stats 200", good.stdout, re.M), good.stdout
    wrong = run_doctor({**env, "VELOX_ADMIN_TOKEN": "not-the-token"})
    assert re.search(r"^FAIL  admin-port .*answers 401", wrong.stdout, re.M), wrong.stdout
    public = run_doctor({**base, **gateway_env(upstream), "VELOX_PORT": str(free_port()),
                         "VELOX_ADMIN_ADDR": f"0.0.0.0:{free_port()}"})
    assert public.returncode == 1
    assert re.search(r"^FAIL  admin-port .*not a loopback address", public.stdout, re.M)
    assert "set VELOX_ADMIN_TOKEN to a secret, or bind 127.0.0.1" in public.stdout
