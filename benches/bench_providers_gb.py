"""Translation cost of the Gemini and Bedrock kinds, per request and per streamed event.

For each kind:
* request:  a typical chat request (system, two turns, one tool) parsed dict -> UpstreamCall
            (Bedrock's includes SigV4 signing with botocore, also timed alone as `sign`);
* answer:   the upstream's complete answer (text + usage) -> OpenAI answer bytes;
* stream:   a 64-event text stream fed one event per `feed` (as reads deliver them), then
            `end()`; `per_event_us` = median / 64 is recorded in extra_info.

Reference: `orjson_roundtrip` parses and re-encodes the same answer body, the least any
translation that reads the body must do.

Run: `.venv/bin/pytest --benchmark benches/bench_providers_gb.py`.
"""

from __future__ import annotations

import orjson
import pytest

from velox.providers.bedrock import BedrockTranslator
from velox.providers.gemini import GeminiTranslator
from velox_lab.mock import eventstream

EVENTS = 64
REQUEST = {
    "model": "alias", "temperature": 0.3, "max_tokens": 256,
    "messages": [{"role": "system", "content": "You are a helpful assistant."},
                 {"role": "user", "content": "What is the weather in Oslo today?"},
                 {"role": "assistant", "content": "Let me look that up for you."},
                 {"role": "user", "content": "Please be quick, and use Celsius."}],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}],
}
TEXT = "The weather in Oslo is 3 degrees Celsius and cloudy, with light wind from the west."
GEMINI_ANSWER = orjson.dumps({
    "candidates": [{"content": {"parts": [{"text": TEXT}], "role": "model"},
                    "finishReason": "STOP", "index": 0}],
    "usageMetadata": {"promptTokenCount": 60, "candidatesTokenCount": 20,
                      "totalTokenCount": 80}, "modelVersion": "gemini-2.5-flash"})
BEDROCK_ANSWER = orjson.dumps({
    "output": {"message": {"role": "assistant", "content": [{"text": TEXT}]}},
    "stopReason": "end_turn", "usage": {"inputTokens": 60, "outputTokens": 20,
                                        "totalTokens": 80}, "metrics": {"latencyMs": 300}})
GEMINI_EVENTS = [b"data: " + orjson.dumps({"candidates": [{"content": {"parts": [
    {"text": f" word{i}"}], "role": "model"}, "index": 0, **(
        {"finishReason": "STOP"} if i == EVENTS - 1 else {})}],
    "usageMetadata": {"promptTokenCount": 60, "candidatesTokenCount": i + 1}}) + b"\r\n\r\n"
    for i in range(EVENTS)]
BEDROCK_EVENTS = ([eventstream.event("messageStart", {"role": "assistant"})]
                  + [eventstream.event("contentBlockDelta", {"delta": {"text": f" word{i}"},
                                                             "contentBlockIndex": 0})
                     for i in range(EVENTS - 3)]
                  + [eventstream.event("contentBlockStop", {"contentBlockIndex": 0}),
                     eventstream.event("messageStop", {"stopReason": "end_turn"})])
BEDROCK_TAIL = eventstream.event("metadata", {"usage": {"inputTokens": 60, "outputTokens": 61,
                                                        "totalTokens": 121},
                                              "metrics": {"latencyMs": 1}})

GEMINI = GeminiTranslator("AIza-bench")
BEDROCK = BedrockTranslator("us-east-1", "AKIAIOSFODNN7EXAMPLE", "secret")
KINDS = {"gemini": (GEMINI, "gemini-2.5-flash", GEMINI_ANSWER, GEMINI_EVENTS),
         "bedrock": (BEDROCK, "anthropic.claude-3-5-haiku-20241022-v1:0", BEDROCK_ANSWER,
                     [*BEDROCK_EVENTS, BEDROCK_TAIL])}


@pytest.mark.parametrize("kind", KINDS)
def test_request(benchmark, kind):
    translator, model, _, _ = KINDS[kind]
    benchmark.group = "providers-gb: request"
    call = benchmark(translator.chat, REQUEST, model, False, [])
    assert call.body


def test_bedrock_sign(benchmark):
    benchmark.group = "providers-gb: request"
    body = BEDROCK.chat(REQUEST, "m", False, []).body
    headers = benchmark(BEDROCK.sign, b"/model/m/converse", body)
    assert any(name == b"authorization" for name, _ in headers)


@pytest.mark.parametrize("kind", KINDS)
def test_answer(benchmark, kind):
    translator, _, answer, _ = KINDS[kind]
    benchmark.group = "providers-gb: answer"
    out = benchmark(translator.chat_answer, 200, [], answer, "alias")
    assert out.status == 200


def test_orjson_roundtrip(benchmark):
    benchmark.group = "providers-gb: answer"
    benchmark(lambda: orjson.dumps(orjson.loads(GEMINI_ANSWER)))


@pytest.mark.parametrize("kind", KINDS)
def test_stream(benchmark, kind):
    translator, _, _, events = KINDS[kind]
    benchmark.group = f"providers-gb: stream of {EVENTS} events"

    def run() -> bytes:
        stream = translator.chat_stream("alias", True)
        out = [stream.feed(event) for event in events]
        out.append(stream.end())
        return b"".join(out)

    body = benchmark(run)
    assert body.endswith(b"data: [DONE]\n\n")
    benchmark.extra_info["per_event_us"] = round(benchmark.stats.stats.median / EVENTS * 1e6, 2)
