"""The mock upstream as a process: ready line, signals, cert reuse, workers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import velox_lab.mock
from velox_lab.mock import MockUpstream

ROOT = str(Path(velox_lab.mock.__file__).resolve().parents[2])


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "velox_lab.mock", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_ready_line_and_sigterm_with_open_streams():
    proc = spawn("--no-tls", "--port", "0")
    try:
        ready = json.loads(proc.stdout.readline())
        assert set(ready) >= {"event", "origin", "port", "ca_file", "pid"}
        assert ready["event"] == "ready" and ready["ca_file"] is None
        assert ready["pid"] == proc.pid
        assert ready["origin"] == f"http://127.0.0.1:{ready['port']}"
        # A hanging request and an idle connection must not delay shutdown.
        hang = socket.create_connection(("127.0.0.1", ready["port"]), timeout=5)
        hang.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-mock-fault: hang\r\n\r\n")
        idle = socket.create_connection(("127.0.0.1", ready["port"]), timeout=5)
        time.sleep(0.1)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert time.monotonic() - t0 < 2
        assert proc.stdout.read() == b""  # exactly one line on stdout
        assert hang.recv(10) == b"" and idle.recv(10) == b""
        hang.close()
        idle.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_sigint_exits_zero_and_tls_ready_line():
    with MockUpstream() as m:
        assert m.origin == f"https://127.0.0.1:{m.port}" and Path(m.ca_file).is_file()
        os.kill(m.pid, signal.SIGINT)
        proc = m._proc
        assert proc.wait(timeout=5) == 0
        m.stop()


def test_bad_arguments_exit_2():
    proc = spawn("--alpn", "spdy/3")
    try:
        assert proc.wait(timeout=10) == 2
        assert b"--alpn" in proc.stderr.read()
    finally:
        proc.stdout.close()
        proc.stderr.close()


def test_certdir_is_reused(tmp_path):
    with MockUpstream(certdir=str(tmp_path)) as m:
        assert m.ca_file == str(tmp_path / "ca.pem")
        first = Path(m.ca_file).read_bytes()
    with MockUpstream(certdir=str(tmp_path)) as m:
        assert Path(m.ca_file).read_bytes() == first
        assert m.stats()["requests"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.pem", "server.key", "server.pem"]


def test_workers_share_port_and_aggregate_stats():
    with MockUpstream(tls=False, extra_args=["--workers", "2"]) as m:
        kids = children_of(m.pid)
        assert len(kids) == 1
        pids = set()
        for _ in range(30):  # fresh connections land on either worker
            conn = http.client.HTTPConnection("127.0.0.1", m.port, timeout=5)
            conn.request("POST", "/v1/chat/completions",
                         body=json.dumps({"model": "m", "messages": []}),
                         headers={"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            resp.read()
            conn.close()
            pids.add(m.stats()["pid"])  # the control call also lands on either worker
        print("workers that answered stats:", len(pids))
        stats = m.stats()
        assert stats["workers"] == 2
        assert stats["requests"] == 30 and stats["h1_requests"] == 30
        assert stats["by_path"]["/v1/chat/completions"] == 30
        assert stats["connections"] == 30
        m.reset()
        assert m.stats()["requests"] == 0
        assert m.stop() == 0
    assert not any(Path(f"/proc/{k}").exists() and "zombie" not in
                   Path(f"/proc/{k}/status").read_text().lower() for k in kids)


def test_behaviour_applies_to_every_later_request_until_restored():
    with MockUpstream(tls=False) as mock:
        def status_of_chat() -> int:
            conn = http.client.HTTPConnection("127.0.0.1", mock.port, timeout=10)
            try:
                body = json.dumps({"model": "m", "messages": []})
                conn.request("POST", "/v1/chat/completions", body,
                             {"content-type": "application/json"})
                resp = conn.getresponse()
                resp.read()
                return resp.status
            finally:
                conn.close()

        assert status_of_chat() == 200
        assert mock.behave(status=503) == {"status": "503"}
        assert [status_of_chat() for _ in range(3)] == [503, 503, 503]
        try:
            mock.behave(status="abc")  # refused, and the previous behaviour stays
        except RuntimeError as exc:
            assert "400" in str(exc)
        else:
            raise AssertionError("an invalid behaviour was accepted")
        assert status_of_chat() == 503
        assert mock.behave() == {}
        assert status_of_chat() == 200
