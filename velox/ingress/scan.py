"""The face of the native JSON request scanner (native/vx_json.c): `scan_json` validates a
request body as one JSON text, accepting exactly what orjson.loads accepts, and finds its
top-level `model` and `stream` in the same pass (bodies of 64 KiB or more with the GIL
released). The parse stage (velox.admission.parse) reads a request through it, and routing
finds the model's bytes again with it to rewrite them. Only this module imports the
extension for it (the import contract in pyproject.toml).
"""

from __future__ import annotations

from velox import _native

scan_json = _native.scan_json

# Kinds of value (the result's model_kind, stream_kind and top_kind).
JSON_ABSENT = _native.JSON_ABSENT
JSON_NULL = _native.JSON_NULL
JSON_FALSE = _native.JSON_FALSE
JSON_TRUE = _native.JSON_TRUE
JSON_NUMBER = _native.JSON_NUMBER
JSON_STRING = _native.JSON_STRING
JSON_ARRAY = _native.JSON_ARRAY
JSON_OBJECT = _native.JSON_OBJECT

# The result's error: JSON_OK or one of these.
JSON_OK = _native.JSON_OK
JSON_E_EMPTY = _native.JSON_E_EMPTY
JSON_E_TRUNCATED = _native.JSON_E_TRUNCATED
JSON_E_SYNTAX = _native.JSON_E_SYNTAX
JSON_E_TRAILING = _native.JSON_E_TRAILING
JSON_E_DEPTH = _native.JSON_E_DEPTH
JSON_E_NUMBER = _native.JSON_E_NUMBER
JSON_E_RANGE = _native.JSON_E_RANGE
JSON_E_CONTROL = _native.JSON_E_CONTROL
JSON_E_ESCAPE = _native.JSON_E_ESCAPE
JSON_E_SURROGATE = _native.JSON_E_SURROGATE
JSON_E_UTF8 = _native.JSON_E_UTF8
JSON_E_TOO_LARGE = _native.JSON_E_TOO_LARGE
JSON_MAX_DEPTH = _native.JSON_MAX_DEPTH
