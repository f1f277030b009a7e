"""The neutral graph view the analysis works on, built by each front end.

Only floating-point values the plan may convert (fp32 values of the original model) appear as inputs and
outputs. Values come from three kinds of source: graph inputs and run-time constants (fixed fp32), weights
(initializers and parameters, which can be stored in low precision ahead of time) and node outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from .plan import Category


@dataclass
class OpView:
    """One node: its name, its op for display, its policy category and reason, and its float edges."""

    name: str
    op: str
    category: Category
    reason: str
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    # True for an op the policy table does not know (reported, and a candidate for user overrides)
    unknown: bool = False
    # Python-number arguments, checked against the low dtype's range
    scalars: list[float] = field(default_factory=list)
    # why the target runtime cannot run this op in low precision ("" when it can); overrides respect it
    low_blocked: str = ""
    # what the op computes, from its policy row (amppass.analysis.policy: division, reduction, ...)
    facts: frozenset[str] = frozenset()


@dataclass
class AliasGroup:
    """Values that share storage with a value the graph writes in place (a buffer filled through views).

    They run in one precision, with no cast between a write and a read (:func:`amppass.analysis.painting.paint`,
    rule 9).
    """

    members: list[str]  # the view's nodes in the group, in graph order
    writers: list[str]  # the members that write in place
    # a graph input or weight in the group: written in place, it keeps the dtype it is stored in (fp32)
    stored: str = ""


@dataclass
class GraphView:
    """A whole graph for the analysis: nodes in topological order plus what feeds them."""

    nodes: list[OpView]
    weights: dict[str, float] = field(default_factory=dict)  # weight value -> absmax (for the range rule)
    outputs: list[str] = field(default_factory=list)
    alias_groups: list[AliasGroup] = field(default_factory=list)
    # a weight's values (numpy or torch), read on demand by the painting's fit check; None: not readable,
    # and every weight within the low dtype's largest value is taken to fit
    weight_values: Callable[[str], Any] | None = None
    # (weight, low dtype name) -> (relative rounding error, smallest non-zero magnitude): measured once by
    # amppass.analysis.fit for the many paintings of one conversion (the tolerance search paints every run)
    rounding_cache: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict, repr=False,
                                                                         compare=False)

    def producers(self) -> dict[str, OpView]:
        """Value name -> the node that produces it."""
        return {value: node for node in self.nodes for value in node.outputs}

    def consumers(self) -> dict[str, list[OpView]]:
        """Value name -> the nodes that read it, in graph order."""
        result: dict[str, list[OpView]] = {}
        for node in self.nodes:
            for value in node.inputs:
                result.setdefault(value, []).append(node)
        return result
