"""Aligned text tables for the command line (`velox prices`, `velox spend`).
"""

from __future__ import annotations

from collections.abc import Sequence


def cell(value: object) -> str:
    """How a value reads in a table: None as "-", floats without trailing zeros."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.9f}".rstrip("0").rstrip(".") if value else "0"
    return str(value)


def aligned(columns: Sequence[str], rows: Sequence[Sequence[object]],
            right: frozenset[str] = frozenset()) -> str:
    """`columns` then one line per row, each column padded to its widest cell; columns named
    in `right` are right-aligned (numbers)."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if c in right else v.ljust(w)
                 for c, v, w in zip(columns, values, widths, strict=True)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(list(columns)), *(line(v) for v in cells)]) + "\n"
