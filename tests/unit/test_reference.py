"""The configuration reference (docs/reference/configuration.md) is generated and complete."""

from __future__ import annotations

import re
from pathlib import Path

from velox.config import reference
from velox.config.settings import FIELDS

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_in_docs_is_the_generated_one() -> None:
    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert page == reference.page(), (
        "regenerate it: python -m velox.config.reference > docs/reference/configuration.md")


def test_every_variable_and_every_table_key_is_described() -> None:
    page = reference.page()
    for field in FIELDS:
        assert f"| `{field.env}` |" in page, field.env
    for table, keys in reference.table_keys().items():
        described = set(reference.KEY_DOCS[table])
        assert described == set(keys), (
            f"[{table}]: the parser accepts {sorted(set(keys) - described)} without a "
            f"description in velox.config.reference.KEY_DOCS, which also describes "
            f"{sorted(described - set(keys))} the parser does not accept")


def test_defaults_and_bounds_come_from_the_parser() -> None:
    page = reference.page()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", page, re.M))
    assert rows["attempts"].strip() == "`3`"  # RetryPolicy's default
    assert "(1 to 10)" in page  # RETRY_INTS["attempts"]
    assert rows["connections"].strip() == "`VELOX_EGRESS_POOL_CONNECTIONS`"  # the template's
    assert rows["stream_usage"].strip() == "`true`"
