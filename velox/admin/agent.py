"""The worker's side of the admin: its control channel and its access log.

`Agent.start` runs inside `Worker.serve`, on the worker's event loop: it starts the access log
timer (unless VELOX_ACCESS_LOG=0) and hands the worker the deque's `append` for its hot path,
then wraps the worker's end of the control socketpair in a loop transport, so commands are
read between the loop's other callbacks and answers are written without ever blocking it.

Commands (see control.py for the framing):

* `state`: this worker's upstream pool per connection (`Pool.describe()`), in-flight
  requests, ring depth, client connections. Answered at once, from the loop thread, so a
  worker that cannot answer quickly is busy, which the supervisor reports as such.
* `keys {version, full, keys, gone}`: the run-time keys changed (velox.admin.keyfeed); applied
  at once in this callback (velox.admission.runtime); answered with the version applied.
* `segment {segment, count}`: the key table grew (velox.state.keys); its `count` memfd
  descriptors wait on the descriptor socket (control.take_fds) and are mapped as segment
  `segment` unless this worker has it already (it forked after); answered with the number of
  segments it has. Always sent before a `keys` frame that names the segment's keys.
* `profile {seconds}`: start pyinstrument on this (the loop's) thread; after `seconds`
  (`loop.call_later`) stop it and answer with the compacted session.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from velox.admin.accesslog import AccessLog
from velox.admin.control import ControlError, FrameReader, encode, take_fds
from velox.admin.ledgerfeed import LedgerFeed
from velox.spend.ledger import state_file

log = logging.getLogger("velox.admin")


class Agent:
    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.access_log: AccessLog | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.profile: Any = None
        self.profile_timer: asyncio.TimerHandle | None = None
        self.ledger: LedgerFeed | None = None

    async def start(self) -> None:
        worker = self.worker
        spend = worker.spend
        if worker.settings.access_log:
            self.access_log = AccessLog(worker.slot, worker.counters,
                                        key_names=tuple(k.name for k in worker.tables.keys),
                                        priced=spend is not None,
                                        held_max=worker.settings.access_log_buffer_bytes,
                                        native=worker.settings.native)
            self.access_log.start(worker.loop)
            worker.log_access = self.access_log.append
            worker.log_done = self.access_log.done
            worker.add_key_name_reader(self.access_log)
        sock = worker.control_sock
        if sock is not None:
            worker.control_sock = None
            sock.setblocking(False)
            await worker.loop.connect_accepted_socket(lambda: _ControlProtocol(self), sock)
            transport = self.transport
            if spend is not None and transport is not None and \
                    state_file(worker.settings.state_dir) is not None:
                # The ledger's rows go to the supervisor's writer over this channel.
                self.ledger = LedgerFeed(transport.write,  # type: ignore[attr-defined]
                                         transport.get_write_buffer_size)  # type: ignore
                self.ledger.start(worker.loop)
                spend.feed = self.ledger

    def close(self) -> None:
        """After the worker has drained: stop profiling, close the channel, flush the log."""
        if self.profile_timer is not None:
            self.profile_timer.cancel()
        if self.profile is not None:
            self.profile.profiler.stop()
            self.profile = None
        if self.ledger is not None:  # the last rows, before the channel closes
            self.ledger.close()
        if self.transport is not None:
            self.transport.close()
        self.worker.runtime_keys.close()
        self.worker.log_access = self.worker.log_done = None
        if self.access_log is not None:
            self.access_log.close()

    # --- commands -------------------------------------------------------------------------

    def handle(self, message: dict[str, Any]) -> None:
        msg_id = message.get("id")
        cmd = message.get("cmd")
        try:
            if cmd == "keys":
                self.reply(msg_id, self.worker.runtime_keys.apply(message))
            elif cmd == "segment":
                self.reply(msg_id, self.attach_segment(int(message["segment"]),
                                                       int(message["count"])))
            elif cmd == "state":
                self.reply(msg_id, self.state())
            elif cmd == "profile":
                self.start_profile(msg_id, float(message.get("seconds", 10)))
            elif cmd == "ping":
                self.reply(msg_id, os.getpid())
            else:
                raise ControlError(f"unknown command {cmd!r}")
        except Exception as exc:
            self.reply(msg_id, error=str(exc) or type(exc).__name__)

    def attach_segment(self, segment: int, count: int) -> int:
        worker = self.worker
        fds = take_fds(worker.fd_sock, count)
        try:
            table = worker.shared.keys.table
            if segment == len(table.segments):
                table.attach(fds)
            return len(table.segments)
        finally:
            for fd in fds:
                os.close(fd)

    def reply(self, msg_id: Any, result: Any = None, error: str | None = None) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        message = {"id": msg_id, "ok": error is None}
        if error is None:
            message["result"] = result
        else:
            message["error"] = error
        self.transport.write(encode(message))  # type: ignore[attr-defined]

    def state(self) -> dict[str, Any]:
        worker = self.worker
        pool = worker.pool
        describe = getattr(pool, "describe", None)
        arena = worker.arena
        return {
            "pid": os.getpid(),
            "in_flight": worker.in_flight,
            "ring_depth": len(worker.ring),
            "client_connections": len(worker.ingress.connections),
            "arena": None if arena is None else {"live_bodies": arena.live,
                                                 "spills": arena.spills},
            "upstream": describe() if describe is not None else {"egress": type(pool).__name__},
            "upstreams": [u.describe() for u in worker.upstreams[1:]],
            "profiling": self.profile is not None,
            "access_log_queued": len(self.access_log.queue) if self.access_log else None,
            "access_log_held_bytes": self.access_log.held_bytes if self.access_log else None,
            "cache": worker.cache.state() if worker.cache is not None else None,
        }

    def start_profile(self, msg_id: Any, seconds: float) -> None:
        if self.profile is not None:
            raise ControlError("a profile is already running in this worker")
        from velox.admin.profiling import MAX_SECONDS, WorkerProfile

        seconds = min(max(seconds, 0.01), MAX_SECONDS)
        self.profile = WorkerProfile(f"velox worker {self.worker.slot} (pid {os.getpid()})")
        self.profile_timer = self.worker.loop.call_later(seconds, self.finish_profile, msg_id)

    def finish_profile(self, msg_id: Any) -> None:
        profile, self.profile, self.profile_timer = self.profile, None, None
        if profile is None:
            return
        try:
            result = profile.stop()
        except Exception as exc:
            self.reply(msg_id, error=f"profiling failed: {exc}")
            return
        self.reply(msg_id, result)


class _ControlProtocol(asyncio.Protocol):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.reader = FrameReader()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.agent.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            messages = self.reader.feed(data)
        except Exception:
            log.warning("control channel: unreadable frame; closing it")
            self.agent.transport.close()  # type: ignore[union-attr]
            return
        for message in messages:
            self.agent.handle(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.agent.transport = None
