"""The neutral view of an FX graph for its target: in a train-mode plan for speed on a CPU, an fp16 convolution,
whose backward torch runs with a reference loop there (tens of times slower than fp32), is planned fp32; bf16,
``plan_for="coverage"`` and inference keep it low. The CPU is read as one with bf16 and fp16 instructions: on one
without, a train-mode plan for speed is the original in fp32 (tests/analysis/test_profitability_train_device.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from tests.helpers.load import native_bf16_cpu


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.ConvTranspose2d(16, 16, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


def _precisions(converted: nn.Module) -> dict[str, tuple[str, str]]:
    return {row.op.split(".")[-1]: (row.precision, row.reason) for row in amppass.report(converted).rows
            if row.op.split(".")[-1] in ("conv2d", "conv_transpose2d", "linear")}


def test_fp16_training_on_a_cpu_keeps_convolutions_fp32_and_says_why(monkeypatch):
    native_bf16_cpu(monkeypatch)  # the plan for speed of a CPU with fp16 instructions (one without keeps all fp32)
    got = _precisions(amppass.convert(_net().train(), (X,), "fp16", mode="train"))
    for op in ("conv2d", "conv_transpose2d"):
        precision, reason = got[op]
        assert precision == "fp32" and "fp16 backward with a reference loop" in reason and "bf16" in reason, got[op]
    assert got["linear"][0] == "fp16"


@pytest.mark.parametrize("dtype, mode, plan_for", [("bf16", "train", "speed"), ("fp16", "train", "coverage"),
                                                     ("fp16", "inference", "coverage")])
def test_bf16_training_fp16_coverage_and_inference_keep_convolutions_low(dtype, mode, plan_for, monkeypatch):
    native_bf16_cpu(monkeypatch)
    model = _net().train(mode == "train")
    got = _precisions(amppass.convert(model, (X,), dtype, mode=mode, plan_for=plan_for))
    assert got["conv2d"][0] == got["conv_transpose2d"][0] == dtype, got


def test_the_fp32_convolutions_train_as_the_fp32_model_does(monkeypatch):
    native_bf16_cpu(monkeypatch)
    reference, model = _net().train(), _net().train()
    converted = amppass.convert(model, (X,), "fp16", mode="train")
    reference(X).square().mean().backward()
    converted(X).square().mean().backward()
    want, got = reference[0].weight.grad, dict(converted.named_parameters())["0.weight"].grad
    assert torch.allclose(got, want, rtol=2e-2, atol=1e-4)  # the layers after it run fp16 (the linear)
