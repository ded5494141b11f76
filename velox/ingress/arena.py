"""The per-worker request-body arena: one preallocated buffer, bump-allocated, reused.

Ingress copies each complete request body into the arena and hands the stages a memoryview of
it; orjson parses that view in place and the egress codec copies it into its frame buffer, so a
body is never joined, sliced into new bytes or re-serialised on its way through.

A body must stay valid until its request can no longer be retried on another upstream
connection (its response has started or it has failed), which can be later than the end of its
batch. So the arena is split into a few segments, each with a count of the bodies still live
in it: allocation bumps through the current segment, a segment whose count has dropped to zero
is reset and reused, and one long-lived stream pins only its own segment. After a batch the
current segment is reset at once when nothing in it is live, which is the common case. A body
that does not fit (too big, or every segment pinned) falls back to an ordinary buffer.
"""

from __future__ import annotations

SEGMENTS = 8
NO_SEGMENT = -1
_PAGE = 4096


class Arena:
    __slots__ = ("_view", "_segment_bytes", "_live", "_offset", "_current", "spills", "capacity")

    def __init__(self, size: int) -> None:
        self.capacity = size
        buf = bytearray(size)
        # Touch every page now: the worker builds its arena after pinning itself to a core, and
        # first-touch placement then puts these pages on that core's NUMA node.
        buf[0:size:_PAGE] = b"\x00" * len(range(0, size, _PAGE))
        self._view = memoryview(buf)
        self._segment_bytes = size // SEGMENTS
        self._live = [0] * SEGMENTS
        self._offset = 0  # absolute offset of the bump pointer
        self._current = 0
        self.spills = 0

    def put(self, chunks: list[bytes]) -> tuple[memoryview, int] | None:
        """Copy the body chunks into the arena; return (view, segment) or None if it won't fit."""
        size = 0
        for chunk in chunks:
            size += len(chunk)
        start = self._reserve(size)
        if start < 0:
            self.spills += 1
            return None
        view = self._view
        at = start
        for chunk in chunks:
            end = at + len(chunk)
            view[at:end] = chunk
            at = end
        seg = self._current
        self._live[seg] += 1
        return view[start:at], seg

    def _reserve(self, size: int) -> int:
        seg_bytes = self._segment_bytes
        if size > seg_bytes or size == 0:
            return -1
        seg_end = (self._current + 1) * seg_bytes
        if self._offset + size <= seg_end:
            start = self._offset
            self._offset = start + size
            return start
        # The current segment is full: move to the next one that holds no live body.
        live = self._live
        for step in range(1, SEGMENTS + 1):
            seg = (self._current + step) % SEGMENTS
            if live[seg] == 0:
                self._current = seg
                start = seg * seg_bytes
                self._offset = start + size
                return start
        return -1

    def release(self, segment: int) -> None:
        """A body allocated in `segment` is no longer needed."""
        self._live[segment] -= 1

    def reset(self) -> None:
        """End of a batch: rewind the current segment if nothing in it is still live."""
        if self._live[self._current] == 0:
            self._offset = self._current * self._segment_bytes

    @property
    def live(self) -> int:
        return sum(self._live)

    @property
    def used(self) -> int:
        return self._offset - self._current * self._segment_bytes
