"""The native usage scan (velox.relay.usage's usage_scan, native/vx_books.c) against its
Python twin (velox.relay.twins.usage_scan).

Bodies are generated around the two forms the scan reads (OpenAI's `"usage":{"prompt_tokens":N,
"completion_tokens":M`, and Anthropic's input_tokens, cache members, output_tokens): JSON
whitespace and other whitespace between their tokens, numbers of 1 to 17 digits, other
orders and names, escaped names in the cache object, truncation at every point, a second
"usage" before or inside another object, and random bytes; both must give the same answer
for bytes, bytearray and memoryview.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.relay.twins import usage_scan as twin
from velox.relay.usage import usage_scan

SPACE = st.text(alphabet=" \t\r\n", max_size=3).map(str.encode)
ODD_SPACE = st.sampled_from([b"", b" ", b"\x0b", b"\x0c", b"\xc2\xa0"])  # not JSON whitespace
NUMBER = st.one_of(st.integers(0, 10**15 + 5).map(lambda n: b"%d" % n),
                   st.sampled_from([b"", b"-1", b"1.0", b"1e3", b'"5"', b"0" * 16, b"9" * 15]))
NAMES = st.sampled_from([(b'"prompt_tokens"', b'"completion_tokens"'),
                         (b'"completion_tokens"', b'"prompt_tokens"'),
                         (b'"input_tokens"', b'"output_tokens"'),
                         (b'"prompt_tokens"', b'"total_tokens"')])


@st.composite
def usage_form(draw: st.DrawFn) -> bytes:
    first, second = draw(NAMES)
    gap = st.one_of(SPACE, ODD_SPACE)
    parts = [b'"usage"', draw(gap), b":", draw(gap), b"{", draw(gap), first, draw(gap), b":",
             draw(gap), draw(NUMBER), draw(gap), b",", draw(gap), second, draw(gap), b":",
             draw(gap), draw(NUMBER), draw(st.sampled_from([b"}", b',"total_tokens":3}', b""]))]
    return b"".join(parts)


@st.composite
def messages_usage_form(draw: st.DrawFn) -> bytes:
    """Anthropic's order: input_tokens, the optional cache members, output_tokens."""
    gap = st.one_of(SPACE, ODD_SPACE)

    def member(name: bytes, value: bytes) -> bytes:
        return b"".join([draw(gap), b",", draw(gap), name, draw(gap), b":", draw(gap), value])

    parts = [b'"usage"', draw(gap), b":", draw(gap), b"{", draw(gap), b'"input_tokens"',
             draw(gap), b":", draw(gap), draw(NUMBER)]
    if draw(st.booleans()):
        parts.append(member(b'"cache_creation_input_tokens"', draw(NUMBER)))
    if draw(st.booleans()):
        parts.append(member(b'"cache_read_input_tokens"', draw(NUMBER)))
    if draw(st.booleans()):
        names = draw(st.lists(st.sampled_from([b'"ephemeral_5m_input_tokens"', b'"x"', b'""',
                                               b'"a\\"b"', b'"a\\\\b"']),
                              max_size=3))
        inner = b",".join(n + draw(gap) + b":" + draw(gap) + draw(NUMBER) for n in names)
        parts.append(member(b'"cache_creation"', b"{" + draw(gap) + inner + draw(gap) + b"}"))
    parts.append(member(draw(st.sampled_from([b'"output_tokens"', b'"output"'])), draw(NUMBER)))
    parts.append(draw(st.sampled_from([b"}", b',"service_tier":"standard"}', b""])))
    return b"".join(parts)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    before = draw(st.sampled_from([b"", b'{"id":"x",', b'{"a":{"usage":{"prompt_tokens":1,'
                                   b'"completion_tokens":2}},', b'{"usage":null,']))
    form = draw(st.one_of(usage_form(), messages_usage_form()))
    body = before + form + draw(st.sampled_from([b"}", b"", b',"usage2":1}', b',"x":"usage"}']))
    cut = draw(st.integers(0, len(body)))
    return body[:cut] if draw(st.booleans()) else body


def agree(body: bytes) -> None:
    expected = twin(body)
    for form in (body, bytearray(body), memoryview(body)):
        assert usage_scan(form) == expected, body


@settings(max_examples=600)
@given(body=bodies())
def test_generated_answers_agree(body: bytes) -> None:
    agree(body)


@settings(max_examples=300)
@given(body=st.binary(max_size=64), form=st.one_of(usage_form(), messages_usage_form()))
def test_random_bytes_around_a_usage_agree(body: bytes, form: bytes) -> None:
    agree(body)
    agree(body + form)
    agree(form + body)


@pytest.mark.parametrize("body", [
    b'{"usage":{"prompt_tokens":12,"completion_tokens":345}}',
    b'{"usage" : {\n "prompt_tokens" :\t999999999999999 ,\r\n "completion_tokens": 0}}',
    b'{"usage":{"prompt_tokens":1000000000000000,"completion_tokens":1}}',  # 16 digits
    b'{"usage":{"completion_tokens":4,"prompt_tokens":31}}',
    b'{"usage":{"input_tokens":5,"cache_creation_input_tokens":2,"cache_read_input_tokens":3,'
    b'"cache_creation":{"ephemeral_5m_input_tokens":2},"output_tokens":7}}',
    b'{"usage":{"input_tokens":5,"cache_creation":{},"output_tokens":7}}',
    b'{"usage":{"input_tokens":5,"cache_creation":{"a\\"b":1},"output_tokens":7}}',
    b'{"usage":{"input_tokens":5,"cache_creation":{"a\\\\b":1},"output_tokens":7}}',
    b'"usage"', b"", b'"usag', b'{"usage":{"prompt_tokens":1,"completion_tokens":2',
])
def test_the_edges_agree(body: bytes) -> None:
    agree(body)
