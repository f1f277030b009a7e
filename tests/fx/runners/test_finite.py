"""The conversion runs the example call and catches outputs that go inf or NaN in low precision where fp32's are
finite: it names the output and the first node that went non-finite, and keeps that node fp32 where that fixes it.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

import amppass
from amppass.fx.capture.export import capture
from amppass.fx.runners.finite import non_finite

FP16_TOLERANCE = 1e-2  # relative L2 error of two fp16 matrix products on values of a few thousand


class Overflow(nn.Module):
    """A square of values up to ~1e4 (fine in fp16) reaches ~1e8, beyond fp16's 65504; fp32 holds it.

    No static rule sees it (no constant or weight is out of range): only running the example shows it."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = self.a(x) * 3000.0
        return self.b(big * big)


def _case() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Overflow().eval(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def test_overflowing_node_is_kept_fp32_with_its_reason(caplog):
    model, x = _case()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        fast = amppass.convert(model, (x,), dtype="fp16", plan_for="coverage", target="cpu")
    with torch.no_grad():
        out, ref = fast(x), model(x)
        fresh = torch.randn(6, 8, generator=torch.Generator().manual_seed(2))
        fresh_out = fast(fresh)
    assert torch.isfinite(out).all() and torch.isfinite(fresh_out).all()
    assert float((out - ref).norm() / ref.norm()) < FP16_TOLERANCE
    report = amppass.report(fast)
    # the square overflows first; kept fp32, its value then overflows the cast to fp16 its reader needed
    assert report.info["non_finite"] == {"kept_fp32": ["mul_1", "linear_1"]}
    rows = {r.name: r for r in report.rows}
    for name in ("mul_1", "linear_1"):
        assert rows[name].precision == "fp32"
        assert "goes inf or NaN on the example inputs where fp32's is finite" in rows[name].reason
    assert rows["linear"].precision == "fp16"  # nothing else moved
    assert "kept fp32: mul_1, linear_1" in caplog.text


def test_a_node_forced_low_is_named_not_moved(caplog):
    model, x = _case()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        fast = amppass.convert(model, (x,), dtype="fp16", plan_for="coverage", target="cpu", force_low=["^mul_1$"])
    info = amppass.report(fast).info["non_finite"]
    assert info == {"output": "output 0 (node 'linear_1')", "node": "mul_1", "kept_fp32": []}
    assert "output 0 (node 'linear_1') is inf or NaN" in caplog.text and "starts at node 'mul_1'" in caplog.text


def test_outputs_non_finite_in_fp32_too_are_not_flagged():
    class AlreadyInf(nn.Module):
        def forward(self, x):
            return torch.nn.functional.linear(x, torch.ones(4, 4)) / 0.0

    x = torch.ones(2, 4)
    gm = capture(AlreadyInf(), (x,), None, train=False)
    assert non_finite(gm, gm, [x]) is None
    fast = amppass.convert(AlreadyInf(), (x,), dtype="fp16", plan_for="coverage", target="cpu")
    assert "non_finite" not in amppass.report(fast).info


def test_bf16_conversion_of_the_same_model_needs_nothing():
    model, x = _case()
    fast = amppass.convert(model, (x,), dtype="bf16", plan_for="coverage")
    assert "non_finite" not in amppass.report(fast).info


def test_the_compile_backend_checks_each_graph_s_example_call(caplog):
    """torch.compile(backend='amppass') runs dynamo's example inputs through fp32 and the converted graph, as
    convert does, and keeps the overflowing nodes fp32, naming them with their graph."""
    model, x = _case()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        compiled = torch.compile(model, backend="amppass", options={"dtype": "fp16", "compiler": "eager",
                                                                     "plan_for": "coverage"})
        with torch.no_grad():
            out, ref = compiled(x), model(x)
    torch._dynamo.reset()
    assert torch.isfinite(out).all() and float((out - ref).norm() / ref.norm()) < FP16_TOLERANCE
    report = amppass.report(compiled)
    assert report.info["non_finite"] == [{"graph": 0, "kept_fp32": ["g0.mul_1", "g0.linear_1"]}]
    rows = {r.name: r for r in report.rows}
    assert "goes inf or NaN on the example inputs" in rows["g0.mul_1"].reason
    assert rows["g0.linear"].precision == "fp16"
