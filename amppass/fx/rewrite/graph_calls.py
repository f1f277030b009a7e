"""Helpers the rewritten graphs call at run time."""

from __future__ import annotations

from typing import Any

import torch

_CONVERTIBLE = (torch.float32, torch.float16, torch.bfloat16)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast ``value`` to ``dtype`` if it is an fp32/fp16/bf16 tensor; return anything else unchanged.

    Used where the graph has no dtype information (symbolically traced modules): integer, boolean and
    fp64 tensors and non-tensors pass through.
    """
    if isinstance(value, torch.Tensor) and value.dtype in _CONVERTIBLE and value.dtype != dtype:
        return value.to(dtype)
    return value
