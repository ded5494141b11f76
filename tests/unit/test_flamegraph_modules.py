"""The flame graph's module names: a checkout's absolute path is cut to the package, so Velox's
own code is coloured as Velox's (warm) wherever it is installed from, and no machine's
directory shows in the picture."""

from __future__ import annotations

from types import SimpleNamespace

from velox.admin.flamegraph import colour, module_of


def frame(path: str) -> SimpleNamespace:
    return SimpleNamespace(file_path_short=path)


def test_a_checkouts_absolute_path_is_cut_to_the_package() -> None:
    assert module_of(frame("/srv/checkouts/gw/velox/worker.py")) == "velox/worker"
    assert module_of(frame("/srv/checkouts/gw/velox/egress/h2conn.py")) == "velox/egress/h2conn"
    assert colour(module_of(frame("/srv/x/velox/worker.py"))) == colour("velox/worker")


def test_installed_and_builtin_paths_as_before() -> None:
    assert module_of(frame("/usr/lib/python3/site-packages/uvloop/__init__.py")) == \
        "uvloop/__init__"
    assert module_of(frame("velox/worker.py")) == "velox/worker"
    assert module_of(frame("<built-in>")) == "<built-in>"
    assert module_of(frame("/usr/lib/python3.11/asyncio/events.py")) == \
        "/usr/lib/python3.11/asyncio/events"
