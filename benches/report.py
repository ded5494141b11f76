"""`python -m benches.report` (`make bench-report`): turn the saved benchmark results into plots,
an HTML page and the tables of docs/benchmarks.md. A developer tool, so it lives here and not in
the velox package.

Reads benches/results/micro.json (from `pytest --benchmark`), e2e.json (`make bench-e2e`),
e2e-native.json and e2e-native-before.json (`make bench-native`: issue 12's comparison with nginx in
front of the TLS mock, with and before the native path), soak.json (`make bench-soak`), routing.json
(`make bench-routing`), cache.json (`make bench-cache`), batching.json (`make bench-batching`),
cluster.json (`make bench-cluster`), streamscale.json (`make bench-streamscale`), peers.json
(`python -m benches.e2e.peers`), profile.json (`python -m benches.e2e.profile --conns 1,64`) and
balance.json (`pytest --benchmark benches/bench_balance.py`) when present, and writes into the
same directory: one PNG per plot, report.html (every table and plot, with the machine facts and
commits, and the project's goals with their verdicts), and the tables of docs/benchmarks.md
(the user docs: figures, machine and date, no goals, verdicts or commits), replaced between
their markers:

    <!-- bench:e2e:start --> ... <!-- bench:e2e:end -->
    <!-- bench:native:start --> ... <!-- bench:native:end -->
    <!-- bench:micro:start --> ... <!-- bench:micro:end -->
    <!-- bench:routing:start --> ... <!-- bench:routing:end -->
    <!-- bench:cache:start --> ... <!-- bench:cache:end -->
    <!-- bench:batching:start --> ... <!-- bench:batching:end -->
    <!-- bench:cluster:start --> ... <!-- bench:cluster:end -->
    <!-- bench:streamscale:start --> ... <!-- bench:streamscale:end -->
    <!-- bench:peers:start --> ... <!-- bench:peers:end -->
    <!-- bench:profile:start --> ... <!-- bench:profile:end -->

Every number comes from the saved files; nothing is typed in here. The plots are drawn by
benches/e2e/plots.py with matplotlib (`pip install -e '.[bench]'`, which `make bench-report`
does); without it the tables are still written. Run it from the repository root (the default
--results and --readme paths are relative to it).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benches import report_peers, report_profile

MARKERS = ("e2e", "native", "micro", "routing", "cache", "batching", "cluster", "peers",
           "streamscale", "profile")
# Sections of this marker (the projects' goals and verdicts) go to the developers' HTML page
# only, never into the user docs.
GOALS = "goals"
# The page the tables go to, and the results directory as a link from it.
DOC = Path("docs/benchmarks.md")
RESULTS_LINK = "../benches/results"
TARGET_ORDER = ("direct", "velox", "nginx", "nginx-tls", "litellm")
PCTS = ("p50", "p90", "p99", "p99.9")
Table = tuple[list[str], list[list[str]]]


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _n(value: Any, digits: int = 0) -> str:
    if value is None:
        return "–"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}"
    return str(value)


def _ordered(d: dict[str, Any]) -> list[str]:
    return sorted(d, key=lambda t: (TARGET_ORDER.index(t) if t in TARGET_ORDER else 99, t))


def _keys(d: dict[Any, Any]) -> list[Any]:
    return sorted(d, key=float)


def machine_line(doc: dict[str, Any], commit: bool = True) -> str:
    """The machine, software and date of a run; the commit only on the developers' HTML page
    (the user docs give the machine and the date)."""
    m = doc["machine"]
    pk = m.get("packages", {})
    made = (f"commit {m['git_commit']}{' + local changes' if m['git_dirty'] else ''}, "
            if commit else "")
    return (f"{m['cpu_model']}, {m['cores']} cores, {m['memory_mib'] // 1024} GiB, {m['os']}, "
            f"kernel {m['kernel']}, Python {m['python']} (uvloop {pk.get('uvloop', '?')}, orjson "
            f"{pk.get('orjson', '?')}); {made}"
            f"{m['date'][:16].replace('T', ' ')} UTC, load average {m['loadavg'][0]:.2f}")


# --- tables --------------------------------------------------------------------------------


def table_fixed(s: dict[str, Any]) -> Table:
    head = ["target", "connections", "req/s", "p50 µs", "p90 µs", "p99 µs", "p99.9 µs",
            "added p50 µs", "added p99 µs", "req/s vs direct", "CPU µs/req", "errors"]
    rows = []
    for target in _ordered(s["fixed"]):
        for conns in _keys(s["fixed"][target]):
            r, o = s["fixed"][target][conns], s["overhead"].get(target, {}).get(conns, {})
            rows.append([target, str(conns), _n(r["rps"]), *(_n(r[p]) for p in PCTS),
                         _n(o.get("p50")), _n(o.get("p99")),
                         _n(o.get("throughput_ratio"),
                            3) if o else "1", _n(r.get("cpu_us_per_request"), 1),
                         _n(r["errors"] + r["non_2xx"])])
    return head, rows


def table_goals(s: dict[str, Any]) -> Table:
    head = ["issue", "goal", "measured", "target", "verdict", "note"]
    verdict = {True: "reached", False: "**missed**", None: "not measured"}
    digits = {"x": 2}  # ratios (issue 12) need two decimals; everything else one
    rows = [[g["source"], g["goal"], f"{_n(g['measured'], digits.get(g['unit'], 1))} {g['unit']}",
             f"{_n(g['target'], digits.get(g['unit'], 1))} {g['unit']}", verdict[g["reached"]],
             g.get("detail", "")] for g in s["goals"]]
    return head, rows


def _times(value: float | None) -> str:
    return "–" if value is None else f"{_n(value, 2)}×"


def table_native_goals(after: dict[str, Any], before: dict[str, Any] | None) -> Table:
    """Issue 12's ratios against nginx with a TLS upstream: this run, and the run before the
    native path (e2e-native-before.json) when there is one."""
    head = ["goal", *(["before"] if before else []), "measured", "target", "verdict", "figures"]
    was = {g["goal"]: g for g in (before or {}).get("goals", []) if g["source"] == "issue 12"}
    rows = []
    for g in after["goals"]:
        if g["source"] != "issue 12":
            continue
        prev = [_times(was[g["goal"]]["measured"] if g["goal"] in was else None)] \
            if before else []
        rows.append([g["goal"], *prev, _times(g["measured"]), _times(g["target"]),
                     VERDICT[g["reached"]], g.get("detail", "")])
    return head, rows


def table_native_ratios(after: dict[str, Any]) -> Table:
    """The same ratios against nginx with a TLS upstream as figures only: no target, no
    verdict (the user docs' table; the goals stay on the developers' HTML page)."""
    head = ["figure", "Velox / nginx", "measured"]
    rows = [[re.sub(r"\s*(<=|>=)\s*[\d.]+x nginx's", " against nginx's", g["goal"]),
             _times(g["measured"]), g.get("detail", "")]
            for g in after["goals"] if g["source"] == "issue 12"]
    return head, rows


def table_arch(s: dict[str, Any]) -> Table:
    head = ["configuration (one switch from the default)", "req/s", "vs default", "p50 µs",
            "p99 µs", "CPU µs/req", "errors"]
    rows = [[r["config"], _n(r["rps"]), _n(r.get("rps_vs_default"), 2), _n(r["p50"]), _n(r["p99"]),
             _n(r["cpu_us_per_request"], 1), _n(r["errors"])] for r in s["arch"]]
    return head, rows


def table_stream(s: dict[str, Any]) -> Table:
    head = ["streams", "target", "TTFB p50 µs", "TTFB p99 µs", "added TTFB p50 µs",
            "added TTFB p99 µs", "total p50 µs", "longest gap p99 µs", "streams", "stalled"]
    rows = []
    for scen in sorted(s["stream"], key=lambda k: (k.startswith("many"), int(k.split("=")[1]))):
        for target in _ordered(s["stream"][scen]):
            r = s["stream"][scen][target]
            rows.append([scen.replace("many=", "") + (" long" if scen.startswith("many") else ""),
                         target, _n(r["ttfb_p50"]), _n(r["ttfb_p99"]), _n(r.get("added_ttfb_p50")),
                         _n(r.get("added_ttfb_p99")), _n(r["total_p50"]), _n(r["max_gap_p99"]),
                         _n(r["streams"]), _n(r["stalled"])])
    return head, rows


def table_rate(s: dict[str, Any]) -> Table:
    head = ["target", "offered req/s", "achieved req/s", "p50 µs", "p99 µs", "p99.9 µs", "errors"]
    rows = [[t, _n(float(k)), _n(r["achieved_rps"]), _n(r["p50"]), _n(r["p99"]), _n(r["p99.9"]),
             _n(r["errors"])] for t in _ordered(s["rate"]) for k, r in
            sorted(s["rate"][t].items(), key=lambda kv: float(kv[0]))]
    return head, rows


def table_resources(doc: dict[str, Any]) -> Table:
    s = doc["summary"]
    fx, arch = s["fixed"], {r["config"]: r for r in s["arch"]}
    head = ["figure", "value"]
    rows = []
    for conns in ("1", "16", "64", "256"):
        v = fx.get("velox", {}).get(conns, {}) or fx.get("velox", {}).get(int(conns), {})
        if v:
            rows.append([f"Velox CPU per request, HTTP/2 + TLS egress, {conns} connections",
                         f"{_n(v.get('cpu_us_per_request'), 1)} µs (mock upstream: "
                         f"{_n(v.get('upstream_cpu_us_per_request'), 1)} µs)"])
    for name in ("egress=http1", "egress=http1 cleartext"):
        if name in arch:
            rows.append([f"Velox CPU per request, {name.split('=')[1]} egress, 64 connections",
                         f"{_n(arch[name]['cpu_us_per_request'], 1)} µs"])
    mem = s["memory"]
    rows.append(["Velox RSS per worker: start → end of the run (MiB)",
                 f"{mem.get('rss_mib_start')} → {mem.get('rss_mib_end')}"])
    rows.append(["Velox largest worker RSS in any run",
                 f"{_n(mem.get('max_worker_rss_mib'), 1)} MiB"])
    if "litellm_rss_mib" in mem:
        rows.append(["LiteLLM proxy RSS (1 worker, process tree)",
                     f"{_n(mem['litellm_rss_mib'], 1)} MiB"])
    for section, ld in s.get("load", {}).items():
        rows.append([f"other people's load during '{section}' runs (cores)",
                     f"median {_n(ld['median'], 2)}, max {_n(ld['max'], 2)}; {ld['repeated']} of "
                     f"{ld['runs']} runs repeated, {ld['over_limit']} still over the limit"])
    for gen, c in s.get("ceiling", {}).items():
        rows.append([f"{gen} ceiling against nginx `return 200`, 64 connections",
                     f"{_n(c['rps'])} req/s, {_n(c['generator_cpu_us_per_request'], 1)} µs of "
                     f"generator CPU per request"])
    return head, rows


VERDICT = {True: "reached", False: "**missed**", None: "not measured"}


def table_routing_goals(s: dict[str, Any]) -> Table:
    head = ["goal", "measured", "target", "verdict"]
    digits = {"ratio": 3, "µs": 2}
    return head, [[g["goal"], f"{_n(g['measured'], digits.get(g['unit'], 0))} "
                   f"{g['unit']}", f"{g['target']} {g['unit']}", VERDICT[g["reached"]]]
                  for g in s["goals"]]


def table_routing_spread(s: dict[str, Any]) -> Table:
    head = ["gateway", "req/s", "p50 µs", "p99 µs", "p99.9 µs", "gateway CPU µs/req",
            "mocks' CPU µs/req", "errors", "rounds", "other load, cores (median)"]
    names = {"velox-env": "Velox, 1 upstream from VELOX_UPSTREAM_* (no file)",
             "velox-1": "Velox, 1 upstream", "velox-3": "Velox, 3 upstreams (weights 2:1:1)",
             "velox-1-3conns": "Velox, 1 upstream, 3 connections per worker (control)"}
    rows = [[names.get(t, t), _n(r["rps"]), _n(r["p50"]), _n(r["p99"]), _n(r["p99.9"]),
             _n(r["cpu_us_per_request"], 1), _n(r["upstream_cpu_us_per_request"], 1),
             _n(r["errors"]), _n(r["runs"]), _n(r.get("foreign_cores_median"), 2)]
            for t, r in s["spread"].items()]
    p = s.get("spread_vs_one")
    if p:
        rows.append(["3 upstreams against 1 (paired by round, median)",
                     f"× {_n(p['rps_ratio'], 3)}", "", f"{_n(p['p99_delta_us'])} added", "",
                     f"{_n(p['cpu_delta_us'], 2)} added", "", "", _n(p["rounds"]), ""])
    for key, label in (("file_vs_env", "1 upstream from the file against no file"),
                       ("control_vs_one", "1 upstream: 3 connections per worker against 1"),
                       ("spread_vs_control", "3 upstreams against 1 with 3 connections")):
        f = s.get(key)
        if f and f["rounds"]:
            rows.append([f"{label} (paired by round, median)",
                         f"× {_n(f['rps_ratio'], 3)}", "", f"{_n(f['p99_delta_us'])} added", "",
                         f"{_n(f['cpu_delta_us'], 2)} added", "", "", _n(f["rounds"]), ""])
    return head, rows


def table_routing_failover(s: dict[str, Any]) -> Table:
    head = ["upstreams", "req/s", "vs all up", "p50 µs", "p99 µs", "p99.9 µs",
            "added p99 µs", "client-visible errors", "requests", "gateway retries",
            "other load, cores (median)"]
    names = {"all-up": "all three up", "b-503": "b answers 503", "b-killed": "b killed (SIGKILL)"}
    vs = s.get("failover_vs_all_up", {})
    rows = []
    for cond, r in s["failover"].items():
        p = vs.get(cond, {})
        rows.append([names.get(cond, cond), _n(r["rps"]),
                     _n(p.get("rps_ratio"), 3) if p else "1", _n(r["p50"]), _n(r["p99"]),
                     _n(r["p99.9"]), _n(p.get("p99_delta_us")) if p else "0",
                     _n(r["errors"]), _n(r["requests"]), _n(r.get("retries")),
                     _n(r.get("foreign_cores_median"), 2)])
    return head, rows


_CACHE_CONFIGS = {"direct": "the upstream alone (mock, cleartext HTTP/1.1)",
                  "miss": "Velox without the cache (every request proxied)",
                  "hit": "Velox with the cache: hits",
                  "miss-stored": "Velox with the cache: misses (no-cache: key, record, store)"}


BATCH_MODES = {"off": "off", "on": "on (max_wait_ms = 20)", "on-wait5": "on (max_wait_ms = 5)"}


def table_batching(doc: dict[str, Any]) -> Table:
    head = ["connections", "batching", "req/s", "p50 µs", "p99 µs", "upstream calls per request",
            "requests per upstream call", "errors", "rounds"]
    rows = []
    for r in doc["summary"]["rows"]:
        per = r["upstream_calls_per_request"]
        rows.append([_n(r["conns"]), BATCH_MODES.get(r["mode"], r["mode"]), _n(r["rps"]),
                     _n(r["p50"]), _n(r["p99"]), _n(per, 3),
                     _n(1 / per, 1) if per else "–", _n(r["errors"]), _n(r["rounds"])])
    return head, rows


def table_cache_hit_path(s: dict[str, Any]) -> Table:
    head = ["conns", "what", "req/s", "p50 µs", "p99 µs", "gateway CPU µs/req", "errors",
            "rounds", "other load, cores (median)"]
    rows = [[_n(r["conns"]), _CACHE_CONFIGS.get(r["config"], r["config"]), _n(r["rps"]),
             _n(r["p50"]), _n(r["p99"]), _n(r["cpu_us_per_request"], 1), _n(r["errors"]),
             _n(r["runs"]), _n(r.get("foreign_cores"), 2)] for r in s["hit_path"].values()]
    for conns, p in s.get("paired", {}).items():
        if p["rounds"]:
            rows.append([conns, "hit against a proxied miss (paired by round, median)",
                         f"× {_n(p['hit_rps_ratio'], 2)}", f"{_n(p['hit_p50_delta_us'])} added",
                         "", f"× {_n(p['hit_cpu_ratio'], 2)}", "", _n(p["rounds"]), ""])
    return head, rows


def table_cache_repeat(s: dict[str, Any]) -> Table:
    r = s["repeat"]
    sim = r["simulated"]
    head = ["cache", "hit rate", "upstream calls", "calls saved", "how"]
    return head, [
        ["Velox: one cache shared by the workers", _n(r["hit_rate"], 3), _n(r["upstream_calls"]),
         _n(r["upstream_calls_saved"]), f"measured: {_n(r['requests'])} requests over "
         f"{_n(r['clients'])} connections, repeat ratio {r['repeat_ratio']}, "
         f"{_n(r['distinct_prompts'])} distinct prompts ({_n(r['hits'])} hits, "
         f"{_n(r['coalesced'])} coalesced)"],
        ["best possible (each distinct prompt missed once)", _n(r["best_possible_hit_rate"], 3),
         _n(r["distinct_prompts"]), _n(r["requests"] - r["distinct_prompts"]), "arithmetic"],
        [f"one LRU of {_n(sim['lru_entries'])} entries", _n(sim["shared_lru_hit_rate"], 3), "",
         "", "simulated on the same sequence"],
        [f"a {_n(sim['lru_entries'])}-entry LRU per worker, {sim['workers']} workers",
         _n(sim["per_worker_lru_hit_rate"], 3), _n(sim["per_worker_lru_upstream_calls"]),
         _n(r["requests"] - sim["per_worker_lru_upstream_calls"]),
         "simulated: each connection on a random worker, as SO_REUSEPORT spreads them"],
    ]


def table_cache_lookup(s: dict[str, Any]) -> Table:
    lk = s["lookup"]
    head = ["lookup of one stored answer", "ns per hit"]
    return head, [["shared store (SharedCache.get: lock, copy out of the shared mapping)",
                   _n(lk["shared_store_ns"])],
                  ["per-worker LRU (OrderedDict get + move_to_end)",
                   _n(lk["per_worker_dict_lru_ns"])]]


def table_hash_quality(bal: dict[str, Any]) -> Table:
    head = ["method", "targets", "max / mean keys", "min / mean keys", "moved on remove (ideal)",
            "moved on add (ideal)", "lookup ns"]
    rows = [[q["method"] + (" (used)" if q["method"] == bal.get("hash_used") else ""),
             _n(q["targets"]), _n(q["max_over_mean"], 4), _n(q["min_over_mean"], 4),
             f"{_n(q['moved_on_remove'], 4)} ({_n(q['ideal_on_remove'], 4)})",
             f"{_n(q['moved_on_add'], 4)} ({_n(q['ideal_on_add'], 4)})", _n(q["lookup_ns"], 1)]
            for q in sorted(bal["hash_quality"], key=lambda q: (q["targets"], q["method"]))]
    share = bal.get("weighted_3_to_1_share")
    if share:
        rows.append(["weights 3:1, share of the heavier (ideal 0.75)", "2",
                     *(f"{m} {_n(v, 4)}" for m, v in sorted(share.items())), "", "", ""])
    return head, rows


def table_selection(bal: dict[str, Any]) -> Table:
    head = ["operation (ns per item)", "median", "minimum", "quiet-machine estimate"]
    med, mins = bal["timed_medians_ns_per_item"], bal["timed_minima_ns_per_item"]
    est = bal.get("quiet_estimate_ns_per_item", {})
    order = sorted(med, key=lambda k: (not k.startswith("select_"), k))
    rows = [[k, _n(med[k], 1), _n(mins.get(k), 1), _n(est.get(k), 1)] for k in order]
    return head, rows


def table_cluster(doc: dict[str, Any]) -> Table:
    """The several-hosts run: admitted against the bounds, with Redis and without."""
    head = ["run", "hosts", "sent", "admitted", "bounds [lower, upper]", "stated bound",
            "tokens used (bound)", "5xx / no answer", "back on Redis after restart (s)"]
    rows = []
    for part, label in (("shared", "VELOX_RATE_LIMIT_RPM, one Redis killed mid-run"),
                        ("keyed", "a [[key]] (rpm 600, tpm 60000), one Redis killed mid-run"),
                        ("single_host_no_redis", "one host, no Redis")):
        d = doc.get(part)
        if not d:
            continue
        plan = d["plan"]
        outage = plan.get("outage")
        name = f"{label} ({plan['duration_s']:g} s" + (
            f", Redis down {outage[0]:g}-{outage[1]:g} s)" if outage and plan["redis"] else ")")
        back = [v for v in d.get("recovered_s", {}).values() if v is not None]
        rows.append([name, str(plan["hosts"]), _n(d["sent"]), _n(d["admitted"]),
                     f"[{_n(d['lower'])}, {_n(d['upper'])}]", _n(d["stated_bound"]),
                     f"{_n(d['tokens'])} ({_n(d['tokens_upper'])})" if d.get("tokens_upper")
                     else "–", _n(d["server_errors"]), _n(max(back), 1) if back else "–"])
    return head, rows


def table_cluster_commands(doc: dict[str, Any]) -> Table | None:
    d = doc.get("shared", {})
    c = d.get("commands")
    rows = []
    if d.get("redis_commands_per_s_during_load") is not None:
        rows.append([f"{d['plan']['factor']:g}x the {d['plan']['rpm']} rpm limit (SDK, open "
                     "loop; includes the outage's retries)",
                     _n(d["sent"] / d["plan"]["duration_s"], 0),
                     _n(d["redis_commands_per_s_during_load"], 1),
                     _n(d["redis_commands_per_s_during_load"] / d["plan"]["hosts"], 1)])
    if c and "commands_per_s" in c:
        rows.append([f"as fast as wrk drives 3 hosts (64 connections each, {c['seconds']:g} s, "
                     "limit out of the way)", _n(c["requests_per_s"], 0),
                     _n(c["commands_per_s"], 1), _n(c["commands_per_s_per_host"], 1)])
    if not rows:
        return None
    return ["load", "requests/s", "Redis commands/s", "per host"], rows


def _speedups(name: str, info: dict[str, Any]) -> str:
    parts = []
    for key, value in info.items():
        if not isinstance(value, (int, float)) or not value:
            continue
        if key.startswith(("ratio_vs_", "cpu_ratio_vs_")):
            label = ("CPU " if key.startswith("cpu_") else "") + key.split("_vs_", 1)[1]
            parts.append(f"{value:.2f}× vs {label}")
        elif key.startswith("ratio_to_") and f"[{key[9:]}]" not in name:
            parts.append(f"{1 / value:.2f}× vs {key[len('ratio_to_'):]}")
    return ", ".join(parts)


_PER_ITEM = (("median_per_item_ns", "ns/item"), ("median_per_parse_us", "µs/parse"),
             ("per_request_us_median", "µs/request"), ("per_request_us", "µs/request"),
             ("client_cpu_us_per_request", "µs CPU/request"),
             ("mock_cpu_us_per_request", "µs CPU/request"))

# Benchmarks that measure a scenario (a running gateway, seconds long) rather than one call:
# their figures get a table each instead of a row of the micro table.
_SCENARIOS = ("test_large_uploads_do_not_stall_the_loop", "test_client_disconnect_cancel_latency",
              "test_access_log_cost", "test_profile_throughput_cost")


def _scenario(doc: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((b["extra_info"] for b in doc["benchmarks"] if b["name"] == name), None)


def table_bigbody(doc: dict[str, Any]) -> Table | None:
    info = _scenario(doc, "test_large_uploads_do_not_stall_the_loop")
    if info is None:
        return None
    rows = []
    for variant, label in (("off-loop_quiet", "no uploads"),
                           ("off-loop_uploads",
                            "16 MiB chat uploads, scanned off the loop (default)"),
                           ("on-loop_uploads", "16 MiB chat uploads, orjson on the loop"),
                           ("no_parse_uploads", "16 MiB uploads to a path that is not parsed")):
        rows.append([label, *(_n(info.get(f"{variant}_{k}")) for k in
                              ("p50_us", "p99_us", "p999_us", "max_us", "uploads"))])
    return ["one worker, /healthz probes", "p50 µs", "p99 µs", "p99.9 µs", "max µs",
            "uploads"], rows


def table_cancel(doc: dict[str, Any]) -> Table | None:
    info = _scenario(doc, "test_client_disconnect_cancel_latency")
    if info is None:
        return None
    rows = [[label, *(_n(info.get(f"{kind}_{k}"), 2) for k in ("p50_ms", "p90_ms", "max_ms")),
             _n(info.get(f"{kind}_n"))]
            for kind, label in (("idle", "idle gateway"), ("busy", "32 other streams running"))]
    return ["client closes mid-stream", "p50 ms", "p90 ms", "max ms", "rounds"], rows


def table_admin_cost(doc: dict[str, Any]) -> Table | None:
    log, prof = (_scenario(doc, "test_access_log_cost"),
                 _scenario(doc, "test_profile_throughput_cost"))
    rows = []
    if log:
        rows += [[f"access log {v}: CPU per request, one worker's path without sockets",
                  f"{_n(log.get(f'cpu_us_per_request_{v}'), 2)} µs"]
                 for v in ("off", "enqueue", "on")]
    if prof:
        rows += [["requests/s, 2 workers, 64 connections: without a profile / while profiling",
                  f"{_n(prof.get('rps_without_profile'))} / {_n(prof.get('rps_while_profiling'))} "
                  f"({_n(prof.get('throughput_cost_pct'), 1)}% fewer)"],
                 ["worker CPU per request: without a profile / while profiling",
                  f"{_n(prof.get('worker_cpu_us_per_request'), 1)} / "
                  f"{_n(prof.get('worker_cpu_us_per_request_profiling'), 1)} µs"]]
        rows += [[f"admin {path} while the workers serve 64 connections: median / max",
                  f"{_n(prof.get(f'admin_{path}_under_load_p50_ms'), 2)} / "
                  f"{_n(prof.get(f'admin_{path}_under_load_max_ms'), 2)} ms "
                  f"({_n(prof.get(f'admin_{path}_under_load_n'))} requests)"]
                 for path in ("stats", "metrics") if f"admin_{path}_under_load_n" in prof]
    return (["figure", "value"], rows) if rows else None


# native/tests/bench.c's figures (saved by benches/bench_native.py) and the targets.
C_FIGURES = (
    ("ring_push_pop", "ring push + pop, one item", "<= 25"),
    ("ring_pop_drain", "ring pop, draining a full ring, per item", ""),
    ("ring_pop_batch_claim", "ring pop_batch(64) claim, per item", ""),
    ("bucket_acquire", "bucket acquire(1), uncontended", "<= 10"),
    ("bucket_acquire64_per_token", "bucket acquire(64), per token", ""),
    ("counters_add", "counter add", ""),
    ("histogram_record", "histogram record", ""),
    ("ring_push_pop_2_threads", "ring push + pop, 2 threads sharing one ring (wall)", ""),
)


def table_c(doc: dict[str, Any]) -> Table | None:
    info = next((b["extra_info"] for b in doc["benchmarks"]
                 if any(k.startswith("c_ns_") for k in b["extra_info"])), None)
    if info is None:
        return None
    rows = [[label, _n(info.get(f"c_ns_{key}"), 2), target] for key, label, target in C_FIGURES]
    return ["operation (C, -O2, median of 7 runs)", "ns/op", "target ns"], rows


_EGRESS = {"http1": "HTTP/1.1 cleartext upstream (Velox's HTTP/1.1 egress, against nginx)",
           "h2": "HTTP/2 + TLS upstream (Velox's HTTP/2 egress; nginx-tls: HTTP/1.1 + TLS)"}


def table_streamscale(run: dict[str, Any]) -> Table:
    """One egress's part of the streaming matrix: per target and stream count, CPU per event
    and the delays added to the mock's own, with the ratios to nginx's in the same run."""
    from benches.e2e.streamscale import HEADER, summary

    return HEADER, summary(run)


def table_streamscale_goals(doc: dict[str, Any]) -> Table:
    """The streaming targets against nginx, with verdicts (the developers' HTML page only)."""
    from benches.e2e.streamscale import goals, runs

    head = ["egress", "target", "streams", "goal", "measured", "verdict", "figures"]
    return head, [[run["egress"], g["target"], str(g["streams"]), g["goal"], g["measured"],
                   VERDICT[g["reached"]], g["detail"]]
                  for run in runs(doc) for g in goals(run)]


def streamscale_sections(doc: dict[str, Any]) -> list[tuple[str, str, Table | None, str | None]]:
    """A table per egress of the matrix (`make bench-streamscale`), in the order run, and
    the goals' verdicts for the developers' page."""
    from benches.e2e.streamscale import runs

    out: list[tuple[str, str, Table | None, str | None]] = [
        (GOALS, "Streaming at scale against nginx (issue 22)", table_streamscale_goals(doc),
         None)]
    for run in runs(doc):
        events = str(run["events"]).replace("-", "–")
        how = (f"one keep-alive client connection per concurrent stream, each starting its "
               f"next stream as one ends, for {_n(run['seconds'])} s" if run.get("seconds")
               else "one client connection per stream")
        out.append(("streamscale", f"{_EGRESS[run['egress']]}: {events} events "
                    f"{run['interval_ms']} ms apart per stream, {how}", table_streamscale(run),
                    None))
    return out


def table_providers(doc: dict[str, Any]) -> Table:
    """OpenAI SDK -> Velox -> an Anthropic upstream (translated) against the same SDK to an
    OpenAI upstream (pass-through): the gateway's CPU per request, medians of rounds."""
    rows = [[kind, f"{s['openai_cpu_us_per_request']:,.0f} µs",
             f"{s['anthropic_cpu_us_per_request']:,.0f} µs", f"{s['ratio']:.2f}×"]
            for kind, s in doc["summary"].items()]
    return ["answers", "OpenAI upstream (pass-through)", "Anthropic upstream (translated)",
            "translated / pass-through"], rows


def table_messages_front(doc: dict[str, Any]) -> Table:
    """/v1/messages to an Anthropic upstream against /v1/chat/completions to an OpenAI one,
    both passed through: the workers' CPU per request."""
    rows = [[c["path"], f"{c['rps']:,}", f"{c['cpu_us_per_request']:,.1f} µs"]
            for c in doc["cases"].values()]
    rows.append(["messages / chat", "", f"{doc['ratio']:.2f}×"])
    return ["path", "requests/s", "workers' CPU per request"], rows


def table_micro(doc: dict[str, Any]) -> Table:
    head = ["group", "benchmark", "median per call", "per item", "speed-up"]
    rows = []
    for b in sorted(doc["benchmarks"], key=lambda b: (b["group"] or "", b["name"])):
        info = b["extra_info"]
        if any(k.startswith("c_ns_") for k in info) or b["name"] in _SCENARIOS:
            continue  # tables of their own: one call is a whole scenario, its time says nothing
        item = next((f"{info[k]:,.2f} {unit}" for k, unit in _PER_ITEM if k in info), "")
        rows.append([b["group"] or "", b["name"], f"{b['stats']['median'] * 1e6:,.1f} µs", item,
                     _speedups(b["name"], info)])
    return head, rows


def markdown(table: Table) -> str:
    head, rows = table
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def html_table(table: Table) -> str:
    head, rows = table
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c).replace('**', '')}</td>" for c in row)
                   + "</tr>" for row in rows)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


# --- documents -----------------------------------------------------------------------------


# The result documents by name (`docs`), each from benches/results/<file> (see load_docs).
DOCUMENTS = {"e2e": "e2e.json", "micro": "micro.json", "routing": "routing.json",
             "cache": "cache.json", "batching": "batching.json", "cluster": "cluster.json",
             "native": "e2e-native.json", "soak": "soak.json", "balance": "balance.json",
             "native_before": "e2e-native-before.json", "streamscale": "streamscale.json",
             "providers": "providers.json", "messages_front": "messages_front.json",
             "peers": "peers.json", "profile": "profile.json"}


def load_docs(results: Path) -> dict[str, Any]:
    """Every result document by name (None for a benchmark not run yet)."""
    return {name: _load(results / file) for name, file in DOCUMENTS.items()}


def sections(docs: dict[str, Any]) -> list[tuple[str, str, Table | None, str | None]]:
    """(marker, title, table, plot file) in reading order; the source of both outputs. `docs`:
    result documents by name (DOCUMENTS; a missing or None one adds no section)."""
    e2e, micro, soak, routing = docs.get("e2e"), docs.get("micro"), docs.get("soak"), \
        docs.get("routing")
    balance, cache, batching = docs.get("balance"), docs.get("cache"), docs.get("batching")
    cluster, native, native_before = docs.get("cluster"), docs.get("native"), \
        docs.get("native_before")
    out: list[tuple[str, str, Table | None, str | None]] = []
    if cluster:
        out.append(("cluster", "Three hosts, one limit, one Redis (`make bench-cluster`)",
                    table_cluster(cluster), "cluster.png"))
        commands = table_cluster_commands(cluster)
        if commands is not None:
            out.append(("cluster", "Redis commands against requests", commands, None))
    if routing:
        s = routing["summary"]
        out.append(("goals", "Routing goals (issue 9)", table_routing_goals(s), None))
        if s.get("spread"):
            out.append(("routing", f"Three upstreams against one, {routing.get('conns', 64)} "
                        "connections (wrk)", table_routing_spread(s), None))
        if s.get("failover"):
            out.append(("routing", f"One of three upstreams down, {routing.get('conns', 64)} "
                        "connections (wrk)", table_routing_failover(s), None))
    if cache:
        s = cache["summary"]
        if s.get("goals"):
            out.append(("goals", "Cache goals (issue 10)", table_routing_goals(s), None))
        if s.get("hit_path"):
            out.append(("cache", "The hit path against a proxied miss (wrk, the same request "
                        "every time)", table_cache_hit_path(s), None))
        if s.get("repeat"):
            out.append(("cache", "A workload with repeats",
                        table_cache_repeat(s), None))
        if s.get("lookup"):
            out.append(("cache",
                        f"What one lookup costs in a worker ({_n(s['lookup']['value_bytes'])}"
                        "-byte answer, in-process, best of 5)", table_cache_lookup(s), None))
    if batching:
        st = batching["setup"]
        out.append(("batching", f"Single-input embeddings through Velox, mock at "
                    f"{st['mock_latency_ms']} ms per call + {st['mock_latency_per_input_us']} "
                    "µs per input (wrk, closed loop)", table_batching(batching), None))
    if balance:
        out.append(("routing", "Consistent hashing: rendezvous against a ring (100,000 keys)",
                    table_hash_quality(balance), None))
        out.append(("routing", "What choosing a target costs (`benches/bench_balance.py`; "
                    f"target {_n(balance.get('target_ns'))} ns per request)",
                    table_selection(balance), None))
    if e2e:
        s = e2e["summary"]
        out += [
            ("goals", "Goals", table_goals(s), None),
            ("e2e", "Fixed concurrency, non-streaming (wrk)", table_fixed(s), "throughput.png"),
            ("e2e", "Latency percentiles", None, "latency_percentiles.png"),
            ("e2e", "Added latency against direct", None, "overhead.png"),
            ("e2e", "Constant request rate (open loop, latency from the due time)",
             table_rate(s), "rate.png"),
            ("e2e", "Streaming", table_stream(s), "streaming.png"),
            ("e2e", "Architecture switches, 64 connections", table_arch(s), "architecture.png"),
            ("e2e", "CPU, memory and the load generators' ceilings", table_resources(e2e), None),
        ]
    if soak:
        out.append(("e2e", "Soak: worker RSS over about a million requests", None, "soak.png"))
    if native:
        s = native["summary"]
        before = native_before["summary"] if native_before else None
        out += [
            ("goals", "Issue 12: Velox against nginx with a TLS upstream, in one run",
             table_native_goals(s, before), None),
            ("native", "Velox against nginx with a TLS upstream, ratios from one run",
             table_native_ratios(s), None),
            ("native", "Fixed concurrency, non-streaming (wrk)", table_fixed(s), None),
            ("native", "Streaming", table_stream(s), None),
        ]
        if s.get("arch"):
            out.append(("native", "Velox's egress, 64 connections", table_arch(s), None))
    streamscale = docs.get("streamscale")
    if streamscale:
        out += streamscale_sections(streamscale)
    out += report_peers.sections(docs.get("peers"))
    out += report_profile.sections(docs.get("profile"))
    providers, front = docs.get("providers"), docs.get("messages_front")
    if providers:
        out.append(("providers", "Translation to another provider: OpenAI SDK, 64 requests in "
                    "flight (`python -m benches.e2e.providers`)", table_providers(providers),
                    None))
    if front:
        out.append(("providers", "The Messages API in front, passed through: wrk at 64 "
                    "connections (`python -m benches.bench_messages_front`)",
                    table_messages_front(front), None))
    if micro:
        c_table = table_c(micro)
        if c_table is not None:
            out.append(("micro", "Native core without Python", c_table, None))
        out.append(("micro", "Micro-benchmarks (`pytest --benchmark`)", table_micro(micro),
                    "micro_ratios.png"))
        for title, table in (
                ("Large uploads do not hold the loop (`benches/bench_bigbody.py`)",
                 table_bigbody(micro)),
                ("Client disconnect to upstream RST_STREAM (`benches/bench_cancel.py`)",
                 table_cancel(micro)),
                ("What seeing inside costs (`benches/bench_admin.py`)", table_admin_cost(micro))):
            if table is not None:
                out.append(("micro", title, table, None))
    return out


def readme_block(marker: str, secs: list, docs: dict[str, Any], plots: set[str]) -> str:
    lines = ["<!-- Generated by `python -m benches.report` from benches/results/; do not edit. -->"]
    doc = docs.get(marker)
    if doc and marker == "cluster":
        m = doc.get("machine", {})
        lines.append(f"\nMeasured on this project's {m.get('cores', '?')}-core machine, shared "
                     f"(load average {m.get('loadavg_end', [0])[0]:.2f} at the end); counts, "
                     "not speed, so the load matters little.")
    elif doc:
        lines.append(f"\nMeasured on {machine_line(doc, commit=False)}.")
        if marker in ("routing", "cache"):
            lines.append(f"Placement: {doc['placement']} Medians of {doc['plan']['rounds']} "
                         f"interleaved rounds of {doc['plan']['duration_s']} s.")
            lines += [f"{n}" for n in doc.get("notes", [])]
            foreign = sorted(x["foreign_cores"] for x in doc.get("runs", [])
                             if x.get("foreign_cores") is not None)
            if foreign:
                mid = foreign[len(foreign) // 2]
                lines.append(f"Other people's processes used a median of {mid:.2f} cores (max "
                             f"{foreign[-1]:.2f}) of the {doc['machine']['cores']} during these "
                             "runs" + ("; absolute figures are far below a quiet machine's, so "
                                       "read the ratios paired by round." if mid > 0.15 else "."))
        if marker == "batching":
            st = doc["setup"]
            foreign = sorted(r["foreign_cores_before"] for r in doc.get("runs", [])
                             if r.get("foreign_cores_before") is not None)
            lines.append(f"Velox with {st['velox_workers']} workers (batching is per worker), "
                         f"medians of {st['rounds']} rounds of {st['duration_s']} s, modes "
                         "rotated from round to round; wrk, the mock and Velox share the "
                         "machine's cores" + (
                             f"; other people's processes used a median of "
                             f"{foreign[len(foreign) // 2]:.2f} cores just before each run "
                             f"(max {foreign[-1]:.2f})." if foreign else "."))
        if marker in ("e2e", "native"):
            lines.append(f"Placement: {doc['placement']} Medians of {doc['plan']['rounds']} "
                         f"interleaved rounds of {doc['plan']['duration_s']} s.")
        if marker == "native":
            lines += _load_lines(doc)
        if marker == "streamscale" and "load_start" in doc:
            lines.append(f"Load average {doc['load_start'][0]:.2f} at the start of the run and "
                         f"{doc['load'][0]:.2f} at its end; the run took "
                         f"{_n(doc['duration_s'] / 60, 1)} min. Medians over rounds, the "
                         "targets interleaved in each round.")
        if marker == "peers":
            lines += report_peers.intro(doc)
        if marker == "profile":
            lines += report_profile.intro(doc)
    front = docs.get("messages_front")
    if marker == "providers" and front:
        lines.append(f"The Messages API run: {machine_line(front, commit=False)}.")
    if marker == "routing" and docs.get("balance"):
        bal = docs["balance"]
        lines.append(f"\nRoute selection measured {bal['measured_at'][:16].replace('T', ' ')} "
                     f"UTC (load average {bal['loadavg'][0]:.2f}; the machine is shared, so "
                     "medians are inflated: the quiet-machine estimate scales each minimum by "
                     "the reference's known quiet figure).")
    for mk, title, table, plot in secs:
        if mk != marker:
            continue
        lines.append(f"\n#### {title}\n")
        if table:
            lines.append(markdown(table))
        if plot and plot in plots:
            lines.append(f"\n![{title}]({RESULTS_LINK}/{plot})")
    return "\n".join(lines) + "\n"


def _load_lines(doc: dict[str, Any]) -> list[str]:
    """The other load on the machine during a run (the ratios are what survive it)."""
    out = []
    for label, d in (("This run", doc),):
        foreign = sorted(x["foreign_cores"] for x in d.get("runs", [])
                         if x.get("foreign_cores") is not None)
        mid = foreign[len(foreign) // 2] if foreign else None
        m = d["machine"]
        load = d.get("loadavg_start") or m.get("loadavg") or [0.0]
        out.append(f"{label} (ended {m['date'][:16].replace('T', ' ')} "
                   f"UTC): load average {load[0]:.2f} at its start and {m['loadavg'][0]:.2f} at "
                   f"its end; other people's processes used a median of {_n(mid, 2)} of the "
                   f"{m['cores']} cores during its runs." + "".join(
                       f" {n}" for n in d.get("notes", [])))
    return out


def update_readme(readme: Path, blocks: dict[str, str]) -> list[str]:
    """Replace the text between each marker pair; returns the markers found."""
    text = readme.read_text()
    found = []
    for marker, block in blocks.items():
        pattern = re.compile(rf"(<!-- bench:{marker}:start -->)(.*?)(<!-- bench:{marker}:end -->)",
                             re.S)
        if pattern.search(text):
            text = pattern.sub(lambda m: m.group(1) + "\n" + block + m.group(3), text)
            found.append(marker)
    readme.write_text(text)
    return found


def html_page(secs: list, docs: dict[str, Any], plots: set[str]) -> str:
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Velox benchmarks</title>",
             "<style>body{font:14px sans-serif;max-width:1100px;margin:2em auto}table{"
             "border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 7px;"
             "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%}"
             "</style></head><body><h1>Velox benchmarks</h1>"]
    for name, doc in docs.items():
        if doc and name not in ("cluster", "balance", "native_before"):
            parts.append(f"<p><b>{name}</b>: {html.escape(machine_line(doc))}</p>")
    if docs.get("e2e"):
        parts.append(f"<p>{html.escape(docs['e2e']['placement'])}</p>")
        parts += [f"<p>Note: {html.escape(n)}</p>" for n in docs["e2e"].get("notes", [])]
    for _, title, table, plot in secs:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if table:
            parts.append(html_table(table))
        if plot and plot in plots:
            parts.append(f"<img src='{plot}' alt='{html.escape(title)}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _draw(results: Path, docs: dict[str, Any]) -> set[str]:
    """The plots are drawn by benches/e2e/plots.py, next to the benchmarks that made the data."""
    try:
        from benches.e2e import plots
    except ImportError as exc:  # matplotlib missing
        print(f"plots skipped: {exc} (make bench-report installs matplotlib)")
        return set()
    drawn = plots.draw(results, docs["e2e"], docs["micro"], docs["soak"])
    if docs.get("cluster"):
        name = plots.cluster_plot(results, docs["cluster"])
        if name:
            drawn.add(name)
    return drawn


def generate_only(results: Path, readme: Path, markers: Sequence[str]) -> list[str]:
    """Rewrite only the README blocks of `markers` (tables, no plots, no report.html): what a
    single benchmark's make target runs, leaving every other section as it was."""
    docs = load_docs(results)
    secs = sections(docs)
    drawn = {p.name for p in results.glob("*.png")}  # plots already drawn stay linked
    blocks = {m: readme_block(m, secs, docs, drawn) for m in markers if docs.get(m)}
    return update_readme(readme, blocks)


def generate(results: Path, readme: Path | None) -> dict[str, Any]:
    docs = load_docs(results)
    plots = _draw(results, docs)
    secs = sections(docs)
    (results / "report.html").write_text(html_page(secs, docs, plots))
    found: list[str] = []
    if readme is not None and readme.exists():
        blocks = {m: readme_block(m, secs, docs, plots)
                  for m in MARKERS if docs.get(m) or (m == "routing" and docs["balance"])}
        found = update_readme(readme, blocks)
    return {"plots": sorted(plots), "readme_markers": found, "html": str(results / "report.html")}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benches.report")
    p.add_argument("--results", type=Path, default=Path("benches/results"))
    p.add_argument("--readme", type=Path, default=DOC,
                   help="the Markdown page whose bench:* blocks are rewritten")
    p.add_argument("--no-readme", action="store_true")
    p.add_argument("--only", help="comma-separated README markers to rewrite (tables only; "
                   "no plots, no report.html), e.g. batching")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        print(f"no results directory at {args.results} (run from the repository root)")
        return 2
    if args.only:
        found = generate_only(args.results, args.readme, args.only.split(","))
        print(f"README sections updated: {', '.join(found) or 'none'}")
        return 0
    out = generate(args.results, None if args.no_readme else args.readme)
    print(f"wrote {out['html']} and {len(out['plots'])} plot(s); README sections updated: "
          f"{', '.join(out['readme_markers']) or 'none (no markers found)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
