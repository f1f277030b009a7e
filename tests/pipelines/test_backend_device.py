"""torch.compile(backend="amppass") applies profitability's device rule, in training and in inference.

On a CPU without bf16/fp16 instructions a plan for speed keeps every op fp32
(:func:`amppass.analysis.profitability.fp32_by_device`, the one function the backend and amppass.convert's train mode
call), so every graph dynamo hands over runs as it traced it, in fp32, with one warning per compile saying why;
``plan_for="coverage"`` converts anyway, and a CPU with the instructions converts. The CPU's flags are injected, so
every test holds on any CPU.
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


def _untraced_on_avx2(monkeypatch) -> None:
    """The CPU's flags say AVX2 only, and tracing a graph fails the test: the device alone decides."""
    avx2_cpu(monkeypatch)

    def refused(*args, **kwargs):
        raise AssertionError("traced, though the device alone decides the plan")

    monkeypatch.setattr(backend, "trace_aten", refused)


def _the_one_warning(caplog) -> str:
    """The compile's one warning (two graphs, one warning), saying why and how to convert anyway."""
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1, warned
    assert warned[0].startswith("torch.compile(backend='amppass'): profitability: ") and "in its ISA flags" in warned[0]
    assert "options={'plan_for': 'coverage'} converts it anyway" in warned[0] and "target='cuda'" not in warned[0]
    return warned[0]


def _kept_by_the_device(info: dict, mode: str) -> None:
    """The report of a compile whose every graph the device kept fp32."""
    assert info["dtype"] == "fp32" and info["graphs"] == 0 and info["mode"] == mode
    assert info["profitability"]["device"]["native_low"] is False
    assert info["profitability"]["decided"] == "before capture"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_train_plan_for_speed_on_an_avx2_cpu_runs_every_graph_as_traced_with_one_warning(dtype, monkeypatch,
                                                                                         caplog):
    _untraced_on_avx2(monkeypatch)
    with caplog.at_level("WARNING", logger="amppass"):
        compiled, model, reference = _trained({"dtype": dtype})
        with torch.no_grad():
            assert torch.equal(compiled(X), reference(X))  # the fp32 model's own ops
    # the same gradients as the fp32 model, exactly: nothing was converted
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name
    assert "a train-mode plan for speed" in _the_one_warning(caplog)
    info = amppass.report(compiled).info
    _kept_by_the_device(info, "train")
    # both graphs, and those of the no_grad call (dynamo's recompile for grad mode off): every one unconverted
    assert [u["graph"] for u in info["unconverted"]] == list(range(len(info["unconverted"]))) and len(
        info["unconverted"]) >= 2
    assert all("so nothing was captured" in u["reason"] and dtype in u["reason"] for u in info["unconverted"])


def test_the_backend_and_convert_decide_with_the_same_function(monkeypatch):
    """Rule 7 is profitability's fp32_by_device itself: the backend calls it once per compile and device, in
    either mode."""
    avx2_cpu(monkeypatch)
    calls = []
    real = backend.fp32_by_device

    def counted(*args, **kwargs):
        calls.append((args[3].plan_for, kwargs["mode"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, "fp32_by_device", counted)
    _trained({})
    _served({"compiler": "eager"})
    assert calls == [("speed", "train"), ("speed", "inference")]  # once per compile


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


def _served(options: dict) -> tuple[nn.Module, nn.Module]:
    """The model in eval mode compiled for inference (dtype bf16 unless ``options`` say), called once without
    grad: the compiled model and the model it wraps."""
    model = _model().eval()
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", **options})
    with torch.no_grad():
        compiled(X)
    return compiled, model


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_an_inference_plan_for_speed_on_an_avx2_cpu_runs_every_graph_as_traced_with_one_warning(dtype, monkeypatch,
                                                                                              caplog):
    _untraced_on_avx2(monkeypatch)
    with caplog.at_level("WARNING", logger="amppass"):
        compiled, model = _served({"dtype": dtype, "compiler": "eager"})
    with torch.no_grad():
        assert torch.equal(compiled(X), model(X))  # the fp32 model's own ops
    warned = _the_one_warning(caplog)
    assert "an inference-mode plan for speed" in warned and "runs in fp32 as it is" in warned
    assert "trains" not in warned
    info = amppass.report(compiled).info
    _kept_by_the_device(info, "inference")
    assert [u["graph"] for u in info["unconverted"]] == [0, 1]
    assert all(f"no op can run faster in {dtype} here, so nothing was captured" in u["reason"]
               for u in info["unconverted"])


def test_an_unconverted_inference_graph_is_what_plain_torch_compile_makes_of_it(monkeypatch, caplog):
    """Default options (inductor): every graph compiled as plain torch.compile compiles it, the same outputs."""
    _untraced_on_avx2(monkeypatch)
    with caplog.at_level("WARNING", logger="amppass"):
        compiled, model = _served({})
    plain = torch.compile(copy.deepcopy(model))
    with torch.no_grad():
        assert torch.equal(compiled(X), plain(X))
    _the_one_warning(caplog)
    _kept_by_the_device(amppass.report(compiled).info, "inference")


def test_an_inference_plan_for_speed_on_a_native_bf16_cpu_still_converts(monkeypatch):
    native_bf16_cpu(monkeypatch)
    compiled, model = _served({"compiler": "eager"})
    info = amppass.report(compiled).info
    assert info["graphs"] == 2 and info["unconverted"] == [] and "profitability" not in info
    assert {r.precision for r in amppass.report(compiled).rows if r.op == "aten.linear"} == {"bf16"}
    with torch.no_grad():
        reference = model(X)
        assert (compiled(X) - reference).norm() / reference.norm() < 5e-2


def test_coverage_converts_an_inference_compile_on_an_avx2_cpu(monkeypatch, caplog):
    avx2_cpu(monkeypatch)
    with caplog.at_level("WARNING", logger="amppass"):
        compiled, _ = _served({"compiler": "eager", "plan_for": "coverage"})
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    info = amppass.report(compiled).info
    assert info["graphs"] == 2 and info["unconverted"] == [] and "profitability" not in info
    assert {r.precision for r in amppass.report(compiled).rows if r.op == "aten.linear"} == {"bf16"}


def test_a_plan_for_the_backend_does_not_make_is_refused_naming_the_choices():
    compiled = torch.compile(_model(), backend=amppass_backend, options={"mode": "train", "plan_for": "memory"})
    with pytest.raises(Exception, match=r"plan_for='memory' is not one of \('speed', 'coverage'\)") as caught:
        compiled(X)
    assert "torch.compile(backend='amppass')" in str(caught.value)
