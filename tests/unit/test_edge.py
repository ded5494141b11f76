"""The edge of egress, socket-free: which upstreams are translated, what a translated attempt
sends, what is refused before anything is sent, and that a translator's failure costs one
OpenAI-shaped 502 (or one error event ending a stream), never a hang."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from velox.config.tables import UpstreamSpec
from velox.core.types import Request
from velox.egress.edge import Edge, Translation, translator_for
from velox.providers.anthropic import AnthropicTranslator
from velox.providers.base import Untranslatable

ANTHROPIC = UpstreamSpec(name="claude", origin="https://api.anthropic.com", kind="anthropic",
                         api_key="sk-ant-test", default_max_tokens=321)


def request(body: dict[str, Any], path: bytes = b"/v1/chat/completions") -> Request:
    req = Request(None, b"POST", path, None, [(b"anthropic-beta", b"b1")],  # type: ignore[arg-type]
                  orjson.dumps(body), True, 0)
    req.model = body.get("model")
    return req


def test_only_other_apis_get_a_translator() -> None:
    edge = Edge((UpstreamSpec(name="oa", origin="https://api.openai.com"),
                 UpstreamSpec(name="az", origin="https://x.openai.azure.com", kind="azure"),
                 ANTHROPIC))
    assert edge.translators[:2] == (None, None)
    assert isinstance(edge.translators[2], AnthropicTranslator)


def test_an_attempt_is_the_kinds_call_with_its_defaults() -> None:
    edge = Edge((ANTHROPIC,))
    t = edge.attempt(0, request({"model": "gpt-4o", "messages": [{"role": "user",
                                                                  "content": "hi"}]}),
                     "claude-x", None)
    sent = orjson.loads(t.call.body)
    assert t.call.path == b"/v1/messages" and sent["model"] == "claude-x"
    assert sent["max_tokens"] == 321  # the upstream's default_max_tokens
    assert (b"x-api-key", b"sk-ant-test") in t.call.headers
    assert (b"anthropic-beta", b"b1") in t.call.headers  # the client's, passed on
    t = edge.attempt(0, request({"model": "gpt-4o", "messages": [{"role": "user",
                                                                  "content": "hi"}]}),
                     "claude-x", None, max_tokens=7)
    assert orjson.loads(t.call.body)["max_tokens"] == 7  # the route's default


@pytest.mark.parametrize("body, path", [
    ({"model": "m", "messages": [], "n": 3}, b"/v1/chat/completions"),
    ({"model": "m", "prompt": "x"}, b"/v1/completions"),
    ({"model": "m", "input": "x"}, b"/v1/embeddings"),  # the Messages API has no embeddings
])
def test_untranslatable_requests_raise_before_a_call(body: dict[str, Any], path: bytes) -> None:
    with pytest.raises(Untranslatable) as caught:
        Edge((ANTHROPIC,)).attempt(0, request(body, path), "claude-x", None)
    assert "anthropic" in str(caught.value)


class Broken(AnthropicTranslator):
    def chat_answer(self, *args: Any) -> Any:
        raise RuntimeError("a bug")


def test_a_translator_failure_is_one_502_or_one_error_event() -> None:
    t = Translation(Broken("k"), request({"model": "gpt-4o", "stream": True, "messages": [
        {"role": "user", "content": "hi"}]}), "claude-x", None)
    answer = t.answer(200, b"{}")
    assert answer.status == 502 and orjson.loads(answer.body)["error"]["type"] == "api_error"
    t.head(200, [])
    assert t.feed(b"event: message_start\ndata: {}\n\n").startswith(b"data: {\"error\"")
    assert t.feed(b"event: message_stop\ndata: {}\n\n") == b"" and t.end() == b""


def test_translator_settings_come_from_the_spec() -> None:
    bedrock = UpstreamSpec(name="b", origin="https://bedrock-runtime.eu-west-1.amazonaws.com",
                           kind="bedrock", aws_region="eu-west-1", aws_access_key_id="AKIA1",
                           aws_secret_access_key="s")
    translator: Any = translator_for(bedrock)
    assert translator.host == "bedrock-runtime.eu-west-1.amazonaws.com"
    assert translator.region == "eu-west-1"
