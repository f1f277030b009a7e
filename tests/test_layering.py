"""The package's import rules (docs/architecture.md), read from the source with ``ast``.

1. Layers, lowest first: errors; json_input, limits; archive, dtypes, files, text; targets; analysis; the front ends
   fx, onnx and the training support; report; serving; pipelines; cli and the package itself. A module imports
   only from its own folder or from a lower layer: never upward, and never across folders of one layer (the front
   ends do not import each other). Only the top layer's modules import each other.
2. ``__version__`` lives in ``amppass/_version.py``, the lowest layer, which imports nothing: every module reads it
   from there, and no module imports the package root.
3. No module imports a private name (``_name``) or private module from another folder; a subfolder (``onnx/io/``)
   is a folder of its own here, while for rule 1 it belongs to its top folder's layer.
4. A subfolder listed in :data:`BELOW_ITS_FRONT_END` is the lowest part of its front end: it imports from its own
   folder, from lower layers, and from the rest of its front end only the modules listed (the ONNX files in and out
   read the graph walkers of ``onnx/view.py``, nothing else of ``onnx/``).
5. An old path kept after a move (:data:`KEPT_PATHS`) holds a docstring and one line,
   ``__getattr__ = moved(__name__, "<release>", name="new home", ...)`` (:mod:`amppass.deprecation`): reading a name
   from it gives the new home's object and warns (tests/test_public_api.py pins both). It imports nothing but
   ``moved``, so it breaks no layer; the docs teach the new homes, not it; and this test fails once
   ``amppass.__version__`` reaches the release that removes it.
6. Sizes: a module stays under :data:`MAX_LINES` lines. A folder holds one job, which a reviewer judges
   (docs/architecture.md, rule 5): what is mechanical of it is that every folder is named in the architecture's
   layer table, where its job is written, and a tripwire, :data:`FOLDER_TRIPWIRE` modules, far above any one-job
   folder here, that sends a folder back to that review.
7. No import cycle, at any level: tests/test_imports.py holds it, with the rules on graph types in ``analysis/``
   and private attributes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from amppass._version import __version__
from tests.helpers.package_imports import PACKAGE, all_imports, folder, imports, module_name
from tests.helpers.paths import ROOT

LAYERS = (
    ("_version",),
    ("errors",),
    ("json_input", "limits"),
    ("archive", "deprecation", "dtypes", "files", "text"),
    ("targets",),
    ("analysis",),
    ("fx", "onnx", "training"),
    ("reporting", "report"),  # report/: only the old module paths kept until their removal
    ("serving",),
    ("pipelines",),
    ("integrations",),
    ("cli", "__init__", "__main__"),
)
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}
TOP = len(LAYERS) - 1

MAX_LINES = 650  # rule 6
# Rule 6's tripwire, not its rule: a folder is split when it holds two jobs, whatever its count (a count as the rule
# once pushed the checkpoints into analysis/calibration.py, a module whose job they are not). The largest one-job
# folder holds 17 modules; one of nearly twice that has taken a second job nobody split off.
FOLDER_TRIPWIRE = 32

# a subfolder -> the modules of the rest of its front end it may import (rule 4)
BELOW_ITS_FRONT_END = {
    "amppass.onnx.io": {"amppass.onnx.view"},
}

# old module path -> why it is kept (its new homes and the release that removes it are its moved() call's)
KEPT_PATHS = {
    "amppass.report.report": "code written from the docs of amppass 0.1 calls its load_schema",
    "amppass.report.terminal": "code written from the docs of amppass 0.1 imports its render_text",
    "amppass.onnx.convert": "code written from the docs of amppass 0.1 imports amppass.onnx.convert.save",
    "amppass.fx.backend": "installs made before the move name it in their torch_dynamo_backends entry point",
}


def _unit(module: str) -> str:
    """The folder (or top-level module) of ``amppass.x.y``: ``x``; the package itself is ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _breaks(importer: str, target: str, name: str | None) -> str | None:
    """Why ``importer`` may not import ``name`` from ``target``, or None."""
    a, b = _unit(importer), _unit(target)
    if folder(importer) != folder(target):
        if name and _private(name):
            return f"imports the private {name} from another folder"
        if _private(target.rsplit(".", 1)[-1]) and target != "amppass._version":
            return "imports a private module of another folder"
    if a == b:
        return _below_its_front_end(importer, target)
    if b == "__init__" and RANK[a] != TOP:
        return "imports the package root (rule 2: read __version__ from amppass._version)"
    if RANK[b] > RANK[a]:
        return f"imports upward ({a} is below {b})"
    if RANK[b] == RANK[a] and RANK[a] != TOP:
        return f"imports across one layer ({a} and {b} are peers)"
    return None


def _below_its_front_end(importer: str, target: str) -> str | None:
    """Rule 4 for an import within one folder of :data:`LAYERS`."""
    home = folder(importer)
    allowed = BELOW_ITS_FRONT_END.get(home)
    if allowed is None or folder(target) == home or target in allowed:
        return None
    return f"imports from the rest of its front end ({home} is below it and reads only {sorted(allowed)})"


def test_every_folder_has_a_layer():
    units = {_unit(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(RANK), f"place {sorted(units - set(RANK))} in LAYERS and docs/architecture.md"


def test_no_import_breaks_the_layers():
    broken = [f"{importer}:{line} {why}: {target}" + (f".{name}" if name else "")
              for importer, target, name, line in all_imports()
              if (why := _breaks(importer, target, name))]
    assert not broken, "\n".join(broken)


def test_the_rule_catches_an_upward_and_a_private_import():
    assert _breaks("amppass.fx.capture.export", "amppass.serving.serving_graph", "ServingGraph").startswith(
        "imports upward"
    )
    broken = _breaks("amppass.onnx.trial_runs", "amppass.fx.runners.trial_runs", "Checkpoints")
    assert broken.startswith("imports across")
    assert _breaks("amppass.pipelines.backend", "amppass.fx.capture.guards", "_spec").startswith("imports the private")
    assert _breaks("amppass.pipelines.convert", "amppass", "__version__").startswith("imports the package root")
    assert _breaks("amppass.analysis.record", "amppass._version", "__version__") is None
    assert _breaks("amppass.cli", "amppass.pipelines.convert", "convert") is None


def test_a_subfolder_takes_its_top_folders_layer_and_keeps_its_private_names():
    assert _unit("amppass.onnx.io.save") == "onnx" and folder("amppass.onnx.io.save") == "amppass.onnx.io"
    assert folder("amppass.onnx.io") == "amppass.onnx.io" and folder("amppass.cli") == "amppass"
    assert _breaks("amppass.onnx.io.save", "amppass.pipelines.convert_onnx", "save").startswith("imports upward")
    assert _breaks("amppass.onnx.io.save", "amppass.fx.view.policy", "POLICY").startswith("imports across")
    assert _breaks("amppass.onnx.rewrite", "amppass.onnx.io.weight_store", "_entry").startswith("imports the private")
    assert _breaks("amppass.onnx.io.save", "amppass.onnx.io.weight_store", "_entry") is None
    assert _breaks("amppass.onnx.io.save", "amppass.onnx.rewrite", "rewrite").startswith("imports from the rest")
    assert _breaks("amppass.onnx.io.validate", "amppass.onnx.view", "subgraphs") is None
    assert _breaks("amppass.onnx.rewrite", "amppass.onnx.io.weight_store", "WeightStore") is None


def test_modules_stay_small_and_no_folder_trips_the_wire():
    paths = sorted(PACKAGE.rglob("*.py"))
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in paths if (n := len(p.read_text().splitlines())) >= MAX_LINES]
    crowded = [f"{folder.relative_to(ROOT)}/: {n} modules" for folder in sorted({p.parent for p in paths})
               if (n := len(list(folder.glob("*.py")))) > FOLDER_TRIPWIRE]
    assert not long, f"split (rule 6): {long}"
    assert not crowded, (f"{crowded}: a folder this large holds more than one job; split it by job as "
                         "docs/architecture.md's rule 5 says, not by count")


def _layer_rows() -> list[str]:
    """The rows of docs/architecture.md's layer table ("| <layer> | <folder> | <what lives there> |")."""
    return [line for line in (ROOT / "docs" / "architecture.md").read_text().splitlines()
            if re.match(r"\| \d+ \|", line)]


def test_every_folder_is_named_in_the_layer_table_with_its_job():
    rows = _layer_rows()
    unnamed = []
    for sub in sorted({p.parent.relative_to(PACKAGE) for p in PACKAGE.rglob("*.py")} - {Path(".")}):
        top, *below = sub.parts
        row = next((row for row in rows if f"`{top}/`" in row), None)
        if row is None or (below and f"`{below[-1]}/" not in row):
            unnamed.append(str(sub))
    assert not unnamed, (f"amppass/{unnamed}: say in docs/architecture.md's layer table, in the row of its top "
                         "folder, the one job the folder holds (rule 5)")


def _kept(old: str) -> tuple[str, dict[str, str]]:
    """The release that removes the kept path ``old`` and the new home of each name it gives, read from its module,
    which holds nothing but a docstring naming them and ``__getattr__ = moved(__name__, "<release>", name="home")``."""
    path = ROOT / (old.replace(".", "/") + ".py")
    body = ast.parse(path.read_text()).body
    assert len(body) == 3, f"{path}: a docstring, the import of moved and __getattr__ = moved(...), nothing else"
    doc, imported, assigned = body
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), f"{path}: no docstring first"
    assert isinstance(imported, ast.ImportFrom) and [alias.name for alias in imported.names] == ["moved"]
    assert {target for _, target, _, _ in imports(path)} == {"amppass.deprecation"}, f"{path} imports more"
    call = assigned.value
    assert isinstance(assigned, ast.Assign) and [ast.unparse(t) for t in assigned.targets] == ["__getattr__"]
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "moved", f"{path}: __getattr__ = moved(...)"
    assert len(call.args) == 2 and ast.unparse(call.args[0]) == "__name__", f"{path}: moved(__name__, release, ...)"
    removed_in = ast.literal_eval(call.args[1])
    homes = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    assert isinstance(removed_in, str) and homes and all(isinstance(home, str) for home in homes.values())
    said = " ".join(doc.value.value.split())
    assert f"removed in amppass {removed_in}" in said, f"{path}: its docstring names the release that removes it"
    assert all(home in said for home in homes.values()), f"{path}: its docstring names {sorted(set(homes.values()))}"
    return removed_in, homes


def _release(version: str) -> tuple[int, int, int]:
    """``major.minor.patch`` of a version string; a pre-release counts as its release."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    assert found, f"{version!r} is not a version"
    major, minor, patch = found.groups()
    return int(major), int(minor), int(patch or 0)


def _due(version: str, removed_in: str) -> bool:
    """Whether amppass ``version`` is the release ``removed_in`` (a pre-release of it included) or later."""
    return _release(version) >= _release(removed_in)


@pytest.mark.parametrize("old", sorted(KEPT_PATHS))
def test_a_kept_path_only_re_exports_and_goes_in_the_release_it_names(old):
    removed_in, _ = _kept(old)
    assert not _due(__version__, removed_in), (
        f"amppass {__version__} is the release that removes {old} (kept because {KEPT_PATHS[old]}): delete it, its "
        "KEPT_PATHS entry and its pin in tests/test_public_api.py, and say so in the release notes")


@pytest.mark.parametrize("old", sorted(KEPT_PATHS))
def test_the_docs_teach_the_new_homes_not_a_kept_path(old):
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md")), *sorted((ROOT / "examples").glob("*.py"))]
    teaching = [str(page.relative_to(ROOT)) for page in pages if re.search(rf"\b{re.escape(old)}\b", page.read_text())]
    assert not teaching, f"{teaching} show {old}, which warns and goes away: show {sorted(set(_kept(old)[1].values()))}"


def test_the_removal_check_fires_at_the_release_it_names():
    assert not _due("0.1.0", "0.2.0") and not _due("0.1.12", "0.2.0")
    assert _due("0.2.0", "0.2.0") and _due("0.2.0rc1", "0.2.0") and _due("0.2.1", "0.2.0") and _due("1.0", "0.2.0")
