"""The ledger file after SIGKILLs, with real processes: a supervisor-like process owning the
writer and the control channels, two worker processes streaming rows over them.

Three runs on one file. In the first two a worker is SIGKILLed while it streams (the writer
carries on with the other's rows), then the supervisor is SIGKILLed mid-write; in the last the
supervisor is SIGKILLed in the middle of a retention purge of 300,000 old rows, its workers
streaming. After every run the file passes SQLite's
`PRAGMA integrity_check`, and each worker's rows are a prefix of what it sent (request ids
RUN-SLOT-0 ... RUN-SLOT-k, no holes): what a kill loses is a tail, never a middle, and no
batch is half there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import wait_for
from velox.spend.ledger import Store, connect, make_row

ROOT = Path(__file__).resolve().parents[2]
OLD_ROWS = 300_000


def _count(path: Path, sql: str, *args: object) -> int:
    conn = connect(path, readonly=True)
    try:
        return int(conn.execute(sql, args).fetchone()[0])
    finally:
        conn.close()


def _rows_of(path: Path, run: str, slot: int) -> int:
    return _count(path, "SELECT COUNT(*) FROM requests WHERE request_id LIKE ?",
                  f"{run}-{slot}-%")



class Run:
    """The supervisor of one run and the PIDs of its workers."""

    def __init__(self, path: Path, run: str, retention_days: int,
                 purge_rows_max: int | None = None) -> None:
        extra = [] if purge_rows_max is None else [str(purge_rows_max)]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.spend._procs", "supervisor", str(path), run, "2",
             str(retention_days), *extra], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.workers: dict[int, int] = {}
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            if words == ["ready"]:
                break
            self.workers[int(words[1])] = int(words[2])
        assert len(self.workers) == 2, "the supervisor did not start its workers"

    def kill_worker(self, slot: int) -> None:
        os.kill(self.workers.pop(slot), signal.SIGKILL)

    def kill_all(self) -> None:
        self.proc.kill()  # SIGKILL by PID
        self.proc.wait(30)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        for pid in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.workers.clear()


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        if run.proc.poll() is None or run.workers:
            run.kill_all()


def _check(path: Path, runs: list[str]) -> None:
    conn = connect(path, readonly=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        for run in runs:
            for slot in (0, 1):
                seqs = sorted(int(rid.rsplit("-", 1)[1]) for (rid,) in conn.execute(
                    "SELECT request_id FROM requests WHERE request_id LIKE ?",
                    (f"{run}-{slot}-%",)))
                assert seqs, f"no rows from worker {slot} of run {run}"
                assert seqs == list(range(len(seqs))), f"a hole in worker {slot} of {run}"
    finally:
        conn.close()


def _old_rows(path: Path) -> None:
    store = Store(connect(path))
    old = int(time.time() * 1000) - 10 * 86_400_000
    for start in range(0, OLD_ROWS, 50_000):
        store.append([make_row(ts_ms=old, key="old", request_id=f"old-{start + i}")
                      for i in range(50_000)])
    store.conn.close()


def test_sigkill_of_workers_and_of_the_writer_never_corrupts_the_ledger(
        tmp_path: Path, runs: list[Run]) -> None:
    path = tmp_path / "ledger.sqlite3"
    done: list[str] = []
    for number in range(3):
        name = f"run{number}"
        purging = number == 2
        if purging:
            _old_rows(path)
        # The purging run's writer deletes at most 500 rows per batch: the purge lasts hundreds
        # of batches, so the SIGKILL below lands in it on a quiet machine as on a busy one.
        run = Run(path, name, retention_days=7, purge_rows_max=500 if purging else None)
        runs.append(run)
        if purging:  # SIGKILL while old rows are being deleted, some gone, some not
            wait_for(lambda n=name: 0 < _count(path, "SELECT COUNT(*) FROM requests WHERE "
                                               "request_id LIKE 'old-%'") < OLD_ROWS
                     and _rows_of(path, n, 0) > 0 and _rows_of(path, n, 1) > 0, timeout=120)
        else:
            wait_for(lambda n=name: _rows_of(path, n, 0) >= 2000
                     and _rows_of(path, n, 1) >= 2000, timeout=90)
            run.kill_worker(0)
            after = _rows_of(path, name, 1)
            # The writer goes on with the other worker's rows.
            wait_for(lambda n=name, a=after: _rows_of(path, n, 1) >= a + 2000, timeout=90)
        run.kill_all()
        done.append(name)
        _check(path, done)
    left = _count(path, "SELECT COUNT(*) FROM requests WHERE request_id LIKE 'old-%'")
    assert left < OLD_ROWS  # the purge had started; what it committed stays committed
