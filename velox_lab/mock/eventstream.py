"""AWS event-stream frames (`application/vnd.amazon.eventstream`), the encoding side.

botocore ships only the decoder; the mock (and tests that feed the Bedrock translator) need to
write frames. One frame:

    total length (u32) | headers length (u32) | CRC32 of those 8 bytes (u32)
    headers: name length (u8), name, value type (u8, 7 = string), value length (u16), value
    payload | CRC32 of everything before it (u32)

all big-endian (the AWS event-stream specification). Tests check every frame written here with
botocore's own `EventStreamBuffer`.
"""

from __future__ import annotations

import struct
from binascii import crc32
from typing import Any

import orjson

_STRING = 7


def frame(headers: dict[str, str], payload: bytes) -> bytes:
    encoded = b"".join(_header(name, value) for name, value in headers.items())
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    head = prelude + struct.pack(">I", crc32(prelude))
    body = head + encoded + payload
    return body + struct.pack(">I", crc32(body))


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    return (struct.pack(">B", len(raw_name)) + raw_name + struct.pack(">BH", _STRING,
                                                                      len(raw_value))
            + raw_value)


def event(event_type: str, body: dict[str, Any]) -> bytes:
    """An event frame as Bedrock's ConverseStream sends it (JSON payload)."""
    return frame({":event-type": event_type, ":content-type": "application/json",
                  ":message-type": "event"}, orjson.dumps(body))


def exception(exception_type: str, message: str) -> bytes:
    """An exception frame (`exception_type` as the stream's member name: throttlingException)."""
    return frame({":exception-type": exception_type, ":content-type": "application/json",
                  ":message-type": "exception"}, orjson.dumps({"message": message}))
