"""The face of the native HTTP/1.1 request-head parser (native/vx_reqhead.c): `parse` takes a
whole head in one call, a strict subset of HTTP/1.1, and answers FALLBACK for anything else,
which ingress then hands to httptools (its reference twin, and what VELOX_NATIVE=0 uses
alone). Only this module imports the extension for it (the import contract in
pyproject.toml).
"""

from __future__ import annotations

from velox import _native

parse = _native.reqhead
# Header fields a head may carry (ingress answers 431 beyond): the parser's stack array.
MAX_FIELDS = _native.REQHEAD_FIELDS
# An incomplete head longer than this falls back (it bounds rescanning a growing head).
PARTIAL = _native.REQHEAD_PARTIAL
