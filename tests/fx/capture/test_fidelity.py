"""A captured graph that does not compute what the model computes is refused, not converted
(amppass.fx.capture.fidelity).

torch.export runs the model's Python once, and a model can see it is being traced and take another path there
(transformers' PaliGemma: hidden states 0.1 from its own, in fp32, before any conversion). Each test fails on the
code before the check, where convert returned the other path's answer in mixed precision without a word.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from amppass import CaptureError
from amppass.fx.capture import fidelity


class TracedOtherwise(nn.Module):
    """Scales its output by 2 when torch.export traces it: the captured graph is not the model."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y * 2 if torch.compiler.is_exporting() else y


class Sampling(nn.Module):
    """Adds noise in eval mode too (a sampler): its own two calls differ, so the capture cannot be judged."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x) + torch.randn(x.shape[0], 8)


class Counting(nn.Module):
    """Scales by how often it was called (a Python counter torch.export bakes in): no two eager calls agree."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.count = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.linear(x) * self.count


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def test_a_model_that_takes_another_path_under_torch_export_converts_by_parts_naming_the_output():
    """The whole graph computes twice the model's answer: refused, and the model converts by parts (its linear
    layer captured alone), whose answer is the model's."""
    model = TracedOtherwise().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(CaptureError, match=r"TracedOtherwise does not compute what TracedOtherwise computes.*"
                                           r"output 0 \(of 1 tensors\) differs from the model's by 1 "):
        fidelity.check_fidelity(model, _captured(model, x), (x,), {})
    converted = amppass.convert(model, (x,), dtype="bf16", plan_for="coverage")
    why = amppass.report(converted).info["parts"]["why_whole"]
    assert "does not compute what TracedOtherwise computes" in why
    assert rel(converted(x), model(x)) < 2e-2
    trained = amppass.convert(model.train(), (x,), dtype="fp16", mode="train", plan_for="coverage")
    assert "before any conversion" in amppass.report(trained).info["parts"]["why_whole"]
    assert rel(trained.eval()(x), model.eval()(x)) < 2e-2


def test_a_faithful_capture_passes_and_the_models_buffers_stay_as_they_were():
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    converted = amppass.convert(model, (x,), dtype="bf16", plan_for="coverage")
    assert rel(converted(x), model(x)) < 2e-2


def test_a_model_whose_own_calls_differ_is_not_judged_and_keeps_its_buffers():
    model = Sampling().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    captured = _captured(model, x)
    calls = float(model.calls)
    assert fidelity._draws_random(captured)
    fidelity.check_fidelity(model, captured, (x,), {})  # no error: the graph's draws are its own
    assert float(model.calls) == calls  # the check's calls put the model's buffer back


def test_a_model_whose_eager_calls_differ_without_drawing_random_numbers_is_not_judged():
    model = Counting().eval()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    captured = _captured(model, x)
    assert not fidelity._draws_random(captured)
    fidelity.check_fidelity(model, captured, (x,), {})  # the graph is one of the model's answers: not judged


def _captured(model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    from amppass.fx.capture.export import capture

    return capture(model, (x,), None, train=False)


def test_paligemma_captured_by_torch_export_is_refused_and_converts_by_parts():
    pytest.importorskip("transformers")
    from tests.conformance import zoo_harness

    built = zoo_harness.build("PaliGemmaModel", "base", "paligemma")
    with torch.no_grad():
        before = built.model(**built.inputs).last_hidden_state
    fast = amppass.convert(built.model, example_kwargs=built.inputs, dtype="bf16", plan_for="coverage")
    why_whole = amppass.report(fast).info["parts"]["why_whole"]
    assert "PaliGemmaModel does not compute what PaliGemmaModel computes" in why_whole
    with torch.no_grad():
        assert torch.equal(built.model(**built.inputs).last_hidden_state, before)  # the caller's model untouched
        got = fast(**built.inputs).last_hidden_state
    assert rel(got, before) < 2e-2  # the whole graph's answer was 0.0998 away
