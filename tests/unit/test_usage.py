"""velox.relay.usage without sockets: the estimate, reading usage, the SSE usage stripping at every
DATA frame boundary, and the body rewrite that asks for the usage chunk."""

from __future__ import annotations

import base64

import orjson
import pytest

from velox.core.types import Kind, Request
from velox.relay import usage
from velox.relay.exchange import UNROUTED
from velox_lab.mock import payloads


def _request(path: bytes, body: bytes) -> Request:
    return Request(None, b"POST", path, Kind.MODEL_CALL, [], body, True, 0)  # type: ignore[arg-type]


def _chat(**extra: object) -> bytes:
    return orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x" * 400}],
                         **extra})


# --- estimate --------------------------------------------------------------------------------


def test_input_is_body_bytes_over_four() -> None:
    body = _chat()
    assert usage.input_tokens(body) == -(-len(body) // 4)
    assert usage.input_tokens(memoryview(body)) == usage.input_tokens(body)
    assert usage.input_tokens(b"") == 0


def test_inline_base64_counts_as_one_image() -> None:
    image = base64.b64encode(b"\x00" * 300_000).decode()
    body = orjson.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + image}}]}]})
    tokens = usage.input_tokens(body)
    text_bytes = len(body) - len(image)
    assert tokens == -(-text_bytes // 4) + usage.IMAGE_TOKENS
    assert tokens < 1000  # not 100,000 tokens for 400 kB of base64


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens", "max_output_tokens"])
def test_output_from_the_body(key: str) -> None:
    body = _chat(**{key: 77})
    assert usage.output_limit(body) == 77
    assert usage.estimate(_request(b"/v1/chat/completions", body)) == \
        usage.input_tokens(body) + 77


def test_output_spaced_and_not_confused_by_strings_or_schemas() -> None:
    assert usage.output_limit(b'{"model": "m", "max_tokens" :  12 }') == 12
    # the key's name inside a string is escaped; a schema property has no integer value
    body = orjson.dumps({"model": "m", "messages": [{"content": '"max_tokens": 5'}],
                         "tools": [{"parameters": {"max_tokens": {"type": "integer"}}}]})
    assert usage.output_limit(body) is None
    assert usage.output_limit(b'{"max_tokens":null,"max_completion_tokens":9}') == 9


def test_default_output_capped_at_the_limit() -> None:
    body = _chat()
    req = _request(b"/v1/chat/completions", body)
    inp = usage.input_tokens(body)
    assert usage.estimate(req, default_output=1000) == inp + 1000
    assert usage.estimate(req, default_output=1000, cap=300) == inp + 300
    emb = _request(b"/v1/embeddings?x=1", b'{"model":"e","input":"hello"}')
    assert usage.estimate(emb, default_output=1000) == usage.input_tokens(emb.body)


# --- body rewrite ----------------------------------------------------------------------------


def test_add_include_usage_inserts_one_member() -> None:
    body = _chat(stream=True)
    out = usage.add_include_usage(body)
    assert out == b'{"stream_options":{"include_usage":true},' + body[1:]
    assert orjson.loads(out) == {**orjson.loads(body), "stream_options": {"include_usage": True}}
    spaced = b'  { "model": "m", "stream": true }'
    assert orjson.loads(usage.add_include_usage(spaced))["stream_options"] == \
        {"include_usage": True}
    assert usage.add_include_usage(b"{}") == b'{"stream_options":{"include_usage":true}}'
    assert usage.add_include_usage(memoryview(b'{ }')) == \
        b'{"stream_options":{"include_usage":true} }'


def test_add_include_usage_keeps_other_options() -> None:
    body = _chat(stream=True, stream_options={"include_obfuscation": False})
    doc = orjson.loads(usage.add_include_usage(body))
    assert doc["stream_options"] == {"include_obfuscation": False, "include_usage": True}
    assert doc["messages"] == orjson.loads(body)["messages"]


def test_client_asked_usage() -> None:
    assert usage.client_asked_usage(_chat(stream=True, stream_options={"include_usage": True}))
    assert not usage.client_asked_usage(_chat(stream=True, stream_options={"include_usage": False}))
    assert not usage.client_asked_usage(_chat(stream=True))
    assert usage.wants_usage(b"/v1/chat/completions?a=b", True)
    assert not usage.wants_usage(b"/v1/chat/completions", False)
    assert not usage.wants_usage(b"/v1/responses", True)


# --- reading usage ---------------------------------------------------------------------------


def test_usage_of_every_shape() -> None:
    req = {"messages": [{"role": "user", "content": "y" * 40}], "prompt": "p" * 40,
           "input": "i" * 40}
    chat = payloads.chat_completion(req, "gpt-4o", "u", 1, 6)
    u = orjson.loads(chat)["usage"]
    assert usage.usage_of(chat) == (u["prompt_tokens"], u["completion_tokens"])
    comp = payloads.completion(req, "gpt-4o", "u", 1, 6)
    u = orjson.loads(comp)["usage"]
    assert usage.usage_of(comp) == (u["prompt_tokens"], u["completion_tokens"])
    emb = payloads.embeddings(req, "e", ["a" * 40, "b" * 80])
    assert usage.usage_of(emb) == (orjson.loads(emb)["usage"]["prompt_tokens"], 0)
    resp = payloads.response(req, "gpt-4o", "u", 1, 5)
    u = orjson.loads(resp)["usage"]
    assert usage.usage_of(resp) == (u["input_tokens"], u["output_tokens"])
    assert usage.usage_of(b'{"error":{"message":"no"}}') is None
    assert usage.usage_of(b'{"usage":null}') is None
    # a "usage" inside a string is escaped and not taken for the key
    tricky = orjson.dumps({"content": 'say "usage": {"prompt_tokens": 9}',
                           "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    assert usage.usage_of(tricky) == (3, 4)


# --- stripping ---------------------------------------------------------------------------------


def _stream(client_asks: bool) -> tuple[list[bytes], list[bytes]]:
    """The mock's chat stream as the upstream sends it (with include_usage) and as the client
    would get it straight from the mock (with or without)."""
    req = {"messages": [{"role": "user", "content": "z" * 100}], "stream": True}
    asked = {**req, "stream_options": {"include_usage": True}}
    upstream = payloads.chat_completion_stream(asked, "gpt-4o", "abc", 7, 8)
    direct = payloads.chat_completion_stream(asked if client_asks else req, "gpt-4o", "abc", 7, 8)
    return upstream, direct


def _run(meter: usage.SSEUsage, pieces: list[bytes]) -> bytes:
    return b"".join(meter.feed(p) for p in pieces) + meter.flush()


def test_strip_gives_the_client_the_direct_stream() -> None:
    upstream, direct = _stream(client_asks=False)
    meter = usage.SSEUsage(strip=True)
    assert _run(meter, upstream) == b"".join(direct)
    u = orjson.loads(upstream[-2][6:])["usage"]
    assert (meter.input, meter.output) == (u["prompt_tokens"], u["completion_tokens"])
    assert meter.found
    assert meter.events == len(direct)  # every event relayed (the usage chunk was not)


def test_strip_at_every_byte_boundary() -> None:
    upstream, direct = _stream(client_asks=False)
    whole = b"".join(upstream)
    expected = b"".join(direct)
    u = orjson.loads(upstream[-2][6:])["usage"]
    for cut in range(len(whole) + 1):
        meter = usage.SSEUsage(strip=True)
        assert _run(meter, [whole[:cut], whole[cut:]]) == expected, cut
        assert (meter.input, meter.output) == (u["prompt_tokens"], u["completion_tokens"]), cut
    # and one byte per frame
    meter = usage.SSEUsage(strip=True)
    assert _run(meter, [whole[i:i + 1] for i in range(len(whole))]) == expected
    assert meter.found


def test_pass_through_when_the_client_asked() -> None:
    upstream, direct = _stream(client_asks=True)
    assert upstream == direct
    whole = b"".join(upstream)
    u = orjson.loads(upstream[-2][6:])["usage"]
    for cut in range(0, len(whole) + 1, 7):
        meter = usage.SSEUsage(strip=False)
        out = [meter.feed(whole[:cut]), meter.feed(whole[cut:]), meter.flush()]
        assert out == [whole[:cut], whole[cut:], b""]  # the very same bytes, as they came
        assert (meter.input, meter.output) == (u["prompt_tokens"], u["completion_tokens"])


def test_crlf_events_and_spaced_null() -> None:
    events = [b'data: {"id":"a", "usage": null, "choices":[{"delta":{"content":"hi"}}]}\r\n\r\n',
              b'data: {"usage": null}\r\n\r\n',
              b'data: {"id":"a","choices": [], "usage": {"prompt_tokens": 5, '
              b'"completion_tokens": 2}}\r\n\r\n',
              b"data: [DONE]\r\n\r\n"]
    meter = usage.SSEUsage(strip=True)
    out = _run(meter, events)
    assert out == (b'data: {"id":"a", "choices":[{"delta":{"content":"hi"}}]}\r\n\r\n'
                   b"data: {}\r\n\r\n" b"data: [DONE]\r\n\r\n")
    assert (meter.input, meter.output) == (5, 2)


def test_cut_short_counts_relayed_events() -> None:
    upstream, _direct = _stream(client_asks=False)
    meter = usage.SSEUsage(strip=True)
    for event in upstream[:4]:
        meter.feed(event)
    assert not meter.found
    assert meter.relayed_output() == 4


def test_responses_stream_usage_read_in_passing() -> None:
    req = {"input": "w" * 80, "stream": True}
    events = payloads.response_stream(req, "gpt-4o", "r", 1, 5)
    meter = usage.SSEUsage(strip=False)
    whole = b"".join(events)
    assert _run(meter, [whole[:100], whole[100:]]) == whole
    done = orjson.loads(events[-1].split(b"data: ", 1)[1])["response"]["usage"]
    assert (meter.input, meter.output) == (done["input_tokens"], done["output_tokens"])


@pytest.mark.parametrize("strip", [True, False])
def test_an_over_long_event_passes_unread_and_memory_stays_bounded(strip: bool) -> None:
    # A 300 kB event (a hostile or odd upstream) in 1000-byte frames, then the usage chunk:
    # the long event goes through as it is, no more than _HOLD_MAX + a frame is ever held,
    # and the usage chunk after it is still read (and removed when stripping).
    long_event = b"data: " + b"x" * 300_000 + b"\n\n"
    tail_events = [b'data: {"id":"a","choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n',
                   b'data: {"id":"a","choices":[],"usage":{"prompt_tokens":7,'
                   b'"completion_tokens":3}}\n\n', b"data: [DONE]\n\n"]
    whole = long_event + b"".join(tail_events)
    for cut in (0, 1, 7, 999):  # the long event's blank line: 7 splits it across frames
        frames = [whole[:cut]] + [whole[i:i + 1000] for i in range(cut, len(whole), 1000)]
        meter = usage.SSEUsage(strip)
        out = []
        for frame in frames:
            out.append(meter.feed(frame))
            assert len(meter.pending) <= usage._HOLD_MAX + 1000
        out.append(meter.flush())
        expected = (long_event + b'data: {"id":"a","choices":[{"delta":{"content":"hi"}}]}\n\n'
                    + b"data: [DONE]\n\n") if strip else whole
        assert b"".join(out) == expected, cut
        assert (meter.input, meter.output) == (7, 3)


# --- early: the common case's meter, counting at the body, does what settling at the end does --


class _Counters:
    """A token block of the shared counters, recording what is added (the native Counters)."""

    def __init__(self) -> None:
        self.added: dict[tuple[int, int], int] = {}

    def add_many(self, slot: int, *pairs: int) -> None:
        for field, value in zip(pairs[::2], pairs[1::2], strict=False):
            if value:
                self.added[slot, field] = self.added.get((slot, field), 0) + value


class _Exchange:
    def __init__(self, status: int, size: int, answered: bool = True) -> None:
        self.t_headers = 1 if answered else 0
        self.status = status
        self.size = size
        self.attempts = 1
        self.routing = UNROUTED


def _settle(early: bool, request: Request, status: int, answer: bytes | None,
            sse: list[bytes] | None = None, answered: bool = True,
            seen: dict[bool, tuple[object, ...]] | None = None) -> dict[tuple[int, int], int]:
    """What a meter settling `early` or at the end counts for one request answered as given,
    driven as the relay drives it (response only for an event stream, body for a plain answer,
    finish once); `seen[early]` gets what the access log reads of the meter afterwards."""
    counters = _Counters()
    ledger = usage.Ledger((counters,), 3, ("gpt-4o", "*"), None)
    meter = usage.TokenMeter.for_request(ledger, request)
    assert meter.early  # not streamed, no ticket, no tpm: the common case
    meter.early = early
    assert meter.for_attempt(request.body, True) is request.body
    size = 0
    if sse is not None:
        meter.response(status, True)
        for piece in sse:
            size += len(meter.data(piece))
        meter.end()
    elif answer is not None:
        meter.body(answer)
        size = len(answer)
    meter.finish(_Exchange(status, size, answered), status)
    meter.finish(_Exchange(status, size, answered), status)  # a second call changes nothing
    if seen is not None:
        seen[early] = (meter.done, meter.input, meter.output, meter.exact)
    return counters.added


_OPENAI = (b'{"id":"x","object":"chat.completion","choices":[],'
           b'"usage":{"prompt_tokens":31,"completion_tokens":4,"total_tokens":35}}')
_REORDERED = orjson.dumps({"usage": {"completion_tokens": 4, "prompt_tokens": 31}, "id": "x"})
_IMAGE = _chat(image="data:image/png;base64," + "A" * 4000)


@pytest.mark.parametrize("model,body,status,answer,sse,answered", [
    ("gpt-4o", _chat(), 200, _OPENAI, None, True),  # the common case: counted at the body
    ("other", _chat(), 200, _OPENAI, None, True),  # the catch-all route
    (None, _chat(), 200, _OPENAI, None, True),  # no model: the catch-all
    ("gpt-4o", _chat(), 200, _REORDERED, None, True),  # usage only Python reads
    ("gpt-4o", _chat(), 200, b'{"id":"x"}', None, True),  # no usage: charged its estimate
    ("gpt-4o", _IMAGE, 200, b'{"id":"x"}', None, True),  # over 2 kB: the base64 rule
    ("gpt-4o", _chat(), 200, None, [b'data: {"choices":[{"delta":{}}]}\n\n',
                                    b"data: [DONE]\n\n"], True),  # an event stream all the same
    ("gpt-4o", _chat(), 499, None, None, False),  # the client left while the upstream worked
    ("gpt-4o", _chat(), 502, None, None, False),  # failed: nothing generated
    ("gpt-4o", _chat(), 500, b'{"error":{}}', None, True),  # an error answer: nothing
])
def test_counting_early_counts_what_settling_at_the_end_counts(
        model: str | None, body: bytes, status: int, answer: bytes | None,
        sse: list[bytes] | None, answered: bool) -> None:
    got: dict[bool, dict[tuple[int, int], int]] = {}
    seen: dict[bool, tuple[object, ...]] = {}
    for early in (True, False):
        request = _request(b"/v1/chat/completions", body)
        request.model = model
        got[early] = _settle(early, request, status, answer, sse, answered, seen)
    assert got[True] == got[False]
    # The access log's usage (done, input, output, exact) is the same either way.
    assert seen[True] == seen[False]
    if answer is _OPENAI:  # read by the native scan alone, and counted
        assert type(usage.usage_scan(_OPENAI)) is tuple
        assert sorted(got[True].values()) == [4, 31]
    # Refused or failed answers generate nothing; every other case counts something.
    assert bool(got[True]) == (status < 300 or status == 499)


def test_only_the_common_case_settles_early() -> None:
    ledger = usage.Ledger((_Counters(),), 3, ("gpt-4o", "*"), None)
    plain = _request(b"/v1/chat/completions", _chat())
    assert usage.TokenMeter.for_request(ledger, plain).early
    streamed = _request(b"/v1/chat/completions", _chat())
    streamed.stream = True
    assert not usage.TokenMeter.for_request(ledger, streamed).early
    keyed = _request(b"/v1/chat/completions", _chat())
    keyed.ticket = object()  # type: ignore[assignment]
    assert not usage.TokenMeter.for_request(ledger, keyed).early
    counted = usage.TokenMeter.for_request(ledger, plain)
    counted.body(_OPENAI)  # counted at the body: the settlement has nothing left to do
    assert counted.done and (counted.input, counted.output, counted.exact) == (31, 4, True)
