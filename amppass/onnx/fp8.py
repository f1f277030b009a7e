"""fp8 matrix products in an ONNX plan: which products take e4m3 inputs, and the ``QuantizeLinear`` /
``DequantizeLinear`` pairs that say so in the file.

An fp8 plan is the fp16 plan of the same model with some matrix products (MatMul, Gemm, Conv) lowered further:
both operands of such a product reach it through a Q/DQ pair in :data:`~amppass.dtypes.E4M3`, the form TensorRT
reads as an fp8 product (ONNX opset 19 and later: :data:`FP8_OPSET`):

- a weight (an initializer) is stored once as a ``FLOAT8E4M3FN`` initializer, read through a ``DequantizeLinear``
  with its scale: one per tensor, from the weight's largest magnitude, or one per output channel (a 1-D scale and
  zero point, the ``DequantizeLinear``'s ``axis`` the channels'; opset 19 allows it for float8, and onnxruntime's
  CPU provider runs it) where that leaves less than :data:`~amppass.dtypes.FINER_SCALES_GAIN` of the weight's own
  per-tensor e4m3 error (:func:`weight_scales`, ``_weight_operand``);
- an activation goes through ``QuantizeLinear`` -> ``DequantizeLinear`` with a static per-tensor scale from the
  range calibration observed (:meth:`~amppass.dtypes.Fp8Format.scale_for` gives both scales);
- the scales are stored in the product's own dtype (fp16: ``QuantizeLinear`` takes its input and scale in one
  type, and ``DequantizeLinear`` gives the scale's type), so the product reads fp16 as in the fp16 plan and
  accumulates and writes fp16. A scale is kept within fp16's normal range, so it never rounds to zero or inf.

Which products go fp8 (:func:`choose`): every product the fp16 plan runs low whose operands are weights or values
calibration observed is a candidate. Each trial of the tolerance search (the conversion's rewrite, run as the target
computes it) measures the model's output error on each of the judged batches, and is judged by a bound on a new
batch's error from them, :func:`~amppass.analysis.tolerance.batch_bound` (the one-sided 95% prediction bound, at
least the largest), as the torch front end's search is (docs/fp8.md, "Which products go fp8", 4): not by the largest
error of the batches it measured, which a search of many accept/reject steps fits. The judged batches are the last
:data:`~amppass.analysis.tolerance.JUDGED` calibration batches (a single batch with the perturbed copies of it the
fp16 plan's search kept). Candidates go fp8 in order of that bound with each alone in e4m3, least first, as many as
keep the bound within the tolerance (a bisection over that order). A trial stops at its first judged batch beyond
the tolerance (:class:`~amppass.analysis.tolerance.JudgedTrials`); the order is the one judging every batch gives.
Every product that stays fp16 gets a reason with
the bounds measured (and its operands' ranges and scales, where an outlier sets one), and each fp8 product's
decision carries its scales (``evidence["fp8"]``) for the report; every other product (a candidate left out, or one
that is no candidate: kept fp32 by the plan, an operand calibration did not observe) carries why
(``evidence["fp8"]["why_not"]``). :func:`record` writes the summary's ``fp8`` in the shape both front ends share
(:func:`amppass.analysis.record.fp8_record`), with the kept plan's error on each judged batch and the bound, under
the torch record's names (:func:`amppass.analysis.tolerance.judged`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx import helper

from ..analysis.calibration import Trials
from ..analysis.plan import Decision, Precision, PrecisionPlan
from ..analysis.record import FP8_KEY, fp8_record
from ..analysis.tolerance import JUDGED, BatchError, JudgedTrials, batch_bound, judged, longest_within
from ..dtypes import FINER_SCALES_GAIN, Fp8Format, LowType
from .io.weight_store import WeightStore
from .macs import is_heavy, node_macs, operands, value_shapes
from .rewrite import _set_meta, all_names, unique_name
from .view import clear_value_info

log = logging.getLogger(__name__)

FP8_OPSET = 19  # QuantizeLinear / DequantizeLinear take float8 types from opset 19
PRODUCTS = ("MatMul", "Gemm", "Conv")
OPERANDS = (0, 1)  # the inputs quantized: MatMul's A and B, Gemm's A and B, Conv's X and W
KEY = FP8_KEY  # evidence key of a product's fp8 outcome: its format and scales, or why it is not fp8
SCALES = "weights: once at conversion, per tensor; activations: static, per tensor, from calibration"


@dataclass(frozen=True)
class Operand:
    """One quantized input of a product: its fp32 value, whether it is a weight, its range and stored scale; a
    weight with one scale per output channel has that channel's ``axis``, ``scale`` is then the largest of them and
    ``channels`` says how many and their smallest; ``why`` says why one scale or several (:func:`weight_scales`)."""

    value: str
    weight: bool
    absmax: float
    scale: float
    axis: int | None = None
    channels: tuple[int, float] | None = None
    why: str = ""


def candidates(model: onnx.ModelProto, plan: PrecisionPlan, stats: Any, store: WeightStore, fmt: Fp8Format,
               low: LowType) -> tuple[dict[str, list[Operand]], dict[str, str]]:
    """Product node -> its operands, for every MatMul, Gemm and Conv of ``model``'s main graph (the fp32 model)
    that ``plan`` runs low and whose two operands are weights (initializers) or values calibration observed
    (``stats``), with each operand's scale as stored (:func:`stored_scale`); and every other product of the plan
    -> why it cannot be fp8."""
    initializers = {t.name: t for t in model.graph.initializer}
    found: dict[str, list[Operand]] = {}
    excluded: dict[str, str] = {}
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in PRODUCTS or len(node.input) < 2:
            continue
        if node.name not in plan:
            continue
        if plan[node.name].precision is not Precision.LOW:
            excluded[node.name] = f"not {fmt}: the {low} plan keeps this product in fp32"
            continue
        if _odd_bias(node, initializers):
            excluded[node.name] = (f"stays {low}, not {fmt}: " + (
                "its bias is scaled by beta, so it cannot move after the product" if node.op_type == "Gemm" else
                "the bias of a convolution whose weight is computed cannot move after the product (its rank is "
                "not known)"))
            continue
        operands = []
        for slot in OPERANDS:
            value = node.input[slot]
            if value in initializers and channel_axis(node, slot, initializers[value]) is not None:
                operands.append(_weight_operand(node, slot, initializers[value], store, fmt, low))
                continue
            if value in initializers:
                amax = store.absmax(initializers[value])
            elif stats.get(value) is not None:
                amax = float(stats.get(value).absmax)
            else:
                excluded[node.name] = (f"stays {low}, not {fmt}: its input {value} was not observed by calibration, "
                                       "so it has no static scale")
                break
            operands.append(Operand(value, value in initializers, amax, stored_scale(fmt, amax, low)))
        else:
            found[node.name] = operands
    return found, excluded


def channel_axis(node: onnx.NodeProto, slot: int, weight: onnx.TensorProto) -> int | None:
    """The output-channel axis of ``weight``, input ``slot`` of product ``node``, where it can have one scale per
    channel: a MatMul's 2-D B ([K, N]: 1) or, the weight first, its 2-D A ([M, K]: 0, one scale per output row), a
    Gemm's B (1, or 0 with ``transB``) or A (0, or 1 with ``transA``), a Conv's W (0); None otherwise. Along that
    axis a scale multiplies whole output rows or columns, so it factors out of the product's sums."""
    if node.op_type == "Conv":
        return 0 if slot == 1 else None
    if len(weight.dims) != 2:
        return None
    transposed = node.op_type == "Gemm" and any(a.name == ("transB" if slot else "transA") and a.i
                                                for a in node.attribute)
    return int(transposed) if slot == 0 else int(not transposed)


def weight_scales(fmt: Fp8Format, low: LowType, values: torch.Tensor, axis: int | None) -> torch.Tensor:
    """A weight's stored scales (:func:`stored_scale`): one (a 0-d tensor) where ``axis`` is None, else one per
    channel along ``axis``, shaped to broadcast against ``values``."""
    if axis is None or not values.numel():
        return torch.tensor(stored_scale(fmt, float(values.abs().amax()) if values.numel() else 0.0, low))
    amax = values.abs().amax(dim=[d for d in range(values.dim()) if d != axis], keepdim=True)
    return torch.tensor([stored_scale(fmt, a, low) for a in amax.flatten().tolist()]).reshape(amax.shape)


def _quantized(fmt: Fp8Format, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (values / scales).clamp(-fmt.max, fmt.max).to(fmt.torch)


def _weight_operand(node: onnx.NodeProto, slot: int, tensor: onnx.TensorProto, store: WeightStore, fmt: Fp8Format,
                    low: LowType) -> Operand:
    """A weight operand with one scale per tensor or one per output channel: per channel where the weight's own e4m3
    error is below :data:`~amppass.dtypes.FINER_SCALES_GAIN` times the per-tensor one, as the torch front end
    chooses its granularity (one scale needs one value, not one per channel, otherwise). The error is that of the
    worst output channel, ``||dequantized_c - w_c|| / ||w_c||``: each channel is an output feature of its own, and
    a channel one per-tensor scale flushes to e4m3's subnormals barely moves the whole weight's norm."""
    values = torch.from_numpy(np.array(store.array(tensor), dtype=np.float32))
    axis = channel_axis(node, slot, tensor)
    others = [d for d in range(values.dim()) if d != axis]
    norms = values.pow(2).sum(dim=others).sqrt()
    errors = {}
    for granularity, scales in (("tensor", weight_scales(fmt, low, values, None)),
                                ("channel", weight_scales(fmt, low, values, axis))):
        moved = (_quantized(fmt, values, scales).float() * scales - values).pow(2).sum(dim=others).sqrt()
        errors[granularity] = float(torch.where(norms > 0, moved / norms.clamp_min(1e-30), 0.0).amax()), scales
    (per_tensor, one), (per_channel, scales) = errors["tensor"], errors["channel"]
    amax = store.absmax(tensor)
    if per_channel < FINER_SCALES_GAIN * per_tensor:
        why = (f"one weight scale per output channel: the weight's worst channel's own e4m3 error {per_channel:.3g}, "
               f"against {per_tensor:.3g} with one per tensor")
        return Operand(tensor.name, True, amax, float(scales.max()), axis, (scales.numel(), float(scales.min())), why)
    why = (f"one weight scale per tensor: the weight's worst channel's own e4m3 error {per_tensor:.3g}; one per "
           f"output channel gives {per_channel:.3g}, not below {FINER_SCALES_GAIN:g}x that")
    return Operand(tensor.name, True, amax, float(one), why=why)


def _odd_bias(node: onnx.NodeProto, initializers: Mapping[str, onnx.TensorProto]) -> bool:
    """Whether ``node`` has a bias :func:`_bias_after` cannot move out: a Gemm's scaled by ``beta``, or a Conv's
    whose weight's rank is not known (not an initializer)."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    if node.op_type == "Gemm":
        return any(a.name == "beta" and a.f != 1.0 for a in node.attribute)
    return node.op_type == "Conv" and node.input[1] not in initializers


def stored_scale(fmt: Fp8Format, amax: float, low: LowType) -> float:
    """``fmt``'s per-tensor scale for ``amax`` as the product's dtype ``low`` stores it: rounded to ``low`` and kept
    within its normal range (a scale that rounded to zero would make the quantized values inf)."""
    scale = min(max(fmt.scale_for(amax), low.min_normal), low.max)
    return float(torch.tensor(scale, dtype=torch.float32).to(low.torch).float())


def marked(plan: PrecisionPlan, chosen: Mapping[str, Sequence[Operand]], fmt: Fp8Format) -> PrecisionPlan:
    """A copy of ``plan`` whose ``chosen`` products carry their fp8 operands (``evidence["fp8"]``), which
    :class:`Fp8Rewrite` writes as Q/DQ pairs; ``plan`` is left as it was."""
    result = PrecisionPlan()
    for name, decision in plan.items():
        if name in chosen:
            decision = copy.copy(decision)
            decision.evidence = {**decision.evidence, KEY: describe(chosen[name], fmt)}
        result[name] = decision
    return result


def lowered(decision: Decision) -> dict[str, Any] | None:
    """The fp8 evidence of a product ``decision`` marks fp8 (:func:`marked`), None where it does not run in fp8
    (no ``fp8`` evidence, or one that says why not)."""
    evidence = decision.evidence.get(KEY)
    return evidence if isinstance(evidence, dict) and "operands" in evidence else None


def describe(operands: Sequence[Operand], fmt: Fp8Format) -> dict[str, Any]:
    """An fp8 product's evidence: its format, its weight scales' granularity ("tensor", or "channel": one scale per
    output channel) and why, and per operand its fp32 value, kind, range and scale (the largest, per channel,
    with the channels' ``axis`` and ``weight_scales``: how many, smallest, largest)."""
    described = []
    for o in operands:
        entry: dict[str, Any] = {"value": o.value, "weight": o.weight, "absmax": o.absmax, "scale": o.scale}
        if o.axis is not None and o.channels is not None:
            entry.update(axis=o.axis, weight_scales={"channels": o.channels[0], "min": o.channels[1], "max": o.scale})
        described.append(entry)
    return {"format": fmt.name, "granularity": "channel" if any(o.axis is not None for o in operands) else "tensor",
            "granularity_reason": "; ".join(o.why for o in operands if o.why), "operands": described}


class Fp8Rewrite:
    """The Q/DQ pairs of a plan's fp8 products, written into a model the low-precision rewrite has rewritten.

    :meth:`weights` reads each fp8 product's weights from the model before that rewrite (the fp32 values, cached
    by name for every later trial), :meth:`insert` writes the pairs after it."""

    def __init__(self, store: WeightStore, fmt: Fp8Format, low: LowType):
        self.store, self.fmt, self.low = store, fmt, low
        # (weight, scale, axis) -> its e4m3 bytes, dims, and scales per channel (None: one per tensor)
        self.cache: dict[tuple[str, float, int | None], tuple[bytes, list[int], list[float] | None]] = {}

    def weights(self, model: onnx.ModelProto, plan: PrecisionPlan) -> None:
        """Quantize the weights ``plan``'s fp8 products read, from ``model``'s fp32 initializers (before the
        rewrite stores them low)."""
        initializers = {t.name: t for t in model.graph.initializer}
        for _, decision in plan.items():
            for operand in (lowered(decision) or {}).get("operands", ()):
                key = _key(operand)
                if operand["weight"] and key not in self.cache:
                    tensor = initializers[operand["value"]]
                    values = torch.from_numpy(np.array(self.store.array(tensor), dtype=np.float32))
                    axis = operand.get("axis")
                    scales = (weight_scales(self.fmt, self.low, values, axis) if axis is not None
                              else torch.tensor(operand["scale"]))
                    quantized = _quantized(self.fmt, values, scales)
                    self.cache[key] = (quantized.view(torch.uint8).numpy().tobytes(), list(tensor.dims),
                                       None if axis is None else scales.flatten().tolist())

    def insert(self, model: onnx.ModelProto, plan: PrecisionPlan) -> int:
        """Put each fp8 product's operands of ``model`` (rewritten by ``plan``) through Q/DQ pairs (module
        docstring); returns how many products. Low weights no node reads any more are dropped."""
        graph = model.graph
        taken = all_names(model)
        initializers = {t.name: t for t in graph.initializer}
        zero = unique_name(taken, f"amppass_{self.fmt.name}_zero")
        shared: dict[tuple[str, float, int | None], str] = {}  # (value, scale, axis) -> its dequantized name
        nodes: list[onnx.NodeProto] = []
        count = 0
        for node in graph.node:
            evidence = lowered(plan[node.name]) if node.name in plan else None
            for slot, operand in enumerate(evidence["operands"] if evidence else ()):
                read = node.input[slot]
                key = (operand["value"] if operand["weight"] else read, operand["scale"], operand.get("axis"))
                if key not in shared:
                    shared[key] = self._pair(graph, nodes, taken, read, operand, zero)
                node.input[slot] = shared[key]
            count += bool(evidence)
            nodes.append(node)
            if evidence and len(node.input) > 2 and node.input[2]:
                nodes += _bias_after(graph, node, taken, len(self.cache_dims(evidence)) - 2)
        if not count:
            return 0
        graph.initializer.append(helper.make_tensor(zero, self.fmt.onnx, [], [0.0]))
        read = {v for n in nodes for v in n.input} | {o.name for o in graph.output}
        kept = [t for t in graph.initializer if t.name in read or t.name not in initializers]
        del graph.initializer[:]
        graph.initializer.extend(kept)
        del graph.node[:]
        graph.node.extend(nodes)
        return count

    def _pair(self, graph: onnx.GraphProto, nodes: list[onnx.NodeProto], taken: set[str], read: str,
              operand: Mapping[str, Any], zero: str) -> str:
        """Append the nodes that give ``read`` (the product's low input) as e4m3 and back; the name read then."""
        base = operand["value"]
        scale = unique_name(taken, f"{base}__{self.fmt.name}_scale")
        out = unique_name(taken, f"{base}__{self.fmt.name}_dq")
        per_channel: dict[str, int] = {}
        if operand["weight"]:
            stored = unique_name(taken, f"{base}__{self.fmt.name}")
            payload, dims, scales = self.cache[_key(operand)]
            tensor = onnx.TensorProto(name=stored, data_type=self.fmt.onnx, dims=dims, raw_data=payload)
            graph.initializer.append(tensor)
            quantized = stored
            if scales is not None:  # one scale (and zero point) per output channel, along the weight's axis
                per_channel["axis"] = operand["axis"]
                zero = unique_name(taken, f"{base}__{self.fmt.name}_zero")
                graph.initializer.append(helper.make_tensor(zero, self.fmt.onnx, [len(scales)], [0.0] * len(scales)))
        else:
            quantized = unique_name(taken, f"{base}__{self.fmt.name}")
            nodes.append(self._node("QuantizeLinear", [read, scale, zero], quantized, taken, base))
        graph.initializer.append(helper.make_tensor(scale, self.low.onnx, [len(scales)] if per_channel else [],
                                                    scales if per_channel else [operand["scale"]]))
        nodes.append(self._node("DequantizeLinear", [quantized, scale, zero], out, taken, base, **per_channel))
        return out

    def cache_dims(self, evidence: Mapping[str, Any]) -> list[int]:
        """The dims of an fp8 product's second operand, a weight (read by :meth:`weights`), or [] for a value."""
        operand = evidence["operands"][1]
        return self.cache[_key(operand)][1] if operand["weight"] else []

    def _node(self, op: str, inputs: list[str], output: str, taken: set[str], base: str,
              **attributes: int) -> onnx.NodeProto:
        node = helper.make_node(op, inputs, [output], name=unique_name(taken, f"{output}_{op}"), **attributes)
        _set_meta(node, {"cast": True, "of": base, "to": self.fmt.name})
        return node




def _key(operand: Mapping[str, Any]) -> tuple[str, float, int | None]:
    """A weight operand's entry in :attr:`Fp8Rewrite.cache`."""
    return operand["value"], operand["scale"], operand.get("axis")


def choose(found: Mapping[str, list[Operand]], excluded: Mapping[str, str], plan: PrecisionPlan, trials: Trials,
           tolerance: float, fmt: Fp8Format, low: LowType, runtime: str) -> tuple[PrecisionPlan, dict[str, Any]]:
    """The fp8 plan: ``plan`` (the fp16 plan) with the candidate products ``found`` that the output error allows
    marked fp8 (module docstring), each product's reason saying why it is or is not (``excluded``: the products
    that are no candidates, and why), each product not in fp8 its ``why_not`` in ``evidence["fp8"]``; and the
    search's figures, for the record (:func:`record`).

    ``trials`` runs a marked plan on the calibration batches it kept (its error against fp32, inf where it does not
    run), as ``runtime`` (named in reasons) computes it."""
    plan = _not_fp8(plan, excluded)
    batches, how = _judged(trials)
    judge = JudgedTrials(lambda names: _on_judged(trials.judge(marked(plan, {n: found[n] for n in names}, fmt), {}),
                                                  batches), len(batches), tolerance)
    info: dict[str, Any] = {"format": fmt.name, "tolerance": tolerance, "candidates": len(found), "judged_on": how}
    if not found:
        info.update(why="no matrix product runs low on weights or values calibration observed")
        return plan, info
    baseline = batch_bound(judge.measured([]))
    alone = {name: judge.error([name]) for name in found}
    order = sorted(found, key=lambda n: (alone[n], list(found).index(n)))
    within = sum(alone[n] <= tolerance for n in found)

    def prefix(k: int) -> list[str]:
        """The ``k`` candidates ranked first, as judging every batch ranks them. Those alone within the tolerance
        rank first, by their bounds (a candidate stopped early alone is beyond it); a longer prefix, short of all
        the candidates, needs the first of the others in their true order: where one ranks among those first by
        the error that stopped it (a lower bound on its bound), it is measured on every batch, until the first
        ``k`` are all measured (any other's bound is at least its lower bound, so ranks after them)."""
        nonlocal order
        while within < k < len(order) and not all(judge.known([n]) for n in order[:k]):
            alone.update({n: batch_bound(judge.measured([n])) for n in order[within:k] if not judge.known([n])})
            order = sorted(found, key=lambda n: (alone[n], list(found).index(n)))
        return order[:k]

    judged_on = f"errors bounded for a new batch from {how}"
    count = longest_within(len(order), lambda k: judge.error(prefix(k)) <= tolerance) if baseline <= tolerance else 0
    achieved = judge.error(order[:count])
    chosen = order[:count]
    result = marked(plan, {n: found[n] for n in chosen}, fmt)
    why_not = {}
    for rank, name in enumerate(order, 1):
        decision = result[name] = copy.copy(result[name])  # the caller's plan keeps its own decisions
        decision.evidence = {**decision.evidence, "fp8_error_alone": alone[name],  # a lower bound where stopped early
                             **({} if judge.known([name]) else {"fp8_error_alone_at_least": True})}
        ranges = "; ".join(f"{'weight' if o.weight else 'input'} {o.value} |x| <= {o.absmax:.3g}, " + (
            f"scale {o.scale:.3g}" if o.channels is None else
            f"{o.channels[0]} scales, one per output channel, {o.channels[1]:.3g} to {o.scale:.3g}")
            for o in found[name])
        if name in chosen:
            why = (f"{fmt} inputs and weights, {low} accumulation and output: alone in {fmt} it moves the output "
                   f"by up to {alone[name]:.2g}, and with the {count} products in {fmt} the bound on a new batch's "
                   f"output error is {achieved:.2g} <= the tolerance {tolerance:g} ({judged_on}; {ranges})")
        elif not math.isfinite(alone[name]):
            why = (f"stays {low}, not {fmt}: with it in {fmt} the model does not run as the target computes it "
                   f"({runtime}: its graph optimisations move or fuse the Q/DQ pair into kernels without {fmt} "
                   f"types)")
        elif alone[name] > tolerance or baseline > tolerance:
            why = (f"stays {low}, not {fmt}: alone in {fmt} it moves the output by "
                   f"{'up to ' if judge.known([name]) else ''}{judge.words([name], '.2g')}, beyond "
                   f"the tolerance {tolerance:g}" if baseline <= tolerance else
                   f"stays {low}, not {fmt}: the {low} plan's output error, up to {baseline:.2g}, already passes the "
                   f"tolerance {tolerance:g}") + f" ({judged_on}; {ranges})"
        else:
            why = (f"stays {low}, not {fmt}: it ranks {rank} of {len(order)} by the output error it causes alone in "
                   f"{fmt} ({alone[name]:.2g}); with the {count} products ranked before it the bound on a new "
                   f"batch's output error is {achieved:.2g}, and with one more {judge.words(order[:count + 1], '.2g')} "
                   f"> the tolerance {tolerance:g} ({judged_on}; {ranges})")
        if name in chosen:
            decision.reason = f"{decision.reason}; {why}"
        else:
            why_not[name] = why
    result = _not_fp8(result, why_not)
    info.update(baseline_error=baseline, **judged(judge.measured(chosen)), trials=len(judge.seen),
                batch_runs=judge.runs, tolerance_met=achieved <= tolerance)
    log.info("fp8: %d of %d products in %s, bound on a new batch's output error %.3g (tolerance %g, %d trials, %d "
             "batch runs)", len(chosen), len(found), fmt, achieved, tolerance, len(judge.seen), judge.runs)
    return result, info


def _not_fp8(plan: PrecisionPlan, why_not: Mapping[str, str]) -> PrecisionPlan:
    """A copy of ``plan`` whose products ``why_not`` names say why they are not fp8: in their reason, and as
    ``evidence["fp8"]["why_not"]`` (what the report counts them by); ``plan`` is left as it was."""
    result = PrecisionPlan()
    for name, decision in plan.items():
        if name in why_not:
            decision = dataclasses.replace(decision, reason=f"{decision.reason}; {why_not[name]}",
                                           evidence={**decision.evidence, KEY: {"why_not": why_not[name]}})
        result[name] = decision
    return result


def record(plan: PrecisionPlan, model: onnx.ModelProto, feed: Mapping[str, np.ndarray], fmt: Fp8Format,
           low: LowType, details: Mapping[str, Any]) -> dict[str, Any]:
    """The summary's ``fp8`` (:func:`amppass.analysis.record.fp8_record`) for the products ``plan`` (chosen by
    :func:`choose`) decides on, with ``details`` (the search's figures): their multiply-accumulates counted at the
    shapes of ``feed`` (a calibration batch: a file's dynamic sizes leave its own counts unknown), which it names."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)  # a skeleton: no weight bytes to copy
    clear_value_info(fixed.graph)
    for value in fixed.graph.input:
        if value.name in feed and value.type.HasField("tensor_type"):
            shape = value.type.tensor_type.shape
            shape.Clear()
            for size in np.shape(feed[value.name]):
                shape.dim.add(dim_value=int(size))
    inferred = onnx.shape_inference.infer_shapes(fixed, data_prop=True)
    heavy = [n for n in inferred.graph.node if is_heavy(n) and n.name in plan and KEY in plan[n.name].evidence]
    shapes = value_shapes(inferred, {v for n in heavy for v in operands(n)})
    products = []
    for node in heavy:
        decision = plan[node.name]
        precision = "fp8" if lowered(decision) else low.name if decision.precision is Precision.LOW else "fp32"
        products.append((precision, node_macs(node, shapes), str(decision.evidence[KEY].get("why_not", ""))))
    return fp8_record(fmt.name, low.name, products, scales=SCALES, **details,
                      counted_at={name: list(np.shape(array)) for name, array in feed.items()})


def _on_judged(error: BatchError, batches: Sequence[int]) -> BatchError:
    """``error`` of a calibration batch, read by its place among the judged ``batches``."""
    return lambda index: error(batches[index])


def _judged(trials: Trials) -> tuple[list[int], str]:
    """The batches that judge every trial, and which: the last :data:`~amppass.analysis.tolerance.JUDGED`
    calibration batches, as the torch front end's search judges (docs/fp8.md); a single batch with the perturbed
    copies of it that the fp16 plan's tolerance search kept (:func:`amppass.analysis.calibration.held_out`), which
    stand in for new inputs."""
    count, kept = trials.count(), len(trials.data.kept)
    if count >= 2:
        judged_count = min(JUDGED, count)
        return list(range(count - judged_count, count)), f"the last {judged_count} of {count} calibration batches"
    if kept > 1:
        return list(range(kept)), f"the single calibration batch and {kept - 1} perturbed copies of it"
    return [0], "a single calibration batch, which shows no spread; pass two or more batches"


def _bias_after(graph: onnx.GraphProto, node: onnx.NodeProto, taken: set[str], spatial: int) -> list[onnx.NodeProto]:
    """Move the bias of an fp8 Gemm or Conv ``node`` out of it into an Add after it; the nodes that add it.

    onnxruntime's CPU provider rewrites the bias of a Q/DQ Gemm or Conv as int32 at the scale ``x_scale *
    w_scale`` (its WeightBiasQuantization, written for int8): with fp8's small scales the bias over that scale
    overflows fp16 and int32, and the product's output is wrong. A bias added after the product is left alone, and
    TensorRT fuses the Add into the product as it would the bias. A Conv's bias ([C]) is unsqueezed over its
    ``spatial`` dimensions to broadcast along the channels."""
    bias, output = node.input[2], node.output[0]
    del node.input[2]
    node.output[0] = unique_name(taken, f"{output}__before_bias")
    added: list[onnx.NodeProto] = []
    if node.op_type == "Conv":
        axes = unique_name(taken, f"{bias}__axes")
        graph.initializer.append(helper.make_tensor(axes, onnx.TensorProto.INT64, [spatial], range(1, spatial + 1)))
        unsqueezed = unique_name(taken, f"{bias}__unsqueezed")
        added.append(helper.make_node("Unsqueeze", [bias, axes], [unsqueezed], name=unique_name(taken, unsqueezed)))
        bias = unsqueezed
    name = unique_name(taken, f"{node.name}_bias")
    added.append(helper.make_node("Add", [node.output[0], bias], [output], name=name))
    return added
