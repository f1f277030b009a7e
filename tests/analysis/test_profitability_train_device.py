"""A train-mode plan for speed on a CPU without bf16/fp16 instructions: the original, in fp32, decided before capture.

There a low-precision kernel converts to fp32 and back around every operation, so training in bf16 or fp16 is
slower than in fp32 and profitability's device rule keeps every op fp32 (:mod:`amppass.analysis.profitability`,
rules 2 and 5). Decided from the CPU's flags alone, nothing is captured: ``convert(..., mode="train")`` returns the
original kept in fp32 with weights of its own, and its report says why and what converts anyway. The CPU's flags
are injected, so every test holds on any CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import CaptureError
from amppass.pipelines import convert as convert_module
from amppass.serving.fp32_original import Fp32Original
from amppass.serving.train_eval import TrainEvalGraphs
from tests.helpers.load import avx2_cpu, native_bf16_cpu

X = (torch.randn(8, 64, generator=torch.Generator().manual_seed(0)),)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.0), nn.Linear(128, 64), nn.LayerNorm(64))


@pytest.fixture
def no_capture(monkeypatch):
    """A capture fails the test: the device decides before anything is captured."""

    def refused(*args, **kwargs):
        raise AssertionError("captured, though the device alone decides the plan")

    monkeypatch.setattr(convert_module, "capture", refused)


def _step(model: nn.Module) -> tuple[float, list[torch.Tensor]]:
    """One SGD step on the example: the loss and the gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(*X).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    return loss.item(), grads


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_train_plan_for_speed_on_an_avx2_cpu_is_the_original_in_fp32_without_capture(dtype, monkeypatch,
                                                                                       no_capture, caplog):
    avx2_cpu(monkeypatch)
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level("WARNING", logger="amppass"):
        kept = amppass.convert(model, X, dtype, mode="train")
    assert isinstance(kept, Fp32Original) and isinstance(kept, nn.Sequential)
    assert kept.training and all(m.training for m in kept.modules())  # trains as it came
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "Sequential" in warned[0] and "in its ISA flags" in warned[0], warned
    assert "plan_for='coverage'" in warned[0]
    report = amppass.report(kept)
    assert report.counts() == {"fp32": 1} and report.info["mode"] == "train" and report.info["casts"] == 0
    assert report.info["profitability"]["decided"] == "before capture"
    assert report.info["profitability"]["device"]["native_low"] is False
    lines = report.summary().splitlines()
    assert any(line.startswith(f"returned: your original module, in fp32, unchanged: this CPU has no {dtype} "
                               "instructions") for line in lines), lines
    advice = [line for line in lines if line.startswith("to convert it anyway: ")]
    assert len(advice) == 1 and "plan_for='coverage'" in advice[0] and "target='cuda'" in advice[0]
    assert "nothing was captured" in report.rows[0].reason and "?" not in report.summary()
    # it trains as the original does, exactly (the same fp32 ops), on weights of its own
    (loss, grads), (want_loss, want_grads) = _step(kept), _step(net())
    assert loss == want_loss and all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    assert not torch.equal(kept[0].weight, model[0].weight)  # the step wrote the kept copy's own weights
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key  # the caller's model is never written

def test_tied_weights_stay_tied_in_the_kept_copy(monkeypatch, no_capture):
    avx2_cpu(monkeypatch)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    model[1].weight = model[0].weight
    kept = amppass.convert(model, (torch.arange(6).view(2, 3),), "bf16", mode="train")
    assert isinstance(kept, Fp32Original)
    assert kept[0].weight is kept[1].weight and kept[0].weight is not model[0].weight


def test_a_train_plan_for_speed_on_a_native_bf16_cpu_still_runs_bf16(monkeypatch):
    native_bf16_cpu(monkeypatch)
    converted = amppass.convert(net(), X, "bf16", mode="train")
    assert isinstance(converted, TrainEvalGraphs)
    assert amppass.report(converted).counts().get("bf16", 0) > 0


@pytest.mark.parametrize("how", [{"plan_for": "coverage"}, {"force_low": ["linear"]}, {"costs": {}}])
def test_coverage_force_low_and_costs_still_make_a_plan_on_an_avx2_cpu(how, monkeypatch):
    avx2_cpu(monkeypatch)
    converted = amppass.convert(net(), X, "bf16", mode="train", **how)
    assert isinstance(converted, TrainEvalGraphs)
    assert amppass.report(converted).counts().get("bf16", 0) > 0


def test_bad_input_is_still_refused_first(monkeypatch):
    avx2_cpu(monkeypatch)
    with pytest.raises(amppass.errors.InputError, match="needs example_inputs"):
        amppass.convert(net(), mode="train")


def test_a_module_that_does_not_capture_trains_as_it_is(monkeypatch, no_capture):
    """Nothing is captured, so a model torch.export cannot take whole (sizes from data) trains too, with no
    conversion by parts."""
    avx2_cpu(monkeypatch)

    class Data(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(x)[: int(x.sum().item() > 0) + 1]

    kept = amppass.convert(Data(), (torch.ones(3, 4),), "bf16", mode="train")
    assert isinstance(kept, Fp32Original) and kept(torch.ones(3, 4)).shape == (2, 4)


def test_an_example_the_model_refuses_is_refused_as_a_capture_would(monkeypatch, no_capture):
    """Nothing is captured, yet a wrong example is still the one short CaptureError naming input, op and module; the
    check runs the model once and leaves the random number generator where it was (a dropout draw)."""
    avx2_cpu(monkeypatch)
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(4, 2))
    with pytest.raises(CaptureError) as caught:
        amppass.convert(model, (torch.ones(2, 5),), "bf16", mode="train")
    assert str(caught.value) == ("input 'input' of shape [2, 5] does not fit Sequential: linear (1) takes [*, 4], "
                                 "got [2, 5]")
    torch.manual_seed(0)
    state = torch.get_rng_state()
    amppass.convert(model, (torch.ones(2, 4),), "bf16", mode="train")
    assert torch.equal(torch.get_rng_state(), state)
