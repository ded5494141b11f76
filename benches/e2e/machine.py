"""Facts about the machine and its processes: what every saved result is stamped with.

* `facts()`: CPU model, cores, kernel, OS, memory, Python and package versions, git commit,
  date and load average, so a result file says where and when it was measured.
* `/proc` accounting: CPU seconds (utime + stime) and RSS of a process tree, and the machine's
  busy time, from which a run's "foreign" CPU (work done by processes that are not part of the
  benchmark) is computed. Other people share this machine; a run disturbed by them is visible.
* `bench_lock()`: the exclusive flock every timed section runs under, so two people measuring on
  the same machine take turns instead of disturbing each other.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import importlib.metadata
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("velox", "uvloop", "httptools", "orjson", "jh2", "h2", "httpx", "pytest",
            "pytest-benchmark", "matplotlib")


def lock_path() -> str:
    return os.environ.get("VELOX_BENCH_LOCK") or os.path.join(
        os.environ.get("TMPDIR") or "/tmp", "velox-bench.lock")


def _held_by_ancestor(path: str) -> bool:
    """True when we run under `flock PATH ...` (the lock is already ours: taking it again from
    a new file description would wait for ourselves forever)."""
    pid = os.getppid()
    while pid > 1:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        if argv and os.path.basename(argv[0].decode(errors="replace")) == "flock" and any(
                os.path.abspath(a.decode(errors="replace")) == os.path.abspath(path)
                for a in argv[1:]):
            return True
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


@contextlib.contextmanager
def bench_lock() -> Iterator[float]:
    """Hold the shared benchmark lock; yields the seconds spent waiting for it."""
    t0 = time.monotonic()
    if _held_by_ancestor(lock_path()):
        yield 0.0
        return
    with open(lock_path(), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield time.monotonic() - t0
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --- facts -------------------------------------------------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _os_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return platform.system()


def _mem_total_mib() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 0


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=5,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def tool_version(argv: list[str]) -> str:
    """First line a tool prints about its version ('' if it is not installed)."""
    if shutil.which(argv[0]) is None:
        return ""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    text = (out.stdout + out.stderr).strip()
    return text.splitlines()[0] if text else ""


def facts(extra_packages: Iterable[str] = ()) -> dict[str, object]:
    packages = {name: _version(name) for name in (*PACKAGES, *extra_packages)}
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_mib": _mem_total_mib(),
        "kernel": platform.release(),
        "os": _os_name(),
        "python": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "packages": {k: v for k, v in packages.items() if v},
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "loadavg": list(os.getloadavg()),
    }


# --- /proc accounting --------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0.0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                children = Path(f"/proc/{pid}/task/{task}/children").read_text()
                kids += [int(x) for x in children.split()]
    return kids


def tree(pid: int) -> list[int]:
    """pid and all its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def tree_cpu(pids: Iterable[int]) -> float:
    return sum(cpu_seconds(p) for root in pids for p in tree(root))


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * PAGE_KIB
    except OSError:
        return 0


def pss_kib(pid: int) -> int:
    """Proportional set size: the process's private pages plus its share of the pages it
    shares (a forked worker shares its parent's imports with its siblings; RSS counts them
    whole in each)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def machine_busy() -> tuple[float, float]:
    """(busy CPU seconds, wall-clock seconds) summed over all cores since boot."""
    with open("/proc/stat") as fh:
        values = [int(x) for x in fh.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user
    return (total - idle) / TICK, total / TICK


class CpuWindow:
    """CPU used by `own` process trees, by this process's children and by the whole machine
    over a window: `foreign_cores` is what other people's processes used meanwhile."""

    def __init__(self, own: Iterable[int]) -> None:
        self.own = list(own)

    def __enter__(self) -> CpuWindow:
        self._own0 = {p: cpu_seconds(p) for root in self.own for p in tree(root)}
        self._self0 = os.times()
        self._busy0, _ = machine_busy()
        self._t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        busy1, _ = machine_busy()
        t1 = os.times()
        self.wall = time.monotonic() - self._t0
        own1 = {p: cpu_seconds(p) for root in self.own for p in tree(root)}
        # A process that appeared during the window started from zero.
        self.own_cpu = sum(v - self._own0.get(p, 0.0) for p, v in own1.items())
        self.self_cpu = (t1.user + t1.system + t1.children_user + t1.children_system
                         - self._self0.user - self._self0.system
                         - self._self0.children_user - self._self0.children_system)
        self.busy = busy1 - self._busy0
        self.foreign_cores = max(0.0, (self.busy - self.own_cpu - self.self_cpu)) / self.wall


def wait_quiet(own: Iterable[int], threshold_cores: float = 0.2, timeout_s: float = 20.0) -> float:
    """Wait until other people's processes use less than `threshold_cores`; returns the last
    reading (the run goes ahead after `timeout_s` regardless, with the reading recorded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with CpuWindow(own) as win:
            time.sleep(0.5)
        if win.foreign_cores < threshold_cores or time.monotonic() > deadline:
            return round(win.foreign_cores, 3)
