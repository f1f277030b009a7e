"""The torch pipeline on one captured graph, in named stages over one work record (:func:`plan_captured` lists them).

:func:`amppass.convert` runs it on each capture (both graphs of a train-mode conversion, and a capture of other
shapes later), the compile backend on each graph dynamo hands it (:mod:`amppass.pipelines.backend`). Each stage is a
function of the :class:`Work` record: it reads what earlier stages left there and adds its own part, so following a
value from the capture to the stored record is following an attribute. The ONNX pipeline has the same shape
(:func:`amppass.pipelines.convert_onnx.convert_onnx_streamed`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import fx, nn

from ..analysis import overrides, precedence
from ..analysis.painting import paint
from ..analysis.plan import Decision, PrecisionPlan, Source
from ..analysis.profitability import SOURCES, Profitability
from ..analysis.record import META_KEY, summary, with_evidence
from ..analysis.view import GraphView
from ..fx.capture.copies import shared_copy
from ..fx.capture.inputs import flatten_inputs, split_batch
from ..fx.prepare.aliasing import functional_writes, writes_an_input
from ..fx.prepare.gelu import FUSED_KEY, fuse_tanh_gelu
from ..fx.prepare.masks import fold_constant_masks
from ..fx.rewrite.apply import RewriteStats, rewrite
from ..fx.rewrite.fp8 import linear_weights
from ..fx.rewrite.low_backward import annotate_backward
from ..fx.runners import finite, region_timing
from ..fx.runners.calibrate import CaptureFp32, calibrated_plan
from ..fx.runners.fp8 import plan_fp8
from ..fx.runners.fp8_train import plan_fp8_train
from ..fx.view.build import build_view
from ..fx.view.macs import node_macs
from ..targets.cost_model import CostModel, DeviceFacts
from .settings import Settings

log = logging.getLogger(__name__)

MEASURED = (Source.CALIBRATION, Source.TOLERANCE)  # the sources of decisions measured on calibration data


@dataclass
class Work:
    """What one graph's conversion carries from stage to stage. The first six fields are given; each stage fills in
    its own (the comment names it)."""

    gm: fx.GraphModule  # the captured graph, prepared in place, then the rewritten graph
    model: Any  # the module captured (its name in messages, its weight bytes)
    settings: Settings  # resolved for the device (:meth:`Settings.on`)
    example: tuple[Any, dict] | None = None  # example inputs and keyword inputs: the timings' and the finite check's
    carried: dict[str, Any] = field(default_factory=dict)  # decisions an earlier plan made (another capture's)
    recapture: CaptureFp32 | None = None  # calibration's capture for batches of shapes ``gm`` does not take
    training: bool = True  # a train-mode conversion's graph of training mode (its eval graph: False)
    bytes_before: int = 0  # prepare
    fused: dict[str, str] = field(default_factory=dict)  # prepare: node -> what the fused op replaced
    view: GraphView | None = None  # neutral_view
    macs: dict[str, int | None] = field(default_factory=dict)  # neutral_view, before the rewrite puts casts between
    user: dict[str, Decision] | None = None  # pin, the first time: the user's overrides resolved
    pinned: dict[str, Decision] = field(default_factory=dict)  # pin: the decisions painting keeps
    unprofitable: dict[str, Decision] = field(default_factory=dict)  # profitable_regions
    profitability: dict[str, Any] = field(default_factory=dict)  # profitable_regions: what to record
    plan: PrecisionPlan | None = None  # plan_precision
    measured: dict[str, Decision] | None = None  # plan_precision, the first time: decisions measured on calibration
    calibration: dict[str, Any] = field(default_factory=lambda: {"calibrated": False})  # plan_precision
    stored: PrecisionPlan | None = None  # add_evidence: the plan with what the report shows beside each decision
    checked: list | None = None  # rewrite_graph, the first time: the finite check's inputs (None: no check)
    pristine: fx.GraphModule | None = None  # rewrite_graph: the prepared graph, for the check and its retries
    stats: RewriteStats | None = None  # rewrite_graph
    kept_finite: dict[str, Decision] = field(default_factory=dict)  # finite_check
    non_finite: dict[str, Any] = field(default_factory=dict)  # finite_check: what to record
    fp8_sources: tuple[fx.GraphModule, dict[str, torch.Tensor]] | None = None  # rewrite_graph, for an fp8 plan
    fp8: dict[str, Any] | None = None  # lower_fp8: what to record
    ran: list[str] = field(default_factory=list)  # the stages run, in order


def plan_captured(gm: fx.GraphModule, model: Any, settings: Settings, *, example: tuple[Any, dict] | None = None,
                  carried: dict[str, Any] | None = None, recapture: CaptureFp32 | None = None,
                  training: bool = True) -> fx.GraphModule:
    """Analyse, paint and rewrite a captured graph of ``model`` in place (``settings`` resolved for its device);
    record the decisions in it (``training``: the graph of training mode, where fp8's delayed scaling records).
    Which decision wins is :mod:`amppass.analysis.precedence`'s order.

    The stages, in order (:data:`STAGES`), each a function below that says what it reads and adds:

    1. :func:`prepare`: writes made functional (training), tanh-GELU fused, constant masks folded;
    2. :func:`neutral_view`: the neutral view the analysis plans on, and each node's multiply-accumulates;
    3. :func:`pin`: the decisions painting keeps: user overrides, carried decisions;
    4. :func:`profitable_regions`: regions not faster low on the device kept fp32 (a speed plan for inference);
    5. :func:`plan_precision`: calibration when given, painting;
    6. :func:`add_evidence`: what the report shows beside each decision;
    7. :func:`rewrite_graph`: casts and low weights written in;
    8. :func:`finite_check`: the example run fp32 and converted; a node going inf or NaN is kept fp32 and the
       graph made again from it (:data:`RETRY`: pin, plan, evidence, rewrite; nothing is captured, viewed or
       timed again);
    9. :func:`lower_fp8`: for ``dtype="fp8"``, the products whose measured error allows it lowered to e4m3;
    10. :func:`record`: the summary stored in the graph for ``amppass.report``.
    """
    work = Work(gm, model, settings, example, carried or {}, recapture, training)
    run(work, STAGES)
    return work.gm


def run(work: Work, stages: Iterable[Callable[[Work], None]]) -> None:
    """Run ``stages`` on ``work`` in order, noting each in ``work.ran``."""
    for stage in stages:
        work.ran.append(stage.__name__)
        stage(work)


def prepare(work: Work) -> None:
    """Stage 1, on ``work.gm`` in place: the weight bytes counted; in training, writes into values saved for
    backward made functional (autograd would fail on them); a written-out tanh-GELU fused into one low kernel (op
    by op it runs fp32, its cube can overflow, and training saves its fp32 activations); a mask the graph fixes as
    all-true or causal folded (it keeps SDPA off its fused kernels on CUDA)."""
    gm = work.gm
    work.bytes_before = weight_bytes(work.model) if isinstance(work.model, nn.Module) else 0
    if work.settings.trains:
        functional_writes(gm)
    fuse_tanh_gelu(gm)
    fold_constant_masks(gm)
    work.fused = {node.name: node.meta[FUSED_KEY] for node in gm.graph.nodes if FUSED_KEY in node.meta}


def neutral_view(work: Work) -> None:
    """Stage 2: the neutral view of ``work.gm`` for the target (a speed plan for training keeps fp32 what trains
    tens of times slower low: :attr:`Settings.avoids_slow_backward`), and each node's multiply-accumulates, counted
    before the rewrite puts casts between the shapes."""
    settings = work.settings
    work.view, _ = build_view(work.gm, settings.resolved, avoid_slow_backward=settings.avoids_slow_backward)
    work.macs = {node.name: node_macs(node) for node in work.gm.graph.nodes}


def pin(work: Work) -> None:
    """Stage 3: the decisions painting keeps as they are (:func:`amppass.analysis.precedence.pinned`): the user's
    overrides (resolved once), then what later stages found: the finite check's, the carried ones, profitability's,
    those measured on calibration data."""
    options, view = work.settings.options, work.view
    assert view is not None
    if work.user is None:
        work.user = overrides.resolve(view, options.keep_fp32, options.force_low, work.settings.low)
    work.pinned = precedence.pinned(user=work.user, finite=work.kept_finite, carried=work.carried,
                                    profitability=work.unprofitable, measured=work.measured)


def profitable_regions(work: Work) -> None:
    """Stage 4: where :attr:`Settings.measures_regions` and an example is given, the regions not faster low on the
    device kept fp32 (:func:`profitability`), and the decisions pinned again with them."""
    if not work.settings.measures_regions or work.example is None:
        return
    work.unprofitable, work.profitability = profitability(work)
    pin(work)


def plan_precision(work: Work) -> None:
    """Stage 5: the plan. The first time, with calibration data, the range rules and the tolerance search decide
    under the pinned decisions (:func:`amppass.fx.runners.calibrate.calibrated_plan`, whose trials rewrite as the
    final rewrite does), and what they measured is kept to be pinned on a retry; otherwise painting."""
    settings, view = work.settings, work.view
    assert view is not None
    options, first = settings.options, work.measured is None
    if first and options.calibration is not None:
        work.plan, work.calibration = calibrated_plan(
            work.gm, view, options.calibration, settings.low, work.pinned, tolerance=options.tolerance,
            progress=options.progress, low_weight_tables=options.low_weight_tables, rewrite_options=settings.rewrite,
            recapture=work.recapture)
    else:
        work.plan = paint(view, settings.low, work.pinned, low_weight_tables=options.low_weight_tables)
    if first:
        work.measured = {name: d for name, d in work.plan.items() if d.source in MEASURED}


def add_evidence(work: Work) -> None:
    """Stage 6: the plan as the graph stores it (:func:`amppass.analysis.record.with_evidence`): whether each
    node's op is unknown, its multiply-accumulates, and for a fused op what it replaced."""
    assert work.plan is not None and work.view is not None
    work.stored = with_evidence(work.plan, work.view, work.macs, fused=work.fused)


def rewrite_graph(work: Work) -> None:
    """Stage 7: the stored plan written into the graph (:attr:`Settings.rewrite`). The first time, the finite
    check's inputs are taken and the prepared graph kept for it; a retry rewrites a copy of that graph."""
    assert work.stored is not None
    if work.stats is None:
        work.checked = _finite_check_inputs(work)
        work.pristine = shared_copy(work.gm) if work.checked is not None else None
        if work.settings.options.fp8 is not None:  # fp8 weights are quantized from fp32 values, not bf16 ones
            work.fp8_sources = (shared_copy(work.gm), linear_weights(work.gm))
    else:
        assert work.pristine is not None
        work.gm = shared_copy(work.pristine)
    work.stats = rewrite(work.gm, work.stored, work.settings.low, work.settings.rewrite)


def finite_check(work: Work) -> None:
    """Stage 8: the example run in fp32 and converted (:mod:`amppass.fx.runners.finite`); while a node goes inf or
    NaN where fp32 stays finite, it is kept fp32 and :data:`RETRY` makes the graph again. What the check found is
    kept for the record."""
    if work.pristine is None:
        return
    assert work.checked is not None and work.plan is not None
    check = finite.Check(work.pristine, work.checked, work.settings.low.name)
    while check.again(work.gm, work.plan):
        work.kept_finite = check.kept
        run(work, RETRY)
    work.non_finite = check.info


def lower_fp8(work: Work) -> None:
    """Stage 9, for an fp8 plan (a bf16 plan with some products lowered further): the linear products whose
    measured sensitivity allows it run e4m3 (:func:`amppass.fx.runners.fp8.plan_fp8`), each product's outcome on
    its node; in training, the products :func:`amppass.fx.runners.fp8_train.plan_fp8_train` chooses train with e4m3
    forward operands and e5m2 gradients; nothing otherwise."""
    if work.fp8_sources is None:
        return
    options = work.settings.options
    if work.settings.trains:
        work.fp8 = plan_fp8_train(work.gm, options.fp8_recipe, record=work.training)
        return
    work.fp8 = plan_fp8(work.gm, *work.fp8_sources, options.calibration, options.tolerance,
                        low=work.settings.low.name)


def record(work: Work) -> None:
    """Stage 10: the conversion's summary stored in ``work.gm.meta`` (what ``amppass.report`` reads back with each
    node's decision), and in training what each op's backward runs in."""
    settings, gm, stats = work.settings, work.gm, work.stats
    assert stats is not None and work.plan is not None
    low, target = settings.low, settings.resolved
    gm.meta[META_KEY] = {
        **summary("fx", low.name, target.describe(), settings.mode, settings.options.keep_io_types, stats,
                  work.bytes_before, weight_bytes(gm)),
        "plan_for": settings.options.plan_for,
        **work.profitability,
        **work.calibration,
        **work.non_finite,
    }
    if work.fp8 is not None:
        gm.meta[META_KEY]["fp8"] = work.fp8
    if settings.trains:
        gm.meta[META_KEY]["backward"] = annotate_backward(gm, low.name)
    log.info("converted %s to %s for %s: %d nodes planned, %d casts", type(work.model).__name__, low, target.name,
             len(work.plan), stats.casts)


STAGES = (prepare, neutral_view, pin, profitable_regions, plan_precision, add_evidence, rewrite_graph, finite_check,
          lower_fp8, record)
RETRY = (pin, plan_precision, add_evidence, rewrite_graph)  # the finite check's: the graph made again from its plan


def _finite_check_inputs(work: Work) -> list | None:
    """The graph's inputs for the finite check: the example's, where :attr:`Settings.checks_finite`; None where
    there is no example, and where the graph writes into an input (the check must not change the caller's
    tensors)."""
    if work.example is None or not work.settings.checks_finite or writes_an_input(work.gm):
        return None
    args, kwargs = work.example
    return flatten_inputs(work.gm, split_batch(args)[0] if args is not None else (), kwargs, index=0)


def profitability(work: Work) -> tuple[dict, dict[str, Any]]:
    """Fp32 decisions for the regions not faster low on this device, and what to record about them."""
    start = time.perf_counter()
    gm, view, target, options = work.gm, work.view, work.settings.resolved, work.settings.options
    assert view is not None and work.example is not None
    args, kwargs = work.example
    flat = flatten_inputs(gm, split_batch(args)[0] if args is not None else (), kwargs, index=0)
    device = next((t.device for t in gm.parameters()), torch.device(target.name))
    facts = DeviceFacts(device, target.low)
    model = CostModel(options.costs, facts.cache)
    rule = Profitability(model, facts, target.low)
    plan = paint(view, target.low, work.pinned, low_weight_tables=options.low_weight_tables)
    decided, regions = region_timing.decide(gm, view, plan, flat, work.pinned, options.keep_io_types, rule, device)
    timing = {source: sum(r["timing"] == source for r in regions) for source in (*SOURCES, "device")}
    timing = {source: count for source, count in timing.items() if count}
    if timing.get("device"):
        _say_once(f"profitability: {facts.native.reason}; every region runs fp32 without timing "
                  "(plan_for='coverage' converts it anyway)")
    seconds = time.perf_counter() - start
    fp32 = sum(r["runs"] == "fp32" for r in regions)
    log.info("profitability: %d of %d region(s) kept fp32 (%s), %d timings, %.2f s", fp32, len(regions),
             ", ".join(f"{n} {s}" for s, n in timing.items()) or "none", len(model.used), seconds)
    return decided, {"costs": model.table(), "profitability": {
        "regions_fp32": fp32, "nodes_fp32": len(decided), "seconds": round(seconds, 3), "timing": timing,
        "too_busy": rule.misses > 0, "device": facts.describe(), "regions": regions}}


_WARNED: set[str] = set()


def _say_once(message: str) -> None:
    """Log ``message`` as a warning the first time in this process, at debug level after that."""
    log.log(logging.DEBUG if message in _WARNED else logging.WARNING, message)
    _WARNED.add(message)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the module's floating-point parameters and buffers, each tensor counted once."""
    seen: dict[int, int] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_floating_point():
            seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())
