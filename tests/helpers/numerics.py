"""Error of a model's outputs against a reference, over every floating output, for tests and benchmarks."""

from __future__ import annotations

from typing import Any

import torch


def _float_leaves(out: Any) -> torch.Tensor:
    """All floating tensors of a (possibly nested, ModelOutput) result, flattened into one fp64 vector."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    leaves = torch.utils._pytree.tree_leaves(out)
    return torch.cat(
        [t.detach().double().flatten() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    )


def rel_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` over every floating output."""
    a, b = _float_leaves(out), _float_leaves(ref)
    return float((a - b).norm() / b.norm())
