"""Hostile models for fp16: plain ``.half()``, torch.autocast and amppass (with and without calibration).

Each model has one spot that leaves fp16's range (overflow beyond 65504, or products that flush to zero
before a division) next to matrix products that are harmless in fp16. ``run()`` returns one row per
(model, method): the relative output error against fp32, whether the output is finite, and for amppass
how many matrix products stayed fp16.

    python -m benchmarks.hostile
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import amppass
from amppass.errors import first_line

D = 64


def _linear(d_in: int, d_out: int, scale: float) -> nn.Linear:
    layer = nn.Linear(d_in, d_out)
    with torch.no_grad():
        layer.weight.normal_(0.0, scale / math.sqrt(d_in))
        layer.bias.zero_()
    return layer


class ProjectionBeforeNorm(nn.Module):
    """A projection whose outputs reach ~1e5 (beyond 65504) feeds a LayerNorm, then a harmless head."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.head = _linear(D, D, 3e4), nn.LayerNorm(D), _linear(D, D, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.up(x)))


class HotAttention(nn.Module):
    """Attention logits q @ k^T reach ~1e5 before the softmax; the projections stay small."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.out = (_linear(D, D, s) for s in (100.0, 100.0, 1.0, 1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.q(x) @ self.k(x).transpose(-1, -2)
        return self.out(torch.softmax(logits, dim=-1) @ self.v(x))


class LongSum(nn.Module):
    """A sum over 8192 positive terms reaches ~1e5 and feeds a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = _linear(16, 16, 25.0), _linear(16, 8, 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.proj(x)).sum(dim=1))


class TinyRatio(nn.Module):
    """Squares of values ~1e-2 (around 1e-4, partly flushed to zero in fp16) are divided by each other."""

    def __init__(self) -> None:
        super().__init__()
        self.u, self.w, self.head = _linear(D, D, 1e-2), _linear(D, D, 1e-2), _linear(D, D, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, w = self.u(x), self.w(x)
        return self.head((u * u) / (w * w + 1e-7))


@dataclass
class HostileCase:
    """A hostile model, its input factory and how many matrix products must stay low precision."""

    name: str
    build: Callable[[], nn.Module]
    make_inputs: Callable[[int], tuple]
    harmless_matmuls: int


def _inputs(*shape: int) -> Callable[[int], tuple]:
    def make(seed: int) -> tuple:
        return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)),)

    return make


CASES = (
    HostileCase("projection>65504 before LayerNorm", ProjectionBeforeNorm, _inputs(4, 16, D), 1),
    HostileCase("attention logits>65504 before softmax", HotAttention, _inputs(4, 16, D), 4),
    HostileCase("sum over 8192 terms overflows", LongSum, _inputs(2, 8192, 16), 1),
    HostileCase("squares underflow before division", TinyRatio, _inputs(4, 16, D), 3),
)
MATMUL_OPS = ("aten.linear", "aten.matmul", "aten.mm", "aten.bmm", "aten.addmm")


def build(case: HostileCase) -> nn.Module:
    """The case's model with seeded weights, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return case.build().eval()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp32; inf when ``out`` holds inf or NaN."""
    out = out.float()
    if not bool(torch.isfinite(out).all()):
        return math.inf
    return float((out - ref).norm() / ref.norm())


def run_case(case: HostileCase, calibration_seeds: tuple[int, ...] = (1, 2, 3, 4), held_out: int = 10) -> list[dict]:
    """Rows for one case: fp32 reference against .half(), autocast, amppass and calibrated amppass."""
    model = build(case)
    inputs = case.make_inputs(held_out)
    with torch.no_grad():
        ref = model(*inputs)
    rows = []

    def row(method: str, produce: Callable[[], torch.Tensor], low_matmuls: int | None = None,
            note: str = "") -> None:
        try:
            with torch.no_grad():
                out = produce()
            error, finite = relative_error(out, ref), bool(torch.isfinite(out).all())
        except RuntimeError as err:  # e.g. an op without an fp16 CPU kernel
            error, finite, note = math.nan, False, f"failed: {first_line(err)}"
        rows.append({"model": case.name, "method": method, "rel_error": error, "finite": finite,
                     "low_matmuls": low_matmuls, "harmless_matmuls": case.harmless_matmuls, "note": note})

    half = copy.deepcopy(model).half()
    row(".half()", lambda: half(*(t.half() for t in inputs)))

    def autocast() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return model(*inputs)

    row("torch.autocast fp16", autocast)
    for method, calibration in (("amppass fp16", None),
                                ("amppass fp16 + calibration", [case.make_inputs(s) for s in calibration_seeds])):
        # the numerics of an fp16 plan (what a GPU computes): no profitability, which would keep every op fp32
        # on this CPU, whose fp16 kernels are slower than fp32
        fast = amppass.convert(model, case.make_inputs(0), torch.float16, calibration=calibration,
                               plan_for="coverage")
        report = amppass.report(fast)
        low = sum(1 for r in report.rows if r.op in MATMUL_OPS and r.precision == "fp16")
        fired = sorted({r.evidence.get("rule") for r in report.rows if r.source == "calibration"} - {None})
        row(method, functools.partial(fast, *inputs), low, ", ".join(fired))
    return rows


QUICK = CASES[:1]  # --quick: the projection overflowing before a LayerNorm (benchmarks/checks holds every case)


def run(quick: bool = False) -> list[dict]:
    """Every hostile case (``quick``: :data:`QUICK`), every method."""
    return [r for case in (QUICK if quick else CASES) for r in run_case(case)]


def table(rows: list[dict]) -> str:
    """Plain-text table of :func:`run`'s rows."""
    lines = [f"{'model':<40} {'method':<28} {'rel error':>10} finite  fp16 matmuls  rules/notes"]
    for r in rows:
        low = "" if r["low_matmuls"] is None else f"{r['low_matmuls']}/{r['harmless_matmuls']}+"
        lines.append(f"{r['model']:<40} {r['method']:<28} {r['rel_error']:>10.2e} {str(r['finite']):<7} "
                     f"{low:<13} {r['note']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()))
