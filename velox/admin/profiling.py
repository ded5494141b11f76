"""CPU profiles of the workers' event loops with pyinstrument: taking, merging and rendering.

Worker side (`WorkerProfile`): started from the control channel's callback, so pyinstrument's
profile hook is installed on the thread that runs the event loop, the one serving requests.
`async_mode="disabled"` because nothing awaits on the hot path (uvloop calls the protocols'
callbacks directly); with it, every callback's stack is recorded as it is. When the time is up
the session is compacted (identical stacks summed into one record: the tree and every
aggregate view are unchanged, only the timeline is lost, which a merged profile has no use for)
and the thread's frame is renamed so that the sessions of several workers merge into one tree.

Supervisor side: `parse_params` validates the query, `merge` joins the workers' sessions with
`Session.combine`, and `render` produces html (pyinstrument's page), speedscope JSON, text or
an SVG flamegraph (`flamegraph.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyinstrument.session import Session

# pyinstrument is an extra (`velox[profile]`, in the dev extra too): serving does not need it.
MISSING = ("profiling needs pyinstrument, which is not installed: pip install 'velox[profile]' "
           "and restart the gateway")
DEFAULT_SECONDS = 10.0
MAX_SECONDS = 60.0
# pyinstrument's hook runs on every call and return whatever the interval; that, not the
# sampling, is most of its cost (about 3x the CPU per request while it runs, measured on the
# socket-free pipeline: 25 → 76 µs at 1 ms, 80 µs at 0.2 ms). 0.5 ms buys finer detail on the
# cheap stages for a few percent more.
INTERVAL_S = 0.0005
FORMATS = {
    "html": "text/html; charset=utf-8",
    "speedscope": "application/json",
    "text": "text/plain; charset=utf-8",
    "svg": "image/svg+xml",
}
# Text view: drop frames under this share of the total. pyinstrument's default (1%) hides the
# cheap stages (the rate limiter's one call per batch is ~0.1%), and those are worth seeing.
TEXT_THRESHOLD = 0.0002
_THREAD_FILE = "<thread>"


def available() -> bool:
    """pyinstrument can be imported (by this process, and so by the workers it forks)."""
    try:
        import pyinstrument  # noqa: F401 - imported only to know it is there
    except ImportError:
        return False
    return True


class BadParams(ValueError):
    """A query parameter is invalid; the message says which and what is accepted."""


@dataclass(frozen=True)
class ProfileParams:
    seconds: float
    fmt: str
    worker: int | None


def _one(query: dict[str, list[str]], name: str) -> str | None:
    values = query.get(name)
    if not values:
        return None
    if len(values) > 1:
        raise BadParams(f"'{name}' is given more than once")
    return values[0]


def parse_format(query: dict[str, list[str]]) -> str:
    fmt = (_one(query, "format") or "html").lower()
    if fmt not in FORMATS:
        raise BadParams(f"format={fmt!r} is not one of " + ", ".join(FORMATS))
    return fmt


def parse_params(query: dict[str, list[str]], workers: int) -> ProfileParams:
    raw = _one(query, "seconds")
    seconds = DEFAULT_SECONDS
    if raw is not None:
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not (0 < seconds <= MAX_SECONDS):
            raise BadParams(f"seconds={raw!r} must be a number in (0, {MAX_SECONDS:g}]")
    fmt = parse_format(query)
    worker = None
    raw = _one(query, "worker")
    if raw is not None:
        if not raw.isdigit() or int(raw) >= workers:
            raise BadParams(f"worker={raw!r} must be a worker number from 0 to {workers - 1}")
        worker = int(raw)
    return ProfileParams(seconds, fmt, worker)


# --- worker side ---------------------------------------------------------------------------


class WorkerProfile:
    """A running profile of the calling thread (the worker's event loop)."""

    def __init__(self, description: str) -> None:
        from pyinstrument import Profiler

        self.profiler = Profiler(interval=INTERVAL_S, async_mode="disabled")
        self.profiler.start(target_description=description)

    def stop(self) -> dict[str, Any]:
        return compact(self.profiler.stop())


def compact(session: Session) -> dict[str, Any]:
    """The session as JSON, identical stacks summed, the thread frame made worker-neutral."""
    totals: dict[tuple[str, ...], float] = {}
    for frames, elapsed in session.frame_records:
        stack = frames
        if stack:
            head = stack[0].split("\x00")
            if len(head) == 3 and head[1] == _THREAD_FILE:
                # "<name>\0<thread>\0<ident>": the ident differs per process; drop it so the
                # workers' trees join at their root.
                stack = [f"{head[0]}\x00{_THREAD_FILE}\x000", *stack[1:]]
        key = tuple(stack)
        totals[key] = totals.get(key, 0.0) + elapsed
    doc: dict[str, Any] = session.to_json(include_frame_records=False)  # pyinstrument: untyped
    doc["frame_records"] = [[list(stack), elapsed] for stack, elapsed in totals.items()]
    return doc


# --- supervisor side -----------------------------------------------------------------------


def merge(docs: list[dict[str, Any]]) -> Session:
    from pyinstrument.session import Session

    sessions: list[Session] = [Session.from_json(doc) for doc in docs]
    merged = sessions[0]
    for other in sessions[1:]:
        merged = Session.combine(merged, other)
    if len(sessions) > 1:  # combine() keeps the first session's "velox worker K (pid P)"
        merged.target_description = (f"{len(sessions)} velox workers merged: "
                                     + "; ".join(s.target_description for s in sessions))
    # pyinstrument builds its tree as a timeline, joining a record only to the one before it;
    # sorted records put equal call paths side by side, so every view gets one box per path.
    merged.frame_records.sort(key=lambda record: record[0])
    return merged


def render(session: Session, fmt: str, title: str = "Velox CPU profile") -> bytes:
    if fmt == "html":
        from pyinstrument.renderers import HTMLRenderer

        page: str = HTMLRenderer().render(session)  # pyinstrument's renderers: untyped
        return page.encode()
    if fmt == "speedscope":
        from pyinstrument.renderers import SpeedscopeRenderer

        # speedscope.app is itself interactive: give it every frame, not pyinstrument's 1% cut.
        page = SpeedscopeRenderer(processor_options={"filter_threshold": 0.0}).render(session)
        return page.encode()
    if fmt == "text":
        from pyinstrument.renderers import ConsoleRenderer

        page = ConsoleRenderer(unicode=True, color=False,
                               processor_options={"filter_threshold": TEXT_THRESHOLD}
                               ).render(session)
        return page.encode()
    if fmt == "svg":
        from velox.admin.flamegraph import flamegraph_svg

        return flamegraph_svg(session.root_frame(), title=title,
                              subtitle=_subtitle(session)).encode()
    raise BadParams(f"unknown format {fmt!r}")


def _subtitle(session: Session) -> str:
    return (f"{session.sample_count} samples, {session.duration:.1f} s of event-loop time "
            f"summed over the profiled workers")
