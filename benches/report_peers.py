"""The "Against other gateways" tables of docs/benchmarks.md, from benches/results/peers.json
(`python -m benches.e2e.peers`): every gateway in one run on one host, medians over interleaved
rounds, each figure beside nginx's with a TLS upstream (the cheapest proxy there is, doing none of
the LLM work) as a ratio."""

from __future__ import annotations

from typing import Any

Table = tuple[list[str], list[list[str]]]

# Display order and names; a target missing from a run is left out.
TARGETS = (("velox", "Velox"), ("nginx_tls", "nginx, TLS upstream"), ("nginx", "nginx, cleartext"),
           ("envoy", "Envoy"), ("tensorzero", "TensorZero"), ("ferrogw", "Ferro Labs AI Gateway"),
           ("portkey", "Portkey"), ("litellm1", "LiteLLM (1 worker)"),
           ("litellm2", "LiteLLM (2 workers)"))
_NAMES = {"nginx": "nginx", "envoy": "Envoy", "tensorzero": "TensorZero",
          "ferrogw": "Ferro Labs AI Gateway", "litellm": "LiteLLM", "portkey": "Portkey",
          "wrk": "wrk"}
BASE = "nginx_tls"  # the ratio column's reference for the non-streamed runs
STREAM_BASE = "nginx"  # streams go to a cleartext mock: nginx proxies it directly


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None, base: float | None) -> str:
    return "–" if not value or not base else f"{value / base:.2f}×"


def _present(table: dict[str, Any]) -> list[tuple[str, str]]:
    return [(key, name) for key, name in TARGETS if key in table]


def table_load(doc: dict[str, Any]) -> Table:
    """Non-streamed chat completions at 16 and 64 connections (wrk, closed loop)."""
    wrk = doc["wrk"]
    base = wrk.get(BASE, {}).get("64", {}).get("server_cpu_us_per_req")
    head = ["gateway", "CPU µs/req @16", "CPU µs/req @64", "× nginx-tls @64", "req/s @64",
            "p99 ms @64", "PSS peak MiB @64", "errors"]
    rows = []
    for key, name in _present(wrk):
        c16, c64 = wrk[key].get("16", {}), wrk[key].get("64", {})
        cpu = c64.get("server_cpu_us_per_req")
        pss = c64.get("server_pss_peak_kib")
        rows.append([name, _f(c16.get("server_cpu_us_per_req")), _f(cpu), _ratio(cpu, base),
                     _f(c64.get("rps"), 0), _f((c64.get("p99_us") or 0) / 1000, 2),
                     _f(pss / 1024 if pss else None, 0),
                     str(c16.get("errors", 0) + c64.get("errors", 0))])
    return head, rows


def table_one(doc: dict[str, Any]) -> Table:
    """One connection: what a lone client pays per request."""
    wrk = doc["wrk"]
    direct = wrk.get("direct", {}).get("1", {}).get("p50_us")
    base = wrk.get(BASE, {}).get("1", {})
    head = ["gateway", "CPU µs/req", "× nginx-tls", "added p50 µs", "req/s"]
    rows = []
    for key, name in _present(wrk):
        one = wrk[key].get("1", {})
        cpu = one.get("server_cpu_us_per_req")
        added = None if direct is None or one.get("p50_us") is None else one["p50_us"] - direct
        rows.append([name, _f(cpu), _ratio(cpu, base.get("server_cpu_us_per_req")),
                     _f(added, 0), _f(one.get("rps"), 0)])
    return head, rows


def table_streams(doc: dict[str, Any], streams: str) -> Table:
    """Concurrent SSE streams: CPU per relayed event and what each gateway adds to the time to
    the response head and to the gap between events, over the upstream reached directly."""
    scale = doc["scale"]
    direct = scale.get("direct", {}).get(streams, {})
    base = scale.get(STREAM_BASE, {}).get(streams, {}).get("server_cpu_us_per_event")
    head = ["gateway", "CPU µs/event", "× nginx", "+TTFB p99 ms", "+gap p99 ms", "stalls",
            "errors"]
    rows = []
    for key, name in _present(scale):
        s = scale[key].get(streams)
        if not s:
            continue

        def added(field: str, s: dict[str, Any] = s) -> str:
            if s.get(field) is None or direct.get(field) is None:
                return "–"
            return f"{s[field] - direct[field]:+.2f}"

        cpu = s.get("server_cpu_us_per_event")
        rows.append([name, _f(cpu), _ratio(cpu, base), added("ttfb_p99_ms"),
                     added("gap_excess_p99_ms"), str(s["stalls"]), str(s["errors"])])
    return head, rows


def stream_levels(doc: dict[str, Any]) -> list[str]:
    levels = {n for per in doc["scale"].values() for n in per}
    return sorted(levels, key=int)


def sections(doc: dict[str, Any] | None) -> list[tuple[str, str, Table | None, str | None]]:
    if not doc:
        return []
    out: list[tuple[str, str, Table | None, str | None]] = [
        ("peers", "Non-streamed, 16 and 64 connections (wrk)", table_load(doc), None),
        ("peers", "One connection (wrk, 5 s)", table_one(doc), None)]
    for n in stream_levels(doc):
        one = next(iter(doc["scale"].values()))[n]
        out.append(("peers", f"{n} concurrent streams, {one['events_per_stream']} events "
                    f"{_f(one['delay_ms'], 0)} ms apart, one connection each, cleartext "
                    "HTTP/1.1 upstream", table_streams(doc, n), None))
    return out


def intro(doc: dict[str, Any]) -> list[str]:
    """The run's versions and the host's speed check, under the machine line."""
    v = doc.get("versions", {})
    ran = doc["wrk"].keys() | doc["scale"].keys()
    names = ", ".join(f"{_NAMES.get(k, k)} {v[k]}" for k in v
                      if k == "wrk" or any(t.startswith(k) for t in ran))
    sc = doc.get("speed_check")
    out = [f"Versions: {names}." if names else ""]
    if sc:
        out.append(f"The host's speed check (a fixed pure-Python loop timed around every wrk "
                   f"run; about 70–80 ms on a quiet host): median {sc['median_ms']:.0f} ms, "
                   f"range {sc['min_ms']:.0f}–{sc['max_ms']:.0f}.")
    return [line for line in out if line]
