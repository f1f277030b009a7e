"""The README's install runs the README's example: a newcomer's first two commands work as written.

The docs test (tests/test_docs.py) runs the README where ``[test]`` is installed, so it cannot see an example
that needs a package only the test extras bring (``pip install -e .`` then ``from models import build`` once
failed with ``No module named 'transformers'``). Here the README's first Python block runs in a subprocess
whose import system finds only what the README's install line installs:

1. The install block is read from README.md: its ``pip install`` lines name torch and amppass with extras.
2. The distributions that install brings are amppass's requirements (pyproject.toml: the dependencies plus
   the extras the README names), and theirs, transitively, from the installed metadata; with pip, setuptools
   and wheel, which a fresh virtual environment has.
3. Every other installed distribution (the test extras and all they bring, torchaudio from scripts/setup,
   anything else in this environment) is hidden: a finder wraps each of ``sys.meta_path``'s finders and finds
   neither its modules nor its metadata, so ``import`` raises ModuleNotFoundError and
   ``importlib.util.find_spec`` / ``importlib.metadata`` answer as where it is not installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers.docs import blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FRESH_VENV = ("pip", "setuptools", "wheel")  # what `python -m venv` gives before the README's commands

# Runs in the subprocess: hide what the install does not bring, then run the README's block. argv: a JSON
# object with the import names and distribution names to hide, and the code.
_BOOT = r'''
import importlib.abc, json, re, sys

given = json.loads(sys.argv[1])
# a module a .pth file of this environment imported at start-up is there already: it cannot be hidden
modules = set(given["modules"]) - {m.partition(".")[0] for m in sys.modules}
dists = set(given["dists"])


def _canonical(name):
    return re.sub(r"[-_.]+", "-", name or "").lower()


class NotInstalled(importlib.abc.MetaPathFinder):
    """One of sys.meta_path's finders, blind to the hidden packages' modules and metadata."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in modules or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        found = getattr(self.finder, "find_distributions", None)
        for dist in found(*args, **kwargs) if found else ():
            if _canonical(dist.metadata["Name"]) not in dists:
                yield dist

    def invalidate_caches(self):
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


sys.meta_path[:] = [NotInstalled(finder) for finder in sys.meta_path]
import models

build = models.build
# BERT-small for BERT-base: the same classes, imports and conversion, a fraction of the time
models.build = lambda name, size="base", **kw: build(name, "small", **kw)
exec(compile(given["code"], given["where"], "exec"), {"__name__": "__main__"})
leaked = sorted({m.partition(".")[0] for m in sys.modules} & modules)
assert not leaked, f"hidden packages imported: {leaked}"
print("README example ran")
'''


def _install_lines() -> list[str]:
    """The README's install commands: the first bash block that runs ``pip install``."""
    for block in blocks(README):
        if block.language == "bash" and "pip install" in block.code:
            return [line.split("#", 1)[0].strip() for line in block.code.splitlines() if "pip install" in line]
    raise AssertionError("README.md: no ```bash block with the pip install commands")


def _readme_extras(lines: list[str]) -> set[str]:
    """The extras the README installs amppass with: ``pip install -e ".[zoo]"`` -> {"zoo"}."""
    project = [line for line in lines if re.search(r"pip install (-e )?[\"']?\.", line)]
    assert len(project) == 1, f"README.md: one `pip install -e .` line expected, found {lines}"
    extras = re.search(r"\.\[([\w,\- ]+)\]", project[0])
    return {canonicalize_name(e) for e in extras.group(1).split(",")} if extras else set()


def _closure(requirements: list[tuple[str, set[str]]]) -> set[str]:
    """The installed distributions ``requirements`` (name, extras) bring, themselves included, transitively."""
    found: set[str] = set()
    done: set[tuple[str, frozenset[str]]] = set()
    queue = list(requirements)
    while queue:
        name, extras = queue.pop()
        name = canonicalize_name(name)
        try:
            needs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional need not installed here
        if (name, frozenset(extras)) in done:
            continue
        done.add((name, frozenset(extras)))
        found.add(name)
        for text in needs:
            requirement = Requirement(text)
            wanted = any(requirement.marker is None or requirement.marker.evaluate({"extra": extra})
                         for extra in {"", *extras})
            if wanted:
                queue.append((requirement.name, set(requirement.extras)))
    return found


def _installed_by_readme() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = _install_lines()
    extras = _readme_extras(lines)
    optional = {canonicalize_name(k): v for k, v in project["optional-dependencies"].items()}
    assert extras <= set(optional), f"README.md installs extras {sorted(extras - set(optional))} pyproject.toml lacks"
    texts = list(project["dependencies"])
    pending, seen = list(extras), set()
    while pending:  # an extra may name amppass's own extras ("amppass[zoo]")
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for text in optional[extra]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == "amppass":
                pending.extend(canonicalize_name(e) for e in requirement.extras)
            else:
                texts.append(text)
    named = [(Requirement(t).name, set(Requirement(t).extras)) for t in texts]
    named += [(w.split("==")[0], set()) for line in lines for w in line.split() if re.match(r"torch(==|$)", w)]
    return _closure(named + [(name, set()) for name in FRESH_VENV]) | {"amppass"}


def _hidden(installed: set[str]) -> tuple[set[str], set[str]]:
    """(import names, distribution names) of what is installed here and not by the README."""
    providers = importlib.metadata.packages_distributions()
    modules = {module for module, dists in providers.items()
               if module.isidentifier() and not {canonicalize_name(d) for d in dists} & installed}
    dists = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()} - installed
    return modules - set(sys.stdlib_module_names) - {"models", "tests", "amppass"}, dists


def test_the_readme_install_line_brings_what_the_zoo_imports():
    installed = _installed_by_readme()
    assert "transformers" in installed, "README.md's install does not bring transformers, which models/zoo.py needs"
    modules, dists = _hidden(installed)
    assert {"pytest", "hypothesis", "peft", "torchvision"} <= modules, "the test extras are hidden"
    assert "transformers" not in modules and "torch" not in modules


def test_the_readme_example_runs_with_only_what_the_readme_installs(tmp_path):
    example = next(b for b in blocks(README) if b.language == "python" and not b.not_run)
    modules, dists = _hidden(_installed_by_readme())
    given = json.dumps({"modules": sorted(modules), "dists": sorted(dists), "code": example.code,
                        "where": f"README.md:{example.line}"})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the README runs from the root, nothing else
    done = subprocess.run([sys.executable, "-c", _BOOT, given], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "README example ran" in done.stdout


def test_the_simulation_refuses_a_test_only_package():
    """The check above can fail: under the same finder, a package only [test] brings is not there."""
    modules, dists = _hidden(_installed_by_readme())
    probe = ("import importlib.util, importlib.metadata\n"
             "assert importlib.util.find_spec('hypothesis') is None\n"
             "try:\n    importlib.metadata.version('hypothesis')\nexcept importlib.metadata.PackageNotFoundError:\n"
             "    pass\nelse:\n    raise AssertionError('metadata seen')\n"
             "import hypothesis\n")
    boot = _BOOT.split("import models\n", 1)[0] + probe
    done = subprocess.run(
        [sys.executable, "-c", boot, json.dumps({"modules": sorted(modules), "dists": sorted(dists)})],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "ModuleNotFoundError: No module named 'hypothesis'" in done.stderr, done.stderr



def test_export_onnx_runs_with_only_what_the_readme_installs():
    """main: onnxscript came with the test extra only, so after the README's install export_onnx failed in both
    exporters and told the user to use amppass.convert. scripts/readme_export.py (an export, the file loaded and run
    in onnxruntime) is what scripts/readme_install runs in CI's fresh venv; here it runs with what the README's
    install does not bring hidden."""
    modules, dists = _hidden(_installed_by_readme())
    assert "onnxscript" not in modules, "the README's install does not bring onnxscript, which export_onnx needs"
    script = ROOT / "scripts" / "readme_export.py"
    given = json.dumps({"modules": sorted(modules), "dists": sorted(dists), "code": script.read_text(),
                        "where": str(script)})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", _BOOT, given], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "export_onnx: ok" in done.stdout and "exporter failed" not in done.stderr, done.stderr[-4000:]
