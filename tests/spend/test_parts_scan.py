"""A non-streamed answer's usage parts (cached input, cache writes, reasoning): the anchored
match that recognises OpenAI's usage object with both parts 0 gives what the search and parse
give, on usage objects as OpenAI writes them and on ones that differ from it by a byte."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.spend.wire import _DETAILS, _parts, usage_parts

_COUNT = st.sampled_from([0, 0, 0, 1, 9, 120])


def _reference(body: bytes) -> tuple[int, int, int]:
    """The parts as the search and parse alone read them (no anchored match)."""
    if _DETAILS.search(body, max(0, body.rfind(b'"usage"'))) is None:
        return (0, 0, 0)
    usage = usage_parts(orjson.loads(body)["usage"])
    return (0, 0, 0) if usage is None else \
        (usage.cached_input, usage.cache_write, usage.reasoning)


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    """An OpenAI chat answer's tail: its usage object in OpenAI's member order (details or
    not, parts 0 or not), sometimes with a member added, renamed or spaced."""
    usage: dict[str, Any] = {"prompt_tokens": draw(_COUNT), "completion_tokens": draw(_COUNT),
                             "total_tokens": draw(_COUNT)}
    if draw(st.booleans()):
        usage["prompt_tokens_details"] = {"cached_tokens": draw(_COUNT),
                                          "audio_tokens": draw(_COUNT)}
        usage["completion_tokens_details"] = {
            "reasoning_tokens": draw(_COUNT), "audio_tokens": draw(_COUNT),
            "accepted_prediction_tokens": draw(_COUNT),
            "rejected_prediction_tokens": draw(_COUNT)}
    if draw(st.booleans()):
        usage[draw(st.sampled_from(("cache_write_tokens", "cache_read_input_tokens",
                                    "thinking_tokens", "extra")))] = draw(_COUNT)
    body = orjson.dumps({"id": "chatcmpl-1", "usage": usage, "service_tier": "default"})
    if draw(st.booleans()):
        body = body.replace(b":", draw(st.sampled_from((b": ", b" :"))),
                            draw(st.integers(1, 12)))
    return body


@settings(max_examples=1500, deadline=None)
@given(answers())
def test_the_anchored_match_gives_the_parts_the_search_gives(body: bytes) -> None:
    found = _parts((body,))
    got = (0, 0, 0) if found is None else (found.cached_input, found.cache_write,
                                           found.reasoning)
    assert got == _reference(body)


def test_openai_usage_with_its_parts_zero_is_matched_and_with_parts_is_read() -> None:
    zero = (b'{"usage":{"prompt_tokens":24,"completion_tokens":6,"total_tokens":30,'
            b'"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},'
            b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
            b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}')
    assert _parts((zero,)) is None
    cached = _parts((zero.replace(b'"cached_tokens":0', b'"cached_tokens":12'),))
    assert cached is not None and cached.cached_input == 12
    reasoning = _parts((zero.replace(b'"reasoning_tokens":0', b'"reasoning_tokens":3'),))
    assert reasoning is not None and reasoning.reasoning == 3
