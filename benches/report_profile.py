"""The "Where Velox's time goes" tables of docs/benchmarks.md, from benches/results/profile.json
(`python -m benches.e2e.profile --conns 1,64`): the busiest worker's CPU under wrk, by request
stage (py-spy's non-idle samples, each given to the first stage found from the innermost frame
out), by shared object (perf), and the innermost Python frames that hold the most samples.
Shares, not times: the host is shared and its load moves absolute figures."""

from __future__ import annotations

from typing import Any

Table = tuple[list[str], list[list[str]]]

# perf's shared objects by what they are (the first prefix that matches names a row); the
# extension modules' file names carry their ABI tag, so prefixes.
OBJECTS = (("libpython", "the Python interpreter"), ("[kernel", "the kernel"),
           ("libcrypto", "OpenSSL"), ("libssl", "OpenSSL"), ("loop.", "uvloop"),
           ("_native.", "Velox's native core"), ("libc.", "the C library"),
           ("orjson.", "orjson"), ("parser.", "httptools"), ("url_parser.", "httptools"))
OTHERS = "the rest (objects under 0.5% each, and other objects)"
TOP_FRAMES = 10  # innermost frames listed per connection count


def _pct(share: float | None) -> str:
    return "–" if share is None else f"{share:.0%}"


def _counts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(doc["results"], key=lambda r: r["conns"])


def _column(result: dict[str, Any]) -> str:
    n = result["conns"]
    return f"{n} connection{'s' if n != 1 else ''}"


def _shares(result: dict[str, Any], tool: str) -> dict[str, float]:
    part = result.get(tool)
    return part.get("shares", {}) if isinstance(part, dict) else {}


def table_stages(doc: dict[str, Any]) -> Table:
    """Each stage's share of the sampled worker's non-idle Python samples, largest first at
    the highest connection count."""
    results = _counts(doc)
    stages: dict[str, None] = {}
    for result in reversed(results):
        stages.update(dict.fromkeys(sorted(_shares(result, "py_spy"),
                                           key=lambda k, r=result: -_shares(r, "py_spy")[k])))
    rows = [[stage, *(_pct(_shares(r, "py_spy").get(stage)) for r in results)]
            for stage in stages]
    return ["stage (py-spy)", *(_column(r) for r in results)], rows


def object_name(dso: str) -> str:
    return next((name for prefix, name in OBJECTS if dso.startswith(prefix)), OTHERS)


def table_objects(doc: dict[str, Any]) -> Table:
    """The sampled worker's CPU by shared object (perf), objects of one kind summed."""
    results = _counts(doc)
    grouped = []
    for result in results:
        sums: dict[str, float] = {}
        for dso, share in _shares(result, "perf").items():
            name = object_name(dso)
            sums[name] = sums.get(name, 0.0) + share
        if sums:  # what perf's report left under its 0.5% cut, with the rest
            sums[OTHERS] = sums.get(OTHERS, 0.0) + max(0.0, 1.0 - sum(sums.values()))
        grouped.append(sums)
    names = sorted({n for sums in grouped for n in sums},
                   key=lambda n: (n == OTHERS, -grouped[-1].get(n, 0.0)))
    rows = [[name, *(_pct(sums.get(name)) for sums in grouped)] for name in names]
    return ["shared object (perf)", *(_column(r) for r in results)], rows


def frame_name(frame: str) -> str:
    """py-spy's "function (file:line)" with the file from the package on (a module of the
    standard library by its name alone): no directory of the machine that ran it."""
    name, _, where = frame.partition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    inside = path.rpartition("velox/")[2]
    path = "velox/" + inside if "velox/" in path else path.rpartition("/")[2]
    return f"{name} ({path}:{line})" if where else name


def table_frames(doc: dict[str, Any]) -> Table:
    """The innermost Python frames holding the most samples, per connection count."""
    results = _counts(doc)
    head = []
    columns = []
    for result in results:
        py = result.get("py_spy")
        top = list(py.get("top_frames", {}).items())[:TOP_FRAMES] if isinstance(py, dict) else []
        head += [f"innermost frame, {_column(result)}", "share"]
        columns.append([(frame_name(f), _pct(s)) for f, s in top])
    rows = []
    for i in range(max((len(c) for c in columns), default=0)):
        row: list[str] = []
        for column in columns:
            row += list(column[i]) if i < len(column) else ["", ""]
        rows.append(row)
    return head, rows


def sections(doc: dict[str, Any] | None) -> list[tuple[str, str, Table | None, str | None]]:
    if not doc or not doc.get("results"):
        return []
    out: list[tuple[str, str, Table | None, str | None]] = []
    if any(_shares(r, "py_spy") for r in doc["results"]):
        out.append(("profile", "By stage of the request path (py-spy, non-idle samples)",
                    table_stages(doc), None))
    if any(_shares(r, "perf") for r in doc["results"]):
        out.append(("profile", "By shared object (perf)", table_objects(doc), None))
    if any(_shares(r, "py_spy") for r in doc["results"]):
        out.append(("profile", "Where the Python samples end (py-spy)", table_frames(doc),
                    None))
    return out


def intro(doc: dict[str, Any]) -> list[str]:
    """How the profile was taken, under the machine line."""
    egress = "HTTP/2 + TLS" if doc.get("egress", "h2") == "h2" else "cleartext HTTP/1.1"
    settings = ", ".join(doc.get("settings") or []) or "the defaults (the access log on)"
    load = doc.get("loadavg_start")
    out = [f"`python -m benches.e2e.profile`: a 2-worker Velox in front of the TLS mock "
           f"(upstream {egress}), wrk at each connection count, the busiest worker sampled "
           f"for {doc.get('seconds', 8) / 2:g} s by perf and as long by py-spy; settings: "
           f"{settings}."]
    for r in _counts(doc):
        out.append(f"{_column(r)}: {r['rps']:,.0f} requests/s in all, the sampled worker "
                   f"{r['worker_user_s']} s user and {r['worker_system_s']} s system CPU"
                   + (f", {r['py_spy']['samples']:,} py-spy samples"
                      if isinstance(r.get("py_spy"), dict) and "samples" in r["py_spy"]
                      else "") + ".")
    if load:
        out.append(f"Load average {load[0]:.2f} at the start and {doc['machine']['loadavg'][0]:.2f}"
                   " at the end: other people's work shares the host, so read the shares, not "
                   "absolute figures.")
    return out
