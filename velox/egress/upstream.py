"""The egress front of one upstream: an `UpstreamSpec` in, `submit(client)` out.

An `Upstream` owns one pool, chosen from the spec: HTTP/2 (`h2pool.H2Pool`) for `h2`, and for
`auto` on an https origin, HTTP/1.1 (`h1pool.H1Pool`) for `http1` and for `auto` on a cleartext
origin. When an `auto` upstream's ALPN picks HTTP/1.1, the front switches to an HTTP/1.1 pool
once, moving the queued attempts over. The worker makes one `Upstream` per upstream it sends to;
today that is `settings.tables.upstreams[0]`.

The front makes the first `UpstreamCall` of every client request and every further one: requests the
upstream provably did not process come back through `retry`, which sends them again on this
upstream's current pool. That is also where sending them to another upstream would go.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import TYPE_CHECKING, Any

from velox.config.tables import UpstreamSpec
from velox.egress.h1pool import H1Pool
from velox.egress.h2pool import H2Pool
from velox.egress.interfaces import MAX_ATTEMPTS, Tally, UpstreamCall
from velox.egress.pool import EgressOptions, ssl_context

if TYPE_CHECKING:
    from velox.egress.interfaces import Client, Pool

log = logging.getLogger("velox.egress")


def first_protocol(spec: UpstreamSpec) -> str:
    """The protocol an upstream starts with: "h2" or "http1" (ALPN may still move h2 to http1)."""
    if spec.protocol == "http1":
        return "http1"
    if spec.protocol == "h2":
        return "h2"
    return "h2" if spec.scheme == "https" else "http1"


class Upstream:
    """One upstream's egress: its pool (HTTP/2 or HTTP/1.1), its attempts, its counters."""

    def __init__(self, spec: UpstreamSpec, options: EgressOptions,
                 loop: asyncio.AbstractEventLoop, tally: Tally | None = None) -> None:
        self.spec = spec
        self.options = options
        self.loop = loop
        self.tally = tally if tally is not None else Tally()
        self.closing = False
        self.request_timeout_s = spec.request_timeout_ms / 1000
        self.tls_contexts: dict[tuple[str, ...], ssl.SSLContext] = {}
        self.pool: Pool = (H2Pool(self, options) if first_protocol(spec) == "h2"
                           else H1Pool(self, options))
        # The worker flushes every upstream after each micro-batch (once per request at one
        # client): the pool's own flush, without this object's frame in between.
        self.flush = self.pool.flush  # type: ignore[method-assign]

    # --- Egress: what the worker uses -------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.pool.ready

    @property
    def open_connections(self) -> int:
        return self.pool.open_connections

    def start(self) -> None:
        self.pool.start()

    def submit(self, client: Client, number: int = 0) -> None:
        attempt = UpstreamCall(client, number, time.monotonic() + self.request_timeout_s)
        client.attempt = attempt
        self.pool.dispatch(attempt)

    def flush(self) -> None:
        self.pool.flush()

    def describe(self) -> dict[str, Any]:
        return {"name": self.spec.name, **self.pool.describe(), **self.tally.as_dict()}

    async def close(self) -> None:
        self.closing = True
        self.pool.close()
        await asyncio.sleep(0)

    # --- Front: what the pools use ---------------------------------------------------------

    def retry(self, attempt: UpstreamCall) -> bool:
        """Send again a request whose attempt the upstream provably did not process."""
        client = attempt.client
        if (self.closing or attempt.number + 1 >= MAX_ATTEMPTS
                or client.attempt is not attempt):
            return False  # given up, or the client already moved on (cancelled, answered)
        again = UpstreamCall(client, attempt.number + 1, attempt.deadline)
        client.attempt = again
        self.tally.retry()
        self.pool.dispatch(again)
        # Called from a connection's events, which no batch's flush follows: write at the end
        # of this pass (retries are rare; the per-request path flushes after its batch).
        self.loop.call_soon(self.pool.flush)
        return True

    def tls(self, alpn: tuple[str, ...]) -> ssl.SSLContext:
        """One context per ALPN list, built once: loading the CA bundle costs milliseconds,
        which an HTTP/1.1 pool opening connections under load would pay on the loop each time."""
        ctx = self.tls_contexts.get(alpn)
        if ctx is None:
            ctx = self.tls_contexts[alpn] = ssl_context(
                (self.spec.ca_file, self.options.ssl_cert_file), list(alpn))
        return ctx

    def on_no_h2(self) -> None:
        if self.spec.protocol == "h2" or self.pool.protocol != "h2" or self.closing:
            return  # h2 required: the connect path reports it as a failure and backs off
        log.warning("%s does not offer HTTP/2; falling back to HTTP/1.1 keep-alive",
                    self.spec.authority)
        old = self.pool
        self.pool = H1Pool(self, self.options)
        self.flush = self.pool.flush  # type: ignore[method-assign]
        waiting = old.take_waiting()
        old.close()
        self.pool.start()
        for attempt in waiting:
            self.pool.dispatch(attempt)
