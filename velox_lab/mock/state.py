"""Counters, the request log and the `/_mock/*` control endpoints of the mock upstream.

Shared by the HTTP/1.1 and HTTP/2 shells: `MockState.handle` records a fully received request
and returns the `Plan` to execute. Numeric counters live in a shared memory block with one row
per worker process, so with `--workers N` every worker answers `/_mock/stats` with totals over
all workers; `/_mock/reset` stores a baseline instead of zeroing other processes' rows (no
cross-process write races). The request log (`/_mock/requests`) and by_path entries for paths
outside the API routes are kept per process.

Each `/_mock/requests` entry says which mock answered (`instance`, from `--name`) and what it
received: `path` (the request target as received, query included, as it always was) and
`query` (the part after '?', "" without one), the body's `model`, the Azure
`deployment` from the path, `auth` = {`kind`: "authorization" | "api-key" | "x-api-key" |
"x-goog-api-key" | "sigv4" (the access key id is fingerprinted) | "both" | None, `key_sha256`:
`fingerprint(credential)`}, `inputs` (an embeddings call's input
items, 0 for other calls), plus the raw `headers` as before (tests of the gateway's header
forwarding compare them; the mock only ever sees test keys).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import time
from collections import deque
from urllib.parse import parse_qs

import orjson

from . import fingerprint
from .behaviour import Defaults, Plan, error_plan, plan_request

FIELDS = ("requests", "h2_streams", "h1_requests", "connections", "open_connections",
          "streams_cancelled", "streams_completed", "streams_refused", "bytes_received",
          "goaways_sent", "faults_injected")
(REQUESTS, H2_STREAMS, H1_REQUESTS, CONNECTIONS, OPEN_CONNECTIONS, CANCELLED, COMPLETED,
 REFUSED, BYTES_RECEIVED, GOAWAYS_SENT, FAULTS) = range(len(FIELDS))
# Paths with a shared counter slot; others are counted per process.
ROUTE_PATHS = (b"/v1/chat/completions", b"/v1/completions", b"/v1/embeddings",
               b"/v1/responses", b"/v1/models", b"/v1/messages")
_ROUTE_SLOT = {path: len(FIELDS) + i for i, path in enumerate(ROUTE_PATHS)}
ROW = len(FIELDS) + len(ROUTE_PATHS)
LOG_SIZE = 1000

# Request log record layout (a list, cheap to build per request); index names:
R_TIME, R_PROTO, R_METHOD, R_TARGET, R_HEADERS, R_LEN, R_SHA, R_STREAM, R_CANCELLED, \
    R_STATUS, R_FAULT, R_ID, R_MODEL, R_DEPLOYMENT, R_INPUTS = range(15)


# Azure's, Anthropic's, Gemini's key headers.
_KEY_HEADERS = {b"api-key": "api-key", b"x-api-key": "x-api-key",
                b"x-goog-api-key": "x-goog-api-key"}


def auth_of(headers: list[tuple[bytes, bytes]]) -> dict:
    """How a request authenticated: `kind` ("authorization", "api-key" (Azure), "x-api-key"
    (Anthropic), "x-goog-api-key" (Gemini), "sigv4" (Bedrock), "both" or None) and the fingerprint
    of the credential (the key header's value,
    else the bearer token)."""
    api_key = bearer = key_kind = None
    for name, value in headers:
        if name in _KEY_HEADERS:
            api_key, key_kind = value.strip(), _KEY_HEADERS[name]
        elif name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme == b"AWS4-HMAC-SHA256":  # SigV4 (Bedrock): the access key id signed
                key_id = token.partition(b"Credential=")[2].partition(b"/")[0]
                return {"kind": "sigv4", "key_sha256": fingerprint(key_id)}
            bearer = token.strip() if scheme.lower() == b"bearer" else value.strip()
    if api_key is None and bearer is None:
        return {"kind": None, "key_sha256": None}
    kind = "both" if api_key is not None and bearer is not None else (
        key_kind if api_key is not None else "authorization")
    return {"kind": kind, "key_sha256": fingerprint(api_key if api_key is not None else bearer)}


class SharedCounters:
    """`workers` rows of int64 counters plus a reset baseline, in memory shared across fork."""

    def __init__(self, workers: int = 1) -> None:
        self.workers = workers
        self._mem = mmap.mmap(-1, 2 * workers * ROW * 8)
        self._all = memoryview(self._mem).cast("q")
        self.row = self._all[0:ROW]

    def select(self, worker: int) -> None:
        self.row = self._all[worker * ROW:(worker + 1) * ROW]

    def totals(self) -> list[int]:
        live, base = self._all, self.workers * ROW
        out = [0] * ROW
        for w in range(self.workers):
            for i in range(ROW):
                out[i] += live[w * ROW + i] - live[base + w * ROW + i]
        return out

    def reset(self) -> None:
        base = self.workers * ROW
        for i in range(base):
            if i % ROW != OPEN_CONNECTIONS:  # a gauge, not a counter
                self._all[base + i] = self._all[i]


class MockState:
    """Per-process server state; see the module docstring."""

    def __init__(self, defaults: Defaults, *, max_concurrent_streams: int = 1000,
                 goaway_after: int = 0, h2_allowed: bool = True,
                 counters: SharedCounters | None = None, name: str = "mock") -> None:
        self.defaults = defaults
        self.name = name  # --name: tells the log entries of several mocks apart
        self.max_concurrent_streams = max_concurrent_streams
        self.goaway_after = goaway_after
        self.h2_allowed = h2_allowed
        self.counters = counters or SharedCounters(1)
        self.other_paths: dict[bytes, int] = {}
        self.log: deque[list] = deque(maxlen=LOG_SIZE)
        self.connections: set = set()  # live protocol objects, for shutdown
        # Set by POST /_mock/behaviour: control headers applied to every request that does not
        # carry its own, so a test can make one of several mocks fail, slow down or recover
        # without touching the gateway's clients. Per process (tests run one worker).
        self.overrides: list[tuple[bytes, bytes]] = []

    # -- accounting -----------------------------------------------------------------------

    def connection_opened(self, proto: object) -> None:
        row = self.counters.row
        row[CONNECTIONS] += 1
        row[OPEN_CONNECTIONS] += 1
        self.connections.add(proto)

    def connection_closed(self, proto: object, control: bool) -> None:
        self.connections.discard(proto)
        if not control:
            self.counters.row[OPEN_CONNECTIONS] -= 1

    def mark_control(self) -> None:
        """A connection whose first request is `/_mock/*` is not counted as traffic."""
        row = self.counters.row
        row[CONNECTIONS] -= 1
        row[OPEN_CONNECTIONS] -= 1

    def completed(self) -> None:
        self.counters.row[COMPLETED] += 1

    def cancelled(self, record: list | None) -> None:
        self.counters.row[CANCELLED] += 1
        if record is not None:
            record[R_CANCELLED] = time.time()  # when the reset arrived, for cancel latency

    def count(self, field: int, n: int = 1) -> None:
        self.counters.row[field] += n

    # -- requests -------------------------------------------------------------------------

    def handle(self, proto: str, method: bytes, target: bytes, headers: list,
               body: bytes) -> tuple[Plan, list | None]:
        """Plan the response to a complete request; the record is None for control calls."""
        path = target.partition(b"?")[0]
        if path[:7] == b"/_mock/":
            return self._control(method, path, target), None
        row = self.counters.row
        row[REQUESTS] += 1
        row[H2_STREAMS if proto == "h2" else H1_REQUESTS] += 1
        if body:
            row[BYTES_RECEIVED] += len(body)
        slot = _ROUTE_SLOT.get(path)
        if slot is not None:
            row[slot] += 1
        else:
            self.other_paths[path] = self.other_paths.get(path, 0) + 1
        if self.overrides:
            # Overrides first: a header the request carries itself comes later and wins.
            headers = self.overrides + headers
        plan = plan_request(method, target, headers, body, self.defaults)
        if plan.fault is not None:
            row[FAULTS] += 1
        record = [time.time(), proto, method, target, headers, len(body),
                  hashlib.sha256(body).digest(), plan.stream, False, plan.status, plan.fault,
                  plan.dynamic[0][1] if plan.dynamic else None, plan.model, plan.deployment,
                  plan.inputs]
        self.log.append(record)
        return plan, record

    def _control(self, method: bytes, path: bytes, target: bytes) -> Plan:
        if method == b"GET" and path == b"/_mock/stats":
            return _json_plan(self.stats())
        if method == b"GET" and path == b"/_mock/requests":
            query = parse_qs(target.partition(b"?")[2].decode("latin-1"))
            try:
                limit = int(query.get("limit", ["100"])[0])
            except ValueError:
                return error_plan(400, "limit must be an integer", param="limit")
            return _json_plan(self.requests(limit))
        if method == b"POST" and path == b"/_mock/behaviour":
            return self._behaviour(target)
        if method == b"GET" and path == b"/_mock/behaviour":
            return _json_plan(self._overrides_dict())
        if method == b"POST" and path == b"/_mock/reset":
            self.reset()
            return _json_plan({"ok": True})
        return error_plan(404, f"Unknown mock control endpoint {path.decode('latin-1')}")

    def _behaviour(self, target: bytes) -> Plan:
        """POST /_mock/behaviour?status=503&latency-ms=100&fault=hang...: each query parameter
        NAME becomes the control header x-mock-NAME for every later request (validated like the
        headers are); no parameters restores normal answers."""
        query = parse_qs(target.partition(b"?")[2].decode("latin-1"))
        overrides = [(b"x-mock-" + name.encode(), values[-1].encode())
                     for name, values in sorted(query.items())]
        probe = plan_request(b"GET", b"/v1/models", overrides, b"", self.defaults)
        if probe.status == 400:  # an invalid value: say so, keep the current behaviour
            return probe
        self.overrides = overrides
        return _json_plan(self._overrides_dict())

    def _overrides_dict(self) -> dict:
        return {name[7:].decode(): value.decode() for name, value in self.overrides}

    def stats(self) -> dict:
        totals = self.counters.totals()
        out: dict = {name: totals[i] for i, name in enumerate(FIELDS)}
        by_path = {p.decode("latin-1"): n for p, n in self.other_paths.items()}
        for path, slot in _ROUTE_SLOT.items():
            if totals[slot]:
                by_path[path.decode()] = by_path.get(path.decode(), 0) + totals[slot]
        out["by_path"] = by_path
        out["workers"] = self.counters.workers
        out["pid"] = os.getpid()
        out["name"] = self.name
        return out

    def requests(self, limit: int) -> list[dict]:
        limit = max(0, min(limit, LOG_SIZE))
        records = list(self.log)[-limit:] if limit else []
        return [{
            "instance": self.name, "time": r[R_TIME], "protocol": r[R_PROTO],
            "method": r[R_METHOD].decode("latin-1"),
            "path": r[R_TARGET].decode("latin-1"),  # as received: with its query, if any
            "query": r[R_TARGET].partition(b"?")[2].decode("latin-1"),
            "model": r[R_MODEL], "deployment": r[R_DEPLOYMENT], "auth": auth_of(r[R_HEADERS]),
            "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in r[R_HEADERS]],
            "body_length": r[R_LEN], "body_sha256": r[R_SHA].hex(), "stream": r[R_STREAM],
            "cancelled": bool(r[R_CANCELLED]), "cancelled_at": r[R_CANCELLED] or None,
            "status": r[R_STATUS], "fault": r[R_FAULT],
            "request_id": r[R_ID].decode() if r[R_ID] else None,
            "inputs": r[R_INPUTS],  # embeddings: input items of the call (0 otherwise)
        } for r in records]

    def reset(self) -> None:
        self.counters.reset()
        self.other_paths.clear()
        self.log.clear()


def _json_plan(obj: object) -> Plan:
    return Plan(200, ((b"content-type", b"application/json"), (b"cache-control", b"no-store")),
                [], body=orjson.dumps(obj))
