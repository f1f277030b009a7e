"""Tolerance-search time on the zoo's models, for one or several checkouts.

Each model is converted by the FX path to fp16 for the CPU (``plan_for="coverage"``: no profitability
timings, so the time is calibration and search alone) without calibration, then with 4 calibration batches
(seeds 1-4) and ``tolerance=1e-4``, below the all-fp16 error of every model here. Columns:

- ``candidates``: nodes the plain plan runs in fp16 (what the search ranks);
- ``plain_s``: the conversion without calibration (the second of two: the first warms torch.export up);
  ``tolerance_s``: with calibration and the search; ``calibration_s``: the calibration pass (the report's);
  ``search_s``: ``tolerance_s - plain_s - calibration_s``, the search's own time, computed the same way for
  every checkout;
- ``runs``: runs of the model over the batches the search made; ``max_runs``: the bound the checkout
  documents (``amppass.analysis.calibration.max_runs``; ``-`` where it has none);
- ``moved``, ``achieved_error``, ``held_out_error`` (``-`` where the checkout holds nothing out),
  ``reused``: the share of node runs started from kept fp32 values (``amppass.fx.runners.trial_runs``).

``--quick`` measures the small CNN of this checkout alone, in the benchmark run's own process.

``python -m benchmarks.tolerance_time [--full] [--root CHECKOUT ...]`` measures each checkout's amppass in a
fresh process (default: this one), so before/after tables come from one run; ``--quick`` (the default) uses
the small zoo, ``--full`` the real-sized models (BERT-base, ViT-Base/16, ResNet-50-like, MobileNetV3,
the constant-Q audio classifier).
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

try:
    from . import checkouts
except ImportError:  # run as a script in another checkout's process (--measure): this folder is on sys.path
    import checkouts

BEFORE = "d7ec324"  # amppass before the held-out check, prefix reuse and run bound
TOLERANCE = 1e-4  # below fp16's output error on every model here: the search has nodes to move
SEEDS = (1, 2, 3, 4)


def _zoo(name: str, size: str) -> Callable[[], Any]:
    def build() -> Any:
        from models import build as build_zoo

        return build_zoo(name, size)

    return build


def _arch(name: str) -> Callable[[], Any]:
    def build() -> Any:
        from models.arch import build_arch

        return build_arch(name, batch=1)

    return build


# name -> (builder of a case with .model, .example_inputs, .make_inputs(seed); only with --full)
MODELS: dict[str, tuple[Callable[[], Any], bool]] = {
    "cnn (small)": (_zoo("cnn", "small"), False),
    "bert (small)": (_zoo("bert", "small"), False),
    "resnet (base)": (_zoo("resnet", "base"), True),
    "bert (base)": (_zoo("bert", "base"), True),
    "vit (base)": (_zoo("vit", "base"), True),
    "mobilenet_v3_small": (_arch("mobilenet_v3_small"), True),
    "audio_cqt": (_arch("audio_cqt"), True),
}

QUICK = ("cnn (small)",)  # python -m benchmarks run --quick
NOTES = __doc__.split("\n\n", 1)[1].split("``python -m")[0].strip()


def measure(name: str) -> dict[str, Any]:
    """One row for the amppass this process imports."""
    import amppass

    warnings.filterwarnings("ignore")
    logging.getLogger("amppass").setLevel(logging.ERROR)
    case = MODELS[name][0]()
    for _ in range(2):
        start = time.perf_counter()
        plain = amppass.convert(case.model, case.example_inputs, torch.float16, plan_for="coverage")
        plain_s = time.perf_counter() - start
    candidates = sum(r.precision == "fp16" for r in amppass.report(plain).rows)
    start = time.perf_counter()
    fast = amppass.convert(case.model, case.example_inputs, torch.float16, plan_for="coverage",
                           calibration=[case.make_inputs(s) for s in SEEDS], tolerance=TOLERANCE)
    tolerance_s = time.perf_counter() - start
    info = amppass.report(fast).info
    try:
        from amppass.analysis.calibration import max_runs
        bound: Any = max_runs(candidates)
    except ImportError:
        bound = "-"
    held = info.get("held_out_error")
    return {
        "model": name, "candidates": candidates, "plain_s": round(plain_s, 2), "tolerance_s": round(tolerance_s, 2),
        "calibration_s": info["calibration_seconds"],
        "search_s": round(tolerance_s - plain_s - info["calibration_seconds"], 2),
        "runs": info["tolerance_runs"], "max_runs": bound, "moved": info["moved_by_tolerance"],
        "achieved_error": f"{info['achieved_error']:.2e}", "held_out_error": "-" if held is None else f"{held:.2e}",
        "reused": info.get("tolerance_reused", "-"),
    }


def run(full: bool, roots: list[Path] | None = None) -> list[dict[str, Any]]:
    """One row per model and checkout (default: this checkout, in this process)."""
    names = [n for n, (_, heavy) in MODELS.items() if full == heavy]
    return checkouts.run(str(Path(__file__)), measure, names, roots)


def against(commit: str, full: bool) -> list[dict[str, Any]]:
    """One row per model for amppass at ``commit`` and for this checkout, each measured in a fresh process."""
    names = [n for n, (_, heavy) in MODELS.items() if full == heavy]
    return checkouts.against(str(Path(__file__)), measure, names, commit)


def main() -> None:
    checkouts.main(__doc__.splitlines()[0], measure, run, "the real-sized models instead of the small zoo")


if __name__ == "__main__":
    main()
