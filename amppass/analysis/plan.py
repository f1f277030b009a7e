"""The precision plan: one decision per node, each with a reason a user can read.

The analysis produces a :class:`PrecisionPlan`; the rewrite passes only read it. A decision is
``(precision, reason, source)`` plus optional evidence (observed ranges, the rule that fired).
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


@dataclass
class Decision:
    """The precision chosen for one node and why."""

    precision: Precision
    reason: str
    source: Source
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        """A plain-dict form stored in the rewritten model (``node.meta`` / ONNX metadata)."""
        return {
            "precision": self.precision.value,
            "reason": self.reason,
            "source": self.source.value,
            "evidence": dict(self.evidence),
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> "Decision":
        """Inverse of :meth:`to_meta`."""
        return cls(
            Precision(meta["precision"]),
            meta["reason"],
            Source(meta["source"]),
            dict(meta.get("evidence", {})),
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
