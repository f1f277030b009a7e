"""Whether a weight's values survive being stored in the low dtype (painting rules 6 and 7).

An element-wise op that reads a weight or constant beside a low-precision activation runs low with that
weight stored low once, when its values fit. Values beyond the low dtype's largest finite value are
painting rule 3's; this check covers the small end. A weight *fits* when storing it in the low dtype moves
it by no more than that dtype rounds a normal number, its unit roundoff ``u = 2**-significand_bits``
(2**-11 for fp16): ``||round(w) - w|| <= u * ||w||``, which every tensor of normal numbers meets. A
constant 1e-12 (an epsilon) flushes to zero in fp16 and moves by all of itself; a tensor of 1e-6 (a
layer scale at its initial value) keeps 4 of its 11 bits; both keep their op fp32. A bias with a few
subnormal entries among normal ones still fits: the norm barely moves.

An op that divides (the policy fact "division") also needs every non-zero value of its weights normal: a
divisor below the smallest normal loses relative precision in the quotient, and one that flushes makes it
infinite.

bf16 has fp32's exponent range: every weight fits it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import torch

from ..dtypes import LowType
from .view import GraphView

_CHUNK = 1 << 20  # elements rounded at a time: a large table is measured without a float64 copy of it


def misfit(view: GraphView, weight: str, low: LowType, divides: bool = False) -> tuple[str, dict[str, Any]]:
    """Why ``weight`` does not fit ``low`` and the evidence, or ``("", {})`` when it fits (module docstring).

    ``divides`` is True when the reading op divides. A weight ``view`` cannot read (no ``weight_values``)
    is taken to fit.
    """
    if low.wide_range or view.weight_values is None:
        return "", {}
    key = (weight, low.name)
    if key not in view.rounding_cache:
        view.rounding_cache[key] = _measure(view.weight_values(weight), low)
    error, smallest = view.rounding_cache[key]
    unit = 2.0 ** -low.significand_bits
    evidence = {"weight": weight, "rounding_error": error, "min_nonzero": smallest, "limit": unit}
    if error > unit:
        return (f"stored in {low} it moves by {error:.2g} of its size, more than {low} rounds a normal number "
                f"({unit:.2g}): its values reach down to {smallest:.2g}, below {low}'s smallest normal "
                f"{low.min_normal:.2g}"), evidence
    if divides and smallest < low.min_normal:
        return (f"the op divides by it and its values reach down to {smallest:.2g}, below {low}'s smallest "
                f"normal {low.min_normal:.2g}"), evidence
    return "", {}


def _measure(values: object, low: LowType) -> tuple[float, float]:
    """``(||round(w) - w|| / ||w||, smallest non-zero finite magnitude)`` of ``values`` in ``low``."""
    flat = _float32(values).reshape(-1)
    error2 = norm2 = 0.0
    smallest = math.inf
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK]
        chunk = chunk[torch.isfinite(chunk)]  # inf and NaN stay what they are in any dtype
        magnitude = chunk.abs()
        nonzero = magnitude[magnitude > 0]
        if nonzero.numel():
            smallest = min(smallest, float(nonzero.min()))
        exact = chunk.double()
        error2 += float(((chunk.to(low.torch).double() - exact) ** 2).sum())
        norm2 += float((exact ** 2).sum())
    return (math.sqrt(error2 / norm2) if norm2 > 0 else 0.0), smallest


def _float32(values: object) -> torch.Tensor:
    """A float32 torch view of a tensor or a (possibly read-only) numpy array."""
    if isinstance(values, torch.Tensor):
        return values.detach().float()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(values, np.float32))
