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
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping, Protocol

from .._version import __version__
from ..errors import InputError
from .plan import PrecisionPlan
from .view import GraphView

log = logging.getLogger(__name__)

META_KEY = "amppass"


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
