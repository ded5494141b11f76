"""The two parse paths (orjson on the loop, the native scanner off it) decide alike."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from velox._types import Request, Route
from velox.errors import VeloxError
from velox.parse import parse_model_call, scan_model_call


def on_loop(body: bytes) -> tuple[str, bool] | tuple[str, str]:
    request = Request(None, b"POST", b"/v1/chat/completions", Route.MODEL_CALL, [], body,  # type: ignore[arg-type]
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
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
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
