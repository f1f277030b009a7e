"""torch.compile(backend="amppass", options={"dtype": "fp8"}): each graph planned as amppass.convert plans fp8.

Inference and training, eager and inductor: the graph's products are the ones convert chooses, its outputs are
convert's (eager) and fp32's within fp8's rounding, gradients reach the fp32 master weights, an inference graph
whose weights change is planned again on the new ones, and a CPU without ``plan_for="coverage"`` is refused as
convert refuses it, naming the option.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import amppass
from amppass.fx.rewrite.fp8_train import fp8_train_linear
from amppass.pipelines.backend import amppass_backend, session_of

TRAIN_OP = fp8_train_linear._opoverload
E4M3_STEP = 2**-4  # e4m3's largest relative rounding error of one value (3 significand bits)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    logging.disable(logging.NOTSET)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 16))


def _products(report) -> dict[str, int]:
    return report.info["fp8"]["products"]


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_inference_runs_converts_fp8_plan_within_fp8_rounding_of_fp32(compiler):
    model, x = _net().eval(), torch.randn(16, 32)
    converted = amppass.convert(model, (x,), dtype="fp8", plan_for="coverage")
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "fp8", "plan_for": "coverage",
                                                                       "compiler": compiler})
    with torch.no_grad():
        out, expected, reference = compiled(x), converted(x), model(x)
    report = amppass.report(compiled)
    assert _products(report) == _products(amppass.report(converted)) and _products(report)["fp8"] == 4
    assert [row.name for row in report.fp8_rows() if row.precision == "fp8"] == ["g0.linear", "g0.linear_1",
                                                                                 "g0.linear_2", "g0.linear_3"]
    if compiler == "eager":
        assert torch.equal(out, expected)
    # each fp8 product moves the output by at most twice e4m3's step (both operands rounded)
    assert rel(out, reference) <= 4 * 2 * E4M3_STEP
    assert rel(out, expected) <= 2**-7  # inductor: a bf16 rounding or two of the products' sums, fused otherwise


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_an_inference_graph_whose_weight_changed_is_planned_again_on_it(compiler):
    """Its e4m3 weight copies and their scales came from the old weights: the graph must compute the changed
    model's fp8 plan, not the old one's (inductor: frozen, under no_grad, and compiled again)."""
    model, x = _net().eval(), torch.randn(16, 32)
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "fp8", "plan_for": "coverage",
                                                                       "compiler": compiler})
    with torch.no_grad():
        before = compiled(x)
        model[2].weight.mul_(-3.0)  # in place: its version counter moves
        after = compiled(x)
        assert torch.equal(compiled(x), after)  # planned once: the new plan is not a change again
        expected = amppass.convert(model, (x,), dtype="fp8", plan_for="coverage")(x)
    if compiler == "eager":
        assert torch.equal(after, expected)
    assert rel(after, expected) <= 2**-7 and rel(after, before) > 0.5
    assert amppass.report(compiled).info["graph_plans"][0]["refreshes"] == 1


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_training_runs_fp8_train_linear_and_gradients_reach_the_fp32_masters(compiler):
    model, x = _net().train(), torch.randn(16, 32)
    converted = amppass.convert(copy.deepcopy(model), (x,), dtype="fp8", mode="train", plan_for="coverage")
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "fp8", "mode": "train",
                                                                       "plan_for": "coverage", "compiler": compiler})
    out = compiled(x)
    out.float().square().mean().backward()
    converted(x).float().square().mean().backward()
    reference(x).square().mean().backward()
    plans = [graph.plan for graph in session_of(compiled).graphs]
    assert sum(n.target is TRAIN_OP for plan in plans for n in plan.graph.nodes) == 2  # the middle two
    assert _products(amppass.report(compiled)) == _products(amppass.report(converted))
    assert "not needed" in amppass.report(compiled).info["fp8"]["loss_scaling"]
    for (name, p), q, r in zip(model.named_parameters(), converted.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        if compiler == "eager":
            assert torch.equal(p.grad, q.grad), name
        assert rel(p.grad, r.grad) <= 4 * 2 * E4M3_STEP, name  # e4m3 and e5m2 (one bit fewer) operands, two layers
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # the graphs read the stepped fp32 masters
    with torch.no_grad():
        assert rel(compiled(x), model(x)) <= 2 * 2 * E4M3_STEP and rel(compiled(x), out) > 1e-3


def test_fp8_on_a_cpu_without_coverage_is_refused_naming_the_option():
    compiled = torch.compile(_net().eval(), backend=amppass_backend, options={"dtype": "fp8", "compiler": "eager"})
    with pytest.raises(Exception) as raised, torch.no_grad():
        compiled(torch.randn(16, 32))
    error = getattr(raised.value, "inner_exception", raised.value)
    assert isinstance(error, amppass.InputError)
    assert "options={'dtype': 'fp8'}" in str(error) and "plan_for='coverage'" in str(error)
    assert "dtype='bf16'" in str(error)
