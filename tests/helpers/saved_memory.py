"""Bytes autograd saves for backward, for tests and benchmarks."""

from __future__ import annotations

import torch
from torch import nn


def saved_bytes(model: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes autograd saves for backward in one call ``model(*inputs)``, each storage once, the model's own
    parameters and buffers left out (held anyway)."""
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(*inputs)
    return sum(seen.values())
