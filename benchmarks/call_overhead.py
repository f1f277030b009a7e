"""What the module amppass.convert returns costs per call on top of its graph, for one or several checkouts.

Small models at batch 1 (a 3-layer MLP of width 64, a 2-layer LSTM, a 2-layer transformer encoder), bf16, one
thread, under ``torch.no_grad()``: the original's call, the call of the module ``plan_for="coverage"`` returns
(the graph always runs), and that graph's own call (``run_graph``, the compiled fx code the returned module
calls), in microseconds: medians of 30 interleaved rounds, each sample averaging ~20 ms of calls
(``benchmarks.latency.time_interleaved``). ``overhead_us`` = returned - graph alone: the guard check, the input
flattening and the output rebuild of every call. ``speed_plan`` is what the
default ``plan_for="speed"`` returned (the original's class where it kept the original) and ``speed_vs_original``
its call against the original's. ``--quick`` measures the MLP of this checkout alone, in
the benchmark run's own process.

``python -m benchmarks run --full --only call_overhead`` measures e70efd1 (before the call's fast path and the
kept original as the original's class) and this checkout, each in a fresh process.
"""

from __future__ import annotations

import statistics
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

try:
    from . import checkouts
except ImportError:  # run as a script in another checkout's process (--measure): this folder is on sys.path
    import checkouts

BEFORE = "e70efd1"  # amppass before the call's fast path and the kept original as the original's class
NOTES = __doc__.split("\n\n", 1)[1].split("``python -m")[0].strip()


def _mlp() -> tuple[torch.nn.Module, tuple]:
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return net.eval(), (torch.randn(4, 64),)


class _Lstm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = torch.nn.LSTM(32, 64, num_layers=2, batch_first=True), torch.nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.rnn(x)[0][:, -1])


def _lstm() -> tuple[torch.nn.Module, tuple]:
    return _Lstm().eval(), (torch.randn(1, 8, 32),)


def _encoder() -> tuple[torch.nn.Module, tuple]:
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), (torch.randn(1, 16, 64),)


MODELS: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
    "mlp 64, batch 4": _mlp, "lstm 2x64, batch 1": _lstm, "transformer encoder 2x64, batch 1": _encoder}
QUICK = ("mlp 64, batch 4",)  # python -m benchmarks run --quick


def measure(name: str) -> dict[str, Any]:
    """One row for the amppass this process imports."""
    import amppass
    from benchmarks.latency import time_interleaved  # this folder's parent is on the path in every checkout's run

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, args = MODELS[name]()
    with torch.no_grad():
        returned = amppass.convert(model, args, "bf16", plan_for="coverage")
        served = getattr(returned, "converted", returned)  # a drop-in holds the serving graph
        graph = served.run_graph
        speed = amppass.convert(model, args, "bf16")
        for call in (returned, speed, model):
            call(*args)
        samples = time_interleaved({"original": lambda: model(*args), "returned": lambda: returned(*args),
                                    "graph": lambda: graph(*args), "speed": lambda: speed(*args)}, 3, 10)
        original, whole, alone, fast = (statistics.median(samples[n]) * 1e6
                                        for n in ("original", "returned", "graph", "speed"))
    return {"model": name, "original_us": round(original, 1), "returned_us": round(whole, 1),
            "graph_alone_us": round(alone, 1), "overhead_us": round(whole - alone, 1),
            "speed_plan": type(speed).__name__, "speed_vs_original": round(fast / original, 3)}


def run(full: bool, roots: list[Path] | None = None) -> list[dict[str, Any]]:
    """One row per model and checkout (default: this checkout, in this process)."""
    return checkouts.run(str(Path(__file__)), measure, list(MODELS), roots)


def against(commit: str, full: bool) -> list[dict[str, Any]]:
    """One row per model for amppass at ``commit`` and for this checkout, each measured in a fresh process."""
    return checkouts.against(str(Path(__file__)), measure, list(MODELS), commit)


def main() -> None:
    checkouts.main(__doc__.splitlines()[0], measure, run, "(no heavier set: the models are the same)")


if __name__ == "__main__":
    main()
