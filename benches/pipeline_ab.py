"""A/B of the socket-free pipeline's Python per request between source trees, in one process.

Each tree (a checkout with its native extension built in place) is imported under the same
package names one after the other: its modules are kept aside and put back in `sys.modules`
while its pipeline runs, so lazy imports resolve to the right tree. Blocks of rounds alternate
between the trees (the order flips every block) and each block is timed on the thread CPU
clock, so a host busy with other work slows every tree alike; the median block is reported,
for the whole round and for its two phases (client request -> upstream frames, upstream
answer -> client).

    python -m benches.pipeline_ab before=../old-checkout after=. [--codec native] [--blocks 15]
        [--env VELOX_SPEND=0 ...]

The first tree is the reference for the deltas. Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("velox", "velox_lab", "benches")


def _harness(root: str) -> Any:
    """The tree's socket-free pipeline module: velox_lab.pipeline, or benches._pipeline in a
    tree from before the lab had its own package."""
    if (Path(root) / "velox_lab" / "pipeline.py").is_file():
        from velox_lab import pipeline
    else:
        from benches import _pipeline as pipeline  # type: ignore[no-redef]
    return pipeline


def load(root: str, clients: int, codec: str,
         env: dict[str, str] | None = None) -> tuple[Any, dict[str, Any]]:
    """The warmed pipeline of the tree at `root`, and that tree's modules."""
    for name in [n for n in sys.modules if _ours(n)]:
        del sys.modules[name]
    root = str(Path(root).resolve())
    sys.path.insert(0, root)
    try:
        harness = _harness(root)
        if not str(Path(harness.__file__).resolve()).startswith(root):
            raise SystemExit(f"{root}: imported {harness.__file__} instead")
        pipeline = harness.Pipeline(clients=clients, codec=codec, **(env or {}))
        for _ in range(50):
            pipeline.round()
    finally:
        sys.path.remove(root)
    return pipeline, {n: m for n, m in sys.modules.items() if _ours(n)}


def load_all(args: argparse.Namespace) -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, warmed pipeline, modules) of every tree, then the heap frozen."""
    variants = []
    for spec in args.trees:
        name, _, root = spec.partition("=")
        variants.append((name, *load(root, args.clients, args.codec,
                                     dict(e.split("=", 1) for e in args.env))))
    gc.collect()
    gc.freeze()
    return variants


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trees", nargs="+", help="NAME=PATH, the first is the reference")
    ap.add_argument("--codec", default="native")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=15)
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of every tree's pipeline (e.g. VELOX_SPEND=0)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds per block")
    ap.add_argument("--stream", type=int, default=0, metavar="EVENTS",
                    help="streamed answers of EVENTS events instead (Pipeline.stream_round); "
                         "the figure is per relayed event, request and answer head included")
    args = ap.parse_args(argv)
    if args.stream:
        stream_ab(args)
        return
    variants = load_all(args)
    n = args.clients * args.rounds
    runs: dict[str, dict[str, list[float]]] = {
        name: {"round": [], "send": [], "answer": []} for name, _, _ in variants}
    for block in range(args.blocks):
        for name, pipeline, modules in variants if block % 2 == 0 else variants[::-1]:
            sys.modules.update(modules)
            send = answer = 0.0
            for _ in range(args.rounds):
                t0 = time.thread_time()
                pipeline.send_requests()
                t1 = time.thread_time()
                pipeline.answer_streams()
                t2 = time.thread_time()
                send += t1 - t0
                answer += t2 - t1
            assert pipeline.worker.in_flight == 0
            run = runs[name]
            run["send"].append(send / n * 1e6)
            run["answer"].append(answer / n * 1e6)
            run["round"].append((send + answer) / n * 1e6)
    reference = None
    for name, _, _ in variants:
        med = {k: statistics.median(v) for k, v in runs[name].items()}
        reference = reference or med
        print(f"{name:>12}: {med['round']:6.2f} us/request (send {med['send']:5.2f}, "
              f"answer {med['answer']:5.2f}); vs {variants[0][0]}: "
              f"{med['round'] - reference['round']:+5.2f} (send "
              f"{med['send'] - reference['send']:+5.2f}, answer "
              f"{med['answer'] - reference['answer']:+5.2f})")


def stream_ab(args: argparse.Namespace) -> None:
    """Thread CPU per relayed event of each tree, blocks alternating as in main."""
    variants = load_all(args)
    n = args.clients * args.rounds * args.stream
    runs: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for block in range(args.blocks):
        for name, pipeline, modules in variants if block % 2 == 0 else variants[::-1]:
            sys.modules.update(modules)
            t0 = time.thread_time()
            for _ in range(args.rounds):
                pipeline.stream_round(args.stream)
            runs[name].append((time.thread_time() - t0) / n * 1e6)
            assert pipeline.worker.in_flight == 0
    reference = statistics.median(runs[variants[0][0]])
    for name, _, _ in variants:
        med = statistics.median(runs[name])
        print(f"{name:>12}: {med:6.3f} us/event; vs {variants[0][0]}: {med - reference:+6.3f} "
              f"({med / reference:.3f}x)")


if __name__ == "__main__":
    main()
