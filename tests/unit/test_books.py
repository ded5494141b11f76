"""The per-request bookkeeping's cheap paths give what the plain ones gave.

* The access log's line (velox.admin.accesslog) is built from pre-encoded pieces by one bytes
  format; it must be byte for byte what orjson makes of the line's dict, hostile strings
  included (quotes, backslashes, control bytes, latin-1 and non-BMP text, query strings).
* usage_of reads OpenAI's own member order with a native scan (vx_books_usage) instead of a
  regular expression: same numbers, and anything else still goes the parsing way.
* The token estimate is one native pass (vx_books_estimate) doing what input_tokens and
  output_limit (the reference, in Python) do.
* A keyed request's ticket is native (Limits.ticket): released once, settled once.
* Counters.add_many adds several fields of a slot in one call (what a finished request
  counts), checking every argument first.
"""

from __future__ import annotations

import json
import os
import re
import time
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from velox._native import Counters, Limits, access_line, access_lines, estimate_scan, usage_scan
from velox.admin.accesslog import _MAX_FIELD, AccessLog
from velox.core.types import Kind, Request
from velox.relay.records import access_records
from velox.relay.twins import usage_scan as scan_twin
from velox.relay.usage import estimate, input_tokens, output_limit, usage_of
from velox_lab.pipeline import CHAT_BODY, REPLY_BODY, Pipeline

# --- the access log ------------------------------------------------------------------------


def reference_line(log: AccessLog, item: tuple[Any, ...], wall_offset_ns: int,
                   request_id: str) -> bytes:
    """The line as the log made it before: a dict through orjson (the oracle)."""
    t_end, request, exchange, status, bytes_out = item
    upstream_us = upstream = usage = None
    attempts = 0
    if exchange is not None:
        meter = exchange.meter
        if meter is not None and meter.done:
            usage = {"input": meter.input, "output": meter.output, "exact": meter.exact}
        upstream = exchange.upstream_name.decode() if exchange.upstream_name else None
        attempts = exchange.attempts
        if exchange.t_headers and exchange.t_sent:
            upstream_us = (exchange.t_headers - exchange.t_sent) // 1000
    ms = (t_end + wall_offset_ns) // 1_000_000
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"
    model = request.model
    return orjson.dumps({
        "time": stamp, "log": "access", "worker": log.slot,
        "method": request.method[:16].decode("latin-1"),
        "path": request.path.split(b"?", 1)[0][:_MAX_FIELD].decode("latin-1"),
        "model": model[:_MAX_FIELD] if model else None,
        "status": status, "bytes_in": len(request.body), "bytes_out": bytes_out,
        "upstream": upstream, "attempts": attempts, "upstream_us": upstream_us,
        "total_us": max(0, t_end - request.t_received) // 1000,
        "request_id": request_id,
        "key": log.key_names[request.key] if request.key >= 0 else None,
        "usage": usage,
    }, option=orjson.OPT_APPEND_NEWLINE)


HOSTILE_BYTES = [
    b"/v1/chat/completions", b'/v1/"quoted"', b"/v1/back\\slash", b"/v1/\x00\x01\x1f\x7f",
    b"/v1/\xe9t\xe9\xff", b"/v1/a?api_key=sk-secret", b"/v1/" + b"x" * 600, b"/v1/\t\n\r",
    b"", b"/v1/</script>", b"/v1/\\u0000",
]
HOSTILE_TEXT = [
    "gpt-4o-mini", 'gpt"4', "gpt\\4", "gpt\n4\x00", "gpt-\u00e9\u4e2d\U0001f600", "m" * 700,
    "", None, "\u2028\u2029", "\x7f",
]


def _request(path: bytes, model: str | None, key: int, method: bytes = b"POST") -> Request:
    request = Request(None, method, path, Kind.MODEL_CALL, [], b"{}" * 7,  # type: ignore[arg-type]
                      True, 1_000_000)
    request.model = model
    request.key = key
    return request


def _exchange(request_id: bytes | None, done: bool, exact: bool,
              upstream: bytes = b"primary") -> SimpleNamespace:
    headers = [(b"content-type", b"application/json")]
    if request_id is not None:
        headers.append((b"x-request-id", request_id))
    meter = SimpleNamespace(done=done, input=31, output=4, exact=exact)
    return SimpleNamespace(meter=meter, upstream_name=upstream, attempts=2,
                           t_headers=9_000_000, t_sent=4_000_000, headers=headers)


def test_the_line_is_what_orjson_made_of_the_dict_for_hostile_strings() -> None:
    log = AccessLog(3, fd=-1, key_names=('team "a"', "b\\\u00e9\n"))
    offset = 1_760_000_000_123_456_789
    cases = 0
    for i, path in enumerate(HOSTILE_BYTES):
        for j, model in enumerate(HOSTILE_TEXT):
            raw_id = HOSTILE_BYTES[(i + j) % len(HOSTILE_BYTES)] or None
            request = _request(path, model, (i + j) % 3 - 1,
                               b"PATCH" if j % 2 else b"WEIRD\x01\"METHOD-TOO-LONG")
            for exchange in (None, _exchange(raw_id, j % 2 == 0, i % 2 == 0),
                             _exchange(raw_id, True, True, b"")):
                item = (1_000_000 + 1_234_567_891 * (i + 1), request, exchange, 200 + j, 77 * i)
                line = log.line(item, offset)
                # The request id: the upstream's (latin-1) or one the log made.
                record = orjson.loads(line)
                if exchange is not None and raw_id is not None:
                    assert record["request_id"] == raw_id[:_MAX_FIELD].decode("latin-1")
                else:
                    assert record["request_id"].startswith("velox-3-")
                assert line == reference_line(log, item, offset, record["request_id"]), line
                cases += 1
    assert cases == len(HOSTILE_BYTES) * len(HOSTILE_TEXT) * 3


def test_flush_writes_every_line_and_counts_them(tmp_path: Any) -> None:
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        log = AccessLog(0, fd=fd)
        for n in range(300):
            log.append((time.perf_counter_ns(), _request(b"/v1/x?q=%d" % n, "m", -1), None,
                        200, n))
        assert log.flush() == 300
    finally:
        os.close(fd)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 300
    assert [orjson.loads(line)["bytes_out"] for line in lines] == list(range(300))
    assert {orjson.loads(line)["path"] for line in lines} == {"/v1/x"}


def test_a_line_that_cannot_be_made_is_told_once_and_the_others_are_written(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    # A meter without the fields the line reads (what a meter class missing `done` did): the
    # line is skipped, the reason logged once per worker, the other lines written.
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    bad = SimpleNamespace(meter=SimpleNamespace(), upstream_name=b"u", attempts=1, t_headers=0,
                          t_sent=0, headers=[])
    try:
        log = AccessLog(0, fd=fd)
        with caplog.at_level("ERROR", logger="velox.accesslog"):
            for _ in range(2):
                for n in range(3):
                    log.append((time.perf_counter_ns(), _request(b"/v1/x", "m", -1),
                                bad if n == 1 else None, 200, n))
                assert log.flush() == 2
    finally:
        os.close(fd)
    assert len(path.read_bytes().splitlines()) == 4
    told = [r for r in caplog.records if r.name == "velox.accesslog"]
    assert len(told) == 1 and told[0].exc_info is not None


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])


def test_access_lines_chunks_whole_lines_and_skips_a_bad_item() -> None:
    names = ("k",)
    items: list[Any] = [(2_000_000 + n, _request(b"/v1/%d" % n + b"y" * (n * 37 % 300),
                                                  "m", n % 2 - 1), None, 200, n)
                        for n in range(40)]
    items.append((2_000_000, _request(b"/v1/" + b"z" * 3000, "m", -1), None, 200, 1))  # long
    records: list[Any] = access_records(items)
    records.insert(7, None)  # an item whose fields could not be read
    records.insert(9, ("not", "a", "record"))
    offset = 10**18
    chunks, count = access_lines(records, offset, 1, b"p-", 100, names, 700)
    assert count == 41
    good = [(i, r) for i, r in enumerate(records) if r is not None and r[0] != "not"]
    expected = [access_line(r, offset, 1, b"p-", 100 + 1 + i, names) for i, r in good]
    assert b"".join(chunks) == b"".join(expected)  # every line, in order, ids as access_line's
    for chunk in chunks:
        assert chunk.endswith(b"\n")
        assert len(chunk) <= 700 or chunk.count(b"\n") == 1  # only a long line goes alone
    assert max(len(c) for c in chunks) > 700 and len(chunks) < count
    assert access_lines([], offset, 1, b"p-", 0, names, 1000) == ([], 0)


def test_a_model_that_cannot_be_utf8_and_an_unknown_key_are_null() -> None:
    log = AccessLog(0, fd=-1, key_names=("only",))
    request = _request(b"/v1/x", "bad\ud800surrogate", 5)
    record = orjson.loads(log.line((2_000_000, request, None, 200, 1), 10**18))
    assert record["model"] is None and record["key"] is None
    request = _request(b"/v1/x", "m", 0)
    assert orjson.loads(log.line((2_000_000, request, None, 200, 1), 10**18))["key"] == "only"


# --- usage ---------------------------------------------------------------------------------

# What usage_of found in OpenAI's own order before the native scan: this regular expression.
_OLD_CHAT_USAGE = re.compile(
    rb'"usage"\s*:\s*\{\s*"prompt_tokens"\s*:\s*(\d{1,15})\s*,\s*"completion_tokens"\s*:'
    rb'\s*(\d{1,15})')


def _old_fast(body: bytes) -> tuple[int, int] | None:
    i = body.rfind(b'"usage"')
    if i < 0:
        return None
    m = _OLD_CHAT_USAGE.match(body, i)
    return (int(m.group(1)), int(m.group(2))) if m else None


USAGE_BODIES = [
    REPLY_BODY,
    b'{"usage":{"prompt_tokens":0,"completion_tokens":0}}',
    b'{"usage" : {\n "prompt_tokens" :\t12 ,\r\n "completion_tokens": 345, "total_tokens": 357}}',
    b'{"usage":{"completion_tokens":4,"prompt_tokens":31}}',  # other order
    b'{"usage":{"input_tokens":3,"output_tokens":4}}',  # responses
    b'{"usage":null}', b'{"usage":', b'"usage"', b"", b"{}", b'{"x":"usage"}',
    b'{"usage":{"prompt_tokens":"1","completion_tokens":2}}',
    b'{"usage":{"prompt_tokens":1,"completion_tokens":}}',
    b'{"usage":{"prompt_tokens":1,"completion_tokens":2}, "usage2": 1, "a": {"usage": 5}}',
    b'{"a":{"usage":{"prompt_tokens":1,"completion_tokens":2}},"usage":{"prompt_tokens":7,'
    b'"completion_tokens":8}}',
    b'{"usage":{"prompt_tokens":123456789012345,"completion_tokens":999999999999999}}',
    b'{"usage":{"prompt_tokens":1,"completion_tokens":2',  # cut after the numbers
    b'{"usage":{"prompt_tokens":1,"completion_tokens"',  # cut before
    b'{"usage":{"prompt_tokens":-1,"completion_tokens":2}}',
]


@pytest.mark.parametrize("body", USAGE_BODIES)
def test_usage_scan_finds_what_the_regular_expression_found(body: bytes) -> None:
    found = usage_scan(body)
    old = _old_fast(body)
    if old is not None:
        assert found == old
    elif type(found) is tuple:  # the Messages API's order (velox.relay.twins)
        assert found == scan_twin(body)
    else:
        assert found is (b'"usage"' in body)  # True: read another way; False: none at all
    assert usage_scan(bytearray(body)) == found
    assert usage_scan(memoryview(body)) == found


@pytest.mark.parametrize("body", USAGE_BODIES)
def test_usage_of_gives_what_it_gave(body: bytes) -> None:
    """usage_of with the native scan in front: the same answers as the regex and the parse."""
    expected = _old_fast(body)
    if expected is None and b'"usage"' in body:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            doc = None
        usage = doc.get("usage") if type(doc) is dict else None
        if type(usage) is dict:
            inp = usage.get("prompt_tokens", usage.get("input_tokens"))
            out = usage.get("completion_tokens", usage.get("output_tokens"))
            expected = (inp, out if type(out) is int else 0) if type(inp) is int else None
    assert usage_of(body) == expected


# --- the estimate --------------------------------------------------------------------------

ESTIMATE_BODIES = [
    CHAT_BODY, b"{}", b"[]", b"3", b'{"max_tokens":12}', b'{"max_tokens" :\t 12 ,"x":1}',
    b'{"max_completion_tokens":7,"max_tokens":9}', b'{"max_output_tokens":5}',
    b'{"max_tokens":null,"max_completion_tokens":3}', b'{"max_tokens":"12"}',
    b'{"max_tokens":1234567890123456789}', b'{"max_tokens":-0,"max_output_tokens":-7}',
    b'{"max_tokens":5,"max_tokens":null}', b'{"max_tokens":1e3,"max_output_tokens":2.0}',
    b'{"max_\\u0074okens":3}', b'{"a":{"max_tokens":4}}', b'[{"max_tokens":4}]',
    b'{"a":"data:image/png;base64,' + b"A" * 5000 + b'","b":"x;base64,QQ=="}',
    b'{"input":"' + b"x" * 3001 + b'"}',
    # The finding: ";base64," opening a text made 100 kB count as one image.
    orjson.dumps({"model": "m", "messages": [{"role": "user",
                                              "content": ";base64," + "x" * 100_000}]}),
    orjson.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": ";base64," + "x" * 3000},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4000}}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "max_tokens": 1,
            "image_url": {"url": "data:x;base64," + "B" * 900}}}}]}),
]
# Not JSON at all (the parse stage refuses these first): read safely, all text, no maximum.
NOT_JSON = [b"", b'{"max_tokens":', b'{"max_', b'{"a":"data:image/png;base64,AAAA',
            b'{"max_tokens\\":3}', b'"max_foo":1,"max_tokens":2', b';base64,;base64,"',
            b']]}}"\\"\\', b'{"messages":[{"content":[{"image_url":"x;base64,\\']


@pytest.mark.parametrize("body", ESTIMATE_BODIES + NOT_JSON)
def test_estimate_scan_is_input_tokens_and_output_limit(body: bytes) -> None:
    limit = output_limit(body)
    expected = (input_tokens(body), -1 if limit is None else limit)
    assert estimate_scan(body) == expected
    assert estimate_scan(memoryview(body)) == expected


def test_inline_images_count_only_where_the_schema_puts_them() -> None:
    text = ESTIMATE_BODIES[-2]
    assert estimate_scan(text) == (-(-len(text) // 4), -1)  # was 765 tokens
    mixed = ESTIMATE_BODIES[-1]
    # Only the image part's payload is an image; the tool schema's decoy is text, and so is
    # its max_tokens.
    assert estimate_scan(mixed) == (-(-(len(mixed) - 4000) // 4) + 765, -1)


# --- hostile JSON: the differential --------------------------------------------------------

class _Obj(list):  # type: ignore[type-arg]
    """A JSON object as pairs, so generated documents can repeat a key."""


_KEYS = ["messages", "input", "content", "image_url", "url", "source", "data", "type", "text",
         "max_tokens", "max_completion_tokens", "max_output_tokens", "model", "tools", "x"]
_PIECES = [";base64,", "data:image/png;base64,", "AAAA", "\\", '"', "/", "é", "\u2028",
           "\U0001F600", "max_tokens", ";", "base64", ","]
_STRINGS = st.lists(st.sampled_from(_PIECES) | st.text(max_size=6), max_size=6).map("".join)
_NUMBERS = st.integers(-5, 10**6) | st.integers(-10**20, 10**20) | st.sampled_from(
    [0.0, 1.5, 1e3, -0.0])
_LEAVES = _NUMBERS | _STRINGS | st.sampled_from([None, True, False])


def _values(depth: int) -> st.SearchStrategy[Any]:
    if depth == 0:
        return _LEAVES
    inner = _values(depth - 1)
    return _LEAVES | st.lists(inner, max_size=3) | st.lists(
        st.tuples(st.sampled_from(_KEYS), inner), max_size=4).map(_Obj)


@st.composite
def hostile_bodies(draw: st.DrawFn) -> bytes:
    """JSON texts shaped like chat and Responses requests, with images, decoys, repeated and
    escaped keys, escaped payload bytes and odd numbers at every level the scan reads."""
    value = _values(2)
    marked = st.tuples(_STRINGS, _STRINGS).map(";base64,".join) | _STRINGS
    image = marked | st.lists(st.tuples(st.sampled_from(["url", "detail", "url"]),
                                        marked | value), max_size=3).map(_Obj)
    source = st.lists(st.tuples(st.sampled_from(["data", "type", "data"]), _STRINGS | value),
                      max_size=3).map(_Obj)
    noise = st.tuples(st.sampled_from(_KEYS), value)
    part = st.lists(st.one_of(st.tuples(st.just("image_url"), image),
                              st.tuples(st.just("source"), source), noise),
                    min_size=1, max_size=4).map(_Obj)
    item = st.lists(st.tuples(st.just("content"), st.lists(part, min_size=1, max_size=3))
                    | noise, min_size=1, max_size=3).map(_Obj)
    lists = st.tuples(st.sampled_from(["messages", "input"]),
                      st.lists(item, min_size=1, max_size=3))
    maxima = st.tuples(st.sampled_from(_KEYS[9:12]), _NUMBERS | _LEAVES)
    top = draw(st.lists(lists, min_size=1, max_size=2)) + draw(st.lists(noise, max_size=4)) \
        + draw(st.lists(maxima, max_size=3))
    top = draw(st.permutations(top))
    escape = draw(st.booleans())  # \uXXXX for every non-ASCII character, \/ for slashes
    spell = draw(st.integers(0, 3))  # keys spelt with an escaped letter now and then

    def dump(v: Any) -> str:
        if isinstance(v, _Obj):
            return "{" + ",".join(key(k) + " \t" * (spell == 3) + ":" + dump(x)
                                  for k, x in v) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(dump(x) for x in v) + "]"
        if isinstance(v, str):
            out = json.dumps(v, ensure_ascii=escape)
            return out.replace("/", "\\/") if escape else out
        return json.dumps(v)

    def key(k: str) -> str:
        if spell == 1 and len(k) > 3:
            return '"' + k[:2] + f"\\u{ord(k[2]):04x}" + k[3:] + '"'
        return json.dumps(k)

    body = dump(_Obj(top)).encode()
    orjson.loads(body)  # a valid JSON text, as the parse stage hands it on
    return body


@settings(max_examples=int(os.environ.get("VELOX_FUZZ_EXAMPLES", "200")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(body=hostile_bodies())
def test_estimate_scan_equals_its_reference_on_hostile_bodies(body: bytes) -> None:
    limit = output_limit(body)
    assert estimate_scan(body) == (input_tokens(body), -1 if limit is None else limit), body


def test_estimate_adds_the_default_output_capped_and_skips_embeddings() -> None:
    request = _request(b"/v1/chat/completions", "m", -1)
    request.body = b'{"model":"m"}'  # 13 bytes: 4 tokens, no maximum
    assert estimate(request, 100) == 104
    assert estimate(request, 100, cap=10) == 14
    request.body = b'{"model":"m","max_tokens":5}'
    assert estimate(request, 100, cap=10) == 7 + 5
    request.path = b"/v1/embeddings?x=1"
    assert estimate(request, 100) == 7


# --- counters --------------------------------------------------------------------------------


def test_add_many_adds_each_pair_and_checks_everything_first() -> None:
    counters = Counters(2, 10)
    counters.add_many(1, 0, 1, 3, 700, 9, -2)
    counters.add_many(1, 0, 1)
    assert counters.snapshot()[1] == [2, 0, 0, 700, 0, 0, 0, 0, 0, -2]
    assert counters.snapshot()[0] == [0] * 10
    for bad in ((1, 0, 1, 10, 1), (2, 0, 1), (1, 0, 1, 3), (1,), (1, 0, "x")):
        with pytest.raises((IndexError, TypeError, ValueError, OverflowError)):
            counters.add_many(*bad)
    assert counters.snapshot()[1] == [2, 0, 0, 700, 0, 0, 0, 0, 0, -2]  # nothing half-added
    with pytest.raises(TypeError):
        counters.add_many(0, *([0, 1] * 17))


def test_a_pipeline_round_counts_what_it_counted_before() -> None:
    """on_response's add_many and the ledger's: requests, classes, bytes, tokens."""
    pipeline = Pipeline(clients=8, codec="native")
    pipeline.round()
    totals = pipeline.worker.shared.totals()
    written = pipeline.responses_written()
    pipeline.round()
    after = pipeline.worker.shared.totals()
    assert after["requests"] - totals["requests"] == 8
    assert after["resp_2xx"] - totals["resp_2xx"] == 8
    assert after["bytes_out"] - totals["bytes_out"] == pipeline.responses_written() - written
    assert after["upstream_requests"] - totals["upstream_requests"] == 8
    assert pipeline.worker.shared.token_rows() == [("-", "*", 2 * 8 * 31, 2 * 8 * 4)]


# --- key tickets -----------------------------------------------------------------------------


def test_a_native_ticket_releases_and_settles_once() -> None:
    limits = Limits(4, slots=2)
    limits.configure(1, 1000, 1000)  # entry 1: a token bucket
    assert limits.admit(-1, 1, 100, 0, 0, 1) < 0  # gauge 0 entered by slot 1, 100 tokens taken
    key = object()
    ticket = limits.ticket(key, 0, 1, 1, 100)
    assert (ticket.key, ticket.reserved, ticket.released, ticket.settled) == (key, 100, False,
                                                                               False)
    assert limits.active(0) == 1
    ticket.release()
    ticket.release()
    assert ticket.released and limits.active(0) == 0  # left once, not twice
    taken = limits.taken(1)
    ticket.settle(30)  # 70 of the 100 go back
    ticket.settle(0)
    assert ticket.settled and limits.taken(1) == taken - 70
    over = limits.ticket(key, 0, 1, 1, 10)
    level = limits.level(1)
    over.settle(50)  # 40 more than reserved: charged
    assert limits.level(1) == level - 40
    assert limits.ticket(key, 0, -1, 1, 0).settled  # no token bucket: nothing to settle
    with pytest.raises(ValueError):
        over.settle(-1)
    with pytest.raises((IndexError, ValueError)):
        limits.ticket(key, 9, -1, 0, 0)
    del limits  # the tickets keep the shared mapping alive
    ticket.release()
    over.release()
