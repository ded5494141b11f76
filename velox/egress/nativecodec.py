"""The `native` egress codec: the HTTP/2 client codec of the C core (native/vx_h2.c).

`velox._native.H2Client` implements `velox.egress.codec.Codec` entirely in C: frame parsing,
HPACK both ways (static and dynamic tables, Huffman decoding), flow control, and the same policy,
errors and bytes on the wire as the Python framer it was ported from (framer.py;
docs/design/codecs.md has the reasoning behind each choice). One `receive_data` call crosses
into C once for a whole upstream read and returns the event tuples built there.

This module only checks that the C core was built with the same constants as codec.py and hands
it `CodecError`, which it raises as ``CodecError(code, message, events)``; and it is where
h2conn finds `H2Reader`, the connection's C base.
"""

from __future__ import annotations

from velox import _native

from . import codec
from .codec import CodecError

__all__ = ["H2Reader", "NativeCodec"]

# The C base of the connection (h2conn.H2Connection): its reads go into the native codec in C.
H2Reader = _native.H2Reader

# The C core hard-codes these (vx_h2.h); a mismatch would make `native` differ from the other
# codecs silently, so it is refused at import.
_EXPECTED = {
    "H2_RESPONSE": codec.RESPONSE,
    "H2_DATA": codec.DATA,
    "H2_TRAILERS": codec.TRAILERS,
    "H2_RESET": codec.RESET,
    "H2_GOAWAY": codec.GOAWAY,
    "H2_SETTINGS": codec.SETTINGS,
    "H2_PING_ACK": codec.PING_ACK,
    "H2_ANSWER": codec.ANSWER,
    "H2_LOCAL_INITIAL_WINDOW_SIZE": codec.LOCAL_INITIAL_WINDOW_SIZE,
    "H2_LOCAL_CONNECTION_WINDOW": codec.LOCAL_CONNECTION_WINDOW,
    "H2_LOCAL_MAX_HEADER_LIST_SIZE": codec.LOCAL_MAX_HEADER_LIST_SIZE,
    "H2_DATA_PER_CALL": codec.DATA_PER_CALL,
    "H2_DEFAULT_MAX_CONCURRENT_STREAMS": codec.DEFAULT_MAX_CONCURRENT_STREAMS,
    "H2_MAX_CONCURRENT_STREAMS_CAP": codec.MAX_CONCURRENT_STREAMS_CAP,
}
_mismatch = {k: v for k, v in _EXPECTED.items() if getattr(_native, k, None) != v}
if _mismatch:  # pragma: no cover - a build from other sources
    raise ImportError(f"velox._native was built with different HTTP/2 constants: {_mismatch}")


def NativeCodec(authority: bytes, scheme: bytes) -> codec.Codec:
    """A native codec for one connection (see `velox.egress.codec.Codec`)."""
    return _native.H2Client(authority, scheme, CodecError)
