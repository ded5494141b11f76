"""The native scan of an answer's usage with its parts (usage_parts_scan, native/vx_books.c)
against its Python twin (velox.relay.twins.usage_parts_scan), and both against the meaning:
what velox.spend.wire.usage_parts makes of the parsed usage object.

Bodies are generated around OpenAI's usage object (prompt_tokens, completion_tokens, then
numbers and details objects in any order, repeated, with other members and values of other
kinds), with JSON and other whitespace between tokens, numbers of 1 to 17 digits, truncation
at every point and random bytes around it; native and twin must agree for bytes, bytearray
and memoryview, and whenever the scan reads a valid JSON answer its five numbers must be the
parse's.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox._native import usage_parts_scan
from velox.relay.twins import usage_parts_scan as twin
from velox.spend.wire import usage_parts

SPACE = st.text(alphabet=" \t\r\n", max_size=2).map(str.encode)
# Mostly JSON's whitespace; sometimes a space JSON does not allow.
GAP = st.one_of(SPACE, SPACE, SPACE, st.sampled_from([b"\x0b", b"\xc2\xa0"]))
NUMBER = st.one_of(st.integers(0, 99).map(lambda n: b"%d" % n),
                   st.integers(0, 10**15 + 5).map(lambda n: b"%d" % n),
                   st.sampled_from([b"-1", b"1.5", b"null", b'"5"', b"0" * 16, b"9" * 15]))
INNER_NAMES = st.sampled_from([b'"cached_tokens"', b'"cache_write_tokens"', b'"audio_tokens"',
                               b'"reasoning_tokens"', b'"accepted_prediction_tokens"', b'"x"',
                               b'"a\\"b"'])
OUTER_NAMES = st.sampled_from([b'"total_tokens"', b'"prompt_tokens_details"',
                               b'"completion_tokens_details"', b'"prompt_tokens"',
                               b'"completion_tokens"', b'"other"', b'"x\\u0041"'])


@st.composite
def details(draw: st.DrawFn) -> bytes:
    members = [draw(INNER_NAMES) + draw(GAP) + b":" + draw(GAP) + draw(NUMBER)
               for _ in range(draw(st.integers(0, 4)))]
    deeper = draw(st.sampled_from([b"", b"", b"", b'"d":{}', b'"s":"x"']))
    if deeper:
        members.append(deeper)
    return b"{" + draw(GAP) + (b"," + draw(GAP)).join(members) + draw(GAP) + b"}"


@st.composite
def usage_object(draw: st.DrawFn) -> bytes:
    parts = [b'"usage"', draw(GAP), b":", draw(GAP), b"{", draw(GAP), b'"prompt_tokens"',
             draw(GAP), b":", draw(GAP), draw(NUMBER), draw(GAP), b",", draw(GAP),
             draw(st.sampled_from([b'"completion_tokens"', b'"total_tokens"'])), draw(GAP), b":",
             draw(GAP), draw(NUMBER)]
    for _ in range(draw(st.integers(0, 4))):
        value = draw(st.one_of(NUMBER, details()))
        parts += [draw(GAP), b",", draw(GAP), draw(OUTER_NAMES), draw(GAP), b":", draw(GAP), value]
    parts.append(draw(GAP) + b"}")
    return b"".join(parts)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    before = draw(st.sampled_from([b"{", b'{"id":"x",', b'{"a":{"usage":{"prompt_tokens":1,'
                                   b'"completion_tokens":2}},', b'{"usage":null,']))
    body = before + draw(usage_object()) + draw(st.sampled_from([b"}", b',"x":"usage"}', b""]))
    if draw(st.booleans()):
        body = body[:draw(st.integers(0, len(body)))]
    return body


def agree(body: bytes) -> None:
    expected = twin(body)
    for form in (body, bytearray(body), memoryview(body)):
        assert usage_parts_scan(form) == expected, body


def means(body: bytes) -> None:
    """A valid answer the scan reads: its numbers are the parse's (usage_parts'), a part
    not reported 0."""
    found = usage_parts_scan(body)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return
    if type(found) is not tuple or type(doc) is not dict or type(doc.get("usage")) is not dict:
        return
    parsed = usage_parts(doc["usage"])
    assert parsed is not None, body
    assert found == (parsed.input, parsed.output, parsed.cached_input, parsed.cache_write,
                     parsed.reasoning), body


@settings(max_examples=800)
@given(body=bodies())
def test_generated_answers_agree(body: bytes) -> None:
    agree(body)
    means(body)


@settings(max_examples=300)
@given(noise=st.binary(max_size=48), form=usage_object())
def test_random_bytes_around_a_usage_agree(noise: bytes, form: bytes) -> None:
    agree(noise)
    agree(noise + form)
    agree(form + noise)


@st.composite
def valid_answers(draw: st.DrawFn) -> bytes:
    """OpenAI's answers as its API writes them, with parts reported or not, details repeated
    or missing, other members between: read by the scan, and meaning what the parse says."""
    ints = st.integers(0, 10**6)
    usage: list[tuple[str, object]] = [("prompt_tokens", draw(ints)),
                                       ("completion_tokens", draw(ints))]
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(["total_tokens", "prompt_tokens_details",
                                     "completion_tokens_details", "other"]))
        inner = st.dictionaries(st.sampled_from(["cached_tokens", "cache_write_tokens",
                                                 "audio_tokens", "reasoning_tokens"]), ints)
        usage.append((name, draw(inner) if name.endswith("_details") else draw(ints)))
    text = ",".join(f'"{k}":' + orjson.dumps(v).decode() for k, v in usage)
    return b'{"id":"x","usage":{' + text.encode() + b'},"system_fingerprint":null}'


@settings(max_examples=400)
@given(body=valid_answers())
def test_openai_answers_mean_the_parse(body: bytes) -> None:
    assert type(usage_parts_scan(body)) is tuple
    agree(body)
    means(body)


OPENAI = (b'{"id":"chatcmpl-1","object":"chat.completion","choices":[],"usage":{'
          b'"prompt_tokens":31,"completion_tokens":4,"total_tokens":35,'
          b'"prompt_tokens_details":{"cached_tokens":16,"audio_tokens":0},'
          b'"completion_tokens_details":{"reasoning_tokens":2,"audio_tokens":0,'
          b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},'
          b'"service_tier":"default","system_fingerprint":null}')


@pytest.mark.parametrize(("body", "expected"), [
    (OPENAI, (31, 4, 16, 0, 2)),
    (b'{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}', (3, 4, 0, 0, 0)),
    (b'{"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":'
     b'{"cached_tokens":3,"cache_write_tokens":4},"prompt_tokens_details":'
     b'{"cache_write_tokens":5}}}', (9, 2, 0, 5, 0)),
    (b'{"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens_details":null}}', True),
    (b'{"usage":{"prompt_tokens":1,"completion_tokens":2,"prompt_tokens":3}}', True),
    (b'{"usage":{"input_tokens":1,"output_tokens":2}}', True),
    (b'{"id":"x"}', False),
])
def test_the_edges(body: bytes, expected: tuple[int, ...] | bool) -> None:
    assert usage_parts_scan(body) == expected
    agree(body)
    means(body)
