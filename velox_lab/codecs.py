"""Every HTTP/2 client codec by name, for the tests and benchmarks that compare them.

The gateway itself knows two, chosen by VELOX_NATIVE (velox.egress.pool.EgressOptions): the
native codec and its Python twin, the framer. The lab adds the python-hyper `h2` state machine
and its fork `jh2` behind the same interface (`h2lib`), as the reference and the baseline they
are measured against, and the framer on its pure-Python HPACK decoder.
"""

from __future__ import annotations

import importlib

from velox.egress.codec import Codec
from velox.egress.framer import Framer
from velox.egress.nativecodec import NativeCodec
from velox.egress.pool import CodecFactory

CODEC_NAMES = ("native", "framer", "h2", "jh2")


def make_codec(name: str, authority: bytes, scheme: bytes) -> Codec:
    """The codec called `name` (one of CODEC_NAMES) for one connection."""
    if name == "native":
        return NativeCodec(authority, scheme)
    if name == "framer":
        return Framer(authority, scheme)
    if name in ("h2", "jh2"):
        from velox_lab.h2lib import H2LibCodec

        return H2LibCodec(importlib.import_module(name), authority, scheme)
    raise ValueError(f"unknown HTTP/2 codec {name!r}; one of {', '.join(CODEC_NAMES)}")


def factory(name: str) -> CodecFactory:
    """make_codec as an EgressOptions.codec factory, for pools driven by a benchmark."""
    return lambda authority, scheme: make_codec(name, authority, scheme)
