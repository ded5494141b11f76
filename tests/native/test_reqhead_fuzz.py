"""Differential fuzz of the native request-head parser (native/vx_reqhead.c) against httptools
(llhttp), and of ingress's two paths against each other.

1. Parser against parser: generated and mutated request heads go to `_native.reqhead` and to
   httptools, the latter fed the same bytes split in two at EVERY byte boundary (and whole).
   Whenever the native parser accepts a head, httptools accepts it too and reports the same
   method, target, header fields (names lower-cased), Content-Length, keep-alive, version, no
   upgrade, and the body starts where the native parser says the head ends. The native parser
   never accepts what httptools rejects, nor what ingress's httptools path refuses at header
   time (a missing, repeated or invalid Host, more than MAX_FIELDS fields, another target
   form); generated heads usually carry one valid Host and oddly none, two or an invalid one.
   Every proper prefix of an accepted head is "need more", and a head found at an offset of a
   buffer parses the same.
2. Ingress against ingress: the same traffic (pipelined requests, bodies, chunked ones that
   send the connection over to httptools mid-way, garbage) fed in random pieces to two
   ClientConnections, one on VELOX_INGRESS_PARSER=native and one on httptools: the Requests
   they produce (method, path, route, headers, body, keep-alive, caller) and every byte they
   write, close and refusal are identical.

`make test` runs a bounded number of examples; VELOX_FUZZ_EXAMPLES=2000 runs more.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benches.bench_ingress import REQUESTS
from velox import _native
from velox.config.settings import load
from velox.core.types import Request
from velox.ingress.arena import Arena
from velox.ingress.auth import Auth
from velox.ingress.connection import _HOST, MAX_FIELDS, ClientConnection, IngressState

from ..ends import sent

EXAMPLES = int(os.environ.get("VELOX_FUZZ_EXAMPLES", "150"))
MAX_HEADER = 1024  # small, so the 431 path (fallback) is reached by generated heads
MAX_BODY = 600

# --- generated heads --------------------------------------------------------------------------

_TCHAR = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-!#$%&'*+.^_`|~"
TOKEN = st.text(alphabet=_TCHAR, min_size=1, max_size=10).map(str.encode)


# (usual, odd) choices for each part of a head: a head takes an odd choice for each part with
# a chance set per test, so heads stay near the subset's edges instead of failing at their
# first byte.
METHODS = (
    st.sampled_from([b"GET", b"POST", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS",
                     b"PATCH"]),
    st.sampled_from([b"CONNECT", b"TRACE", b"get", b"PRI", b"POSTX", b"OPTIONSX"]) | TOKEN)
TARGETS = (
    st.sampled_from([
        b"/v1/chat/completions", b"/v1/embeddings", b"/v1/models", b"/", b"/healthz",
        b"/readyz", b"/v1/../x", b"/v1//x", b"/v1/a%2fb", b"/v1/a\\b", b"/nowhere",
        b"/v1/chat/completions?a=1#f", b"/\"<>{}|^`~",
    ]) | st.text(alphabet=[chr(c) for c in range(0x21, 0x7f)], max_size=20).map(
        lambda t: b"/" + t.encode()),
    st.sampled_from([b"*", b"http://example.com/v1/models", b"a:443",  # absolute-form ...
                     b"HTTPS://h:443/v1/chat/completions?a=1", b"http://h", b"http://h?x",
                     b"http://u@h/v1/models", b"http:///v1/models", b"http://h%/v1/models",
                     b"ftp://h/v1/models", b"http://h/v1/../x"])
    | st.binary(min_size=1, max_size=20))
# b"": an HTTP/0.9 request line, which has no version (see heads).
VERSIONS = (st.sampled_from([b"HTTP/1.1"] * 4 + [b"HTTP/1.0"]),
            st.sampled_from([b"HTTP/2.0", b"HTTP/1.2", b"http/1.1", b"HTTP/1.1 ", b"HTTP/1.",
                             b"HTTP/0.9", b""]))
_HOST_BYTES = "ABCXYZabcxyz0189-._~!$&'()*+,;=%[]:"
# Host fields (RFC 9112 §3.2): usually one valid one; oddly none, two, or an invalid value.
HOSTS = (
    st.sampled_from([b"127.0.0.1:8080", b"localhost", b"api.openai.com", b"[::1]:8080", b"",
                     b"h ", b"h\t"]).map(lambda v: [b"Host: " + v])
    | st.text(alphabet=_HOST_BYTES, max_size=12).map(lambda v: [b"host: " + v.encode()]),
    st.just([])
    | st.sampled_from([[b"Host: a", b"Host: a"], [b"host: a", b"HOST: b"]])
    | st.sampled_from([[b"Host: a/b"], [b"Host: u@h"], [b"Host: a b"], [b"Host: \xc3\xa9"],
                       [b"Host: a\"b"], [b"Host: a#"], [b" Host: a"], [b"Host : a"]])
    | st.binary(min_size=1, max_size=8).filter(
        lambda b: not set(b) & set(b"\r\n")).map(lambda v: [b"Host: " + v]))
NAMES = (
    st.sampled_from([
        b"Host", b"content-type", b"Authorization", b"authorization", b"Content-Length",
        b"CONTENT-LENGTH", b"Connection", b"connection", b"Expect", b"Keep-Alive",
        b"x-stainless-lang", b"Accept", b"TE", b"Trailer", b"User-Agent", b"traceparent",
        b"TraceParent", b"TRACEPARENT", b"tracestate", b"traceparentx",
    ]) | TOKEN,
    st.sampled_from([b"Transfer-Encoding", b"Upgrade", b"Proxy-Connection", b"X Space", b"",
                     b"x-\x80", b"x(y", b"x\x00"]))
VALUES = (
    st.sampled_from([
        b"close", b"Close", b"keep-alive", b"Keep-Alive", b"100-continue", b"100-Continue",
        b"0", b"5", b"007", b"12", b"Bearer sk-x", b"Bearer sk-bad", b"bearer  sk-x", b"",
        b"application/json", b"\x80\xff", b"a b\tc", b"h2c", b"chunked",
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    ]) | st.binary(max_size=16).filter(
        lambda b: not set(b) & set(b"\r\n\x7f") and all(c > 31 or c == 9 for c in b)),
    st.sampled_from([b"upgrade", b"close, keep-alive", b"-1", b"1,1", b"+3",
                     b"99999999999999999999", b"a\x7fb", b"a\x00b", b"5 ", b" "])
    | st.binary(max_size=16).filter(lambda b: b"\r" not in b and b"\n" not in b))
SEPARATORS = (st.sampled_from([b": ", b": ", b":", b":  ", b":\t", b": \t"]),
              st.sampled_from([b" :", b"\t:", b";"]))
TRAILING = (st.just(b""), st.sampled_from([b" ", b"\t", b" \t"]))
EOLS = (st.just(b"\r\n"), st.sampled_from([b"\n", b"\r", b"\r\r\n", b"\r\n "]))
MUTANTS = st.sampled_from(list(b" \t\r\n:\x00\x7f\x80,A0/"))


@st.composite
def heads(draw: st.DrawFn, odd: int = 12, mutate: int | None = None) -> bytes:
    """One request head (blank line included); each part takes its odd choice about once in
    `odd` draws (0: never), and about one head in `mutate` (default `odd`) gets one to three
    byte mutations anywhere."""
    mutate = odd if mutate is None else mutate

    def part(choices: tuple[st.SearchStrategy[bytes], st.SearchStrategy[bytes]]) -> bytes:
        return draw(choices[1] if odd and draw(st.integers(1, odd)) == 1 else choices[0])

    def rarely() -> bool:
        return bool(odd) and draw(st.integers(1, 3 * odd)) == 1

    line = b" ".join(p for p in (part(METHODS), part(TARGETS), part(VERSIONS)) if p)
    if rarely():
        line = line.replace(b" ", b"  ", 1)
    out = [b"\r\n"] if rarely() else []
    out += [line, part(EOLS)]
    fields = []
    for _ in range(draw(st.integers(0, 8))):
        fields.append(b"".join([part(NAMES), part(SEPARATORS), part(VALUES), part(TRAILING),
                                part(EOLS)]))
    for host in part(HOSTS):
        fields.insert(draw(st.integers(0, len(fields))), host + b"\r\n")
    out += fields
    if odd and draw(st.integers(1, odd)) == 1:  # near the cap on the number of fields
        many = draw(st.integers(MAX_FIELDS - len(fields) - 3, MAX_FIELDS - len(fields) + 1))
        out += [b"f%d: 1\r\n" % i for i in range(many)]
    if draw(st.integers(0, 5)) == 0:
        out += [b"x-long: ", b"y" * draw(st.integers(0, 1100)), b"\r\n"]
    out.append(b"\r\n")
    raw = bytearray(b"".join(out))
    if mutate and draw(st.integers(1, mutate)) == 1:
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, len(raw) - 1))
            kind = draw(st.integers(0, 2))
            if kind == 0:
                raw[at] = draw(MUTANTS)
            elif kind == 1:
                raw.insert(at, draw(MUTANTS))
            elif len(raw) > 1:
                del raw[at]
    return bytes(raw)


# --- httptools as the reference ---------------------------------------------------------------

class _Reference:
    """What httptools reports for the first request of the bytes it is fed."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.head: tuple[Any, ...] | None = None
        self.done: tuple[Any, ...] | None = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        p = self.parser
        self.head = (p.get_method(), self.url, self.headers, p.should_upgrade())

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        if self.done is None:
            p = self.parser
            self.done = (p.get_method(), self.url, self.headers, p.should_keep_alive(),
                         p.get_http_version(), p.should_upgrade(), self.body)


def reference(pieces: list[bytes]) -> tuple[tuple[Any, ...] | None, str | None]:
    """(the first complete request as httptools saw it, the error it raised, if any)."""
    ref = _Reference()
    try:
        for piece in pieces:
            ref.parser.feed_data(piece)
    except httptools.HttpParserUpgrade:
        return ref.done, "upgrade"
    except httptools.HttpParserError as exc:
        return ref.done, f"{type(exc).__name__}: {exc}"
    return ref.done, None


def check_head(raw: bytes) -> bool:
    """The differential check of one head; returns whether the native parser accepted it."""
    got = _native.reqhead(raw, 0, MAX_HEADER)
    if not isinstance(got, tuple):
        return False
    method, target, headers, length, authorization, expect, keep_alive, http10, end, tp = got
    assert 0 < end <= len(raw) and raw[end - 4:end] == b"\r\n\r\n"
    # The body httptools will read: exactly what the Content-Length says.
    body = bytes(range(48, 58)) * (max(length, 0) // 10 + 1)
    data = raw[:end] + body[:max(length, 0)]
    expected = (method, target, headers, keep_alive, "1.0" if http10 else "1.1", False,
                data[end:])
    whole, error = reference([data])
    assert error is None, f"native accepted what httptools rejects ({error}): {raw!r}"
    assert whole == expected, f"{raw!r}\nnative:    {expected}\nhttptools: {whole}"
    for cut in range(1, len(data)):
        split, error = reference([data[:cut], data[cut:]])
        assert error is None and split == expected, (raw, cut, error, split)
    # What ingress takes from the fields, the same from both.
    lengths = [int(v) for n, v in headers if n == b"content-length"]
    assert length == (lengths[0] if lengths else -1) and len(lengths) <= 1
    auths = [v for n, v in headers if n == b"authorization"]
    assert len(auths) <= 1  # two are left to httptools' path, which refuses them
    assert authorization == (auths[0] if auths else None)
    assert authorization is None or authorization is auths[0]
    assert expect == any(n == b"expect" and v.lower() == b"100-continue" for n, v in headers)
    # The traceparent flag: the one field's value (that object), b"" for two or more.
    parents = [v for n, v in headers if n == b"traceparent"]
    if len(parents) == 1:
        assert tp is parents[0]
    else:
        assert tp == (b"" if parents else None)
    count = len(target) + sum(len(n) + len(v) + 4 for n, v in headers)
    assert count <= MAX_HEADER
    # Nothing ingress's httptools path refuses at header time (RFC 9112 §3.2: one Host, none
    # only with HTTP/1.0; at most MAX_FIELDS fields; origin-form) is accepted natively.
    hosts = [v for n, v in headers if n == b"host"]
    assert len(hosts) == 1 or (http10 and not hosts), raw
    assert all(_HOST.fullmatch(v.rstrip(b" \t")) for v in hosts), raw
    assert len(headers) <= MAX_FIELDS and target.startswith(b"/")
    # Every proper prefix needs more; the same head at an offset parses the same.
    for cut in range(end):
        assert _native.reqhead(raw[:cut], 0, MAX_HEADER) is None, (raw, cut)
    shifted = _native.reqhead(b"xyz" + raw, 3, MAX_HEADER)
    assert shifted == (*got[:-2], end + 3, tp)
    return True


_FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# The costlier examples (every byte boundary of a conversation, 8 to 14 requests each): fewer.
_FUZZ_FEW = settings(_FUZZ, max_examples=max(10, EXAMPLES // 15))


@_FUZZ
@given(raw=heads(odd=40))
def test_heads_with_an_odd_part_agree_with_httptools(raw: bytes) -> None:
    # About one odd part per head: the subset's edges, one at a time.
    check_head(raw)


@_FUZZ
@given(raw=heads(odd=8))
def test_odd_heads_agree_with_httptools(raw: bytes) -> None:
    check_head(raw)


@_FUZZ
@given(raw=heads(odd=0, mutate=1))
def test_mutated_plain_heads_agree_with_httptools(raw: bytes) -> None:
    # Plain heads with one to three bytes replaced, inserted or deleted anywhere.
    check_head(raw)


@_FUZZ
@given(raw=heads(odd=0))
def test_plain_heads_agree_with_httptools(raw: bytes) -> None:
    # Heads of the usual parts only: most are accepted, and all must agree.
    check_head(raw)


# The OpenAI SDK's 16-field head, as benches/bench_ingress.py times it.
SDK_HEAD = REQUESTS["sdk"][:REQUESTS["sdk"].index(b"\r\n\r\n") + 4]


def test_the_heads_clients_send_are_accepted_and_agree() -> None:
    # The subset is not empty: what the SDK, wrk and curl send takes the native path.
    assert check_head(SDK_HEAD)
    assert check_head(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
                      b"Content-Type: application/json\r\nAuthorization: Bearer sk-x\r\n"
                      b"Content-Length: 300\r\n\r\n")
    assert check_head(b"GET /healthz HTTP/1.1\r\nHost: localhost:8080\r\n"
                      b"User-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n")
    assert check_head(b"POST /v1/embeddings HTTP/1.0\r\nConnection: Keep-Alive\r\n"
                      b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n")


# --- ingress on both paths --------------------------------------------------------------------

class _Transport:
    """Records everything a connection does to its transport, in order."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.log.append(bytes(data))

    def close(self) -> None:
        self.closed = True
        self.log.append("close")

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.log.append("pause")

    def resume_reading(self) -> None:
        self.log.append("resume")

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Ring:
    """Answers every pushed request at once (200, or streamed), so pipelining goes on; or,
    with answer=False, holds them (the test answers them later, see `answer`)."""

    def __init__(self, answer: bool = True) -> None:
        self.pushed: list[Request] = []
        self.answer = answer

    def try_push(self, request: Request) -> bool:
        self.pushed.append(request)
        if self.answer:
            answer(request, len(self.pushed))
        return True


def answer(request: Request, n: int) -> None:
    """Answer a request: 200 with a small body, or every third one streamed."""
    conn = request.conn
    if n % 3 == 0:
        conn.start_stream(sent(request), 200, [(b"content-type", b"text/event-stream")])
        conn.send_chunk(b"data: x\n\n")
        conn.end_stream()
    else:
        conn.respond(request, 200, [(b"x-n", b"%d" % n)], b"ok")


def make(parser: str, answer: bool = True) -> tuple[ClientConnection, _Transport, _Ring]:
    ring = _Ring(answer)
    auth = Auth(load({"VELOX_API_KEYS": "sk-x"}, dotenv=None))
    state = IngressState(None, ring, lambda: None, Arena(0),  # type: ignore[arg-type]
                         auth, MAX_BODY, MAX_HEADER, lambda: True,
                         None, parser == "native")
    conn = ClientConnection(state)
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport, ring


def _seen(request: Request) -> tuple[Any, ...]:
    return (request.method, request.path, request.kind, request.headers, bytes(request.body),
            request.keep_alive, request.caller, request.arena_segment, request.traceparent)


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    head = draw(heads())
    kind = draw(st.integers(0, 5))
    if kind == 0 and head.endswith(b"\r\n\r\n"):  # a chunked body: httptools takes over
        head = head[:-2] + b"Transfer-Encoding: chunked\r\n\r\n"
        return head + b"3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n"
    got = _native.reqhead(head, 0, MAX_HEADER)
    length = got[3] if isinstance(got, tuple) else 0
    body = b'{"model": "m", "messages": []}' * 30
    if length > 0 and kind != 1:
        return head + body[:length]
    return head


@st.composite
def conversations(draw: st.DrawFn) -> tuple[bytes, list[bytes]]:
    parts = draw(st.lists(requests(), min_size=1, max_size=4))
    if draw(st.integers(0, 9)) == 0:
        parts.insert(draw(st.integers(0, len(parts))), draw(st.sampled_from(
            [b"\r\n", b"\r\n\r\n", b"\x16\x03\x01garbage", b"GET"])))
    data = b"".join(parts)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=8))))
    bounds = [0, *cuts, len(data)]
    return data, [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def run_both(writes: list[bytes], expire: bool = False, hold: bool = False) -> None:
    """Feed the writes to a connection on each parser and compare everything. hold: the ring
    holds requests until all writes are in (pipelined ones queue up, reading pauses at
    eight), then they are answered one by one (reading resumes)."""
    results = []
    for parser in ("native", "httptools"):
        conn, transport, ring = make(parser, answer=not hold)
        for piece in writes:
            if conn.closed:
                break
            conn.data_received(piece)
        if hold:
            answered = 0
            while conn.current is not None and not conn.closed and answered < 100:
                current = conn.current
                if not any(current is r for r in ring.pushed):
                    break  # not the ring's to answer
                answered += 1
                answer(current, answered)
        if expire and conn.receiving_since:
            conn.expire_receive()  # what the worker's tick does at VELOX_BODY_TIMEOUT_MS
        results.append(([_seen(r) for r in ring.pushed], transport.log, conn.closed,
                        conn.refused, bool(conn.receiving_since)))
    native, reference_ = results
    assert native == reference_, f"{writes!r}\nnative:    {native}\nhttptools: {reference_}"


@_FUZZ
@given(conversation=conversations(), expire=st.booleans(), hold=st.booleans())
def test_ingress_makes_the_same_requests_and_answers_on_both_paths(
        conversation: tuple[bytes, list[bytes]], expire: bool, hold: bool) -> None:
    _, writes = conversation
    run_both(writes, expire, hold)


@st.composite
def forwarded(draw: st.DrawFn) -> bytes:
    """A request the ring gets: authorized, to a forwarded path, with its body; about one in
    twenty is chunked (the connection moves to httptools there)."""
    path = draw(st.sampled_from([b"/v1/chat/completions", b"/v1/embeddings", b"/v1/files"]))
    head = draw(heads(odd=0)).split(b"\r\n", 1)[1]  # its fields (and blank line) only
    fields = [f for f in head.split(b"\r\n") if f and f.split(b":")[0].lower() not in (
        b"authorization", b"connection", b"content-length", b"expect")]
    head = b"POST %b HTTP/1.1\r\nAuthorization: Bearer sk-x\r\n%b" % (
        path, b"".join(f + b"\r\n" for f in fields))
    if draw(st.integers(0, 19)) == 0:
        return head + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    length = draw(st.integers(0, 40))
    return head + b"Content-Length: %d\r\n\r\n" % length + b"x" * length


@_FUZZ_FEW
@given(parts=st.lists(forwarded(), min_size=8, max_size=14), cuts=st.integers(1, 4))
def test_many_pipelined_requests_pause_and_resume_alike(parts: list[bytes], cuts: int) -> None:
    data = b"".join(parts)
    step = len(data) // cuts + 1
    run_both([data[i:i + step] for i in range(0, len(data), step)], hold=True)


@_FUZZ_FEW
@given(conversation=conversations())
def test_ingress_agrees_at_every_byte_boundary(conversation: tuple[bytes, list[bytes]]) -> None:
    data, _ = conversation
    for cut in range(1, len(data)):
        run_both([data[:cut], data[cut:]])
    if len(data) <= 400:
        run_both([data[i:i + 1] for i in range(len(data))])


@pytest.mark.parametrize("auth", [b"Authorization: Bearer wrong\r\n", b""])
def test_bytes_after_an_http10_body_that_came_in_a_later_read_are_data_after_close(
        auth: bytes) -> None:
    """An HTTP/1.0 request (no keep-alive) whose body arrives in a later read than its head,
    followed in that read by more bytes: httptools refuses those as data after `Connection:
    close`; the native path parsed them as the start of a next request (its receive deadline
    started, a next request could be served)."""
    head = b"POST /v1/chat/completions HTTP/1.0\r\n" + auth + b"Content-Length: 5\r\n\r\n"
    run_both([head, b'{"mod \nGET / HTTP/1.1\r\n\r\n'])
    run_both([head, b'{"mod' + b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"], hold=True)
