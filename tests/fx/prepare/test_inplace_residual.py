"""An in-place residual add (``out += identity``, as torchvision's ResNet BasicBlock and Bottleneck write it) plans as
the out-of-place form does: the same convolutions run low, the same share of multiply-adds, and the converted model
agrees with fp32. Coverage plans, so that the plan does not depend on this CPU's speed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amppass
from tests.helpers.numerics import rel_error

torchvision = pytest.importorskip("torchvision")
from torchvision.models import resnet  # noqa: E402 - after the importorskip that guards it


def _out_of_place(self, x):
    """torchvision's BasicBlock.forward with ``out = out + identity`` in place of ``out += identity``."""
    identity = x
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    if self.downsample is not None:
        identity = self.downsample(x)
    out = out + identity
    return self.relu(out)


def _resnet18(in_place: bool, monkeypatch) -> nn.Module:
    if not in_place:
        monkeypatch.setattr(resnet.BasicBlock, "forward", _out_of_place)
    torch.manual_seed(0)
    model = resnet.resnet18(num_classes=10).eval()
    with torch.no_grad():  # running statistics other than 0/1, so the batch norms do real work
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    return model


def _conv_plan(converted) -> tuple[dict[str, str], float]:
    report = amppass.report(converted)
    convs = {row.name: row.precision for row in report.rows if "conv" in row.op}
    return convs, report.stats()["macs"]["low_share"]


def test_resnet18_in_place_residual_runs_its_convolutions_low_as_the_out_of_place_form(monkeypatch):
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    plans = {}
    for in_place in (True, False):
        model = _resnet18(in_place, monkeypatch)
        converted = amppass.convert(model, (x,), "bf16", plan_for="coverage")
        plans[in_place] = _conv_plan(converted)
        with torch.no_grad():
            assert rel_error(converted(x), model(x)) < 5e-2
    (in_place, share), (out_of_place, share_oop) = plans[True], plans[False]
    assert len(in_place) == 20 and set(in_place.values()) == {"bf16"}
    assert sorted(in_place.values()) == sorted(out_of_place.values()) and share == share_oop == 1.0


class _Block(nn.Module):
    """A residual block without normalisation: the in-place add writes straight into a convolution's output."""

    def __init__(self, in_place: bool):
        super().__init__()
        self.in_place = in_place
        self.conv1, self.conv2, self.skip = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1), \
            nn.Conv2d(8, 8, 1)

    def forward(self, x):
        identity = self.skip(x)
        out = self.conv2(torch.relu(self.conv1(x)))
        if self.in_place:
            out += identity
        else:
            out = out + identity
        return torch.relu(out)


def test_a_trained_in_place_residual_keeps_its_convolutions_low():
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(2))
    plans = {}
    for in_place in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(_Block(in_place), _Block(in_place))
        converted = amppass.convert(model, (x,), "fp16", plan_for="coverage", mode="train")
        plans[in_place] = _conv_plan(converted)
        out = converted(x)
        assert rel_error(out.detach(), model(x).detach()) < 2e-2
        out.square().mean().backward()
    assert set(plans[True][0].values()) == {"fp16"} and plans[True] == plans[False]
