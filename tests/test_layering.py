"""The package's import rules (docs/architecture.md), read from the source with ``ast``.

1. Layers, lowest first: errors; archive, dtypes, files, text; targets; analysis; the front ends fx, onnx and
   the training support; report; serving; pipelines; cli and the package itself. A module imports only from its own
   folder or from a lower layer: never upward, and never across folders of one layer (the front ends do
   not import each other). Only the top layer's modules import each other.
2. ``__version__`` lives in ``amppass/_version.py``, the lowest layer, which imports nothing: every module reads it
   from there, and no module imports the package root.
3. No module imports a private name (``_name``) from another folder.
4. The re-exports kept at paths the docs or older installs name (:data:`KEPT_PATHS`) are the only
   exceptions; each holds nothing but a docstring and imports from its new home, and stays only while the
   docs or the pinned public API (tests/test_public_api.py) name it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "amppass"

LAYERS = (
    ("_version",),
    ("errors",),
    ("archive", "dtypes", "files", "text"),
    ("targets",),
    ("analysis",),
    ("fx", "onnx", "training"),
    ("report",),
    ("serving",),
    ("pipelines",),
    ("integrations",),
    ("cli", "__init__", "__main__"),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
TOP = len(LAYERS) - 1

# old module path -> (its new home, why the old path is kept)
KEPT_PATHS = {
    "amppass.onnx.convert": ("amppass.pipelines.convert_onnx", "README.md shows amppass.onnx.convert.save"),
    "amppass.fx.backend": ("amppass.pipelines.backend",
                           "installs made before the move name it in their torch_dynamo_backends entry point"),
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 2:
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    """The folder (or top-level module) of ``amppass.x.y``: ``x``; the package itself is ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imports(path: pathlib.Path):
    """(importing module, imported module, imported name or None, line) for every amppass import in ``path``,
    function-level ones included; ``from pkg import module`` names the module itself."""
    module = _module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
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
                if _is_module(f"{target}.{alias.name}"):
                    yield module, f"{target}.{alias.name}", None, node.lineno
                else:
                    yield module, target, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "amppass":
                    yield module, alias.name, None, node.lineno


def _all_imports():
    return [edge for path in sorted(PACKAGE.rglob("*.py")) for edge in _imports(path)]


def _breaks(importer: str, target: str, name: str | None) -> str | None:
    """Why ``importer`` may not import ``name`` from ``target``, or None."""
    a, b = _unit(importer), _unit(target)
    if a == b:
        return None
    if b == "__init__" and RANK[a] != TOP:
        return "imports the package root (rule 2: read __version__ from amppass._version)"
    if name and name.startswith("_") and not name.startswith("__"):
        return f"imports the private {name} from another folder"
    if target.rsplit(".", 1)[-1].startswith("_") and not target.endswith("__") and target != "amppass._version":
        return "imports a private module of another folder"
    if RANK[b] > RANK[a]:
        return f"imports upward ({a} is below {b})"
    if RANK[b] == RANK[a] and RANK[a] != TOP:
        return f"imports across one layer ({a} and {b} are peers)"
    return None


def test_every_folder_has_a_layer():
    units = {_unit(_module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(RANK), f"place {sorted(units - set(RANK))} in LAYERS and docs/architecture.md"


def test_no_import_breaks_the_layers():
    broken = [f"{importer}:{line} {why}: {target}" + (f".{name}" if name else "")
              for importer, target, name, line in _all_imports()
              if importer not in KEPT_PATHS and (why := _breaks(importer, target, name))]
    assert not broken, "\n".join(broken)


def test_the_rule_catches_an_upward_and_a_private_import():
    assert _breaks("amppass.fx.capture.export", "amppass.serving.serving_graph", "ServingGraph").startswith("imports upward")
    assert _breaks("amppass.onnx.trial_runs", "amppass.fx.runners.trial_runs", "Checkpoints").startswith("imports across")
    assert _breaks("amppass.pipelines.backend", "amppass.fx.capture.guards", "_spec").startswith("imports the private")
    assert _breaks("amppass.pipelines.convert", "amppass", "__version__").startswith("imports the package root")
    assert _breaks("amppass.analysis.record", "amppass._version", "__version__") is None
    assert _breaks("amppass.cli", "amppass.pipelines.convert", "convert") is None


@pytest.mark.parametrize("old", sorted(KEPT_PATHS))
def test_kept_paths_only_re_export_and_are_still_needed(old):
    new, why = KEPT_PATHS[old]
    path = ROOT / (old.replace(".", "/") + ".py")
    body = ast.parse(path.read_text()).body
    assert isinstance(body[0], ast.Expr) and new in body[0].value.value, f"{path}: its docstring names {new}"
    assert all(isinstance(node, ast.ImportFrom) for node in body[1:]), f"{path} holds more than re-exports"
    assert {t for _, t, _, _ in _imports(path)} == {new}
    named_in = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")), ROOT / "tests" / "test_public_api.py"]
    assert any(old in p.read_text() for p in named_in if p.exists()), (
        f"{old} is named nowhere any more ({why}): delete it and its KEPT_PATHS entry")
