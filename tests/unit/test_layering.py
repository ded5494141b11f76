"""Layering: every velox module's docstring ends with an "Imports:" line naming what it may
import; this check parses the module's real imports with `ast` and fails on any it does not name.

A velox import `velox.a.b` is allowed when the line names `a.b` or a package above it (`a`),
relative to `velox` or to the module's own package (`control` inside velox/admin). A
third-party import is allowed when the line names its top-level package (`orjson`); the
standard library always is, and "stdlib only" therefore adds nothing to check. Imports under
`if TYPE_CHECKING:` are annotations, not dependencies, and are skipped; lazy imports inside
functions are dependencies all the same and are checked. A synthetic package proves the check
fails on a violation.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "velox"
# Phrases in Imports lines that stand for a module without naming it.
ALIASES = {"native extension": "_native"}
# Distribution names that differ from their import names.
IMPORT_NAMES = {"python-dotenv": "dotenv", "pyinstrument": "pyinstrument"}


def declared_imports(doc: str) -> set[str] | None:
    """The words of a docstring's "Imports:" paragraph (None when it has none)."""
    match = re.search(r"^Imports:(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    if match is None:
        return None
    text = match.group(1)
    words = set(re.findall(r"[A-Za-z_][\w.]*\w|[A-Za-z_]", text))
    for phrase, name in ALIASES.items():
        if phrase in text:
            words.add(name)
    words |= {IMPORT_NAMES[w] for w in list(words) if w in IMPORT_NAMES}
    words |= {w.removeprefix("velox.") for w in words}  # `velox.egress.codec` style
    return words


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped |= {id(n) for n in ast.walk(child)}
    return skipped


def actual_imports(path: Path, root: Path) -> set[tuple[str, bool]]:
    """(name, is_ours) for each import: velox modules relative to the package
    (`admin.control`), third-party ones by their top-level name."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]  # ("velox", "admin")
    if path.name == "__init__.py":
        package = path.relative_to(root.parent).parts[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if module == "__future__":
                continue
            for alias in node.names:  # `from velox.admin import snapshot` imports a module
                sub = root.parent.joinpath(*module.split("."), alias.name)
                if sub.with_suffix(".py").is_file() or (sub / "__init__.py").is_file():
                    found.add(f"{module}.{alias.name}")
                else:
                    found.add(module)
    out = set()
    for name in found:
        top = name.split(".")[0]
        if top == root.name:
            rest = name[len(top) + 1:]
            if rest:  # `from velox import __version__` is the package root: always allowed
                out.add((rest, True))
        elif top not in sys.stdlib_module_names:
            out.add((top, False))
    return out


def violations(root: Path) -> list[str]:
    problems = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        declared = declared_imports(doc)
        imports = actual_imports(path, root)
        if declared is None:
            if imports:
                names = sorted(name for name, _ in imports)
                problems.append(f"{rel}: no Imports: line, imports {names}")
            continue
        own = ".".join(rel.with_suffix("").parts[:-1])
        allowed = declared | {f"{own}.{w}" for w in declared if own}
        third_party = {w.split(".")[0] for w in declared}  # `jh2._hazmat` names jh2
        for name, ours in sorted(imports):
            parts = name.split(".")
            if ours:
                ok = any(".".join(parts[:i]) in allowed for i in range(1, len(parts) + 1))
            else:
                ok = name in third_party
            if not ok:
                problems.append(f"{rel}: imports {name}, which its Imports: line does not name")
    return problems


def test_every_module_imports_only_what_its_docstring_declares() -> None:
    assert violations(PACKAGE) == []


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_check_fails_on_a_violation(tmp_path: Path) -> None:
    pkg = tmp_path / "velox"
    _write(pkg, "__init__.py", '"""Root.\n\nImports: nothing.\n"""\n')
    _write(pkg, "stats.py", '"""Counters.\n\nImports: stdlib only.\n"""\nimport os\n')
    _write(pkg, "ingress.py", '"""Ingress.\n\nImports: stats, stdlib.\n"""\n'
           "from velox.stats import x\nfrom velox import __version__\n")
    _write(pkg, "admin/__init__.py", '"""Admin.\n\nImports: stdlib.\n"""\n')
    _write(pkg, "admin/control.py", '"""Control.\n\nImports: stdlib, orjson.\n"""\n'
           "import orjson\n")
    _write(pkg, "admin/server.py",
           '"""Server.\n\nImports: control (the channel), stdlib.\n"""\n'
           "from typing import TYPE_CHECKING\nfrom velox.admin import control\n"
           "if TYPE_CHECKING:\n    from velox.ingress import y\n")
    assert violations(pkg) == []
    # An upward import, a lazy one, an undeclared third-party one, a missing Imports line.
    _write(pkg, "stats.py", '"""Counters.\n\nImports: stdlib only.\n"""\nimport os\n'
           "def f():\n    from velox import ingress\n")
    _write(pkg, "admin/control.py", '"""Control.\n\nImports: stdlib.\n"""\nimport orjson\n')
    _write(pkg, "admin/server.py", '"""Server.\n"""\nfrom . import control\n')
    assert violations(pkg) == [
        "admin/control.py: imports orjson, which its Imports: line does not name",
        "admin/server.py: no Imports: line, imports ['admin.control']",
        "stats.py: imports ingress, which its Imports: line does not name",
    ]


@pytest.mark.parametrize("doc, words", [
    ("x\n\nImports: stats, admin.server (lazily), stdlib.\n", {"admin.server", "stats"}),
    ("x\n\nImports: the native extension, _types and stdlib.", {"_native", "_types"}),
])
def test_declared_imports_reads_the_line(doc: str, words: set[str]) -> None:
    declared = declared_imports(doc)
    assert declared is not None and words <= declared
