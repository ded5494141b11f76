"""An open relay does not start by accident: VELOX_HOST beyond loopback, an upstream key and no
client key stops start-up with a message naming VELOX_ALLOW_OPEN; with VELOX_ALLOW_OPEN=1 it
starts and says so in a warning line.

Each gateway runs in a network namespace of its own (`unshare --net`, only its loopback up), so
a gateway listening on 0.0.0.0 is reachable from nowhere but itself, even when the refusal
under test is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from velox_lab.launch import free_port

UPSTREAM_KEY = "sk-operator-0123456789abcdef"
LISTENING = "velox.supervisor: listening on"

pytestmark = pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                                reason="needs unshare --net (root) for a private network")


def isolated_velox(env: dict[str, str]) -> subprocess.Popen[str]:
    """`python -m velox` alone in a new network namespace, its output on one pipe."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("VELOX_")}
    base.pop("OPENAI_API_KEY", None)
    full = {**base, "VELOX_PORT": str(free_port()), "VELOX_WORKERS": "1",
            "VELOX_ADMIN_ADDR": "off", "VELOX_UPSTREAM_ORIGIN": "https://127.0.0.1:9", **env}
    return subprocess.Popen(
        ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh",
         sys.executable, "-m", "velox"],
        env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        cwd=Path(__file__).parent)


def output_until(proc: subprocess.Popen[str], line: str, timeout: float = 60) -> str:
    """What the process printed until `line` (then it is stopped by SIGTERM) or its exit."""
    assert proc.stdout is not None
    out: list[str] = []
    timer = threading.Timer(timeout, proc.send_signal, (signal.SIGTERM,))  # a silent process
    timer.start()
    try:
        for text in proc.stdout:
            out.append(text)
            if line in text:
                break
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
    return "".join(out) + (rest or "")


def test_a_public_bind_without_client_keys_is_refused() -> None:
    proc = isolated_velox({"VELOX_HOST": "0.0.0.0", "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY})
    out = output_until(proc, LISTENING)
    assert proc.returncode == 2, out
    assert LISTENING not in out
    assert "VELOX_HOST=0.0.0.0 is not a loopback address and no client key" in out
    assert "VELOX_ALLOW_OPEN=1" in out and "VELOX_API_KEYS" in out
    assert UPSTREAM_KEY not in out


def test_velox_allow_open_starts_the_relay_and_says_so() -> None:
    proc = isolated_velox({"VELOX_HOST": "0.0.0.0", "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
                           "VELOX_ALLOW_OPEN": "1"})
    out = output_until(proc, "VELOX_ALLOW_OPEN=1:")
    assert LISTENING in out, out
    warning = [ln for ln in out.splitlines() if "VELOX_ALLOW_OPEN=1:" in ln]
    assert warning and " WARNING " in warning[0], out
    assert "anyone who can reach 0.0.0.0:" in warning[0] and "upstream key" in warning[0]
    assert UPSTREAM_KEY not in out
    assert proc.returncode == 0, out  # SIGTERM: drained and stopped


def test_client_keys_make_a_public_bind_start_without_a_warning() -> None:
    proc = isolated_velox({"VELOX_HOST": "0.0.0.0", "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
                           "VELOX_API_KEYS": "sk-client-0123456789"})
    out = output_until(proc, LISTENING)
    assert LISTENING in out, out
    assert "anyone who can reach" not in out and "WARNING" not in out.split(LISTENING)[0]
