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

import os
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
