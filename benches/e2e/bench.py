"""The measuring harness: the running services, and one measured run with its accounting.

`Bench` starts every service once (the mocks, Velox, nginx in front of each mock, LiteLLM), then
each `run_*` call measures one load-generator run against one target and appends a record to
`self.runs`:

* the generator's figures (requests/s, latency percentiles, errors, stalls);
* CPU seconds of the target's process tree, of its upstream (the mock) and of the generator,
  and the "foreign" cores other people's processes used meanwhile; a run disturbed by more than
  `FOREIGN_LIMIT` cores is repeated once and the quieter attempt kept;
* RSS of the target's workers after the run.

Between runs the harness waits for the target and its upstream to go idle, so a slow target
still working off a backlog (LiteLLM after a burst) cannot steal CPU from the next run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benches.e2e import litellm, wrk
from benches.e2e.machine import CpuWindow, rss_kib, tree, tree_cpu
from benches.e2e.targets import LiteLLM, Mock, Nginx, Service, Velox

FOREIGN_LIMIT = 0.15  # cores used by other processes during a run before it is repeated
Record = dict[str, Any]


@dataclass
class Plan:
    rounds: int = 3
    duration_s: int = 5
    warmup_s: int = 1
    concurrencies: tuple[int, ...] = (1, 16, 64, 256)
    rates: tuple[int, ...] = (100, 1000, 5000, 10000)
    stream_conns: tuple[int, ...] = (1, 64)
    many_streams: int = 512
    slow_chunks: int = 20
    slow_delay_ms: int = 50
    mock_workers: int = 1
    velox_workers: int = 2
    nginx_workers: int = 2
    nginx_tls: bool = True  # nginx in front of the TLS mock too (target "nginx-tls")
    litellm: bool = True
    sections: tuple[str, ...] = ("ceiling", "fixed", "rate", "stream", "arch")
    arch: tuple[str, ...] = ()  # empty: all of sections.ARCH
    extra: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, plan: Plan, logdir: Path) -> None:
        self.plan = plan
        self.logdir = logdir
        self.services: dict[str, Service] = {}
        self.upstream_of: dict[str, str] = {}
        self.runs: list[Record] = []
        self.notes: list[str] = []
        self.requests_served = 0  # every attempt's requests, kept or not (for the soak)

    # --- services ----------------------------------------------------------------------------

    def start(self) -> None:
        plan = self.plan
        plain = self._add(Mock(tls=False, workers=plan.mock_workers, logdir=self.logdir))
        tls = self._add(Mock(tls=True, workers=plan.mock_workers, logdir=self.logdir))
        self.services["direct"] = plain
        self.start_velox("velox", {})
        self._add(Nginx(plain, workers=plan.nginx_workers), upstream="mock")
        if plan.nginx_tls:
            self._add(Nginx(tls, workers=plan.nginx_workers), upstream="mock-tls")
        if plan.litellm:
            if litellm.installed():
                self._add(LiteLLM(plain, plan.slow_chunks, plan.slow_delay_ms, self.logdir),
                          upstream="mock")
            else:
                self.notes.append("LiteLLM not installed (.bench/litellm-venv): skipped")

    def _add(self, service: Service, upstream: str = "") -> Any:
        service.start()
        self.services[service.name] = service
        if upstream:
            self.upstream_of[service.name] = upstream
        return service

    def start_velox(self, label: str, overrides: dict[str, str]) -> Velox:
        """Start a Velox (in front of the TLS mock unless the overrides name another origin)."""
        upstream = "mock" if overrides.get("_upstream") == "mock" else "mock-tls"
        env = {k: v for k, v in overrides.items() if not k.startswith("_")}
        velox = Velox(self.services[upstream], self.logdir, label, env,  # type: ignore[arg-type]
                      workers=self.plan.velox_workers)
        return self._add(velox, upstream=upstream)

    def stop_service(self, name: str) -> None:
        service = self.services.pop(name, None)
        if service is not None and name != "direct":
            service.stop()

    def stop(self) -> None:
        for name in reversed(list(self.services)):
            try:
                self.stop_service(name)
            except Exception as exc:
                print(f"warning: stopping {name}: {exc}", file=sys.stderr)

    def port(self, target: str) -> int:
        if target == "nginx-static":
            return self.services["nginx"].static_port  # type: ignore[attr-defined]
        return self.services[target].port

    @property
    def target_names(self) -> list[str]:
        return [n for n in ("velox", "direct", "nginx", "nginx-tls", "litellm")
                if n in self.services]

    def own_roots(self) -> list[int]:
        seen = {id(s): s for s in self.services.values()}
        return [pid for s in seen.values() for pid in s.roots]

    # --- measuring ---------------------------------------------------------------------------

    def _account(self, target: str) -> tuple[list[int], list[int]]:
        name = "nginx" if target == "nginx-static" else target
        service = self.services[name]
        upstream = self.upstream_of.get(name)
        return service.roots, (self.services[upstream].roots if upstream else [])

    def measure(self, meta: Record, target: str, call: Callable[[], Record]) -> Record:
        """Run `call` (one generator run) with CPU accounting; repeat once if disturbed."""
        best: Record | None = None
        for attempt in (1, 2):
            roots, upstream = self._account(target)
            t_cpu0, u_cpu0 = tree_cpu(roots), tree_cpu(upstream)
            with CpuWindow(self.own_roots()) as win:
                result = call()
            t_cpu, u_cpu = tree_cpu(roots) - t_cpu0, tree_cpu(upstream) - u_cpu0
            record = {**meta, "target": target, "attempt": attempt, **result,
                      "wall_s": round(win.wall, 3), "foreign_cores": round(win.foreign_cores, 3),
                      "target_cpu_s": round(t_cpu, 4), "upstream_cpu_s": round(u_cpu, 4),
                      "generator_cpu_s": round(win.self_cpu, 4),
                      "target_cores": round(t_cpu / win.wall, 3),
                      "upstream_cores": round(u_cpu / win.wall, 3),
                      "generator_cores": round(win.self_cpu / win.wall, 3)}
            requests = result.get("requests") or 0
            self.requests_served += requests
            if result.get("generator") == "wrk" and requests:
                record["cpu_us_per_request"] = round(t_cpu / requests * 1e6, 2)
                record["upstream_cpu_us_per_request"] = round(u_cpu / requests * 1e6, 2)
            record["rss_kib"] = self.rss(target)
            self.settle(roots + upstream)
            if best is None or record["foreign_cores"] < best["foreign_cores"]:
                best = record
            if record["foreign_cores"] <= FOREIGN_LIMIT:
                break
        assert best is not None
        self.runs.append(best)
        _progress(best)
        return best

    def rss(self, target: str) -> list[int]:
        service = self.services["nginx" if target == "nginx-static" else target]
        if isinstance(service, LiteLLM):
            return [sum(rss_kib(p) for root in service.roots for p in tree(root))]
        return [rss_kib(p) for p in service.workers]

    def settle(self, pids: list[int], limit_cores: float = 0.05, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            c0 = tree_cpu(pids)
            time.sleep(0.2)
            if (tree_cpu(pids) - c0) / 0.2 < limit_cores:
                return

    # --- generators ----------------------------------------------------------------------------

    def run_wrk(self, meta: Record, target: str, conns: int) -> Record:
        port, plan = self.port(target), self.plan
        timeout = 30 if target == "litellm" else 10
        if plan.warmup_s:
            wrk.run(port, conns, plan.warmup_s, timeout_s=timeout)

        def call() -> Record:
            out = wrk.run(port, conns, plan.duration_s, timeout_s=timeout)
            return {"generator": "wrk", **out}

        return self.measure({**meta, "conns": conns}, target, call)

    def run_loadgen(self, meta: Record, target: str, mode: str, conns: int,
                    rate: float = 0.0, slow: bool = False) -> Record:
        plan = self.plan
        argv = [sys.executable, "-m", "benches.e2e.loadgen", mode, "--port", str(self.port(target)),
                "--conns", str(conns), "--duration", str(plan.duration_s),
                "--warmup", str(plan.warmup_s)]
        if rate:
            argv += ["--rate", str(rate)]
        if slow:
            stagger = plan.slow_chunks * plan.slow_delay_ms / 1000
            argv += ["--chunks", str(plan.slow_chunks), "--chunk-delay-ms", str(plan.slow_delay_ms),
                     "--stagger-s", str(stagger)]

        def call() -> Record:
            proc = subprocess.run(argv, capture_output=True, text=True,
                                  cwd=Path(__file__).parents[2],
                                  timeout=plan.duration_s + plan.warmup_s + 180, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"loadgen failed: {proc.stderr.strip()[-800:]}")
            return {"generator": "loadgen", **json.loads(proc.stdout.strip().splitlines()[-1])}

        return self.measure({**meta, "conns": conns, "rate": rate, "slow": slow}, target, call)


def _progress(r: Record) -> None:
    lat = r.get("ttfb_us") if r.get("mode") == "stream" else r.get("latency_us")
    lat = lat or {}
    extra = f" stalled={r['stalled']}" if "stalled" in r else ""
    print(f"  [{r['section']} r{r['round']}] {r['target']:<22} c={r.get('conns', ''):<4} "
          f"rate={r.get('rate') or '-':<6} rps={r.get('rps', 0):>9.0f} "
          f"p50={lat.get('p50', 0):>8.0f}us p99={lat.get('p99', 0):>9.0f}us "
          f"cpu/req={r.get('cpu_us_per_request', '-')} foreign={r['foreign_cores']}{extra}",
          flush=True)
