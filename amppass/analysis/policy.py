"""The shape of an op policy table, shared by both front ends.

Each front end keeps one declarative table (:mod:`amppass.fx.view.policy` keyed by ATen overload packet,
:mod:`amppass.onnx.policy` by ``(domain, op_type)`` and opset range) whose rows are :class:`PolicyRow`: a
category with the reason every op in it gets, the *facts* the calibration range rules read about those
ops, and per-input-slot exceptions. The facts live only here, in the tables: no second list of op names
decides which ops divide, reduce or normalise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .plan import Category

# facts about what an op computes (read by amppass.analysis.rules)
DIVISION = "division"  # divides by an input: a flushed-to-zero divisor becomes inf
SINGULAR = "singular-at-zero"  # log, reciprocal, rsqrt of an input: zero is a singularity
POWER = "power"  # x ** p: singular at zero when p may be negative
NORMALISATION = "normalisation"  # divides by a variance or norm computed from its input
REDUCTION = "reduction"  # sums or averages many terms into each result
JOIN = "join"  # joins its inputs into one value (concatenation): a weight it reads becomes part of the result
ADDITION = "addition"  # adds or subtracts its inputs: an input's error reaches the result scaled by its share
LAYOUT = "layout"  # reshapes or reorders its input without selecting or changing a value: of a weight, a weight

FACTS = frozenset({DIVISION, SINGULAR, POWER, NORMALISATION, REDUCTION, JOIN, ADDITION, LAYOUT})

# A reason must be true for the target its plan is made for: the rows of matrix products and convolutions say
# MATRIX_WORK, which for_target() replaces with what does that work on the target (Tensor Cores on a GPU, the
# CPU's low-precision matrix instructions on a CPU), so the tables name each op once.
MATRIX_WORK = "<matrix-unit work>"
_MATRIX_WORK = {
    "cuda": "Tensor Core work",
    "tensorrt": "Tensor Core work",
    "cpu": "work for the CPU's {low} matrix instructions where it has them (AMX or AVX-512 on x86, Arm's {LOW} "
           "extension)",
}


def for_target(reason: str, target: str, low: str) -> str:
    """``reason`` with :data:`MATRIX_WORK` in words true for ``target`` ("cpu", "cuda", "tensorrt") and its low
    dtype ``low`` ("fp16", "bf16")."""
    if MATRIX_WORK not in reason:
        return reason
    words = _MATRIX_WORK.get(target, "work for the target's {low} matrix units")
    return reason.replace(MATRIX_WORK, words.format(low=low, LOW=low.upper()))


@dataclass(frozen=True)
class PolicyRow:
    """One row of an op policy table.

    ``slots`` maps an input's name (ATen argument or ONNX schema input) to how that input is treated
    instead of the node's precision: "keep" (fed as the model gives it) or "saturate" (clamped to the low
    dtype's range before the cast). ``domain`` and ``opsets`` are for ONNX rows.
    """

    category: Category
    reason: str
    ops: tuple[str, ...]
    facts: frozenset[str] = frozenset()
    slots: Mapping[str, str] = field(default_factory=dict)
    domain: str = ""
    opsets: tuple[int, int] = (1, 1 << 30)

    def __post_init__(self) -> None:
        unknown = set(self.facts) - FACTS
        if unknown:
            raise ValueError(f"policy row {self.ops[:3]}: unknown facts {sorted(unknown)}")
