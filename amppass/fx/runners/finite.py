"""The conversion's own check on the example call: no output goes inf or NaN in low precision where fp32's is finite.

Rules:

1. The captured fp32 graph and the converted one run the example inputs once each. Where every floating output
   that is finite in fp32 is finite converted, the check is done (two forward calls).
2. Otherwise both graphs run again node by node, recording only whether each floating value is finite, and
   the *culprit* is the first node, in graph order, whose converted value is non-finite where its fp32 value
   (the same node; for a cast the value it casts) is finite. A cast's culprit is the node that reads it: read
   in fp32, the value is never cast. A value that shares storage with one written in place is judged once
   the run is over, when its storage holds what was written (a buffer from ``new_empty`` holds anything
   before).
3. The culprit is kept fp32 (with the reason, painted again so its aliasing group and readers follow) and
   the check repeats, a few rounds at most. What is still non-finite then (or a culprit the user forced low)
   is a warning naming the output and the node, and the converted model's info says so.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...analysis.plan import Decision, Precision, PrecisionPlan, Source
from ...errors import first_line
from ..prepare.aliasing import alias_groups

log = logging.getLogger(__name__)

ROUNDS = 4  # nodes kept fp32 one after another before the check gives up and warns


@dataclass
class Finding:
    """A converted output that is non-finite where fp32's is finite, and the node where it starts."""

    output: str  # "output 0 (node 'linear_2')"
    node: str  # the first node whose value goes non-finite in low precision ("" where none was found)
    culprits: list[str]  # the plan's nodes to keep fp32 for it


def non_finite(fp32: fx.GraphModule, converted: fx.GraphModule, inputs: list) -> Finding | None:
    """Rules 1-2 on one example (``inputs``: the graph's placeholder values); None when the outputs are fine."""
    with torch.no_grad():
        reference = _outputs(fp32, inputs)
        got = _outputs(converted, inputs)
    bad = [i for i, (r, g) in enumerate(zip(reference, got, strict=False)) if r is True and g is False]
    if not bad:
        return None
    names = _output_names(fp32)
    output = f"output {bad[0]} (node {names[bad[0]]!r})" if bad[0] < len(names) else f"output {bad[0]}"
    finite32 = _finite_by_node(fp32, inputs)
    finite = _finite_by_node(converted, inputs)
    for node in converted.graph.nodes:
        if finite.get(node.name) is not False:
            continue
        meta = node.meta.get("amppass", {})
        source = meta.get("of", node.name) if meta.get("cast") else node.name
        if finite32.get(source) is not True:
            continue
        culprits = [u.name for u in node.users if u.op != "output"] if meta.get("cast") else [node.name]
        return Finding(output, node.name, culprits)
    return Finding(output, "", [])


def keep_finite(plan: PrecisionPlan, finding: Finding, low: str) -> dict[str, Decision]:
    """Rule 3: fp32 decisions for the finding's culprits the plan runs low and the user did not force low."""
    decisions = {}
    for name in finding.culprits:
        decision = plan[name] if name in plan else None
        if decision is None or decision.precision is not Precision.LOW or decision.source is Source.OVERRIDE:
            continue
        decisions[name] = Decision(
            Precision.FP32,
            f"in {low} its value goes inf or NaN on the example inputs where fp32's is finite ({finding.output} of "
            f"the converted model was non-finite); kept fp32 ({decision.reason})",
            Source.CALIBRATION, {"rule": "non-finite", "output": finding.output}, rule="non-finite",
        )
    return decisions


class Check:
    """Rules 1-3, one round at a time: the pipeline rewrites the graph again between rounds
    (:func:`amppass.pipelines.stages.finite_check`), so the check holds no way of converting of its own.

    ``fp32``: the prepared graph before the rewrite; ``inputs``: its placeholder values on the example. After the
    last round, ``info`` holds what to record (empty when the first check passed)."""

    def __init__(self, fp32: fx.GraphModule, inputs: list, low: str):
        self.fp32, self.inputs, self.low = fp32, inputs, low
        self.kept: dict[str, Decision] = {}  # every culprit kept fp32 so far
        self.info: dict[str, Any] = {}
        self.rounds = 0
        self.finding: Finding | None = None

    def again(self, converted: fx.GraphModule, plan: PrecisionPlan) -> bool:
        """Check ``converted`` (made from ``plan``): True where culprits were added to :attr:`kept`, so the graph
        is to be planned and rewritten again with them; False when the check is over (:attr:`info` says how)."""
        if self.rounds == ROUNDS:
            return self._gave_up()
        self.rounds += 1
        try:
            finding = non_finite(self.fp32, converted, self.inputs)
        except Exception as err:  # noqa: BLE001 - a graph that cannot run outside its compiler is not checked
            log.info("the example call was not checked: the graph does not run on it eagerly (%s)",
                     first_line(err, 200))
            self.info = {"non_finite": {"not_checked": first_line(err, 200)}}
            return False
        if finding is None:
            if self.kept:
                log.warning("the converted model's output went non-finite on the example inputs in %s where fp32's "
                            "is finite; kept fp32: %s", self.low, ", ".join(self.kept))
                self.info = {"non_finite": {"kept_fp32": list(self.kept)}}
            return False
        self.finding = finding
        added = keep_finite(plan, finding, self.low)
        if not added:
            return self._gave_up()
        self.kept.update(added)
        return True

    def _gave_up(self) -> bool:
        """Rule 3's warning: what is still non-finite after the last round, or where no culprit can be kept."""
        finding = self.finding
        assert finding is not None
        where = f"; it starts at node {finding.node!r}" if finding.node else ""
        log.warning("the converted model's %s is inf or NaN on the example inputs where fp32's is finite%s (kept fp32 "
                    "so far: %s); keep that node fp32 with keep_fp32=[...] or convert with calibration= and "
                    "tolerance=", finding.output, where, ", ".join(self.kept) or "none", )
        self.info = {"non_finite": {"output": finding.output, "node": finding.node, "kept_fp32": list(self.kept)}}
        return False


def _outputs(gm: fx.GraphModule, inputs: list) -> list[bool | None]:
    """Whether each output leaf is finite (None: not a floating tensor)."""
    return [_finite(v) for v in pytree.tree_leaves(fx.Interpreter(gm).run(*inputs, enable_io_processing=False))]


def _output_names(gm: fx.GraphModule) -> list[str]:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [a.name if isinstance(a, fx.Node) else repr(a) for a in pytree.tree_leaves(output.args[0])]


def _finite(value: Any) -> bool | None:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return bool(torch.isfinite(value).all()) if value.numel() else True
    if isinstance(value, (tuple, list)):
        flags = [f for f in (_finite(v) for v in value) if f is not None]
        return all(flags) if flags else None
    if isinstance(value, float):
        return math.isfinite(value)
    return None


def _finite_by_node(gm: fx.GraphModule, inputs: list) -> dict[str, bool | None]:
    """Rule 2: whether each node's floating value is finite, in one run."""
    shared = {n for members in alias_groups(gm).members for n in members}
    recorder = _Recorder(gm, shared)
    with torch.no_grad():
        recorder.run(*inputs, enable_io_processing=False)
    for node, value in recorder.later.items():
        recorder.finite[node.name] = _finite(value)
    return recorder.finite


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, shared: set[fx.Node]):
        super().__init__(gm)
        self.shared = shared
        self.finite: dict[str, bool | None] = {}
        self.later: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n in self.shared:
            self.later[n] = result
        else:
            self.finite[n.name] = _finite(result)
        return result
