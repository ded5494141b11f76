"""The Messages front without sockets: canned OpenAI chunk streams (text, reasoning, two parallel
tool calls) through ChatToMessagesStream under any split, reassembled by the Anthropic SDK's own
stream accumulator; answers, errors and request mapping edge cases."""

from __future__ import annotations

import orjson
import pytest
from anthropic._models import construct_type
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.providers import messages
from velox.providers.base import Untranslatable

HEAD = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "gpt"}


def chunk(delta: dict | None = None, finish: str | None = None, **extra: object) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return b"data: " + orjson.dumps({**HEAD, "choices": choices, **extra}) + b"\n\n"


ARGS_A = ['{"ci', 'ty": "Pa', 'ris"}']
STREAM = b"".join([
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "Two cities, "}), chunk({"reasoning_content": "two calls."}),
    chunk({"content": "Checking ☀ "}), chunk({"content": "both."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                           "function": {"name": "w", "arguments": ""}}]}),
    *[chunk({"tool_calls": [{"index": 0, "function": {"arguments": a}}]}) for a in ARGS_A],
    chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                           "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]}),
    chunk({}, "tool_calls"),
    chunk(None, usage={"prompt_tokens": 50, "completion_tokens": 20,
                       "prompt_tokens_details": {"cached_tokens": 30},
                       "completion_tokens_details": {"reasoning_tokens": 5}}),
    b"data: [DONE]\n\n"])


def run(pieces: list[bytes]) -> tuple[bytes, object]:
    stream = messages.ChatToMessagesStream("claude-alias")
    return b"".join(stream.feed(p) for p in pieces) + stream.end(), stream.usage


def assemble(out: bytes) -> Message:
    snapshot, bufs = None, {}
    for block in out.split(b"\n\n")[:-1]:
        name, _, data = block.partition(b"\ndata: ")
        event = orjson.loads(data)
        assert name == b"event: " + event["type"].encode()
        snapshot = accumulate_event(event=construct_type(type_=RawMessageStreamEvent,
                                                         value=event),
                                    current_snapshot=snapshot, json_bufs=bufs)
    return snapshot


WHOLE, USAGE = run([STREAM])


def test_stream_reassembled_by_the_sdk():
    message = assemble(WHOLE)
    thinking, text, first, second = message.content
    assert thinking.thinking == "Two cities, two calls."
    assert text.text == "Checking ☀ both."
    assert (first.id, first.name, first.input) == ("call_a", "w", {"city": "Paris"})
    assert (second.id, second.input) == ("call_b", {"city": "Oslo"})
    assert message.stop_reason == "tool_use" and message.model == "claude-alias"
    assert message.usage.input_tokens == 20 and message.usage.cache_read_input_tokens == 30
    assert message.usage.output_tokens == 20
    assert (USAGE.input, USAGE.cached_input, USAGE.output, USAGE.reasoning) == (50, 30, 20, 5)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_gives_the_same_events(data):
    points = sorted(set(data.draw(st.lists(st.integers(1, len(STREAM) - 1), max_size=40))))
    pieces = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=False)]
    assert run(pieces) == (WHOLE, USAGE)


def test_truncated_error_and_missing_done():
    cut, _ = run([STREAM[:STREAM.index(b"data: ", 600)]])
    assert cut.split(b"\n\n")[-2].startswith(b"event: error\n")
    assert b"message_stop" not in cut
    broken, _ = run([chunk({"content": "x"}),
                     b'data: {"error": {"message": "Overloaded", "type": "overloaded_error"}}'
                     b"\n\n"])
    assert orjson.loads(broken.split(b"\n\n")[-2].partition(b"data: ")[2])["error"] == {
        "type": "overloaded_error", "message": "Overloaded"}
    lenient, usage = run([chunk({"content": "x"}), chunk({}, "length")])
    assert assemble(lenient).stop_reason == "max_tokens" and usage.output == 0


def test_answer_and_bad_tool_arguments():
    answer = messages.chat_to_messages(orjson.dumps({
        "id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "content_filter",
                                         "message": {"role": "assistant", "content": "No."}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 2}}), "claude-x")
    Message.model_validate(orjson.loads(answer.body))
    assert orjson.loads(answer.body)["stop_reason"] == "refusal"
    bad = messages.chat_to_messages(orjson.dumps({"choices": [{"message": {"tool_calls": [
        {"id": "c", "function": {"name": "f", "arguments": "not json"}}]}}]}), "m")
    assert bad.status == 502 and orjson.loads(bad.body)["error"]["type"] == "api_error"


@pytest.mark.parametrize("status, kind, sent", [(400, "invalid_request_error", 400),
                                                (413, "request_too_large", 413),
                                                (503, "overloaded_error", 529),
                                                (502, "api_error", 502),
                                                (504, "timeout_error", 504)])
def test_error_statuses(status, kind, sent):
    answer = messages.error_to_messages(status, b'{"error": {"message": "m"}}',
                                        [(b"retry-after", b"3")])
    assert answer.status == sent and dict(answer.headers)[b"retry-after"] == b"3"
    assert orjson.loads(answer.body) == {"type": "error", "error": {"type": kind,
                                                                     "message": "m"}}


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0]"),
    ({"container": "c1"}, "container"), ({"brand_new": 1}, "brand_new"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format")])
def test_refusals(body, param):
    with pytest.raises(Untranslatable) as caught:
        messages.messages_to_chat({"model": "m", "max_tokens": 5,
                                   "messages": [{"role": "user", "content": "x"}], **body})
    assert caught.value.param == param


def test_request_blocks():
    chat = messages.messages_to_chat({
        "model": "m", "max_tokens": 5, "stream": True, "top_k": 5,
        "system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "B"}],
        "output_config": {"effort": "max"},
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBO"}},
            {"type": "document", "title": "r.pdf",
             "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "t",
                                               "signature": "s"},
                                              {"type": "text", "text": "Hi"}]}]})
    assert chat["messages"] == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
            {"type": "file", "file": {"filename": "r.pdf",
                                      "file_data": "data:application/pdf;base64,JVBE"}}]},
        {"role": "assistant", "content": "Hi"}]
    assert chat["reasoning_effort"] == "xhigh" and chat["top_k"] == 5
    assert chat["stream_options"] == {"include_usage": True}
