"""A ``torch.autograd.Function`` whose backward is not its forward's derivative, and a small net that applies one."""

from __future__ import annotations

import torch
from torch import nn


class RoundSTE(torch.autograd.Function):
    """Rounds forward, passes the gradient straight through backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Net(nn.Module):
    """Linear, batch norm, ``function`` (in eval too unless ``train_only``), linear."""

    def __init__(self, function: type, train_only: bool = False):
        super().__init__()
        self.function, self.train_only = function, train_only
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.norm(self.fc1(x))
        h = self.function.apply(h) if self.training or not self.train_only else torch.round(h)
        return self.fc2(h)


def function_input() -> torch.Tensor:
    """A fixed batch of 16 inputs for :class:`Net`, spread wide enough that rounding changes values."""
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(0)) * 2
