"""Conversion time and the plan it gives, for one or several checkouts: a move of code must change neither.

Three conversions that exercise the pipelines' stages end to end without timing kernels (``plan_for="coverage"``),
so their plans depend on the code alone: the zoo's small CNN to bf16; an MLP ending in softmax to fp16 with four
calibration batches and ``tolerance=1e-3`` (the calibration template, its checkpoints and the tolerance search); the
same MLP exported to ONNX and converted by ``convert_onnx`` with the same batches. ``seconds`` is the median of three
conversions in one fresh process per checkout; ``plan`` is a digest of the report's rows (name, op, precision,
reason), equal where the plans are. ``--quick`` measures the two MLP conversions of this
checkout alone, in the benchmark run's own process.

``python -m benchmarks run --full --only conversion_time`` measures 71b06f8 (before the second floor's moves of this
round: profitability, policy kinds, the calibration template, onnx/io, the test tree) and this checkout.
"""

from __future__ import annotations

import hashlib
import io
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

try:
    from . import checkouts
except ImportError:  # run as a script in another checkout's process (--measure): this folder is on sys.path
    import checkouts

BEFORE = "71b06f8"
NOTES = __doc__.split("\n\n", 1)[1].split("``python -m")[0].strip()
CASES = ("fx cnn", "fx mlp calibrated", "onnx mlp calibrated")
QUICK = CASES[1:]  # python -m benchmarks run --quick: the CNN's capture alone costs more than both


def _digest(converted: Any) -> str:
    import amppass

    rows = [(r.name, r.op, r.precision, r.reason) for r in amppass.report(converted).rows]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:10]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                               torch.nn.Softmax(-1)).eval()


def _conversion(name: str) -> Callable[[], Any]:
    import amppass
    from models import build

    batches = [(torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) * 4,) for i in range(4)]
    if name == "fx cnn":
        case = build("cnn", "small")
        inputs = case.make_inputs(1)
        return lambda: amppass.convert(case.model, inputs, "bf16", plan_for="coverage")
    if name == "fx mlp calibrated":
        model = _mlp()
        return lambda: amppass.convert(model, batches[0], "fp16", plan_for="coverage", calibration=batches,
                                       tolerance=1e-3)
    import onnx

    buffer = io.BytesIO()
    torch.onnx.export(_mlp(), batches[0], buffer, dynamo=False, input_names=["x"])
    exported = onnx.load_from_string(buffer.getvalue())
    feeds = [{"x": b[0].numpy()} for b in batches]
    return lambda: amppass.convert_onnx(exported, "fp16", calibration=feeds, tolerance=1e-3)


def measure(name: str) -> dict[str, Any]:
    """One row for the amppass this process imports: ``name``'s median conversion time and its plan's digest."""
    warnings.filterwarnings("ignore")
    convert = _conversion(name)
    times, converted = [], None
    for _ in range(3):
        start = time.perf_counter()
        converted = convert()
        times.append(time.perf_counter() - start)
    return {"conversion": name, "seconds": round(statistics.median(times), 3), "plan": _digest(converted)}


def run(full: bool, roots: list[Path] | None = None) -> list[dict[str, Any]]:
    """One row per conversion and checkout (default: this checkout, in this process)."""
    return checkouts.run(str(Path(__file__)), measure, list(CASES), roots)


def against(commit: str, full: bool) -> list[dict[str, Any]]:
    """One row per conversion for amppass at ``commit`` and for this checkout, each in a fresh process."""
    return checkouts.against(str(Path(__file__)), measure, list(CASES), commit)


def main() -> None:
    checkouts.main(__doc__.splitlines()[0], measure, run, "(no heavier set)")


if __name__ == "__main__":
    main()
