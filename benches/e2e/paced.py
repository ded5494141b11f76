"""One load process of a several-hosts run: the official `openai` SDK sending to ONE host at a
steady (or bursty) pace, as a client of that host would, from its own process.

Several hosts get one such process each (`spawn`), so no client's event loop paces the load of
another host: on a busy machine one lagging loop then delays only its own host's requests.
Requests are shaped as the SDK sends them by default: no `max_tokens` (a key's tpm reservation
is then the body's estimate plus the default output budget), unless `max_tokens` is given.

    python -m benches.e2e.paced BASE_URL API_KEY RATE DURATION_S START_AT [--burst N]
        [--max-tokens N]

Request k is due at START_AT (a time.time() value, shared by the processes) + k / RATE; with
START_AT `-` the process imports the SDK, prints `ready` and reads START_AT from its stdin
(`spawn(..., None)` then `start(procs)`: on a busy host the import can take longer than any
fixed lead, and a process starting late would send all its overdue requests at once); with
`--burst N` requests go out N at once every N / RATE seconds (the same mean rate). Bounded: at
most RATE x DURATION_S requests, each with a 30 s timeout, and the process waits at most 35 s
for the last answers. Prints one JSON line: per request (send time from START_AT, status),
the tokens the admitted answers used, the longest send-to-answer time of an admitted request,
and the errors without an answer by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
import subprocess
import sys
import time
from typing import Any

MODEL = "gpt-4o-mini"


async def load(base_url: str, api_key: str, rate: float, duration_s: float, start_at: float,
               burst: int = 1, max_tokens: int | None = None) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                timeout=30.0)
    total = int(rate * duration_s)
    records: list[tuple[float, int]] = []
    out: dict[str, Any] = {"tokens": 0, "max_lag_s": 0.0, "last_admitted_s": 0.0,
                           "failures": {}}
    extra: dict[str, Any] = {} if max_tokens is None else {"max_tokens": max_tokens}

    async def one() -> None:
        sent = time.time() - start_at
        try:
            answer = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hello."}], **extra)
            status = 200
            if answer.usage is not None:
                out["tokens"] += answer.usage.total_tokens
        except openai.APIStatusError as exc:
            status = exc.status_code
        except openai.APIError as exc:  # no answer at all (refused, reset, timeout)
            status = 0
            why = f"{type(exc).__name__}: {exc.__cause__!r}"[:200]
            out["failures"][why] = out["failures"].get(why, 0) + 1
        done = time.time() - start_at
        records.append((round(sent, 4), status))
        if status == 200:
            out["max_lag_s"] = max(out["max_lag_s"], done - sent)
            out["last_admitted_s"] = max(out["last_admitted_s"], done)

    pending: set[asyncio.Task[None]] = set()
    for k in range(0, total, burst):
        delay = start_at + k / rate - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        for _ in range(min(burst, total - k)):
            task = asyncio.create_task(one())
            pending.add(task)
            task.add_done_callback(pending.discard)
    out["last_send_s"] = time.time() - start_at
    if pending:
        await asyncio.wait(pending, timeout=35)
    await client.close()
    out["records"] = records
    out["sent"] = total
    return out


def spawn(base_url: str, api_key: str, rate: float, duration_s: float,
          start_at: float | None, burst: int = 1,
          max_tokens: int | None = None) -> subprocess.Popen[str]:
    """Start one load process (stdout: its JSON line); the caller waits for it (`collect`).
    `start_at` None: it waits, SDK imported, for the time `start` gives every process."""
    cmd = [sys.executable, "-m", "benches.e2e.paced", base_url, api_key, repr(rate),
           repr(duration_s), "-" if start_at is None else repr(start_at), "--burst", str(burst)]
    if max_tokens is not None:
        cmd += ["--max-tokens", str(max_tokens)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE if start_at is None else None,
                            stdout=subprocess.PIPE, text=True)


def start(procs: list[subprocess.Popen[str]], lead_s: float = 0.5,
          timeout_s: float = 120.0) -> float:
    """Once every process spawned with `start_at` None is ready (its SDK imported), give them
    all one start time `lead_s` ahead, and return it."""
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        ready = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]
        line = proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            raise RuntimeError(f"a load process did not get ready: {line!r}")
    start_at = time.time() + lead_s
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(f"{start_at!r}\n")
        proc.stdin.flush()  # one line is all it reads; `collect`'s communicate closes it
    return start_at


def collect(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    """The JSON line of one load process; killed (by its PID) if it overruns `timeout_s`."""
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"a load process exited with {proc.returncode}")
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benches.e2e.paced")
    p.add_argument("base_url")
    p.add_argument("api_key")
    p.add_argument("rate", type=float)
    p.add_argument("duration_s", type=float)
    p.add_argument("start_at", help="a time.time() value, or - to read it from stdin")
    p.add_argument("--burst", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=None)
    a = p.parse_args()
    if a.start_at == "-":
        import openai  # noqa: F401 - the slow part, done before the start is given

        print("ready", flush=True)
        start_at = float(sys.stdin.readline())
    else:
        start_at = float(a.start_at)
    doc = asyncio.run(load(a.base_url, a.api_key, a.rate, a.duration_s, start_at, a.burst,
                           a.max_tokens))
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
