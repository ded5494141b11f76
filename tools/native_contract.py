"""An import-linter contract for the native extension: only its façades import `velox._native`.

The extension is a compiled module, which the import graph import-linter builds from Python
sources does not contain: `from velox._native import X` is dropped and `from velox import
_native` is recorded as an import of `velox`. This contract puts the module and its
importers back into (its copy of) the graph, read from each module's source with `ast`, then
checks them as a `protected` contract does: `allowed_importers` are the only modules that may
import `protected_modules`.

Loaded by `lint-imports` (which puts the working directory on sys.path) through
`contract_types` in pyproject.toml.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
from importlinter import ContractCheck
from importlinter.contracts.protected import ProtectedContract


class NativeBoundaryContract(ProtectedContract):
    type_name = "native_boundary"

    def check(self, graph: grimp.ImportGraph, verbose: bool) -> ContractCheck:
        protected = {m.expression for m in self.protected_modules}  # type: ignore[attr-defined]
        for name in protected:
            graph.add_module(name)
        for module in sorted(graph.modules):
            for line, imported in _imports_of(module, protected):
                graph.add_import(importer=module, imported=imported, line_number=line,
                                 line_contents=f"import of {imported}")
        return super().check(graph, verbose)


def _source(module: str) -> Path | None:
    """The file of a module of the project (the working directory is the repository root)."""
    path = Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports_of(module: str, targets: set[str]) -> list[tuple[int, str]]:
    """(line, target) for each import of a target in the module's source, however spelt:
    `import a.b`, `from a.b import x`, `from a import b` (lazy imports inside functions too)."""
    path = _source(module)
    if path is None:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name in targets]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in targets:
                found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if f"{node.module}.{a.name}" in targets]
    return found
