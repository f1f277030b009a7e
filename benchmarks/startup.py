"""How long the command line takes to answer ``--help``, and ``import amppass``, for one or several checkouts.

Each figure is the median of 7 fresh Python processes (wall time of the whole process, interpreter start-up
included), the checkouts' runs interleaved: ``amppass --help`` (``amppass.cli.main(["--help"])``, what the
installed command runs) and a bare ``import amppass``. ``--quick`` measures ``import amppass``
of this checkout alone. ``python -m benchmarks run --full --only startup``
measures e70efd1 (which imported torch, onnx and every pipeline at start-up) and this checkout.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

try:
    from . import checkouts
except ImportError:  # run as a script in another checkout's process (--measure): this folder is on sys.path
    import checkouts

BEFORE = "e70efd1"  # amppass when it imported torch, onnx and every pipeline at start-up
NOTES = __doc__.split("\n\n", 1)[1].split("``python -m")[0].strip()
RUNS = 7
QUICK = ("import amppass",)  # python -m benchmarks run --quick
CODE = {"amppass --help": "from amppass.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
        "import amppass": "import amppass"}


def _seconds(code: str) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the checkout this process imports
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def measure(name: str) -> dict[str, Any]:
    """One row for the amppass this process imports: ``name``'s median wall time over :data:`RUNS` processes."""
    times = [_seconds(CODE[name]) for _ in range(RUNS)]
    return {"command": name, "median_s": round(statistics.median(times), 3), "min_s": round(min(times), 3)}


def run(full: bool, roots: list[Path] | None = None) -> list[dict[str, Any]]:
    """One row per command and checkout (default: this checkout, in this process)."""
    return checkouts.run(str(Path(__file__)), measure, list(CODE), roots)


def against(commit: str, full: bool) -> list[dict[str, Any]]:
    """One row per command for amppass at ``commit`` and for this checkout."""
    return checkouts.against(str(Path(__file__)), measure, list(CODE), commit)


def main() -> None:
    checkouts.main(__doc__.splitlines()[0], measure, run, "(no heavier set)")


if __name__ == "__main__":
    main()
