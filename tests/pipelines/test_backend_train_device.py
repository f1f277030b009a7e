"""torch.compile(backend="amppass") in train mode applies profitability's device rule as amppass.convert does.

On a CPU without bf16/fp16 instructions a train-mode plan for speed keeps every op fp32
(:func:`amppass.analysis.profitability.fp32_by_device`, the one function both entry points call), so every graph
dynamo hands over runs as it traced it, in fp32, with one warning per compile saying why; ``plan_for="coverage"``
converts anyway. The CPU's flags are injected, so every test holds on any CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amppass
from amppass.pipelines import backend
from amppass.pipelines.backend import amppass_backend
from tests.helpers.load import avx2_cpu, native_bf16_cpu
from tests.helpers.small_models import Split


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> nn.Module:
    """Two linear stages with a graph break between them: dynamo hands the backend two graphs."""
    torch.manual_seed(0)
    return Split().train()


X = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))


def _trained(options: dict) -> tuple[nn.Module, nn.Module, nn.Module]:
    """One backward through the compiled model (eager compiler) and through an fp32 copy of it: the compiled
    model, the model it wraps, the copy."""
    model = _model()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", "mode": "train",
                                                                       "compiler": "eager", **options})
    compiled(X).square().mean().backward()
    reference(X).square().mean().backward()
    return compiled, model, reference


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_train_plan_for_speed_on_an_avx2_cpu_runs_every_graph_as_traced_with_one_warning(dtype, monkeypatch,
                                                                                         caplog):
    avx2_cpu(monkeypatch)

    def refused(*args, **kwargs):
        raise AssertionError("traced, though the device alone decides the plan")

    monkeypatch.setattr(backend, "trace_aten", refused)
    with caplog.at_level("WARNING", logger="amppass"):
        compiled, model, reference = _trained({"dtype": dtype})
        with torch.no_grad():
            assert torch.equal(compiled(X), reference(X))  # the fp32 model's own ops
    # the same gradients as the fp32 model, exactly: nothing was converted
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, warned  # two graphs, one warning for the compile
    assert warned[0].startswith("torch.compile(backend='amppass'): profitability: ") and "in its ISA flags" in warned[0]
    assert "options={'plan_for': 'coverage'}" in warned[0] and "target='cuda'" not in warned[0]
    info = amppass.report(compiled).info
    assert info["dtype"] == "fp32" and info["graphs"] == 0 and info["mode"] == "train"
    # both graphs, and those of the no_grad call (dynamo's recompile for grad mode off): every one unconverted
    assert [u["graph"] for u in info["unconverted"]] == list(range(len(info["unconverted"]))) and len(
        info["unconverted"]) >= 2
    assert all("so nothing was captured" in u["reason"] and dtype in u["reason"] for u in info["unconverted"])
    assert info["profitability"]["device"]["native_low"] is False
    assert info["profitability"]["decided"] == "before capture"


def test_the_backend_and_convert_decide_with_the_same_function(monkeypatch):
    """Rule 7 is profitability's fp32_by_device itself: the backend calls it once per compile and device."""
    avx2_cpu(monkeypatch)
    calls = []
    real = backend.fp32_by_device

    def counted(*args, **kwargs):
        calls.append(args[3].plan_for)
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "fp32_by_device", counted)
    _trained({})
    assert calls == ["speed"]


def test_coverage_still_converts_every_graph_on_an_avx2_cpu(monkeypatch, caplog):
    avx2_cpu(monkeypatch)
    with caplog.at_level("WARNING", logger="amppass"):
        compiled, model, reference = _trained({"plan_for": "coverage"})
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    info = amppass.report(compiled).info
    assert info["graphs"] == 2 and info["unconverted"] == [] and "profitability" not in info
    assert {r.precision for r in amppass.report(compiled).rows if r.op == "aten.linear"} == {"bf16"}
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float32 and (p.grad - q.grad).norm() / q.grad.norm() < 5e-2, name


def test_a_train_plan_for_speed_on_a_native_bf16_cpu_still_converts(monkeypatch):
    native_bf16_cpu(monkeypatch)
    compiled, _, _ = _trained({})
    info = amppass.report(compiled).info
    assert info["graphs"] == 2 and info["unconverted"] == []
    assert {r.precision for r in amppass.report(compiled).rows if r.op == "aten.linear"} == {"bf16"}


def test_inference_is_planned_as_before_on_an_avx2_cpu(monkeypatch):
    """The rule is a train-mode rule: an inference compile converts its graphs as it did."""
    avx2_cpu(monkeypatch)
    compiled = torch.compile(_model().eval(), backend=amppass_backend, options={"dtype": "bf16", "compiler": "eager"})
    with torch.no_grad():
        compiled(X)
    assert amppass.report(compiled).info["graphs"] == 2


def test_a_plan_for_the_backend_does_not_make_is_refused_naming_the_choices():
    compiled = torch.compile(_model(), backend=amppass_backend, options={"mode": "train", "plan_for": "memory"})
    with pytest.raises(Exception, match=r"plan_for='memory' is not one of \('speed', 'coverage'\)") as caught:
        compiled(X)
    assert "torch.compile(backend='amppass')" in str(caught.value)
