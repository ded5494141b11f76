"""The Messages API in front of Gemini and Bedrock, socket-free: Messages -> chat -> the kind's
call, and the kind's answers and streams back through chat to Messages (the chain the gateway
runs for a `/v1/messages` request routed to either kind)."""

from __future__ import annotations

from typing import Any

import orjson
from anthropic.types import Message
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.providers import test_bedrock as bedrock_tests
from tests.providers import test_gemini as gemini_tests
from velox.providers import messages, sse
from velox.providers.base import Translator

GEMINI = gemini_tests.T
BEDROCK = bedrock_tests.T
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
CONVERSATION = {
    "model": "m", "max_tokens": 100, "system": [{"type": "text", "text": "Be brief."}],
    "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Weather here?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 degrees"}]}]}


def call_body(translator: Translator, body: dict[str, Any]) -> dict[str, Any]:
    chat = messages.messages_to_chat(body, translator.kind)
    return orjson.loads(translator.chat(chat, "m-1", False, []).body)


def test_gemini_call_keeps_system_tools_image_and_the_tool_turn() -> None:
    sent = call_body(GEMINI, CONVERSATION)
    assert sent["systemInstruction"] == {"parts": [{"text": "Be brief."}]}
    assert sent["tools"][0]["functionDeclarations"][0]["name"] == "get_weather"
    user, model, result = sent["contents"]
    assert user["parts"][1] == {"inlineData": {"mimeType": "image/png", "data": PNG}}
    assert model["parts"][0]["functionCall"]["args"] == {"city": "Oslo"}
    # Gemini needs the function's name on the result: found from the earlier tool_use.
    assert result["parts"][0]["functionResponse"]["name"] == "get_weather"
    assert sent["generationConfig"]["maxOutputTokens"] == 100


def test_bedrock_call_keeps_system_tools_image_and_the_tool_turn() -> None:
    sent = call_body(BEDROCK, CONVERSATION)
    assert sent["system"] == [{"text": "Be brief."}]
    assert sent["toolConfig"]["tools"][0]["toolSpec"]["name"] == "get_weather"
    user, assistant, result = sent["messages"]
    assert user["content"][1] == {"image": {"format": "png", "source": {"bytes": PNG}}}
    assert assistant["content"][0]["toolUse"]["toolUseId"] == "toolu_1"
    assert result["content"][0]["toolResult"]["toolUseId"] == "toolu_1"
    assert sent["inferenceConfig"]["maxTokens"] == 100


def test_bedrock_answer_with_cache_reads_and_writes() -> None:
    body = orjson.dumps({
        "output": {"message": {"role": "assistant", "content": [{"text": "Hello"}]}},
        "stopReason": "end_turn",
        "usage": {"inputTokens": 20, "outputTokens": 7, "totalTokens": 1227,
                  "cacheReadInputTokens": 1000, "cacheWriteInputTokens": 200}})
    answer = messages.provider_answer(BEDROCK, 200, [], body, "alias")
    message = Message.model_validate(orjson.loads(answer.body))
    assert message.model == "alias" and message.content[0].text == "Hello"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens,
            usage.cache_creation_input_tokens, usage.output_tokens) == (20, 1000, 200, 7)


def test_provider_errors_in_anthropics_shape() -> None:
    status, body = 503, orjson.dumps({"error": {"code": 503, "message": "Overloaded.",
                                                "status": "UNAVAILABLE"}})
    answer = messages.provider_answer(GEMINI, status, [], body, "m")
    assert answer.status == 529
    assert orjson.loads(answer.body) == {"type": "error", "error": {
        "type": "overloaded_error", "message": "Overloaded."}}
    throttled = messages.provider_answer(
        BEDROCK, 429, [(b"x-amzn-errortype", b"ThrottlingException:http://x")],
        b'{"message":"Slow down."}', "m")
    assert throttled.status == 429
    assert orjson.loads(throttled.body)["error"]["type"] == "rate_limit_error"


# --- streams ------------------------------------------------------------------------------------


def events(raw: bytes) -> list[dict[str, Any]]:
    splitter = sse.Splitter()
    return [orjson.loads(sse.fields(block)[1]) for block in splitter.feed(raw)]


def chained(translator: Translator, raw: bytes, pieces: list[int] | None = None) -> bytes:
    stream = messages.ChainedStream(translator, "alias")
    out = []
    at = 0
    for size in pieces or []:
        out.append(stream.feed(raw[at:at + size]))
        at += size
    out.append(stream.feed(raw[at:]))
    out.append(stream.end())
    return b"".join(out)


def reassembled(raw: bytes) -> tuple[str, list[tuple[str, Any]], dict[str, Any]]:
    """(text, [(tool name, input)], the last message_delta) of a Messages event stream."""
    text, tools, partial, last = "", [], "", {}
    for event in events(raw):
        kind = event["type"]
        if kind == "content_block_start" and event["content_block"]["type"] == "tool_use":
            tools.append(event["content_block"]["name"])
        elif kind == "content_block_delta" and event["delta"]["type"] == "text_delta":
            text += event["delta"]["text"]
        elif kind == "content_block_delta":
            partial += event["delta"]["partial_json"]
        elif kind == "content_block_stop" and partial:
            tools[-1] = (tools[-1], orjson.loads(partial))
            partial = ""
        elif kind == "message_delta":
            last = event
    return text, tools, last


def test_gemini_stream_as_messages_events() -> None:
    out = chained(GEMINI, gemini_tests.TEXT_STREAM)
    kinds = [e["type"] for e in events(out)]
    assert kinds == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_delta", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    text, _, last = reassembled(out)
    assert text == "Héllo wörld 🌍!"
    assert last["delta"]["stop_reason"] == "end_turn"
    assert last["usage"]["input_tokens"] == 8 and last["usage"]["output_tokens"] == 7
    tools = reassembled(chained(GEMINI, gemini_tests.TOOL_STREAM))[1]
    assert tools == [("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})]


def test_bedrock_stream_as_messages_events() -> None:
    text, tools, last = reassembled(chained(BEDROCK, bedrock_tests.TOOL_FRAMES))
    assert text == "Checking."
    assert tools == [("get_weather", {"city": "Oslo"}), ("time", {})]
    assert last["delta"]["stop_reason"] == "tool_use"
    # Converse reports cache reads beside inputTokens; Anthropic does too.
    usage = reassembled(chained(BEDROCK, bedrock_tests.TEXT_FRAMES))[2]["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (9, 3)


def test_a_cut_stream_ends_with_an_error_event() -> None:
    raw = gemini_tests.TEXT_STREAM
    out = events(chained(GEMINI, raw[:len(raw) // 2]))
    assert out[-1]["type"] == "error" and out[-1]["error"]["message"]
    assert "message_stop" not in [e["type"] for e in out]


def _without_ids(raw: bytes) -> list[dict[str, Any]]:
    out = events(raw)
    for event in out:
        if event["type"] == "message_start":
            event["message"]["id"] = ""
        block = event.get("content_block") or {}
        if block.get("type") == "tool_use" and block["id"].startswith("call_vx"):
            block["id"] = ""  # minted per answer (Gemini gave none)
    return out


@settings(max_examples=100, deadline=None)
@given(case=st.sampled_from([(GEMINI, gemini_tests.TEXT_STREAM),
                             (GEMINI, gemini_tests.TOOL_STREAM),
                             (BEDROCK, bedrock_tests.TEXT_FRAMES),
                             (BEDROCK, bedrock_tests.TOOL_FRAMES)]), data=st.data())
def test_any_split_gives_the_same_events(case: tuple[Translator, bytes],
                                         data: st.DataObject) -> None:
    translator, raw = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    pieces = [b - a for a, b in zip([0, *cuts], cuts, strict=False)]
    assert _without_ids(chained(translator, raw, pieces)) == \
        _without_ids(chained(translator, raw))

