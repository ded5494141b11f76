"""The anthropic translator without sockets: canned requests, answers and event streams shaped
as the Messages API reference shows them, and hypothesis splits of the streams (any split of the
upstream bytes gives the same client events; text and tool arguments reassemble exactly)."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.core.errors import to_response
from velox.providers.anthropic import FINISH, AnthropicTranslator
from velox.providers.base import Untranslatable

KEY = "sk-ant-secret-value-42"
T = AnthropicTranslator(KEY)
HI = [{"role": "user", "content": "Hi"}]


def sent(body: dict, headers: list | None = None, stream: bool = False) -> dict:
    return orjson.loads(T.chat({"model": "gpt-x", **body}, "claude-up", stream,
                               headers or []).body)


def ev(kind: str, **fields: object) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) \
        + b"\n\n"


# --- requests -----------------------------------------------------------------------------------


def test_messages_roles_system_and_tool_turns():
    out = sent({"messages": [
        {"role": "system", "content": "Rule one."},
        {"role": "user", "content": "What is the weather?"},
        {"role": "developer", "content": [{"type": "text", "text": "Rule two."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "w", "arguments": '{"city":"Paris"}'}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "w", "arguments": '{"city":"Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": [{"type": "text",
                                                                 "text": "Rain"}]},
        {"role": "user", "content": "Thanks"}]})
    assert out["system"] == [{"type": "text", "text": "Rule one."},
                             {"type": "text", "text": "Rule two."}]
    assert [m["role"] for m in out["messages"]] == ["user", "assistant", "user"]
    assert out["messages"][1]["content"] == [
        {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "w", "input": {"city": "Oslo"}}]
    assert out["messages"][2]["content"] == [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2",
         "content": [{"type": "text", "text": "Rain"}]},
        {"type": "text", "text": "Thanks"}]
    assert out["max_tokens"] == 4096 and out["model"] == "claude-up"


def test_parameters():
    out = sent({"messages": HI, "max_completion_tokens": 300, "temperature": 0.2,
                "top_p": 0.9, "stop": "END", "user": "u-1", "seed": 7, "n": 1,
                "logprobs": False, "stream_options": {"include_usage": True},
                "tools": [{"type": "function", "function": {
                    "name": "f", "description": "d", "strict": True}}],
                "tool_choice": "required", "parallel_tool_calls": False}, stream=True)
    assert out["max_tokens"] == 300 and out["temperature"] == 0.2 and out["top_p"] == 0.9
    assert out["stop_sequences"] == ["END"] and out["metadata"] == {"user_id": "u-1"}
    assert out["tools"] == [{"name": "f", "description": "d", "strict": True,
                             "input_schema": {"type": "object", "properties": {}}}]
    assert out["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert out["stream"] is True and "seed" not in out and "n" not in out


@pytest.mark.parametrize("choice, expected", [
    ("auto", {"type": "auto"}), ("none", {"type": "none"}), ("required", {"type": "any"}),
    ({"type": "function", "function": {"name": "f"}}, {"type": "tool", "name": "f"})])
def test_tool_choice(choice, expected):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert sent({"messages": HI, "tools": tools, "tool_choice": choice})["tool_choice"] \
        == expected


@pytest.mark.parametrize("effort, max_tokens, budget, limit", [
    ("minimal", None, 1024, 4096 + 1024), ("high", None, 16384, 4096 + 16384),
    ("medium", 20000, 8192, 20000), ("medium", 3000, 2999, 3000)])
def test_reasoning_effort_budget(effort, max_tokens, budget, limit):
    out = sent({"messages": HI, "reasoning_effort": effort, "max_tokens": max_tokens})
    assert out["thinking"] == {"type": "enabled", "budget_tokens": budget}
    assert out["max_tokens"] == limit


def test_reasoning_effort_none_sends_no_thinking():
    assert "thinking" not in sent({"messages": HI, "reasoning_effort": "none"})


def test_images_files_and_cache_control():
    out = sent({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png",
                                            "detail": "high"}},
        {"type": "file", "file": {"filename": "a.pdf",
                                  "file_data": "data:application/pdf;base64,JVBERi0="}},
        {"type": "file", "file": {"file_data": "data:text/plain;base64,aMOpbGxv"}}]}]})
    assert out["messages"][0]["content"] == [
        {"type": "text", "text": "Look", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "document", "title": "a.pdf",
         "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "héllo"}}]


@pytest.mark.parametrize("body, param", [
    ({"n": 3}, "n"), ({"logprobs": True}, "logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "x"}}, "audio"),
    ({"temperature": 1.5}, "temperature"), ({"brand_new_option": 1}, "brand_new_option"),
    ({"response_format": {"type": "json_object"},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "response_format"),
    ({"reasoning_effort": "low", "max_tokens": 1000}, "max_completion_tokens"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"tools": [{"type": "custom", "custom": {"name": "g"}}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/bmp;base64,Qk0="}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0]")])
def test_refusals_name_the_field_and_the_kind(body, param):
    with pytest.raises(Untranslatable) as caught:
        T.chat({"model": "m", "messages": HI, **body}, "claude", False, [])
    response = to_response(caught.value)
    error = orjson.loads(response.body)["error"]
    assert response.status == 400 and error["param"] == param
    assert error["code"] == "unsupported_parameter" and "'anthropic'" in error["message"]


def test_headers_beta_passthrough_and_no_key_in_repr():
    call = T.chat({"model": "m", "messages": HI}, "claude", False,
                  [(b"anthropic-beta", b"prompt-caching-2024-07-31"), (b"x-other", b"1")])
    assert dict(call.headers) == {b"content-type": b"application/json",
                                  b"x-api-key": KEY.encode(),
                                  b"anthropic-version": b"2023-06-01",
                                  b"anthropic-beta": b"prompt-caching-2024-07-31"}
    assert call.method == b"POST" and call.path == b"/v1/messages"
    assert KEY not in repr(T)
    prefixed = AnthropicTranslator(KEY, version="2024-01-01", base_path="/proxy/")
    assert prefixed.chat({"model": "m", "messages": HI}, "c", False, []).path \
        == b"/proxy/v1/messages"


def test_messages_passthrough_swaps_only_the_credential():
    body = b'{"model":"claude","max_tokens":5,"messages":[]}'
    client = [(b"x-api-key", b"client-key"), (b"anthropic-version", b"2023-06-01"),
              (b"anthropic-beta", b"b1")]
    call = T.messages(body, client)
    assert call.body is body
    assert dict(call.headers)[b"x-api-key"] == KEY.encode()
    assert dict(call.headers)[b"anthropic-beta"] == b"b1"
    assert T.messages(body, [], count_tokens=True).path == b"/v1/messages/count_tokens"
    assert dict(T.messages(body, [(b"anthropic-version", b"2099-01-01")]).headers)[
        b"anthropic-version"] == b"2099-01-01"


# --- answers ------------------------------------------------------------------------------------


MESSAGE = {
    "id": "msg_01XFDUDYJgAACzvnptvVoYEL", "type": "message", "role": "assistant",
    "model": "claude-sonnet-4-5",
    "content": [{"type": "thinking", "thinking": "Check the weather.", "signature": "EqQB"},
                {"type": "redacted_thinking", "data": "EmwKAh"},
                {"type": "text", "text": "I'll look that up."},
                {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9",
                 "name": "get_weather", "input": {"location": "San Francisco, CA"}}],
    "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 100, "cache_creation_input_tokens": 20,
              "cache_read_input_tokens": 3000, "output_tokens": 50,
              "output_tokens_details": {"thinking_tokens": 30}}}


def test_answer_with_thinking_tools_and_cache_usage():
    answer = T.chat_answer(200, [], orjson.dumps(MESSAGE), "my-model")
    body = orjson.loads(answer.body)
    assert body["id"] == MESSAGE["id"] and body["model"] == "my-model"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "I'll look that up."
    assert message["tool_calls"] == [{"id": "toolu_01A09q90qw90lq917835lq9", "type": "function",
                                      "function": {"name": "get_weather",
                                                   "arguments":
                                                   '{"location":"San Francisco, CA"}'}}]
    assert message["reasoning_content"] == "Check the weather."
    assert [b["type"] for b in message["thinking_blocks"]] == ["thinking", "redacted_thinking"]
    assert body["usage"] == {"prompt_tokens": 3120, "completion_tokens": 50,
                             "total_tokens": 3170,
                             "prompt_tokens_details": {"cached_tokens": 3000,
                                                       "cache_write_tokens": 20},
                             "completion_tokens_details": {"reasoning_tokens": 30}}
    assert (answer.usage.input, answer.usage.cached_input, answer.usage.cache_write,
            answer.usage.reasoning) == (3120, 3000, 20, 30)


@pytest.mark.parametrize("reason", sorted(FINISH))
def test_every_stop_reason(reason):
    body = {**MESSAGE, "content": [{"type": "text", "text": "x"}], "stop_reason": reason}
    finish = orjson.loads(T.chat_answer(200, [], orjson.dumps(body), "m").body)[
        "choices"][0]["finish_reason"]
    assert finish == FINISH[reason]
    assert finish in ("stop", "length", "tool_calls", "content_filter")


@pytest.mark.parametrize("status, kind, expected", [
    (400, "invalid_request_error", 400), (401, "authentication_error", 401),
    (402, "billing_error", 402), (403, "permission_error", 403),
    (404, "not_found_error", 404), (413, "request_too_large", 413),
    (429, "rate_limit_error", 429), (500, "api_error", 500), (504, "timeout_error", 504),
    (529, "overloaded_error", 503), (418, "teapot_error", 418)])
def test_error_answers(status, kind, expected):
    body = orjson.dumps({"type": "error", "error": {"type": kind, "message": "Said so."},
                         "request_id": "req_1"})
    answer = T.chat_answer(status, [(b"retry-after", b"7")], body, "m")
    assert answer.status == expected
    assert orjson.loads(answer.body)["error"] == {"message": "Said so.", "type": kind,
                                                  "param": None, "code": None}
    assert dict(answer.headers)[b"retry-after"] == b"7"


def test_error_answer_without_a_json_body():
    answer = T.chat_answer(502, [], b"<html>Bad gateway</html>", "m")
    assert answer.status == 502 and b"without an error body" in answer.body
    assert T.chat_answer(200, [], b"[]", "m").status == 502


# --- streams ------------------------------------------------------------------------------------


TOOL_STREAM = b"".join([
    ev("message_start", message={
        "id": "msg_014p7gG3wDgGV9EUtLvnow3U", "type": "message", "role": "assistant",
        "model": "claude-sonnet-4-5", "stop_sequence": None, "content": [],
        "usage": {"input_tokens": 472, "output_tokens": 2, "cache_read_input_tokens": 100,
                  "cache_creation_input_tokens": 0}, "stop_reason": None}),
    ev("content_block_start", index=0, content_block={"type": "thinking", "thinking": "",
                                                      "signature": ""}),
    ev("content_block_delta", index=0, delta={"type": "thinking_delta",
                                              "thinking": "Use the tool — ünïcode ✓."}),
    ev("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "EqQ"}),
    ev("content_block_stop", index=0),
    ev("content_block_start", index=1, content_block={"type": "text", "text": ""}),
    ev("ping"),
    ev("content_block_delta", index=1, delta={"type": "text_delta", "text": "Okay, let's"}),
    ev("content_block_delta", index=1, delta={"type": "text_delta", "text": " check 🌤 天気"}),
    ev("content_block_stop", index=1),
    ev("content_block_start", index=2, content_block={
        "type": "tool_use", "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "name": "get_weather",
        "input": {}}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta", "partial_json": ""}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta",
                                              "partial_json": '{"location":'}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta",
                                              "partial_json": ' "San Francisc'}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta",
                                              "partial_json": 'o, CA", "unit": "fah'}),
    ev("content_block_delta", index=2, delta={"type": "input_json_delta",
                                              "partial_json": 'renheit"}'}),
    ev("content_block_stop", index=2),
    ev("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None},
       usage={"output_tokens": 89}),
    ev("message_stop")])


def _events(out: bytes) -> list:
    """The client's events, `created` left out (it is the translation's clock)."""
    events = []
    for block in out.split(b"\n\n"):
        if not block:
            continue
        assert block.startswith(b"data: ")
        if block == b"data: [DONE]":
            events.append("[DONE]")
            continue
        value = orjson.loads(block[6:])
        value.pop("created", None)
        events.append(value)
    return events


def _translate(pieces: list[bytes], include_usage: bool = True) -> tuple[bytes, object]:
    stream = T.chat_stream("client-model", include_usage)
    out = b"".join(stream.feed(p) for p in pieces) + stream.end()
    return out, stream.usage


def _cuts(data: bytes) -> st.SearchStrategy[list[bytes]]:
    def split(points: list[int]) -> list[bytes]:
        points = sorted(set(points))
        return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=False)]
    return st.lists(st.integers(1, len(data) - 1), max_size=40).map(split)


WHOLE, WHOLE_USAGE = _translate([TOOL_STREAM])


def test_tool_stream_translated():
    events = _events(WHOLE)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {"msg_014p7gG3wDgGV9EUtLvnow3U"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert text == "Okay, let's check 🌤 天気" and reasoning == "Use the tool — ünïcode ✓."
    assert calls[0] == {"index": 0, "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert orjson.loads(arguments) == {"location": "San Francisco, CA", "unit": "fahrenheit"}
    assert [d["thinking_blocks"] for d in deltas if "thinking_blocks" in d] == [[
        {"index": 0, "type": "thinking", "thinking": "Use the tool — ünïcode ✓.",
         "signature": "EqQ"}]]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["prompt_tokens"] == 572
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 100
    assert chunks[-1]["usage"]["completion_tokens"] == 89
    assert WHOLE_USAGE.input == 572 and WHOLE_USAGE.output == 89


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_events(data):
    pieces = data.draw(_cuts(TOOL_STREAM))
    out, usage = _translate(pieces)
    assert _events(out) == _events(WHOLE)
    assert usage == WHOLE_USAGE


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1, max_size=40), st.data())
def test_any_text_reassembles_under_any_split(text, data):
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    upstream = b"".join([
        ev("message_start", message={"id": "msg_1", "usage": {"input_tokens": 1,
                                                              "output_tokens": 1}}),
        ev("content_block_start", index=0, content_block={"type": "text", "text": ""}),
        *[ev("content_block_delta", index=0, delta={"type": "text_delta", "text": p})
          for p in pieces],
        ev("content_block_stop", index=0),
        ev("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 3}),
        ev("message_stop")]).replace(b"\n", b"\r\n")
    out, _ = _translate(data.draw(_cuts(upstream)), include_usage=False)
    deltas = [e["choices"][0]["delta"] for e in _events(out)[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == text


def test_mid_stream_error_event_and_truncation():
    head = TOOL_STREAM[:TOOL_STREAM.index(b"event: content_block_start")]
    error = ev("error", error={"type": "overloaded_error", "message": "Overloaded"})
    out, usage = _translate([head, error, ev("message_stop")])
    last = out.split(b"\n\n")[-2]
    assert orjson.loads(last[6:])["error"]["type"] == "overloaded_error"
    assert b"[DONE]" not in out and usage is None
    cut, _ = _translate([TOOL_STREAM[:len(TOOL_STREAM) // 2]])
    assert b"[DONE]" not in cut and b"ended before message_stop" in cut.split(b"\n\n")[-2]


def test_events_out_of_order_fail_the_stream():
    out, _ = _translate([ev("content_block_delta", index=0,
                            delta={"type": "text_delta", "text": "x"})])
    assert b"out of order" in out and b"[DONE]" not in out
    malformed, _ = _translate([b"event: message_start\ndata: {not json\n\n"])
    assert b"malformed message_start" in malformed
