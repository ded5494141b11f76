"""The admin server's connections: request heads read without a thread each, requests served
on threads, at most `MAX_SERVING` at once.

Why not a thread per connection: a connection's thread would be taken before its client has
said who it is, so a handful of clients that connect and trickle a byte now and then (each
byte restarting a per-recv timeout) would hold every thread there is, and every admin path,
/healthz included, would answer 503 for as long as they like. Here one thread (`_run`) owns
the listening socket and every connection waiting for a head, as non-blocking sockets in a
selector: waiting costs a descriptor and a buffer, never a thread.

* Each head has ONE deadline, `READ_TIMEOUT_S` after the server started waiting for it (the
  accept, or the end of the previous answer on a keep-alive connection): a client trickling
  bytes is closed then, like an idle one.
* At most `MAX_PENDING` connections wait at once; the next one closes the oldest (a real
  client sends its head within milliseconds of connecting, so it is never the oldest).
* A complete head goes to the application's `quick` first, on this thread: /healthz, 401 for a
  missing or wrong token and 405 are answered at once, whatever the load. Only an
  authenticated request takes one of the `MAX_SERVING` serving places and a thread (`slow`);
  with none left it gets 503 and the connection is closed.
* Bodies (the key API's JSON) are read only for requests `quick` passed (authenticated), with
  a Content-Length of at most `MAX_BODY_BYTES`, within the head's deadline. A larger one, or a
  chunked one, is answered 400 at once without being read; so is any body `quick` answers
  itself (401, 405). Such a connection is then DRAINED until the client stops sending (or
  the deadline): closed at once with unread bytes, the kernel would reset it and the client
  could lose the answer. Heads larger than `MAX_HEAD_BYTES` get 431.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

import orjson

log = logging.getLogger("velox.admin")

# Requests served at once. Scrapers, a profile and a person with curl use a handful; the rest
# is refused rather than given a thread each.
MAX_SERVING = 16
# Connections waiting for a head (idle keep-alive ones included). Each costs a descriptor in
# the supervisor; 256 keeps far below its default limit of 1,024.
MAX_PENDING = 256
# A whole request head must arrive within this long (and an idle keep-alive connection is
# closed after it): 10 s outlasts any scrape interval's gap between a client's requests.
READ_TIMEOUT_S = 10.0
# The key API's bodies are a few hundred bytes; 64 KiB leaves room for a long models list.
MAX_BODY_BYTES = 64 * 1024
# A serving thread gives a client that does not read its answer this long per send.
WRITE_TIMEOUT_S = 10.0
# Heads are a request line and a few headers; 16 KiB leaves room for long tokens and cookies.
MAX_HEAD_BYTES = 16 * 1024
# The reader wakes at least this often to close connections past their deadline.
_TICK_S = 1.0


class Answer(NamedTuple):
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    authorization: str | None  # None when absent
    keep_alive: bool
    # Other headers by lower-case name (the last value of each), and the body once read.
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    body: bytes = b""
    body_length: int = 0  # Content-Length; -1: chunked (refused)


class _Conn:
    __slots__ = ("sock", "buf", "deadline", "request", "draining")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.deadline = 0.0
        self.request: Request | None = None  # authenticated, waiting for its body
        self.draining = False  # answered and shut for writing: what arrives is discarded


def parse_head(head: bytes) -> Request | None:
    """The request of a head (without its blank line); None when it is not HTTP/1.x."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[1].startswith(b"/"):
        return None
    fields: dict[str, list[str]] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            return None
        fields.setdefault(name.decode("latin-1").lower(), []).append(
            value.strip().decode("latin-1"))
    auth = fields.get("authorization", [])
    if len(auth) > 1:  # which one would count? none: refused as malformed
        return None
    connection = ",".join(fields.get("connection", [])).lower()
    lengths = set(fields.get("content-length", []))
    if "transfer-encoding" in fields:
        length = -1
    elif len(lengths) > 1 or any(not v.isdigit() for v in lengths):
        return None  # which length would count? none (RFC 9112 6.3)
    else:
        length = int(lengths.pop()) if lengths else 0
    keep_alive = parts[2] == b"HTTP/1.1" and "close" not in connection
    url = urlsplit(parts[1].decode("latin-1"))
    return Request(parts[0].decode("latin-1"), url.path,
                   parse_qs(url.query, keep_blank_values=True), auth[0] if auth else None,
                   keep_alive, {name: values[-1] for name, values in fields.items()},
                   body_length=length)


def encode(answer: Answer, head_only: bool, keep_alive: bool) -> bytes:
    status = answer.status
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Server: velox-admin",
             f"Content-Type: {answer.content_type}", f"Content-Length: {len(answer.body)}",
             "Cache-Control: no-store"]
    lines += [f"{name}: {value}" for name, value in answer.headers]
    if not keep_alive:
        lines.append("Connection: close")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + answer.body


class Server:
    """Serves `quick` and `slow` (see the module docstring) on a bound, listening socket."""

    def __init__(self, sock: socket.socket, quick: Callable[[Request], Answer | None],
                 slow: Callable[[Request], Answer], busy: Callable[[], Answer]) -> None:
        self.sock = sock
        sock.setblocking(False)
        self.quick, self.slow, self.busy = quick, slow, busy
        self.slots = threading.BoundedSemaphore(MAX_SERVING)
        self.refused = 0  # requests answered 503 and connections closed for MAX_PENDING
        self._pending: dict[int, _Conn] = {}  # by descriptor, oldest first
        self._back: queue.SimpleQueue[_Conn] = queue.SimpleQueue()  # served, kept alive
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._stopping = False
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, self._wake_r)
        self.thread = threading.Thread(target=self._run, name="velox-admin", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        if self.thread is not None:
            self.thread.join(5.0)
        for conn in list(self._pending.values()):
            conn.sock.close()
        self._pending.clear()
        self._sel.close()
        for sock in (self.sock, self._wake_r, self._wake_w):
            sock.close()

    def close_in_child(self) -> None:
        """In a forked worker: close the inherited listening socket."""
        self.sock.close()

    # --- the reader thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            for key, _ in self._sel.select(self._timeout()):
                if key.data is None:
                    self._accept()
                elif key.data is self._wake_r:
                    self._take_back()
                else:
                    self._read(key.data)
            self._expire()

    def _timeout(self) -> float:
        if not self._pending:
            return _TICK_S
        first = min(c.deadline for c in self._pending.values())
        return max(0.0, min(_TICK_S, first - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the next select retries
                log.warning("admin: accept failed: %s", exc)
                return
            sock.setblocking(False)
            # The head and the body go out in one write, but a keep-alive client's next
            # request must not wait for a delayed ACK either.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._wait(_Conn(sock))

    def _wait(self, conn: _Conn) -> None:
        """Wait for the connection's next head, READ_TIMEOUT_S at most."""
        self._watch(conn)
        if conn.buf:  # a pipelined request came with the last one
            self._next_head(conn)

    def _watch(self, conn: _Conn) -> None:
        """Read the connection in the selector until READ_TIMEOUT_S from now."""
        if len(self._pending) >= MAX_PENDING:
            self.refused += 1
            self._close(next(iter(self._pending.values())))
        conn.deadline = time.monotonic() + READ_TIMEOUT_S
        self._pending[conn.sock.fileno()] = conn
        self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def _unwatch(self, conn: _Conn) -> None:
        if self._pending.pop(conn.sock.fileno(), None) is not None:
            self._sel.unregister(conn.sock)

    def _close(self, conn: _Conn) -> None:
        self._unwatch(conn)
        conn.sock.close()

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        if conn.draining:
            return
        conn.buf += data
        if conn.request is not None:
            self._body(conn)
        else:
            self._next_head(conn)

    def _next_head(self, conn: _Conn) -> None:
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.buf) > MAX_HEAD_BYTES:
                self._unwatch(conn)
                self._answer_now(conn, error(431, "the request head is too large"), False)
            return
        self._unwatch(conn)
        request = parse_head(bytes(conn.buf[:end]))
        del conn.buf[:end + 4]
        if request is None:
            self._answer_now(conn, error(400, "not an HTTP/1.1 request head"), False)
            return
        if request.body_length < 0 or request.body_length > MAX_BODY_BYTES:
            what = ("a chunked body (send Content-Length)" if request.body_length < 0 else
                    f"a body of {request.body_length:,} bytes (at most {MAX_BODY_BYTES:,})")
            self._refuse_body(conn, error(400, f"the admin server does not take {what}"))
            return
        answer = self.quick(request)
        if answer is not None:
            if request.body_length:
                self._refuse_body(conn, answer)
            else:
                self._answer_now(conn, answer, request.keep_alive, request.method == "HEAD")
        elif request.body_length:
            conn.request = request
            self._watch(conn)
            self._body(conn)
        else:
            self._dispatch(conn, request)

    def _body(self, conn: _Conn) -> None:
        request = conn.request
        assert request is not None
        if len(conn.buf) < request.body_length:
            return
        self._unwatch(conn)
        body = bytes(conn.buf[:request.body_length])
        del conn.buf[:request.body_length]
        conn.request = None
        self._dispatch(conn, dataclasses.replace(request, body=body))

    def _dispatch(self, conn: _Conn, request: Request) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self._answer_now(conn, self.busy(), False)
        else:
            threading.Thread(target=self._serve, args=(conn, request), daemon=True,
                             name="velox-admin-request").start()

    def _refuse_body(self, conn: _Conn, answer: Answer) -> None:
        """Answer without reading the body, then discard what the client still sends until
        it stops or the deadline passes (see the module docstring)."""
        try:
            conn.sock.send(encode(answer, False, False))
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            conn.sock.close()
            return
        conn.buf.clear()
        conn.draining = True
        self._watch(conn)

    def _answer_now(self, conn: _Conn, answer: Answer, keep_alive: bool,
                    head_only: bool = False) -> None:
        """A short answer from the reader thread: one non-blocking send, never a wait."""
        data = encode(answer, head_only, keep_alive)
        try:
            sent = conn.sock.send(data)
        except OSError:
            sent = -1
        if keep_alive and sent == len(data):
            self._wait(conn)
            return
        if sent == len(data):
            _shut_write(conn.sock)
        conn.sock.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._pending.values() if c.deadline <= now]:
            self._close(conn)

    def _take_back(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while not self._back.empty():
            self._wait(self._back.get_nowait())

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # already woken, or closed at stop
            pass

    # --- serving threads --------------------------------------------------------------------

    def _serve(self, conn: _Conn, request: Request) -> None:
        sent = False
        try:
            try:
                answer = self.slow(request)
            except Exception:
                log.exception("admin request %s %s failed", request.method, request.path)
                answer = error(500, "internal error; see the gateway's log")
            conn.sock.settimeout(WRITE_TIMEOUT_S)
            conn.sock.sendall(encode(answer, request.method == "HEAD", request.keep_alive))
            sent = True
        except OSError:
            pass
        finally:
            self.slots.release()
        if sent and request.keep_alive and not self._stopping:
            conn.sock.setblocking(False)
            self._back.put(conn)
            self._wake()
            return
        if sent:
            _shut_write(conn.sock)
        conn.sock.close()


def _shut_write(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def error(status: int, message: str) -> Answer:
    """The admin server's JSON error."""
    return Answer(status, "application/json",
                  orjson.dumps({"error": {"status": status, "message": message}}))
