"""Run the C test suite (`make -C native test`: unit tests and the 10M-item MPMC stress test,
built normally, with ThreadSanitizer and with AddressSanitizer + UndefinedBehaviorSanitizer) so
that `pytest` covers it too.

Marked slow (5 to 15 s on two cores): deselect with `-m "not slow"`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "native"


@pytest.mark.slow
def test_make_native_test_passes() -> None:
    if shutil.which("make") is None or shutil.which("cc") is None:
        pytest.skip("needs make and a C compiler")
    # Own process group, so a timeout can kill make and the test binaries it is running.
    proc = subprocess.Popen(
        ["make", "-C", str(NATIVE), "test"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("make -C native test did not finish in 600 s")
    finally:
        if proc.poll() is None:  # interrupted some other way: do not leave it running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = stdout
    assert proc.returncode == 0, output[-8000:]
    assert "ThreadSanitizer" not in output, output[-8000:]
    # Every program ran to its own "ok" line: normal, TSan and ASan builds of the unit tests.
    assert output.count("test_bucket: ok") == 3, output[-8000:]
    assert output.count("test_stats: ok") == 3, output[-8000:]
    assert output.count("test_cache: ok") == 3, output[-8000:]
    assert output.count("test_limits: ok") == 3, output[-8000:]  # normal, TSan, ASan
    assert output.count("10000000 items, capacity 1024") == 2, output[-8000:]
    assert output.count("1000000 items, capacity 4") == 2, output[-8000:]
    assert output.count("lost 0, duplicated 0") == 4, output[-8000:]
    # The HPACK and HTTP/2 codec programs ran normally, under TSan and under ASan + UBSan.
    assert output.count("test_hpack: ok") == 3, output[-8000:]
    assert output.count("test_h2: ok") == 3, output[-8000:]
    assert "runtime error" not in output and "AddressSanitizer" not in output, output[-8000:]
