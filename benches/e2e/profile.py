"""Where a worker's CPU goes, per stage, under wrk at a given connection count.

`python -m benches.e2e.profile --conns 1,64` starts the TLS mock and a 2-worker Velox in
front of it (as the end-to-end benchmark does), drives it with wrk, and samples one worker two
ways while wrk runs:

* `perf record` (if perf is installed and allowed): the share of the worker's CPU in each
  shared object: the kernel, the Python interpreter, OpenSSL, uvloop, httptools, orjson,
  Velox's native core and the rest; that splits interpreted work from C and system work;
* `py-spy record` (if installed: `pip install py-spy`), non-idle samples only: the Python stack
  of every sample, each attributed to the first Velox stage found from the innermost frame out
  (ingress, worker drain, relay, the client write, the HTTP/2 framer, the h2 connection, the
  pool, ...), so a sample inside `transport.write` called from `ClientConnection.respond`
  counts for the client write.

Prints both tables as Markdown and writes them as JSON to --out (default
benches/results/profile.json). Every process is started here and stopped by its PID.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benches.e2e import workload, wrk
from benches.e2e.machine import bench_lock, children, facts
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

OUT = Path(__file__).resolve().parents[1] / "results" / "profile.json"

# (stage, test on "package/file.py:function" of a frame, the path taken from velox/ on), tried
# from the innermost frame outwards; the first match names the sample's stage. Order matters only
# within one frame. tests/unit/test_profile_stages.py checks that every file named here exists,
# so a move of the tree cannot silently send samples to the wrong stage.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("client write (respond / stream, syscall included)",
     ("ingress/connection.py:respond", "ingress/connection.py:start_stream",
      "ingress/connection.py:send_chunk", "ingress/connection.py:flush_stream",
      "ingress/connection.py:end_stream", "ingress/connection.py:respond_error",
      "ingress/h1write.py:")),
    ("relay (response head, server-timing, accounting)", ("relay/exchange.py:",
                                                          "relay/usage.py:")),
    ("spend (prices, ledger rows, cost headers)", ("spend/",)),
    ("HTTP/2 codec (frames, HPACK, both ways)", ("egress/framer.py:", "egress/codec.py:",
                                                  "egress/nativecodec.py:",
                                                  "egress/hpack_static.py:")),
    ("h2 connection (events, flow control, flush, TLS write)", ("egress/h2conn.py:",)),
    ("pool, attempts, dispatch, routing", ("egress/pool.py:", "egress/h2pool.py:",
                                           "egress/interfaces.py:", "egress/upstream.py:",
                                           "routing/dispatch.py:", "routing/balance.py:",
                                           "state/health.py:")),
    ("worker drain (parse, upstream headers, batch)", ("pipeline/worker.py:",
                                                      "admission/parse.py:",
                                                      "ingress/arena.py:",
                                                      "admission/ratelimit.py:",
                                                      "ingress/ring.py:")),
    ("ingress (httptools callbacks, routing, ring push)", ("ingress/",)),
    ("stats and access log", ("state/stats.py:", "admin/accesslog.py:",
                              "admin/ledgerfeed.py:")),
)


def stage_of(stack: list[str]) -> str:
    """stack: frames outermost first, each "function (file:line)" as py-spy prints them."""
    for frame in reversed(stack):
        name, _, where = frame.partition(" (")
        # py-spy names methods "Class.method" (and closures "f.<locals>.g"): the stages are
        # told apart by file and function name alone.
        name = name.split(".<locals>", 1)[0].rsplit(".", 1)[-1]
        path = where.split(":")[0]
        package = path.rpartition("velox/")[2] if "velox/" in path else Path(path).name
        key = f"{package}:{name}"
        for stage, tests in STAGES:
            if any(key.startswith(t) for t in tests):
                return stage
    return "event loop (uvloop's C: socket reads, TLS, callbacks dispatch)"


def pyspy_stages(pid: int, seconds: float, raw: Path | None = None) -> dict[str, object]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        return {"error": "py-spy not installed"}
    with tempfile.NamedTemporaryFile(suffix=".txt") as fh:
        proc = subprocess.run([exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250",
                               "-f", "raw", "-o", fh.name, "--nonblocking"],
                              capture_output=True, text=True, timeout=seconds + 60, check=False)
        text = Path(fh.name).read_text()
        if raw is not None:
            raw.write_text(text)
        lines = text.splitlines()
    if not lines:
        return {"error": f"py-spy: {proc.stderr.strip()[-300:]}"}
    counts: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for line in lines:
        stack, _, n = line.rpartition(" ")
        frames = [f for f in stack.split(";") if f and not f.startswith("process ")
                  and not f.startswith("thread ")]
        counts[stage_of(frames)] += int(n)
        if frames:
            leaves[frames[-1]] += int(n)
    total = sum(counts.values())
    return {"samples": total, "rate_hz": 250, "shares": {
        k: round(v / total, 3) for k, v in counts.most_common()},
        "top_frames": {k: round(v / total, 3) for k, v in leaves.most_common(25)}}


def perf_dsos(pid: int, seconds: float) -> dict[str, object]:
    perf = shutil.which("perf")
    if perf is None:
        return {"error": "perf not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        rec = subprocess.run([perf, "record", "-F", "999", "-p", str(pid), "-o", str(data), "--",
                              "sleep", str(seconds)], capture_output=True, text=True,
                             timeout=seconds + 60, check=False)
        if rec.returncode != 0 or not data.exists():
            return {"error": f"perf record: {rec.stderr.strip()[-300:]}"}
        rep = subprocess.run([perf, "report", "-i", str(data), "--sort", "dso", "--stdio",
                              "--percent-limit", "0.5"], capture_output=True, text=True,
                             timeout=120, check=False)
    shares: dict[str, float] = {}
    for line in rep.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].endswith("%") and not line.startswith("#"):
            shares[" ".join(parts[1:])] = round(float(parts[0].rstrip("%")) / 100, 3)
    return {"shares": shares} if shares else {"error": rep.stderr.strip()[-300:]}


def cpu_split(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def busiest(pids: list[int], window_s: float = 1.0) -> int:
    """The worker that used the most CPU over window_s: at one connection the kernel gives
    the connection to one of the workers, and the other one idles."""
    before = {pid: sum(cpu_split(pid)) for pid in pids}
    time.sleep(window_s)
    return max(pids, key=lambda pid: sum(cpu_split(pid)) - before[pid])


def profile(conns: int, seconds: float, port: int, workers: list[int],
            raw: Path | None = None) -> dict[str, object]:
    result: dict[str, object] = {"conns": conns}
    box: dict[str, object] = {}

    def load() -> None:
        box["wrk"] = wrk.run(port, conns, int(seconds) + 5)

    t = threading.Thread(target=load)
    t.start()
    time.sleep(1.0)  # connections open, caches warm
    worker = busiest(workers)
    u0, s0 = cpu_split(worker)
    result["perf"] = perf_dsos(worker, seconds / 2)
    result["py_spy"] = pyspy_stages(worker, seconds / 2, raw)
    u1, s1 = cpu_split(worker)
    t.join()
    out = box["wrk"]
    result["rps"] = out["rps"]  # type: ignore[index]
    result["worker_user_s"], result["worker_system_s"] = round(u1 - u0, 2), round(s1 - s0, 2)
    return result


def markdown(results: list[dict[str, object]]) -> str:
    lines = []
    for r in results:
        lines.append(f"\n{r['conns']} connection(s), {r['rps']} req/s in all; sampled worker: "
                     f"user {r['worker_user_s']} s, system {r['worker_system_s']} s\n")
        py = r["py_spy"]
        if isinstance(py, dict) and "shares" in py:
            lines += ["| stage (py-spy, non-idle samples) | share |", "|---|---:|"]
            lines += [f"| {k} | {v:.0%} |" for k, v in py["shares"].items()]
            lines += ["", "| innermost Python frame (py-spy) | share |", "|---|---:|"]
            lines += [f"| {k} | {v:.1%} |" for k, v in list(py["top_frames"].items())[:15]]
        pf = r["perf"]
        if isinstance(pf, dict) and "shares" in pf:
            lines += ["", "| shared object (perf) | share |", "|---|---:|"]
            lines += [f"| {k} | {v:.0%} |" for k, v in pf["shares"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benches.e2e.profile")
    p.add_argument("--conns", default="1,64")
    p.add_argument("--rounds", type=int, default=1,
                   help="profiles per count, the counts interleaved (a shared host moves the "
                        "shares from one profile to the next: the report pools the rounds and "
                        "gives their range)")
    p.add_argument("--seconds", type=float, default=8.0, help="sampled seconds per count")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--env", action="append", default=[], metavar="VELOX_X=VALUE",
                   help="a setting of the profiled gateway (repeatable)")
    p.add_argument("--cleartext", action="store_true",
                   help="the mock without TLS, Velox to it over HTTP/1.1 (the self-hosted case)")
    p.add_argument("--raw", action="store_true",
                   help="keep py-spy's collapsed stacks beside --out (one file per count)")
    args = p.parse_args(argv)
    load_start = list(os.getloadavg())
    if not wrk.available():
        print("wrk is not installed", file=sys.stderr)
        return 2
    logdir = Path(tempfile.mkdtemp(prefix="velox-profile-"))
    mock = MockUpstream(tls=not args.cleartext, extra_args=["--workers", "1"],
                        log_path=str(logdir / "mock.log"))
    mock.start()
    velox = GatewayProcess({"VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
                            "VELOX_UPSTREAM_ORIGIN": mock.origin,
                            "VELOX_UPSTREAM_CA_FILE": mock.ca_file or "",
                            "OPENAI_API_KEY": workload.API_KEY, "VELOX_LOG_LEVEL": "warning",
                            **({"VELOX_UPSTREAM_PROTOCOL": "http1"} if args.cleartext else {}),
                            **dict(kv.partition("=")[::2] for kv in args.env)},
                           log_path=logdir / "velox.log")
    results = []
    try:
        velox.start(timeout=60)
        workers = children(velox.pid)
        with bench_lock() as waited:  # never overlaps another timed section on this machine
            print(f"waited {waited:.0f}s for the benchmark lock", flush=True)
            for rnd in range(args.rounds):
                for conns in (int(c) for c in args.conns.split(",")):
                    raw = args.out.with_name(f"{args.out.stem}-{conns}-{rnd}.pyspy.txt") \
                        if args.raw else None
                    results.append({**profile(conns, args.seconds, velox.port, workers, raw),
                                    "round": rnd})
    finally:
        velox.stop()
        mock.stop()
    # What the report (benches/report_profile.py) says of the run beside its tables.
    doc = {"machine": facts(), "loadavg_start": load_start, "seconds": args.seconds,
           "egress": "http1" if args.cleartext else "h2", "settings": args.env,
           "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"load average {os.getloadavg()}")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
