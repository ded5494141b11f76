"""Where workers run: usable cores handed out NUMA node by node.

Reads the node → CPU lists from /sys (absent on some kernels and containers: then every usable
core is treated as node 0) and orders the usable cores node by node, so consecutive workers
fill one node before the next. On a one-node machine this is simply core order.

Never two workers on one core: with more workers than usable cores (VELOX_WORKERS=64 on a
2-core box) no worker is pinned at all and the kernel's scheduler shares the cores among them.
Pinning the first N and leaving the rest free would still stack the free ones onto the pinned
cores (they may run anywhere), while the pinned ones could never move away from them.
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path

NODE_ROOT = Path("/sys/devices/system/node")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' → [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes(root: Path = NODE_ROOT) -> dict[int, list[int]]:
    nodes: dict[int, list[int]] = {}
    if not root.is_dir():
        return nodes
    for entry in root.glob("node[0-9]*"):
        try:
            nodes[int(entry.name[4:])] = parse_cpulist((entry / "cpulist").read_text())
        except (OSError, ValueError):
            continue
    return nodes


def core_order(allowed: set[int] | None = None,
               nodes: dict[int, list[int]] | None = None) -> list[tuple[int, int]]:
    """Usable (core, node) pairs, node by node, cores ascending within a node."""
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    nodes = numa_nodes() if nodes is None else nodes
    order: list[tuple[int, int]] = []
    seen: set[int] = set()
    for node in sorted(nodes):
        for cpu in sorted(nodes[node]):
            if cpu in allowed and cpu not in seen:
                order.append((cpu, node))
                seen.add(cpu)
    order.extend((cpu, 0) for cpu in sorted(allowed - seen))
    return order


def plan(workers: int, allowed: set[int] | None = None,
         nodes: dict[int, list[int]] | None = None) -> list[tuple[int, int]]:
    """(core, node) for each worker slot, or (-1, -1) for all when there are more workers than
    usable cores (see `oversubscribed`)."""
    order = core_order(allowed, nodes)
    if workers > len(order):
        return [(-1, -1)] * workers
    return order[:workers]


def oversubscribed(workers: int, allowed: set[int] | None = None) -> int:
    """The number of usable cores if `workers` exceeds it, else 0."""
    cores = len(os.sched_getaffinity(0) if allowed is None else allowed)
    return cores if workers > cores else 0


def pin(core: int) -> None:
    os.sched_setaffinity(0, {core})


# sched_setattr/sched_getattr by machine (no libc wrapper in glibc before 2.41, none in os).
_SCHED_CALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
# struct sched_attr, first version: size, policy, flags, nice, priority, runtime, deadline,
# period, util_min, util_max. For SCHED_OTHER, runtime is the slice asked for (ns, Linux 6.12+).
_SCHED_ATTR = struct.Struct("IIQiIQQQII")
_RUNTIME = 5


def read_slice(tid: int = 0) -> int:
    """The time slice (ns) the scheduler gives thread or process `tid` (0: the calling thread);
    0 where sched_getattr is missing or refused."""
    attr = _sched_attr(tid)
    return 0 if attr is None else int(attr[_RUNTIME])


def ask_slice(us: int, tid: int = 0) -> int:
    """Ask the scheduler (EEVDF) for a time slice of `us` microseconds for thread `tid` (0: the
    calling one), keeping its policy and nice; returns the slice in force after (read_slice).
    Kernels before 6.12 ignore the request.

    Why: a worker at one client connection wakes the upstream on every request and the client
    on every answer. With the default slice (~1.4 ms here) a woken process often preempts the
    worker mid-request, which then finishes on a cold cache; a short slice gives the worker
    earlier deadlines, so it runs to its next wait (its CPU share is unchanged: weight is nice's).
    One run at one connection, load 13-18: 133.9 against 137.3 us of CPU per request (4 of 4
    rounds lower) and the added p99 0.70 against 1.74 ms. Unprivileged processes may do this."""
    attr = _sched_attr(tid)
    calls = _SCHED_CALLS.get(os.uname().machine)
    if attr is None or calls is None:
        return 0
    attr[0] = _SCHED_ATTR.size
    attr[_RUNTIME] = us * 1000
    ctypes.CDLL(None).syscall(calls[0], tid, ctypes.create_string_buffer(_SCHED_ATTR.pack(*attr)),
                              0)
    return read_slice(tid)


def _sched_attr(tid: int) -> list[int] | None:
    calls = _SCHED_CALLS.get(os.uname().machine)
    if calls is None:
        return None
    buf = ctypes.create_string_buffer(_SCHED_ATTR.size)
    if ctypes.CDLL(None).syscall(calls[1], tid, buf, _SCHED_ATTR.size, 0):
        return None
    return list(_SCHED_ATTR.unpack(buf.raw))
