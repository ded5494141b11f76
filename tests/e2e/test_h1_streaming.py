"""Streams over a cleartext HTTP/1.1 upstream (the self-hosted case), end to end, on both
HTTP/1.1 readers: the native one (its plain reads written to the client from C) and httptools
(VELOX_NATIVE=0).

Real gateway processes, the bundled mock without TLS (HTTP/1.1, chunked event streams), the
official openai SDK: the client sees exactly the chunks the mock sends it directly, with and
without asking for the usage itself (the gateway asks on its behalf and strips it); the tokens
counted are the mock's usage; the access log's byte count is what the client received; a stream
the client leaves is charged its estimated input and the events relayed before, alike on both
readers; many concurrent streams all complete.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import CLIENT_KEY, client_for, gateway_env, wait_for
from tests.e2e.test_tokens import access_lines, direct_client, leave_a_stream, normal, tokens
from velox.relay import usage
from velox_lab.launch import GatewayProcess
from velox_lab.mock import MockUpstream

MESSAGES = [{"role": "user", "content": "Stream these tokens back, please. " * 4}]
AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
# Events 5 ms apart: one upstream read each (the reads the native reader writes itself).
PACED = {"x-mock-chunk-delay-ms": "5"}


def one_worker(mock: MockUpstream, protocol: str, native: bool,
               tmp_path: Path) -> Iterator[GatewayProcess]:
    """A one-worker gateway on `mock` over `protocol`, native or on the Python twins."""
    env = gateway_env(mock, VELOX_WORKERS="1", VELOX_UPSTREAM_PROTOCOL=protocol,
                      VELOX_NATIVE="1" if native else "0")
    with GatewayProcess(env, log_path=tmp_path / "velox.log") as gateway:
        yield gateway


@pytest.fixture(params=["native", "httptools"])
def gw(request: pytest.FixtureRequest, plain_mock: MockUpstream,
       tmp_path: Path) -> Iterator[GatewayProcess]:
    yield from one_worker(plain_mock, "http1", request.param == "native", tmp_path)


def test_streams_relay_the_upstreams_chunks_and_count_its_usage(
        gw: GatewayProcess, plain_mock: MockUpstream) -> None:
    via, direct = client_for(gw), direct_client(plain_mock)
    got = [normal(c) for c in via.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        extra_headers=PACED)]
    want = [normal(c) for c in direct.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        extra_headers=PACED)]
    assert len(got) > 3 and got == want
    assert all("usage" not in c for c in got)  # the usage the gateway asked for: stripped
    asked = [normal(c) for c in via.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_headers=PACED)]
    want_asked = [normal(c) for c in direct.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_headers=PACED)]
    assert asked == want_asked and asked[-1]["usage"]["completion_tokens"] > 0
    real = asked[-1]["usage"]
    once = (real["prompt_tokens"], real["completion_tokens"])
    assert wait_for(lambda: tokens(gw).get(("-", "*")) == (2 * once[0], 2 * once[1])), \
        tokens(gw)
    def chat_lines() -> list[dict] | None:  # both chat lines, whatever else the log holds
        lines = [a for a in access_lines(gw) if a["path"] == "/v1/chat/completions"]
        return lines if len(lines) >= 2 else None

    lines = wait_for(chat_lines)
    assert [a["usage"] for a in lines] == [
        {"input": once[0], "output": once[1], "exact": True}] * 2


def test_the_access_log_counts_the_bytes_the_client_received(gw: GatewayProcess) -> None:
    body = orjson.dumps({"model": "gpt-4o", "messages": MESSAGES, "stream": True})
    with httpx.Client(timeout=20) as client, client.stream(
            "POST", gw.base_url + "/v1/chat/completions", content=body,
            headers={**AUTH, "content-type": "application/json", "x-mock-chunks": "30",
                     "x-mock-chunk-delay-ms": "10"}) as r:  # one read per event
        assert r.status_code == 200
        received = sum(len(piece) for piece in r.iter_raw())  # the body, unframed
        head = r.headers
    line = wait_for(lambda: [a for a in access_lines(gw) if a["path"] == "/v1/chat/completions"])
    assert head["transfer-encoding"] == "chunked"
    # The log's bytes are the head's and the chunked body's (each of the 30 events framed):
    # more than the body's, by less than a head and the framing.
    assert received < line[-1]["bytes_out"] < received + 2048, (line[-1], received)


def test_a_stream_the_client_leaves_is_charged_alike_on_both_readers(
        gw: GatewayProcess) -> None:
    body = leave_a_stream(gw.base_url, 100)
    got = wait_for(lambda: tokens(gw).get(("-", "*")))
    assert got[0] == usage.input_tokens(body)
    assert 3 <= got[1] <= 10, got  # what was relayed before the client left


def test_many_concurrent_streams_all_complete(gw: GatewayProcess) -> None:
    client = client_for(gw)

    def one(i: int) -> str:
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="gpt-4o", stream=True,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": f"stream {i}"}], extra_headers=PACED)
            if c.choices)

    with cf.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(48)))
    assert all(texts) and len(texts) == 48
