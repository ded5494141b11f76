"""Reading translated answers back with the openai SDK's own types (the client's view)."""

from __future__ import annotations

import httpx
import openai
import orjson
from openai.types import CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from velox.providers.base import Answer, Translator

_SDK = openai.OpenAI(api_key="sk-test", base_url="http://127.0.0.1:9/v1", max_retries=0)


def completion(answer: Answer) -> ChatCompletion:
    assert answer.status == 200, answer.body
    assert (b"content-type", b"application/json") in answer.headers
    return ChatCompletion.model_validate(orjson.loads(answer.body))


def embeddings(answer: Answer) -> CreateEmbeddingResponse:
    assert answer.status == 200, answer.body
    return CreateEmbeddingResponse.model_validate(orjson.loads(answer.body))


def sdk_error(answer: Answer) -> openai.APIStatusError:
    """The exception the openai SDK raises for this answer (its own status -> class table)."""
    response = httpx.Response(answer.status, headers=[(k.decode(), v.decode())
                                                      for k, v in answer.headers],
                              content=answer.body,
                              request=httpx.Request("POST", "http://127.0.0.1:9/v1/x"))
    body = orjson.loads(answer.body)
    return _SDK._make_status_error(body["error"]["message"], body=body["error"],
                                   response=response)


class Stream:
    """An OpenAI SSE body: the chunks (validated as ChatCompletionChunk), whether it ended
    with [DONE], the error event if any, and the reassembled text and tool calls."""

    def __init__(self, raw: bytes) -> None:
        assert raw.endswith(b"\n\n") or not raw, raw[-200:]
        self.chunks: list[ChatCompletionChunk] = []
        self.done = False
        self.error: dict | None = None
        for event in raw.split(b"\n\n")[:-1]:
            assert event.startswith(b"data: "), event
            data = event[6:]
            assert not self.done, "an event after [DONE]"
            if data == b"[DONE]":
                self.done = True
                continue
            obj = orjson.loads(data)
            if "error" in obj:
                assert self.error is None
                self.error = obj["error"]
                continue
            assert self.error is None, "a chunk after an error event"
            self.chunks.append(ChatCompletionChunk.model_validate(obj))
        self.text = "".join(c.choices[0].delta.content or "" for c in self.chunks
                            if c.choices)
        calls: dict[int, dict] = {}
        for chunk in self.chunks:
            for choice in chunk.choices:
                for call in choice.delta.tool_calls or ():
                    slot = calls.setdefault(call.index, {"id": None, "name": None,
                                                         "arguments": ""})
                    if call.id:
                        assert slot["id"] is None, "id sent twice"
                        slot["id"] = call.id
                    if call.function and call.function.name:
                        slot["name"] = call.function.name
                    if call.function and call.function.arguments:
                        slot["arguments"] += call.function.arguments
        self.calls = [calls[i] for i in sorted(calls)]
        finishes = [c.choices[0].finish_reason for c in self.chunks
                    if c.choices and c.choices[0].finish_reason]
        assert len(finishes) <= 1
        self.finish = finishes[0] if finishes else None
        usage = [c.usage for c in self.chunks if c.usage is not None]
        self.usage = usage[-1] if usage else None
        ids = {c.id for c in self.chunks}
        assert len(ids) <= 1, "one stable id per answer"
        if self.chunks:
            assert self.chunks[0].choices[0].delta.role == "assistant"

    def normalised(self) -> list[dict]:
        """The chunks with the per-answer random parts (id, created, minted call ids) blanked:
        equal for equal upstream bytes however they were split."""
        out = []
        for chunk in self.chunks:
            obj = chunk.model_dump()
            obj["id"] = obj["created"] = None
            for choice in obj["choices"]:
                for call in choice["delta"].get("tool_calls") or ():
                    if (call.get("id") or "").startswith("call_vx"):
                        call["id"] = "call_vx" + call["id"].partition("__sig__")[2]
            out.append(obj)
        return out


def translate_stream(translator: Translator, raw: bytes, pieces: list[int] | None = None,
                     include_usage: bool = True) -> Stream:
    """`raw` fed to a fresh stream of `translator` in pieces of the given sizes (the rest in
    one more feed), then ended: the client's side, parsed."""
    stream = translator.chat_stream("client-name", include_usage)
    out, at = [], 0
    for size in pieces or [len(raw)]:
        out.append(stream.feed(raw[at:at + size]))
        at += size
    out.append(stream.feed(raw[at:]))
    out.append(stream.end())
    return Stream(b"".join(out))
