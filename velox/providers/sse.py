"""Incremental server-sent-event splitter: bytes in any split -> complete events.

A streamed answer reaches a translator in whatever pieces the reads delivered: an event may be cut
mid-line, mid-field, or inside a multi-byte UTF-8 character. `Splitter.feed` keeps the unfinished
tail and returns the events completed so far as raw blocks (the lines of one event, without the
blank line that ends it); `fields` reads the `event:` name and the `data:` payload of one block.
Nothing is decoded to text: the payload stays bytes and goes to orjson as it is, so a character
split across two reads is whole again once both pieces are in the buffer.

Line ends: LF (what OpenAI, Anthropic and Google send), CRLF and lone CR (what the SSE grammar also
allows) are all read; a CR at the very end of a read is held back, since the next read may begin
with its LF.
"""

from __future__ import annotations

_LF2 = b"\n\n"


class Splitter:
    """Splits an event stream into event blocks, one `feed` per read."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            buf = _normalise(buf)
        end = buf.rfind(_LF2)
        if end < 0:
            self._buf = buf
            return []
        self._buf = buf[end + 2:]
        # One split of the finished part: the common read holds one or a few whole events.
        return [block for block in buf[:end].split(_LF2) if block]

    def one(self, data: bytes) -> tuple[bytes, bytes] | None:
        """(event name, data) when nothing is held and `data` is exactly one event in the
        shape providers write (`event:` line, `data:` line, blank line, LF line ends): the
        common read, a third of the cost of feed + fields. None: take feed's path."""
        if self._buf or data[-2:] != _LF2 or data[:7] != b"event: ":
            return None
        nl = data.find(b"\n")
        if data[nl + 1:nl + 7] != b"data: ":
            return None
        # Three LFs (the two lines' and the blank line's) and no CR: nothing else is a line.
        if data.count(b"\n") != 3 or b"\r" in data:
            return None
        return data[7:nl], data[nl + 7:-2]

    def close(self) -> list[bytes]:
        """The stream ended: a CR held back was a line end after all. An event still without
        its blank line is dropped, as the SSE grammar says."""
        held, self._buf = self._buf, b""
        return self.feed(held[:-1] + b"\n") if held.endswith(b"\r") else []

    def pending(self) -> bytes:
        """The unfinished tail (an event whose blank line has not arrived)."""
        return self._buf


def _normalise(buf: bytes) -> bytes:
    held = buf.endswith(b"\r")
    if held:
        buf = buf[:-1]
    buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    return buf + b"\r" if held else buf


def fields(block: bytes) -> tuple[bytes, bytes]:
    """(event name, data) of one event block; b"" for a missing field. Several `data:` lines
    are joined with LF, as the SSE grammar says; comments and other fields are skipped."""
    # The shapes providers send: one event line and one data line (Anthropic), or one data
    # line alone (OpenAI); anything else takes the general path below.
    if block[:7] == b"event: " and block.count(b"\n") == 1:
        head, _, tail = block.partition(b"\n")
        if tail[:6] == b"data: ":
            return head[7:], tail[6:]
    elif block[:6] == b"data: " and b"\n" not in block:
        return b"", block[6:]
    event = b""
    data: list[bytes] = []
    for line in block.split(b"\n"):
        name, _, value = line.partition(b":")
        if value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value
    return event, b"\n".join(data)


def event(name: bytes, data: bytes) -> bytes:
    """One event as sent: `event:` line, `data:` line, blank line."""
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


def data(payload: bytes) -> bytes:
    """One unnamed event, as OpenAI streams are written."""
    return b"data: " + payload + b"\n\n"
