"""The native usage scan (`usage_scan`, native/vx_books.c) in Python: its reference, kept equal
to it by a differential test over real and hostile bodies (tests/unit/test_usage_scan.py).

At the last `"usage"` key of an answer, one of two fixed member orders is read without parsing
the document: OpenAI's (`prompt_tokens`, `completion_tokens`) and the Messages API's
(`input_tokens`, optional `cache_creation_input_tokens`, `cache_read_input_tokens` and
`cache_creation` object, `output_tokens`; the input is the sum, as OpenAI's prompt_tokens counts
cached tokens). The result: (input, output); False when the body has no "usage" key; True when
its last one is in neither order (the caller parses it instead: velox.relay.usage.usage_of).
"""

from __future__ import annotations

_SPACE = b" \t\n\r"
_MAX_DIGITS = 15  # a longer number is left to the parser (the C side's int64 never overflows)


class _Miss(Exception):
    """The usage object is not in the order being read."""


class _Reader:
    __slots__ = ("i", "s")

    def __init__(self, s: bytes, i: int) -> None:
        self.s = s
        self.i = i

    def space(self) -> None:
        s, i = self.s, self.i
        while i < len(s) and s[i] in _SPACE:
            i += 1
        self.i = i

    def expect(self, literal: bytes) -> None:
        if not self.s.startswith(literal, self.i):
            raise _Miss
        self.i += len(literal)
        self.space()

    def number(self) -> int:
        s, i = self.s, self.i
        j = i
        while j < len(s) and 0x30 <= s[j] <= 0x39:
            j += 1
        if j == i or j - i > _MAX_DIGITS:
            raise _Miss
        self.i = j
        self.space()
        return int(s[i:j])

    def member(self, key: bytes) -> bool:
        """`,"key":` next: True (moved past it); else False (nothing moved)."""
        start = self.i
        try:
            self.expect(b",")
            self.expect(key)
            self.expect(b":")
        except _Miss:
            self.i = start
            return False
        return True

    def number_object(self) -> None:
        self.expect(b"{")
        if self.s.startswith(b"}", self.i):
            self.i += 1
            self.space()
            return
        while True:
            self.expect(b'"')
            s, i = self.s, self.i
            while i < len(s) and s[i] not in b'"\\':
                i += 1
            self.i = i
            self.expect(b'"')
            self.expect(b":")
            self.number()
            if self.s.startswith(b"}", self.i):
                self.i += 1
                self.space()
                return
            self.expect(b",")


def _openai(r: _Reader) -> tuple[int, int]:
    r.expect(b'"prompt_tokens"')
    r.expect(b":")
    inp = r.number()
    r.expect(b",")
    r.expect(b'"completion_tokens"')
    r.expect(b":")
    return inp, r.number()


def _messages(r: _Reader) -> tuple[int, int]:
    r.expect(b'"input_tokens"')
    r.expect(b":")
    total = r.number()
    if r.member(b'"cache_creation_input_tokens"'):
        total += r.number()
    if r.member(b'"cache_read_input_tokens"'):
        total += r.number()
    if r.member(b'"cache_creation"'):
        r.number_object()
    if not r.member(b'"output_tokens"'):
        raise _Miss
    return total, r.number()


def usage_scan(body: bytes | bytearray | memoryview) -> tuple[int, int] | bool:
    s = bytes(body)
    at = s.rfind(b'"usage"')
    if at < 0:
        return False
    for order in (_openai, _messages):
        r = _Reader(s, at + 7)
        try:
            r.space()
            r.expect(b":")
            r.expect(b"{")
            return order(r)
        except _Miss:
            continue
    return True
