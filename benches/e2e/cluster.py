"""The several-hosts run (`make bench-cluster`, `python -m benches.e2e cluster`), and the harness
the published test (tests/cluster/test_published.py) runs in a shorter form.

Set-up: one real `redis-server` on a free port of 127.0.0.1 (started here, no persistence),
the bundled mock upstream (HTTP/2 + TLS), and `hosts` Velox instances (two workers each) on
their own ports, all with `VELOX_REDIS_URL` pointing at that Redis and the same limit
(`VELOX_RATE_LIMIT_RPM`, `VELOX_RATE_LIMIT_BURST`).

Load: the official `openai` SDK (AsyncOpenAI, no retries), open loop: request k is sent at
t0 + k / rate to host k mod hosts, `factor` times the limit, for `duration_s`; every answer
is recorded with its send time, host and status. The count of requests and the time are both
bounded (at most rate x duration requests; each times out after 10 s; the run ends 15 s after
its last send at the latest).

Outage: Redis is SIGKILLed (by PID) `outage[0]` seconds into the load and started again on the
same port `outage[1]` seconds in; it comes back empty (no persistence), so its buckets start
full again. Each host's /metrics is read every second (velox_redis_up, velox_redis_hosts,
velox_redis_commands): when each host saw Redis go and come back.

Commands: a second phase (`rate_phase_s` > 0) lifts the limit out of the way
(`HIGH_RPM`) and drives the three hosts as fast as wrk can (64 connections each) to measure
Redis commands per second against requests per second.

Results: `run()` returns a dict (per-second admitted per host and in total, statuses, the
bounds, the commands); `main` writes benches/results/cluster.json, which
`python -m benches.report` turns into the README's figure (cluster.png) and table.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from velox.cluster import leases as vcluster
from velox_lab.launch import GatewayProcess, RedisProcess, free_port
from velox_lab.mock import MockUpstream

MODEL = "gpt-4o-mini"
CLIENT_KEY = "sk-velox-cluster-bench-key"  # the [[key]] of keyed runs (its SHA-256 in the file)
UPSTREAM_KEY = "sk-upstream-bench-not-a-secret"
HIGH_RPM = 1_000_000_000  # the commands phase: a limit no load on this machine reaches
_METRIC = re.compile(rb"^(velox_redis_\w+?)(?:_total)? ([0-9.e+-]+)$", re.M)


@dataclass
class Plan:
    hosts: int = 3
    workers: int = 2
    rpm: int = 600
    burst: int = 20
    factor: float = 3.0  # load as a multiple of the limit
    duration_s: float = 60.0
    outage: tuple[float, float] | None = (20.0, 40.0)  # Redis down from..to, s into the load
    redis: bool = True  # False: one limit per host, no Redis (the control)
    rate_phase_s: int = 0  # > 0: also measure commands/s at the highest rate wrk reaches
    # > 0: the limit under test is a gateway key's ([[key]] rpm = `rpm`, tpm = `tpm`; its
    # buckets hold a minute's worth, so burst = rpm), not VELOX_RATE_LIMIT_RPM.
    tpm: int = 0
    keyed: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)


class Cluster:
    """Redis, the mock and the Velox hosts; stopped by PID whatever happens."""

    def __init__(self, plan: Plan, logdir: Path) -> None:
        self.plan = plan
        self.logdir = logdir
        self.redis: RedisProcess | None = None
        self.mock: MockUpstream | None = None
        self.gateways: list[GatewayProcess] = []

    def start(self, rpm: int | None = None, burst: int | None = None, tag: str = "") -> Cluster:
        plan = self.plan
        if plan.redis and self.redis is None:
            self.redis = RedisProcess(log_path=self.logdir / "redis.log").start()
        if self.mock is None:
            self.mock = MockUpstream(tls=True, certdir=str(self.logdir),
                                     log_path=str(self.logdir / "mock.log")).start()
        self.gateways = [GatewayProcess(self.env(rpm or plan.rpm, burst or plan.burst),
                                        log_path=self.logdir / f"velox-{tag}{i}.log")
                         for i in range(plan.hosts)]
        try:
            start_all(self.gateways)
        except BaseException:
            self.stop()
            raise
        if plan.redis:  # every host sees every other one before the load starts
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if all(self.metrics(i).get("velox_redis_hosts") == plan.hosts
                       for i in range(plan.hosts)):
                    break
                time.sleep(0.1)
            else:
                raise RuntimeError("the hosts did not all register in Redis within 15 s")
        return self

    def env(self, rpm: int, burst: int) -> dict[str, str]:
        assert self.mock is not None
        plan = self.plan
        env = {
            "VELOX_UPSTREAM_ORIGIN": self.mock.origin,
            "VELOX_UPSTREAM_API_KEY": UPSTREAM_KEY,
            "VELOX_WORKERS": str(plan.workers),
            "VELOX_EGRESS_POOL_CONNECTIONS": "1",
            "VELOX_RATE_LIMIT_RPM": str(rpm),
            "VELOX_RATE_LIMIT_BURST": str(burst),
            "VELOX_ACCESS_LOG": "0",
            "VELOX_SHUTDOWN_GRACE_S": "5",
            "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}",
        }
        if self.mock.ca_file:
            env["VELOX_UPSTREAM_CA_FILE"] = self.mock.ca_file
        if self.redis is not None:
            env["VELOX_REDIS_URL"] = self.redis.url
        if plan.keyed and rpm == plan.rpm:
            import hashlib

            path = self.logdir / "velox.toml"
            digest = hashlib.sha256(CLIENT_KEY.encode()).hexdigest()
            path.write_text(f'[[key]]\nname = "bench"\nsha256 = "{digest}"\nrpm = {plan.rpm}\n'
                            + (f"tpm = {plan.tpm}\n" if plan.tpm else ""))
            env["VELOX_CONFIG"] = str(path)
            env["VELOX_RATE_LIMIT_RPM"] = "0"  # the key's limits are the ones under test
        env.update(plan.extra_env)
        return env

    def metrics(self, i: int) -> dict[str, float]:
        """The velox_redis_* values of host i (empty when it does not answer)."""
        try:
            status, body = self.gateways[i].admin_get("/metrics", timeout=2.0)
        except OSError:
            return {}
        if status != 200:
            return {}
        return {m.group(1).decode(): float(m.group(2)) for m in _METRIC.finditer(body)}

    def stop_gateways(self) -> None:
        for gw in self.gateways:
            gw.stop()
        self.gateways = []

    def stop(self) -> None:
        self.stop_gateways()
        if self.mock is not None:
            self.mock.stop()
            self.mock = None
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def start_all(gateways: list[GatewayProcess]) -> None:
    """Start the hosts at once (each takes seconds to fork its workers); the first failure
    is raised once all have returned (the caller stops them)."""
    errors: list[BaseException] = []

    def start(gw: GatewayProcess) -> None:
        try:
            gw.start(timeout=60)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(gw,)) for gw in gateways]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


async def _load(c: Cluster, plan: Plan) -> dict[str, Any]:
    """Open-loop load at plan.factor x the limit; the outage and the metrics sampling inside."""
    import openai

    rate = plan.rpm / 60 * plan.factor  # requests per second, all hosts together
    total = int(rate * plan.duration_s)
    # A generous timeout: on a 2-core box shared with other work the client's own loop can
    # lag by seconds, and a late loop fires a connect timeout before it sees the connection.
    clients = [openai.AsyncOpenAI(base_url=gw.base_url + "/v1", api_key=CLIENT_KEY,
                                  max_retries=0, timeout=30.0) for gw in c.gateways]
    records: list[tuple[float, int, int]] = []  # (send time from t0, host, status)
    tokens: list[int] = [0]  # usage.total_tokens of the admitted answers
    answered: list[float] = [0.0]  # the last admitted answer, from t0
    lag: list[float] = [0.0]  # the longest send-to-answer time of an admitted request
    samples: list[dict[str, Any]] = []
    events: dict[str, float] = {}
    failures: dict[str, int] = {}
    t0 = time.monotonic()

    async def one(k: int) -> None:
        host = k % plan.hosts
        sent = time.monotonic() - t0
        try:
            answer = await clients[host].chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
            status = 200
            if answer.usage is not None:
                tokens[0] += answer.usage.total_tokens
        except openai.APIStatusError as exc:
            status = exc.status_code
        except openai.APIError as exc:  # no answer at all (connection refused, reset, timeout)
            status = 0
            why = f"{type(exc).__name__}: {exc.__cause__!r}"[:200]
            failures[why] = failures.get(why, 0) + 1
        done = time.monotonic() - t0
        records.append((sent, host, status))
        if status == 200:  # admitted no later than answered: the bound's clock runs to here
            answered[0] = max(answered[0], done)
            lag[0] = max(lag[0], done - sent)

    async def outage() -> None:
        if plan.outage is None or c.redis is None:
            return
        down, back = plan.outage
        await asyncio.sleep(max(0.0, t0 + down - time.monotonic()))
        events["killed"] = time.monotonic() - t0
        await asyncio.to_thread(c.redis.kill)
        await asyncio.sleep(max(0.0, t0 + back - time.monotonic()))
        await asyncio.to_thread(c.redis.start)
        events["restarted"] = time.monotonic() - t0

    async def sample() -> None:
        if c.redis is None:
            return
        while time.monotonic() - t0 < plan.duration_s:
            t = time.monotonic() - t0
            rows = await asyncio.gather(*(asyncio.to_thread(c.metrics, i)
                                          for i in range(plan.hosts)))
            samples.append({"t": round(t, 3), "hosts": rows})
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - t)))

    tasks = [asyncio.create_task(outage()), asyncio.create_task(sample())]
    pending: set[asyncio.Task[None]] = set()
    for k in range(total):
        due = t0 + k / rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(one(k))
        pending.add(task)
        task.add_done_callback(pending.discard)
    last_send = time.monotonic() - t0
    if pending:
        await asyncio.wait(pending, timeout=35)
    for task in tasks:
        try:
            await asyncio.wait_for(task, timeout=15)
        except TimeoutError:
            task.cancel()
    for client in clients:
        await client.close()
    return {"records": records, "samples": samples, "events": events, "failures": failures,
            "tokens": tokens[0], "last_admitted_s": answered[0], "max_lag_s": lag[0],
            "last_send_s": last_send, "sent": total}


def summarize(plan: Plan, raw: dict[str, Any]) -> dict[str, Any]:
    """Per-second admitted counts, statuses and the bounds they are held to."""
    seconds = math.ceil(max(plan.duration_s, raw["last_send_s"] + 1e-9))
    per_host = [[0] * seconds for _ in range(plan.hosts)]
    statuses: dict[str, int] = {}
    for sent, host, status in raw["records"]:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if status == 200:
            per_host[host][min(seconds - 1, int(sent))] += 1
    total = [sum(col) for col in zip(*per_host, strict=False)]
    rate_s = plan.rpm / 60
    hosts = plan.hosts if plan.redis else 1
    stated = vcluster.bound(plan.rpm, plan.burst, hosts) if plan.redis else 0
    admitted = sum(total)
    outage_s = (plan.outage[1] - plan.outage[0]) if plan.outage and plan.redis else 0.0
    # One burst, the refill over the run, and what the hosts may hold. With an outage: the
    # restarted Redis (no persistence) makes its buckets empty (velox.cluster.leases.LEASE_LUA), and
    # a host may still refill its share for up to a second after another is back on Redis.
    # Tokens keep refilling while requests wait in a busy gateway's queues: the bound runs to
    # the last admitted answer (a busy client may also send late).
    span = max(plan.duration_s, raw["last_send_s"], raw["last_admitted_s"])
    upper = plan.burst + rate_s * span + stated
    if outage_s:
        upper += rate_s * 1.0
    lower = lower_bound(plan, raw["last_send_s"], stated)
    recovered: dict[str, float | None] = {}
    if plan.outage and plan.redis and raw["samples"]:
        restarted = raw["events"].get("restarted", plan.outage[1])
        for i in range(plan.hosts):
            back = [s["t"] for s in raw["samples"]
                    if s["t"] >= restarted and s["hosts"][i].get("velox_redis_up") == 1]
            recovered[str(i)] = round(back[0] - restarted, 3) if back else None
    commands = [s["hosts"] for s in raw["samples"]]
    cmd_rate = None
    if len(commands) >= 2:
        first, last = raw["samples"][0], raw["samples"][-1]
        span = last["t"] - first["t"]
        sums = [sum(h.get("velox_redis_commands", 0.0) for h in s["hosts"])
                for s in (first, last)]
        cmd_rate = round((sums[1] - sums[0]) / span, 2) if span > 0 else None
    return {
        "plan": {**asdict(plan), "outage": list(plan.outage) if plan.outage else None},
        "sent": raw["sent"], "statuses": statuses, "admitted": admitted,
        "server_errors": sum(n for s, n in statuses.items() if s == "0" or s.startswith("5")),
        "limit_per_s": rate_s, "stated_bound": stated,
        "upper": round(upper, 1), "lower": round(lower, 1),
        "within": lower <= admitted <= upper,
        "per_second": {"total": total, "hosts": per_host},
        "events": raw["events"], "recovered_s": recovered,
        "redis_commands_per_s_during_load": cmd_rate,
        "last_send_s": round(raw["last_send_s"], 3),
        "last_admitted_s": round(raw["last_admitted_s"], 3),
        # Windows are counted by send time; a request is admitted between its send and its
        # answer, so a window's bounds move by at most this much of the refill.
        "max_lag_s": round(raw["max_lag_s"], 3),
        "failures": raw["failures"],
        "tokens": raw["tokens"],
        "tokens_upper": round(plan.tpm + plan.tpm / 60 * span
                              + (vcluster.bound(plan.tpm, plan.tpm, hosts) if plan.redis else 0)
                              + (plan.tpm / 60 if outage_s else 0), 1)
        if plan.tpm else None,
    }


def lower_bound(plan: Plan, last_send_s: float, stated: int) -> float:
    """The fewest admissions the run may show under a demand above the limit.

    Fewer than the burst plus the refill only by what the hosts hold unused at the end (one
    lease each) and what refilled in Redis that no host had asked for yet (a host waits up to
    a lease's time after a short grant): one lease cap per host each. With an outage the
    burst does not count: tokens still in Redis when it is killed die with its data (a key's
    minute-long burst is not spent in the first 20 s at 3x), and detection (a call's timeout)
    and the reconnect after the restart take up to 2 s of the refill.
    """
    rate_s = plan.rpm / 60
    if plan.outage and plan.redis:
        return rate_s * (last_send_s - 2.0) - 2 * stated
    return plan.burst + rate_s * last_send_s - 2 * stated - (1 if not plan.redis else 0)


def window(doc: dict[str, Any], start: int, end: int) -> int:
    """Admitted requests sent in [start, end) seconds (all hosts)."""
    return sum(doc["per_second"]["total"][start:end])


def run(plan: Plan, logdir: Path | None = None) -> dict[str, Any]:
    logdir = logdir or Path(tempfile.mkdtemp(prefix="velox-cluster-"))
    c = Cluster(plan, logdir)
    try:
        c.start()
        raw = asyncio.run(_load(c, plan))
        doc = summarize(plan, raw)
        doc["final_metrics"] = [c.metrics(i) for i in range(plan.hosts)]
        doc["logs"] = [gw.log() for gw in c.gateways]
        if plan.rate_phase_s:
            c.stop_gateways()
            doc["commands"] = commands_at_rate(c, plan)
    finally:
        c.stop()
    return doc


def commands_at_rate(c: Cluster, plan: Plan) -> dict[str, Any]:
    """Redis commands per second while the hosts serve as fast as wrk drives them."""
    from benches.e2e import wrk

    if not wrk.available():
        return {"skipped": "wrk is not installed (make bench-deps)"}
    c.start(rpm=HIGH_RPM, burst=HIGH_RPM, tag="rate-")
    before = [c.metrics(i) for i in range(plan.hosts)]
    results: list[dict[str, Any]] = [{} for _ in range(plan.hosts)]

    def drive(i: int) -> None:
        results[i] = wrk.run(c.gateways[i].port, 64, plan.rate_phase_s)

    t0 = time.monotonic()
    threads = [threading.Thread(target=drive, args=(i,)) for i in range(plan.hosts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.monotonic() - t0
    after = [c.metrics(i) for i in range(plan.hosts)]
    requests = sum(float(r.get("requests", 0)) for r in results)
    commands = sum(a.get("velox_redis_commands", 0) - b.get("velox_redis_commands", 0)
                   for a, b in zip(after, before, strict=False))
    return {"seconds": round(seconds, 2), "requests": requests,
            "requests_per_s": round(requests / seconds, 1),
            "commands": commands, "commands_per_s": round(commands / seconds, 2),
            "commands_per_s_per_host": round(commands / seconds / plan.hosts, 2),
            "non_2xx": sum(float(r.get("non_2xx", 0)) for r in results)}


def main(out: Path, name: str = "cluster", quick: bool = False) -> dict[str, Any]:
    plan = Plan(duration_s=20.0, outage=(6.0, 14.0), rate_phase_s=3) if quick else \
        Plan(rate_phase_s=10)
    control = Plan(hosts=1, redis=False, duration_s=10.0 if quick else 20.0, outage=None)
    # The key: rpm 600, tpm 60000 (a minute's burst), 3x for 60 s, Redis down 20 s.
    keyed = Plan(rpm=600, burst=600, tpm=60_000, keyed=True,
                 duration_s=20.0 if quick else 60.0, outage=(6.0, 14.0) if quick else (20.0, 40.0))
    from benches.e2e.machine import bench_lock, wait_quiet

    # Counts, not speed, but a box so busy that the client's loop lags by seconds shifts the
    # windows: take the shared benchmark lock and wait (up to a minute) for a quiet machine.
    foreign: dict[str, float] = {}
    parts: dict[str, Any] = {}
    with bench_lock():
        for part, p in (("shared", plan), ("keyed", keyed), ("single_host_no_redis", control)):
            foreign[part] = round(wait_quiet([os.getpid()], timeout_s=60.0), 2)
            parts[part] = run(p)
    doc = {**parts,
           "machine": {"cores": os.cpu_count(), "loadavg_end": list(os.getloadavg()),
                       "foreign_cores_before_each_run": foreign},
           "bound_formula": "hosts x ceil(rpm/60 x 1 s / hosts) tokens "
                            "(velox.cluster.leases.bound)"}
    for part in ("shared", "keyed", "single_host_no_redis"):
        doc[part].pop("logs", None)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc
