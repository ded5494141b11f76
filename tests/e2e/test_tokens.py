"""Token accounting end to end: real Velox processes, the bundled mock (HTTP/2 + TLS), the
official openai SDK and httpx as clients.

What is proved here: a streamed call is sent upstream with include_usage and the client still
sees exactly the chunks the mock would have sent it directly (with and without asking for the
usage itself); the tokens Velox counts per key and route equal the usage the mock reports, for
every response shape; a stream the client cuts short is charged its estimated input plus the
events relayed; per-upstream tpm moves traffic to another upstream before the first one would
say 429, and an answer that used more than its reservation leaves that upstream in debt.
"""

from __future__ import annotations

import hashlib
import json
import ssl
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson

from tests.conftest import closed_after_the_test
from tests.e2e.conftest import CLIENT_KEY, GatewayFactory, client_for, wait_for
from tests.e2e.test_routing import (  # noqa: F401  (fixtures: certdir, mocks, fresh, gateways)
    admin_stats,
    certdir,
    chat_calls,
    fresh,
    gateways,
    mocks,
    start,
    upstream_stats,
    upstream_table,
    write_config,
)
from velox.relay import usage
from velox_lab.mock import MockUpstream

AUTH = {"authorization": f"Bearer {CLIENT_KEY}"}
MESSAGES = [{"role": "user", "content": "Count the tokens of this sentence, please. " * 5}]


def direct_client(mock: MockUpstream) -> openai.OpenAI:
    client = openai.OpenAI(base_url=mock.origin + "/v1", api_key="sk-direct", max_retries=0,
                           http_client=httpx.Client(
                               verify=ssl.create_default_context(cafile=mock.ca_file),
                               timeout=20))
    closed_after_the_test(client)
    return client


def normal(chunk: Any) -> dict[str, Any]:
    """A chunk as the SDK parsed it, fields it was given only (a `usage: null` the client did
    not ask for would show here), without what differs per call (id, created)."""
    doc = chunk.model_dump(exclude_unset=True)
    doc.pop("id", None)
    doc.pop("created", None)
    return doc


def tokens(gw: Any) -> dict[tuple[str, str], tuple[int, int]]:
    return {(r["key"], r["route"]): (r["input"], r["output"]) for r in admin_stats(gw)["tokens"]}


def metric_tokens(gw: Any) -> dict[tuple[str, str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{gw.admin_url}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "velox_tokens":
            for s in family.samples:
                out[(s.labels["key"], s.labels["route"], s.labels["kind"])] = s.value
    return out


def access_lines(gw: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gw.log().splitlines()
            if line.startswith("{") and '"log":"access"' in line]


# --- streams -----------------------------------------------------------------------------------


def test_stream_without_include_usage_sees_the_direct_chunks_and_is_counted(
        start_gateway: GatewayFactory, upstream: MockUpstream) -> None:
    gw = start_gateway(VELOX_WORKERS="1")
    via = client_for(gw)
    direct = direct_client(upstream)
    got = [normal(c) for c in via.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True)]  # type: ignore[arg-type]
    want = [normal(c) for c in direct.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True)]  # type: ignore[arg-type]
    assert got == want
    assert all("usage" not in c for c in got)  # neither the usage chunk nor "usage": null
    # What the mock reports when asked: Velox asked, and counted exactly that.
    asked = list(direct.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    real = asked[-1].usage
    assert real is not None and real.completion_tokens > 0
    expect = (real.prompt_tokens, real.completion_tokens)
    assert wait_for(lambda: tokens(gw).get(("-", "*")) == expect), tokens(gw)
    m = metric_tokens(gw)
    assert (m[("-", "*", "input")], m[("-", "*", "output")]) == expect
    line = wait_for(lambda: [a for a in access_lines(gw) if a["path"] == "/v1/chat/completions"])
    assert line[-1]["usage"] == {"input": expect[0], "output": expect[1], "exact": True}


def test_the_upstream_gets_include_usage_added_to_the_body_bytes(
        start_gateway: GatewayFactory, upstream: MockUpstream) -> None:
    gw = start_gateway(VELOX_WORKERS="1")
    body = orjson.dumps({"model": "gpt-4o", "messages": MESSAGES, "stream": True})
    r = httpx.post(gw.base_url + "/v1/chat/completions", content=body, headers={
        **AUTH, "content-type": "application/json"}, timeout=20)
    assert r.status_code == 200
    assert "usage" not in r.text and r.text.endswith("data: [DONE]\n\n")
    sent = upstream.requests(5)[-1]
    assert sent["body_sha256"] == hashlib.sha256(usage.add_include_usage(body)).hexdigest()
    # A client that asked itself: its body goes unchanged and it gets the usage chunk.
    asked = orjson.dumps({"model": "gpt-4o", "messages": MESSAGES, "stream": True,
                          "stream_options": {"include_usage": True}})
    r = httpx.post(gw.base_url + "/v1/chat/completions", content=asked, headers={
        **AUTH, "content-type": "application/json"}, timeout=20)
    assert upstream.requests(5)[-1]["body_sha256"] == hashlib.sha256(asked).hexdigest()
    events = [e for e in r.text.split("\n\n") if e.startswith("data: {")]
    final = orjson.loads(events[-1][6:])
    assert final["choices"] == [] and final["usage"]["completion_tokens"] > 0
    assert all('"usage":null' in e for e in events[:-1])  # as the mock sent them


def test_stream_with_include_usage_gets_the_chunk(start_gateway: GatewayFactory,
                                                  upstream: MockUpstream) -> None:
    gw = start_gateway(VELOX_WORKERS="1")
    kw: dict[str, Any] = {"model": "gpt-4o", "messages": MESSAGES, "stream": True,
                          "stream_options": {"include_usage": True}}
    got = [normal(c) for c in client_for(gw).chat.completions.create(**kw)]
    want = [normal(c) for c in direct_client(upstream).chat.completions.create(**kw)]
    assert got == want
    final = got[-1]["usage"]
    expect = (final["prompt_tokens"], final["completion_tokens"])
    assert wait_for(lambda: tokens(gw).get(("-", "*")) == expect), tokens(gw)


def test_settlement_is_exact_for_every_shape(start_gateway: GatewayFactory) -> None:
    gw = start_gateway(VELOX_WORKERS="2")
    client = client_for(gw)
    inp = out = 0
    chat = client.chat.completions.create(model="gpt-4o", messages=MESSAGES)  # type: ignore
    assert chat.usage is not None
    inp, out = inp + chat.usage.prompt_tokens, out + chat.usage.completion_tokens
    comp = client.completions.create(model="gpt-4o", prompt="Say something " * 20)
    assert comp.usage is not None
    inp, out = inp + comp.usage.prompt_tokens, out + comp.usage.completion_tokens
    emb = client.embeddings.create(model="text-embedding-3-small", input=["a" * 80, "b" * 40])
    inp += emb.usage.prompt_tokens
    resp = client.responses.create(model="gpt-4o", input="Tell me about tokens " * 10)
    assert resp.usage is not None
    inp, out = inp + resp.usage.input_tokens, out + resp.usage.output_tokens
    stream = client.completions.create(model="gpt-4o", prompt="Stream it " * 12, stream=True)
    pieces = list(stream)
    assert all(getattr(p, "usage", None) is None for p in pieces)
    # the legacy completions stream's usage, as the mock reports it when asked
    u = usage.usage_of(payloads_completion_usage("Stream it " * 12))
    assert u is not None
    inp, out = inp + u[0], out + u[1]
    rstream = list(client.responses.create(model="gpt-4o", input="Stream me " * 9, stream=True))
    done = rstream[-1].response.usage  # type: ignore[union-attr]
    inp, out = inp + done.input_tokens, out + done.output_tokens
    assert wait_for(lambda: tokens(gw).get(("-", "*")) == (inp, out)), (tokens(gw), inp, out)


def payloads_completion_usage(prompt: str) -> bytes:
    """The usage chunk the mock sends for a default completions stream that asks for it."""
    from velox_lab.mock import payloads

    events = payloads.completion_stream({"prompt": prompt, "stream_options": {
        "include_usage": True}}, "gpt-4o", "x", 1, 8)
    return events[-2][len(b"data: "):]


def leave_a_stream(base_url: str, delay_ms: int) -> bytes:
    """A stream of 40 events `delay_ms` apart whose client reads three and leaves; its body."""
    body = orjson.dumps({"model": "gpt-4o", "messages": MESSAGES, "stream": True,
                         "max_tokens": 500})
    headers = {**AUTH, "content-type": "application/json", "x-mock-chunks": "40",
               "x-mock-chunk-delay-ms": str(delay_ms)}
    with httpx.Client(timeout=20) as client, client.stream(
            "POST", base_url + "/v1/chat/completions", content=body, headers=headers) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    break
    return body


def test_stream_cut_short_is_charged_input_and_relayed_output(
        start_gateway: GatewayFactory, upstream: MockUpstream) -> None:
    gw = start_gateway(VELOX_WORKERS="1")
    body = leave_a_stream(gw.base_url, 150)
    estimated_input = usage.input_tokens(body)  # the client's body, as it was estimated
    got = wait_for(lambda: tokens(gw).get(("-", "*")))
    assert got[0] == estimated_input
    # At least what the client read; far fewer than the 40 events (or the 500 reserved).
    assert 3 <= got[1] <= 10, got
    assert wait_for(lambda: upstream.requests(3)[-1]["cancelled"])


def test_accounting_off_sends_the_body_unchanged(start_gateway: GatewayFactory,
                                                 upstream: MockUpstream) -> None:
    # Pricing (VELOX_SPEND) reads every answer's usage too: both off, nothing reads it.
    gw = start_gateway(VELOX_WORKERS="1", VELOX_TOKEN_ACCOUNTING="0", VELOX_SPEND="0")
    body = orjson.dumps({"model": "gpt-4o", "messages": MESSAGES, "stream": True})
    r = httpx.post(gw.base_url + "/v1/chat/completions", content=body, headers={
        **AUTH, "content-type": "application/json"}, timeout=20)
    assert r.status_code == 200
    assert upstream.requests(5)[-1]["body_sha256"] == hashlib.sha256(body).hexdigest()
    assert admin_stats(gw)["tokens"] == []


# --- per-upstream tpm ----------------------------------------------------------------------


def two_up(fresh: dict, a: dict, b: dict) -> str:
    return upstream_table("a", fresh["a"], **a) + upstream_table("b", fresh["b"], **b) + """
[[route]]
model = "m"
targets = [{ upstream = "a", weight = 100 }, { upstream = "b", priority = 1 }]
"""


def chat(gw: Any, max_tokens: int, **headers: str) -> httpx.Response:
    return httpx.post(gw.base_url + "/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
        headers={**AUTH, **headers}, timeout=30)


def test_upstream_tpm_moves_traffic_before_the_provider_says_429(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # a: 1000 tokens a minute (the refill, 16 a second, is negligible here); each request
    # reserves its input (~20) + max_tokens 300, and uses far less: a 4 s latency keeps the
    # first three in flight, so their reservations (~960) are all held at once.
    gw = start(tmp_path, write_config(tmp_path, two_up(fresh, {"tpm": 1000}, {})))
    gateways.append(gw)
    fresh["a"].behave(latency_ms=4000)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(6) as pool:
        held = [pool.submit(chat, gw, 300) for _ in range(3)]
        row = wait_for(lambda: (lambda r: r if r["in_flight"] == 3 else None)(
            upstream_stats(gw, "a")))
        assert row["tpm_available"] < 320  # three reservations held (same snapshot)
        # Now a cannot cover another 320: b (no tpm, the lower priority) serves these.
        more = [pool.submit(chat, gw, 300) for _ in range(3)]
        second = [f.result() for f in more]
        first = [f.result() for f in held]
    assert [r.status_code for r in first + second] == [200] * 6
    assert [r.headers["x-velox-upstream"] for r in first] == ["a"] * 3
    assert [r.headers["x-velox-upstream"] for r in second] == ["b"] * 3
    assert all(r.json()["usage"] for r in first)
    # a never answered 429: it was not asked beyond its quota.
    assert all(q["status"] == 200 for q in fresh["a"].requests(20) if q["path"] != "/v1/models")
    # Settled from the real usage: most of the 960 reserved came back.
    row = upstream_stats(gw, "a")
    assert row["tpm"] == 1000 and row["tpm_available"] > 800, row


def test_upstream_over_use_is_debt_that_moves_the_next_request(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # a: tpm 600. A request reserving ~21 tokens (max_tokens 1) is answered with 500 output
    # tokens (the mock ignores max_tokens): the 480-token excess is charged, and the next such
    # answer drives the bucket below zero: a request after that goes to b until it is repaid.
    gw = start(tmp_path, write_config(tmp_path, two_up(fresh, {"tpm": 600}, {})))
    gateways.append(gw)
    fresh["a"].behave(chunks=502)
    r1 = chat(gw, 1)
    assert r1.headers["x-velox-upstream"] == "a"
    assert r1.json()["usage"]["completion_tokens"] == 500
    level = upstream_stats(gw, "a")["tpm_available"]
    assert level < 600 - 480, level  # charged the over-use, not just the reservation
    r2 = chat(gw, 1)
    assert r2.headers["x-velox-upstream"] == "a"  # ~100 left covers the ~21 reserved
    assert upstream_stats(gw, "a")["tpm_available"] < 0  # in debt now
    r3 = chat(gw, 1)
    assert r3.status_code == 200 and r3.headers["x-velox-upstream"] == "b"
    assert chat_calls(fresh["a"]) == 2


# --- a gateway key's tpm -----------------------------------------------------------------------

KEY = "sk-velox-team-a-0123456789"


def one_up_with_key(fresh: dict, tpm: int) -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return upstream_table("a", fresh["a"]) + f"""
[[route]]
model = "m"
targets = [{{ upstream = "a" }}]

[[key]]
name = "team-a"
sha256 = "{digest}"
tpm = {tpm}
"""


def keyed(gw: Any, max_tokens: int | None = None, **headers: str) -> httpx.Response:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return httpx.post(gw.base_url + "/v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {KEY}", **headers}, timeout=30)


def key_row(gw: Any) -> dict[str, Any]:
    return next(k for k in admin_stats(gw)["keys"] if k["name"] == "team-a")


def test_key_tpm_admits_until_the_tokens_run_out_then_429(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # tpm 600 (10 a second). Each request reserves its input (~20) + max_tokens 250; a 2 s
    # answer keeps two reservations (~540) held, so a third cannot be covered: 429.
    gw = start(tmp_path, write_config(tmp_path, one_up_with_key(fresh, 600)))
    gateways.append(gw)
    fresh["a"].behave(latency_ms=2000)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(keyed, gw, 250) for _ in range(2)]
        wait_for(lambda: key_row(gw)["active"] == 2)
        refused = keyed(gw, 250)
        answered = [f.result() for f in held]
    assert [r.status_code for r in answered] == [200, 200]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "tokens per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert chat_calls(fresh["a"]) == 2  # the refused one never reached the upstream
    # Settled from the usage (about 10 tokens each): the unused reservations came back, so
    # the same request is admitted again at once.
    used = sum(r.json()["usage"]["total_tokens"] for r in answered)
    fresh["a"].behave()
    again = keyed(gw, 250)
    assert again.status_code == 200, again.text
    used += again.json()["usage"]["total_tokens"]
    counted = wait_for(lambda: tokens(gw).get(("team-a", "m")))
    assert sum(counted) == used
    m = metric_tokens(gw)
    assert m[("team-a", "m", "input")] + m[("team-a", "m", "output")] == used
    assert key_row(gw)["remaining_tokens"] >= 600 - used - 5  # ~5: the refill meanwhile


def test_key_over_use_is_debt_the_next_request_waits_for(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # tpm 600: a request reserving ~21 tokens (max_tokens 1) gets 1000 output tokens (the mock
    # ignores max_tokens): ~980 over-use is charged, leaving the key ~400 tokens in debt, which
    # the refill (10 a second) repays in about 40 s: the next request is refused until then.
    gw = start(tmp_path, write_config(tmp_path, one_up_with_key(fresh, 600)))
    gateways.append(gw)
    fresh["a"].behave(chunks=1002)
    first = keyed(gw, 1)
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]
    assert used > 1000
    remaining = key_row(gw)["remaining_tokens"]
    assert remaining < 600 - used + 20, remaining  # charged what was used, not the reservation
    assert remaining < 0  # in debt
    fresh["a"].behave()
    second = keyed(gw, 1)
    assert second.status_code == 429, second.text
    wait = int(second.headers["retry-after"])
    # the debt plus the new reservation, at 10 tokens a second
    assert wait >= (-remaining) // 10, (wait, remaining)
    assert chat_calls(fresh["a"]) == 1
    counted = wait_for(lambda: tokens(gw).get(("team-a", "m")))
    assert sum(counted) == used


def test_key_stream_settles_and_strips(tmp_path: Path, fresh: dict, gateways: list) -> None:
    gw = start(tmp_path, write_config(tmp_path, one_up_with_key(fresh, 100_000)))
    gateways.append(gw)
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=KEY, max_retries=0, timeout=20)
    closed_after_the_test(client)
    chunks = list(client.chat.completions.create(model="m", messages=MESSAGES,  # type: ignore
                                                 stream=True, max_tokens=50))
    assert all(c.usage is None and "usage" not in c.model_fields_set for c in chunks)
    asked = list(client.chat.completions.create(
        model="m", messages=MESSAGES, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, max_tokens=50))
    final = asked[-1].usage
    assert final is not None
    expect = 2 * final.total_tokens  # the same request twice
    assert wait_for(lambda: sum(tokens(gw).get(("team-a", "m"), (0, 0))) == expect)


def test_an_upstream_with_stream_usage_false_gets_the_body_unchanged(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    # For an OpenAI-compatible server that rejects stream_options: nothing is added, the client
    # gets the upstream's stream as it is, and the request is charged its estimate (input) plus
    # one token per relayed event, marked not exact.
    config = upstream_table("a", fresh["a"], stream_usage=False) + """
[[route]]
model = "m"
targets = [{ upstream = "a" }]
"""
    gw = start(tmp_path, write_config(tmp_path, config), VELOX_ACCESS_LOG="1")
    gateways.append(gw)
    body = orjson.dumps({"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 50})
    r = httpx.post(gw.base_url + "/v1/chat/completions", content=body, headers={
        **AUTH, "content-type": "application/json"}, timeout=20)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert fresh["a"].requests(5)[-1]["body_sha256"] == hashlib.sha256(body).hexdigest()
    events = r.text.count("\n\n")
    got = wait_for(lambda: tokens(gw).get(("-", "m")))
    assert got == (usage.input_tokens(body), events)
    line = wait_for(lambda: [a for a in access_lines(gw) if a["path"] == "/v1/chat/completions"])
    assert line[-1]["usage"] == {"input": got[0], "output": got[1], "exact": False}


def test_every_upstream_out_of_tokens_is_429_from_the_gateway(
        tmp_path: Path, fresh: dict, gateways: list) -> None:
    config = upstream_table("a", fresh["a"], tpm=600) + """
[[route]]
model = "m"
targets = [{ upstream = "a" }]
"""
    gw = start(tmp_path, write_config(tmp_path, config))
    gateways.append(gw)
    fresh["a"].behave(latency_ms=2000)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(chat, gw, 250) for _ in range(2)]
        wait_for(lambda: upstream_stats(gw, "a")["in_flight"] == 2)
        refused = chat(gw, 250)
        answered = [f.result() for f in held]
    assert [r.status_code for r in answered] == [200, 200]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert "token rate limit" in refused.json()["error"]["message"]
    assert chat_calls(fresh["a"]) == 2  # the provider was never asked beyond its quota
