"""Unit tests of the mock's pure layers: behaviour planning, HPACK encoding, the h2 framer."""

from __future__ import annotations

import base64
import json
import struct

import h2.config
import h2.connection
import h2.events
import hpack
import pytest

from velox_lab.mock import h2server as h2s
from velox_lab.mock import hpackenc
from velox_lab.mock.behaviour import Defaults, plan_request

CHAT = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}).encode()


def plan(path=b"/v1/chat/completions", body=CHAT, method=b"POST", **controls):
    headers = [(b"x-mock-" + k.replace("_", "-").encode(), str(v).encode())
               for k, v in controls.items()]
    return plan_request(method, path, headers, body, Defaults(chunks=8))


def test_plain_plan_is_simple_and_headers_are_realistic():
    p = plan()
    assert p.simple and p.status == 200 and p.fault is None
    names = [n for n, _ in p.static + tuple(p.dynamic)]
    assert names[0] == b"content-type"
    assert {b"x-request-id", b"openai-processing-ms", b"openai-version",
            b"x-ratelimit-limit-requests", b"x-ratelimit-remaining-requests"} <= set(names)
    assert plan().dynamic[0][1] != p.dynamic[0][1]  # unique request ids


@pytest.mark.parametrize("path, body, n_events", [
    (b"/v1/chat/completions", {"messages": []}, 5),
    (b"/v1/completions", {"prompt": "x"}, 5),
    (b"/v1/responses", {"input": "x"}, 5 + 8),
])
def test_stream_part_counts(path, body, n_events):
    req = json.dumps({"model": "m", "stream": True, **body}).encode()
    p = plan(path, req, chunks=5, chunk_delay_ms=7)
    assert p.stream and not p.simple and p.part_delay == 0.007
    ends_with_done = p.parts[-1] == b"data: [DONE]\n\n"
    assert ends_with_done == (path != b"/v1/responses")
    assert len(p.parts) == n_events + ends_with_done


def test_chat_single_chunk_stream_is_complete():
    req = json.dumps({"model": "m", "stream": True, "messages": []}).encode()
    parts = plan(body=req, chunks=1).parts
    event = json.loads(parts[0][6:])
    assert event["choices"][0]["delta"]["role"] == "assistant"
    assert event["choices"][0]["finish_reason"] == "stop"


def test_errors_and_control_validation():
    assert plan(status=429).status == 429
    assert (b"retry-after", b"1") in plan(status=429).static
    assert plan(body=b"{oops").status == 400
    assert plan(body=b"[1]").status == 400
    assert plan(body=b'{"messages": []}').status == 400  # no model
    assert plan(path=b"/v2/x").status == 404
    assert plan(method=b"GET").status == 404
    for bad in ({"latency_ms": "soon"}, {"fault": "explode"}, {"status": "204"},
                {"chunks": "0"}):
        p = plan(**bad)
        assert p.status == 400 and b"mock_control" in p.body


def test_head_announces_the_length_without_a_body():
    get = plan(b"/v1/models", b"", method=b"GET")
    head = plan(b"/v1/models", b"", method=b"HEAD")
    assert head.status == 200 and head.body == b"" and head.content_length == len(get.body)


def test_faults_shape_the_plan():
    slow = plan(fault="slow-body")
    assert slow.body is None and len(slow.parts) >= 4 and slow.part_delay > 0
    assert slow.content_length == len(b"".join(slow.parts))
    cut = plan(fault="reset-mid-stream")
    assert len(cut.parts) == 4 and cut.content_length is not None
    assert plan(fault="hang", latency_ms=5).latency == 0.005


def test_embeddings_base64_matches_floats():
    floats = json.loads(plan(b"/v1/embeddings", json.dumps(
        {"model": "m", "input": ["a", "b"], "encoding_format": "float"}).encode()).body)
    b64 = json.loads(plan(b"/v1/embeddings", json.dumps(
        {"model": "m", "input": ["a", "b"], "encoding_format": "base64"}).encode()).body)
    for f, b in zip(floats["data"], b64["data"], strict=False):
        decoded = struct.unpack("<8f", base64.b64decode(b["embedding"]))
        assert decoded == pytest.approx(f["embedding"], abs=1e-6)
    assert plan(b"/v1/embeddings", b'{"model": "m", "input": []}').status == 400


def test_hpack_blocks_decode_with_a_reference_decoder():
    long_value = b"x" * 300  # multi-byte string length
    block = hpackenc.encode_response(
        429, ((b"content-type", b"application/json"), (b"retry-after", b"1")),
        [(b"x-request-id", b"req_1"), (b"x-long", long_value), (b"content-length", b"12")])
    decoded = hpack.Decoder().decode(block, raw=True)
    assert [tuple(h) for h in decoded] == [
        (b":status", b"429"), (b"content-type", b"application/json"), (b"retry-after", b"1"),
        (b"x-request-id", b"req_1"), (b"x-long", long_value), (b"content-length", b"12")]
    assert hpackenc.encode_static(200, ())[:1] == b"\x88"  # indexed :status 200
    assert hpackenc.encode_int(1337, 5) == bytes([31, 154, 10])  # RFC 7541 C.1.2


class Recorder:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))


def served(*client_actions, **kw):
    """Run a fresh H2Server against an h2 client; returns (server, recorder, client)."""
    rec = Recorder()
    srv = h2s.H2Server(rec, **kw)
    srv.initiate()
    cli = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    cli.initiate_connection()
    for action in client_actions:
        action(cli)
    srv.receive_data(cli.data_to_send())
    cli.receive_data(srv.data_to_send())
    return srv, rec, cli


def headers(path="/v1/models", method="GET"):
    return [(":method", method), (":path", path), (":scheme", "https"), (":authority", "a")]


def test_framer_request_response_roundtrip():
    srv, rec, cli = served(lambda c: c.send_headers(1, headers("/x", "POST")),
                           lambda c: c.send_data(1, b"abc"),
                           lambda c: c.send_data(1, b"def", end_stream=True))
    assert rec.calls[0][:3] == ("on_request", 1, b"POST") and rec.calls[0][3] == b"/x"
    assert [c[2] for c in rec.calls[1:]] == [b"abc", b"def"]
    srv.send_headers(1, hpackenc.encode_static(200, ()))
    assert srv.send_data(1, b"x" * 70000, True) > 0  # beyond the client's 65535 window
    events = cli.receive_data(srv.data_to_send())
    got = sum(len(e.data) for e in events if isinstance(e, h2.events.DataReceived))
    assert got == 65535
    cli.increment_flow_control_window(10000)
    cli.increment_flow_control_window(10000, stream_id=1)
    srv.receive_data(cli.data_to_send())
    assert ("on_drained", 1) in rec.calls and 1 not in srv.streams
    events = cli.receive_data(srv.data_to_send())
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)


@pytest.mark.parametrize("payload, code", [
    (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 10, h2s.PROTOCOL_ERROR),
    (h2s.PREFACE + h2s._frame(h2s.DATA, 0, 0, b"x"), h2s.PROTOCOL_ERROR),
    (h2s.PREFACE + h2s._frame(h2s.PING, 0, 0, b"short"), h2s.FRAME_SIZE_ERROR),
    (h2s.PREFACE + h2s._frame(h2s.WINDOW_UPDATE, 0, 0, struct.pack(">I", 0)),
     h2s.PROTOCOL_ERROR),
    # HEADERS without END_HEADERS must be followed by CONTINUATION, not PING.
    (h2s.PREFACE + h2s._frame(h2s.HEADERS, 0, 1, b"\x82")
     + h2s._frame(h2s.PING, 0, 0, b"12345678"), h2s.PROTOCOL_ERROR),
    (h2s.PREFACE + h2s._frame(h2s.SETTINGS, 0, 0, struct.pack(">HI", 5, 100)),
     h2s.PROTOCOL_ERROR),
    (h2s.PREFACE + struct.pack(">IBI", (20000 << 8) | 0, 0, 1), h2s.FRAME_SIZE_ERROR),
])
def test_framer_connection_errors_send_goaway(payload, code):
    rec = Recorder()
    srv = h2s.H2Server(rec)
    srv.receive_data(payload)
    out = srv.data_to_send()
    assert srv.closed
    assert out[3] == h2s.GOAWAY and struct.unpack(">I", out[13:17])[0] == code


def test_framer_refuses_excess_and_goes_away_after_n():
    _srv, rec, _cli = served(*[lambda c, s=s: c.send_headers(s, headers(), end_stream=True)
                             for s in (1, 3, 5)], max_concurrent_streams=2)
    assert [c[0] for c in rec.calls] == ["on_request", "on_request", "on_reset"]
    srv2, rec2, _ = served(*[lambda c, s=s: c.send_headers(s, headers(), end_stream=True)
                             for s in (1, 3, 5, 7)], goaway_after=2)
    assert [c[0] for c in rec2.calls] == ["on_request", "on_request", "on_goaway_sent"]
    assert rec2.calls[-1][1] == 3 and srv2.goaway_sent


def test_framer_trailers_end_the_request():
    _, rec, _ = served(lambda c: c.send_headers(1, headers("/x", "POST")),
                       lambda c: c.send_data(1, b"abc"),
                       lambda c: c.send_headers(1, [("x-checksum", "1")], end_stream=True))
    assert [c[0] for c in rec.calls] == ["on_request", "on_data", "on_data"]
    assert rec.calls[-1] == ("on_data", 1, b"", True)


def test_framer_continuation_out_and_pure_python_hpack_in(monkeypatch):
    monkeypatch.setattr(h2s, "_FastDecoder", None)  # the fallback decoder path
    srv, rec, cli = served(lambda c: c.send_headers(1, headers(), end_stream=True))
    assert rec.calls[0][:4] == ("on_request", 1, b"GET", b"/v1/models")
    big = b"y" * 40000  # larger than the client's 16 KiB max frame size
    srv.send_headers(1, hpackenc.encode_response(200, (), [(b"x-big", big)]), end_stream=True)
    out = srv.data_to_send()
    types, pos = [], 0
    while pos < len(out):
        types.append(out[pos + 3])
        pos += 9 + int.from_bytes(out[pos:pos + 3], "big")
    assert types == [h2s.HEADERS, h2s.CONTINUATION, h2s.CONTINUATION]
    events = cli.receive_data(out)
    [resp] = [e for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert dict(resp.headers)[b"x-big"] == big
    assert any(isinstance(e, h2.events.StreamEnded) for e in events)


# --- Azure paths, per-input latency, what the request log shows of a credential ------------

def azure_plan(path, headers=((b"api-key", b"k"),), body=CHAT, method=b"POST", defaults=None):
    return plan_request(method, path, list(headers), body, defaults or Defaults())


def test_azure_plan_checks_key_then_version_then_path():
    chat = b"/openai/deployments/dep-1/chat/completions"
    no_key = azure_plan(chat + b"?api-version=2024-10-21", headers=())
    assert no_key.status == 401 and json.loads(no_key.body)["error"]["code"] == "401"
    assert azure_plan(chat + b"?api-version=2024-10-21",
                      headers=[(b"api-key", b"  ")]).status == 401  # blank key
    assert azure_plan(chat, headers=[(b"api-key", b"k")]).status == 404  # no api-version
    ok = azure_plan(chat + b"?api-version=2024-10-21")
    assert ok.status == 200 and (ok.model, ok.deployment) == ("gpt-4o", "dep-1")
    no_model = azure_plan(chat + b"?api-version=1", body=b'{"messages": []}')
    assert no_model.status == 200 and (no_model.model, no_model.deployment) == (None, "dep-1")
    assert json.loads(no_model.body)["model"] == "dep-1"
    quoted = azure_plan(b"/openai/deployments/my%20dep/embeddings?api-version=1",
                        body=b'{"input": "x"}')
    assert quoted.status == 200 and quoted.deployment == "my dep"
    assert azure_plan(b"/openai/deployments//chat/completions?api-version=1").status == 404
    assert azure_plan(b"/openai/files?api-version=1", method=b"GET").status == 404


def test_per_input_latency_is_base_plus_inputs():
    body = json.dumps({"model": "e", "input": ["a"] * 10}).encode()
    p = plan_request(b"POST", b"/v1/embeddings", [(b"x-mock-latency-per-input-us", b"500")],
                     body, Defaults(latency_ms=2))
    assert p.inputs == 10 and p.latency == pytest.approx(0.002 + 10 * 0.0005)
    process_default = plan_request(b"POST", b"/v1/embeddings", [], body,
                                   Defaults(latency_ms=0, latency_per_input_us=100))
    assert process_default.latency == pytest.approx(0.001)
    chat = plan_request(b"POST", b"/v1/chat/completions", [], CHAT,
                        Defaults(latency_per_input_us=100))
    assert chat.latency == 0 and chat.simple  # only embeddings count inputs
    bad = plan_request(b"POST", b"/v1/embeddings", [(b"x-mock-latency-per-input-us", b"-1")],
                       body, Defaults())
    assert bad.status == 400


def test_auth_of_reports_kind_and_fingerprint_never_the_key():
    from velox_lab.mock import fingerprint
    from velox_lab.mock.state import auth_of

    assert auth_of([]) == {"kind": None, "key_sha256": None}
    bearer = auth_of([(b"authorization", b"Bearer sk-secret")])
    assert bearer == {"kind": "authorization", "key_sha256": fingerprint("sk-secret")}
    assert auth_of([(b"api-key", b"az-secret")]) == {"kind": "api-key",
                                                      "key_sha256": fingerprint("az-secret")}
    both = auth_of([(b"authorization", b"Bearer sk-secret"), (b"api-key", b"az-secret")])
    assert both == {"kind": "both", "key_sha256": fingerprint("az-secret")}
    assert len(fingerprint("sk-secret")) == 12 and "secret" not in str(bearer)
