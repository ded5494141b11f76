"""httpx as an egress, for head-to-head measurement only (VELOX_EGRESS=httpx).

A Task per request and httpx's own pool: the generic way to write a Python proxy, kept so the
benchmarks can show what the project's own pool and codec are worth. It is correct enough to
serve the same traffic (streaming and errors included) but it is never the default.

It implements the same `interfaces.Egress` as `upstream.Upstream` and carries each request's
`Attempt` (it is the attempt's `Carrier`: cancelling cancels the task; httpx does its own flow
control, so there is no credit to return).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from velox.config.settings import Settings
from velox.egress.interfaces import Attempt, Tally
from velox.egress.pool import make_ssl_context
from velox.core.errors import UpstreamProtocolError, UpstreamTimeout, UpstreamUnavailable

if TYPE_CHECKING:
    from velox.egress.interfaces import Client

log = logging.getLogger("velox.egress")


class HttpxPool:
    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop,
                 tally: Tally | None = None) -> None:
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
        self.tasks: dict[Attempt, asyncio.Task[None]] = {}
        self.warm = False
        self.tally = tally if tally is not None else Tally()

    @property
    def ready(self) -> bool:
        return self.warm

    def describe(self) -> dict[str, Any]:
        return {"egress": "httpx", "ready": self.warm, "in_flight": len(self.tasks),
                **self.tally.as_dict()}

    @property
    def open_connections(self) -> int:
        return 0  # httpx does not expose it

    def start(self) -> None:
        self.loop.create_task(self._warm())

    async def _warm(self) -> None:
        while not self.warm:
            try:
                await self.client.get(self.origin + self.settings.upstream_warmup_path)
                self.warm = True
            except self._httpx.HTTPError as exc:
                log.warning("httpx warm-up failed: %s", exc)
                await asyncio.sleep(0.5)

    def submit(self, client: Client, number: int = 0) -> None:
        # The body may live in the arena, which is reused after this batch: copy it now.
        body = bytes(client.body)
        attempt = Attempt(client, number, 0.0)
        attempt.conn = self
        client.attempt = attempt
        self.tasks[attempt] = self.loop.create_task(self._run(attempt, body))

    async def _run(self, attempt: Attempt, body: bytes) -> None:
        httpx = self._httpx
        client = attempt.client
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in client.headers_out]
        attempt.t_sent = time.perf_counter_ns()
        response = None
        try:
            response = await self.client.send(
                self.client.build_request(client.method.decode(),
                                          self.origin + client.path.decode("latin-1"),
                                          headers=headers, content=body or None),
                stream=True,
            )
            raw = [(k.lower(), v) for k, v in response.headers.raw]
            attempt.t_headers = time.perf_counter_ns()
            client.on_response(response.status_code, raw, False)
            async for chunk in response.aiter_raw():
                client.on_data(chunk, False)
            client.on_data(b"", True)
        except httpx.TimeoutException:
            client.on_error(UpstreamTimeout())
        except httpx.RemoteProtocolError as exc:
            client.on_error(UpstreamProtocolError(str(exc)))
        except httpx.HTTPError as exc:
            client.on_error(UpstreamUnavailable(str(exc)))
        finally:
            self.tasks.pop(attempt, None)
            attempt.conn = None
            if response is not None:
                await response.aclose()

    def flush(self) -> None:
        """Each request's task writes it: nothing batched."""

    def cancel(self, attempt: Attempt) -> None:
        task = self.tasks.pop(attempt, None)
        attempt.conn = None
        if task is not None:
            self.tally.cancelled()
            task.cancel()

    def credit(self, attempt: Attempt) -> None:
        """httpx reads the response at its own pace: there is no credit withheld to return."""

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await self.client.aclose()
