"""Command line of the mock upstream: `python -m velox_lab.mock [options]`.

Prints one JSON line `{"event": "ready", "origin": ..., "port": ..., "ca_file": ..., "pid": ...}`
on stdout once listening, then serves until SIGTERM/SIGINT (exit status 0).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .server import ServerConfig, run


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def parse_args(argv: Sequence[str] | None = None) -> ServerConfig:
    p = argparse.ArgumentParser(prog="python -m velox_lab.mock",
                                description="Local OpenAI-compatible mock upstream "
                                            "(HTTP/2 + TLS, HTTP/1.1, h2c).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_non_negative, default=0, help="0 picks a free port")
    tls = p.add_mutually_exclusive_group()
    tls.add_argument("--tls", dest="tls", action="store_true", default=True,
                     help="TLS with ALPN (default)")
    tls.add_argument("--no-tls", dest="tls", action="store_false",
                     help="cleartext HTTP/1.1 and h2c with prior knowledge")
    p.add_argument("--certdir", default=None,
                   help="where ca.pem/server.pem/server.key live (reused if present); "
                        "default: a fresh temporary directory")
    p.add_argument("--alpn", default="h2,http/1.1",
                   help="ALPN protocols offered; 'http/1.1' simulates an upstream without h2")
    p.add_argument("--max-concurrent-streams", type=_positive, default=1000)
    p.add_argument("--latency-ms", type=_non_negative, default=0,
                   help="default delay before response headers")
    p.add_argument("--chunks", type=_positive, default=8,
                   help="default number of events in a streamed response")
    p.add_argument("--chunk-delay-ms", type=_non_negative, default=0)
    p.add_argument("--goaway-after", type=_non_negative, default=0,
                   help="send GOAWAY when a connection opens stream N+1 (0: never)")
    p.add_argument("--latency-per-input-us", type=_non_negative, default=0,
                   help="embeddings: extra delay per input item, on top of --latency-ms")
    p.add_argument("--name", default="mock",
                   help="instance name, reported in /_mock/requests and /_mock/stats")
    p.add_argument("--workers", type=_positive, default=1,
                   help="processes accepting on the same socket; /_mock/stats counters are "
                        "totals over all of them, the /_mock/requests log is per process")
    a = p.parse_args(argv)
    alpn = tuple(x.strip() for x in a.alpn.split(",") if x.strip())
    unknown = set(alpn) - {"h2", "http/1.1"}
    if unknown or not alpn:
        p.error(f"--alpn takes h2 and/or http/1.1, got {a.alpn!r}")
    return ServerConfig(host=a.host, port=a.port, tls=a.tls, certdir=a.certdir, alpn=alpn,
                        max_concurrent_streams=a.max_concurrent_streams,
                        latency_ms=a.latency_ms, chunks=a.chunks,
                        chunk_delay_ms=a.chunk_delay_ms, goaway_after=a.goaway_after,
                        workers=a.workers, name=a.name,
                        latency_per_input_us=a.latency_per_input_us)


def main(argv: Sequence[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
