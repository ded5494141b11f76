"""The control channel between the supervisor and its workers: framing and the supervisor's end.

One `socket.socketpair()` per worker slot, made by the supervisor right before each fork (so a
restarted worker gets a fresh one). Messages are frames of a 4-byte big-endian length and an
orjson document. The supervisor sends `{"id": n, "cmd": ...}`; the worker answers
`{"id": n, "ok": true, "result": ...}` or `{"id": n, "ok": false, "error": "..."}`, possibly
much later (a profile answers after its N seconds), and may answer other commands meanwhile.

`ControlHub` is used from the admin server's threads: `call` sends under a per-channel lock
and waits for the reply with a timeout, while one reader thread per channel routes replies to
their callers. A worker that exits fails its pending calls at once (EOF), and a slot's channel
is replaced when the supervisor restarts the worker, hence the lock around the slot map.

Descriptors (a grown key-table segment's memfds, velox.state.keys) cannot ride the worker's
loop transport, which reads with recv() and would drop them: each slot has a second
socketpair that carries only them. `send(..., fds=...)` puts them there (SCM_RIGHTS) before
the frame that names them on the control socket, so the worker finds them queued when it
reads that frame (`take_fds`).

A worker may also send unasked frames of usage-ledger rows (velox.admin.ledgerfeed), whose
body is not JSON but velox.spend.rowframe's binary (it starts with `rowframe.TAG`, a JSON
body with "{"): the reader hands the body undecoded to `ControlHub.ledger_sink` (the
supervisor's LedgerWriter.submit_frame), or drops it when there is none.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson

from velox.spend.rowframe import TAG as LEDGER_TAG

log = logging.getLogger("velox.admin")
_HEADER = struct.Struct(">I")
# A merged profile is the largest message; this only stops a corrupt length from allocating GBs.
MAX_FRAME = 256 * 1024 * 1024


class ControlError(Exception):
    """The worker could not answer: it is gone, it refused, or the channel broke."""


class ControlTimeout(ControlError):
    """The worker did not answer in time (for `state`: its loop is saturated)."""


def encode(message: Any) -> bytes:
    return frame(orjson.dumps(message))


def frame(body: bytes) -> bytes:
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into decoded frames; feed it whatever recv() returned. A ledger
    frame's body stays bytes (its reader decodes it)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buf = self._buf
        buf += data
        out = []
        while len(buf) >= 4:
            (size,) = _HEADER.unpack_from(buf)
            if size > MAX_FRAME:
                raise ControlError(f"control frame of {size} bytes is too large")
            if len(buf) < 4 + size:
                break
            body = bytes(buf[4:4 + size])
            out.append(body if body[:1] == LEDGER_TAG else orjson.loads(body))
            del buf[:4 + size]
        return out


class _Pending:
    __slots__ = ("event", "reply")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: dict[str, Any] | None = None


class _Channel:
    """The supervisor's end of one worker's socketpair, with its reader thread."""

    def __init__(self, slot: int, sock: socket.socket, hub: ControlHub | None = None,
                 fd_sock: socket.socket | None = None) -> None:
        self.slot = slot
        self.sock = sock
        self.fd_sock = fd_sock  # the descriptors' socketpair end (None: none to pass)
        self.hub = hub
        self.send_lock = threading.Lock()
        self.pending: dict[int, _Pending] = {}
        self.pending_lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._read, name=f"velox-control-{slot}",
                                       daemon=True)

    def _read(self) -> None:
        reader = FrameReader()
        try:
            while True:
                data = self.sock.recv(1 << 20)
                if not data:
                    break
                for message in reader.feed(data):
                    if type(message) is bytes:
                        self._ledger(message)
                        continue
                    with self.pending_lock:
                        waiter = self.pending.pop(message.get("id"), None)
                    if waiter is not None:  # else its caller gave up (timeout): drop it
                        waiter.reply = message
                        waiter.event.set()
        except (OSError, ControlError, orjson.JSONDecodeError):
            pass
        self.fail_pending()

    def _ledger(self, body: bytes) -> None:
        sink = self.hub.ledger_sink if self.hub is not None else None
        if sink is None:
            return
        try:
            sink(body)
        except Exception:
            log.exception("control channel %d: ledger rows dropped", self.slot)

    def fail_pending(self) -> None:
        self.closed = True
        with self.pending_lock:
            waiters, self.pending = list(self.pending.values()), {}
        for waiter in waiters:
            waiter.event.set()  # reply stays None: the worker is gone

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader thread out of recv()
        except OSError:
            pass
        self.sock.close()
        if self.fd_sock is not None:
            self.fd_sock.close()


class ControlHub:
    """Every worker's channel, by slot; safe to use from any thread of the supervisor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[int, _Channel] = {}
        self._ids = itertools.count(1)
        # Where the workers' frames of ledger rows go (LedgerWriter.submit_frame); None:
        # dropped.
        self.ledger_sink: Callable[[bytes], object] | None = None

    @staticmethod
    def pair() -> tuple[socket.socket, socket.socket]:
        """(supervisor end, worker end), made before the fork so the child inherits its end."""
        return socket.socketpair()

    def attach(self, slot: int, sock: socket.socket,
               fd_sock: socket.socket | None = None) -> None:
        """The worker in `slot` now listens on the other end of `sock` (after each fork), and
        takes descriptors from the other end of `fd_sock`."""
        channel = _Channel(slot, sock, self, fd_sock)
        with self._lock:
            old = self._channels.get(slot)
            self._channels[slot] = channel
        if old is not None:
            old.close()
        channel.thread.start()

    def slots(self) -> list[int]:
        with self._lock:
            return sorted(self._channels)

    def send(self, slot: int, cmd: str, fds: list[int] | None = None, **args: Any) -> _Pending:
        """Send a command, with `fds` passed first on the slot's descriptor socket; the
        returned handle is completed by the reader thread."""
        with self._lock:
            channel = self._channels.get(slot)
        if channel is None or channel.closed:
            raise ControlError(f"worker {slot} is not running")
        if fds and channel.fd_sock is None:
            raise ControlError(f"worker {slot} has no descriptor channel")
        msg_id = next(self._ids)
        waiter = _Pending()
        with channel.pending_lock:
            channel.pending[msg_id] = waiter
        try:
            with channel.send_lock:
                if fds:
                    socket.send_fds(channel.fd_sock, [b"\0"], fds)  # type: ignore[arg-type]
                channel.sock.sendall(encode({"id": msg_id, "cmd": cmd, **args}))
        except OSError as exc:
            with channel.pending_lock:
                channel.pending.pop(msg_id, None)
            raise ControlError(f"worker {slot}: control channel broken ({exc})") from None
        return waiter

    @staticmethod
    def wait(waiter: _Pending, timeout: float) -> Any:
        """The result of a sent command, or ControlTimeout / ControlError."""
        if not waiter.event.wait(timeout):
            raise ControlTimeout("no answer in time")
        reply = waiter.reply
        if reply is None:
            raise ControlError("the worker exited before answering")
        if not reply.get("ok"):
            raise ControlError(str(reply.get("error", "the worker refused the command")))
        return reply.get("result")

    def call(self, slot: int, cmd: str, timeout: float, **args: Any) -> Any:
        return self.wait(self.send(slot, cmd, **args), timeout)

    def call_each(self, slots: list[int], cmd: str, timeout: float,
                  **args: Any) -> dict[int, Any]:
        """Send to every slot first, then wait: the workers answer in parallel.

        Each value is the result or the ControlError that stood in for it.
        """
        sent: dict[int, Any] = {}
        for slot in slots:
            try:
                sent[slot] = self.send(slot, cmd, **args)
            except ControlError as exc:
                sent[slot] = exc
        # One deadline for all: a slow worker must not stretch the wait for the others.
        deadline = time.monotonic() + timeout
        out: dict[int, Any] = {}
        for slot, waiter in sent.items():
            if isinstance(waiter, ControlError):
                out[slot] = waiter
                continue
            try:
                out[slot] = self.wait(waiter, max(0.0, deadline - time.monotonic()))
            except ControlError as exc:
                out[slot] = exc
        return out

    def close_in_child(self) -> None:
        """In a freshly forked worker: drop the inherited ends of every channel (no locks:
        the threads that might hold them do not exist in the child)."""
        for channel in list(self._channels.values()):
            channel.sock.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()


def take_fds(sock: socket.socket, count: int) -> list[int]:
    """The worker's side of `send(..., fds=...)`: the `count` descriptors queued before the
    frame that names them (already there: a second's timeout only guards against a broken
    peer)."""
    sock.settimeout(1.0)
    _, fds, _, _ = socket.recv_fds(sock, 1, count)
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise ControlError(f"expected {count} descriptors, got {len(fds)}")
    return fds
