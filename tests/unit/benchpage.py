"""A docs page with one generated section, written by benches.report from one results file:
what the report tests of each section share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benches import report as benchreport


def regenerate(tmp_path: Path, marker: str, results_name: str, doc: dict[str, Any],
               before: str = "intro\n", after: str = "") -> str:
    """The page's text once its `marker` section is generated from `doc` (saved as
    results_name); the section held "old" before."""
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    (results / results_name).write_text(json.dumps(doc))
    page = tmp_path / "benchmarks.md"
    page.write_text(f"{before}<!-- bench:{marker}:start -->\nold\n<!-- bench:{marker}:end -->\n"
                    f"{after}")
    assert benchreport.generate_only(results, page, [marker]) == [marker]
    return page.read_text()


def section(text: str, marker: str) -> str:
    return text.split(f"<!-- bench:{marker}:start -->")[1].split(f"<!-- bench:{marker}:end -->")[0]
