"""The package's imports read from its source with ``ast``, for the tests that hold the import rules
(tests/test_layering.py, tests/test_imports.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

from tests.helpers.paths import ROOT

PACKAGE = ROOT / "amppass"


def module_name(path: Path) -> str:
    """The dotted name of the module at ``path`` (a package's ``__init__.py`` is the package)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts.pop()
    return ".".join(parts)


def folder(module: str) -> str:
    """The package a module lives in (a package's ``__init__`` lives in the package itself)."""
    if module.endswith(".__init__"):
        return module[: -len(".__init__")]
    return module if (ROOT / module.replace(".", "/") / "__init__.py").exists() else module.rsplit(".", 1)[0]


def is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of the checkout."""
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> Iterator[tuple[str, str, str | None, int]]:
    """(importing module, imported module, imported name or None, line) for every amppass import in ``path``,
    function-level ones included; ``from pkg import module`` names the module itself."""
    module = module_name(path)
    package = folder(module).split(".")
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "amppass":
                continue
            for alias in node.names:
                if is_module(f"{target}.{alias.name}"):
                    yield module, f"{target}.{alias.name}", None, node.lineno
                else:
                    yield module, target, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "amppass":
                    yield module, alias.name, None, node.lineno


def all_imports() -> list[tuple[str, str, str | None, int]]:
    """:func:`imports` of every module of the package."""
    return [edge for path in sorted(PACKAGE.rglob("*.py")) for edge in imports(path)]
