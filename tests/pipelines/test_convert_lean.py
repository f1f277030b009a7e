"""Lean FX plans: the torch.fx path follows the ONNX rule. A weight or constant beside a low
activation runs low with it, stored low once, when it fits; an eval batch norm runs low and reads its
statistics in fp32 (torch's kernels take them beside a low input); what does not fit keeps fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from amppass.analysis.record import META_KEY


class Block(nn.Module):
    """conv -> eval BatchNorm -> ReLU -> x * scale + shift (parameters) -> linear."""

    def __init__(self, scale: float = 0.5):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.scale = nn.Parameter(torch.full((1, 8, 1, 1), scale))
        self.shift = nn.Parameter(torch.linspace(-0.5, 0.5, 8).reshape(1, 8, 1, 1))
        self.fc = nn.Linear(8, 4)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))) * self.scale + self.shift
        return self.fc(h.mean(dim=(2, 3)))


def decisions(gm: torch.fx.GraphModule) -> dict[str, dict]:
    return {n.name: n.meta[META_KEY] for n in gm.graph.nodes
            if META_KEY in n.meta and not n.meta[META_KEY].get("cast")}


def by_op(gm: torch.fx.GraphModule, op: str) -> dict:
    (found,) = [m for m in decisions(gm).values() if m["op"] == op]
    return found


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def test_eval_batch_norm_and_parameter_scale_shift_run_low():
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 3, 8, 8)
    fast = amppass.convert(model, (x,), torch.float16, plan_for="coverage")
    fast.graph.lint()
    plan = decisions(fast)
    assert by_op(fast, "aten.batch_norm")["precision"] == "low"
    assert by_op(fast, "aten.mul")["precision"] == "low" and by_op(fast, "aten.add")["precision"] == "low"
    assert "the weights it reads fit fp16" in by_op(fast, "aten.mul")["reason"]
    # scale and shift stored fp16 once; the batch norm's statistics and affine weights stay fp32
    assert fast.get_parameter("scale").dtype == torch.float16 and fast.get_parameter("shift").dtype == torch.float16
    assert fast.get_parameter("bn.weight").dtype == torch.float32
    assert fast.get_buffer("bn.running_var").dtype == torch.float32
    # casts: the input in, the mean's fp32 result to the linear, the output back
    assert fast.meta["amppass"]["casts"] == 3, plan
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) < 5e-3


def test_symbolically_traced_batch_norm_module_keeps_its_state_fp32():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    fast = amppass.convert(model, None, torch.float16, plan_for="coverage")
    fast.graph.lint()
    assert {m["precision"] for m in decisions(fast).values()} == {"low"}
    bn = fast.get_submodule("1")
    assert bn.weight.dtype == torch.float32 and bn.running_mean.dtype == torch.float32
    assert fast.get_submodule("0").weight.dtype == torch.float16
    x = torch.randn(2, 3, 10, 10)
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) < 5e-3


def test_batch_norm_in_training_mode_follows_its_low_input_and_its_eval_graph_runs_it_low():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
    fast = amppass.convert(model, (torch.randn(4, 3, 8, 8),), torch.bfloat16, mode="train", plan_for="coverage")
    trained = [m for m in decisions(fast.train_graph).values() if "batch_norm" in m["op"]]
    # the kernel accumulates the batch's statistics in fp32 beside the low input (fx.policy.TRAINING)
    assert trained and all(m["precision"] == "low" and "training mode" in m["reason"] for m in trained)
    assert fast.get_buffer("1.running_mean").dtype == torch.float32
    evaluated = [m for m in decisions(fast.eval_graph).values() if "batch_norm" in m["op"]]
    assert evaluated and all(m["precision"] == "low" for m in evaluated)


@pytest.mark.parametrize("value, why", [
    (1e-6, "below fp16's smallest normal"),  # a layer scale at its initial value
    (1e5, "beyond fp16's largest"),
])
def test_parameter_that_does_not_fit_fp16_keeps_its_op_fp32(value, why):
    torch.manual_seed(0)
    model = Block(scale=value).eval()
    x = torch.randn(2, 3, 8, 8)
    fast = amppass.convert(model, (x,), torch.float16, plan_for="coverage")
    mul = by_op(fast, "aten.mul")
    assert mul["precision"] == "fp32" and why in mul["reason"], mul["reason"]
    assert fast.get_parameter("scale").dtype == torch.float32
    with torch.no_grad():
        assert rel_err(fast(x), model(x)) < 5e-3


def test_python_constant_that_rounds_to_zero_keeps_its_op_fp32():
    class Eps(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.log(torch.clamp(self.fc(x), min=1e-12))

    x = torch.randn(4, 8)
    fast = amppass.convert(Eps().eval(), (x,), torch.float16, plan_for="coverage")
    clamp = by_op(fast, "aten.clamp")
    assert clamp["precision"] == "fp32" and "rounds to zero in fp16" in clamp["reason"]
    with torch.no_grad():
        assert torch.isfinite(fast(x)).all()  # log(1e-12), not log(0)
