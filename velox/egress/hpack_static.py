"""HPACK for the framer: stateless request encoding and the choice of response decoder.

Requests are encoded without the dynamic table: indexed static entries where name and value
match exactly, otherwise literals never added to the peer's table, and no Huffman coding.
Request headers are a few hundred bytes on a connection that then carries kilobytes of JSON, so
compression would buy little, and statelessness means encoded fields can be cached and shared
by every connection. Responses are decoded by jh2's compiled decoder when it is installed, else
by the pure-Python `hpack` one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .codec import LOCAL_HEADER_TABLE_SIZE, LOCAL_MAX_HEADER_LIST_SIZE, SENSITIVE_HEADERS

# RFC 7541 Appendix A, in index order (index = position + 1).
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b":authority", b""), (b":method", b"GET"), (b":method", b"POST"), (b":path", b"/"),
    (b":path", b"/index.html"), (b":scheme", b"http"), (b":scheme", b"https"),
    (b":status", b"200"), (b":status", b"204"), (b":status", b"206"), (b":status", b"304"),
    (b":status", b"400"), (b":status", b"404"), (b":status", b"500"),
    (b"accept-charset", b""), (b"accept-encoding", b"gzip, deflate"),
    *((name, b"") for name in (
    b"accept-language accept-ranges accept access-control-allow-origin age allow authorization "
    b"cache-control content-disposition content-encoding content-language content-length "
    b"content-location content-range content-type cookie date etag expect expires from host "
    b"if-match if-modified-since if-none-match if-range if-unmodified-since last-modified link "
    b"location max-forwards proxy-authenticate proxy-authorization range referer refresh "
    b"retry-after server set-cookie strict-transport-security transfer-encoding user-agent vary "
    b"via www-authenticate"
).split()),
)  # fmt: skip
STATIC_NAME: dict[bytes, int] = {}
STATIC_EXACT: dict[tuple[bytes, bytes], int] = {}
for _index, (_name, _value) in enumerate(STATIC_TABLE, 1):
    STATIC_NAME.setdefault(_name, _index)
    if _value:
        STATIC_EXACT[_name, _value] = _index

# Encoded (name, value) fields shared by all connections. Cleared wholesale when full: refilling
# costs a microsecond per distinct field, far less than tracking recency on every lookup.
FIELD_CACHE: dict[tuple[bytes, bytes], bytes] = {}
FIELD_CACHE_LIMIT = 4096
_BYTE = [bytes((i,)) for i in range(256)]


def hpack_int(value: int, prefix_bits: int, pattern: int) -> bytes:
    """RFC 7541 section 5.1 integer with an N-bit prefix; pattern holds the high bits."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return _BYTE[pattern | value]
    out = bytearray((pattern | limit,))
    value -= limit
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_field(name: bytes, value: bytes, never_indexed: bool = False) -> bytes:
    if not never_indexed:
        index = STATIC_EXACT.get((name, value))
        if index:
            return hpack_int(index, 7, 0x80)
    pattern = 0x10 if never_indexed else 0x00  # literal never indexed / without indexing
    index = STATIC_NAME.get(name, 0)
    head = hpack_int(index, 4, pattern)
    if not index:
        head += hpack_int(len(name), 7, 0) + name
    return head + hpack_int(len(value), 7, 0) + value


# The value-independent start of a never-indexed literal for each credential header.
_NEVER_INDEXED_HEADS = {name: hpack_field(name, b"", True)[:-1] for name in SENSITIVE_HEADERS}


def encode_new_field(field: tuple[bytes, bytes]) -> bytes:
    name, value = field
    head = _NEVER_INDEXED_HEADS.get(name)
    if head is not None:
        # Credentials are encoded afresh each time and never cached: with pass-through keys the
        # cache would otherwise keep many tenants' secrets alive in a long-lived structure, for a
        # saving of a fraction of a microsecond per request.
        return head + hpack_int(len(value), 7, 0) + value
    encoded = hpack_field(name, value)
    if len(FIELD_CACHE) >= FIELD_CACHE_LIMIT:
        FIELD_CACHE.clear()
    FIELD_CACHE[field] = encoded
    return encoded


DecoderParts = tuple[Callable[[bytes], list], Callable[[list], list], type[Exception]]


def make_decoder() -> DecoderParts:
    """Return (decode, strip_pseudo, oversized-list error) for the best HPACK decoder installed."""
    try:
        from jh2._hazmat import Decoder, OversizedHeaderListError
    except ImportError:
        return make_python_decoder()
    decoder = Decoder(max_header_list_size=LOCAL_MAX_HEADER_LIST_SIZE)
    decoder.max_allowed_table_size = LOCAL_HEADER_TABLE_SIZE
    # jh2 yields (name, value, sensitive) triples. The filter drops pseudo-headers (58 is ":")
    # and the caller compares lengths to spot misplaced ones, so one pass does both jobs; an
    # empty name raises IndexError, which the caller treats as malformed.

    def strip(fields: list) -> list:
        return [(n, v) for n, v, _ in fields if n[0] != 58]

    return decoder.decode, strip, OversizedHeaderListError


def make_python_decoder() -> DecoderParts:
    from hpack import Decoder, OversizedHeaderListError

    decoder = Decoder(max_header_list_size=LOCAL_MAX_HEADER_LIST_SIZE)
    decoder.max_allowed_table_size = LOCAL_HEADER_TABLE_SIZE
    decode = functools.partial(decoder.decode, raw=True)

    def strip(fields: list) -> list:
        return [(n, v) for n, v in fields if n[0] != 58]

    return decode, strip, OversizedHeaderListError
