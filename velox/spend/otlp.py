"""OTLP/protobuf encoding of Velox's spans, written by hand (the bytes of an
`ExportTraceServiceRequest`, as the official OTLP/HTTP exporter POSTs them).

Why by hand: the SDK's encoder (opentelemetry-exporter-otlp-proto-common) builds a protobuf
message per span, per attribute and per attribute value from Python, about 55 to 70 us a span on
this host; at 1% sampling that was more than half of what tracing cost a request end to end.
Velox's spans have a fixed shape (velox.spend.trace: a SERVER span with a few events, a CLIENT
span per attempt), most of their attribute values repeat (method, path, models, provider,
upstream, status codes), and the resource and scope never change, so each piece is written once
and reused: an attribute already seen is one dict lookup.

The output is byte for byte what the SDK's encoder makes of the same spans built as its
`ReadableSpan`s (tests/spend/test_trace_encoding.py checks it, records drawn by hypothesis):
fields in field-number order, proto3 defaults left out, a span's `flags` saying whether its
parent is remote, and an empty `Status` for an unset one. The SDK's exporter still sends the
bytes (velox.spend.trace).

Only what velox.spend.trace makes is supported: attribute values of str, bool, int, float and
lists of str; an event's attributes of the same kinds; links without attributes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

SERVER, CLIENT = 2, 3  # Span.SpanKind in the protocol
STATUS_UNSET, STATUS_ERROR = 0, 2
# Span.flags (SpanFlags): the encoder says whether it knows the parent's remoteness, and it is.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
# Past this many distinct attributes the cache starts over (a few KiB per hundred entries):
# values that repeat (models, paths, upstreams, small counts) are what it is for, and a run of
# ever-new values (token counts, costs) must not grow it without bound.
_CACHE_MAX = 4096
_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_FIXED32 = struct.Struct("<I")


class SpanData(NamedTuple):
    """One span as velox.spend.trace describes it (times: Unix nanoseconds)."""

    trace_id: int
    span_id: int
    parent_span_id: int  # 0: none
    remote_parent: bool  # the parent is the client's span (its traceparent)
    name: str
    kind: int  # SERVER or CLIENT
    start_ns: int
    end_ns: int
    attributes: Mapping[str, Any]
    events: Sequence[tuple[str, Mapping[str, Any], int]] = ()  # name, attributes, time
    links: Sequence[tuple[int, int]] = ()  # trace id, span id
    error: bool = False  # Status ERROR, else UNSET


def varint(n: int) -> bytes:
    """An unsigned varint; a negative int64 is written as its two's complement (10 bytes)."""
    if n < 0:
        n += 1 << 64
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: its tag, the body's length, the body."""
    return tag + varint(len(body)) + body


def _text(tag: bytes, value: str) -> bytes:
    """A string field; an empty one is left out (proto3), but for AnyValue's (a oneof)."""
    return field(tag, value.encode("utf-8", "surrogatepass")) if value else b""


def _fixed64(tag: bytes, value: int) -> bytes:
    return tag + _FIXED64.pack(value) if value else b""


def any_value(value: Any) -> bytes:
    """An AnyValue's body (bool before int: a bool is an int to Python)."""
    if isinstance(value, str):
        return field(b"\x0a", value.encode("utf-8", "surrogatepass"))
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE.pack(value)
    if isinstance(value, list | tuple):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(v)) for v in value))
    raise TypeError(f"an attribute value of type {type(value).__name__}")


def key_value(key: str, value: Any) -> bytes:
    """A KeyValue's body."""
    return _text(b"\x0a", key) + field(b"\x12", any_value(value))


class Encoder:
    """Spans to an ExportTraceServiceRequest under one resource and scope, given as their
    encoded messages (`Resource`, `InstrumentationScope`): made once, reused for every export."""

    def __init__(self, resource: bytes, scope: bytes) -> None:
        self.resource = field(b"\x0a", resource)  # ResourceSpans.resource
        self.scope = field(b"\x0a", scope)  # ScopeSpans.scope
        # (key, type, value) -> the KeyValue with its length, ready for any attributes field
        # (the type keeps True apart from 1).
        self._attrs: dict[tuple[str, type, Any], bytes] = {}

    def request(self, spans: Sequence[SpanData]) -> bytes:
        """One request holding every span, in their order, under the one resource and scope."""
        scope_spans = self.scope + b"".join([field(b"\x12", self.span(s)) for s in spans])
        resource_spans = self.resource + field(b"\x12", scope_spans)
        return field(b"\x0a", resource_spans)

    def span(self, s: SpanData) -> bytes:
        """A Span's body, fields in number order (flags, field 16, last)."""
        parts = [b"\x0a\x10", s.trace_id.to_bytes(16, "big"), b"\x12\x08",
                 s.span_id.to_bytes(8, "big")]
        if s.parent_span_id:
            parts += (b"\x22\x08", s.parent_span_id.to_bytes(8, "big"))
        parts += (_text(b"\x2a", s.name), b"\x30", varint(s.kind),
                  _fixed64(b"\x39", s.start_ns), _fixed64(b"\x41", s.end_ns))
        parts += self._attributes(b"\x4a", s.attributes)
        for name, attrs, when in s.events:
            parts.append(field(b"\x5a", b"".join([_fixed64(b"\x09", when),
                                                  _text(b"\x12", name),
                                                  *self._attributes(b"\x1a", attrs)])))
        for trace_id, span_id in s.links:  # a link's flags: its remoteness known, local
            parts.append(field(b"\x6a", b"\x0a\x10" + trace_id.to_bytes(16, "big") +
                               b"\x12\x08" + span_id.to_bytes(8, "big") + b"\x35" +
                               _FIXED32.pack(_HAS_IS_REMOTE)))
        parts.append(b"\x7a\x02\x18\x02" if s.error else b"\x7a\x00")
        flags = _HAS_IS_REMOTE | (_IS_REMOTE if s.parent_span_id and s.remote_parent else 0)
        parts += (b"\x85\x01", _FIXED32.pack(flags))
        return b"".join(parts)

    def _attributes(self, tag: bytes, attrs: Mapping[str, Any]) -> list[bytes]:
        cache = self._attrs
        out = []
        for key, value in attrs.items():
            if type(value) is list:  # finish reasons: few, not worth a key of their own
                out.append(tag + _length_prefixed(key_value(key, value)))
                continue
            entry = (key, type(value), value)
            encoded = cache.get(entry)
            if encoded is None:
                if len(cache) >= _CACHE_MAX:
                    cache.clear()
                encoded = cache[entry] = _length_prefixed(key_value(key, value))
            out.append(tag + encoded)
        return out


def _length_prefixed(body: bytes) -> bytes:
    return varint(len(body)) + body
