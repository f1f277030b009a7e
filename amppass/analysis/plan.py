"""The precision plan: one decision per node, each with a reason a user can read.

The analysis produces a :class:`PrecisionPlan`; the rewrite passes only read it. A decision is
``(precision, reason, source)`` plus optional evidence (observed ranges, the values it rested on) and the id
of the rule that made it: a short stable string (``"policy"``, ``"overflow"``, ``"weight-fit"``, ...) that
stays the same when the reason's wording changes, stored with the decision and shown in the report.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterator


class Category(enum.Enum):
    """What the op policy table says about an op before any painting."""

    LOW = "low"  # Tensor Core work: always run in fp16/bf16
    FOLLOW = "follow"  # runs in the precision of its inputs; painted
    FP32 = "fp32"  # must run in fp32: inputs are cast up
    FP32_ACCUM = "fp32-accumulate"  # takes low-precision input but accumulates (and outputs) in fp32
    KEEP = "keep"  # no floating-point work to decide (shapes, indices, metadata)


class Precision(enum.Enum):
    """Where a node runs after planning."""

    LOW = "low"
    FP32 = "fp32"
    FP32_ACCUM = "fp32-accumulate"
    KEEP = "keep"


class Source(enum.Enum):
    """Who made a decision."""

    POLICY = "policy"  # the op policy table
    PAINTING = "painting"  # follows its neighbours
    CALIBRATION = "calibration"  # a rule over observed value ranges
    STATIC = "static"  # a rule over constants / initializers
    TOLERANCE = "tolerance"  # moved back to fp32 by the tolerance search
    PROFITABILITY = "profitability"  # measured slower in low precision on the target device
    OVERRIDE = "override"  # the user asked for it


# rule id -> what the rule is; every decision names one (Decision.rule), by level of docs/architecture.md
RULES: dict[str, str] = {
    # user overrides (analysis/overrides.py)
    "keep-fp32": "the user kept the node fp32 (keep_fp32=)",
    "force-low": "the user forced the node low (force_low=)",
    "force-low-no-kernel": "forced low, but the target has no low kernel for it: fp32",
    # profitability (analysis/profitability.py, serving/fp32_original.py)
    "profitability": "its region is not faster low on this device",
    "low-kernel-failed": "its low kernel raised when timed on this device",
    "whole-model": "the original module in fp32 measured faster than any converted graph",
    # calibration range rules (analysis/rules.py) and the tolerance search (analysis/tolerance.py)
    "overflow": "its output comes near the low dtype's largest value on calibration data",
    "reduction-overflow": "its reduction result comes near the low dtype's largest value on calibration data",
    "overflow-input": "a low-precision op whose input exceeds the low dtype's range",
    "underflow": "its small values would flush to zero before a division, log or normalisation",
    "reduction-depth": "a reduction over more terms than the low dtype's significand holds",
    "range-origin": "it carries values from a node kept fp32 for their range",
    "tolerance": "moved back to fp32 to meet the output tolerance",
    "non-finite": "in the low dtype its value goes inf or NaN on the example inputs where fp32's is finite",
    # policy, static ranges and painting (fx|onnx policy.py, analysis/painting.py)
    "policy": "its op's row of the front end's policy table",
    "qdq": "a quantized (QDQ) node: kept as the quantization left it",
    "weight-range": "it reads a weight beyond the low dtype's range",
    "constant-range": "a constant in the op is beyond the low dtype's range",
    "constant-flush": "a constant in the op rounds to zero in the low dtype",
    "weight-fit": "a weight it reads does not fit the low dtype",
    "join-weight": "it joins a weight's values to low inputs: fp32 as type promotion would",
    "follow-low": "its inputs are low",
    "follow-low-weights-fit": "its inputs are low and the weights it reads fit the low dtype",
    "follow-fp32": "its inputs are fp32, or mix fp32 and low",
    "follow-nothing": "no floating-point input to follow",
    "cast-before-follower": "every reader runs fp32: the cast moves before it at no cost",
    "weights-only": "it reads weights only (decided from its consumers)",
    "weights-only-low-readers": "it reads weights only and every consumer runs low",
    "weights-only-fp32-readers": "it reads weights only and feeds fp32 work",
    "weight-tables-low": "it reads weights only and low_weight_tables is set",
    "alias-group": "it shares storage with values written in place: the group runs in one precision",
}


@dataclass
class Decision:
    """The precision chosen for one node and why."""

    precision: Precision
    reason: str
    source: Source
    evidence: dict[str, Any] = field(default_factory=dict)
    rule: str = ""  # the id of the rule that made it (module docstring)

    def to_meta(self) -> dict[str, Any]:
        """A plain-dict form stored in the rewritten model (``node.meta`` / ONNX metadata)."""
        return {
            "precision": self.precision.value,
            "reason": self.reason,
            "source": self.source.value,
            "evidence": dict(self.evidence),
            "rule": self.rule,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "Decision":
        """Inverse of :meth:`to_meta`."""
        return cls(
            Precision(meta["precision"]),
            meta["reason"],
            Source(meta["source"]),
            dict(meta.get("evidence", {})),
            str(meta.get("rule", "")),
        )


class PrecisionPlan:
    """Decisions keyed by node name, in graph order."""

    def __init__(self) -> None:
        self._decisions: dict[str, Decision] = {}

    def __setitem__(self, node: str, decision: Decision) -> None:
        self._decisions[node] = decision

    def __getitem__(self, node: str) -> Decision:
        return self._decisions[node]

    def __contains__(self, node: object) -> bool:
        return node in self._decisions

    def __iter__(self) -> Iterator[str]:
        return iter(self._decisions)

    def __len__(self) -> int:
        return len(self._decisions)

    def items(self) -> Iterator[tuple[str, Decision]]:
        """(node name, decision) pairs in graph order."""
        return iter(self._decisions.items())

    def count(self, precision: Precision) -> int:
        """Number of nodes planned at ``precision``."""
        return sum(1 for d in self._decisions.values() if d.precision is precision)
