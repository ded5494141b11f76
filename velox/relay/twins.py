"""Pure-Python reference twins of the relay's native scans (native/vx_books.c).

`usage_scan` reads an answer's token usage without Python on every plain answer; this twin says
the same in a regular expression, and tests/native/test_usage_twins.py drives both with
generated bodies and compares them.
"""

from __future__ import annotations

import re

_KEY = b'"usage"'
_SPACE = rb"[ \t\r\n]*"  # JSON whitespace only
_DIGITS = rb"([0-9]{1,15})(?![0-9])"  # 1 to 15 digits: 16 or more is another form
# `"usage"` then `:{"prompt_tokens":N,"completion_tokens":M` with whitespace between the tokens.
_OPENAI_ORDER = re.compile(_SPACE + _SPACE.join(
    [b":", rb"\{", b'"prompt_tokens"', b":", _DIGITS, b",", b'"completion_tokens"', b":",
     _DIGITS]))


def usage_scan(body: bytes | bytearray | memoryview) -> tuple[int, int] | bool:
    """(prompt_tokens, completion_tokens) of the last "usage" key when it is in OpenAI's own
    order; False when there is no "usage" key; True when the last one is in another form."""
    data = bytes(body)
    at = data.rfind(_KEY)
    if at < 0:
        return False
    found = _OPENAI_ORDER.match(data, at + len(_KEY))
    return (int(found[1]), int(found[2])) if found else True
