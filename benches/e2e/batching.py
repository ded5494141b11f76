"""The embeddings batching run (`make bench-batching`, `python -m benches.e2e batching`): what
merging /v1/embeddings calls does for throughput, latency and upstream calls.

One bundled mock (HTTP/2 + TLS) that takes 20 ms per call plus 50 µs per input item (its
`--latency-ms` and `--latency-per-input-us`, as an embedding model costs more for more inputs),
and three Velox processes with the same settings and the same VELOX_CONFIG route, except that
one route has `batch = { max_requests = 32, max_inputs = 2048, max_wait_ms = 20 }` (`on`, the
defaults), one the same with `max_wait_ms = 5` (`on-wait5`, what a shorter wait trades) and
one none (`off`). wrk (closed loop: C connections, each sending its next request
when the previous answer is in) POSTs one single-input embeddings request at 1, 64 and 256
connections, for `duration_s`, against each gateway in turn, in an order rotated from round
to round.

Per run: wrk's requests/s and latency percentiles (µs), its errors, the upstream calls the mock
received and the client requests the gateway answered in the run (from the mock's and the gateway's
counters, read before and after), and the gateway's `batches.embeddings` figures.
`upstream_calls_per_request` = mock calls / gateway answers (the calls of the few requests wrk
abandons when its run ends are counted, their answers not: hence 1.01 without batching). Every loop
is bounded: wrk by its duration (and a subprocess timeout), the rounds by their count. Results go to
benches/results/batching.json; `python -m benches.report` turns them into the README table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benches.e2e.machine import bench_lock, facts, wait_quiet
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

CONCURRENCIES = (1, 64, 256)
MODES = ("off", "on", "on-wait5")
MODEL = "text-embedding-3-small"
BATCH = "{ max_requests = 32, max_inputs = 2048, max_wait_ms = 20 }"
# The same with a shorter wait: what tuning max_wait_ms trades.
BATCHES = {"off": None, "on": BATCH,
           "on-wait5": "{ max_requests = 32, max_inputs = 2048, max_wait_ms = 5 }"}
LATENCY_MS = 20
PER_INPUT_US = 50
WORKERS = 2
UP_KEY = "sk-bench-batching-upstream"
SCRIPT = Path(__file__).with_name("post.lua")
BODY = json.dumps({"model": MODEL, "input": "The quick brown fox jumps over the lazy dog.",
                   "encoding_format": "float"}).encode()
RESULTS = Path(__file__).resolve().parents[1] / "results"


def _config(mock: MockUpstream, batch: str | None) -> str:
    return (f'[[upstream]]\nname = "mock"\norigin = "{mock.origin}"\n'
            f'ca_file = "{mock.ca_file}"\napi_key_env = "UP_KEY"\nconnections = 2\n\n'
            f'[[route]]\nmodel = "{MODEL}"\ntargets = [{{ upstream = "mock" }}]\n'
            + (f"batch = {batch}\n" if batch else ""))


def _wrk(port: int, conns: int, duration_s: int, body_file: str) -> dict[str, Any]:
    env = {**os.environ, "WRK_BODY_FILE": body_file, "WRK_PATH": "/v1/embeddings",
           "WRK_API_KEY": "sk-bench-client"}
    threads = 1 if conns == 1 else 2
    argv = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{duration_s}s", "--timeout=10s",
            "-s", str(SCRIPT), f"http://127.0.0.1:{port}/"]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                          timeout=duration_s + 60, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("WRK_JSON "):
            out = json.loads(line[len("WRK_JSON "):])
            break
    else:
        raise RuntimeError(f"wrk failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    out["rps"] = round(out["requests"] / (out["duration_us"] / 1e6), 1)
    return out


def _gateway_counts(gw: GatewayProcess) -> tuple[int, dict[str, Any]]:
    import httpx

    doc = httpx.get(f"{gw.admin_url}/stats", timeout=10).json()
    return doc["requests"]["by_route"]["model_call"], doc["batches"]["embeddings"]


def _mock_calls(mock: MockUpstream) -> int:
    return int(mock.stats()["by_path"].get("/v1/embeddings", 0))


def run(rounds: int = 2, duration_s: int = 5, outdir: Path = RESULTS,
        name: str = "batching") -> dict[str, Any]:
    logdir = Path(tempfile.mkdtemp(prefix="velox-bench-batching-"))
    certdir = tempfile.mkdtemp(prefix="velox-bench-batching-certs-")
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    with bench_lock() as waited:
        mock = MockUpstream(tls=True, certdir=certdir, latency_ms=LATENCY_MS,
                            latency_per_input_us=PER_INPUT_US, name="emb",
                            log_path=str(logdir / "mock.log")).start()
        gateways: dict[str, GatewayProcess] = {}
        try:
            for mode in MODES:
                config = logdir / f"velox-{mode}.toml"
                config.write_text(_config(mock, BATCHES[mode]))
                env = {"VELOX_CONFIG": str(config), "UP_KEY": UP_KEY,
                       "VELOX_WORKERS": str(WORKERS), "VELOX_RATE_LIMIT_RPM": "0",
                       "VELOX_ACCESS_LOG": "0", "VELOX_SHUTDOWN_GRACE_S": "5",
                       "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}"}
                gateways[mode] = GatewayProcess(env, log_path=logdir / f"velox-{mode}.log"
                                                ).start(wait_ready=True)
            with tempfile.NamedTemporaryFile(prefix="velox-emb-", suffix=".json") as fh:
                fh.write(BODY)
                fh.flush()
                for r in range(rounds):
                    order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
                    for conns in CONCURRENCIES:
                        for mode in order:
                            runs.append(_one(gateways[mode], mock, mode, conns, duration_s,
                                             fh.name, r))
                            print(f"round {r + 1} {mode:>3} c={conns:<3} "
                                  f"{runs[-1]['rps']:>8.1f} req/s p50 {runs[-1]['p50']} µs "
                                  f"p99 {runs[-1]['p99']} µs calls/request "
                                  f"{runs[-1]['upstream_calls_per_request']}", flush=True)
        finally:
            for gw in gateways.values():
                gw.stop()
            mock.stop()
    doc = {
        "kind": "velox-batching", "machine": facts(),
        "setup": {"mock_latency_ms": LATENCY_MS, "mock_latency_per_input_us": PER_INPUT_US,
                  "velox_workers": WORKERS, "batch": BATCHES, "body_bytes": len(BODY),
                  "rounds": rounds, "duration_s": duration_s, "lock_wait_s": round(waited, 1)},
        "seconds": round(time.monotonic() - t0, 1),
        "summary": summarize(runs), "runs": runs,
    }
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def _one(gw: GatewayProcess, mock: MockUpstream, mode: str, conns: int, duration_s: int,
         body_file: str, round_: int) -> dict[str, Any]:
    foreign = wait_quiet([gw.pid, mock.pid], timeout_s=5)
    answered0, batch0 = _gateway_counts(gw)
    calls0 = _mock_calls(mock)
    out = _wrk(int(gw.base_url.rsplit(":", 1)[1]), conns, duration_s, body_file)
    time.sleep(0.3)  # the last answers of the run reach the counters
    answered1, batch1 = _gateway_counts(gw)
    calls = _mock_calls(mock) - calls0
    answered = answered1 - answered0
    lat = out["latency_us"]
    errors = out["errors"]
    merged = batch1["total_batches"] - batch0["total_batches"]
    return {
        "mode": mode, "conns": conns, "round": round_, "rps": out["rps"],
        "requests": out["requests"], "p50": lat["p50"], "p90": lat["p90"], "p99": lat["p99"],
        "errors": sum(errors.values()), "answered": answered, "upstream_calls": calls,
        "upstream_calls_per_request": round(calls / answered, 4) if answered else None,
        "batches": merged,
        "avg_batch_size": round((batch1["requests"] - batch0["requests"]) / merged, 2)
        if merged else None,
        "full_batches": batch1["full_batches"] - batch0["full_batches"],
        "timeout_batches": batch1["timeout_batches"] - batch0["timeout_batches"],
        "immediate_batches": batch1["immediate_batches"] - batch0["immediate_batches"],
        "foreign_cores_before": foreign,
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds per (mode, conns), and on/off ratios per concurrency."""
    rows = []
    for conns in CONCURRENCIES:
        for mode in MODES:
            mine = [r for r in runs if r["mode"] == mode and r["conns"] == conns]
            if not mine:
                continue

            def med(key: str, mine: list[dict[str, Any]] = mine) -> Any:
                values = [r[key] for r in mine if r[key] is not None]
                return statistics.median(values) if values else None

            rows.append({"mode": mode, "conns": conns, "rps": med("rps"), "p50": med("p50"),
                         "p99": med("p99"), "errors": sum(r["errors"] for r in mine),
                         "upstream_calls_per_request": med("upstream_calls_per_request"),
                         "avg_batch_size": med("avg_batch_size"), "rounds": len(mine)})
    return {"rows": rows}


def print_summary(doc: dict[str, Any]) -> None:
    for row in doc["summary"]["rows"]:
        print(f"{row['mode']:>3} c={row['conns']:<3} {row['rps']:>8.1f} req/s "
              f"p50 {row['p50']} µs p99 {row['p99']} µs calls/request "
              f"{row['upstream_calls_per_request']} errors {row['errors']}")
