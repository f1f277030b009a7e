"""Which matrix products of a bf16 plan run in fp8: chosen per node from measured sensitivity, then lowered.

``amppass.convert(..., dtype="fp8")`` plans and rewrites the graph as for bf16, then :func:`plan_fp8` takes each
matrix product of the rewritten graph in turn (the lowering itself is :mod:`amppass.fx.rewrite.fp8`'s):

1. **Structure.** Only a product of an activation and a stored 2-D weight (a scale computed once, at conversion;
   :func:`amppass.fx.rewrite.fp8.operands`: a linear layer, ``addmm``/``mm``, ``x @ W``, ``bmm`` with the weight
   broadcast, a plain ``einsum``) the bf16 plan runs low, whose sizes are multiples of 16 (what
   ``torch._scaled_mm``'s fp8 kernels need) can be fp8. Every other product says why not: kept fp32 by the bf16
   plan, a convolution (torch has no fp8 convolution kernel), attention (SDPA has no fp8 kernel in torch) or
   another product of two activations (attention scores and their weighted sums: no stored operand for a scale
   computed at conversion), or a product with a stored operand that is not a linear layer's
   (:func:`amppass.fx.rewrite.fp8.not_lowered` says exactly why).
2. **Range.** With calibration data, the batches are split: the first ones give each product's input range (its
   static scale: the largest magnitude seen, mapped to e4m3's largest finite value), the last quarter (at least
   one batch, at most :data:`HELD_OUT`) is held out. On the held-out batches each candidate runs alone in fp8 on
   the inputs the fp32 model gave it: its local error ``||y_fp8 - y_fp32|| / ||y_fp32||``. A product whose local
   error exceeds :data:`RANGE_LIMIT` stays bf16: rounding to e4m3 moves one value by at most 2^-4 of itself, so
   an error beyond twice that is range, not rounding: an outlier that leaves the other values of a per-tensor
   scale in e4m3's subnormals or at zero, or held-out values beyond the calibrated range (clipped). The reason
   names the operand (input or weight) whose rounding alone moves the output more, and its largest-to-RMS ratio.
   Without calibration, the weights' ranges decide alone (the weight's own e4m3 error against the same limit)
   and each input's scale is computed on every call from its largest magnitude (dynamic); the report says so.
   **Granularity.** Each candidate is measured twice: with per-tensor scales (the input's static) and with row-wise
   ones (one per output channel of the weight, one per input row computed on every call). It takes row-wise scales
   where they leave less than :data:`~amppass.dtypes.FINER_SCALES_GAIN` of the per-tensor error and the target
   runs them (torch's CUDA row-wise kernels write bf16 only: an fp16 plan keeps per-tensor scales and says so);
   per-tensor ones otherwise.
3. **Tolerance.** With ``tolerance=``, the search goes on down one ordered lattice, fp8 → bf16 → fp32: the bf16
   search of :mod:`amppass.analysis.tolerance` has already moved what it must to fp32 against the whole
   tolerance; here the candidates are ranked by local error and the longest prefix of that ranking whose fp8
   lowering keeps the output error within the tolerance is kept (a binary search over the prefix length: the
   error grows with each product lowered); then each later candidate is tried on its own, in rank order, on top of
   those kept, and kept where the error stays within the tolerance (a product ranked late by its local error may
   matter little to the output). The others stay bf16, each with the two errors that decided it.
   **The error a trial is judged by** is a bound on the error of a batch the conversion never sees, not the error
   of the batches it measured: one plan's output error varies from batch to batch, and a search of many
   accept/reject steps keeps the steps that happened to measure low on its batches (MiniLM's real weights on
   English sentences, judged on its one held-out batch: 0.0198 there, 0.0195-0.0237 on ten batches of new
   sentences, eight of them beyond 0.02). So every trial runs on the last :data:`JUDGED` calibration batches (the
   held-out ones and the last that gave the scales: a static scale clips nothing on those, but their rounding,
   the error the search weighs, is a new batch's) and is judged by
   :func:`~amppass.analysis.tolerance.batch_bound`: the one-sided 95% prediction bound for one new batch, the
   mean of the n batches' errors plus Student's t (95%, n - 1 degrees of freedom) standard deviations of them
   times ``sqrt(1 + 1/n)``, at least the largest. The summary records the kept plan's error on each
   judged batch (``batch_errors``), their largest (``output_error``), the bound (``error_bound``) and what it adds
   to the largest (``margin``). A trial stops at its first judged batch beyond the tolerance, which the bound
   cannot be within (:class:`~amppass.analysis.tolerance.JudgedTrials`: the same decisions, fewer batch runs).

Every product's outcome is in its row's evidence (``fp8``: format, granularity and scales, or ``why_not``), and the
summary's ``fp8`` holds the multiply-accumulates in fp8, bf16 and fp32.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import fx

from ...analysis.calibration import relative_error
from ...analysis.record import META_KEY, fp8_record, stored_fp8_products
from ...analysis.tolerance import JUDGED, BatchError, JudgedTrials, judged, longest_within
from ...dtypes import E4M3, FINER_SCALES_GAIN
from ..capture.copies import shared_copy
from ..capture.guards import GUARDS_KEY
from ..capture.inputs import flatten_inputs, split_batch
from ..rewrite.fp8 import (
    FP8_ALIGNMENT,
    ROW,
    TENSOR,
    Fp8Product,
    fp8_evidence,
    fp8_linear,
    fp8_linear_rowwise,
    lower,
    mark,
    not_lowered,
    operands,
)
from ..view import ops

log = logging.getLogger(__name__)

RANGE_LIMIT = 2 * 2.0 ** -4  # twice the largest relative rounding error of one e4m3 value (3 significand bits)
HELD_OUT = 2  # at most this many calibration batches are held out for the errors
_CONVOLUTIONS = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                 "conv_transpose3d"}
_MATMULS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention"}


@dataclass
class _Measured:
    """What the held-out batches showed of one candidate."""

    local_error: float = 0.0  # with per-tensor scales (the input's static)
    row_error: float = 0.0  # with row-wise scales
    input_error: float = 0.0  # the output's error with the input alone in e4m3, largest over batches
    weight_error: float = 0.0  # with the weight alone in e4m3
    input_ratio: float = 0.0  # the input's largest magnitude over its RMS
    held_out_amax: float = 0.0
    seen: int = 0


@dataclass
class _Data:
    """The calibration batches as this pass uses them."""

    amax: dict[str, float] = field(default_factory=dict)
    measured: dict[str, _Measured] = field(default_factory=dict)
    held_out: list[list] = field(default_factory=list)  # the graph inputs of each held-out batch
    judged: list[list] = field(default_factory=list)  # those of each batch the tolerance search judges on
    references: list[list[torch.Tensor]] = field(default_factory=list)  # the fp32 outputs of each judged batch
    separate: bool = True  # whether the held-out batches are not also the calibration ones


def plan_fp8(gm: fx.GraphModule, fp32_gm: fx.GraphModule, weights: Mapping[str, torch.Tensor],
             calibration: Iterable[Any] | None, tolerance: float | None, low: str = "bf16") -> dict[str, Any]:
    """Choose the products of ``gm`` (rewritten for bf16 in place) that run in fp8 and their scales' granularity,
    lower them, record every product's outcome on its node; the summary for the model's record. ``fp32_gm`` is the
    graph before the rewrite, ``weights`` each linear node's fp32 weight
    (:func:`amppass.fx.rewrite.fp8.linear_weights`) and ``low`` the plan's low type, its products' output."""
    why_not: dict[str, str] = {}
    candidates: list[str] = []
    for node in gm.graph.nodes:
        why = _structure(node, gm, weights)
        if why is None:
            continue
        if why:
            why_not[node.name] = why
        else:
            candidates.append(node.name)
    structural = len(why_not)
    data = _measure(fp32_gm, candidates, weights, calibration) if calibration is not None and candidates else None
    chosen: dict[str, Fp8Product] = {}
    local: dict[str, float] = {}
    granularity_why: dict[str, str] = {}
    no_rows = _rowwise_missing(low)
    for name in candidates:
        weight = weights[name]
        if data is None:
            errors = {TENSOR: _rounding_error(weight, TENSOR), ROW: _rounding_error(weight, ROW)}
            granularity, granularity_why[name] = _granularity(errors, no_rows, "the weight's own e4m3 error")
            error = errors[granularity]
            if error > RANGE_LIMIT:
                why_not[name] = (f"stays bf16: its weight's own e4m3 error is {error:.3g} ({granularity_why[name]}), "
                                 f"beyond {RANGE_LIMIT:g} (twice e4m3's largest rounding error of one value): its "
                                 f"largest magnitude is {_ratio(weight):.3g}x its RMS, so a scale leaves the others "
                                 "to e4m3's subnormals or zero")
                continue
            chosen[name], local[name] = Fp8Product(name, weight, None, granularity), error
            continue
        seen = data.measured[name]
        errors = {TENSOR: seen.local_error, ROW: seen.row_error}
        granularity, granularity_why[name] = _granularity(errors, no_rows, "local error on held-out inputs")
        if errors[granularity] > RANGE_LIMIT:
            why_not[name] = f"{_range_reason(seen, weight, data.amax[name], data.separate)}; {granularity_why[name]}"
            continue
        chosen[name], local[name] = Fp8Product(name, weight, data.amax[name], granularity), errors[granularity]
    search: dict[str, Any] = {}
    if tolerance is not None and data is not None and chosen:
        chosen, search = _lattice(gm, chosen, local, data, tolerance, why_not)
    lower(gm, chosen)
    for name, product in chosen.items():
        _mark_chosen(gm, product, local[name], granularity_why[name], data)
    for name, why in why_not.items():
        evidence: dict[str, Any] = {"why_not": why}
        if data is not None and name in data.measured:
            evidence["local_error"] = data.measured[name].local_error
        mark(gm, name, evidence, why)
    decisions = (node.meta.get(META_KEY) for node in gm.graph.nodes)
    info = fp8_record(E4M3.name, low, stored_fp8_products(decisions, low), range_limit=RANGE_LIMIT,
                      scales="weights: once at conversion; inputs: " + (
                          "static, from calibration" if data is not None
                          else "dynamic, from each call's range (no calibration)")
                      + "; row-wise products: per weight channel at conversion, per input row on every call",
                      row_wise=sum(p.granularity == ROW for p in chosen.values()), **search)
    if data is not None:
        info["held_out_batches"] = len(data.held_out)
        info["held_out_separate"] = data.separate
    log.info("fp8: %d of %d products in %s", len(chosen), len(candidates) + structural, E4M3.name)
    return info


def _rowwise_missing(low: str) -> str:
    """Why this plan's products cannot have row-wise scales ("" where they can): torch's row-wise fp8 kernels
    (``torch._scaled_mm`` with an (M, 1) and a (1, N) scale, on CUDA 8.9 and later) write bf16 only."""
    return "" if low == "bf16" else (f"torch._scaled_mm's row-wise fp8 kernels write bf16 only and this plan's "
                                     f"products output {low}")


def _granularity(errors: Mapping[str, float], no_rows: str, measure: str) -> tuple[str, str]:
    """Per-tensor or row-wise scales for one product, from ``errors`` (the same ``measure`` under each), and why:
    row-wise where it removes more than a tenth of the per-tensor error
    (:data:`~amppass.dtypes.FINER_SCALES_GAIN`) and the target runs it; per-tensor otherwise."""
    if no_rows:
        return TENSOR, (f"per-tensor scales: row-wise ones would give {measure} {errors[ROW]:.3g} against "
                        f"{errors[TENSOR]:.3g}, but {no_rows}")
    if errors[ROW] < FINER_SCALES_GAIN * errors[TENSOR]:
        return ROW, f"row-wise scales: {measure} {errors[ROW]:.3g}, against {errors[TENSOR]:.3g} per tensor"
    return TENSOR, (f"per-tensor scales: {measure} {errors[TENSOR]:.3g}; row-wise ones give {errors[ROW]:.3g}, "
                    f"not below {FINER_SCALES_GAIN:g}x that, which does not pay for a range computed on every call")


def _mark_chosen(gm: fx.GraphModule, product: Fp8Product, error: float, granularity_why: str,
                 data: _Data | None) -> None:
    """Record a product lowered to fp8 on its node: its scales (:func:`~amppass.fx.rewrite.fp8.fp8_evidence`), its
    error, why its granularity, and a reason."""
    if product.granularity == ROW:
        where = "one scale per weight channel at conversion and per input row on every call"
    elif product.input_scale is not None:
        where = "per-tensor scales (weight's at conversion, input's static, from calibration)"
    else:
        where = "per-tensor scales (weight's at conversion, input's from its largest magnitude on every call)"
    measured = (f"local error {error:.3g} on held-out inputs" if data is not None
                else f"weight's own e4m3 error {error:.3g} (chosen from the weight's range alone: no calibration)")
    evidence = {**fp8_evidence(product), "local_error": error, "granularity_reason": granularity_why}
    if data is not None and product.input_scale is not None and data.measured[product.node].held_out_amax > 0:
        # how far the held-out inputs stay below the calibrated range (below 1: they were clipped)
        evidence["input_headroom"] = (product.input_amax or 0.0) / data.measured[product.node].held_out_amax
    mark(gm, product.node, evidence, f"fp8: e4m3 input and weight with {where}, fp32 accumulation, bf16 output; "
                                     f"{measured}, within {RANGE_LIMIT:g}; {granularity_why}")


def _structure(node: fx.Node, gm: fx.GraphModule, weights: Mapping[str, torch.Tensor]) -> str | None:
    """None for a node that is no matrix product; "" for an fp8 candidate; why not otherwise (module docstring, 1)."""
    meta = node.meta.get(META_KEY)
    if node.op != "call_function" or not meta or meta.get("cast"):
        return None
    name = ops.op_name(node, gm)
    if name not in {"linear", *_MATMULS, *_CONVOLUTIONS, *_ATTENTION}:
        return None
    if meta.get("precision") != "low":
        return "not fp8: the bf16 plan keeps this product in fp32"
    if name in _CONVOLUTIONS:
        return ("stays bf16: torch has no fp8 convolution kernel (torch._scaled_mm is a matrix product), on this "
                "target or any")
    if name in _ATTENTION:
        return ("stays bf16: attention's score and value products run inside one SDPA kernel, which torch has in "
                "bf16 and not in fp8")
    weight = weights.get(node.name)
    if weight is None:
        return f"stays bf16: {not_lowered(node) or 'its stored weight is not one 2-D matrix'}"
    out_features, in_features = weight.shape
    if in_features % FP8_ALIGNMENT or out_features % FP8_ALIGNMENT:
        return (f"stays bf16: its sizes (in {in_features}, out {out_features}) are not multiples of "
                f"{FP8_ALIGNMENT}, which torch._scaled_mm's fp8 kernels need")
    return ""


def _measure(fp32_gm: fx.GraphModule, candidates: list[str], weights: Mapping[str, torch.Tensor],
             calibration: Iterable[Any]) -> _Data | None:
    """Input ranges on the calibration batches, then each candidate's local error on the held-out ones (module
    docstring, 2); None where no batch fits the captured graph's shapes."""
    guards = fp32_gm.meta.get(GUARDS_KEY)
    flats = []
    for index, batch in enumerate(calibration):
        args, kwargs = split_batch(batch)
        if guards is None or guards.mismatch(args, kwargs) is None:
            flats.append(flatten_inputs(fp32_gm, args, kwargs, index))
    if not flats:
        return None
    held = min(HELD_OUT, max(1, len(flats) // 4))
    data = _Data(separate=len(flats) > 1)
    first = flats[:-held] if data.separate else flats
    data.held_out = flats[-held:]
    judged_from = len(flats) - min(JUDGED, len(flats))
    wanted = set(candidates)

    def judge(index: int, flat: list, outputs: Any) -> None:
        """Keep batch ``index`` and its fp32 ``outputs`` where it is one of the last :data:`JUDGED`."""
        if index >= judged_from:
            data.judged.append(flat)
            data.references.append(_floating(outputs))

    with torch.no_grad():
        ranges = _Probe(fp32_gm, wanted, lambda name, x, bias, out: _fold_amax(data.amax, name, x))
        for index, flat in enumerate(first):
            judge(index, flat, ranges.run(*flat, enable_io_processing=False))
        data.measured = {name: _Measured() for name in candidates}

        def held_out(name: str, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
            weight = weights[name]
            seen = data.measured[name]
            low_bias = None if bias is None else bias.to(torch.bfloat16)
            tensor = Fp8Product(name, weight, data.amax.get(name, 0.0))
            y = fp8_linear(x.to(torch.bfloat16), tensor.stored_weight(), tensor.weight_scales,
                           torch.tensor(tensor.input_scale), low_bias)
            seen.local_error = max(seen.local_error, relative_error(y, out))
            row = Fp8Product(name, weight, None, ROW)
            y = fp8_linear_rowwise(x.to(torch.bfloat16), row.stored_weight(), row.weight_scales, low_bias)
            seen.row_error = max(seen.row_error, relative_error(y, out))
            # each operand's share, per tensor: the output with only that operand rounded to e4m3
            x_read = tensor.read_input(x.reshape(-1, x.shape[-1])).reshape(x.shape)
            seen.input_error = max(seen.input_error, relative_error(F.linear(x_read, weight, bias), out))
            seen.weight_error = max(seen.weight_error, relative_error(F.linear(x, tensor.read_weight(), bias), out))
            seen.input_ratio = max(seen.input_ratio, _ratio(x))
            seen.held_out_amax = max(seen.held_out_amax, float(x.abs().amax()) if x.numel() else 0.0)

        for index, flat in enumerate(data.held_out, start=len(flats) - held):
            outputs = _Probe(fp32_gm, wanted, held_out).run(*flat, enable_io_processing=False)
            if data.separate:
                judge(index, flat, outputs)
    return data


class _Probe(fx.Interpreter):
    """Runs the fp32 graph and hands each candidate's input, bias (or None) and output to ``seen``."""

    def __init__(self, gm: fx.GraphModule, wanted: set[str], seen: Any):
        super().__init__(gm)
        self.wanted, self.seen = wanted, seen

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.wanted:
            found = operands(n)
            assert found is not None, n.name  # a candidate is a product with a stored weight
            x, bias = (self.env[v] if isinstance(v, fx.Node) else v for v in (found[0], found[2]))
            self.seen(n.name, x, bias, result)
        return result


def _fold_amax(amax: dict[str, float], name: str, x: torch.Tensor) -> None:
    value = float(x.detach().abs().amax()) if x.numel() else 0.0
    amax[name] = max(amax.get(name, 0.0), value) if math.isfinite(value) else amax.get(name, 0.0)


def _lattice(gm: fx.GraphModule, chosen: dict[str, Fp8Product], local: Mapping[str, float], data: _Data,
             tolerance: float, why_not: dict[str, str]) -> tuple[dict[str, Fp8Product], dict[str, Any]]:
    """The candidates whose fp8 lowering keeps the bound on a new batch's output error within ``tolerance`` (module
    docstring, 3): the longest prefix of the ranking by local error, then each later candidate on its own, in rank
    order, on top of those kept; a reason for each candidate left out."""
    ranked = sorted(chosen, key=lambda n: local[n])

    def start(names: frozenset[str]) -> BatchError:
        """The output error of one judged batch with ``names`` in fp8 (the trial lowered once)."""
        trial = shared_copy(gm)
        lower(trial, {n: chosen[n] for n in names})

        def error(batch: int) -> float:
            with torch.no_grad():
                outputs = _floating(trial(*data.judged[batch]))
            return max((relative_error(out, ref) for out, ref in zip(outputs, data.references[batch], strict=True)),
                       default=0.0)

        return error

    trials = JudgedTrials(start, len(data.judged), tolerance)
    low = longest_within(len(ranked), lambda k: trials.error(ranked[:k]) <= tolerance)
    kept = ranked[:low]
    for rank, name in enumerate(ranked[low:], start=low + 1):
        if trials.error([*kept, name]) <= tolerance:
            kept.append(name)
            continue
        why_not[name] = (f"stays bf16: the tolerance search (fp8 -> bf16 -> fp32) ranked the products by local error "
                         f"in fp8 (this one {local[name]:.3g}, rank {rank} of {len(ranked)}); with the {len(kept)} "
                         f"kept in fp8 the bound on a new batch's output error is {trials.words(kept)} (from "
                         f"{len(data.judged)} calibration batches), and with this one too "
                         f"{trials.words([*kept, name])}, beyond tolerance {tolerance:g}")
    log.info("fp8 tolerance search: %d of %d candidates kept, %d trials, %d batch runs", len(kept), len(ranked),
             len(trials.seen), trials.runs)
    return {n: chosen[n] for n in kept}, {"tolerance": tolerance, **judged(trials.measured(kept)),
                                          "trials": len(trials.seen), "batch_runs": trials.runs}


def _range_reason(seen: _Measured, weight: torch.Tensor, amax: float, separate: bool) -> str:
    """Why a product whose local error is beyond :data:`RANGE_LIMIT` stays bf16 (module docstring, 2)."""
    if seen.input_error >= seen.weight_error:
        operand, ratio = "input", seen.input_ratio
    else:
        operand, ratio = "weight", _ratio(weight)
    clipped = (f"; held-out inputs reach {seen.held_out_amax:.3g}, beyond the calibrated {amax:.3g}, and are "
               "clipped" if separate and seen.held_out_amax > amax else "")
    return (f"stays bf16: in e4m3 its output moves by {seen.local_error:.3g} on held-out inputs, beyond "
            f"{RANGE_LIMIT:g} (twice e4m3's largest rounding error of one value): its {operand}'s largest magnitude "
            f"is {ratio:.3g}x its RMS, so one per-tensor scale leaves the other values to e4m3's subnormals or zero"
            f"{clipped}")


def _rounding_error(weight: torch.Tensor, granularity: str) -> float:
    """``weight``'s own relative error stored in e4m3 with its scale(s) of ``granularity`` and read back."""
    return relative_error(Fp8Product("", weight, None, granularity).read_weight(), weight.detach())


def _ratio(tensor: torch.Tensor) -> float:
    """Largest magnitude over RMS (1 for a constant tensor, 0 for an all-zero one)."""
    values = tensor.detach().float()
    rms = float(values.pow(2).mean().sqrt()) if values.numel() else 0.0
    return float(values.abs().amax()) / rms if rms > 0 else 0.0


def _floating(value: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]

