"""Building blocks shared by the architectures of :mod:`models.arch`: conv-BN-activation, squeeze-excitation,
and the weight adjustments that make random weights behave like trained ones."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F


class ConvBNAct(nn.Sequential):
    """``Conv2d`` (no bias, "same" padding for odd kernels) -> ``BatchNorm2d`` -> optional activation."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, groups: int = 1,
                 act: type[nn.Module] | None = nn.ReLU, eps: float = 1e-5):
        layers: list[nn.Module] = [
            nn.Conv2d(c_in, c_out, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(c_out, eps=eps),
        ]
        if act is not None:
            layers.append(act())
        super().__init__(*layers)


class SqueezeExcite(nn.Module):
    """Global average pool -> 1x1 conv down to ``squeeze`` channels -> ``act`` -> 1x1 conv back -> ``gate``,
    whose output rescales every channel of the input."""

    def __init__(self, channels: int, squeeze: int, act: type[nn.Module] = nn.ReLU,
                 gate: type[nn.Module] = nn.Sigmoid):
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.act = act()
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.gate = gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1)))))
        return x * scale


def damp(norms: Iterable[nn.Module], scale: float) -> None:
    """Multiply the affine gain of each normalisation layer in ``norms`` by ``scale``.

    Applied to the last normalisation of residual branches: trained networks keep those gains small, while
    random ones let every block add a branch as large as its input, so activations grow with depth.
    """
    with torch.no_grad():
        for norm in norms:
            norm.weight.mul_(scale)
