"""Parsing a request body: orjson from the worker's arena vs orjson from fresh bytes vs `json`.

Each contender starts from the body as ingress receives it (a list of chunks: one for the small
payloads, 16 KiB pieces for the large one) and ends holding the parsed document with `model` and
`stream` read, the work the parse stage does:

* arena:        `arena.put(chunks)` copies the chunks into the preallocated arena and returns a
                memoryview, orjson parses the view in place, then `arena.release(segment)` and
                the end-of-batch `arena.reset()` (what ingress and the worker do);
* orjson-bytes: what ingress does without an arena, or when a body does not fit: a body that
                came in one chunk is parsed as received, several chunks are joined into new bytes;
* json:         the same join, parsed with the standard library.

Groups per payload (48 B, 4 KB, 64 KB of chat messages, some non-ASCII). The arena is 1 MiB so
the 64 KB body fits one of its 8 segments; with the default 256 KiB arena (32 KiB segments) a
64 KB body spills to an ordinary buffer, which `spills_with_default_arena` records. The arena
benchmark runs last in each group and records `ratio_vs_<contender>` = contender's median per
parse / arena's (> 1: the arena path is faster).

Run: `.venv/bin/pytest --benchmark benches/bench_parse.py` (the whole file, for the ratios).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from velox.config.settings import DEFAULT_ARENA_BYTES
from velox.ingress.arena import Arena

ARENA_BYTES = 1 << 20
CHUNK = 16 * 1024
SIZES = {"48B": 48, "4KB": 4 * 1024, "64KB": 64 * 1024}
# Parses per timed call, so one call lasts tens of microseconds or more for every size.
LOOPS = {"48B": 500, "4KB": 50, "64KB": 4}
_medians: dict[tuple[str, str], float] = {}


def payload(size: int) -> bytes:
    """A chat request of about `size` bytes (exactly 48 for the smallest)."""
    if size <= 64:
        body = b'{"model":"gpt-4.1","messages":[],"stream":false}'
        assert len(body) == 48
        return body
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    turn = 0
    while True:
        role = "user" if turn % 2 == 0 else "assistant"
        text = (f"Message {turn}: please summarise the résumé of Zoë and 東京 trip notes, "
                "keeping dates, prices (€12.50) and names exactly as written. ")
        messages.append({"role": role, "content": text * 2})
        doc = {"model": "gpt-4o-mini", "messages": messages, "temperature": 0.7, "stream": True}
        body = json.dumps(doc, ensure_ascii=False).encode()
        if len(body) >= size:
            return body
        turn += 1


def chunks_of(body: bytes) -> list[bytes]:
    return [body[i:i + CHUNK] for i in range(0, len(body), CHUNK)]


def _use(doc: Any) -> None:
    doc.get("model")
    doc.get("stream")


def arena_parse(arena: Arena, chunks: list[bytes], loops: int) -> Callable[[], None]:
    put, release, reset, loads = arena.put, arena.release, arena.reset, orjson.loads

    def run() -> None:
        for _ in range(loops):
            placed = put(chunks)
            assert placed is not None
            view, segment = placed
            _use(loads(view))
            release(segment)
            reset()

    return run


def bytes_parse(loads: Callable[[bytes], Any], chunks: list[bytes], loops: int
                ) -> Callable[[], None]:
    join = b"".join

    def run() -> None:
        for _ in range(loops):
            # As ingress does without an arena: a body that came in one piece is parsed as
            # received (no copy at all), a body in several pieces is joined into new bytes.
            body = chunks[0] if len(chunks) == 1 else join(chunks)
            _use(loads(body))

    return run


def _record(benchmark: Any, size: str, who: str) -> None:
    per_parse_us = benchmark.stats.stats.median / LOOPS[size] * 1e6
    _medians[(size, who)] = per_parse_us
    benchmark.extra_info.update({
        "parses_per_call": LOOPS[size], "median_per_parse_us": round(per_parse_us, 3),
        "payload_bytes": len(payload(SIZES[size])), "chunks": len(chunks_of(payload(SIZES[size]))),
    })


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("who", ["json", "orjson-bytes", "arena"])
def test_parse(benchmark: Any, size: str, who: str) -> None:
    benchmark.group = f"parse {size}: per parse"
    body = payload(SIZES[size])
    chunks = chunks_of(body)
    loops = LOOPS[size]
    if who == "arena":
        arena = Arena(ARENA_BYTES)
        fn = arena_parse(arena, chunks, loops)
        default = Arena(DEFAULT_ARENA_BYTES)
        benchmark.extra_info["arena_bytes"] = ARENA_BYTES
        benchmark.extra_info["spills_with_default_arena"] = default.put(chunks) is None
    elif who == "orjson-bytes":
        fn = bytes_parse(orjson.loads, chunks, loops)
    else:
        fn = bytes_parse(json.loads, chunks, loops)
    benchmark(fn)
    _record(benchmark, size, who)
    if who == "arena":
        for other in ("json", "orjson-bytes"):
            if (size, other) in _medians:
                benchmark.extra_info[f"ratio_vs_{other}"] = round(
                    _medians[(size, other)] / _medians[(size, who)], 2)
