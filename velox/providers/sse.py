"""Incremental server-sent-events splitter: bytes in any split -> complete events.

A provider's event stream reaches a translator in whatever pieces the socket reads delivered:
a piece may end mid-line, between the CR and LF of a line ending, or mid-UTF-8 sequence. The
splitter keeps the unfinished line and hands out only complete events, as (event name, data)
pairs; `data` is the event's `data:` lines joined by LF, still bytes (the translator parses
it as JSON, which decodes UTF-8 once the event is whole, so a split sequence never matters).

Line endings are LF, CRLF or a lone CR, as the SSE grammar allows (Gemini ends lines with CRLF;
most others with LF). Comment lines (`:` first) and fields other than `event` and `data` are
dropped; an event without data lines is dropped too, as browsers do.

Imports: stdlib only.
"""

from __future__ import annotations

Event = tuple[bytes, bytes]  # (event name, b"" when none was given; data)


class SSESplitter:
    __slots__ = ("_rest", "_name", "_data")

    def __init__(self) -> None:
        self._rest = b""  # an unfinished line from the previous piece
        self._name = b""
        self._data: list[bytes] = []

    def feed(self, piece: bytes) -> list[Event]:
        buf = self._rest + piece if self._rest else piece
        if b"\r" in buf:
            # A CR at the very end may be the first half of a CRLF still on its way: keep it.
            held = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if held:
                buf = buf[:-1]
                lines = buf.split(b"\n")
                self._rest = lines.pop() + b"\r"
            else:
                lines = buf.split(b"\n")
                self._rest = lines.pop()
        else:
            lines = buf.split(b"\n")
            self._rest = lines.pop()
        events: list[Event] = []
        for line in lines:
            self._line(line, events)
        return events

    def _line(self, line: bytes, events: list[Event]) -> None:
        if not line:
            if self._data:
                events.append((self._name, b"\n".join(self._data)))
                self._data = []
            self._name = b""
            return
        name, colon, value = line.partition(b":")
        if not colon:
            name, value = line, b""
        elif value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._name = value

    def pending(self) -> bool:
        """True when bytes of an unfinished event are held (the stream ended mid-event)."""
        return bool(self._data) or bool(self._rest.strip(b"\r"))
