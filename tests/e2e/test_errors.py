"""Every error the gateway produces is OpenAI-shaped, and the SDK raises its matching exception."""

from __future__ import annotations

import socket
import ssl
import time

import httpx
import openai
import pytest

from tests.conftest import closed_after_the_test
from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

from .conftest import CLIENT_KEY, UPSTREAM_KEY, GatewayFactory, client_for, raw

MESSAGES = [{"role": "user", "content": "hi"}]


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def exchange(gw: GatewayProcess, data: bytes, timeout: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection and read until the server closes or goes quiet."""
    with socket.create_connection((gw.host, gw.port), timeout=timeout) as sock:
        sock.sendall(data)
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
                if b"\r\n\r\n" in out and _complete(out):
                    break
        except TimeoutError:
            pass
    return out


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def test_malformed_json_is_400(gateway: GatewayProcess) -> None:
    response = raw(gateway).post("/v1/chat/completions", content=b'{"model": "gpt-4o", ',
                                 headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"{}", b'{"model": ""}', b'{"model": 4}'])
def test_missing_or_bad_model_is_400(gateway: GatewayProcess, body: bytes) -> None:
    response = raw(gateway).post("/v1/embeddings", content=body)
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"


def test_sdk_raises_bad_request(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client_for(gateway).chat.completions.create(model="", messages=MESSAGES)
    assert err.value.status_code == 400
    assert err.value.code == "missing_required_parameter"


def test_unknown_route_404_and_wrong_method_405(gateway: GatewayProcess) -> None:
    client = raw(gateway)
    response = client.get("/v2/chat")
    assert response.status_code == 404 and error_of(response)["code"] == "unknown_url"
    response = client.put("/v1/embeddings", content=b"{}")
    assert response.status_code == 405 and error_of(response)["code"] == "method_not_allowed"
    assert response.headers["allow"] == "POST"
    sdk = client_for(gateway).with_options(base_url=gateway.base_url)
    with pytest.raises(openai.NotFoundError):
        sdk.post("/nowhere", body={}, cast_to=object)


def test_client_keys_401_and_never_forwarded(start_gateway: GatewayFactory,
                                             upstream: MockUpstream) -> None:
    gw = start_gateway(VELOX_API_KEYS=f"other-key,{CLIENT_KEY}")
    wrong = client_for(gw).with_options(api_key="sk-wrong")
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.status_code == 401
    reply = client_for(gw).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert reply.choices[0].message.content
    seen = dict(upstream.requests(5)[-1]["headers"])
    assert seen["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert CLIENT_KEY not in str(upstream.requests(20))


def test_oversized_bodies_are_413(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_MAX_BODY_BYTES="1000")
    too_big = b'{"model": "m", "pad": "' + b"x" * 2000 + b'"}'
    response = raw(gw).post("/v1/chat/completions", content=too_big)
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"

    def chunks():  # chunked: the size is only known while reading
        for _ in range(10):
            yield b"y" * 300

    response = raw(gw).post("/v1/chat/completions", content=chunks())
    assert response.status_code == 413
    # The gateway is still healthy afterwards.
    assert raw(gw).post("/v1/chat/completions",
                        json={"model": "m", "messages": MESSAGES}).status_code == 200


def test_chunked_request_body_is_accepted(gateway: GatewayProcess, upstream: MockUpstream) -> None:
    parts = [b'{"model": "gpt-4o",', b' "messages": [{"role": "user",', b' "content": "hi"}]}']
    response = raw(gateway).post("/v1/chat/completions", content=iter(parts))
    assert response.status_code == 200 and response.json()["model"] == "gpt-4o"


def test_expect_100_continue(gateway: GatewayProcess) -> None:
    body = b'{"model": "gpt-4o", "messages": []}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection((gateway.host, gateway.port), timeout=5) as sock:
        sock.sendall(head)
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        reply = b""
        while not _complete(reply):
            reply += sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n")


def test_malformed_http_is_400_and_closed(gateway: GatewayProcess) -> None:
    reply = exchange(gateway, b"GARBAGE \x00\x01 nonsense\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")
    assert b"connection: close" in reply.lower()
    assert b'"code":"bad_http_request"' in reply


def test_oversized_headers_are_431(gateway: GatewayProcess) -> None:
    reply = exchange(gateway, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431 ")


def test_truncated_body_is_never_forwarded(gateway: GatewayProcess,
                                           upstream: MockUpstream) -> None:
    before = upstream.stats()["requests"]
    with socket.create_connection((gateway.host, gateway.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")
    time.sleep(0.3)
    assert upstream.stats()["requests"] == before
    assert raw(gateway).get("/healthz").status_code == 200


def test_keep_alive_and_pipelining_answer_in_order(gateway: GatewayProcess) -> None:
    one = b'{"model": "first", "messages": []}'
    two = b'{"model": "second", "messages": []}'
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s")
    with socket.create_connection((gateway.host, gateway.port), timeout=5) as sock:
        sock.sendall(req % (len(one), one) + req % (len(two), two)
                     + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        deadline = time.monotonic() + 5
        while data.count(b"HTTP/1.1 200 OK") < 3 and time.monotonic() < deadline:
            data += sock.recv(65536)
    assert data.count(b"HTTP/1.1 200 OK") == 3
    assert data.index(b'"model":"first"') < data.index(b'"model":"second"') < data.index(b'"ok"')


def test_upstream_errors_pass_through_with_the_sdk_exception(gateway: GatewayProcess,
                                                            upstream: MockUpstream) -> None:
    client = client_for(gateway)
    direct = closed_after_the_test(httpx.Client(
        base_url=upstream.origin, verify=ssl.create_default_context(cafile=upstream.ca_file)))
    for status, exc in ((429, openai.RateLimitError), (500, openai.InternalServerError),
                        (400, openai.BadRequestError), (404, openai.NotFoundError)):
        with pytest.raises(exc) as err:
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES,
                                           extra_headers={"x-mock-status": str(status)})
        assert err.value.status_code == status
        # The body is the upstream's own error, exactly as the upstream sends it.
        expected = direct.post("/v1/chat/completions", json={"model": "gpt-4o"},
                               headers={"x-mock-status": str(status)})
        assert err.value.response.json() == expected.json()


def test_upstream_reset_is_502(gateway: GatewayProcess) -> None:
    with pytest.raises(openai.InternalServerError) as err:
        client_for(gateway).chat.completions.create(
            model="gpt-4o", messages=MESSAGES, extra_headers={"x-mock-fault": "reset"})
    assert err.value.status_code == 502
    assert err.value.code == "upstream_protocol_error"


def test_upstream_header_timeout_is_504(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_REQUEST_TIMEOUT_MS="400")
    with pytest.raises(openai.InternalServerError) as err:
        client_for(gw).chat.completions.create(
            model="gpt-4o", messages=MESSAGES, extra_headers={"x-mock-fault": "hang"})
    assert err.value.status_code == 504 and err.value.code == "upstream_timeout"


def test_stream_idle_timeout_cuts_a_stalled_stream(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_STREAM_IDLE_TIMEOUT_MS="300")
    stream = client_for(gw).chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,
        extra_headers={"x-mock-chunks": "5", "x-mock-chunk-delay-ms": "2000"})
    with pytest.raises(openai.APIError):
        list(stream)


def test_unreachable_upstream_is_502_and_not_ready(start_gateway: GatewayFactory,
                                                   upstream: MockUpstream) -> None:
    closed_port = free_port()
    gw = start_gateway(wait_ready=False, VELOX_UPSTREAM_ORIGIN=f"https://127.0.0.1:{closed_port}",
                       VELOX_CONNECT_TIMEOUT_MS="500")
    assert raw(gw).get("/readyz").status_code == 503
    with pytest.raises(openai.InternalServerError) as err:
        client_for(gw).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.status_code == 502 and err.value.code == "upstream_unavailable"


def test_rate_limit_is_429_with_retry_after(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_RATE_LIMIT_RPM="60", VELOX_RATE_LIMIT_BURST="3")
    client = client_for(gw)
    for _ in range(3):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert err.value.code == "rate_limit_exceeded"
    assert err.value.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert 1 <= int(err.value.response.headers["retry-after"]) <= 2


def test_full_ring_is_503_overloaded_and_every_request_gets_one_answer(
        start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="1", VELOX_RING_DEPTH="2")
    body = b'{"model": "m", "messages": []}'
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    overloaded: list[bytes] = []
    for _ in range(20):  # a burst must land in one loop pass; retry until one does
        socks = [socket.create_connection((gw.host, gw.port), timeout=10) for _ in range(64)]
        time.sleep(0.05)  # all accepted before the burst
        for sock in socks:
            sock.sendall(request)
        replies = []
        for sock in socks:
            reply = b""
            while not _complete(reply):
                reply += sock.recv(65536)
            replies.append(reply)
            sock.close()
        statuses = [r.split(b" ", 2)[1] for r in replies]
        assert set(statuses) <= {b"200", b"503"} and len(statuses) == 64
        overloaded = [r for r in replies if r.startswith(b"HTTP/1.1 503")]
        if overloaded:
            break
    assert overloaded, "no burst ever filled a 2-deep ring"
    assert b'"code":"overloaded"' in overloaded[0]
    assert b"retry-after: 1\r\n" in overloaded[0]


def test_upstream_dropping_the_connection_is_502_and_the_gateway_recovers(
        gateway: GatewayProcess) -> None:
    client = client_for(gateway)
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="m", messages=MESSAGES,
                                       extra_headers={"x-mock-fault": "close"})
    assert err.value.status_code == 502
    for _ in range(10):
        assert client.chat.completions.create(model="m", messages=MESSAGES).choices


LARGE = b" " * (300 * 1024)  # padding that puts a body over VELOX_PARSE_OFF_LOOP_BYTES


@pytest.mark.parametrize(("body", "code", "words"), [
    (b'{"model": "gpt-4o", "messages": [' + LARGE, "invalid_json", "ends inside a value"),
    (b'{"model": "gpt-4o"}' + LARGE + b"x", "invalid_json", "trailing characters"),
    (b'{"messages": []}' + LARGE, "missing_required_parameter", "model parameter"),
    (b"[" + LARGE + b"]", "invalid_request", "must be a JSON object"),
])
def test_large_bad_bodies_get_the_same_400s(gateway: GatewayProcess, body: bytes, code: str,
                                             words: str) -> None:
    response = raw(gateway).post("/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = error_of(response)
    assert error["code"] == code and words in error["message"], error
    # The worker goes on serving.
    ok = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    assert raw(gateway).post("/v1/chat/completions", content=ok).status_code == 200


def test_sdk_raises_bad_request_for_a_large_body_without_model(gateway: GatewayProcess) -> None:
    big = [{"role": "user", "content": "x" * (300 * 1024)}]
    with pytest.raises(openai.BadRequestError) as err:
        client_for(gateway).chat.completions.create(model="", messages=big)
    assert err.value.code == "missing_required_parameter"
