"""Stateless HPACK (RFC 7541) encoding of the mock's HTTP/2 response header blocks.

Every field is either a full static-table match (`:status 200`) or a literal *without indexing*
whose name refers to the static table where it can. No dynamic-table entries are ever created,
so the encoder has no per-connection state, any peer SETTINGS_HEADER_TABLE_SIZE is honoured
trivially, and the encoded bytes of a constant header set can be cached and reused across
connections. Values are sent as raw octets (no Huffman): cheaper to produce, a few bytes larger.
"""

from __future__ import annotations

from collections.abc import Iterable

# Names of the RFC 7541 Appendix A static table, in index order (index = position + 1).
_STATIC_NAMES = (
    ":authority", ":method", ":method", ":path", ":path", ":scheme", ":scheme", ":status",
    ":status", ":status", ":status", ":status", ":status", ":status", "accept-charset",
    "accept-encoding", "accept-language", "accept-ranges", "accept",
    "access-control-allow-origin", "age", "allow", "authorization", "cache-control",
    "content-disposition", "content-encoding", "content-language", "content-length",
    "content-location", "content-range", "content-type", "cookie", "date", "etag", "expect",
    "expires", "from", "host", "if-match", "if-modified-since", "if-none-match", "if-range",
    "if-unmodified-since", "last-modified", "link", "location", "max-forwards",
    "proxy-authenticate", "proxy-authorization", "range", "referer", "refresh", "retry-after",
    "server", "set-cookie", "strict-transport-security", "transfer-encoding", "user-agent",
    "vary", "via", "www-authenticate",
)
_NAME_INDEX: dict[bytes, int] = {}
for _i, _name in enumerate(_STATIC_NAMES, 1):
    _NAME_INDEX.setdefault(_name.encode(), _i)
_STATUS_INDEX = {200: 8, 204: 9, 206: 10, 304: 11, 400: 12, 404: 13, 500: 14}
_CACHE_LIMIT = 4096


def encode_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """An HPACK integer with an N-bit prefix; `first` carries the pattern bits above it."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes((first | value,))
    out = bytearray((first | top,))
    value -= top
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_string(data: bytes) -> bytes:
    if len(data) < 0x7F:
        return bytes((len(data),)) + data
    return encode_int(len(data), 7) + data


_name_prefixes: dict[bytes, bytes] = {}


def _name_prefix(name: bytes) -> bytes:
    """The bytes of a literal-without-indexing field up to (not including) its value."""
    prefix = _name_prefixes.get(name)
    if prefix is None:
        index = _NAME_INDEX.get(name)
        prefix = encode_int(index, 4) if index else b"\x00" + encode_string(name)
        if len(_name_prefixes) < _CACHE_LIMIT:
            _name_prefixes[name] = prefix
    return prefix


def encode_field(name: bytes, value: bytes) -> bytes:
    return _name_prefix(name) + encode_string(value)


def encode_status(status: int) -> bytes:
    index = _STATUS_INDEX.get(status)
    if index:
        return bytes((0x80 | index,))
    return encode_field(b":status", b"%d" % status)


_blocks: dict[tuple, bytes] = {}


def encode_static(status: int, headers: tuple[tuple[bytes, bytes], ...]) -> bytes:
    """`:status` plus a constant header set, encoded once and then served from a cache."""
    key = (status, headers)
    block = _blocks.get(key)
    if block is None:
        block = encode_status(status) + b"".join(encode_field(n, v) for n, v in headers)
        if len(_blocks) >= _CACHE_LIMIT:
            _blocks.clear()
        _blocks[key] = block
    return block


def encode_response(status: int, static: tuple[tuple[bytes, bytes], ...],
                    dynamic: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A full response header block: the cached constant part, then per-response fields."""
    parts = [encode_static(status, static)]
    for name, value in dynamic:
        parts.append(_name_prefix(name))
        parts.append(encode_string(value))
    return b"".join(parts)
