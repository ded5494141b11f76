"""Pure-Python reference twins of the relay's native scans (native/vx_books.c).

`usage_scan` reads an answer's token usage without Python on every plain answer; this twin says
the same in regular expressions, and tests/native/test_usage_twins.py drives both with
generated bodies and compares them; `usage_parts_scan` the same for spend's pricing. With
VELOX_NATIVE=0 the gateway reads usage with them (velox.relay.usage.use). `sink_piece` is the
direct path's decision on one streamed read (native/bind_sink.c; tests/native/
test_sink_twins.py): a reference only, since VELOX_NATIVE=0's upstream readers have no direct
path.
"""

from __future__ import annotations

import re

_KEY = b'"usage"'
_S = rb"[ \t\r\n]*"  # JSON whitespace only
_DIGITS = rb"([0-9]{1,15})(?![0-9])"  # 1 to 15 digits: 16 or more is another form
_OPEN = _S + b":" + _S + rb"\{" + _S  # after the last "usage": its object opens


def _member(name: bytes, value: bytes) -> bytes:
    """`,"name":value` with whitespace between the tokens."""
    return _S + b"," + _S + b'"' + name + b'"' + _S + b":" + _S + value


# OpenAI's own order: {"prompt_tokens":N,"completion_tokens":M
_OPENAI = re.compile(_OPEN + b'"prompt_tokens"' + _S + b":" + _S + _DIGITS +
                     _member(b"completion_tokens", _DIGITS))
# Anthropic's: {"input_tokens":N, then optionally the cache writes, the cache reads and a
# "cache_creation" object of "name":digits members, then "output_tokens":M
_NAME_NUMBER = rb'"[^"\\]*"' + _S + b":" + _S + rb"[0-9]{1,15}(?![0-9])" + _S
_NUMBER_OBJECT = rb"\{" + _S + rb"(?:\}|" + _NAME_NUMBER + rb"(?:," + _S + _NAME_NUMBER + \
    rb")*\})"
_ANTHROPIC = re.compile(
    _OPEN + b'"input_tokens"' + _S + b":" + _S + _DIGITS +
    b"(?:" + _member(b"cache_creation_input_tokens", _DIGITS) + b")?" +
    b"(?:" + _member(b"cache_read_input_tokens", _DIGITS) + b")?" +
    b"(?:" + _member(b"cache_creation", _NUMBER_OBJECT) + b")?" +
    _member(b"output_tokens", _DIGITS))


def usage_scan(body: bytes | bytearray | memoryview) -> tuple[int, int] | bool:
    """(input, output) tokens of the last "usage" key when it is in OpenAI's own order, or in
    Anthropic's (the input then counts the cache writes and reads, as OpenAI's prompt_tokens
    does); False when there is no "usage" key; True when the last one is in another form."""
    data = bytes(body)
    at = data.rfind(_KEY)
    if at < 0:
        return False
    at += len(_KEY)
    found = _OPENAI.match(data, at)
    if found:
        return int(found[1]), int(found[2])
    found = _ANTHROPIC.match(data, at)
    if found:
        inp, writes, reads, out = found.groups()
        return int(inp) + int(writes or 0) + int(reads or 0), int(out)
    return True


# usage_parts_scan: after OpenAI's first two members, each further one up to the closing brace.
_NAME = rb'"([^"\\]*)"' + _S + b":" + _S
_REST_MEMBER = re.compile(_S + b"," + _S + _NAME + rb"(?:([0-9]{1,15})(?![0-9])|(\{" + _S +
                          rb"(?:\}|" + _NAME_NUMBER + rb"(?:," + _S + _NAME_NUMBER + rb")*\})))")
_INNER = re.compile(_NAME + rb"([0-9]+)")
_END = re.compile(_S + rb"\}")
# Per details object: its member names read, and their places in the answer's tuple.
_DETAILS_PARTS = {b"prompt_tokens_details": {b"cached_tokens": 2, b"cache_write_tokens": 3},
                  b"completion_tokens_details": {b"reasoning_tokens": 4}}
_TWO = (b"prompt_tokens", b"completion_tokens")


def usage_parts_scan(body: bytes | bytearray | memoryview
                     ) -> tuple[int, int, int, int, int] | bool:
    """(input, output, cached, cache-write, reasoning) tokens of the last "usage" key when it
    is in OpenAI's own order and every member after its first two is a number or an object of
    numbers (the details: a repeated one replaces the earlier); False when there is no "usage"
    key; True when the last one is in another form (vx_books.h)."""
    data = bytes(body)
    at = data.rfind(_KEY)
    if at < 0:
        return False
    found = _OPENAI.match(data, at + len(_KEY))
    if found is None:
        return True
    parts = [int(found[1]), int(found[2]), 0, 0, 0]
    at = found.end()
    while _END.match(data, at) is None:
        member = _REST_MEMBER.match(data, at)
        if member is None:
            return True
        name, _number, inner = member.groups()
        named = _DETAILS_PARTS.get(name)
        if inner is None and (named is not None or name in _TWO):
            return True  # a details name holding a number, or a total named twice
        if named is not None:
            for slot in named.values():
                parts[slot] = 0
            for key, value in _INNER.findall(inner):
                if key in named:
                    parts[named[key]] = int(value)
        at = member.end()
    inp, out, cached, written, reasoning = parts
    return inp, out, cached, written, reasoning


# The direct path's sink (native/bind_sink.c): a piece it writes is at most this long.
SINK_MAX = 64 * 1024
_NULL_USAGE = b',"usage":null'


def sink_piece(data: bytes, metered: bool, strip: bool) -> bytes | None:
    """What the direct path writes of one streamed read (unframed), or None when it leaves the
    read to the Python path: whole events only; with a meter, none naming "usage", or (when the
    meter strips) one event whose `,"usage":null` is left out, as SSEUsage.feed does with
    nothing pending."""
    if len(data) > SINK_MAX or not data.endswith(b"\n\n"):
        return None
    if not metered or b'"usage"' not in data:
        return data
    if not strip or data.find(b"\n\n") != len(data) - 2:
        return None
    i = data.find(_NULL_USAGE)
    return None if i < 0 else data[:i] + data[i + len(_NULL_USAGE):]
