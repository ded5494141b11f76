"""/v1/messages pass-through to an Anthropic upstream against /v1/chat/completions pass-through
to an OpenAI upstream: the workers' CPU per request, end to end, in one run.

One Velox (two workers) in front of one bundled mock over HTTP/2 + TLS that speaks both APIs;
wrk at 64 connections posts a short request to each path in turn (rounds interleaved, so a
neighbour's load on this shared machine falls on both sides alike). CPU per request is the
workers' user + system time over a round divided by the requests wrk completed in it. The
target (issue: Messages in front) is the Messages path within 5% of the chat path.

    python -m benches.bench_messages_front [--seconds 5] [--rounds 3]

Results: benches/results/messages_front.json (the docs' benchmarks page shows them).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import orjson
import psutil

from benches.e2e import wrk
from benches.e2e.machine import bench_lock, facts
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

OUT = Path(__file__).resolve().parent / "results" / "messages_front.json"
KEY = "sk-bench-not-a-secret"
CASES = {
    "chat": ("/v1/chat/completions", {"model": "gpt-front", "max_tokens": 16,
                                      "messages": [{"role": "user", "content": "Say hello"}]}),
    "messages": ("/v1/messages", {"model": "claude-front", "max_tokens": 16,
                                  "messages": [{"role": "user", "content": "Say hello"}]}),
}


def _cpu(processes: list[psutil.Process]) -> float:
    return sum(t.user + t.system for t in (p.cpu_times() for p in processes))


def _wrk(port: int, path: str, body: bytes, seconds: int) -> dict[str, object]:
    with tempfile.NamedTemporaryFile(prefix="velox-wrk-", suffix=".json") as fh:
        fh.write(body)
        fh.flush()
        env = {**os.environ, "WRK_BODY_FILE": fh.name, "WRK_PATH": path, "WRK_API_KEY": KEY,
               "WRK_HEADERS": "anthropic-version: 2023-06-01"}
        proc = subprocess.run(["wrk", "-t1", "-c64", f"-d{seconds}s", "--timeout=10s", "-s",
                               str(wrk.SCRIPT), f"http://127.0.0.1:{port}/"], env=env,
                              capture_output=True, text=True, timeout=seconds + 60, check=False)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("WRK_JSON "))
    out: dict[str, object] = orjson.loads(line[9:])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, \
            MockUpstream(tls=True, certdir=tmp) as mock:
        config = Path(tmp) / "velox.toml"
        config.write_text("".join(
            f'[[upstream]]\nname = "{n}"\norigin = "{mock.origin}"\napi_key_env = "KEY_UP"\n'
            f'ca_file = "{mock.ca_file}"\nconnections = 2\n{extra}\n'
            for n, extra in (("oa", ""), ("an", 'kind = "anthropic"\n'))) + """
[[route]]
model = "gpt-front"
targets = [{ upstream = "oa" }]

[[route]]
model = "claude-front"
targets = [{ upstream = "an" }]
""")
        env = {"VELOX_CONFIG": str(config), "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
               "VELOX_ACCESS_LOG": "0", "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
               "KEY_UP": "sk-up-not-a-secret"}
        with GatewayProcess(env, log_path=Path(tmp) / "velox.log") as gw, bench_lock():
            port = int(gw.base_url.rsplit(":", 1)[1])
            workers = psutil.Process(gw.pid).children()
            proc = psutil.Process(mock._proc.pid)  # type: ignore[union-attr]
            upstream = [proc, *proc.children(recursive=True)]
            sums = {name: [0.0, 0, 0.0, 0.0] for name in CASES}
            for path, body in CASES.values():  # warm both paths
                _wrk(port, path, orjson.dumps(body), 1)
            for _ in range(args.rounds):
                for name, (path, body) in CASES.items():
                    before, mock_before = _cpu(workers), _cpu(upstream)
                    out = _wrk(port, path, orjson.dumps(body), args.seconds)
                    errors = out["errors"]
                    assert isinstance(errors, dict) and not any(errors.values()), out
                    sums[name][0] += _cpu(workers) - before
                    sums[name][1] += int(out["requests"])  # type: ignore[call-overload]
                    sums[name][2] += _cpu(upstream) - mock_before
                    sums[name][3] += int(out["duration_us"]) / 1e6  # type: ignore[call-overload]
    per = {name: cpu / n * 1e6 for name, (cpu, n, _, _) in sums.items()}
    for name, us in per.items():
        _, n, mock_cpu, seconds = sums[name]
        print(f"{name:9s} {n:8.0f} requests  {n / seconds:8.0f} req/s  {us:6.1f} us Velox CPU "
              f"per request  (mock {mock_cpu / n * 1e6:5.1f} us)")
    ratio = per["messages"] / per["chat"]
    print(f"messages / chat: {ratio:.3f}")
    OUT.write_bytes(orjson.dumps({
        "machine": facts(), "seconds": args.seconds, "rounds": args.rounds,
        "cases": {name: {"path": CASES[name][0], "requests": n, "rps": round(n / seconds),
                         "cpu_us_per_request": round(per[name], 1),
                         "mock_cpu_us_per_request": round(mock_cpu / n * 1e6, 1)}
                  for name, (_, n, mock_cpu, seconds) in sums.items()},
        "ratio": round(ratio, 3)}, option=orjson.OPT_INDENT_2) + b"\n")


if __name__ == "__main__":
    main()
