"""The examples in README.md and docs/ match what a fresh gateway prints.

`python -m velox_lab.docs_examples` wrote them from a real run (the mock upstream over HTTP/2 +
TLS, a one-worker gateway with a tables file, the OpenAI SDK, the admin server, the CLI). This
test makes the same run and compares each block's shape: JSON by its keys and value types,
text by its lines with numbers and hex ids masked (ports, pids, timings and request ids move
from run to run; field names, doctor checks and output layouts must not).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from velox_lab import docs_examples

ROOT = Path(__file__).resolve().parents[2]


def shape(text: str) -> Any:
    try:
        return _json_shape(json.loads(text))
    except ValueError:
        masked = re.sub(r"[0-9a-f]{8,}", "H", text)
        # A tuple: lines of text are compared whole (only JSON lists match when one is empty).
        return tuple(re.sub(r"\d+(\.\d+)?", "0", line).rstrip() for line in masked.splitlines())


def _json_shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_shape(value[0])] if value else []
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return type(value).__name__
    return "number"


def documented() -> dict[str, list[tuple[str, str]]]:
    """name -> [(file, block text)] over README.md and docs/."""
    found: dict[str, list[tuple[str, str]]] = {}
    for path in docs_examples.doc_files():
        for name, body in docs_examples.blocks(path.read_text()).items():
            found.setdefault(name, []).append((str(path.relative_to(ROOT)), body))
    return found


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return docs_examples.capture(tmp_path_factory.mktemp("docs"), docs_examples._retry)


def test_every_example_is_in_the_docs_and_every_block_names_one(fresh: dict[str, str]) -> None:
    docs = documented()
    assert set(docs) == set(fresh), (
        "run `python -m velox_lab.docs_examples`: the docs' example blocks "
        f"{sorted(docs)} differ from the examples {sorted(fresh)}")


def differences(documented: Any, fresh: Any, path: str = "") -> list[str]:
    """Where two shapes differ. An empty list matches any list: how many connections, routes'
    fallbacks or workers' upstream rows a loaded machine's run happens to show is not the
    shape of the answer (a documented `[]` seen filled in a run under load failed CI)."""
    if isinstance(documented, list) and isinstance(fresh, list):
        if not documented or not fresh:
            return []
        return differences(documented[0], fresh[0], path + "[0]")
    if isinstance(documented, dict) and isinstance(fresh, dict):
        out = [f"{path}/{k}: only {'documented' if k in documented else 'in the run'}"
               for k in documented.keys() ^ fresh.keys()]
        for k in documented.keys() & fresh.keys():
            out += differences(documented[k], fresh[k], f"{path}/{k}")
        return out
    return [] if documented == fresh else [f"{path}: {documented!r} vs {fresh!r}"]


def test_documented_examples_have_the_shape_of_a_fresh_run(fresh: dict[str, str]) -> None:
    stale = [f"{where}: {name} {differences(shape(body), shape(fresh[name]))}"
             for name, places in documented().items() for where, body in places
             if name in fresh and differences(shape(body), shape(fresh[name]))]
    assert not stale, ("these examples no longer match a fresh run; run "
                       f"`python -m velox_lab.docs_examples`: {stale}")


def test_a_changed_field_is_caught() -> None:
    """The comparison sees a renamed JSON key and a changed line, not only missing blocks."""
    line = '{"status": 200, "key": "support-bot", "usage": {"input": 2}}'
    assert not differences(shape(line), shape(line.replace("200", "503").replace("2}", "7}")))
    assert differences(shape(line), shape(line.replace('"key"', '"api_key"')))
    rows = '{"rows": [{"a": 1}]}'
    assert not differences(shape(rows), shape('{"rows": []}'))
    assert differences(shape(rows), shape('{"rows": [{"b": 1}]}'))
    doctor = "PASS  port   127.0.0.1:8080: Velox (pid 41) is up there, /readyz 200"
    assert not differences(shape(doctor), shape(doctor.replace("41", "9977")))
    assert differences(shape(doctor), shape(doctor.replace("PASS", "FAIL")))
