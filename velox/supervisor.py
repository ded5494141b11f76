"""The supervisor: binds the port, creates the shared state, forks and minds the workers.

Everything that must be ONE for the whole gateway is made here before any worker exists: the
token bucket and the stats region (shared mappings, so every worker enforces one global limit
and writes one set of counters), and the port. Each worker listens on its own SO_REUSEPORT
socket, so the kernel spreads new connections evenly over the workers (with one shared
listening socket, whichever worker wakes first accepts a whole burst and the others idle); the
supervisor keeps a bound, non-listening socket in the same group to hold the port (and to learn
it when VELOX_PORT=0) across worker restarts. Then it forks `VELOX_WORKERS` workers, each
pinned to its own core, restarts any that dies, and on SIGTERM/SIGINT tells them to drain and
waits for them, up to the grace period, before exiting 0.

The supervisor never runs an event loop; it sleeps in select() on a signal wake-up pipe.

The admin server (VELOX_ADMIN_ADDR: /metrics, /stats, /debug/pprof/) runs here too, on its
own threads; each worker gets a control socketpair, made right before its fork.

Imports: worker, ratelimit, stats, topology, config, admin.server (lazily), stdlib.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING

from velox.config import Settings
from velox.ratelimit import Limiter
from velox.stats import F, SharedStats
from velox.topology import pin, plan

if TYPE_CHECKING:
    from velox.admin.server import AdminServer

log = logging.getLogger("velox.supervisor")

_RESTART_BACKOFF_MAX_S = 5.0
# A worker that dies sooner than this after starting is crash-looping: back off.
_HEALTHY_UPTIME_S = 2.0
_KILL_AFTER_GRACE_S = 5.0


def bind(host: str, port: int, listen: bool) -> socket.socket:
    """A SO_REUSEPORT socket on host:port; listening ones share the port's connections."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"velox: cannot listen on {host}:{port} (VELOX_HOST/VELOX_PORT): "
            f"{exc.strerror or exc}"
        ) from None
    if listen:
        sock.listen(4096)
    sock.setblocking(False)
    return sock


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.sock = bind(settings.host, settings.port, listen=False)
        self.port = self.sock.getsockname()[1]
        self.shared = SharedStats(settings.workers)
        self.limiter = Limiter.create(settings.rate_limit_rpm, settings.rate_limit_burst)
        if settings.pin_workers:
            self.placement = plan(settings.workers)
        else:
            self.placement = [(-1, -1)] * settings.workers
        self.children: dict[int, int] = {}  # pid → slot
        self.started_at: dict[int, float] = {}  # slot → time of last start
        self.backoff: dict[int, float] = {}  # slot → next restart delay
        self.respawn_at: dict[int, float] = {}  # slot → when to restart it
        self.stop_signal = 0
        self.stopping = False
        self.kill_deadline = 0.0
        self.admin: AdminServer | None = None
        endpoint = settings.admin_endpoint
        if endpoint is not None:
            from velox.admin.server import AdminServer

            # Bound now, before any fork: a taken address stops start-up with a clear message.
            self.admin = AdminServer(settings, self.shared, self.limiter, endpoint)

    def run(self) -> int:
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self._wake = (rfd, wfd)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select()
        for slot in range(self.settings.workers):
            self._spawn(slot)
        log.info("listening on http://%s:%d with %d worker(s); upstream %s",
                 self.settings.host, self.port, self.settings.workers,
                 self.settings.upstream_origin)
        if self.admin is not None:
            self.admin.start()
        while True:
            select.select([rfd], [], [], 0.2)
            try:
                while os.read(rfd, 512):
                    pass
            except BlockingIOError:
                pass
            self._reap()
            if self.stop_signal and not self.stopping:
                self._begin_stop()
            if self.stopping:
                if not self.children:
                    break
                if time.monotonic() > self.kill_deadline:
                    for pid in list(self.children):
                        log.error("worker pid %d did not stop in time; killing it", pid)
                        _signal(pid, signal.SIGKILL)
            else:
                self._respawn_due()
        if self.admin is not None:
            self.admin.stop()
        log.info("all workers stopped; exiting")
        return 0

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _begin_stop(self) -> None:
        self.stopping = True
        grace = self.settings.shutdown_grace_s
        self.kill_deadline = time.monotonic() + grace + _KILL_AFTER_GRACE_S
        log.info("%s received: draining (grace %ds)",
                 signal.Signals(self.stop_signal).name, grace)
        self.sock.close()
        for pid in list(self.children):
            _signal(pid, signal.SIGTERM)

    def _spawn(self, slot: int) -> None:
        self.started_at[slot] = time.monotonic()
        control = self.admin.hub.pair() if self.admin is not None else None
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.set_wakeup_fd(-1)
                os.close(self._wake[0])
                os.close(self._wake[1])
                self.sock.close()  # the port reservation is the supervisor's
                if self.admin is not None and control is not None:
                    self.admin.close_in_child()
                    control[0].close()
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                    signal.signal(sig, signal.SIG_DFL)
                code = run_worker(self.settings, slot, self.port, self.shared, self.limiter,
                                  self.placement[slot], control[1] if control else None)
            except BaseException:
                traceback.print_exc()
            finally:
                logging.shutdown()
                os._exit(code)
        self.children[pid] = slot
        if self.admin is not None and control is not None:
            control[1].close()
            self.admin.hub.attach(slot, control[0])

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = self.children.pop(pid, None)
            if slot is None:
                continue
            self.shared.counters.set(slot, F.READY, 0)
            if self.stopping:
                continue
            code = os.waitstatus_to_exitcode(status)
            uptime = time.monotonic() - self.started_at.get(slot, 0.0)
            delay = 0.0
            if uptime < _HEALTHY_UPTIME_S:
                delay = min(_RESTART_BACKOFF_MAX_S, max(0.1, self.backoff.get(slot, 0.0) * 2))
            self.backoff[slot] = delay
            how = f"signal {-code}" if code < 0 else f"exit code {code}"
            log.error("worker %d (pid %d) died with %s after %.1fs; restarting in %.1fs",
                      slot, pid, how, uptime, delay)
            self.respawn_at[slot] = time.monotonic() + delay

    def _respawn_due(self) -> None:
        now = time.monotonic()
        for slot, when in list(self.respawn_at.items()):
            if when <= now:
                del self.respawn_at[slot]
                self._spawn(slot)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_worker(settings: Settings, slot: int, port: int, shared: SharedStats,
               limiter: Limiter, placement: tuple[int, int],
               control: socket.socket | None = None) -> int:
    """Body of a worker process: pin, then build the loop and everything else on that core."""
    from velox.worker import Worker

    _die_with_parent()
    core, node = placement
    if core >= 0:
        pin(core)
    counters = shared.counters
    counters.set(slot, F.PID, os.getpid())
    counters.set(slot, F.CORE, core)
    counters.set(slot, F.NUMA_NODE, node)
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    sock = bind(settings.host, port, listen=True)
    worker = Worker(settings, slot, shared, limiter, sock)
    worker.control_sock = control  # the admin's control channel (None: VELOX_ADMIN_ADDR=off)
    try:
        loop.run_until_complete(worker.serve())
    finally:
        loop.close()
    return 0


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM this worker if the supervisor dies, even by SIGKILL.

    Without it an orphaned worker would keep serving on the inherited socket forever.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the supervisor died before prctl took effect
        os._exit(0)


def serve(settings: Settings) -> int:
    supervisor = Supervisor(settings)
    sys.stdout.flush()
    return supervisor.run()
