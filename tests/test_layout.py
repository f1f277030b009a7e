"""The tests' own layout (docs/testing.md, "Where a test lives"): tests/ mirrors amppass/, helpers are shared
through tests/helpers/, and code is shared one way between tests and benchmarks.

Read from the source with ``ast``, as tests/test_layering.py reads the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.paths import ROOT

TESTS, BENCHMARKS, PACKAGE = ROOT / "tests", ROOT / "benchmarks", ROOT / "amppass"
# folders of tests/ that are not a folder of the package, each with what it holds (docs/testing.md)
BESIDE_THE_MIRROR = {"guarantees", "conformance", "helpers", "models"}


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports (a ``from X import y`` counts as X and X.y), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.module, node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return found


def _python(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if "site" not in p.relative_to(folder).parts)


def _is_test_module(name: str) -> bool:
    return name.startswith(("tests.", "benchmarks.checks.")) and name.rsplit(".", 1)[-1].startswith("test_")


def test_every_test_folder_mirrors_a_package_folder_or_says_what_it_holds():
    folders = {p.parent.relative_to(TESTS) for p in TESTS.rglob("test_*.py")} - {Path(".")}
    stray = [str(f) for f in sorted(folders) if f.parts[0] not in BESIDE_THE_MIRROR and not (PACKAGE / f).is_dir()]
    assert not stray, f"tests/{stray} mirror no folder of amppass/: move them, or name the folder in docs/testing.md"


def test_no_test_module_imports_another():
    found = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _python(TESTS) + _python(BENCHMARKS / "checks")
             for name, line in _imports(p) if _is_test_module(name)]
    assert not found, "\n".join(found) + "\nmove what they share into tests/helpers/"


def test_nothing_under_tests_imports_the_benchmarks():
    found = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _python(TESTS)
             for name, line in _imports(p) if name.split(".")[0] == "benchmarks"]
    assert not found, "\n".join(found) + "\nthe benchmarks' own tests belong in benchmarks/checks/"


def test_benchmarks_import_only_the_shared_helpers_and_harnesses_of_tests():
    found = [f"{p.relative_to(ROOT)}:{line} imports {name}" for p in _python(BENCHMARKS)
             for name, line in _imports(p)
             if name.split(".")[0] == "tests" and not name.startswith(("tests.helpers", "tests.conformance"))]
    assert not found, "\n".join(found)


def test_the_rules_catch_what_they_are_for(tmp_path):
    bad = tmp_path / "test_bad.py"
    bad.write_text("from tests.pipelines.test_convert import check\nimport benchmarks.gpu\n")
    names = [name for name, _ in _imports(bad)]
    assert any(_is_test_module(n) for n in names) and "benchmarks.gpu" in names
    assert not _is_test_module("tests.helpers.onnx_graphs")
