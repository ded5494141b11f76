"""Sans-IO round trip per request for each egress HTTP/2 codec (pytest-benchmark, group "codec").

One round is one event-loop iteration's worth of work at 64 requests in flight: encode 64 typical
OpenAI chat requests, take the bytes with one `data_to_send`, feed 64 pre-recorded responses with
one `receive_data`, and acknowledge the DATA. The responses were produced by a real HTTP/2 server
(python-hyper `h2`) whose HPACK encoder had already served a batch, so the header blocks use its
dynamic table the way a long-lived provider connection does. Each round starts from a fresh codec
that replays the server preface and that warm-up batch untimed, which keeps both HPACK tables in
step with the recording.

Run: `.venv/bin/pytest --benchmark benches/bench_codec.py` (run the whole file: the ratio to `h2`
is computed from the `h2` result, which is measured first).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from h2.config import H2Configuration
from h2.connection import H2Connection

from velox.egress.codec import DATA, Codec
from velox.egress.framer import Framer
from velox_lab.codecs import make_codec

IN_FLIGHT = 64
AUTHORITY = b"api.openai.com"
PATH = b"/v1/chat/completions"
REQUEST_HEADERS = [
    (b"content-type", b"application/json"),
    (b"accept", b"application/json"),
    (b"accept-encoding", b"gzip, deflate"),
    (b"authorization", b"Bearer sk-proj-" + b"a1B2c3D4e5F6g7H8" * 9),
    (b"user-agent", b"OpenAI/Python 1.54.4"),
    (b"x-stainless-lang", b"python"),
    (b"x-stainless-package-version", b"1.54.4"),
    (b"x-stainless-os", b"Linux"),
    (b"x-stainless-arch", b"x64"),
    (b"x-stainless-runtime", b"CPython"),
    (b"x-stainless-runtime-version", b"3.11.7"),
    (b"x-stainless-retry-count", b"0"),
]
_MESSAGES = [
    {"role": "system", "content": "You are a concise assistant for a gateway benchmark."},
    {"role": "user", "content": "Summarise HTTP/2 flow control in two sentences, please. " * 3},
]
REQUEST_BODY = json.dumps(
    {"model": "gpt-4o-mini", "messages": _MESSAGES, "temperature": 0.2, "max_tokens": 128}
).encode()
RESPONSE_BODY = json.dumps(
    {
        "id": "chatcmpl-AbCdEfGhIjKlMnOpQrStUvWxYz012",
        "object": "chat.completion",
        "created": 1732300000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Flow control " * 20},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 52, "completion_tokens": 60, "total_tokens": 112},
        "system_fingerprint": "fp_0ba0d124f1",
    }
).encode()
# h2 first: the others report their ratio to it (and, after the framer, to the framer).
# "framer-pyhpack" is the framer on its fallback pure-Python HPACK decoder, to show what the
# compiled decoder is worth; "native" is the C codec (native/vx_h2.c).
CODECS = ("h2", "jh2", "framer", "framer-pyhpack", "native")
_per_request_us: dict[str, float] = {}


def response_headers(n: int) -> list[tuple[bytes, bytes]]:
    return [
        (b":status", b"200"),
        (b"date", b"Fri, 22 Nov 2024 20:%02d:%02d GMT" % (n // 60 % 60, n % 60)),
        (b"content-type", b"application/json"),
        (b"access-control-expose-headers", b"X-Request-ID"),
        (b"openai-organization", b"user-velox-benchmark"),
        (b"openai-processing-ms", b"%d" % (300 + n * 7 % 900)),
        (b"openai-version", b"2020-10-01"),
        (b"x-ratelimit-remaining-requests", b"%d" % (9999 - n)),
        (b"x-request-id", b"req_%032x" % (n * 2654435761)),
        (b"strict-transport-security", b"max-age=31536000; includeSubDomains; preload"),
        (b"cf-cache-status", b"DYNAMIC"),
        (b"server", b"cloudflare"),
    ]


def record() -> tuple[bytes, bytes, bytes]:
    """Server preface, warm-up batch and measured batch, as a real server sent them."""
    client = make_codec("framer", AUTHORITY, b"https")
    server = H2Connection(H2Configuration(client_side=False, header_encoding=None))
    server.initiate_connection()
    client.initiate()
    server.receive_data(client.data_to_send())
    preface = server.data_to_send()
    client.receive_data(preface)
    server.receive_data(client.data_to_send())
    batches = []
    for batch in range(2):
        sids = [
            client.send_request(b"POST", PATH, REQUEST_HEADERS, REQUEST_BODY)
            for _ in range(IN_FLIGHT)
        ]
        server.receive_data(client.data_to_send())
        for i, sid in enumerate(sids):
            server.send_headers(sid, response_headers(batch * IN_FLIGHT + i))
            server.send_data(sid, RESPONSE_BODY, end_stream=True)
        wire = server.data_to_send()
        client.receive_data(wire)
        batches.append(wire)
    return preface, batches[0], batches[1]


PREFACE, WARMUP, MEASURED = record()


def round_trip(codec: Codec, responses: bytes) -> list[tuple]:
    """One loop iteration: 64 requests out in one write, 64 responses in from one read."""
    for _ in range(IN_FLIGHT):
        codec.send_request(b"POST", PATH, REQUEST_HEADERS, REQUEST_BODY)
    codec.data_to_send()
    events = codec.receive_data(responses)
    for event in events:
        if event[0] == DATA:
            codec.acknowledge(event[1], event[3])
    codec.data_to_send()
    return events


def new_codec(name: str) -> Codec:
    if name == "framer-pyhpack":
        return Framer(AUTHORITY, b"https", compiled_hpack=False)
    return make_codec(name, AUTHORITY, b"https")


def fresh(name: str) -> Codec:
    """A codec in the state the recording's second batch expects (untimed)."""
    codec = new_codec(name)
    codec.initiate()
    codec.receive_data(PREFACE)
    round_trip(codec, WARMUP)
    return codec


def expected_events() -> list[tuple]:
    return round_trip(fresh("framer"), MEASURED)


@pytest.mark.parametrize("name", CODECS)
def test_codec_round_trip(benchmark: Callable, name: str) -> None:
    events = round_trip(fresh(name), MEASURED)
    assert events == expected_events()  # every codec decodes the recording identically
    assert len(events) == 2 * IN_FLIGHT

    def setup() -> tuple[tuple[Codec, bytes], dict]:
        return (fresh(name), MEASURED), {}

    benchmark.group = "codec"
    benchmark.pedantic(round_trip, setup=setup, rounds=300, iterations=1, warmup_rounds=5)
    per_request = benchmark.stats.stats.median / IN_FLIGHT * 1e6
    _per_request_us[name] = per_request
    benchmark.extra_info["in_flight"] = IN_FLIGHT
    benchmark.extra_info["per_request_us_median"] = round(per_request, 2)
    if "h2" in _per_request_us:
        benchmark.extra_info["ratio_to_h2"] = round(per_request / _per_request_us["h2"], 3)
    if "framer" in _per_request_us:
        benchmark.extra_info["ratio_to_framer"] = round(per_request / _per_request_us["framer"], 3)
