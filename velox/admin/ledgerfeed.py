"""A worker's side of the ledger: rows collected on the loop, shipped to the supervisor.

The hot path calls `LedgerFeed.add(row)`: one length check and one list append (~0.1 us);
or, with spend's native book (velox.spend.book), the rows are kept there by column and the
feed's `source` hands them over as a ready frame at each flush.
Every `FLUSH_S` a loop timer takes the collected rows, packs them by column into one binary
control frame (velox.spend.rowframe, admin/control.py framing; a row that does not fit is
left out, counted in `dropped` and logged) and hands the frame to `write` (the control
channel's transport.write: never blocking, it buffers in the loop). The supervisor's channel
reader passes the frame to its `LedgerWriter.submit_frame` (velox.spend.ledger explains why
the supervisor writes).

Bounded: at most `ROWS_MAX` rows wait in the feed, and a frame is not written while the
transport already buffers `BACKLOG_MAX` bytes (the supervisor is not reading); rows that find
no room are dropped and counted (`dropped`), never kept. A worker SIGKILLed loses the rows of
its last `FLUSH_S` at most; what it wrote to the socket is read by the supervisor all the same.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from velox.admin.control import frame
from velox.spend.rowframe import pack

log = logging.getLogger("velox.ledger")

FLUSH_S = 0.1
# A second of a worker's top rate (~10k requests/s) with room to spare.
ROWS_MAX = 65_536
# ~4 MiB of frames not yet taken by the supervisor: it is stuck or gone, stop adding.
BACKLOG_MAX = 4 << 20


class LedgerFeed:
    """Per worker: `add` on the hot path, `flush` on a loop timer (`start`)."""

    def __init__(self, write: Callable[[bytes], None], backlog: Callable[[], int],
                 rows_max: int = ROWS_MAX, backlog_max: int = BACKLOG_MAX,
                 flush_s: float = FLUSH_S) -> None:
        self.write = write
        self.backlog = backlog
        self.rows_max = rows_max
        self.backlog_max = backlog_max
        self.flush_s = flush_s
        self.rows: list[Sequence[Any]] = []
        self.sent = 0
        self.dropped = 0
        self.bad = 0  # of the dropped: rows that did not fit the columns (rowframe.pack)
        self._timer: asyncio.TimerHandle | None = None
        # Rows kept elsewhere (velox.spend.wire.Spend.take): (frame body, rows, rows dropped
        # since the last call) or None, taken at each flush.
        self.source: Callable[[], tuple[bytes, int, int] | None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, row: Sequence[Any]) -> None:
        rows = self.rows
        if len(rows) < self.rows_max:
            rows.append(row)
        else:
            self.dropped += 1

    def flush(self) -> int:
        """Ship what was collected as one frame (and the source's, as another); return how
        many rows went."""
        sent = self._flush_rows()
        source = self.source
        taken = None if source is None else source()
        if taken is not None:
            body, rows, dropped = taken
            self.dropped += dropped
            if body and self.backlog() >= self.backlog_max:
                self.dropped += rows
            elif body:
                self.write(frame(body))
                self.sent += rows
                sent += rows
        return sent

    def _flush_rows(self) -> int:
        rows = self.rows
        if not rows:
            return 0
        self.rows = []
        if self.backlog() >= self.backlog_max:
            self.dropped += len(rows)
            return 0
        body, bad = pack(rows)
        if bad:
            if not self.bad:  # once: a producer's bug, not a load to report per frame
                log.warning("ledger: %d rows did not fit the ledger's columns and were "
                            "dropped", bad)
            self.bad += bad
            self.dropped += bad
        if body:
            self.write(frame(body))
        self.sent += len(rows) - bad
        return len(rows) - bad

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timer = loop.call_later(self.flush_s, self._tick)

    def _tick(self) -> None:
        self.flush()
        if self._loop is not None:
            self._timer = self._loop.call_later(self.flush_s, self._tick)

    def close(self) -> None:
        """Stop the timer and ship the last rows (the worker calls this while draining)."""
        if self._timer is not None:
            self._timer.cancel()
        self._loop = None
        self.flush()
