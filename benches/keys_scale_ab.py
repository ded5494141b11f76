"""The keys stage (lookup, checks, admit, ticket) per request at 10, 10,000 and 100,000 keys,
for an interleaved before/after: run it with each checkout first on PYTHONPATH, in turns.

Keys are run-time keys (as a worker applies a control frame), each with rpm, tpm and
max_parallel so large nothing is refused; a batch of 64 requests presents 64 different keys
spread over the table (every 7,919th), so lookups and admissions touch many segments. A
checkout whose key table cannot hold N keys prints "n/a" for N.

    python benches/keys_scale_ab.py            # median ns per request, one line per N
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from typing import Any

from velox.admission.keys import KeyStage
from velox.admission.runtime import spec_of
from velox.config.settings import load
from velox.core.types import Kind, Request
from velox.state.keys import SharedKeys
from velox_lab.pipeline import CHAT_BODY

BATCH = 64
ROUNDS = 400
BIG = 10**9


class _Conn:
    closed = False
    write_paused = False

    def respond_error(self, request: Request, exc: BaseException) -> None:
        raise AssertionError(f"refused in a benchmark: {exc}")


def stage_with(keys: int) -> tuple[KeyStage, list[bytes]] | None:
    settings = load({"VELOX_UPSTREAM_ORIGIN": "https://upstream.invalid"}, dotenv=None)
    shared = SharedKeys(settings.tables.keys, slots=2)
    stage = KeyStage(settings.tables, shared, 0)
    live: dict[bytes, Any] = {}
    for i in range(keys):
        index = shared.claim(f"rt{i}")
        if index is None:
            return None
        shared.set_limits(index, BIG, BIG)
        digest = hashlib.sha256(b"key-%d" % i).digest()
        row = {"name": f"rt{i}", "sha256": digest.hex(), "rpm": BIG, "tpm": BIG,
               "max_parallel": 10**6, "models": None}
        live[digest] = stage.runtime_key(index, spec_of(row))
    stage.use_runtime(live)
    digests = list(live)
    return stage, [digests[(i * 7919) % keys] for i in range(BATCH)]


def batch(digests: list[bytes]) -> list[Request]:
    out = []
    for digest in digests:
        request = Request(_Conn(), b"POST", b"/v1/chat/completions",  # type: ignore[arg-type]
                          Kind.MODEL_CALL, [], CHAT_BODY, True, 0)
        request.model = "gpt-4o-mini"
        request.caller = digest  # as ingress leaves it: the digest the auth check made
        out.append(request)
    return out


def measure(keys: int) -> float | None:
    made = stage_with(keys)
    if made is None:
        return None
    stage, digests = made
    samples = []
    for _ in range(ROUNDS):
        requests = batch(digests)
        start = time.perf_counter_ns()
        for request in stage.run(requests):
            ticket = request.ticket
            ticket.settle(10)
            ticket.release()
        samples.append((time.perf_counter_ns() - start) / BATCH)
    return statistics.median(samples)


if __name__ == "__main__":
    for n in [int(a) for a in sys.argv[1:]] or [10, 10_000, 100_000]:
        ns = measure(n)
        print(f"{n:>7} keys: " + ("n/a" if ns is None else f"{ns:.0f} ns per request"),
              flush=True)
