"""The record a conversion stores in the model it returns, the same for both front ends.

1. One key, :data:`META_KEY`, holds each planned node's decision (``node.meta`` in torch.fx, the node's
   ``metadata_props`` in ONNX) and the conversion's summary (``gm.meta``, the model's ``metadata_props``);
   :mod:`amppass.report` rebuilds its report from them alone.
2. Every summary opens with the keys :func:`summary` writes, in that order; a front end adds its own after
   them (calibration, profitability, clamped weights, ...).
3. Each stored decision carries the same evidence beside it from both front ends (:func:`with_evidence`): the front
   end's policy facts, whether its op is unknown, its multiply-accumulates, and for an op the front end fused, what
   it replaced (said in the reason too).
4. A model that already carries a record is returned unchanged when the caller asks for what it already is,
   and refused otherwise (:func:`check_reconversion`): converting it again would cast its casts.
5. An fp8 plan records its matrix products in one shape from both front ends (:func:`fp8_record`): each product's
   decision carries ``evidence["fp8"]``, its format and scales where it runs in fp8 and ``why_not`` where it does
   not; the summary's ``fp8`` holds the products and their multiply-accumulates by precision (fp8, the plan's low
   dtype, fp32) and the products left out of fp8 counted by why (:data:`FP8_WHY_NOT`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Iterable, Iterator, Mapping, Protocol

from .._version import __version__
from ..errors import InputError
from .plan import PrecisionPlan
from .view import GraphView

log = logging.getLogger(__name__)

META_KEY = "amppass"
FP8_KEY = "fp8"  # a matrix product's fp8 outcome in its evidence, and the fp8 record in the summary (rule 5)
# why a matrix product is not fp8, in a few words, by a phrase its reason holds (either front end's); the first
# entry whose phrase is in the reason names it, and a reason with none of them is counted by its own first clause
FP8_WHY_NOT = (
    ("kept fp32 by the plan", ("keeps this product in fp32",)),
    ("no fp8 kernel for the op (convolution, attention)", ("no fp8 convolution kernel", "SDPA kernel")),
    ("no stored operand to scale at conversion", ("two activations", "weight is computed in the graph")),
    # the second phrase: records written before matmul/bmm/einsum products were lowered
    ("a stored operand that is not a linear layer's weight", ("not a linear layer's product",
                                                              "linear layers, mm and addmm are")),
    ("sizes not multiples of 16", ("not multiples of",)),
    ("an operand calibration did not observe", ("not observed by calibration",)),
    ("a bias that cannot move after the product", ("bias is scaled by beta", "bias of a convolution")),
    ("does not run as the target computes it", ("does not run as the target computes it",)),
    ("range: outliers one scale cannot hold", ("subnormals or zero",)),
    ("output error beyond the tolerance", ("tolerance",)),
)


class RewriteCounts(Protocol):
    """What a front end's rewrite counted, as the summary reads it."""

    casts: int
    weights_converted: int
    weight_copies: int


def summary(front_end: str, dtype: str, target: str, mode: str, keep_io_types: bool, stats: RewriteCounts,
            weight_bytes_before: int, weight_bytes_after: int) -> dict[str, Any]:
    """The keys every conversion's summary opens with: who converted, to what, for where, and what it changed."""
    return {
        "amppass_version": __version__,
        "front_end": front_end,
        "dtype": dtype,
        "target": target,
        "mode": mode,
        "keep_io_types": keep_io_types,
        "casts": stats.casts,
        "weights_converted": stats.weights_converted,
        "weight_copies": stats.weight_copies,
        "weight_bytes_before": weight_bytes_before,
        "weight_bytes_after": weight_bytes_after,
    }


def with_evidence(plan: PrecisionPlan, view: GraphView, macs: Mapping[str, int | None],
                  facts: Mapping[str, Mapping[str, Any]] | None = None,
                  fused: Mapping[str, str] | None = None) -> PrecisionPlan:
    """Rule 3: ``plan`` as the converted model stores it, each decision a copy (the plan's own decisions, which a
    later plan may reuse, are left as they are) with what the report shows beside it: ``facts[node]`` (the front
    end's policy facts), ``unknown`` for an op the policy table does not know, ``macs`` where the front end counted
    them (on the graph before the rewrite put casts between its shapes), and ``fused[node]``: what a node the
    front end fused replaced, appended to its reason."""
    unknown = {node.name for node in view.nodes if node.unknown}
    stored = PrecisionPlan()
    for name in plan:
        decision = plan[name]
        evidence, reason = {**decision.evidence, **(facts or {}).get(name, {})}, decision.reason
        if name in unknown:
            evidence["unknown"] = True
        if macs.get(name) is not None:
            evidence["macs"] = macs[name]
        if fused and name in fused:
            evidence["fused"] = fused[name]
            reason = f"{reason}; {fused[name]}"
        stored[name] = dataclasses.replace(decision, reason=reason, evidence=evidence)
    return stored


def check_reconversion(where: str, done: str, wanted: str, fix: str, *, done_mode: str | None = None,
                       wanted_mode: str | None = None) -> None:
    """A conversion asked of ``where``, already converted by amppass to ``done``: log that it is returned
    unchanged when ``wanted`` (and ``wanted_mode``, where the front end has modes) is what it already is;
    otherwise raise :class:`InputError` naming both, ending with ``fix``."""
    if wanted_mode is None:
        was, asked = done, wanted
    else:
        was, asked = f"{done} ({done_mode} mode)", f"{wanted} ({wanted_mode} mode)"
    if wanted != done or done_mode not in (None, wanted_mode):
        raise InputError(f"{where} was already converted by amppass to {was}; it cannot be converted to {asked} "
                         f"on top of that: {fix}")
    log.warning("%s was already converted by amppass to %s; returned unchanged", where, was)


def fp8_record(fmt: str, low: str, products: Iterable[tuple[str, int | None, str]],
               **details: Any) -> dict[str, Any]:
    """Rule 5: the summary's ``fp8`` for the matrix products of a plan, each ``(precision, macs, why)``:
    ``precision`` "fp8", ``low`` (the plan's low dtype) or "fp32", its multiply-accumulates of one call where
    counted, and for a product not in fp8 its reason. ``details`` (how the scales are computed, the search's
    errors) follow."""
    by_precision = ("fp8", low, "fp32")
    counts, macs = dict.fromkeys(by_precision, 0), dict.fromkeys(by_precision, 0)
    why_not: dict[str, int] = {}
    for precision, count, why in products:
        counts[precision] += 1
        macs[precision] += count or 0
        if precision != "fp8":
            kind = fp8_why_not(why)
            why_not[kind] = why_not.get(kind, 0) + 1
    return {"format": fmt, "low": low, "products": counts, "macs": macs, "why_not": why_not, **details}


def fp8_shares(record: Mapping[str, Any]) -> dict[str, float] | None:
    """Each precision's share of the MACs an fp8 record (:func:`fp8_record`) counted, in its order (fp8, the low
    dtype, fp32); None where it counted none. Non-numbers (a damaged record) count as none."""
    macs = record.get("macs")
    keys = ("fp8", str(record.get("low")), "fp32")
    found = {k: macs.get(k) if isinstance(macs, Mapping) else None for k in keys}
    counts = {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else 0.0
              for k, v in found.items()}
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()} if total > 0 else None


def fp8_why_not(reason: str) -> str:
    """Why a product is not fp8 in a few words (:data:`FP8_WHY_NOT`), from its reason."""
    for kind, phrases in FP8_WHY_NOT:
        if any(phrase in reason for phrase in phrases):
            return kind
    clause = reason.split(": ", 1)[-1]  # after "stays bf16: "
    return clause.split(";")[0].split(":")[0].split(" (")[0][:80]


def stored_fp8_products(decisions: Iterable[Mapping[str, Any] | None],
                        low: str) -> Iterator[tuple[str, int | None, str]]:
    """The ``(precision, macs, why)`` of each matrix product among stored ``decisions`` (those whose evidence holds
    ``fp8``), as :func:`fp8_record` takes them; other entries (None, casts, other ops) are skipped."""
    for decision in decisions:
        if not isinstance(decision, Mapping) or decision.get("cast"):
            continue
        evidence = decision.get("evidence")
        outcome = evidence.get(FP8_KEY) if isinstance(evidence, Mapping) else None
        if not isinstance(evidence, Mapping) or not isinstance(outcome, Mapping):
            continue
        if outcome.get("format"):
            precision = "fp8"
        else:
            precision = low if decision.get("precision") in ("low", low) else "fp32"
        macs = evidence.get("macs")
        yield (precision, macs if isinstance(macs, int) and not isinstance(macs, bool) else None,
               str(outcome.get("why_not") or decision.get("reason") or ""))
