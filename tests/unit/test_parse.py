"""The two parse paths (orjson on the loop, the native scanner off it) decide alike; the other
model-bearing endpoints' model is read from JSON or a multipart form, or refused when unclear."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox.admission.parse import parse_model_call, parse_other, scan_model_call
from velox.core.errors import BadRequest, VeloxError
from velox.core.types import Kind, Request
from velox.routing.dispatch import rewrite_model


def on_loop(body: bytes) -> tuple[str, bool] | tuple[str, str]:
    request = Request(None, b"POST", b"/v1/chat/completions", Kind.MODEL_CALL, [], body,  # type: ignore[arg-type]
                      True, 0)
    try:
        parse_model_call(request)
    except VeloxError as exc:
        return "error", exc.code
    assert request.model is not None
    return request.model, request.stream


def off_loop(body: bytes) -> tuple[str, bool] | tuple[str, str]:
    try:
        return scan_model_call(body)
    except VeloxError as exc:
        return "error", exc.code


CASES = [
    b"", b" ", b"{", b"{}", b"[]", b"null", b'"gpt"', b"1e400", b'{"model": "gpt"} x',
    b'{"model": "gpt-4o"}', b'{"model": "", "stream": true}', b'{"model": 4}',
    b'{"model": null}', b'{"model": ["a"]}', b'{"model": "a", "stream": true}',
    b'{"model": "a", "stream": "true"}', b'{"model": "a", "stream": 1}',
    b'{"model": "a", "stream": true, "stream": false}', b'{"model": "a", "model": "b"}',
    b'{"model": "\\u00e9\\ud83d\\ude00"}', b'{"m\\u006fdel": "escaped key"}',
    b'{"nested": {"model": "inner"}}', b'{"model": "a\\ud800"}', b'{"model": "\xff"}',
    b'{"model": "a", "x": [1, 2, {"y": -0.5e-3}], "stream": false}',
    b"[" * 1025 + b"]" * 1025, b'{"model": "a", "n": 01}', b'{"model": "a",}',
    b'\xef\xbb\xbf{"model": "bom"}', b'{"model": "tab\tin string"}',
]


@pytest.mark.parametrize("body", CASES)
def test_both_paths_agree(body: bytes) -> None:
    assert off_loop(body) == on_loop(body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "stream", "messages", "x"]), json_values,
                       max_size=4), st.integers(0, 3))
def test_both_paths_agree_on_generated_bodies(doc: dict, cut: int) -> None:
    body = orjson.dumps(doc)
    assert off_loop(body) == on_loop(body)
    if cut and len(body) > cut:  # truncated documents are refused alike
        assert off_loop(body[:-cut]) == on_loop(body[:-cut])


# --- the other model-bearing endpoints ---------------------------------------------------------

FORM = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"model\"\r\n"
        b"Content-Type: audio/wav\r\n\r\nRIFF name=model \r\n--XyZ\r\n"
        b"Content-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n")
MULTIPART = b"multipart/form-data; boundary=XyZ"


def _other(body: bytes, content_type: bytes | None = b"application/json") -> Request:
    headers = [(b"content-type", content_type)] if content_type else []
    request = Request(None, b"POST", b"/v1/audio/transcriptions",  # type: ignore[arg-type]
                      Kind.MODEL_OTHER, headers, body, True, 0)
    parse_other(request)
    return request


def test_a_forms_model_field_is_read_with_its_span() -> None:
    request = _other(FORM, MULTIPART)
    assert request.model == "whisper-1" and request.model_span is not None
    start, end = request.model_span
    assert FORM[start:end] == b"whisper-1"
    assert rewrite_model(FORM, "large-v3", request.model_span) == FORM.replace(
        b"whisper-1", b"large-v3")
    quoted = _other(FORM.replace(b"boundary", b"b"), b'multipart/form-data; boundary="XyZ"')
    assert quoted.model == "whisper-1"
    # No model field (the endpoint's default): None, the catch-all route decides.
    plain = FORM.replace(b'name="model"', b'name="prompt"')
    assert _other(plain, MULTIPART).model is None


@pytest.mark.parametrize("form", [
    FORM.replace(b'name="file"; filename="model"', b'name="model"'),  # two model fields
    FORM.replace(b'name="model"', b"name*=UTF-8''model"),
    FORM.replace(b'name="model"', b'name="Model"'),
    FORM.replace(b'name="model"', b'name="mod%65l"'),
    FORM.replace(b"--XyZ--\r\n", b""),  # never closed
    FORM.replace(b"whisper-1", b""),
    FORM.replace(b'name="model"\r\n', b'name="model"\n'),  # unread: refused, not guessed
])
def test_a_form_read_two_ways_is_400(form: bytes) -> None:
    with pytest.raises(BadRequest):
        _other(form, MULTIPART)
    with pytest.raises(BadRequest):
        _other(FORM, b"multipart/form-data")  # no boundary


def test_json_endpoints_may_leave_the_model_out() -> None:
    assert _other(b'{"prompt": "a cat"}').model is None
    assert _other(b'{"prompt": "a cat", "model": "dall-e-3"}', None).model == "dall-e-3"
    for bad in (b'{"model": 3}', b'{"model": ""}', b"[1]", b"{"):
        with pytest.raises(BadRequest):
            _other(bad)
