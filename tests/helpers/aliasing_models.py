"""Attention whose key is a buffer filled in place in slices (multi-head latent attention's pattern), and its inputs."""

from __future__ import annotations

import torch
from torch import nn


class FilledKey(nn.Module):
    """Attention whose key is a buffer filled in place in two slices, one low-precision and one fp32 value."""

    def __init__(self, fp32_half: bool = True):
        super().__init__()
        self.q, self.a, self.b, self.out = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 16)
        self.fp32_half = fp32_half

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        k = q.new_empty(x.shape[0], x.shape[1], 16)
        k[..., :8] = self.a(x)
        k[..., 8:] = torch.exp(0.1 * self.b(x)) if self.fp32_half else self.b(x)  # exp runs fp32
        return self.out(nn.functional.scaled_dot_product_attention(q, k, k))


def filled_key_model(cls: type = FilledKey, **kwargs) -> nn.Module:
    """``cls`` (a :class:`FilledKey` by default) with seeded weights, in eval mode."""
    torch.manual_seed(0)
    return cls(**kwargs).eval()


def key_input(batch: int = 2, length: int = 5, seed: int = 1) -> torch.Tensor:
    """A seeded ``[batch, length, 16]`` input."""
    return torch.randn(batch, length, 16, generator=torch.Generator().manual_seed(seed))
