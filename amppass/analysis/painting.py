"""Painting: from op categories to one precision per node.

Rules, in the order they apply (after TF grappler's auto mixed precision pass):

1. Decisions given up front (user overrides, calibration rules) win, with their own reasons.
2. LOW, FP32 and FP32_ACCUM ops take the policy table's precision; KEEP ops do no float work.
3. Range of weights: in fp16, a weight beyond 65504 cannot be stored in low precision; its consumers
   run fp32 rather than read an inf.
4. Constants in the op itself (a fill value of -3.4e38, say) beyond the low dtype's range keep that op fp32;
   so does a non-zero constant of a LOW or FOLLOW op that flushes to zero in it (1e-12 in fp16).
5. Deny propagation: an fp32 decision caused by range flows downstream through FOLLOW ops, which would
   carry the out-of-range values, until an op of another category.
6. FOLLOW ops take the precision of their activations in graph order, as type promotion would: any fp32
   activation (graph inputs are fp32) makes them fp32, so nothing the original kept fp32 next to another
   value gets rounded; all-low activations keep them low, so element-wise ops between Tensor Core ops stay
   low and cost no casts. A weight or constant read beside low activations (a bias, a scale, a batch
   norm's statistics) runs low with them and is stored low once, when its values fit the low dtype
   (:mod:`amppass.analysis.fit`); one that does not fit keeps the op fp32, with the reason. A weight
   reshaped by weight-only layout ops (the policy fact "layout": an Unsqueeze of a per-channel scale for
   broadcasting) is that weight here. A value
   computed from weights alone (an embedding lookup) is not a weight here: it counts as fp32 until rule 7
   decides it, as type promotion would have it; so is a weight joined to low activations by a
   concatenation (the policy fact "join"): its values become data of the result, which type promotion
   keeps fp32.
7. An op fed by weights alone (an embedding gather, a transposed weight) follows its consumers: low when
   every consumer runs low and its weights fit, so the weight is converted once ahead of time instead of
   on every call, fp32 otherwise. ``low_weight_tables`` stores such tables in low precision regardless,
   for half the bytes.
8. A FOLLOW op painted low with a single low activation (weights beside it allowed), whose readers all run
   fp32, runs fp32 instead: its cast moves before it at no extra cost, exact for data movement and more
   precise for arithmetic (a bias added before a residual sum in fp32). This goes in reverse graph order,
   so a chain of such ops (transpose, reshape) resolves from its far end; it also keeps onnxruntime 1.31
   from crashing on Transpose -> Cast(float) -> MatMul.
9. Aliasing groups: values that share storage with a value written in place (a buffer filled through
   slices, ``copy_``, ``index_put_``, ``masked_fill_``) run in one precision, so no cast (a copy) comes
   between a write and a read: a write through a cast copy never reaches the buffer its readers read. The
   group runs fp32 when any member does (a value written into it is fp32, as type promotion would keep
   it; an fp32 op works on it; it is a graph input or weight, which keeps its dtype), else low; a member
   rule 8 made fp32 only to move a cast does not count (an in-place ReLU after a convolution whose readers
   run fp32 would otherwise pull the convolution to fp32). The
   members are fixed with that precision and the graph painted again, so their readers follow the group.
"""

from __future__ import annotations

from typing import Mapping

from ..dtypes import LowType
from .fit import misfit
from .plan import Category, Decision, Precision, PrecisionPlan, Source
from .policy import DIVISION, JOIN, LAYOUT
from .view import AliasGroup, GraphView, OpView

_CAST_EARLY = "cast-before-follower"  # rule 8's decisions
_CATEGORY_PRECISION = {
    Category.LOW: Precision.LOW,
    Category.FP32: Precision.FP32,
    Category.FP32_ACCUM: Precision.FP32_ACCUM,
    Category.KEEP: Precision.KEEP,
}


def paint(
    view: GraphView,
    low: LowType,
    given: Mapping[str, Decision] | None = None,
    low_weight_tables: bool = False,
) -> PrecisionPlan:
    """Return one decision per node of ``view``.

    ``low`` is the low dtype (its name appears in reasons, its largest finite value bounds weights).
    ``given`` holds decisions made before painting (overrides, calibration); they are kept as they are.
    ``low_weight_tables`` paints ops fed by weights alone low whatever their consumers (rule 7).
    """
    given = dict(given or {})
    plan = _paint(view, low, given, low_weight_tables)
    grouped = _alias_decisions(view, plan, low)
    if any(plan[name].precision is not d.precision for name, d in grouped.items()):
        plan = _paint(view, low, {**given, **grouped}, low_weight_tables)  # rule 9: readers follow the group
    return plan


def _paint(view: GraphView, low: LowType, given: Mapping[str, Decision], low_weight_tables: bool) -> PrecisionPlan:
    """Rules 1-8."""
    plan = PrecisionPlan()
    denied: dict[str, str] = {}  # value -> name of the range-caused fp32 node it descends from
    too_big = {w: m for w, m in view.weights.items() if m > low.max}
    produced: dict[str, Precision] = {}
    reshaped: dict[str, str] = {}  # value -> the weight it holds, reshaped by weight-only layout ops (rule 6)

    for node in view.nodes:
        decision = given.get(node.name) or _fixed(node, low, too_big)
        if decision is None:
            decision = _follow(node, view, low, produced, denied, reshaped)
        plan[node.name] = decision
        held = {weight for v in node.inputs if (weight := _weight_of(v, view, reshaped)) is not None}
        if decision.evidence.get("weights_only") and LAYOUT in node.facts and len(held) == 1:
            reshaped.update({value: next(iter(held)) for value in node.outputs})
        # fp32-accumulating ops output fp32; ops without float work leave their (fp32) values as they are
        out_precision = Precision.LOW if decision.precision is Precision.LOW else Precision.FP32
        for value in node.outputs:
            produced[value] = out_precision
        if decision.precision is Precision.FP32 and decision.evidence.get("propagates"):
            denied.update({value: node.name for value in node.outputs})
        elif node.category is Category.FOLLOW and decision.source is Source.CALIBRATION:
            origin = decision.evidence.get("origin")
            if origin:
                denied.update({value: origin for value in node.outputs})
    consumers = view.consumers()
    _cast_early(view, plan, low, given, consumers)
    _resolve_weight_only(view, plan, low, low_weight_tables, consumers)
    return plan


def _alias_decisions(view: GraphView, plan: PrecisionPlan, low: LowType) -> dict[str, Decision]:
    """Rule 9: one decision per member of each aliasing group with floating-point work."""
    decisions: dict[str, Decision] = {}
    for index, group in enumerate(view.alias_groups):
        floating = [m for m in group.members if plan[m].precision is not Precision.KEEP]
        if not floating:
            continue
        why = _group_fp32(group, plan)
        precision = Precision.FP32 if why else Precision.LOW
        if not why and not any(plan[m].precision is Precision.LOW for m in floating):
            continue
        shown = ", ".join(group.members[:6]) + (", ..." if len(group.members) > 6 else "")
        writers = ", ".join(group.writers[:3]) + (", ..." if len(group.writers) > 3 else "")
        runs = "fp32" if precision is Precision.FP32 else str(low)
        because = f" because {why}" if why else f": every member with floating-point work runs {low}"
        reason = (f"shares storage with values written in place ({writers}; aliasing group: {shown}): the group "
                  f"runs in one precision with no cast between a write and a read, {runs}{because}")
        for member in floating:
            own = plan[member]
            # a member's own reason stands where its op decided it; one painted from its neighbours takes the group's
            keeps = own.precision is precision and own.source is not Source.PAINTING
            evidence = {k: v for k, v in own.evidence.items() if k != "weights_only"}
            decisions[member] = Decision(precision, own.reason if keeps else reason,
                                         own.source if keeps else Source.PAINTING, {**evidence, "alias_group": index},
                                         rule=own.rule if keeps else "alias-group")
    return decisions


def _group_fp32(group: AliasGroup, plan: PrecisionPlan) -> str:
    """Why an aliasing group runs fp32 ("" when it may run low): a member that runs fp32, or stored state."""
    if group.stored:
        return f"{group.stored!r}, a graph input or weight, is written in place and keeps its fp32 storage"
    # a write of an fp32 value says most about why; then any member that runs fp32 for a reason of its own (rule
    # 8's fp32 only moves a cast: it never pulls the group, a convolution before an in-place ReLU, to fp32)
    for member in group.writers + group.members:
        decision = plan[member]
        if decision.precision in (Precision.FP32, Precision.FP32_ACCUM) and decision.rule != _CAST_EARLY:
            return f"{member} runs fp32 ({decision.reason})"
    return ""


def _cast_early(view: GraphView, plan: PrecisionPlan, low: LowType, given: Mapping[str, Decision],
                consumers: Mapping[str, list[OpView]]) -> None:
    """Rule 8, in reverse graph order."""
    outputs = set(view.outputs)
    for node in reversed(view.nodes):
        decision = plan[node.name]
        if (node.category is not Category.FOLLOW or decision.precision is not Precision.LOW
                or node.name in given or len({v for v in node.inputs if v not in view.weights}) != 1):
            continue
        readers = [c for v in node.outputs for c in consumers.get(v, [])]
        if not readers or outputs.intersection(node.outputs) or any(
                plan[c.name].precision is not Precision.FP32 for c in readers):
            continue
        beside = " (beside weights, which stay fp32)" if len(set(node.inputs)) > 1 else ""
        plan[node.name] = Decision(
            Precision.FP32,
            f"reads one {low} value{beside} and every reader runs fp32: runs fp32 so the cast comes before it "
            f"at no extra cost ({node.reason})",
            Source.PAINTING, rule=_CAST_EARLY,
        )


def _resolve_weight_only(view: GraphView, plan: PrecisionPlan, low: LowType, always_low: bool,
                         consumers: Mapping[str, list[OpView]]) -> None:
    """Rule 7, in reverse graph order so chains of weight-only ops resolve from their far end."""
    for node in reversed(view.nodes):
        decision = plan[node.name]
        if not decision.evidence.get("weights_only"):
            continue
        users = [plan[c.name].precision for v in node.outputs for c in consumers.get(v, [])]
        if always_low:
            plan[node.name] = Decision(
                Precision.LOW, f"reads weights only and low_weight_tables is set: its weights are stored in {low}",
                Source.PAINTING, {"weights_only": True}, rule="weight-tables-low",
            )
        elif users and all(p is Precision.LOW for p in users):
            unfit = _unfit(node, view, low)
            if unfit is not None:
                weight, why, evidence = unfit
                plan[node.name] = Decision(
                    Precision.FP32, f"reads weights only and every consumer runs {low}, but weight {weight!r} "
                    f"does not fit {low} ({why}); its weights stay fp32", Source.STATIC,
                    {"weights_only": True, "rule": "weight-fit", **evidence}, rule="weight-fit",
                )
                continue
            plan[node.name] = Decision(
                Precision.LOW, f"reads weights only and every consumer runs {low}: its weights are stored in {low}",
                Source.PAINTING, {"weights_only": True}, rule="weights-only-low-readers",
            )
        else:
            plan[node.name] = Decision(
                Precision.FP32, "reads weights only and feeds fp32 work: its weights stay fp32",
                Source.PAINTING, {"weights_only": True}, rule="weights-only-fp32-readers",
            )


def _weight_of(value: str, view: GraphView, reshaped: Mapping[str, str]) -> str | None:
    """The weight ``value`` holds: itself, or the weight a weight-only layout op reshaped into it; else None."""
    return value if value in view.weights else reshaped.get(value)


def _unfit(node: OpView, view: GraphView, low: LowType, weights: list[str] | None = None
           ) -> tuple[str, str, dict] | None:
    """The first weight ``node`` reads (or of ``weights``) that does not fit ``low``: (weight, why, evidence)."""
    for weight in weights if weights is not None else [v for v in node.inputs if v in view.weights]:
        why, evidence = misfit(view, weight, low, divides=DIVISION in node.facts)
        if why:
            return weight, why, evidence
    return None


def _fixed(node: OpView, low: LowType, too_big: Mapping[str, float]) -> Decision | None:
    """Rules 2-4: the decisions that do not depend on neighbours; None for a FOLLOW op."""
    big = [w for w in node.inputs if w in too_big]
    if big and node.category is not Category.KEEP:
        return Decision(
            Precision.FP32,
            f"weight {big[0]!r} holds values up to {too_big[big[0]]:.3g}, beyond {low}'s largest "
            f"{low.max:.6g}; kept fp32",
            Source.STATIC,
            {"weight": big[0], "absmax": too_big[big[0]], "limit": low.max}, rule="weight-range",
        )
    huge = [s for s in node.scalars if abs(s) > low.max and abs(s) != float("inf")]
    if huge and node.category is not Category.KEEP:
        return Decision(
            Precision.FP32,
            f"constant {huge[0]:.3g} in the op is beyond {low}'s largest {low.max:.6g}; kept fp32",
            Source.STATIC,
            {"constant": huge[0], "limit": low.max}, rule="constant-range",
        )
    flushed = [s for s in node.scalars if 0 < abs(s) < low.smallest_subnormal / 2]
    if flushed and node.category in (Category.LOW, Category.FOLLOW):
        return Decision(
            Precision.FP32,
            f"constant {flushed[0]:.3g} in the op rounds to zero in {low} (its smallest subnormal is "
            f"{low.smallest_subnormal:.3g}); kept fp32",
            Source.STATIC,
            {"constant": flushed[0], "limit": low.smallest_subnormal}, rule="constant-flush",
        )
    if node.category is Category.FOLLOW:
        return None
    reason = node.reason
    return Decision(_CATEGORY_PRECISION[node.category], reason, Source.POLICY, rule="policy")


def _follow(
    node: OpView,
    view: GraphView,
    low: LowType,
    produced: Mapping[str, Precision],
    denied: Mapping[str, str],
    reshaped: Mapping[str, str],
) -> Decision:
    """Rules 5-6 for a FOLLOW op."""
    origins = [denied[v] for v in node.inputs if v in denied]
    if origins:
        return Decision(
            Precision.FP32,
            f"carries values from {origins[0]!r}, which exceed {low}'s range; kept fp32",
            Source.CALIBRATION,
            {"origin": origins[0]}, rule="range-origin",
        )
    # graph inputs, and values computed from weights alone until rule 7 resolves them, are fp32
    activations = {produced.get(v, Precision.FP32) for v in node.inputs if _weight_of(v, view, reshaped) is None}
    if node.inputs and not activations:
        # provisional: resolved from the consumers once the whole graph is painted (rule 7)
        return Decision(Precision.FP32, "reads weights only", Source.PAINTING, {"weights_only": True},
                        rule="weights-only")
    if Precision.FP32 in activations:
        why = "mixes fp32 and low-precision inputs" if Precision.LOW in activations else "its inputs are fp32"
        return Decision(Precision.FP32, f"{why}; runs fp32 ({node.reason})", Source.PAINTING, rule="follow-fp32")
    if not activations:
        return Decision(Precision.KEEP, "no floating-point input to follow", Source.PAINTING, rule="follow-nothing")
    weights = [w for w in (_weight_of(v, view, reshaped) for v in node.inputs) if w is not None]
    if weights and JOIN in node.facts:
        return Decision(
            Precision.FP32,
            f"joins weight {weights[0]!r} to {low} inputs: its values become part of the result, which keeps "
            f"them in fp32 as type promotion would; runs fp32 ({node.reason})", Source.PAINTING,
            rule="join-weight",
        )
    unfit = _unfit(node, view, low, weights)
    if unfit is not None:
        weight, why, evidence = unfit
        return Decision(
            Precision.FP32,
            f"reads weight {weight!r} beside {low} inputs, but it does not fit {low} ({why}); runs fp32 "
            f"({node.reason})",
            Source.STATIC, {"rule": "weight-fit", **evidence}, rule="weight-fit",
        )
    if weights:
        return Decision(Precision.LOW, f"its inputs are {low} and the weights it reads fit {low}, which stores "
                        f"them; runs {low} ({node.reason})", Source.PAINTING, rule="follow-low-weights-fit")
    return Decision(Precision.LOW, f"its inputs are {low}; runs {low} ({node.reason})", Source.PAINTING,
                    rule="follow-low")
