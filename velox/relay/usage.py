"""Token accounting: estimate a request's tokens, read the real usage, settle the difference.

Estimate (at admission, before anything is sent). No tokenizer is used: none ships with the
gateway and nothing may be downloaded at run time, so the input is estimated from the body's
bytes at `BYTES_PER_TOKEN` = 4 bytes per token (OpenAI's own rule of thumb for English text).
The whole body is counted, JSON syntax included: reading the message texts alone would mean
parsing the body a second time, and the overestimate is small (a short chat's envelope is
about 60 bytes, 15 tokens) and corrected at settlement. Inline images are not text: a base64
payload where the schema puts an image (a content part's `image_url.url`, or the Responses API's
`image_url` string, after its `;base64,`; a `source.data`) is replaced by `IMAGE_TOKENS`, so a
1 MB image does not reserve 250,000 tokens. Only there: `;base64,` in a message's text is text
(counting it as an image let 100 KB of text pass as 765 tokens). The output is the largest of
the top-level `max_completion_tokens`, `max_tokens` and `max_output_tokens` when given, else
VELOX_TOKENS_DEFAULT_OUTPUT (capped by the caller at the limit itself, so a small tpm does not
refuse every first request); the same keys deeper in the body (a tool's JSON schema) are not
the request's maximum; embeddings have no output. The native scan (`estimate_scan`,
native/vx_books.c) reads both in one pass; `input_tokens` and `output_limit` below are its
reference, written from the parsed document and kept equal by a differential test.

The estimate is computed only where a tpm needs it (the keys stage, the balancer); what a request
cut short is charged for its input is kept when the meter is made (body bytes / 4, the base64
rule applied to bodies over 2 kB), since the body is released once the answer starts.

Exact (when the answer ends): the `usage` the upstream reports. A JSON answer carries it in its
body (chat `prompt_tokens`/`completion_tokens`, responses `input_tokens`/`output_tokens`,
embeddings `prompt_tokens`); it is found from the last `"usage"` key (OpenAI's own member order
read by one native scan, `usage_scan`; any other by parsing the answer, or only its usage object
when the answer is over 4 kB). A streamed chat or completions request is sent upstream with
`stream_options: {"include_usage": true}` added when the client did not ask for it
(`add_include_usage`: the key is inserted after the body's opening brace, the rest byte for
byte), and `SSEUsage` then reads the final usage chunk and, when the client did not ask, removes
that chunk and the `"usage":null` member the upstream adds to every other chunk, so the client
sees exactly the events it would have seen without the gateway. A responses stream reports its
usage in its `response.completed` event, which is passed through. At most `_HOLD_MAX` bytes of an
unfinished event are held per stream: a longer event is passed through unread.

Most requests (not streamed, no key ticket, no upstream tpm: only the token counters need the
numbers) have nothing to settle when they end: their `TokenMeter` counts a plain answer's usage
as soon as the body is seen (`early`), and its `finish` then has nothing left to do.

Cut short (the client left, the upstream broke, no usage arrived): the request is charged its
estimated input plus the output relayed so far, one token per relayed event (OpenAI streams one
token per chunk), or relayed bytes / 4 for a plain body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from velox import _native
from velox.relay import twins

# The scans a request and its answer go through: the native ones, or with VELOX_NATIVE=0 their
# twins (`use`). Callers outside this module (velox.spend.wire) read them from it at call time,
# so one switch selects them everywhere.
_Body = bytes | bytearray | memoryview
estimate_scan: Callable[[_Body], tuple[int, int]] = _native.estimate_scan
# spend's pricing: the usage with its parts
usage_parts_scan: Callable[[_Body], tuple[int, int, int, int, int] | bool] = \
    _native.usage_parts_scan
usage_scan: Callable[[_Body], tuple[int, int] | bool] = _native.usage_scan

if TYPE_CHECKING:
    from velox.core.types import Request

BYTES_PER_TOKEN = 4
# What one inline base64 image or audio clip is reserved as (a high-detail 1024x1024 image is
# 765 tokens by OpenAI's published formula); settlement replaces it with the real figure.
IMAGE_TOKENS = 765
DEFAULT_OUTPUT = 1024  # VELOX_TOKENS_DEFAULT_OUTPUT's default

_OUTPUT_KEYS = frozenset(("max_tokens", "max_completion_tokens", "max_output_tokens"))
OUTPUT_CAP = 10**15  # a larger maximum counts as this (the callers cap at a limit anyway)
_LISTS = frozenset(("messages", "input"))  # the arrays whose content parts hold images
_BASE64 = ";base64,"
_SMALL_BODY = 2048
# The longest unfinished event a stream's meter holds back or copies (usage chunks are a few
# hundred bytes; a longer event is passed through unread).
_HOLD_MAX = 65536
# A usage object: members whose values are scalars or objects of scalars.
_USAGE_OBJECT = re.compile(rb"\{(?:[^{}]+|\{[^{}]*\})*\}")
# Answers up to this size are parsed whole (one orjson call is cheaper than finding the usage
# object first); larger ones (embeddings) have only their usage object parsed.
_WHOLE = 4096
_SPACE = b" \t\r\n"

# Paths whose streams get `stream_options.include_usage` (the others have no such option).
_INCLUDE_USAGE_PATHS = frozenset({b"/v1/chat/completions", b"/v1/completions"})
_EMBEDDINGS = b"/v1/embeddings"


# --- estimate --------------------------------------------------------------------------------


class _Pairs(list):  # type: ignore[type-arg]
    """A JSON object as its (key, value) pairs, duplicates kept (json's object_pairs_hook)."""


def _document(body: bytes | bytearray | memoryview) -> object:
    """The body parsed with every object as its pairs; None when it is no JSON text (then
    all of it is text and it has no maximum)."""
    try:
        return json.loads(bytes(body), object_pairs_hook=_Pairs)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        return None


def _payload(value: object, whole: bool) -> int:
    """Decoded UTF-8 bytes of an inline payload string (after its ";base64," unless `whole`),
    -1 when it is not one."""
    if type(value) is not str:
        return -1
    if not whole:
        at = value.find(_BASE64)
        if at < 0:
            return -1
        value = value[at + len(_BASE64):]
    return len(value.encode("utf-8", "surrogatepass"))


def _payloads(doc: object) -> list[int]:
    """The payloads where the schema puts images (see vx_books.h): top.messages/input[i]
    .content[j] .image_url(.url) and .source.data, every occurrence."""
    found: list[int] = []
    if type(doc) is not _Pairs:
        return found
    for key, items in doc:
        if key not in _LISTS or type(items) is not list:
            continue
        for item in items:
            if type(item) is not _Pairs:
                continue
            for name, parts in item:
                if name != "content" or type(parts) is not list:
                    continue
                for part in parts:
                    if type(part) is not _Pairs:
                        continue
                    for field, value in part:
                        if field == "image_url":
                            if type(value) is _Pairs:
                                found += [_payload(v, False) for k, v in value if k == "url"]
                            else:
                                found.append(_payload(value, False))
                        elif field == "source" and type(value) is _Pairs:
                            found += [_payload(v, True) for k, v in value if k == "data"]
    return [n for n in found if n >= 0]


def input_tokens(body: bytes | bytearray | memoryview) -> int:
    """Estimated input tokens of a JSON request body (see the module docstring): the
    reference of the native scan (estimate_scan), written from the parsed document."""
    found = _payloads(_document(body))
    return -(-(len(body) - sum(found)) // BYTES_PER_TOKEN) + len(found) * IMAGE_TOKENS


def output_limit(body: bytes | bytearray | memoryview) -> int | None:
    """The request's output maximum: the largest of the top-level max_tokens,
    max_completion_tokens and max_output_tokens that are non-negative integers (each key's
    last occurrence, as JSON parsers keep it; capped at OUTPUT_CAP), None if none is. The
    same keys deeper (a tool's JSON schema) are not the request's. Reference of the native
    scan, like input_tokens."""
    doc = _document(body)
    if type(doc) is not _Pairs:
        return None
    last = {key: value for key, value in doc if key in _OUTPUT_KEYS}
    limits = [min(v, OUTPUT_CAP) for v in last.values() if type(v) is int and v >= 0]
    return max(limits) if limits else None


def estimate_twin(body: bytes | bytearray | memoryview) -> tuple[int, int]:
    """estimate_scan's twin: (input tokens, output maximum or -1), by input_tokens and
    output_limit (two parses of the body where the scan makes one pass)."""
    limit = output_limit(body)
    return input_tokens(body), -1 if limit is None else limit


def use(native: bool) -> None:
    """Select the scans: VELOX_NATIVE=0 the twins (velox.relay.twins, estimate_twin), which
    read the same numbers (tests/unit/test_books.py, tests/unit/test_usage_scan.py). The
    worker calls this once; a worker is a process of its own, so module globals are the
    cheapest switch (as velox.ingress.h1write.use)."""
    global estimate_scan, usage_parts_scan, usage_scan  # noqa: PLW0603 - the switch
    if native:
        estimate_scan, usage_parts_scan = _native.estimate_scan, _native.usage_parts_scan
        usage_scan = _native.usage_scan
    else:
        estimate_scan, usage_parts_scan = estimate_twin, twins.usage_parts_scan
        usage_scan = twins.usage_scan


def bare_path(path: bytes) -> bytes:
    q = path.find(b"?")
    return path if q < 0 else path[:q]


_default_output = DEFAULT_OUTPUT


def set_default_output(tokens: int) -> None:
    """VELOX_TOKENS_DEFAULT_OUTPUT, for every estimate of this process (the worker sets it)."""
    global _default_output  # noqa: PLW0603 - one setting, read by every estimate of the process
    _default_output = tokens


def estimate(request: Request, default_output: int | None = None, cap: int = 0) -> int:
    """Estimated input + output tokens of a model call. The default output (used when the body
    gives no maximum; VELOX_TOKENS_DEFAULT_OUTPUT unless given) is capped at `cap` when
    cap > 0 (the limit the reservation is taken from), so a small limit still admits a first
    request (velox.admission.keys also caps the whole estimate at the key's tpm)."""
    if default_output is None:
        default_output = _default_output
    # Both searches in one native pass over the body (vx_books_estimate; input_tokens and
    # output_limit above are its reference, kept equal by tests): ~0.3 us instead of ~2.
    tokens, out = estimate_scan(request.body)
    path = request.path
    if path.startswith(_EMBEDDINGS) and bare_path(path) == _EMBEDDINGS:
        return tokens
    if out >= 0:
        return tokens + out
    return tokens + (min(default_output, cap) if cap > 0 else default_output)


# --- the body sent upstream ------------------------------------------------------------------


def wants_usage(path: bytes, stream: bool) -> bool:
    """A streamed call whose upstream can be asked for a usage chunk."""
    return stream and bare_path(path) in _INCLUDE_USAGE_PATHS


def client_asked_usage(body: bytes | bytearray | memoryview) -> bool:
    """The body itself sets stream_options.include_usage to true."""
    data = bytes(body) if isinstance(body, memoryview) else body
    if data.find(b'"stream_options"') < 0:
        return False
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    options = doc.get("stream_options") if type(doc) is dict else None
    return type(options) is dict and options.get("include_usage") is True


def add_include_usage(body: bytes | bytearray | memoryview) -> bytes:
    """The body with stream_options.include_usage set to true.

    Without a `stream_options` key (the usual case) the member is inserted right after the
    opening brace and nothing else changes: one copy of the body. With one (asking for something
    else), the document goes through an orjson round trip, which keeps every value but may
    change insignificant whitespace."""
    data = bytes(body)
    if data.find(b'"stream_options"') < 0:
        i = data.find(b"{")
        if i >= 0:
            j = i + 1
            n = len(data)
            while j < n and data[j] in _SPACE:
                j += 1
            sep = b"" if j < n and data[j] == 0x7D else b","  # '}': an empty object
            return b"".join((data[:i + 1], b'"stream_options":{"include_usage":true}', sep,
                             data[i + 1:]))
    doc = orjson.loads(data)
    options = doc.get("stream_options")
    doc["stream_options"] = {**options, "include_usage": True} if type(options) is dict \
        else {"include_usage": True}
    return orjson.dumps(doc)


# --- the real usage ------------------------------------------------------------------------


def _usage_numbers(usage: object) -> tuple[int, int] | None:
    """(input, output) of a usage object of any of OpenAI's shapes, or the Messages API's."""
    if type(usage) is not dict:
        return None
    inp = usage.get("prompt_tokens")
    if inp is None:
        inp = usage.get("input_tokens")
        # The Messages API counts its prompt-cache writes and reads beside input_tokens; they
        # are input all the same (OpenAI's prompt_tokens include its cached part), as the
        # native scan reads them.
        for part in ("cache_creation_input_tokens", "cache_read_input_tokens"):
            extra = usage.get(part)
            if type(inp) is int and type(extra) is int:
                inp += extra
    out = usage.get("completion_tokens")
    if out is None:
        out = usage.get("output_tokens")
    if type(inp) is not int:
        return None
    return inp, out if type(out) is int else 0


def usage_of(body: bytes | bytearray) -> tuple[int, int] | None:
    """(input, output) tokens of a JSON answer's `usage`, or None when it has none.

    The usage object is the last `"usage"` key (OpenAI puts it near the end of every shape;
    a responses object nests it inside `response` for its stream events): only that object is
    parsed, matched by a regular expression: an object of numbers and objects of numbers, nested
    two deep at most (its `*_details`), holding no strings with braces in them. OpenAI's own
    member order is read first by one native scan (vx_books_usage)."""
    found = usage_scan(body)  # OpenAI's own order, read natively (vx_books): ~0.2 us
    if found is False:
        return None  # no "usage" key at all
    if found is not True:
        return found
    i = body.rfind(b'"usage"')
    if len(body) <= _WHOLE:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if type(doc) is not dict:
            return None
        usage = doc.get("usage")
        if usage is None and type(doc.get("response")) is dict:  # a responses stream event
            usage = doc["response"].get("usage")
        return _usage_numbers(usage)
    while i >= 0:
        j = i + 7
        n = len(body)
        while j < n and body[j] in _SPACE:
            j += 1
        if j < n and body[j] == 0x3A:
            j += 1
            while j < n and body[j] in _SPACE:
                j += 1
            if j < n and body[j] == 0x7B:  # '{'
                m = _USAGE_OBJECT.match(body, j)
                if m is not None:
                    try:
                        return _usage_numbers(orjson.loads(m.group()))
                    except orjson.JSONDecodeError:
                        return None
            return None
        i = body.rfind(b'"usage"', 0, i)
    return None


# --- streams ---------------------------------------------------------------------------------

_NULL_MEMBERS = (b'"usage":null', b'"usage": null')


def strip_null_usage(event: bytes) -> bytes:
    """The event without a `"usage":null` member (and its comma), the rest byte for byte."""
    for pattern in _NULL_MEMBERS:
        i = event.find(pattern)
        if i < 0:
            continue
        j = i + len(pattern)
        k = i - 1
        while k >= 0 and event[k] in _SPACE:
            k -= 1
        if k >= 0 and event[k] == 0x2C:  # ',' before: drop ",<space>"usage":null"
            return event[:k] + event[j:]
        m = j
        while m < len(event) and event[m] in _SPACE:
            m += 1
        if m < len(event) and event[m] == 0x2C:  # ',' after: drop '"usage":null,<space>'
            m += 1
            while m < len(event) and event[m] in _SPACE:
                m += 1
            return event[:i] + event[m:]
        return event[:i] + event[j:]
    return event


class SSEUsage:
    """Reads the usage of an event stream as it is relayed; optionally removes what the
    gateway's own `include_usage` added.

    `feed(data)` returns the bytes to send to the client now. Without stripping that is `data`
    itself (only a copy of the unfinished last event is kept, to be read when it ends); with
    stripping, whole events are sent once they end (an event is of no use to a client before
    its blank line anyway), so an event split across any DATA frames is still recognised.
    """

    __slots__ = ("strip", "pending", "input", "output", "found", "events", "relayed",
                 "skipping", "last", "usage_data")

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.pending = b""  # the unfinished last event
        self.input = 0
        self.output = 0
        self.found = False  # a usage was read
        self.events = 0  # events relayed (a removed usage chunk excluded)
        self.relayed = 0  # bytes relayed
        self.skipping = False  # inside an event longer than _HOLD_MAX: passed unread
        self.last = b""  # the last byte passed while skipping (a blank line may straddle)
        # The data of the first and the last event that gave a usage (one event for OpenAI;
        # Anthropic's message_start and message_delta): read for their cached and reasoning
        # parts by whoever prices the stream (velox.spend.wire), not here.
        self.usage_data: tuple[bytes, ...] = ()

    def feed(self, data: bytes) -> bytes:
        if self.skipping:
            return self._skip(data)
        if self.pending:
            buf = self.pending + data
        else:
            buf = data
            if data.endswith(b"\n\n"):  # whole events: the usual DATA frame
                if b'"usage"' not in data:  # nothing to read or remove
                    self.events += data.count(b"\n\n")
                    self.relayed += len(data)
                    return data
                if data.find(b"\n\n") == len(data) - 2:  # exactly one event
                    if self.strip:  # _event's first case inlined: the usual OpenAI chunk
                        i = data.find(b',"usage":null')
                        if i >= 0:
                            self.events += 1
                            out = data[:i] + data[i + 13:]
                            self.relayed += len(out)
                            return out
                    out = self._event(data)
                    if not self.strip:
                        out = data
                    self.relayed += len(out)
                    return out
        end = _last_boundary(buf)
        if end < 0:
            if len(buf) > _HOLD_MAX:
                # An event this long is no usage chunk: it goes through unread (the memory
                # held per stream stays bounded whatever the upstream sends).
                self.pending = b""
                self.skipping = True
                self.last = buf[-1:]
                out = buf if self.strip else data
                self.relayed += len(out)
                return out
            self.pending = buf
            if self.strip:
                return b""
            self.relayed += len(data)
            return data
        self.pending = buf[end:]
        out = self._events(buf[:end])
        if not self.strip:
            self.relayed += len(data)
            return data
        self.relayed += len(out)
        return out

    def _skip(self, data: bytes) -> bytes:
        """Inside an over-long event: pass bytes through up to its end, then read again."""
        end = b"\n" + data[:3] if self.last == b"\n" else data[:0]  # a blank line split
        i = end.find(b"\n\n")
        if i >= 0:
            cut = i + 1  # bytes of `data` up to the boundary
        else:
            j = data.find(b"\n\n")
            k = data.find(b"\r\n\r\n")
            cut = -1 if j < 0 and k < 0 else min(x for x in (j + 2 if j >= 0 else -1,
                                                             k + 4 if k >= 0 else -1) if x >= 0)
        if cut < 0:
            self.last = data[-1:] if data else self.last
            self.relayed += len(data)
            return data
        self.skipping = False
        self.events += 1
        head, rest = data[:cut], data[cut:]
        self.relayed += len(head)
        return head + self.feed(rest) if rest else head

    def flush(self) -> bytes:
        """The end of the stream: what is left (an event without its blank line)."""
        rest, self.pending = self.pending, b""
        if not rest:
            return b""
        out = self._events(rest)
        if self.strip:
            self.relayed += len(out)
            return out
        return b""

    def _events(self, block: bytes) -> bytes:
        """Read (and when stripping, edit) every event of `block`; return what to send."""
        if b'"usage"' not in block:  # the common case: nothing to read or remove
            self.events += _count_data(block)
            return block
        return b"".join([self._event(event) for event in _split_events(block)])

    def _event(self, event: bytes) -> bytes:
        """One whole event: read its usage; when stripping, what is left of it to send."""
        if self.strip:
            i = event.find(b',"usage":null')  # the upstream's compact form, the usual one
            if i >= 0:
                self.events += 1
                return event[:i] + event[i + 13:]
        if b'"usage"' in event:
            numbers = data = None
            if b'"usage":null' not in event and b'"usage": null' not in event:
                data = _data_of(event)
                numbers = usage_of(data)
            if numbers is None and self.found and b'"message_delta"' in event:
                data = _data_of(event) if data is None else data
                numbers = _messages_output(data, self.input)
            if numbers is not None and data is not None:
                self.input, self.output = numbers
                self.found = True
                self.usage_data = (self.usage_data[0], data) if self.usage_data else (data,)
                if self.strip and b'"choices":[]' in event.replace(b" ", b""):
                    return b""  # the usage chunk the client did not ask for
            elif self.strip:
                event = strip_null_usage(event)
        self.events += _count_data(event)
        return event

    def relayed_output(self) -> int:
        """Output tokens relayed so far, estimated: one per data event."""
        return self.events


def _messages_output(data: bytes, inp: int) -> tuple[int, int] | None:
    """A Messages stream's message_delta: its usage may give only the output (the input came
    with message_start, read before it)."""
    try:
        usage = orjson.loads(data).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    out = usage.get("output_tokens") if type(usage) is dict else None
    return (inp, out) if type(out) is int else None


def _data_of(event: bytes) -> bytes:
    """The data of one event: its `data:` lines' values joined by newlines (the SSE rule)."""
    lines = [line[5:].lstrip(b" ") if line.startswith(b"data:") else None
             for line in event.splitlines()]
    values = [v for v in lines if v is not None]
    return values[0] if len(values) == 1 else b"\n".join(values)


def _last_boundary(buf: bytes) -> int:
    """Index past the last event boundary (a blank line) in buf, -1 when none."""
    i = buf.rfind(b"\n\n")
    j = buf.rfind(b"\r\n\r\n")
    if i < 0 and j < 0:
        return -1
    return max(i + 2 if i >= 0 else -1, j + 4 if j >= 0 else -1)


def _split_events(block: bytes) -> list[bytes]:
    """Events of a block of whole events, each with its terminating blank line."""
    out: list[bytes] = []
    start = 0
    n = len(block)
    while start < n:
        i = block.find(b"\n\n", start)
        j = block.find(b"\r\n\r\n", start)
        if i < 0 and j < 0:
            out.append(block[start:])
            break
        end = j + 4 if j >= 0 and (i < 0 or j <= i) else i + 2
        out.append(block[start:end])
        start = end
    return out


def _count_data(block: bytes) -> int:
    """Data events in a block that carry content ([DONE] excluded)."""
    return block.count(b"data:") - block.count(b"data: [DONE]") - block.count(b"data:[DONE]")


# --- the meter -----------------------------------------------------------------------------


class Meter(Protocol):
    """What the relay tells the accounting of one request (None on the exchange when nobody
    accounts it). Each call is made at most once per answer, `finish` exactly once."""

    @property
    def estimate(self) -> int:
        """The request's estimated tokens, reserved where a tpm applies."""
        ...

    def for_attempt(self, body: bytes | bytearray | memoryview,
                    stream_usage: bool) -> bytes | bytearray | memoryview:
        """The body to send on an attempt to an upstream (`stream_usage`: it accepts
        stream_options.include_usage)."""
        ...

    def response(self, status: int, sse: bool) -> None:
        """The answer the client gets starts (after any retries) as an event stream (the relay
        calls it for those only: a plain answer has nothing for the meter before `body`)."""
        ...

    def data(self, data: bytes) -> bytes:
        """A streamed piece: returns what to send to the client instead."""
        ...

    def end(self) -> bytes:
        """The stream ended normally: the last bytes to send."""
        ...

    def stream_feed(self) -> Callable[[bytes], bytes] | None:
        """After `response` of an event stream: the callable `data` comes down to when it does
        nothing else (an SSEUsage's feed), for the relay to call per piece directly; None when
        `data` does more."""
        ...

    def body(self, body: bytes) -> None:
        """A whole (non-streamed) answer body."""
        ...

    def finish(self, exchange: Any, status: int) -> None:
        """The request is over, whatever ended it (the relay's Exchange, before its route
        attempt is finished): settle the reservations, count the tokens."""
        ...


# request.key of a call whose tokens are booked by others: a merged embeddings call, whose members
# each book their own share under their own key (velox.batching.batch). Its meter still settles the
# upstream's tpm for the whole call.
NOT_BOOKED = -2
# The token counts are blocks of 4096 fields (stats.TOKEN_BLOCK; stats is not imported here).
_BLOCK_SHIFT = 12
_BLOCK_MASK = (1 << _BLOCK_SHIFT) - 1


class Ledger:
    """One worker's token books: counts per key and route (shared counters in blocks of 4096
    fields, field = ((key + 1) x routes + route) x 2 + kind, kind 0 input, 1 output) and the
    upstreams' tpm buckets (velox.state.health.UpstreamTokens, or None when no upstream has one)."""

    __slots__ = ("counters", "slot", "routes", "catch_all", "forward", "width", "tpm",
                 "default_output", "keys")

    def __init__(self, counters: tuple[Any, ...], slot: int, route_models: tuple[str, ...],
                 tpm: Any, default_output: int = DEFAULT_OUTPUT, keys: int = 1 << 30) -> None:
        self.counters = counters
        # Rows of keys in the books: the file's keys, sized at start. A key made at run time
        # (request.key from `keys` on: velox.admission.keys.KeyNames) is booked under no key
        # here; its own counts are in the key table's segment (KF.TOKENS_IN/OUT).
        self.keys = keys
        self.slot = slot
        self.routes = {m: i for i, m in enumerate(route_models)}
        self.catch_all = self.routes.get("*", -1)
        # A request without a model goes to the catch-all route, else the first (dispatch).
        self.forward = self.catch_all if self.catch_all >= 0 else 0
        self.width = len(route_models)
        self.tpm = tpm
        self.default_output = default_output

    def count(self, request: Request, inp: int, out: int) -> None:
        """A request's tokens into its key's and model's route's counters (one call: this runs
        for most requests, at their answer's body)."""
        model = request.model
        route = self.forward if model is None else self.routes.get(model, self.catch_all)
        key = request.key
        if route < 0 or key == NOT_BOOKED:
            return
        if key >= self.keys:
            key = -1
        field = ((key + 1) * self.width + route) * 2  # even: both kinds in the same block
        counters = self.counters[field >> _BLOCK_SHIFT]
        field &= _BLOCK_MASK
        counters.add_many(self.slot, field, inp, field + 1, out)  # adding 0 changes nothing


def input_estimate(body: bytes | bytearray | memoryview) -> int:
    """What a request cut short is charged for its input. A small body is bytes / 4 outright
    (no search: any inline payload in 2 kB would be charged less than IMAGE_TOKENS anyway)."""
    size = len(body)
    return -(-size // BYTES_PER_TOKEN) if size <= _SMALL_BODY else estimate_scan(body)[0]


class TokenMeter:
    """The accounting of one request (the relay's `Meter`): its estimate, what the answer says
    it used, and the settlement of every reservation when it ends."""

    __slots__ = ("ledger", "request", "cap", "_estimate", "estimated_input", "ask", "strip",
                 "sse", "tail", "input", "output", "exact", "done", "early")
    # An answer without usage is charged its estimated input and what was relayed (below);
    # ReportedMeter's endpoints are charged nothing they do not report.
    charge_unreported = True

    def __init__(self, ledger: Ledger, request: Request, strip: bool = False,
                 cap: int = 0, estimated_input: int = -1) -> None:
        self.ledger = ledger
        self.request = request
        self.cap = cap
        self._estimate = -1  # computed when a tpm needs it (`estimate`)
        # What a request cut short is charged: kept now, since the body is released once the
        # answer starts.
        if estimated_input < 0:  # input_estimate, inlined: a call is 1/6 of a meter's making
            body = request.body
            size = len(body)
            estimated_input = -(-size // BYTES_PER_TOKEN) if size <= _SMALL_BODY else \
                estimate_scan(body)[0]
        self.estimated_input = estimated_input
        self.ask = strip  # a stream whose usage the client did not ask for: the gateway asks
        self.strip = strip  # the gateway added include_usage: remove what it brings
        self.sse: SSEUsage | None = None
        self.tail = b""  # the end of a plain body streamed past the relay's buffer
        self.input = 0  # tokens used, once known (or charged, when cut short)
        self.output = 0
        self.exact = False  # input/output come from the upstream's usage
        self.done = False
        # Nothing to settle at the end (not streamed, no key ticket, no upstream tpm: only the
        # counters need the numbers): a plain answer's usage is counted when its body is seen,
        # and `finish` finds the meter done. That skips the settlement's Python for the common
        # request (~3 us when it was a meter class of its own, which drifted from this one
        # once: one meter now).
        self.early = not request.stream and request.ticket is None and ledger.tpm is None

    @property
    def estimate(self) -> int:
        """The request's estimated input + output tokens (computed once, from the client's
        body: call it while the body is held, before the answer starts)."""
        tokens = self._estimate
        if tokens < 0:
            tokens = estimate(self.request, self.ledger.default_output, self.cap)
            self._estimate = tokens
        return tokens

    @classmethod
    def for_request(cls, ledger: Ledger, request: Request, cap: int = 0) -> TokenMeter:
        """A meter for a model call; a stream that can report its usage is asked to (the body
        is rewritten per attempt) unless the client asked itself."""
        meter = cls(ledger, request, False, cap)
        if request.stream and wants_usage(request.upstream_path, True) and \
                not client_asked_usage(request.body):
            meter.ask = True  # each attempt's body gets the option (for_attempt)
        return meter

    # --- the relay's Meter ----------------------------------------------------------------

    def for_attempt(self, body: bytes | bytearray | memoryview,
                    stream_usage: bool) -> bytes | bytearray | memoryview:
        if not self.ask:
            return body
        self.strip = stream_usage  # the attempt that answers decides
        return add_include_usage(body) if stream_usage else body

    def response(self, status: int, sse: bool) -> None:
        if sse:
            self.sse = SSEUsage(self.strip and status < 300)

    def data(self, data: bytes) -> bytes:
        sse = self.sse
        if sse is not None:
            return sse.feed(data)
        tail = self.tail + data
        self.tail = tail[-4096:]
        return data

    def stream_feed(self) -> Callable[[bytes], bytes] | None:
        sse = self.sse
        return None if sse is None else sse.feed

    def end(self) -> bytes:
        sse = self.sse
        if sse is not None:
            return sse.flush()
        numbers = usage_of(self.tail)
        if numbers is not None:
            self.input, self.output = numbers
            self.exact = True
        return b""

    def body(self, body: bytes) -> None:
        numbers = usage_of(body)
        if numbers is not None:
            self.input, self.output = numbers
            self.exact = True
            if self.early:  # nothing to settle: counted now, and finish has nothing to do
                self.done = True
                self.ledger.count(self.request, self.input, self.output)

    def finish(self, exchange: Any, status: int) -> None:
        if self.done:
            return
        self.done = True
        sse = self.sse
        if sse is not None and sse.found:
            self.input, self.output = sse.input, sse.output
            self.exact = True
        if not self.exact:
            if not self.charge_unreported:
                self.input = self.output = 0
            elif exchange.t_headers and 200 <= exchange.status < 300:
                # Cut short, or an answer without usage: its input and what was relayed.
                self.input = self.estimated_input
                self.output = sse.relayed_output() if sse is not None else \
                    -(-exchange.size // BYTES_PER_TOKEN)
            elif status == 499 and exchange.attempts:
                # The client left while the upstream was working on it: its input was read.
                self.input, self.output = self.estimated_input, 0
            else:
                self.input = self.output = 0  # refused or failed: nothing was generated
        used = self.input + self.output
        ticket = self.request.ticket
        if ticket is not None:  # the key's reservation (a KeyTicket: settles once)
            ticket.settle(used)
            if used:
                ticket.key.used(self.input, self.output)  # its own token count (any key)
        attempt = exchange.routing.attempt
        ledger = self.ledger
        if attempt is not None and attempt.tokens:
            reserved, attempt.tokens = attempt.tokens, 0
            ledger.tpm.settle(attempt.upstream, reserved, used)
        if used:
            ledger.count(self.request, self.input, self.output)


class ReportedMeter(TokenMeter):
    """The meter of the other model-bearing endpoints (images, audio, moderations: route
    MODEL_OTHER). Their bodies are files, images or short texts, not tokens to estimate, and
    their answers are often no JSON (audio) or carry no usage (DALL-E, whisper-1): only the
    usage an answer reports is counted and settled (gpt-image-1, gpt-4o-transcribe report
    theirs), anything else counts nothing. A tpm reserves 1 token for such a request, so a
    key in debt is refused; what it then reports is charged (debt when over)."""

    __slots__ = ()
    charge_unreported = False

    def __init__(self, ledger: Ledger, request: Request) -> None:
        super().__init__(ledger, request, False, 0, 0)
        self._estimate = 1
