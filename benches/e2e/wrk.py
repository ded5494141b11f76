"""Run wrk (Debian's package) with post.lua and return its figures as a dict.

wrk is the closed-loop generator for the non-streaming runs: C keep-alive connections, each
sending its next request when the previous answer is in. It is written in C, so at these rates
it is not the bottleneck; `ceiling.py` measures how far it goes on this machine. Latencies are
microseconds from wrk's own histogram.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from benches.e2e import workload

SCRIPT = Path(__file__).with_name("post.lua")
_MARK = "WRK_JSON "


def available() -> bool:
    return shutil.which("wrk") is not None


def run(port: int, conns: int, duration_s: int, threads: int = 1, timeout_s: int = 10,
        host: str = "127.0.0.1", body: bytes | None = None,
        headers: dict[str, str] | None = None, scheme: str = "http") -> dict[str, object]:
    """One wrk run; raises RuntimeError if wrk fails or prints no result line. `headers` are
    added to every request."""
    with tempfile.NamedTemporaryFile(prefix="velox-wrk-", suffix=".json") as fh:
        fh.write(body if body is not None else workload.body())
        fh.flush()
        env = {**os.environ, "WRK_BODY_FILE": fh.name, "WRK_PATH": workload.PATH,
               "WRK_API_KEY": workload.API_KEY,
               "WRK_HEADERS": "\n".join(f"{k}: {v}" for k, v in (headers or {}).items())}
        argv = ["wrk", f"-t{min(threads, conns)}", f"-c{conns}", f"-d{duration_s}s",
                f"--timeout={timeout_s}s", "-s", str(SCRIPT), f"{scheme}://{host}:{port}/"]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=duration_s + timeout_s + 30, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            out = json.loads(line[len(_MARK):])
            break
    else:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    seconds = out["duration_us"] / 1e6
    errors = out["errors"]
    out["rps"] = round(out["requests"] / seconds, 1)
    out["non_2xx"] = errors["status"]
    out["errors_total"] = sum(errors.values())
    out["conns"] = conns
    out["threads"] = min(threads, conns)
    return out
