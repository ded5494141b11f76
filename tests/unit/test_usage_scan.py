"""The native usage scan against its Python twin (velox.relay.twins), over real answers
(OpenAI's and the Messages API's, as the mocks and the providers write them) and hostile bodies
(every member order, whitespace, nulls, strings, long numbers, cut anywhere); and usage_of gives
the same numbers whichever of its ways reads a Messages answer."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from velox._native import usage_scan
from velox.relay.twins import usage_scan as twin
from velox.relay.usage import usage_of
from velox_lab.mock import anthropic_api, payloads

MESSAGES_USAGE = {"input_tokens": 12, "cache_creation_input_tokens": 100,
                  "cache_read_input_tokens": 1000,
                  "cache_creation": {"ephemeral_5m_input_tokens": 100,
                                     "ephemeral_1h_input_tokens": 0},
                  "output_tokens": 6, "service_tier": "standard"}


def answer(usage: Any, text: str = "Hello") -> bytes:
    return orjson.dumps({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                         "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                         "stop_sequence": None, "usage": usage})


def test_a_messages_answer_is_read_natively_with_its_cache_tokens() -> None:
    assert usage_scan(answer(MESSAGES_USAGE)) == (1112, 6) == twin(answer(MESSAGES_USAGE))
    plain = {"input_tokens": 3, "output_tokens": 4}
    assert usage_scan(answer(plain)) == (3, 4)
    # A "usage" in the text comes before the real key: the last one is read.
    assert usage_scan(answer(plain, 'say "usage":{"input_tokens":9,"output_tokens":9}')) == (3, 4)


def test_the_mocks_anthropic_answer_is_read_natively() -> None:
    req = {"model": "claude-x", "max_tokens": 16,
           "messages": [{"role": "user", "content": "Say hello"}]}
    body = orjson.dumps(anthropic_api._answer(req, orjson.dumps(req), "msg_0123456789", 4)[0])
    found = usage_scan(body)
    usage = orjson.loads(body)["usage"]
    assert found == (usage["input_tokens"] + usage["cache_creation_input_tokens"]
                     + usage["cache_read_input_tokens"], usage["output_tokens"])


def test_usage_of_reads_any_order_alike() -> None:
    """The native scan reads Anthropic's order; the parser reads any other: same numbers."""
    shuffled = dict(reversed(list(MESSAGES_USAGE.items())))
    assert usage_scan(answer(shuffled)) is True  # read by the parser
    assert usage_of(answer(shuffled)) == usage_of(answer(MESSAGES_USAGE)) == (1112, 6)


# --- the differential test -------------------------------------------------------------------

_KEYS = ["prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
         "cache_creation_input_tokens", "cache_read_input_tokens", "cache_creation",
         "service_tier", "total_tokens"]
_numbers = st.one_of(st.integers(0, 10**6), st.integers(10**14, 10**17), st.none(),
                     st.text(max_size=3), st.just(-1), st.floats(allow_nan=False))
_values = st.one_of(_numbers, st.dictionaries(st.text(max_size=4), _numbers, max_size=3))


@st.composite
def usage_objects(draw: st.DrawFn) -> bytes:
    keys = draw(st.lists(st.sampled_from(_KEYS), max_size=7))
    members = []
    for key in keys:
        value = orjson.dumps(draw(_values))
        space = draw(st.sampled_from([b"", b" ", b"\n\t", b"\r\n "]))
        members.append(orjson.dumps(key) + space + b":" + space + value)
    sep = draw(st.sampled_from([b",", b" , ", b",\n"]))
    return b'{"usage"' + draw(st.sampled_from([b":", b" : "])) + b"{" + sep.join(members) + b"}}"


REAL = [answer(MESSAGES_USAGE), answer({"input_tokens": 3, "output_tokens": 4}),
        payloads.chat_completion({"messages": [{"role": "user", "content": "hi"}]},
                                 "gpt-4o", "u", 1, 6)]


@settings(max_examples=600, deadline=None)
@given(body=st.one_of(usage_objects(), st.sampled_from(REAL),
                      st.binary(max_size=80).map(lambda b: b'{"usage":{' + b)),
       cut=st.integers(0, 400))
def test_native_and_twin_agree(body: bytes, cut: int) -> None:
    for piece in (body, body[:cut]):
        assert usage_scan(piece) == twin(piece), piece
