"""Python frames per request on the socket-free pipeline: a count, not a time.

The end-to-end A/B on a shared 2-core host resolves about ±5–10 % per request, and the
socket-free one (pipeline_ab.py) about ±0.5 us; a step that costs one Python call (0.1–0.3 us)
is below both. This counts instead: every Python function entered and every C function called
(sys.setprofile) while the pipeline of each tree sends its requests (client read -> upstream
frames) and relays the answers (upstream read -> client write), per request, and lists the
Python frames of each phase with their count per request. The harness's own frames (the fake
loop, the canned upstream reads) are left out. Deterministic, so a step removed shows exactly.

    python -m benches.frames main=../main-checkout this=. [--clients 1,64] [--env VELOX_SPEND=0]

One tree is enough (NAME=PATH); with several, the first is the reference. Trees are loaded as
pipeline_ab.py loads them (a checkout with its native extension built in place).
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from typing import Any

from benches.pipeline_ab import load

_HARNESS = ("velox_lab/pipeline.py", "benches/")
_ROUNDS = 40


def census(pipeline: Any, phase: str) -> tuple[collections.Counter[str], collections.Counter[str]]:
    """Python frames and C calls of `phase` ("send" or "answer") over _ROUNDS rounds."""
    python: collections.Counter[str] = collections.Counter()
    native: collections.Counter[str] = collections.Counter()

    def seen(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            where = code.co_filename.replace("\\", "/")
            if not any(h in where for h in _HARNESS):
                name = where.rpartition("velox/")[2] if "velox/" in where else where
                python[f"{name.rpartition('/')[2]}:{code.co_qualname}"] += 1
        elif event == "c_call":
            native[getattr(arg, "__qualname__", str(arg))] += 1

    run, other = (pipeline.send_requests, pipeline.answer_streams) if phase == "send" else \
        (pipeline.answer_streams, pipeline.send_requests)
    for _ in range(_ROUNDS):
        if phase == "answer":
            other()
        _profiled(run, seen)
        if phase == "send":
            other()
    native.pop("setprofile", None)
    return python, native


def _profiled(run: Callable[[], None], hook: Callable[[Any, str, Any], None]) -> None:
    sys.setprofile(hook)
    try:
        run()
    finally:
        sys.setprofile(None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", help="NAME=PATH, the first is the reference")
    ap.add_argument("--clients", default="1,64")
    ap.add_argument("--codec", default="native")
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--top", type=int, default=60, help="frames listed per phase")
    args = ap.parse_args(argv)
    env = dict(e.split("=", 1) for e in args.env)
    for clients in (int(c) for c in args.clients.split(",")):
        reference: dict[str, float] = {}
        for spec in args.trees:
            name, _, root = spec.partition("=")
            pipeline, _ = load(root, clients, args.codec, env)
            n = _ROUNDS * clients
            for phase in ("send", "answer"):
                python, native = census(pipeline, phase)
                frames, calls = sum(python.values()) / n, sum(native.values()) / n
                key = f"{phase}"
                delta = "" if key not in reference else \
                    f" (vs {args.trees[0].partition('=')[0]}: {frames - reference[key]:+.2f})"
                reference.setdefault(key, frames)
                print(f"\n{name}, {clients} client(s), {phase}: {frames:.2f} Python frames and "
                      f"{calls:.2f} C calls per request{delta}")
                for frame, count in python.most_common(args.top):
                    print(f"  {count / n:6.2f}  {frame}")


if __name__ == "__main__":
    main()
