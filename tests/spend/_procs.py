"""Processes for the ledger's crash tests, as the gateway will run them: a supervisor-like
process owning the LedgerWriter and the control channels (admin/control.py's ControlHub with
its ledger sink), and worker processes feeding rows over their channel (velox.admin.ledgerfeed) from
an asyncio loop.

    python -m tests.spend._procs supervisor PATH RUN WORKERS RETENTION_DAYS
    python -m tests.spend._procs worker FD RUN SLOT

The supervisor prints `worker SLOT PID` per worker, then `ready`. A worker adds 20 rows every
millisecond or so, request ids `RUN-SLOT-SEQ` with SEQ counting from 0, until its channel
closes. Nothing here ends by itself except a worker whose supervisor is gone; the test kills
them by PID.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time

from velox.admin.control import ControlHub
from velox.admin.ledgerfeed import LedgerFeed
from velox.spend import ledger
from velox.spend.ledger import LedgerWriter, make_row

ROWS_PER_TICK = 20


def supervisor(path: str, run: str, workers: int, retention_days: int,
               purge_rows_max: int | None = None) -> None:
    if purge_rows_max is not None:  # a purge slow enough for a test to catch it midway
        ledger.PURGE_ROWS_MAX = ledger.PURGE_ROWS_START = purge_rows_max
    writer = LedgerWriter(path, retention_days=retention_days, interval_s=0.05)
    writer.start()
    hub = ControlHub()
    hub.ledger_sink = writer.submit_frame
    for slot in range(workers):
        mine, theirs = hub.pair()
        proc = subprocess.Popen([sys.executable, "-m", "tests.spend._procs", "worker",
                                 str(theirs.fileno()), run, str(slot)],
                                pass_fds=[theirs.fileno()])
        theirs.close()
        hub.attach(slot, mine)
        print(f"worker {slot} {proc.pid}", flush=True)
    print("ready", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    hub.close()
    writer.close()


async def _feed(fd: int, run: str, slot: str) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    closed = loop.create_future()

    class Channel(asyncio.Protocol):
        def connection_lost(self, exc: Exception | None) -> None:
            if not closed.done():
                closed.set_result(None)

    transport, _ = await loop.connect_accepted_socket(Channel, sock)
    feed = LedgerFeed(transport.write, transport.get_write_buffer_size, flush_s=0.05)
    feed.start(loop)
    seq = 0
    now_ms = int(time.time() * 1000)
    while not closed.done():
        for _ in range(ROWS_PER_TICK):
            feed.add(make_row(ts_ms=now_ms, key=f"key-{slot}", team="t", route="m",
                              upstream="u", model="m", input_tokens=seq % 100,
                              output_tokens=1, cost_nanos=seq, latency_us=10,
                              request_id=f"{run}-{slot}-{seq}"))
            seq += 1
        await asyncio.sleep(0.001)


def worker(fd: int, run: str, slot: str) -> None:
    asyncio.run(_feed(fd, run, slot))


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "supervisor":
        supervisor(args[0], args[1], int(args[2]), int(args[3]),
                   int(args[4]) if len(args) > 4 else None)
    else:
        worker(int(args[0]), args[1], args[2])
