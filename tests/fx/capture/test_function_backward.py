"""A model's own ``torch.autograd.Function`` backward is kept in training, never silently replaced.

torch.export captures a Function's forward and differentiates it: a straight-through estimator's ``round``
then has gradient zero, and YOSO's approximate backward is replaced by the exact one (a key bias's gradient
had cosine 0.90 with the model's). Train mode compares the captured graph's fp32 gradients with the model's
on the example and, where they differ, converts the model by parts, the Function running as the model's own
code; the compile backend runs the graph holding the Function as dynamo traced it, with its backward.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

import amppass
from tests.helpers.autograd_functions import Net, RoundSTE, function_input


class ExactExp(torch.autograd.Function):
    """exp with its exact derivative written by hand: nothing to lose."""

    @staticmethod
    def forward(ctx, x):
        y = torch.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


@pytest.mark.parametrize("train_only", [False, True])
def test_a_function_whose_backward_is_not_its_forwards_derivative_runs_as_itself_in_train_mode(train_only):
    """The whole model's graph would differentiate round(): the check finds it, and the model converts by parts
    (amppass.pipelines.parts), the Function applied by the model's own code between the converted layers."""
    torch.manual_seed(0)
    model = Net(RoundSTE, train_only).train()
    reference = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    mode = "train" if train_only else "eval"
    fast = amppass.convert(model, (function_input(),), "bf16", mode="train", plan_for="coverage")
    why = amppass.report(fast).info["parts"]["why_whole"]
    assert re.search(rf"applies .*RoundSTE .*\({mode} mode\) the gradient of fc1\.\w+", why), why
    fast(function_input()).square().mean().backward()
    reference(function_input()).square().mean().backward()
    grad, want = fast.fc1.weight.grad, reference.fc1.weight.grad
    assert want.norm() > 1e-2 and (grad - want).norm() / want.norm() < 0.05
    # the check and the conversion ran without touching the caller's model
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_function_with_its_exact_derivative_converts_and_trains_as_fp32_does():
    torch.manual_seed(0)
    model = Net(ExactExp).train()
    reference = copy.deepcopy(model)
    fast = amppass.convert(model, (function_input() / 8,), "bf16", mode="train", plan_for="coverage")
    fast(function_input() / 8).square().mean().backward()
    reference(function_input() / 8).square().mean().backward()
    for (name, p), q in zip(fast.named_parameters(), reference.parameters(), strict=False):
        if name == "fc1.bias":  # batch norm right after it: its gradient is rounding noise in both
            continue
        assert (p.grad - q.grad).norm() / q.grad.norm() < 3e-2, name


def test_the_compile_backend_trains_through_the_models_own_backward():
    torch.manual_seed(0)
    model = Net(RoundSTE).train()
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend="amppass", options={"dtype": "bf16", "mode": "train",
                                                                "compiler": "eager", "plan_for": "coverage"})
    compiled(function_input()).sum().backward()
    reference(function_input()).sum().backward()
    grad, want = model.fc1.weight.grad, reference.fc1.weight.grad
    assert want.abs().sum() > 0 and torch.allclose(grad, want, rtol=1e-5, atol=1e-6)
    unconverted = amppass.report(compiled).info["unconverted"]
    assert unconverted and "torch.autograd.Function" in unconverted[0]["reason"]
