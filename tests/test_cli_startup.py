"""``amppass --help`` answers without importing torch (it took 3-4 s, torch's import, before any
help appeared).

``import amppass`` imports its public names on first use (PEP 562), and the command line imports numpy, onnx,
torch and the pipelines inside its commands. What a start-up imports is read from ``python -X importtime``,
not timed: the figure is in the commit message and the time, not the import list, is what varies.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "onnx", "onnxruntime", "numpy", "transformers")


def _imported(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``python -X importtime *args`` from the repository root; its result and the modules it imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    modules = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, modules


@pytest.mark.parametrize("argv", [["--help"], ["convert", "--help"], ["report", "--help"], ["--version"]],
                         ids=" ".join)
def test_help_does_not_import_torch(argv):
    done, modules = _imported("-m", "amppass", *argv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "amppass.cli" in modules  # the reading below is of the right process
    assert not modules & set(HEAVY), f"amppass {' '.join(argv)} imported {sorted(modules & set(HEAVY))}"
    assert "usage: amppass" in done.stdout or done.stdout.startswith("amppass ")


def test_a_usage_error_does_not_import_torch():
    done, modules = _imported("-m", "amppass", "convert", "model.onnx", "-o", "out.onnx", "--dtype", "fp4")
    assert done.returncode == 2 and "invalid choice: 'fp4'" in done.stderr
    assert not modules & set(HEAVY)


def test_import_amppass_imports_torch_only_when_a_function_is_used():
    code = ("import sys, amppass\n"
            "assert 'torch' not in sys.modules\n"
            "assert amppass.__version__ and 'convert' in dir(amppass)\n"
            "amppass.convert\n"
            "assert 'torch' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_amppass_report_is_the_function_whatever_was_imported_first():
    """Importing amppass.reporting.rows first (the CLI does) binds a submodule's name on the package; the public
    ``amppass.report`` is the function all the same."""
    code = ("import amppass.reporting.rows, amppass.reporting.terminal\n"
            "import amppass\n"
            "from amppass import report\n"
            "assert callable(amppass.report) and report is amppass.report, amppass.report\n"
            "assert amppass.report.__module__ == 'amppass.pipelines.report'\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_unknown_name_is_an_attribute_error():
    import amppass

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        amppass.nope  # noqa: B018


def test_the_cli_s_target_names_are_the_targets():
    """The CLI spells the target names (importing amppass.targets imports torch); they must stay the same."""
    from amppass import cli, targets

    assert cli.ONNX_TARGETS == targets.ONNX_TARGETS and cli.TORCH_TARGETS == targets.TORCH_TARGETS
