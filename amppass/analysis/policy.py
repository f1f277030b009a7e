"""What an op policy row means, written once, and the shape of the row each front end spells it with.

An :class:`OpKind` is what an op computes and which precision that needs: a category, the reason every op of that
kind gets, and the *facts* the calibration range rules read about it. :data:`KINDS` holds the kinds both front
ends have (softmax's exponentials, logarithms, norms, matrix products, ...), each written once here. Each front
end keeps one declarative table (:mod:`amppass.fx.view.policy` keyed by ATen overload packet,
:mod:`amppass.onnx.policy` by ``(domain, op_type)`` and opset range) of :class:`PolicyRow`: its own names for the
ops of one kind, and what only it knows about them (per-input-slot exceptions by its own input names, opset
ranges). A kind only one front end has (ATen's ``dtype=``-accumulated softmax, ONNX's quantization and control
flow) is written in that front end's table. The facts live only in the kinds: no second list of op names decides
which ops divide, reduce or normalise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
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
class OpKind:
    """What the ops of one kind compute and the precision that needs, whatever a front end calls them.

    ``name`` says the kind in a few words ("logarithm"); ``category`` and ``reason`` are what every op of the kind
    gets; ``facts`` are what the range rules read about it (:data:`FACTS`).
    """

    name: str
    category: Category
    reason: str
    facts: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        unknown = set(self.facts) - FACTS
        if unknown:
            raise ValueError(f"op kind {self.name!r}: unknown facts {sorted(unknown)}")


@dataclass(frozen=True)
class PolicyRow:
    """One row of a front end's op policy table: its names ``ops`` for the ops of one :class:`OpKind`.

    ``slots`` maps an input's name (ATen argument or ONNX schema input) to how that input is treated
    instead of the node's precision: "keep" (fed as the model gives it) or "saturate" (clamped to the low
    dtype's range before the cast). ``domain`` and ``opsets`` are for ONNX rows.
    """

    kind: OpKind
    ops: tuple[str, ...]
    slots: Mapping[str, str] = field(default_factory=dict)
    domain: str = ""
    opsets: tuple[int, int] = (1, 1 << 30)

    @property
    def category(self) -> Category:
        """The precision category of the row's ops (its kind's)."""
        return self.kind.category

    @property
    def reason(self) -> str:
        """Why the row's ops take that category (its kind's)."""
        return self.kind.reason

    @property
    def facts(self) -> frozenset[str]:
        """What the row's ops compute, for the range rules (its kind's)."""
        return self.kind.facts


def _kinds(*kinds: OpKind) -> Mapping[str, OpKind]:
    """``kinds`` by name, read-only."""
    return MappingProxyType({kind.name: kind for kind in kinds})


# The kinds both front ends have, each with the one category, reason and facts both tables give its ops; a front
# end's row names its ops for one of these by ``KINDS[name]``.
KINDS: Mapping[str, OpKind] = _kinds(
    OpKind("matrix multiply", Category.LOW,
           f"matrix multiply: {MATRIX_WORK}, accumulates in fp32 inside the kernel"),
    OpKind("convolution", Category.LOW, f"convolution: {MATRIX_WORK}, accumulates in fp32 inside the kernel"),
    OpKind("attention", Category.LOW, "attention: fused kernel, softmax statistics kept in fp32 inside it"),
    OpKind("recurrent cell", Category.LOW, "recurrent cell: matrix products dominate"),
    OpKind("normalisation", Category.FP32, "normalisation: mean and variance statistics need fp32",
           frozenset({NORMALISATION})),
    OpKind("norm", Category.FP32, "norm: a sum of squares overflows fp16 and loses bits; computed in fp32"),
    OpKind("exponential", Category.FP32, "exponential: overflows fp16 quickly (exp(11.1) > 65504); computed in fp32"),
    OpKind("logarithm", Category.FP32, "logarithm: singular at zero and loses precision in fp16; computed in fp32",
           frozenset({SINGULAR})),
    OpKind("power", Category.FP32, "power: magnifies relative error and leaves fp16's range quickly",
           frozenset({POWER})),
    OpKind("reciprocal", Category.FP32, "reciprocal: singular at zero, magnifies relative error",
           frozenset({SINGULAR})),
    OpKind("transcendental", Category.FP32, "transcendental with a narrow fp16 domain or range"),
    OpKind("loss", Category.FP32, "loss: log, exp and long sums; kept in fp32"),
    OpKind("resampling", Category.FP32, "resampling: interpolation weights and coordinates need fp32"),
    OpKind("division", Category.FOLLOW, "division: runs in the precision of its inputs (a divisor that flushes to "
           "zero in fp16 is kept fp32 by calibration)", frozenset({DIVISION})),
    OpKind("average pooling", Category.FOLLOW, "average pooling: runs in the precision of its inputs (long windows "
           "are kept fp32 by calibration)", frozenset({REDUCTION})),
    OpKind("concatenation", Category.FOLLOW, "concatenation: runs in the precision of its inputs", frozenset({JOIN})),
    OpKind("addition", Category.FOLLOW, "addition: runs in the precision of its inputs", frozenset({ADDITION})),
    OpKind("elementwise", Category.FOLLOW, "elementwise or data movement: runs in the precision of its inputs"),
)

# The kinds whose ops do a model's heavy compute, the one list of them both front ends read: the report counts
# their multiply-accumulates (fx/view/macs.py, onnx/macs.py: the ops of these kinds they have a formula for), an
# ONNX conversion whose target runs none of them low is refused (pipelines/convert_onnx.py), and the report lists
# them first.
HEAVY: frozenset[OpKind] = frozenset(KINDS[name] for name in ("matrix multiply", "convolution", "attention",
                                                              "recurrent cell"))
