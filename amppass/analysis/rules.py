"""Range rules: precision decisions from calibration statistics, front-end neutral.

:func:`range_decisions` reads a :class:`GraphView` and the :class:`CalibrationStats` of its values and
returns decisions for ``paint(..., given=...)``. Rules, in the order they apply (a node keeps the first
decision it gets):

1. Overflow: a LOW or FOLLOW op whose output reaches beyond the low dtype's range (less a headroom factor,
   see :mod:`amppass.analysis.stats`) runs fp32, and its fp32 paint propagates downstream through FOLLOW
   ops (painting rule 5). A reduction whose result is out of range is named as such. An fp32 op whose
   output is out of range gets the same propagating decision, so that the report shows why.
2. Overflow of an input: a LOW op that would cast an out-of-range value (a graph input, or a value an fp32
   op produced) to the low dtype runs fp32 instead of reading infinities.
3. Underflow: a value whose non-zero entries flush to zero in fp16 (or mostly fall below its smallest
   normal) and that feeds a divisor, a logarithm, a reciprocal square root, a negative power or a
   normalisation is computed in fp32, together with the chain of producers whose outputs are as small.
4. Reduction depth: a FOLLOW op that averages over more than ``2**mantissa_bits`` terms per output (a
   pooling over long axes, where no fp32-accumulate path exists) runs fp32. This is a precision rule, so
   it applies to bf16 as well.

Rules 1-3 need fp16 only: bf16 has fp32's exponent range.
"""

from __future__ import annotations

import logging
from typing import Iterable, Mapping

from ..dtypes import LowType
from .plan import Category, Decision, Precision, Source
from .policy import DIVISION, NORMALISATION, POWER, REDUCTION, SINGULAR
from .stats import HEADROOM, CalibrationStats, ValueStats
from .view import GraphView, OpView

log = logging.getLogger(__name__)

# a value whose non-zero entries are mostly this far below the smallest normal is "small" (rule 3)
UNDERFLOW_SHARE = 0.01


def range_decisions(view: GraphView, stats: CalibrationStats, low: LowType) -> dict[str, Decision]:
    """Decisions, by node name, that calibration statistics call for; merge them under user overrides.

    ``low`` selects the rules (module docstring). Each decision's evidence names the rule, the value it
    read and the observed range. Which ops divide, reduce or normalise is each node's ``facts``, from the
    policy tables.
    """
    decisions: dict[str, Decision] = {}
    if not low.wide_range:
        _overflow(view, stats, low, decisions)
        _underflow(view, stats, low, decisions)
    _depth(view, stats, low, decisions)
    log.debug("calibration rules decided %d of %d nodes", len(decisions), len(view.nodes))
    return decisions


def _overflow(view: GraphView, stats: CalibrationStats, low: LowType, decisions: dict[str, Decision]) -> None:
    """Rules 1 and 2."""
    limit = low.max / HEADROOM
    for node in view.nodes:
        if node.category in (Category.KEEP, Category.FP32_ACCUM):
            continue  # no float work, or an fp32 result already
        big = _largest(node.outputs, stats)
        if big is not None and big[1].absmax > limit:
            value, seen = big
            rule = "reduction-overflow" if REDUCTION in node.facts else "overflow"
            what = "reduction result" if rule == "reduction-overflow" else "output"
            decisions[node.name] = Decision(
                Precision.FP32,
                f"{what} reaches {seen.absmax:.3g} on calibration data, within a factor {HEADROOM:g} of "
                f"{low}'s largest {low.max:.6g} or beyond; runs fp32 and so do the ops it feeds",
                Source.CALIBRATION, _evidence(rule, value, seen, limit=limit, propagates=True), rule=rule,
            )
            continue
        big = _largest([v for v in node.inputs if v not in view.weights], stats)
        if node.category is Category.LOW and big is not None and big[1].absmax > limit:
            value, seen = big
            decisions[node.name] = Decision(
                Precision.FP32,
                f"input {value!r} reaches {seen.absmax:.3g} on calibration data, beyond what {low} holds "
                f"with headroom ({limit:.6g}); runs fp32 rather than read infinities",
                Source.CALIBRATION, _evidence("overflow-input", value, seen, limit=limit), rule="overflow-input",
            )


def _underflow(view: GraphView, stats: CalibrationStats, low: LowType, decisions: dict[str, Decision]) -> None:
    """Rule 3: walk up from each sensitive read through producers whose outputs are as small."""
    producers = view.producers()
    for node in view.nodes:
        for value in _sensitive_inputs(node, view.weights):
            seen = stats.get(value)
            if seen is None or not _small(seen):
                continue
            todo = [value]
            while todo:
                current = todo.pop()
                producer = producers.get(current)
                current_stats = stats.get(current)
                if (producer is None or producer.name in decisions or current_stats is None
                        or not _small(current_stats) or producer.category is Category.KEEP):
                    continue
                decisions[producer.name] = Decision(
                    Precision.FP32,
                    f"{current_stats.share_below_normal:.1%} of its non-zero values are below {low}'s "
                    f"smallest normal {low.min_normal:.2g} (smallest {current_stats.min_nonzero:.3g}) and "
                    f"they reach {node.op} {node.name!r}, which divides by them, takes their log or "
                    "normalises them; computed in fp32 so they do not flush to zero",
                    Source.CALIBRATION,
                    _evidence("underflow", current, current_stats, feeds=node.name, feeds_op=node.op),
                    rule="underflow",
                )
                todo.extend(v for v in producer.inputs if v not in view.weights)


def _depth(view: GraphView, stats: CalibrationStats, low: LowType, decisions: dict[str, Decision]) -> None:
    """Rule 4."""
    bits = low.significand_bits
    for node in view.nodes:
        if node.name in decisions or node.category is not Category.FOLLOW or REDUCTION not in node.facts:
            continue
        inputs = [stats.get(v) for v in node.inputs if v not in view.weights]
        outputs = [stats.get(v) for v in node.outputs]
        if not inputs or not outputs or inputs[0] is None or outputs[0] is None or not outputs[0].numel:
            continue
        depth = inputs[0].numel // outputs[0].numel
        if depth > 2 ** bits:
            decisions[node.name] = Decision(
                Precision.FP32,
                f"reduces {depth} terms per result; summed in {low} that loses all {bits} significand "
                "bits and this op has no fp32-accumulate path; runs fp32",
                Source.CALIBRATION,
                {"rule": "reduction-depth", "depth": depth, "limit": 2 ** bits, "value": node.inputs[0]},
                rule="reduction-depth",
            )


def _sensitive_inputs(node: OpView, weights: Mapping[str, float]) -> list[str]:
    """Inputs where a flush to zero turns into inf, NaN or a wrong normalisation."""
    activations = [v for v in node.inputs if v not in weights]
    if DIVISION in node.facts:
        return activations  # a ratio of small values keeps its precision only if both sides keep theirs
    if POWER in node.facts:
        # a tensor exponent's sign is unknown: treat it as possibly negative
        return activations[:1] if not node.scalars or any(s < 0 for s in node.scalars) else []
    if SINGULAR in node.facts or NORMALISATION in node.facts:
        return activations[:1]
    return []


def _small(seen: ValueStats) -> bool:
    return seen.flush > 0 or seen.share_below_normal > UNDERFLOW_SHARE


def _largest(values: Iterable[str], stats: CalibrationStats) -> tuple[str, ValueStats] | None:
    seen = [(v, stats.get(v)) for v in values]
    known = [(v, s) for v, s in seen if s is not None]
    return max(known, key=lambda item: item[1].absmax) if known else None


def _evidence(rule: str, value: str, seen: ValueStats, **extra: object) -> dict[str, object]:
    return {
        "rule": rule, "value": value, "absmax": seen.absmax, "min_nonzero": seen.min_nonzero,
        "share_below_normal": seen.share_below_normal, "share_above_headroom": seen.share_above_headroom,
        "batches": seen.tensors, **extra,
    }
