"""A stand-in for the worker's end of a request (core.types.Lifecycle) in socket-free tests:
it records each request's end and gives arena segments back."""

from __future__ import annotations

from velox.core.types import ADMITTED, PARSED, SENT, Holder, Request
from velox.ingress.arena import Arena


class RecordingEnds:
    def __init__(self, arena: Arena | None = None) -> None:
        self.arena = arena
        self.answered: list[tuple[int, int]] = []  # (status, bytes_out) per finished request
        self.finished_requests: list[Request] = []
        self.segments: list[int] = []  # arena segments given back

    def release_segment(self, segment: int) -> None:
        self.segments.append(segment)
        if self.arena is not None:
            self.arena.release(segment)

    def finished(self, request: Request, status: int, bytes_out: int,
                 holder: Holder | None) -> None:
        request.release_body()
        self.answered.append((status, bytes_out))
        self.finished_requests.append(request)


def sent(request: Request) -> Request:
    """Move a request the way the worker's stages do before its answer streams (a test that
    plays the pipeline itself)."""
    for state in (PARSED, ADMITTED, SENT):
        request.advance(state)
    return request


class Continued:
    """A stand-in for the worker's pipeline (core.types.Pipeline): records the requests a
    stage continues, which must all go on from the limiter."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    def run(self, requests: list[Request], from_stage: str) -> None:
        assert from_stage == "limit"
        self.requests.extend(requests)
