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


def _by_count(doc: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The profiles by connection count (ascending), each count's rounds together."""
    counts: dict[int, list[dict[str, Any]]] = {}
    for result in doc["results"]:
        counts.setdefault(result["conns"], []).append(result)
    return [counts[n] for n in sorted(counts)]


def _column(rounds: list[dict[str, Any]]) -> str:
    n = rounds[0]["conns"]
    return f"{n} connection{'s' if n != 1 else ''}"


def _shares(result: dict[str, Any], tool: str, part: str = "shares") -> dict[str, float]:
    found = result.get(tool)
    return found.get(part, {}) if isinstance(found, dict) else {}


def _cell(pooled: float | None, each: list[float]) -> str:
    """The pooled share, and with several rounds the range of theirs (a shared host moves
    them)."""
    if pooled is None:
        return "–"
    if len(each) < 2:
        return _pct(pooled)
    return f"{pooled:.0%} ({min(each) * 100:.0f}–{max(each) * 100:.0f})"


def _pooled(rounds: list[dict[str, Any]], part: str) -> dict[str, tuple[float, list[float]]]:
    """py-spy's shares over every round's samples (each round weighted by its samples), with
    each round's own share (0 where a round has none)."""
    samples = [r["py_spy"]["samples"] if _shares(r, "py_spy") else 0 for r in rounds]
    total = sum(samples)
    if not total:
        return {}
    names = {k for r in rounds for k in _shares(r, "py_spy", part)}
    return {k: (sum(_shares(r, "py_spy", part).get(k, 0.0) * n
                    for r, n in zip(rounds, samples, strict=True)) / total,
                [_shares(r, "py_spy", part).get(k, 0.0) for r, n in zip(rounds, samples,
                                                                          strict=True) if n])
            for k in names}


def _ordered(columns: list[dict[str, tuple[float, list[float]]]]) -> list[str]:
    """Names largest first at the highest count, then those seen only at lower ones."""
    names: dict[str, None] = {}
    for column in reversed(columns):
        names.update(dict.fromkeys(sorted(column, key=lambda k, c=column: (-c[k][0], k))))
    return list(names)


def table_stages(doc: dict[str, Any]) -> Table:
    """Each stage's share of the sampled worker's non-idle Python samples, largest first at
    the highest connection count."""
    counts = _by_count(doc)
    columns = [_pooled(rounds, "shares") for rounds in counts]
    rows = [[stage, *(_cell(*c[stage]) if stage in c else "–" for c in columns)]
            for stage in _ordered(columns)]
    return ["stage (py-spy)", *(_column(r) for r in counts)], rows


def object_name(dso: str) -> str:
    return next((name for prefix, name in OBJECTS if dso.startswith(prefix)), OTHERS)


def _objects(result: dict[str, Any]) -> dict[str, float]:
    """One profile's perf shares summed by kind, what perf's 0.5% cut left out with the rest."""
    sums: dict[str, float] = {}
    for dso, share in _shares(result, "perf").items():
        name = object_name(dso)
        sums[name] = sums.get(name, 0.0) + share
    if sums:
        sums[OTHERS] = sums.get(OTHERS, 0.0) + max(0.0, 1.0 - sum(sums.values()))
    return sums


def table_objects(doc: dict[str, Any]) -> Table:
    """The sampled worker's CPU by shared object (perf), objects of one kind summed; with
    several rounds their mean and range."""
    counts = _by_count(doc)
    columns = []
    for rounds in counts:
        each = [o for o in (_objects(r) for r in rounds) if o]
        names = {n for o in each for n in o}
        columns.append({n: (sum(o.get(n, 0.0) for o in each) / len(each),
                            [o.get(n, 0.0) for o in each]) for n in names})
    names = [n for n in _ordered(columns) if n != OTHERS] + \
        ([OTHERS] if any(OTHERS in c for c in columns) else [])
    rows = [[name, *(_cell(*c[name]) if name in c else "–" for c in columns)]
            for name in names]
    return ["shared object (perf)", *(_column(r) for r in counts)], rows


def frame_name(frame: str) -> str:
    """py-spy's "function (file:line)" with the file from the package on (a module of the
    standard library by its name alone): no directory of the machine that ran it."""
    name, _, where = frame.partition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    inside = path.rpartition("velox/")[2]
    path = "velox/" + inside if "velox/" in path else path.rpartition("/")[2]
    return f"{name} ({path}:{line})" if where else name


def table_frames(doc: dict[str, Any]) -> Table:
    """The innermost Python frames holding the most samples, per connection count (over
    every round's samples)."""
    head: list[str] = []
    columns = []
    for rounds in _by_count(doc):
        pooled = _pooled(rounds, "top_frames")
        top = sorted(pooled, key=lambda k, p=pooled: (-p[k][0], k))[:TOP_FRAMES]
        head += [f"innermost frame, {_column(rounds)}", "share"]
        columns.append([(frame_name(f), _pct(pooled[f][0])) for f in top])
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


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def intro(doc: dict[str, Any]) -> list[str]:
    """How the profile was taken, under the machine line."""
    egress = "HTTP/2 + TLS" if doc.get("egress", "h2") == "h2" else "cleartext HTTP/1.1"
    settings = ", ".join(doc.get("settings") or []) or "the defaults (the access log on)"
    counts = _by_count(doc)
    rounds = max(len(r) for r in counts)
    out = [f"`python -m benches.e2e.profile`: a 2-worker Velox in front of the TLS mock "
           f"(upstream {egress}), wrk at each connection count, the busiest worker sampled "
           f"for {doc.get('seconds', 8) / 2:g} s by perf and as long by py-spy"
           + (f", {rounds} rounds with the counts interleaved (a share is over every round's "
              "samples, the range in brackets each round's own)" if rounds > 1 else "")
           + f"; settings: {settings}."]
    for each in counts:
        samples = sum(r["py_spy"].get("samples", 0) for r in each
                      if isinstance(r.get("py_spy"), dict))
        several = len(each) > 1
        out.append(f"{_column(each)}: {_median([r['rps'] for r in each]):,.0f} requests/s in "
                   f"all{' (median of the rounds)' if several else ''}, the sampled worker "
                   f"{_median([r['worker_user_s'] for r in each])} s user and "
                   f"{_median([r['worker_system_s'] for r in each])} s system CPU"
                   + (" a round" if several else "")
                   + (f", {samples:,} py-spy samples" if samples else "") + ".")
    load = doc.get("loadavg_start")
    if load:
        out.append(f"Load average {load[0]:.2f} at the start and {doc['machine']['loadavg'][0]:.2f}"
                   " at the end: other people's work shares the host, so read the shares, not "
                   "absolute figures.")
    return out
