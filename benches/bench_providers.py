"""Translation cost of the anthropic kind and of the Messages API in front, from Python.

Per request: `AnthropicTranslator.chat` (OpenAI chat -> Messages body, encoded) and
`messages_to_chat` (Messages -> chat dict) on the same conversation (system prompt, three
turns, one tool), and the answers back (`chat_answer`, `chat_to_messages`). Per streamed event:
an Anthropic stream of 64 text deltas fed one event per read through `AnthropicStream`, and a
chat chunk stream of 64 deltas through `ChatToMessagesStream`. Each benchmark's `extra_info`
gives microseconds per request or per event; the reference is `orjson.loads` of the request
body, the one parse the gateway does anyway (`ratio_vs_parse`: translation / parse).

Run: `.venv/bin/pytest --benchmark benches/bench_providers.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from velox.providers.anthropic import AnthropicTranslator
from velox.providers.messages import ChatToMessagesStream, chat_to_messages, messages_to_chat

LOOPS = 200
EVENTS = 64
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CHAT = {"model": "gpt-4o", "stream": True, "tools": [TOOL],
        "messages": [{"role": "system", "content": "You are a helpful assistant. " * 8},
                     {"role": "user", "content": "What is the weather in Paris today?"},
                     {"role": "assistant", "content": "Let me check.", "tool_calls": [
                         {"id": "toolu_1", "type": "function",
                          "function": {"name": "get_weather",
                                       "arguments": '{"city":"Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"}]}
MESSAGES = {"model": "claude-x", "max_tokens": 1024, "stream": True,
            "system": "You are a helpful assistant. " * 8,
            "tools": [{"name": "get_weather", "description": "The weather in a city.",
                       "input_schema": TOOL["function"]["parameters"]}],
            "messages": [{"role": "user", "content": "What is the weather in Paris today?"},
                         {"role": "assistant", "content": [
                             {"type": "text", "text": "Let me check."},
                             {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                              "input": {"city": "Paris"}}]},
                         {"role": "user", "content": [{"type": "tool_result",
                                                       "tool_use_id": "toolu_1",
                                                       "content": "Sunny, 21 C"}]}]}
MESSAGE = orjson.dumps({
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
    "content": [{"type": "text", "text": "It is sunny in Paris, 21 degrees. " * 4}],
    "stop_reason": "end_turn", "stop_sequence": None,
    "usage": {"input_tokens": 120, "output_tokens": 40, "cache_read_input_tokens": 0,
              "cache_creation_input_tokens": 0}})
COMPLETION = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o",
    "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "It is sunny in Paris, 21 degrees. " * 4}}],
    "usage": {"prompt_tokens": 120, "completion_tokens": 40}})


def _event(kind: str, **fields: object) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) \
        + b"\n\n"


ANTHROPIC_EVENTS = [
    _event("message_start", message={"id": "msg_1", "usage": {"input_tokens": 9,
                                                              "output_tokens": 1}}),
    _event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
    *[_event("content_block_delta", index=0, delta={"type": "text_delta", "text": " word"})
      for _ in range(EVENTS)],
    _event("content_block_stop", index=0),
    _event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 64}),
    _event("message_stop")]
CHUNK_EVENTS = [
    b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1,
                              "model": "gpt-4o", "choices": [{"index": 0, "delta": delta,
                                                              "finish_reason": finish}]})
    + b"\n\n"
    for delta, finish in [({"role": "assistant", "content": ""}, None),
                          *[({"content": " word"}, None)] * EVENTS, ({}, "stop")]
] + [b"data: [DONE]\n\n"]

_medians: dict[str, float] = {}
TRANSLATOR = AnthropicTranslator("sk-ant-bench")


def _loop(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(LOOPS):
            fn()
    return run


def _record(benchmark: pytest.FixtureRequest, name: str, per: int, unit: str) -> None:
    seconds = benchmark.stats.stats.median / (LOOPS * per)  # type: ignore[attr-defined]
    _medians[name] = seconds
    benchmark.extra_info[f"us_per_{unit}"] = round(seconds * 1e6, 3)  # type: ignore[attr-defined]
    parse = _medians.get("parse")
    if parse and name != "parse":
        benchmark.extra_info["ratio_vs_parse"] = round(seconds / parse, 2)  # type: ignore


@pytest.mark.benchmark(group="providers-request")
def test_parse_reference(benchmark):
    body = orjson.dumps(CHAT)
    benchmark(_loop(lambda: orjson.loads(body)))
    _record(benchmark, "parse", 1, "request")


@pytest.mark.benchmark(group="providers-request")
def test_chat_to_anthropic(benchmark):
    benchmark(_loop(lambda: TRANSLATOR.chat(CHAT, "claude-x", True, [])))
    _record(benchmark, "chat_to_anthropic", 1, "request")


@pytest.mark.benchmark(group="providers-request")
def test_messages_to_chat(benchmark):
    benchmark(_loop(lambda: messages_to_chat(MESSAGES)))
    _record(benchmark, "messages_to_chat", 1, "request")


@pytest.mark.benchmark(group="providers-answer")
def test_anthropic_answer(benchmark):
    benchmark(_loop(lambda: TRANSLATOR.chat_answer(200, [], MESSAGE, "gpt-4o")))
    _record(benchmark, "anthropic_answer", 1, "answer")


@pytest.mark.benchmark(group="providers-answer")
def test_chat_answer_to_messages(benchmark):
    benchmark(_loop(lambda: chat_to_messages(COMPLETION, "claude-x")))
    _record(benchmark, "chat_to_messages", 1, "answer")


def _stream(make: Callable[[], object], events: list[bytes]) -> Callable[[], None]:
    def run() -> None:
        for _ in range(LOOPS):
            stream = make()
            for event in events:  # one event per read, as a DATA frame usually carries
                stream.feed(event)  # type: ignore[attr-defined]
            stream.end()  # type: ignore[attr-defined]
    return run


@pytest.mark.benchmark(group="providers-stream")
def test_anthropic_stream_per_event(benchmark):
    benchmark(_stream(lambda: TRANSLATOR.chat_stream("gpt-4o", True), ANTHROPIC_EVENTS))
    _record(benchmark, "anthropic_stream", len(ANTHROPIC_EVENTS), "event")


@pytest.mark.benchmark(group="providers-stream")
def test_chat_stream_to_messages_per_event(benchmark):
    benchmark(_stream(lambda: ChatToMessagesStream("claude-x"), CHUNK_EVENTS))
    _record(benchmark, "chat_to_messages_stream", len(CHUNK_EVENTS), "event")
