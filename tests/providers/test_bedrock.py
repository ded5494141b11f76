"""The Bedrock translator, socket-free: canned Converse shapes from the API reference, AWS
event-stream frames checked against botocore's decoder, answers read by the openai SDK."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import openai
import orjson
import pytest
from botocore.eventstream import EventStreamBuffer
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.providers.oaparse import Stream, completion, embeddings, sdk_error, translate_stream
from velox.providers import KINDS
from velox.providers.base import Untranslatable
from velox.providers.bedrock import BedrockTranslator, tool_id
from velox_lab.mock import eventstream
from velox_lab.mock.providers import check_sigv4

T = BedrockTranslator("eu-west-1", "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG", "tok")
USER = [{"role": "user", "content": "Hi"}]
MODEL = "anthropic.claude-3-5-sonnet-20240620-v1:0"


def call(body: dict, model: str = MODEL, stream: bool = False):
    c = T.chat({"model": "client-name", **body}, model, stream, [])
    return c, orjson.loads(c.body)


# --- requests ---------------------------------------------------------------------------


def test_path_and_sigv4_headers():
    c, _ = call({"messages": USER})
    assert c.path == b"/model/anthropic.claude-3-5-sonnet-20240620-v1%3A0/converse"
    headers = dict(c.headers)
    assert check_sigv4(c.headers) is None
    auth = headers[b"authorization"].decode()
    assert re.match(r"AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/\d{8}/eu-west-1/"
                    r"bedrock/aws4_request, SignedHeaders=", auth)
    assert "host" in auth and "x-amz-security-token" in auth
    assert headers[b"x-amz-security-token"] == b"tok"
    assert b"wJalr" not in b"".join(v for _, v in c.headers)  # the secret never travels
    s, _ = call({"messages": USER}, stream=True)
    assert s.path.endswith(b"/converse-stream")
    assert dict(s.headers)[b"accept"] == b"application/vnd.amazon.eventstream"


def test_kind_factory_from_settings():
    t = KINDS["bedrock"](aws_region="us-east-1", aws_access_key_id="AKIAEXAMPLEEXAMPLE12",
                         aws_secret_access_key="secret", aws_session_token="tok",
                         base_path="/proxy", api_key="")
    c = t.chat({"messages": USER}, "m", False, [])
    assert c.path == b"/proxy/model/m/converse"
    assert b"Credential=AKIAEXAMPLEEXAMPLE12/" in dict(c.headers)[b"authorization"]
    assert dict(c.headers)[b"x-amz-security-token"] == b"tok"
    with pytest.raises(ValueError, match="secret access key"):
        KINDS["bedrock"](aws_region="us-east-1", aws_access_key_id="AKIA",
                         aws_secret_access_key="")


def test_messages_system_images_and_inference_config():
    _, req = call({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look:"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}}]},
        {"role": "assistant", "content": "A cat."}, {"role": "user", "content": "Thanks"}],
        "max_tokens": 50, "temperature": 0.3, "top_p": 0.8, "stop": ["X", "Y"],
        "user": "u-1", "metadata": {"team": "a"}})
    assert req["system"] == [{"text": "Be brief."}]
    assert req["messages"] == [
        {"role": "user", "content": [
            {"text": "Look:"},
            {"image": {"format": "jpeg", "source": {"bytes": "/9j/4AAQ"}}}]},
        {"role": "assistant", "content": [{"text": "A cat."}]},
        {"role": "user", "content": [{"text": "Thanks"}]}]
    assert req["inferenceConfig"] == {"maxTokens": 50, "temperature": 0.3, "topP": 0.8,
                                      "stopSequences": ["X", "Y"]}
    assert req["requestMetadata"] == {"team": "a", "user": "u-1"}


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.mark.parametrize("choice, expected", [
    (None, None), ("auto", {"auto": {}}), ("required", {"any": {}}),
    ({"type": "function", "function": {"name": "get_weather"}},
     {"tool": {"name": "get_weather"}})])
def test_tool_config(choice, expected):
    body = {"messages": USER, "tools": TOOLS}
    if choice is not None:
        body["tool_choice"] = choice
    _, req = call(body)
    assert req["toolConfig"]["tools"] == [{"toolSpec": {
        "name": "get_weather", "description": "Weather of a city",
        "inputSchema": {"json": TOOLS[0]["function"]["parameters"]}}}]
    assert req["toolConfig"].get("toolChoice") == expected
    _, none = call({"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert "toolConfig" not in none


def test_tool_conversation_round_trips_ids():
    answer = completion(T.chat_answer(200, [], orjson.dumps({
        "output": {"message": {"role": "assistant", "content": [
            {"text": "Let me check."},
            {"toolUse": {"toolUseId": "tooluse_abc", "name": "get_weather",
                         "input": {"city": "Oslo"}}}]}},
        "stopReason": "tool_use",
        "usage": {"inputTokens": 10, "outputTokens": 5, "totalTokens": 15},
        "metrics": {"latencyMs": 100}}), "client-name"))
    message = answer.choices[0].message
    assert answer.choices[0].finish_reason == "tool_calls" and message.content == "Let me check."
    assert message.tool_calls[0].id == "tooluse_abc"
    assert orjson.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    foreign = "g-1__sig__c2lnLzE+Kw=="  # an id from another provider (failover)
    _, req = call({"messages": [
        *USER, message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": "tooluse_abc", "content": "3 degrees"},
        {"role": "assistant", "tool_calls": [{"id": foreign, "type": "function", "function": {
            "name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": foreign, "content": "sunny"}], "tools": TOOLS})
    assert req["messages"][1:] == [
        {"role": "assistant", "content": [
            {"text": "Let me check."},
            {"toolUse": {"toolUseId": "tooluse_abc", "name": "get_weather",
                         "input": {"city": "Oslo"}}}]},
        {"role": "user", "content": [{"toolResult": {"toolUseId": "tooluse_abc",
                                                     "content": [{"text": "3 degrees"}]}}]},
        {"role": "assistant", "content": [{"toolUse": {"toolUseId": tool_id(foreign),
                                                       "name": "get_weather", "input": {}}}]},
        {"role": "user", "content": [{"toolResult": {"toolUseId": tool_id(foreign),
                                                     "content": [{"text": "sunny"}]}}]}]
    assert re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", tool_id(foreign))


def test_response_format_and_reasoning_effort():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    _, req = call({"messages": USER, "reasoning_effort": "medium", "response_format": {
        "type": "json_schema", "json_schema": {"name": "r", "schema": schema}}})
    spec = req["outputConfig"]["textFormat"]
    assert spec["type"] == "json_schema" and spec["structure"]["jsonSchema"]["name"] == "r"
    assert orjson.loads(spec["structure"]["jsonSchema"]["schema"]) == schema
    assert req["outputConfig"]["effort"] == "medium"
    _, req = call({"messages": USER, "response_format": {"type": "json_object"}})
    assert orjson.loads(req["outputConfig"]["textFormat"]["structure"]["jsonSchema"]
                        ["schema"]) == {"type": "object"}


@pytest.mark.parametrize("body, field", [
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/tiff;base64,AAAA"}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": USER, "n": 3}, "n"),
    ({"messages": USER, "seed": 1}, "seed"),
    ({"messages": USER, "logprobs": True}, "logprobs"),
    ({"messages": USER, "reasoning_effort": "minimal"}, "reasoning_effort"),
    ({"messages": USER, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
      "function": {"name": "f", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "a",
      "content": "1"}], "tools": TOOLS, "tool_choice": "none"}, "tool_choice"),
])
def test_untranslatable_refused(body, field):
    with pytest.raises(Untranslatable) as info:
        call(body)
    assert info.value.status == 400 and info.value.param == field
    assert "bedrock" in info.value.message


# --- answers ----------------------------------------------------------------------------


def test_answer_usage_with_cache():
    out = completion(T.chat_answer(200, [], orjson.dumps({
        "output": {"message": {"role": "assistant", "content": [
            {"reasoningContent": {"reasoningText": {"text": "hmm", "signature": "s"}}},
            {"text": "Hello"}]}},
        "stopReason": "end_turn",
        "usage": {"inputTokens": 20, "outputTokens": 7, "totalTokens": 1227,
                  "cacheReadInputTokens": 1000, "cacheWriteInputTokens": 200},
        "metrics": {"latencyMs": 1}}), "alias"))
    assert out.model == "alias" and out.choices[0].message.content == "Hello"
    assert out.usage.prompt_tokens == 1220 and out.usage.completion_tokens == 7
    assert out.usage.total_tokens == 1227
    assert out.usage.prompt_tokens_details.cached_tokens == 1000


@pytest.mark.parametrize("reason, finish", [
    ("end_turn", "stop"), ("stop_sequence", "stop"), ("max_tokens", "length"),
    ("guardrail_intervened", "content_filter"), ("content_filtered", "content_filter"),
    ("model_context_window_exceeded", "length"), ("malformed_model_output", "stop")])
def test_stop_reasons(reason, finish):
    out = completion(T.chat_answer(200, [], orjson.dumps({
        "output": {"message": {"role": "assistant", "content": [{"text": "x"}]}},
        "stopReason": reason, "usage": {"inputTokens": 1, "outputTokens": 1,
                                        "totalTokens": 2}}), "m"))
    assert out.choices[0].finish_reason == finish


@pytest.mark.parametrize("code, ours, cls", [
    ("ThrottlingException", 429, openai.RateLimitError),
    ("ServiceQuotaExceededException", 429, openai.RateLimitError),
    ("ValidationException", 400, openai.BadRequestError),
    ("ModelNotReadyException", 503, openai.InternalServerError),
    ("AccessDeniedException", 403, openai.PermissionDeniedError),
    ("ResourceNotFoundException", 404, openai.NotFoundError),
    ("ServiceUnavailableException", 503, openai.InternalServerError),
    ("InternalServerException", 500, openai.InternalServerError),
    ("ModelTimeoutException", 504, openai.InternalServerError),
    ("ModelErrorException", 502, openai.InternalServerError),
    ("UnrecognizedClientException", 401, openai.AuthenticationError),
])
def test_errors(code, ours, cls):
    status = {"ThrottlingException": 429, "ModelNotReadyException": 429}.get(code, 400)
    headers = [(b"x-amzn-errortype", f"{code}:http://internal.amazon.com/coral/".encode())]
    answer = T.chat_answer(status, headers, orjson.dumps({"message": f"says {code}"}), "m")
    exc = sdk_error(answer)
    assert answer.status == ours and type(exc) is cls
    assert exc.message == f"says {code}" and exc.code == code
    by_body = T.chat_answer(status, [], orjson.dumps({"__type": f"com.amazon#{code}",
                                                      "Message": "m"}), "m")
    assert by_body.status == ours


# --- the event stream ---------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(headers=st.dictionaries(st.text(min_size=1, max_size=20).filter(
           lambda s: len(s.encode()) < 256), st.text(max_size=40), max_size=4),
       payload=st.binary(max_size=300))
def test_frames_decode_with_botocore(headers, payload):
    buffer = EventStreamBuffer()
    buffer.add_data(eventstream.frame(headers, payload))
    [message] = list(buffer)
    assert message.headers == headers and message.payload == payload


def frames(*events) -> bytes:
    return b"".join(eventstream.event(name, body) for name, body in events)


TEXT_FRAMES = frames(
    ("messageStart", {"role": "assistant"}),
    ("contentBlockDelta", {"delta": {"reasoningContent": {"text": "hm"}},
                           "contentBlockIndex": 0}),
    ("contentBlockDelta", {"delta": {"text": "Héllo"}, "contentBlockIndex": 1}),
    ("contentBlockDelta", {"delta": {"text": " wörld 🌍"}, "contentBlockIndex": 1}),
    ("contentBlockStop", {"contentBlockIndex": 1}),
    ("messageStop", {"stopReason": "end_turn"}),
    ("metadata", {"usage": {"inputTokens": 9, "outputTokens": 4, "totalTokens": 13,
                            "cacheReadInputTokens": 3}, "metrics": {"latencyMs": 5}}))
TOOL_FRAMES = frames(
    ("messageStart", {"role": "assistant"}),
    ("contentBlockDelta", {"delta": {"text": "Checking."}, "contentBlockIndex": 0}),
    ("contentBlockStop", {"contentBlockIndex": 0}),
    ("contentBlockStart", {"start": {"toolUse": {"toolUseId": "tooluse_1",
                                                 "name": "get_weather"}},
                           "contentBlockIndex": 1}),
    ("contentBlockDelta", {"delta": {"toolUse": {"input": '{"ci'}}, "contentBlockIndex": 1}),
    ("contentBlockDelta", {"delta": {"toolUse": {"input": 'ty": "Oslo"}'}},
                           "contentBlockIndex": 1}),
    ("contentBlockStop", {"contentBlockIndex": 1}),
    ("contentBlockStart", {"start": {"toolUse": {"toolUseId": "tooluse_2", "name": "time"}},
                           "contentBlockIndex": 2}),
    ("contentBlockDelta", {"delta": {"toolUse": {"input": "{}"}}, "contentBlockIndex": 2}),
    ("contentBlockStop", {"contentBlockIndex": 2}),
    ("messageStop", {"stopReason": "tool_use"}),
    ("metadata", {"usage": {"inputTokens": 9, "outputTokens": 4, "totalTokens": 13},
                  "metrics": {"latencyMs": 5}}))


def run(raw: bytes, pieces: list[int] | None = None, include_usage: bool = True) -> Stream:
    return translate_stream(T, raw, pieces, include_usage)


def test_stream_text_and_usage():
    s = run(TEXT_FRAMES)
    assert s.text == "Héllo wörld 🌍" and s.finish == "stop" and s.done
    assert s.usage.prompt_tokens == 12 and s.usage.prompt_tokens_details.cached_tokens == 3
    assert s.chunks[0].model == "client-name"


def test_stream_first_text_leaves_at_once():
    """A text frame gives its chunk on the feed that completes it, not later."""
    first = frames(("messageStart", {"role": "assistant"}),
                   ("contentBlockDelta", {"delta": {"text": "Hi"}, "contentBlockIndex": 0}))
    stream = T.chat_stream("m", False)
    assert stream.feed(first[:-1]) == b""
    assert Stream(stream.feed(first[-1:])).text == "Hi"


def test_stream_tool_arguments_streamed_as_openai_does():
    s = run(TOOL_FRAMES)
    assert s.finish == "tool_calls" and s.text == "Checking."
    assert s.calls == [{"id": "tooluse_1", "name": "get_weather",
                        "arguments": '{"city": "Oslo"}'},
                       {"id": "tooluse_2", "name": "time", "arguments": "{}"}]
    first = [c for c in s.chunks if c.choices and c.choices[0].delta.tool_calls]
    assert first[0].choices[0].delta.tool_calls[0].function.arguments == ""
    assert first[1].choices[0].delta.tool_calls[0].id is None  # fragments carry index only


def test_stream_exception_frame_and_truncation():
    raw = TEXT_FRAMES.split(eventstream.event("contentBlockStop", {"contentBlockIndex": 1}))[0]
    s = run(raw + eventstream.exception("throttlingException", "Too many tokens"))
    assert s.text == "Héllo wörld 🌍" and not s.done
    assert s.error["code"] == "ThrottlingException" and s.error["message"] == "Too many tokens"
    for cut_at in (len(TEXT_FRAMES) - 7, len(TEXT_FRAMES) // 2):  # in metadata; mid-answer
        cut = run(TEXT_FRAMES[:cut_at])
        assert not cut.done and cut.error["code"] == "upstream_truncated"
    corrupt = bytearray(TEXT_FRAMES)
    corrupt[40] ^= 0xFF
    bad = run(bytes(corrupt))
    assert not bad.done and bad.error["code"] == "upstream_protocol_error"


@settings(max_examples=150, deadline=None)
@given(raw=st.sampled_from([TEXT_FRAMES, TOOL_FRAMES]), data=st.data())
def test_any_split_gives_the_same_chunks(raw, data):
    whole = run(raw)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    split = run(raw, [b - a for a, b in zip([0, *cuts], cuts, strict=False)])
    assert split.normalised() == whole.normalised() and split.done
    assert split.text == whole.text and split.calls == whole.calls


# --- embeddings and the optional extra -----------------------------------------------------


def test_cohere_embeddings():
    c = T.embeddings({"model": "x", "input": ["a", "b"]}, "cohere.embed-english-v3", [])
    assert c.path == b"/model/cohere.embed-english-v3/invoke" and check_sigv4(c.headers) is None
    assert orjson.loads(c.body) == {"texts": ["a", "b"], "input_type": "search_document"}
    answer = T.embeddings_answer(200, [(b"X-Amzn-Bedrock-Input-Token-Count", b"6")],
                                 orjson.dumps({"id": "e", "response_type": "embeddings_floats",
                                               "texts": ["a", "b"],
                                               "embeddings": [[0.5], [0.25]]}), "emb")
    out = embeddings(answer)
    assert [d.embedding for d in out.data] == [[0.5], [0.25]] and out.usage.prompt_tokens == 6
    with pytest.raises(Untranslatable):
        T.embeddings({"model": "x", "input": ["a"] * 97}, "cohere.embed-english-v3", [])


def test_import_without_botocore_names_the_extra():
    code = ("import sys; sys.modules['botocore'] = None\n"
            "try:\n    import velox.providers.bedrock\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=60, check=False)
    assert "pip install 'velox[bedrock]'" in out.stdout, out.stderr
