"""httpx as an egress, for head-to-head measurement only (VELOX_EGRESS=httpx).

A Task per request and httpx's own pool: the generic way to write a Python proxy, kept so the
benchmarks can show what the project's own pool and codec are worth. It is correct enough to
serve the same traffic (streaming and errors included) but it is never the default.

Imports: egress.pool (for the TLS context), errors, config, stdlib, httpx (lazily).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from velox.config import Settings
from velox.egress.pool import make_ssl_context
from velox.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable

log = logging.getLogger("velox.egress")


class HttpxPool:
    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop) -> None:
        import httpx

        self._httpx = httpx
        self.loop = loop
        self.settings = settings
        http2 = settings.egress_protocol == "h2"
        verify: Any = True
        if settings.upstream_scheme == "https":
            verify = make_ssl_context(settings, ["h2", "http/1.1"] if http2 else ["http/1.1"])
        self.client = httpx.AsyncClient(
            http2=http2,
            verify=verify,
            timeout=httpx.Timeout(settings.request_timeout_ms / 1000,
                                  connect=settings.connect_timeout_ms / 1000),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
        )
        self.origin = settings.upstream_origin
        self.tasks: dict[Any, asyncio.Task[None]] = {}
        self.ready = False
        self.goaways = self.reconnects = self.retries = self.streams_cancelled = 0

    @property
    def open_connections(self) -> int:
        return 0  # httpx does not expose it

    def start(self) -> None:
        self.loop.create_task(self._warm())

    async def _warm(self) -> None:
        while not self.ready:
            try:
                await self.client.get(self.origin + self.settings.upstream_warmup_path)
                self.ready = True
            except self._httpx.HTTPError as exc:
                log.warning("httpx warm-up failed: %s", exc)
                await asyncio.sleep(0.5)

    def submit(self, exchange: Any) -> None:
        # The body may live in the arena, which is reused after this batch: copy it now.
        body = bytes(exchange.request.body)
        exchange.on_release(exchange.request)
        exchange.link = self
        self.tasks[exchange] = self.loop.create_task(self._run(exchange, body))

    async def _run(self, exchange: Any, body: bytes) -> None:
        httpx = self._httpx
        request = exchange.request
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in exchange.headers_out]
        exchange.t_sent = time.perf_counter_ns()
        response = None
        try:
            response = await self.client.send(
                self.client.build_request(request.method.decode(),
                                          self.origin + exchange.path.decode("latin-1"),
                                          headers=headers, content=body or None),
                stream=True,
            )
            raw = [(k.lower(), v) for k, v in response.headers.raw]
            exchange.on_response(response.status_code, raw, False)
            async for chunk in response.aiter_raw():
                exchange.on_data(chunk, False)
            exchange.on_data(b"", True)
        except httpx.TimeoutException:
            exchange.on_error(UpstreamTimeout())
        except httpx.RemoteProtocolError as exc:
            exchange.on_error(UpstreamProtocolError(str(exc)))
        except httpx.HTTPError as exc:
            exchange.on_error(UpstreamUnavailable(str(exc)))
        finally:
            self.tasks.pop(exchange, None)
            if response is not None:
                await response.aclose()

    def flush(self) -> None:
        pass

    def done(self, exchange: Any) -> None:
        pass

    def cancel(self, exchange: Any) -> None:
        task = self.tasks.pop(exchange, None)
        if task is not None:
            self.streams_cancelled += 1
            task.cancel()

    def acknowledge(self, exchange: Any, n: int) -> None:
        pass

    def pause_for(self, exchange: Any) -> None:
        pass

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await self.client.aclose()
