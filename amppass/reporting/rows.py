"""The parts of a report every view reads: a :class:`Row` per node, the summary sentences, and the words the
views use for the report's two error measures. :class:`~amppass.reporting.report.Report` is built from these;
the views (:mod:`amppass.reporting.html`, :mod:`amppass.reporting.terminal`) take any object with ``rows``,
``info`` and ``stats()`` (:class:`Summarised`), so they never import the report class itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..analysis.record import fp8_record, fp8_shares, stored_fp8_products

SCHEMA_VERSION = 1
LOW_PRECISIONS = ("fp8", "fp16", "bf16")
PRECISIONS = ("fp8", "fp16", "bf16", "fp32", "-")
# what the report's "local error" and "output error" are, in words (HTML legend and tooltips, docs)
LOCAL_ERROR = ("local error: ||y_low - y_fp32|| / ||y_fp32|| for one node's output y when that node alone runs in "
               "low precision on inputs recorded from the fp32 model (first calibration batch). A ratio with no "
               "unit: 1e-3 means the output moved by 0.1% of its size (L2 norm). The tolerance search ranks nodes "
               "by it.")
OUTPUT_ERROR = ("output error: the largest ||out - out_fp32|| / ||out_fp32|| over the model's floating outputs and "
                "the calibration batches, the same unitless ratio for the whole converted model; the tolerance "
                "bounds it.")
# what select() takes: a precision, "low" for any below fp32, "none" for "-" (a word a shell passes as is)
PRECISION_FILTERS = ("fp8", "fp16", "bf16", "fp32", "low", "none")


@dataclass
class Row:
    """One node's decision as a user reads it.

    ``evidence`` holds what the decision rested on; the report reads these keys when present:
    ``macs`` (multiply-accumulates of one call, heavy ops only), ``absmax`` and ``min_nonzero`` (observed
    magnitudes, from calibration), ``unknown`` (op not in the policy table), ``local_error`` (see
    :data:`LOCAL_ERROR`; recorded for the nodes the tolerance search moved). Train-mode rows also carry
    ``backward`` (the dtype the op's gradient runs in), ``saved_bytes`` / ``saved_dtypes`` (what it saved for
    backward on the example) and, for a fused op, ``fused`` (what it replaced).
    """

    name: str
    op: str
    precision: str  # "fp8", "fp16", "bf16", "fp32" or "-" for nodes without floating-point work
    reason: str
    source: str
    casts: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)
    rule: str = ""  # the id of the rule that made the decision (amppass.analysis.plan); empty before it was stored

    @property
    def macs(self) -> int | None:
        """Multiply-accumulates of one call, where the front end could count them."""
        value = finite(self.evidence.get("macs"))
        return None if value is None else int(value)

    @property
    def local_error(self) -> float | None:
        """The node's local error (:data:`LOCAL_ERROR`), where the tolerance search recorded it."""
        return finite(self.evidence.get("local_error"))

    @property
    def observed(self) -> tuple[float, float | None] | None:
        """``(absmax, smallest non-zero magnitude)`` observed during calibration, if recorded and finite."""
        absmax, low = finite(self.evidence.get("absmax")), finite(self.evidence.get("min_nonzero"))
        return None if absmax is None else (absmax, low)


@dataclass
class OpGroup:
    """The rows of one op: how many in each precision, and their MACs where counted."""

    op: str
    by_precision: dict[str, int] = field(default_factory=dict)
    macs: int | None = None

    @property
    def nodes(self) -> int:
        """Nodes the group holds, over every precision."""
        return sum(self.by_precision.values())


def fp8_scales(row: Row) -> str:
    """An fp8 row's scales in a few words, from its evidence ``fp8`` (either front end's: ONNX per operand, torch
    per weight and input; per channel as a range), e.g. "scales: weight 0.00028, input 0.0087"; "" for other rows.
    Text from the file is cut short and never a format string."""
    fp8 = row.evidence.get("fp8")
    if row.precision != "fp8" or not isinstance(fp8, dict):
        return ""
    operands = fp8.get("operands")
    if isinstance(operands, list):  # ONNX: each quantized operand with its scale(s)
        said = [_scale_words("weight" if o.get("weight") is True else "input", o.get("weight_scales") or
                             o.get("scale")) for o in operands[:2] if isinstance(o, dict)]
    else:  # torch: the weight's and the input's
        said = [_scale_words(kind, fp8.get(f"{kind}_scales") or fp8.get(f"{kind}_scale")) for kind in
                ("weight", "input")]
    said = [words for words in said if words]
    return "scales: " + ", ".join(said) if said else ""


def _scale_words(kind: str, scale: Any) -> str:
    """One operand's scale: a number, a per-channel range (``{"min", "max"}``), or how it is computed (text)."""
    if isinstance(scale, dict) and None not in (low := finite(scale.get("min")), high := finite(scale.get("max"))):
        return f"{kind} per channel {low:.3g} to {high:.3g}"
    number = finite(scale)
    if number is not None:
        return f"{kind} {number:.3g}"
    return f"{kind} {scale[:40]}" if isinstance(scale, str) else ""


def decision_order(rows: list[Row]) -> list[int]:
    """The positions of ``rows`` with the decisions that matter first, as the views list them: heavy ops (MACs
    counted), fp32 ones first and the largest first; then the rest of the floating-point work, fp32 first; then
    the nodes without floating-point work (constants, shapes). Graph order within each."""
    def key(i: int) -> tuple:
        row = rows[i]
        return row.macs is None, row.precision == "-", row.precision != "fp32", -(row.macs or 0), i

    return sorted(range(len(rows)), key=key)


class Summarised(Protocol):
    """What the views read of a report."""

    rows: list[Row]
    info: dict[str, Any]

    def stats(self) -> dict[str, Any]:
        """The report's counts, as the summary reads them."""
        ...


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool) a float can hold, else None: numbers come
    from a model's stored report, where JSON's integers have no bound (``10**400`` overflows ``float``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def summary_lines(report: Summarised) -> list[str]:
    """The summary as short sentences, shared by :meth:`Report.summary` and the terminal view."""
    info, stats = report.info, report.stats()
    counts = stats["by_precision"]
    parts = ", ".join(f"{counts[p]} {p}" for p in PRECISIONS if p in counts)
    lines = [
        f"amppass {info.get('front_end', '')} plan, {target_phrase(info)} ({info.get('mode', 'inference')}): "
        f"{_count(stats['nodes'], 'node')}: {parts}",
    ]
    macs = stats["macs"]
    if macs["total"]:
        lines.append(
            f"heavy compute in {info.get('dtype')}{' or fp8' * ('fp8' in counts)}: {macs['low_share']:.1%} of "
            f"{macs['total']:,} MACs "
            f"({macs['counted_nodes']} matmul, conv, attention or RNN nodes)"
        )
    by_parts = info.get("parts")
    if isinstance(by_parts, dict) and isinstance(by_parts.get("converted"), list):
        lines.extend(_parts_lines(by_parts))
    fp8 = fp8_summary(report)
    if fp8 is not None:
        lines.extend(_fp8_lines(fp8))
    lines.append(f"casts inserted: {stats['casts']}")
    before, after = stats["weight_bytes"]["before"], stats["weight_bytes"]["after"]
    if before:
        lines.append(f"weight bytes: {before:,} -> {after:,} ({after / before:.2f} of fp32)")
    backward = info.get("backward")
    saved = finite(backward.get("saved_bytes")) if isinstance(backward, dict) else None
    if saved is not None and isinstance(backward, dict):
        split = backward.get("saved_bytes_by_dtype")
        split = ", ".join(f"{d} {n:,}" for d, n in split.items() if finite(n) is not None) \
            if isinstance(split, dict) else ""
        lines.append(f"saved for backward by one forward on the example: {int(saved):,} bytes"
                     + (f" ({split})" if split else ""))
    if stats["sources"]:
        lines.append("decided by: " + ", ".join(f"{n} {s}" for s, n in stats["sources"].items()))
    if stats["moved_by_tolerance"] is not None:
        moved = stats["moved_by_tolerance"]
        lines.append(f"moved to fp32 by the tolerance search: {moved} node{'' if moved == 1 else 's'}")
    achieved, limit = finite(info.get("achieved_error")), finite(info.get("tolerance"))
    if achieved is not None and limit is not None:
        held = finite(info.get("held_out_error"))
        lines.append(f"output error {achieved:.3g} against a tolerance of {limit:.3g}"
                     + ("" if info.get("tolerance_met", True) else " (not met)")
                     + (f"; {held:.3g} on inputs the search held out" if held is not None else ""))
    profit = info.get("profitability")
    if isinstance(profit, dict) and finite(profit.get("nodes_fp32")) is not None:
        lines.extend(_speed_lines(profit, str(info.get("dtype", "low precision"))))
    lines.extend(_whole_model_lines(report, profit))
    fixed = info.get("fixed_dims")
    if isinstance(fixed, list) and fixed:
        lines.append("sizes fixed at the example's in the file (the export does not run at others): "
                     + ", ".join(map(str, fixed)))
    if stats["unknown_ops"]:
        lines.append("ops not in the policy table (followed their inputs): " + ", ".join(stats["unknown_ops"]))
    if not stats["calibrated"]:
        lines.append("uncalibrated: decisions come from op semantics and weights only")
    return lines


def fp8_summary(report: Summarised) -> dict[str, Any] | None:
    """An fp8 plan's record (``info["fp8"]``) in the shape :func:`amppass.analysis.record.fp8_record` writes; None
    for a plan that is not fp8. A record saved before that shape (its products one number, an ONNX plan's MACs of
    its low dtype under "low") has its products and reasons counted from the rows, its MACs as recorded."""
    fp8, low = report.info.get("fp8"), str(report.info.get("dtype"))
    if not isinstance(fp8, dict):
        return None
    if isinstance(fp8.get("products"), dict) and isinstance(fp8.get("macs"), dict):
        return fp8
    # an older ONNX record marked only the products in fp8; a candidate left out holds its error alone in fp8
    rows = [{"precision": r.precision, "reason": r.reason, "evidence": {"fp8": {"why_not": r.reason}, **r.evidence}
             if "fp8_error_alone" in r.evidence else r.evidence} for r in report.rows]
    record = fp8_record(str(fp8.get("format", "fp8")), low, stored_fp8_products(rows, low))
    macs = fp8.get("macs")
    if isinstance(macs, dict):
        record["macs"] = {"fp8": macs.get("fp8"), low: macs.get(low, macs.get("low")), "fp32": macs.get("fp32")}
        if "counted_at" in macs:
            record["counted_at"] = macs["counted_at"]
    return {**fp8, **record}


def _fp8_lines(fp8: dict[str, Any]) -> list[str]:
    """The summary's lines on an fp8 plan (:func:`fp8_summary`): its matrix products and their MACs in fp8, the
    plan's low dtype and fp32, how scales are computed, and the products not in fp8 counted by why."""
    products, shares = fp8["products"], fp8_shares(fp8)
    total = sum(finite(products.get(k)) or 0 for k in ("fp8", str(fp8.get("low")), "fp32"))
    said = ", ".join(f"{k} {share:.1%}" for k, share in shares.items()) if shares else "not counted"
    where = " at the first calibration batch's shapes" if isinstance(fp8.get("counted_at"), dict) else ""
    line = (f"fp8 ({str(fp8.get('format'))[:16]}): {int(finite(products.get('fp8')) or 0)} of {int(total)} matrix "
            f"products; MACs{where}: {said}")
    if isinstance(fp8.get("scales"), str):
        line += f"; scales: {fp8['scales']}"
    why_not = fp8.get("why_not")
    counts = sorted(((int(n), str(kind)) for kind, n in why_not.items() if finite(n)), key=lambda c: (-c[0], c[1])) \
        if isinstance(why_not, dict) else []
    if not counts:
        return [line]
    return [line, "not fp8: " + "; ".join(f"{n} {kind}" for n, kind in counts)
            + " (Report.fp8_rows(): each product's scales, or why it is not fp8)"]


# how the speed check knew a group's fp32 and low-precision times (amppass.analysis.profitability, rule 2), in
# plain words
_TIMING_WORDS = {
    "measured": "timed on this machine",
    "cached": "timed on this machine by an earlier conversion (kept in the timing cache)",
    "table": "read from the cost table passed as costs=",
    "prior": "estimated from a one-time speed probe of this device (the 'prior'), because the machine was too busy "
             "to time them steadily",
    "device": "not timed: {dtype} cannot be faster on this CPU",
    "unmeasured": "not timed, as their ops cannot run on their own: kept as planned",
    "low kernel failed": "not timed: their {dtype} kernel failed, so they run fp32",
}


def _timing_words(how: str, dtype: str) -> str:
    """How a group's speed was known, in words: a kind this amppass knows in its words (with ``dtype`` filled
    in), any other kind (a file's own text) as it is, never as a format string."""
    return _TIMING_WORDS[how].replace("{dtype}", dtype) if how in _TIMING_WORDS else how


def _count(n: Any, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _speed_lines(profit: dict[str, Any], dtype: str) -> list[str]:
    """The speed check (:mod:`amppass.analysis.profitability`) in words a newcomer reads: what stayed fp32 and why,
    and how each group's speed was known (what to do when the machine was too busy follows the whole-model line)."""
    nodes, groups = profit.get("nodes_fp32"), profit.get("regions_fp32")
    if nodes:
        lines = [f"speed check: {_count(nodes, 'node')} in {_count(groups, 'group')} of connected {dtype} ops stay "
                 f"fp32, because {dtype} (with its casts) was judged no faster than fp32 for them on this machine"]
    else:
        lines = [f"speed check: no {dtype} op stays fp32 for speed: {dtype} was judged faster than fp32 on this "
                 "machine wherever it was checked"]
    timing = profit.get("timing")
    if isinstance(timing, dict) and timing:
        said = [f"{_count(n, 'group')} {_timing_words(how, dtype)}" for how, n in timing.items()]
        lines.append("how the speed of each group of connected ops was known: " + "; ".join(said))
    device = profit.get("device")
    if isinstance(device, dict) and device.get("native_low") is False:
        lines.append(f"not timed: {device.get('why')}")
    return lines


def _whole_model_lines(report: Summarised, profit: Any) -> list[str]:
    """The converted graph against the original module as a whole, and the advice that fits the reason: when the
    original was returned (a row of rule ``whole-model``, :mod:`amppass.serving.fp32_original`), why and how to
    convert anyway; when the machine was too busy to time, how to time; a time never measured is said in words."""
    info = report.info
    whole: dict[str, Any] = info["whole_model"] if isinstance(info.get("whole_model"), dict) else {}
    skipped = whole.get("skipped") if isinstance(whole.get("skipped"), str) else None
    converted, original = finite(whole.get("converted_ms")), finite(whole.get("original_ms"))
    lines = []
    if skipped is None and None not in (converted, original):
        lines.append(f"whole model per call: {converted:.3g} ms converted, {original:.3g} ms for the original module "
                     "in fp32")
    device: dict[str, Any] = (profit["device"] if isinstance(profit, dict) and isinstance(profit.get("device"), dict)
                              else {})
    dtype = info.get("dtype", "low precision")
    if any(row.rule == "whole-model" for row in report.rows):  # the original module came back, in fp32
        if device.get("native_low") is False:
            lines.append(f"returned: your original module, in fp32, unchanged: this CPU has no {dtype} instructions, "
                         f"so {dtype} runs slower than fp32 here and no op was converted")
            lines.append(f"to convert it anyway: plan_for='coverage' runs in {dtype} every op the numerics allow (the "
                         "same plan on every machine; slower on this CPU); to plan for the machine the model will "
                         f"run on, convert there (a CPU with {dtype} instructions), or pass target='cuda' for a GPU")
        else:
            why = ("the converted graph was not faster than it here" if skipped is None and converted is not None
                   else skipped or "the converted graph was not timed against it")
            lines.append(f"returned: your original module, in fp32, unchanged: {why}")
            lines.append("to convert it anyway: plan_for='coverage' runs low every op the numerics allow (the same "
                         "plan on every machine), or pass costs= from a conversion made on the machine the model "
                         "will run on")
        return lines
    if skipped is not None:
        lines.append(f"whole model: not timed against your original module in fp32, because {skipped}; the "
                     "converted graph is used without that check")
    estimated = isinstance(profit, dict) and isinstance(profit.get("timing"), dict) and "prior" in profit["timing"]
    if estimated or skipped is not None:
        lines.append("to time on this machine instead: convert again when it is idle (`uptime` shows its load), or "
                     "pass costs= from a conversion made on an idle machine")
    return lines


def _parts_lines(parts: dict[str, Any]) -> list[str]:
    """A model converted by parts: which parts, the model-wide share of multiply-adds run low, what runs eagerly."""
    eager: dict[str, Any] = parts["eager"] if isinstance(parts.get("eager"), dict) else {}
    converted = parts["converted"]
    lines = [f"converted by parts (the whole model does not capture: {parts.get('why_whole')}): "
             f"{len(converted)} part{'' if len(converted) == 1 else 's'}: {', '.join(map(str, converted))}"]
    total, low = finite(parts.get("macs_total")), finite(parts.get("macs_low"))
    if total and low is not None:
        lines.append(f"heavy compute of the whole model, eager code included: {low / total:.1%} of "
                     f"{int(total):,} MACs in low precision")
    lines.extend(f"runs as the model's own code, in fp32: {path} ({why})" for path, why in eager.items())
    return lines


def target_phrase(info: dict[str, Any]) -> str:
    """The dtype and what the plan was made for, in words: "bf16 for cpu (torch 2.13.0 on cpu)"."""
    target = info.get("target")
    if not isinstance(target, dict) or not isinstance(target.get("name"), str):
        return f"target {info.get('dtype')}"  # converted by an amppass without targets
    return f"{info.get('dtype')} for {target['name']} ({target.get('runtime', '?')})"
