"""A signal sent to a worker in its first milliseconds is not lost (velox.system.fork).

The parent here has a Python SIGTERM handler, as the supervisor does. The child's `prepare`
takes a while (as closing the inherited descriptors does under load) and the parent sends it
SIGTERM meanwhile. Delivered to the inherited handler, the signal would be swallowed and the
child would go on to exit 0; held until the default action is back, it ends the child.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from collections.abc import Iterator

import pytest

from velox.system.fork import fork_child


@pytest.fixture
def parent_handler() -> Iterator[list[int]]:
    got: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    yield got
    signal.signal(signal.SIGTERM, old)


def _wait(pid: int) -> int:
    for _ in range(600):  # bounded: 30 s
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the child outlived its SIGTERM")


def test_sigterm_during_the_childs_preparation_ends_it(parent_handler: list[int]) -> None:
    read, write = os.pipe()

    def prepare() -> None:
        os.close(read)
        os.write(write, b"x")  # the parent may signal now
        os.close(write)
        time.sleep(1.0)  # the signal arrives during this

    def body() -> int:
        time.sleep(10)  # a worker that missed its SIGTERM would run on
        return 0

    pid = fork_child(prepare, body)
    os.close(write)
    assert os.read(read, 1) == b"x"
    os.close(read)
    os.kill(pid, signal.SIGTERM)
    assert _wait(pid) == -signal.SIGTERM
    assert parent_handler == []  # the parent's own handler saw nothing


def test_the_parent_keeps_its_handlers_and_gets_its_signals(parent_handler: list[int]) -> None:
    pid = fork_child(lambda: None, lambda: 3)
    assert _wait(pid) == 3
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100):
        if parent_handler:
            break
        time.sleep(0.01)
    assert parent_handler == [signal.SIGTERM]


def test_the_child_starts_with_its_parents_objects_frozen() -> None:
    """The child's collections never walk what it inherited (no copy-on-write of their pages);
    the parent is thawed again, its own collections unchanged."""
    gc.unfreeze()  # this suite freezes what collection made (conftest); a supervisor has not
    inherited = [[i] for i in range(1000)]  # containers the collector tracks
    read, write = os.pipe()

    def body() -> int:
        os.close(read)
        os.write(write, str(gc.get_freeze_count()).encode())
        os.close(write)
        return 0

    pid = fork_child(lambda: None, body)
    os.close(write)
    frozen = int(os.read(read, 64) or b"0")
    os.close(read)
    assert _wait(pid) == 0
    assert frozen >= len(inherited)
    assert gc.get_freeze_count() == 0
    gc.freeze()
