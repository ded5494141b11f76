"""velox._native.scan_json: agreement with orjson, field extraction, GIL release.

The gateway keeps orjson for small bodies and uses scan_json for large ones, so both must
accept exactly the same documents. The oracle is orjson itself: for every input,
`scan_json(b)` succeeds iff `orjson.loads(b)` does, and when the document is an object the
reported "model" span decodes to `doc["model"]` and the stream kind matches
`doc.get("stream")`. Inputs: explicit regressions, Hypothesis-generated documents serialized
with random whitespace and escaping, the same mutated byte-wise, random bytes, tricky
Unicode, numbers around the binary64 overflow boundary, nesting around the depth limit.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from velox._native import (
    JSON_ABSENT,
    JSON_ARRAY,
    JSON_E_DEPTH,
    JSON_E_EMPTY,
    JSON_E_RANGE,
    JSON_E_SURROGATE,
    JSON_E_TRUNCATED,
    JSON_E_UTF8,
    JSON_FALSE,
    JSON_MAX_DEPTH,
    JSON_NULL,
    JSON_NUMBER,
    JSON_OBJECT,
    JSON_OK,
    JSON_STRING,
    JSON_TRUE,
    scan_json,
)

MISSING = object()
# 2**1024 - 2**970: the smallest magnitude that a double rounds to infinity, where orjson
# starts refusing numbers.
OVERFLOW = 2**1024 - 2**970


def kind_of(value: object) -> int:
    if value is None:
        return JSON_NULL
    if value is True:
        return JSON_TRUE
    if value is False:
        return JSON_FALSE
    if isinstance(value, (int, float)):
        return JSON_NUMBER
    if isinstance(value, str):
        return JSON_STRING
    if isinstance(value, list):
        return JSON_ARRAY
    assert isinstance(value, dict)
    return JSON_OBJECT


def same_json(a: object, b: object) -> bool:
    """a == b for decoded JSON, without recursion (Python's == recurses, and the depth tests
    nest 1024 levels)."""
    stack = [(a, b)]
    while stack:
        x, y = stack.pop()
        if type(x) is not type(y):
            return False
        if isinstance(x, list):
            assert isinstance(y, list)
            if len(x) != len(y):
                return False
            stack.extend(zip(x, y, strict=False))
        elif isinstance(x, dict):
            assert isinstance(y, dict)
            if x.keys() != y.keys():
                return False
            stack.extend((x[k], y[k]) for k in x)
        elif x != y:
            return False
    return True


def assert_agrees(data: bytes) -> tuple[int, ...]:
    """scan_json(data) against orjson.loads(data); returns the scan result."""
    result = scan_json(data)
    err, off, m_start, m_end, m_kind, s_kind, top = result
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        assert err != JSON_OK, f"scan_json accepted what orjson refuses ({exc}): {data[:200]!r}"
        assert 0 <= off <= len(data)
        assert (m_start, m_end, m_kind, s_kind, top) == (0, 0, 0, 0, 0)
        return result
    assert err == JSON_OK, \
        f"scan_json refused (error {err} at {off}) what orjson accepts: {data[:200]!r}"
    assert off == 0
    assert top == kind_of(doc)
    model = doc.get("model", MISSING) if isinstance(doc, dict) else MISSING
    if model is MISSING:
        assert (m_start, m_end, m_kind) == (0, 0, JSON_ABSENT)
    else:
        assert m_kind == kind_of(model)
        assert 0 <= m_start < m_end <= len(data)
        assert same_json(orjson.loads(data[m_start:m_end]), model)
    stream = doc.get("stream", MISSING) if isinstance(doc, dict) else MISSING
    assert s_kind == (JSON_ABSENT if stream is MISSING else kind_of(stream))
    return result


# ---------------------------------------------------------------- explicit regressions

REGRESSIONS: list[bytes] = [
    b"", b" ", b"\t\n\r ", b"{}", b"[]", b"0", b"-0", b"01", b"-01", b"00", b"1.", b".1",
    b"1e", b"1e+", b"1E-5", b"-", b"+1", b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf",
    b"1e400", b"-1e400", b"1e308", b"2e308", b"1e-400", b"0e99999999999999999999",
    b"1e18446744073709551616", b"1e-18446744073709551617", b"1e0000000000000000000000309",
    b"123456789012345678901234567890", b"18446744073709551616", b"-9223372036854775809",
    b"1.7976931348623157e308", b"1.7976931348623158e308", b"1.7976931348623159e308",
    b"0.0001e312", b"0.0001e313", b"100e307", b"1.e5", b"0.e1", b"0x10", b"1.5E+5",
    str(OVERFLOW).encode(), str(OVERFLOW - 1).encode(), b"-" + str(OVERFLOW).encode(),
    b"9" * 400, b"1" + b"0" * 308, b"1" + b"0" * 309,
    b"true", b"false", b"null", b"tru", b"nul", b"truex", b"nulll", b"True", b"NULL",
    b'"\\ud800"', b'"\\udc00"', b'"\\udfff"', b'"\\ud800\\u0041"', b'"\\ud83d\\ude00"',
    b'"\\ud800\\ud800"', b'"\\ud83d\\"', b'"\\ud83d\\n"', b'"\\ud83dx"', b'"\\ud83d\\uDE00"',
    b'"\\ud83d\\ude00\\ud83d"', b'"\\u0000"', b'"\\U0041"', b'"\\x"', b'"\\u00"', b'"\\u00G0"',
    b'"\\/"', b'"\\\'"', b'"\\b\\f\\n\\r\\t\\"\\\\"', b'"\\', b'"\\u', b'"a',
    b'"\x7f"', b'"\x1f"', b'"\x00"', b'"\t"', b'"\n"',
    b'"\xed\xa0\x80"', b'"\xed\x9f\xbf"', b'"\xc0\x80"', b'"\xc1\xbf"', b'"\xc2\x80"',
    b'"\xe0\x9f\xbf"', b'"\xe0\xa0\x80"', b'"\xf0\x8f\xbf\xbf"', b'"\xf0\x90\x80\x80"',
    b'"\xf4\x8f\xbf\xbf"', b'"\xf4\x90\x80\x80"', b'"\xf5\x80\x80\x80"', b'"\xef\xbf\xbf"',
    b'"\xef\xbb\xbf"', b"\xef\xbb\xbf{}", b'"\xc2"', b'"\x80"', b'"\xff"', b"\xff",
    b"\x0c1", b"\x0b1", b"\xa01", b"\x00", b"1\x00", b'{"a":1}\x00', b"/*c*/1", b"1//c",
    b"[1,]", b'{"a":1,}', b"[1 2]", b'{"a" 1}', b"{1:2}", b"[,]", b"[,1]", b"{,}", b'{"a"}',
    b'{"a":}', b"1 2", b"[1]]", b'{"a":1}}', b"[-]", b"-a",
    b'{"model":"gpt-4o","stream":true}',
    b'{"model":1,"model":2}',
    b'{"stream":true,"stream":false}',
    b'{"mod\\u0065l":"m","str\\u0065am":false}',
    b'{"\\u006d\\u006f\\u0064\\u0065\\u006c":{"model":"inner"}}',
    b'{"\\u016dodel":1,"Model":2,"model ":3}',
    b'{"messages":[{"model":"x","stream":true}]}',
    b'["model",{"model":1}]',
    b'{"model":[1,{"model":2}],"stream":null}',
    b' { "model" : "m\\u00e9" , "stream" : "true" } ',
]


@pytest.mark.parametrize("data", REGRESSIONS)
def test_regressions_agree_with_orjson(data: bytes) -> None:
    assert_agrees(data)


def test_error_codes_and_offsets() -> None:
    assert scan_json(b"")[:2] == (JSON_E_EMPTY, 0)
    assert scan_json(b'{"model":')[:2] == (JSON_E_TRUNCATED, 9)
    assert scan_json(b'[1, 1e400]')[:2] == (JSON_E_RANGE, 4)
    assert scan_json(b'["ok", "\\ud800"]')[:2] == (JSON_E_SURROGATE, 8)
    assert scan_json(b'{"a": "\xed\xa0\x80"}')[:2] == (JSON_E_UTF8, 7)


def test_fields_example() -> None:
    body = b'{"model" : "gpt-4o-mini", "messages": [], "stream": true}'
    err, off, start, end, m_kind, s_kind, top = scan_json(body)
    assert (err, off, m_kind, s_kind, top) == (JSON_OK, 0, JSON_STRING, JSON_TRUE, JSON_OBJECT)
    assert body[start:end] == b'"gpt-4o-mini"'


def test_buffer_types() -> None:
    body = b'xx{"model":"m"}yy'
    assert scan_json(body[2:-2])[0] == JSON_OK
    assert scan_json(bytearray(body[2:-2]))[0] == JSON_OK
    view = memoryview(body)[2:-2]  # offsets are relative to the view
    assert scan_json(view)[2:4] == (9, 12)
    with pytest.raises(BufferError):
        scan_json(memoryview(body)[::2])
    with pytest.raises(TypeError):
        scan_json('{"model":"m"}')  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        scan_json()  # type: ignore[call-arg]


@pytest.mark.parametrize("depth", [1, 2, JSON_MAX_DEPTH - 1, JSON_MAX_DEPTH, JSON_MAX_DEPTH + 1])
def test_depth_limit_matches_orjson(depth: int) -> None:
    assert JSON_MAX_DEPTH == 1024
    assert_agrees(b"[" * depth + b"]" * depth)
    assert_agrees(b'{"a":' * depth + b"1" + b"}" * depth)
    assert_agrees(b'{"model":' * depth + b"[]" + b"}" * depth)
    assert_agrees(b"[{" * (depth // 2) + b'"k":' + b"}]" * (depth // 2))
    rnd = random.Random(depth)
    opens = [rnd.choice(["[", '{"x":']) for _ in range(depth)]
    closes = ["]" if o == "[" else "}" for o in reversed(opens)]
    assert_agrees(("".join(opens) + "0" + "".join(closes)).encode())
    if depth > JSON_MAX_DEPTH:
        assert scan_json(b"[" * depth + b"]" * depth)[:2] == (JSON_E_DEPTH, JSON_MAX_DEPTH)


def test_truncated_bodies_are_refused() -> None:
    body = orjson.dumps(
        {"model": "gpt-4o", "messages": [{"role": "user", "content": "h\u00e9 \U0001f600 \\"}],
         "stream": False, "temperature": -0.25e-3}
    )
    for cut in range(len(body)):
        assert scan_json(body[:cut])[:2] == (JSON_E_EMPTY if cut == 0 else JSON_E_TRUNCATED, cut)
    assert_agrees(body)


# ---------------------------------------------------------------- generated documents

KEYS = st.sampled_from(["model", "stream", "messages", "role", "content", "Model", "",
                        "mod\u00e9l"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
              min_size=16, max_size=80)
)
VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(KEYS | st.text(max_size=6), children, max_size=4),
    max_leaves=16,
)
TOP = st.dictionaries(KEYS, VALUES, max_size=6) | VALUES

SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\b": "\\b", "\f": "\\f", "\n": "\\n",
                 "\r": "\\r", "\t": "\\t"}


def render_string(rnd: random.Random, s: str) -> str:
    out = ['"']
    escape_rate = rnd.choice([0.0, 0.1, 1.0])
    for ch in s:
        cp = ord(ch)
        must = ch in '"\\' or cp < 0x20
        if not must and rnd.random() >= escape_rate:
            out.append(ch)
        elif ch in SHORT_ESCAPES and rnd.random() < 0.5:
            out.append(SHORT_ESCAPES[ch])
        elif cp < 0x10000:
            out.append(rnd.choice(["\\u%04x", "\\u%04X"]) % cp)
        else:
            cp -= 0x10000
            out.append(f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04X}")
    out.append('"')
    return "".join(out)


def render_number(rnd: random.Random, v: int | float) -> str:
    if isinstance(v, int):
        return rnd.choice([str(v), str(v), f"{v}E+00", f"{v}e0", f"{v}.000"])
    return rnd.choice([repr(v), repr(v), format(v, ".17e"), format(v, ".3E")])


def render(rnd: random.Random, v: Any) -> str:
    def ws() -> str:
        return "".join(rnd.choice(" \t\n\r") for _ in range(rnd.choice([0, 0, 0, 1, 2])))

    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, (int, float)):
        return render_number(rnd, v)
    if isinstance(v, str):
        return render_string(rnd, v)
    if isinstance(v, list):
        return "[" + ws() + ",".join(ws() + render(rnd, x) + ws() for x in v) + ws() + "]"
    items = [(k, render(rnd, x)) for k, x in v.items()]
    if items and rnd.random() < 0.3:  # a duplicate key, earlier or later: the last one wins
        k = rnd.choice(["model", "stream", items[0][0]])
        items.insert(rnd.randrange(len(items) + 1), (k, render(rnd, rnd.choice([1, "x", True]))))
    return (
        "{" + ws()
        + ",".join(ws() + render_string(rnd, k) + ws() + ":" + ws() + x + ws() for k, x in items)
        + ws() + "}"
    )


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    value = draw(TOP)
    rnd = draw(st.randoms(use_true_random=False))
    if rnd.random() < 0.15:  # the standard library's own spelling, \uXXXX for non-ASCII or not
        return json.dumps(value, ensure_ascii=rnd.random() < 0.5).encode()
    return render(rnd, value).encode()


# Fragments that sit on the boundary between valid and invalid.
FRAGMENTS = [
    b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":", b" ", b"\t", b"\x0c", b"0", b"-", b".",
    b"e", b"E", b"+", b"1e400", b"1e308", b"\\u", b"\\ud800", b"\\udc00", b"\\ud83d\\ude00",
    b"\\u0041", b"\\x", b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82",
    b"\xc3\xa9", b"\xff", b"\x00", b"\x1f", b"\x7f", b"true", b"null", b"nul", b'"model"',
    b'"stream":', b"\xef\xbb\xbf",
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(documents()))
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        piece = draw(st.sampled_from(FRAGMENTS) | st.binary(min_size=1, max_size=2))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        if op == "insert":
            data[pos:pos] = piece
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 3))]
        else:
            data[pos : pos + len(piece)] = piece
    return bytes(data)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents())
def test_generated_documents_agree(data: bytes) -> None:
    assert_agrees(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
@example(b'{"model":"x","stream":tru}')
@example(b'{"model":"x"}\xef\xbb\xbf')
def test_mutated_documents_agree(data: bytes) -> None:
    assert_agrees(data)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=48) | st.lists(st.sampled_from(FRAGMENTS), max_size=12).map(b"".join))
def test_random_bytes_agree(data: bytes) -> None:
    assert_agrees(data)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=12))
def test_tricky_unicode_agrees(text: str) -> None:
    # surrogatepass writes lone surrogates as (invalid) 3-byte UTF-8: both must refuse them.
    raw = text.encode("utf-8", "surrogatepass")
    assert_agrees(b'"' + raw + b'"')
    assert_agrees(b'{"model":"' + raw + b'"}')
    escaped = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c for c in text)
    assert_agrees(('["' + escaped + '"]').encode("utf-8", "surrogatepass"))


@st.composite
def numbers(draw: st.DrawFn) -> bytes:
    """Numbers near the overflow boundary, written many equivalent ways, plus arbitrary
    mantissa/exponent combinations."""
    if draw(st.booleans()):
        magnitude = OVERFLOW + draw(st.integers(-3, 3)) * draw(st.sampled_from([1, 10**250,
                                                                                2**970]))
        digits = str(magnitude)
        point = draw(st.integers(0, len(digits)))  # decimal point position
        lead = draw(st.integers(0, 3))  # extra leading zeros after "0."
        trail = draw(st.integers(0, 3))
        if point == 0:
            mant = "0." + "0" * lead + digits + "0" * trail
            exp = len(digits) + lead
        else:
            frac = digits[point:] + "0" * trail
            mant = digits[:point] + ("." + frac if frac else "")
            exp = len(digits) - point
        text = f"{mant}e{exp}" if exp or draw(st.booleans()) else mant
    else:
        int_part = draw(st.sampled_from(["0", "1", "9", "17976931348623158", "10000"]))
        frac = draw(st.text(alphabet="0123456789", max_size=20))
        exp = draw(st.integers(-400, 400) | st.integers(-(10**25), 10**25))
        text = int_part + ("." + frac if frac else "") + f"e{exp:+d}"
    sign = draw(st.sampled_from(["", "-"]))
    return (sign + text).encode()


@settings(max_examples=500, deadline=None)
@given(numbers())
@example(b"0." + str(OVERFLOW).encode() + b"e309")
@example(b"0." + str(OVERFLOW - 1).encode() + b"e309")
def test_numbers_agree(data: bytes) -> None:
    assert_agrees(data)
    assert_agrees(b'{"model":' + data + b"}")


# ---------------------------------------------------------------- GIL release


def big_body(size: int) -> bytes:
    """A chat request of about `size` bytes whose bulk is multilingual text (so the scan
    takes tens of milliseconds, not two)."""
    text = "Voilà un texte — 長い文章です — naïve café ".encode()
    content = text * (size // len(text))
    return (b'{"model":"gpt-4o","messages":[{"role":"user","content":"' + content
            + b'"}],"stream":true}')


def progress_during(
    fn: Callable[[Any], Any], arg: Any, work: Callable[[object], None] | None = None
) -> tuple[int, Any]:
    """Run fn(arg) in a thread while this thread counts loop iterations of pure Python work
    (plus work(None) once per round, if given); return (iterations completed during the
    call, fn's result).

    The worker reads the counter right before and right after the call. With the switch
    interval raised far above the call's duration, a thread holding the GIL is never asked
    to give it up, so the counter can move between the two reads only if the call itself
    released the GIL. No timing is asserted."""
    counter = [0]
    out: dict[str, Any] = {}
    done = threading.Event()

    def worker() -> None:
        before = counter[0]
        out["result"] = fn(arg)
        out["progress"] = counter[0] - before
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    thread = threading.Thread(target=worker)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            for _ in range(100):
                counter[0] += 1
            if work is not None:
                work(None)
            time.sleep(0.0001)  # lets the worker in when it wants the GIL back
    finally:
        thread.join(timeout=60)
        sys.setswitchinterval(old)
    assert done.is_set(), "worker did not finish"
    return out["progress"], out["result"]


def test_scan_releases_the_gil_and_orjson_does_not() -> None:
    body = big_body(32 << 20)
    assert len(body) >= 32 << 20
    # The scheduler may, rarely, not run this thread during one scan: a few attempts.
    scan_progress = []
    for _ in range(5):
        progress, result = progress_during(scan_json, body)
        err, off, m_start, m_end, m_kind, s_kind, top = result
        assert (err, off, m_kind, s_kind, top) == (JSON_OK, 0, JSON_STRING, JSON_TRUE, JSON_OBJECT)
        assert body[m_start:m_end] == b'"gpt-4o"'
        scan_progress.append(progress)
        if progress > 0:
            break
    assert max(scan_progress) > 0, f"no progress while scan_json ran: {scan_progress}"

    progress, doc = progress_during(orjson.loads, body)
    assert doc["model"] == "gpt-4o"
    assert progress == 0, "orjson.loads was expected to hold the GIL throughout"


def test_buffer_stays_pinned_while_the_gil_is_released() -> None:
    # While the scan holds the buffer export, resizing the bytearray from Python raises
    # BufferError, so the memory the scanner reads cannot move or be freed. The main thread
    # tries to append (spaces: the document stays valid) while the scan runs; seeing the
    # refusal proves both that Python ran during the scan and that the export was held.
    buf = bytearray(big_body(8 << 20))
    refused = 0

    def append_space(_: object) -> None:
        nonlocal refused
        try:
            buf.append(0x20)
        except BufferError:
            refused += 1

    for _ in range(5):
        _, result = progress_during(scan_json, buf, work=append_space)
        assert result[0] == JSON_OK
        if refused:
            break
    assert refused > 0
