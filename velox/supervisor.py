"""The supervisor: binds the port, creates the shared state, forks and minds the workers.

Everything that must be ONE for the whole gateway is made here before any worker exists: the
token bucket and the stats region (shared mappings, so every worker enforces one global limit
and writes one set of counters), and the port. Each worker accepts on its own SO_REUSEPORT
socket, so the kernel spreads new connections evenly over the workers (with one shared
listening socket, whichever worker wakes first accepts a whole burst and the others idle).
Those sockets, one per logical worker slot, are made here (velox.system.ports: start-up is refused,
naming the port, when anything else already listens on the address, since SO_REUSEPORT would
let it share the connections) and held for the supervisor's whole life: a worker inherits its
slot's socket, and a restarted worker finds the connections queued while its slot was empty.
Then it forks `VELOX_WORKERS` workers, each pinned to its own core (none pinned, with a
warning, when there are more workers than usable cores: see topology.py), restarts any that
dies, and on SIGTERM/SIGINT tells them to drain and waits for them, up to the grace period,
before exiting 0.

SIGHUP reloads the configuration (never fatal; workers ignore it, since a closed terminal
signals the whole process group). The supervisor calls config.load() again: the VELOX_CONFIG
file (and `.env`) are re-read; VELOX_* variables are re-read too, but from the supervisor's own
environment, which is the one it was started with, so in practice only the file (and `.env`)
can change anything. What was fixed before the first fork stays: VELOX_HOST/PORT/WORKERS,
VELOX_PIN_WORKERS, the rate limit (one shared bucket), VELOX_ADMIN_ADDR/TOKEN; a change to one
of them is logged as needing a restart. A configuration that does not load is refused with the
ConfigError's message (variable, or file/table/key) and the running one stays.

A loaded configuration gets its own shared state (`SharedStats.with_tables`: new upstream
health and per-upstream stats, the same worker counters), made before its workers fork, and the
workers are replaced one logical slot at a time. Slots: the stats region has 2 x VELOX_WORKERS
worker slots; logical slot i runs in physical slot i or i + workers, and a reload starts the
new worker of i in the other one, so the old and the new worker never share a gauge. A shared
`active` mask (one flag per physical slot) says which slots serve: readiness, /stats and the
per-worker gauges of /metrics only look at those. For each logical slot in turn: fork the new
worker on the slot's socket, which the old worker keeps accepting on; the new one starts
accepting only when its upstreams are ready (so a configuration that parses but cannot serve
never meets a client, and killing it drops no queued connection); when its READY gauge is set
(it is set only once the worker accepts), mark its slot active and the old one inactive, then
SIGUSR2 the old worker: it drains within VELOX_SHUTDOWN_GRACE_S as on shutdown, except that
requests still arriving on its open connections are served (with Connection: close) rather than
refused with 503, and it waits for its clients to close those connections (it is SIGKILLed
_KILL_AFTER_GRACE_S after that). A new worker that dies, or is not ready within
VELOX_RELOAD_READY_S (30 s by default: the hang watch's start-up allowance, for the same
reason), aborts the reload: it is killed, and the slots already switched are switched back the
same way to the running configuration (so one configuration serves at the end). When every slot
is switched, the admin server moves to the new shared state. A SIGHUP during a reload is
queued: one more reload runs after this one; it starts a slot's new worker only once the worker
that last left that physical slot has exited, so two processes never write one slot's gauges.

A forked worker closes every file descriptor it inherited but stdin/out/err, its slot's
listening socket and its own control socket: otherwise it would hold the admin server's client
connections (and the other workers' channels and sockets) open for its whole life.

Hung workers: each worker's loop writes a heartbeat (F.HEARTBEAT_MS, monotonic ms) every
0.25 s tick. A worker silent for `_SILENT_S` (8 missed ticks) is marked not ready, so /readyz
and /stats stop counting it; one silent for VELOX_WORKER_HANG_S is SIGKILLed and its slot
restarted (logged, counted in F.HANG_KILLS). A stopped process (SIGSTOP) or a loop stuck in
one callback is both: the kernel still queues connections for it, nobody answers them.

The supervisor never runs an event loop; it sleeps in select() on a signal wake-up pipe.

The admin server (VELOX_ADMIN_ADDR: /metrics, /stats, /debug/pprof/) runs here too, on its
own threads; each worker gets a control socketpair, made right before its fork.

With VELOX_REDIS_URL the rate limits are shared with the other hosts: the global Limiter, each
[[key]]'s and each [[upstream]]'s rpm and tpm buckets are LEASED buckets, and the host's Redis
refresher (velox.cluster.leases, one thread with its own asyncio loop) runs here too, started before
the first fork and stopped after the last worker, when it hands the tokens this host still
holds back to Redis.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import select
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from velox.admission.ratelimit import Limiter
from velox.cache.store import create_store
from velox.cache.store import enabled as cache_enabled
from velox.config.settings import Settings, relayed_keys, unprotected
from velox.core.fields import F
from velox.spend.wire import SharedBudgets, SpendHost
from velox.state.stats import SharedStats
from velox.system.fork import fork_child
from velox.system.ports import listeners
from velox.system.topology import oversubscribed, pin, plan

if TYPE_CHECKING:
    from velox.admin.keyfeed import KeyFeed
    from velox.admin.server import AdminServer
    from velox.cluster.leases import Cluster
    from velox.state.keys import SharedKeys

log = logging.getLogger("velox.supervisor")

_RESTART_BACKOFF_MAX_S = 5.0
# A worker that dies sooner than this after starting is crash-looping: back off.
_HEALTHY_UPTIME_S = 2.0
_KILL_AFTER_GRACE_S = 5.0
# Heartbeat silence after which a worker counts as not ready: 8 missed 0.25 s ticks.
_SILENT_S = 2.0
# A new worker's first heartbeat comes after its imports, its loop and its pool are built;
# on a loaded 2-core box that has taken a few seconds, so silence before the first beat is
# only counted after this long.
_STARTUP_ALLOWANCE_S = 30.0
# Settings made part of the shared state or the sockets before the first fork: a reload keeps
# the running values.
_FIXED_AT_START = ("host", "port", "workers", "pin_workers", "rate_limit_rpm",
                   "rate_limit_burst", "admin_addr", "admin_token", "cache_max_bytes",
                   "redis_url")


class _Reload:
    """One reload in progress: the target configuration and where the replacement stands."""

    __slots__ = ("settings", "shared", "todo", "done", "logical", "new_slot", "new_pid",
                 "deadline", "failed", "rollback")

    def __init__(self, settings: Settings, shared: SharedStats, todo: list[int],
                 rollback: bool = False) -> None:
        self.settings = settings
        self.shared = shared
        self.todo = todo  # logical slots still to replace, in order
        self.done: list[int] = []  # logical slots now served by the new configuration
        self.logical = -1  # the logical slot being replaced, -1 between two
        self.new_slot = -1
        self.new_pid = 0
        self.deadline = 0.0
        self.failed = ""  # why the new worker was lost (set by _reap)
        self.rollback = rollback


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # One listening socket per logical worker slot, held here for the supervisor's life
        # (velox.system.ports): refused at once, naming the port, if anything else listens there.
        self.listeners = listeners(settings.host, settings.port, settings.workers)
        self.port = self.listeners[0].getsockname()[1]
        self.shared = SharedStats(settings.workers, settings.tables)
        self.limiter = Limiter.create(settings.rate_limit_rpm, settings.rate_limit_burst,
                                      shared=bool(settings.redis_url))
        # The response cache's one store (velox.cache.front), shared by every worker like the
        # bucket.
        self.shared.cache = create_store(settings)
        # VELOX_REDIS_URL: the host's lease refresher; every limit is shared with the other hosts
        # (velox.cluster.leases). Started before the first fork, stopped after the last worker.
        self.cluster: Cluster | None = None
        if settings.redis_url:
            from velox.cluster.leases import Cluster

            self.cluster = Cluster(settings.redis_url)
            if self.limiter.limits is not None:
                self.cluster.add("gateway", self.limiter.limits, self.limiter.index,
                                 settings.rate_limit_rpm, settings.rate_limit_burst)
            self._share_keys(self.shared)
            self._share_upstreams(self.shared)
        cores = oversubscribed(settings.workers)
        if cores:
            log.warning("VELOX_WORKERS=%d is more than the %d usable core(s): the workers will "
                        "share cores and none is pinned; set VELOX_WORKERS=%d (or leave it "
                        "empty) for one worker per core", settings.workers, cores, cores)
        if settings.pin_workers:
            self.placement = plan(settings.workers)
        else:
            self.placement = [(-1, -1)] * settings.workers
        self.children: dict[int, int] = {}  # pid → physical slot
        self.shared_of: dict[int, SharedStats] = {}  # pid → the shared state it runs with
        # The configuration and shared state each physical slot's worker runs with.
        self.generation: dict[int, tuple[Settings, SharedStats]] = dict.fromkeys(
            range(settings.workers), (settings, self.shared))
        self.slot_of = list(range(settings.workers))  # logical slot → its physical slot now
        self.retiring: dict[int, float] = {}  # pid of a replaced worker → when to SIGKILL it
        self.reload: _Reload | None = None
        self.reload_queued = False
        self.started_at: dict[int, float] = {}  # slot → time of last start
        self.backoff: dict[int, float] = {}  # slot → next restart delay
        self.respawn_at: dict[int, float] = {}  # slot → when to restart it
        self.stop_signal = 0
        self.reload_requested = False
        self.silent: set[int] = set()  # slots whose worker is marked not ready for silence
        self.hang_killed: set[int] = set()  # pids SIGKILLed for a silent loop, not yet reaped
        self.stopping = False
        self.kill_deadline = 0.0
        self.admin: AdminServer | None = None
        self.key_feed: KeyFeed | None = None
        endpoint = settings.admin_endpoint
        if endpoint is not None:
            from velox.admin.server import AdminServer

            # Bound now, before any fork: a taken address stops start-up with a clear message.
            self.admin = AdminServer(settings, self.shared, self.limiter, endpoint)
            if self.cluster is not None:
                self.admin.use_cluster(self.cluster)
            # Run-time keys: claimed in the key table before the first fork, then fed to the
            # workers as they change (velox.admin.keyfeed).
            from velox.admin.keyfeed import KeyFeed

            self.key_feed = KeyFeed(self.admin.keys, self.admin.hub, self._key_tables,
                                    self.cluster, self._typical_reservation())
            self.key_feed.adopt(self.shared.keys)
        # Spend (velox.spend.wire): the ledger's writer, fed by the workers over the admin's
        # control channels, and the budgets' shared memory, resumed from the ledger.
        self.spend = SpendHost(settings, self.shared.slots, self.admin is not None, self.cluster)
        if self.admin is not None and self.spend.writer is not None:
            self.admin.hub.ledger_sink = self.spend.writer.submit_frame
        self.spend.budgets_for(self.shared.tables)  # made before the first fork

    def _share_keys(self, shared: SharedStats) -> None:
        """VELOX_REDIS_URL: each [[key]]'s rpm and tpm bucket is shared with the other hosts,
        in Redis as `key:<name>:rpm|tpm` (so hosts must give a key the same name)."""
        cluster = self.cluster
        if cluster is None:
            return
        keys = shared.keys
        cluster.remove("key:")
        for i, spec in enumerate(keys.keys):
            # The buckets' burst is one minute's worth, as on one host (velox.admission.keys).
            limits, rpm_i, tpm_i = keys.entry(i)
            if spec.rpm:
                cluster.add(f"key:{spec.name}:rpm", limits, rpm_i, spec.rpm, spec.rpm)
            if spec.tpm:
                cluster.add(f"key:{spec.name}:tpm", limits, tpm_i, spec.tpm, spec.tpm,
                            self._typical_reservation())

    def _key_tables(self) -> tuple[SharedKeys, dict[int, SharedKeys]]:
        """For the key feed's thread: the current key table, and each worker slot's."""
        generation = dict(self.generation)
        by_slot = {slot: shared.keys for slot, (_, shared) in generation.items()}
        # A reload's replaced workers drain (SIGUSR2) while serving their open keep-alive
        # connections: they are sent the changes too, so a key revoked meanwhile is refused
        # there as well. (list() copies under the GIL: the supervisor's thread changes these.)
        for pid in list(self.retiring):
            slot, shared = self.children.get(pid), self.shared_of.get(pid)
            if slot is not None and shared is not None:
                by_slot.setdefault(slot, shared.keys)
        return self.shared.keys, by_slot

    def _typical_reservation(self) -> int:
        """What a tpm bucket keeps in hand from its first lease (velox.cluster.leases): an SDK
        request without max_tokens reserves its prompt plus VELOX_TOKENS_DEFAULT_OUTPUT; the
        1,024 covers a prompt of about 4 KB."""
        return self.settings.tokens_default_output + 1024

    def _share_upstreams(self, shared: SharedStats) -> None:
        """VELOX_REDIS_URL: each [[upstream]]'s rpm and tpm bucket is shared with the other
        hosts, in Redis as `upstream:<name>:rpm|tpm` (so hosts must give an upstream the same
        name). The buckets are the new configuration's (velox.state.health: a reload makes them
        afresh); the old workers of a reload keep what their buckets hold until they drain."""
        cluster = self.cluster
        if cluster is None:
            return
        from velox.state.health import rpm_burst

        health = shared.health
        cluster.remove("upstream:")
        for u, spec in enumerate(shared.tables.upstreams):
            # The same bursts as on one host (velox.state.health): 10 s of rpm, a minute of tpm.
            if spec.rpm:
                cluster.add(f"upstream:{spec.name}:rpm", health.rpm, u, spec.rpm,
                            rpm_burst(spec.rpm))
            if spec.tpm and health.tpm is not None:
                cluster.add(f"upstream:{spec.name}:tpm", health.tpm.limits, u, spec.tpm,
                            spec.tpm, self._typical_reservation())

    def run(self) -> int:
        rfd, wfd = os.pipe()
        os.set_blocking(rfd, False)
        os.set_blocking(wfd, False)
        self._wake = (rfd, wfd)
        signal.set_wakeup_fd(wfd)
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake select()
        if self.cluster is not None:  # the first leases (or the fallback) before any fork
            self.cluster.start()
        if self.spend.writer is not None:
            self.spend.writer.start()
        for slot in range(self.settings.workers):
            self._spawn(slot)
        tables = self.shared.tables
        log.info("listening on http://%s:%d with %d worker(s); upstream%s %s",
                 self.settings.host, self.port, self.settings.workers,
                 "s" if len(tables.upstreams) > 1 else "",
                 ", ".join(f"{u.name}={u.origin}" if tables.source else u.origin
                           for u in tables.upstreams))
        self._say_if_unprotected()
        if self.admin is not None:
            self.admin.start()
        if self.key_feed is not None:
            self.key_feed.start()
        while True:
            select.select([rfd], [], [], 0.2)
            try:
                while os.read(rfd, 512):
                    pass
            except BlockingIOError:
                pass
            self._reap()
            if self.reload_requested and not self.stopping:
                self.reload_requested = False
                self._reload()
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
                self._watch_heartbeats()
                self.spend.tick()  # a budget period that ended starts anew
                self._respawn_due()
                self._reload_step()
                self._kill_overdue_retirees()
        if self.key_feed is not None:
            self.key_feed.stop()
        if self.admin is not None:
            self.admin.stop()
        if self.cluster is not None:  # the workers are gone: hand back what this host holds
            self.cluster.stop()
        if self.spend.writer is not None:  # the workers' last rows are in: write them
            self.spend.writer.close()
        log.info("all workers stopped; exiting")
        return 0

    def _say_if_unprotected(self) -> None:
        """Serving beyond loopback without client keys is said at start-up (an open relay of
        the upstream keys only starts with VELOX_ALLOW_OPEN=1: config refuses it otherwise)."""
        exposed = unprotected(self.settings)
        if exposed is None:
            return
        relayed = relayed_keys(self.settings)
        if relayed:
            log.warning("VELOX_ALLOW_OPEN=1: %s: anyone who can reach %s:%d is served with %s",
                        exposed, self.settings.host, self.port, relayed)
        else:
            log.warning("%s: anyone who can reach %s:%d may use it (with the credentials they "
                        "send upstream)", exposed, self.settings.host, self.port)

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self.stop_signal = signum

    def _on_hup(self, signum: int, frame: object) -> None:
        self.reload_requested = True

    def _reload(self) -> None:
        """SIGHUP: load the configuration again and start replacing the workers with it."""
        if self.reload is not None:
            if not self.reload_queued:
                log.warning("SIGHUP during a reload: queued; the configuration is read again "
                            "when this reload ends")
            self.reload_queued = True
            return
        from velox.config.settings import ConfigError, load

        try:
            settings = load()
        except ConfigError as exc:
            log.error("SIGHUP: configuration refused, the running one stays: %s", exc)
            return
        for warning in settings.warnings:  # .env may have changed
            log.warning("SIGHUP: %s", warning)
        kept = [name for name in _FIXED_AT_START
                if getattr(settings, name) != getattr(self.settings, name)]
        if kept:
            log.warning("SIGHUP: %s changed but only take effect on a restart; keeping the "
                        "running value(s)", ", ".join(kept))
            settings = dataclasses.replace(
                settings, **{name: getattr(self.settings, name) for name in kept})
        if self.shared.cache is None and cache_enabled(settings):
            log.warning("SIGHUP: the response cache was off at start; turning it on (VELOX_CACHE "
                        "or cache = true) takes effect on a restart")
        try:
            shared = self.shared.with_tables(settings.tables)  # type: ignore[arg-type]
        except (ValueError, OSError) as exc:  # TableError names the file, table and key
            log.error("SIGHUP: configuration refused, the running one stays: %s", exc)
            return
        self._share_keys(shared)  # the reloaded keys' buckets, leased again (VELOX_REDIS_URL)
        if self.key_feed is not None:  # and the run-time keys', in the new table
            self.key_feed.adopt(shared.keys)
        self._share_upstreams(shared)  # and the reloaded upstreams' rpm and tpm buckets
        tables = settings.tables
        assert tables is not None
        log.info("SIGHUP: reloading the configuration%s (%d upstream(s), %d route(s)); "
                 "replacing %d worker(s) one by one",
                 f" from {tables.source}" if tables.source else "", len(tables.upstreams),
                 len(tables.routes), self.settings.workers)
        self.reload = _Reload(settings, shared, list(range(self.settings.workers)))

    def _reload_step(self) -> None:
        """Advance the reload in progress by what has happened since the last loop turn."""
        r = self.reload
        if r is None:
            return
        counters = self.shared.counters
        if r.logical >= 0:  # a new worker is starting
            if r.failed or time.monotonic() > r.deadline:
                self._abort_reload(r)
                return
            if not counters.get(r.new_slot, F.READY):
                return
            old_slot = self.slot_of[r.logical]
            active = self.shared.active
            active.set(0, r.new_slot, 1)
            active.set(0, old_slot, 0)
            self.slot_of[r.logical] = r.new_slot
            for pid, slot in list(self.children.items()):
                if slot == old_slot:
                    self._retire(pid)
            self.respawn_at.pop(old_slot, None)
            self.generation.pop(old_slot, None)
            log.info("reload: worker %d (pid %d) is ready; the old one of that slot drains",
                     r.new_slot, r.new_pid)
            r.done.append(r.logical)
            r.logical = -1
        if r.todo:
            new_slot = self._other_slot(self.slot_of[r.todo[0]])
            if new_slot in self.children.values():
                return  # the worker an earlier reload replaced there is still draining
            r.logical = r.todo.pop(0)
            r.new_slot = new_slot
            r.failed = ""
            r.deadline = time.monotonic() + self.settings.reload_ready_s
            self.generation[r.new_slot] = (r.settings, r.shared)
            self.respawn_at.pop(r.new_slot, None)
            self.backoff.pop(r.new_slot, None)
            r.new_pid = self._spawn(r.new_slot, defer=True)
            return
        self.reload = None
        self.settings, self.shared = r.settings, r.shared
        if self.admin is not None:
            self.admin.use(r.shared)
        if r.rollback:
            log.warning("reload aborted: every worker runs the previous configuration again")
        else:
            log.info("reload done: %d worker(s) run the new configuration",
                     len(r.done))
        if self.reload_queued:
            self.reload_queued = False
            self._reload()

    def _abort_reload(self, r: _Reload) -> None:
        why = r.failed or (f"was not ready within {self.settings.reload_ready_s}s "
                           f"(VELOX_RELOAD_READY_S)")
        log.error("reload aborted: the new worker %d (pid %d) %s; keeping the running "
                  "configuration", r.new_slot, r.new_pid, why)
        if r.new_pid in self.children:
            self.retiring[r.new_pid] = 0.0  # killed now, reaped without a restart
            _signal(r.new_pid, signal.SIGKILL)
        self.generation.pop(r.new_slot, None)
        self.respawn_at.pop(r.new_slot, None)
        self.shared.counters.set(r.new_slot, F.READY, 0)
        self.reload = None
        self._share_keys(self.shared)  # the running configuration's keys again
        self._share_upstreams(self.shared)  # and its upstreams' buckets
        if r.rollback:
            log.error("reload: switching back failed too; the workers of slot(s) %s keep the "
                      "new configuration", ", ".join(map(str, r.done)))
            return
        if r.done:  # switch the replaced slots back to the running configuration
            old_settings, old_shared = self.settings, self.shared
            self.reload = _Reload(old_settings, old_shared, list(r.done), rollback=True)

    def _other_slot(self, slot: int) -> int:
        workers = self.settings.workers
        return slot + workers if slot < workers else slot - workers

    def _retire(self, pid: int) -> None:
        """SIGUSR2 a replaced worker: it drains (Worker._hand_off); reaped without a restart."""
        self.retiring[pid] = (time.monotonic() + self.settings.shutdown_grace_s
                              + _KILL_AFTER_GRACE_S)
        _signal(pid, signal.SIGUSR2)

    def _kill_overdue_retirees(self) -> None:
        now = time.monotonic()
        for pid, when in list(self.retiring.items()):
            if when and now > when and pid in self.children:
                log.error("replaced worker pid %d did not stop in time; killing it", pid)
                self.retiring[pid] = 0.0
                _signal(pid, signal.SIGKILL)

    def _watch_heartbeats(self) -> None:
        counters = self.shared.counters
        now = time.monotonic()
        hang_s = self.settings.worker_hang_s
        silent_s = min(_SILENT_S, hang_s) if hang_s else _SILENT_S
        for pid, slot in list(self.children.items()):
            if pid in self.hang_killed or pid in self.retiring:
                continue
            beat = counters.get(slot, F.HEARTBEAT_MS)
            if beat:
                silent = now - beat / 1000
            else:  # not started yet: count from the end of the start-up allowance
                silent = now - self.started_at[slot] - _STARTUP_ALLOWANCE_S
            if silent < silent_s:
                if slot in self.silent:
                    self.silent.discard(slot)
                    log.info("worker %d (pid %d) is beating again", slot, pid)
                continue
            counters.set(slot, F.READY, 0)
            if slot not in self.silent:
                self.silent.add(slot)
                log.warning("worker %d (pid %d): event loop silent for %.1fs; marked not ready",
                            slot, pid, silent)
            if hang_s and silent >= hang_s:
                log.error("worker %d (pid %d): event loop silent for %.1fs "
                          "(VELOX_WORKER_HANG_S=%d); killing it and starting another",
                          slot, pid, silent, hang_s)
                counters.add(slot, F.HANG_KILLS, 1)
                self.hang_killed.add(pid)
                _signal(pid, signal.SIGKILL)

    def _begin_stop(self) -> None:
        self.stopping = True
        grace = self.settings.shutdown_grace_s
        self.kill_deadline = time.monotonic() + grace + _KILL_AFTER_GRACE_S
        log.info("%s received: draining (grace %ds)",
                 signal.Signals(self.stop_signal).name, grace)
        for sock in self.listeners:
            sock.close()
        for pid in list(self.children):
            _signal(pid, signal.SIGTERM)

    def _spawn(self, slot: int, defer: bool = False) -> int:
        """Fork the worker of physical `slot`, on its logical slot's listening socket. With
        `defer` (a reload's new worker, whose predecessor still accepts on that socket) it
        accepts only once its upstreams are ready."""
        settings, shared = self.generation[slot]
        sock = self.listeners[slot % self.settings.workers]
        self.started_at[slot] = time.monotonic()
        self.shared.counters.set(slot, F.HEARTBEAT_MS, 0)  # the last worker's beats are not ours
        self.silent.discard(slot)
        control = self.admin.hub.pair() if self.admin is not None else None
        fdpass = self.admin.hub.pair() if self.admin is not None else None  # key segments

        def prepare() -> None:  # in the child: keep only what the worker needs
            signal.set_wakeup_fd(-1)
            os.close(self._wake[0])
            os.close(self._wake[1])
            if self.admin is not None and control is not None and fdpass is not None:
                self.admin.close_in_child()
                control[0].close()
                fdpass[0].close()
            for other in self.listeners:  # the other slots' sockets are not this one's
                if other is not sock:
                    other.close()
            keep = {0, 1, 2, sock.fileno()}
            close_inherited_fds(keep | ({control[1].fileno(), fdpass[1].fileno()}
                                        if control and fdpass else set()))

        def body() -> int:
            keys = self.key_feed.initial(shared.keys) if self.key_feed else None
            return run_worker(settings, slot, sock, shared, self.limiter,
                              self.placement[slot % len(self.placement)],
                              control[1] if control else None, defer, keys,
                              self.spend.budgets_for(shared.tables),
                              fdpass[1] if fdpass else None)

        segments = shared.keys.segments  # what the worker has at least (velox.admin.keyfeed)
        pid = fork_child(prepare, body)
        self.children[pid] = slot
        self.shared_of[pid] = shared
        if self.admin is not None and control is not None and fdpass is not None:
            control[1].close()
            fdpass[1].close()
            if self.key_feed is not None:  # before any frame can reach the slot's new worker
                self.key_feed.forked(slot, segments)
            self.admin.hub.attach(slot, control[0], fdpass[0])
            if self.key_feed is not None:
                self.key_feed.joined(slot)
        return pid

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = self.children.pop(pid, None)
            shared = self.shared_of.pop(pid, None)
            self.hang_killed.discard(pid)
            if slot is None:
                continue
            if shared is not None:
                # Whatever the dead worker held in shared gauges (its keys' max_parallel
                # places) goes back before any new worker runs in its slot.
                shared.forget_slot(slot)
            counters = self.shared.counters
            code = os.waitstatus_to_exitcode(status)
            if pid in self.retiring:  # a replaced worker (or an aborted new one): done
                del self.retiring[pid]
                log.info("replaced worker pid %d exited (%s)", pid, _how(code))
                for gauge in (F.READY, F.IN_FLIGHT, F.RING_DEPTH, F.UPSTREAM_CONNECTIONS):
                    counters.set(slot, gauge, 0)
                continue
            counters.set(slot, F.READY, 0)
            if self.stopping:
                continue
            r = self.reload
            if r is not None and pid == r.new_pid:
                r.failed = f"died with {_how(code)}"
                continue
            uptime = time.monotonic() - self.started_at.get(slot, 0.0)
            delay = 0.0
            if uptime < _HEALTHY_UPTIME_S:
                delay = min(_RESTART_BACKOFF_MAX_S, max(0.1, self.backoff.get(slot, 0.0) * 2))
            self.backoff[slot] = delay
            log.error("worker %d (pid %d) died with %s after %.1fs; restarting in %.1fs",
                      slot, pid, _how(code), uptime, delay)
            self.respawn_at[slot] = time.monotonic() + delay

    def _respawn_due(self) -> None:
        now = time.monotonic()
        for slot, when in list(self.respawn_at.items()):
            if when <= now:
                del self.respawn_at[slot]
                self._spawn(slot)


def close_inherited_fds(keep: set[int]) -> None:
    """In a freshly forked worker: close every descriptor but `keep`.

    The supervisor's admin threads may hold hundreds of client sockets at the moment of the
    fork; the Python objects owning them stay behind in the parent's (now absent) threads, so
    nothing else would ever close them in the child.
    """
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc: close up to the descriptor limit
        import resource

        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fds = list(range(3, min(limit, 65536)))
    for fd in fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:  # the directory listing's own descriptor, already closed
                pass


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run_worker(settings: Settings, slot: int, sock: socket.socket, shared: SharedStats,
               limiter: Limiter, placement: tuple[int, int],
               control: socket.socket | None = None, defer: bool = False,
               keys: dict[str, Any] | None = None,
               budgets: SharedBudgets | None = None,
               fd_sock: socket.socket | None = None) -> int:
    """Body of a worker process: pin, then build the loop and everything else on that core."""
    from velox.pipeline.worker import Worker

    _die_with_parent()
    core, node = placement
    if core >= 0:
        pin(core)
    counters = shared.counters
    counters.set(slot, F.PID, os.getpid())
    counters.set(slot, F.CORE, core)
    counters.set(slot, F.NUMA_NODE, node)
    loop: asyncio.AbstractEventLoop
    try:
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    worker = Worker(settings, slot, shared, limiter, sock, defer_accept=defer)
    worker.budgets = budgets  # velox.spend.wire: the budgets' shared memory, or None
    worker.control_sock = control  # the admin's control channel (None: VELOX_ADMIN_ADDR=off)
    worker.fd_sock = fd_sock  # and its descriptors' socket (key-table segments)
    worker.keys_frame = keys  # the run-time keys at fork (velox.admin.keyfeed)
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
    try:
        supervisor = Supervisor(settings)
    except OSError as exc:  # the state directory, the ledger file, a socket: said in one line
        log.error("cannot start: %s", exc)
        return 1
    sys.stdout.flush()
    return supervisor.run()
