"""``amppass.convert``: the settings checked, the model captured (whole, both graphs in train mode, or by parts),
each capture converted by the stages of :mod:`amppass.pipelines.stages`, and the result served."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import fx, nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

from ..analysis.plan import Precision
from ..analysis.profitability import fp32_by_device
from ..analysis.record import META_KEY, check_reconversion
from ..analysis.view import GraphView
from ..dtypes import fp8_format, low_type
from ..errors import CaptureError, InputError
from ..fx.capture.copies import shared_copy
from ..fx.capture.export import capture, capture_program, check_example
from ..fx.capture.fidelity import check_fidelity
from ..fx.capture.function_backward import check_backward
from ..fx.capture.guards import GUARDS_KEY, carried_decisions, carried_into, example_refusal, plain_inputs
from ..fx.capture.inputs import example_call, split_batch
from ..fx.capture.modes import module_mode
from ..fx.prepare.aliasing import functional_writes
from ..fx.rewrite.device_literals import module_device
from ..fx.rewrite.fp8_train import local_amaxes
from ..fx.runners import region_timing
from ..fx.view.build import build_view
from ..serving.artifact import record_of
from ..serving.dropin import in_own_class, transformers_call, with_signature
from ..serving.fp32_original import keep_original
from ..serving.serving_graph import ServingGraph
from ..serving.traced import TracedGraph
from ..serving.train_eval import TrainEvalGraphs
from ..targets.cost_model import CostModel
from ..targets.device import fingerprint
from ..targets.target import check_fp8
from ..targets.timing_cache import TimingCache
from .serialize import plan_file
from .settings import Settings, device_name
from .stages import plan_captured, weight_bytes

log = logging.getLogger(__name__)


def _outside_callers_modes(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run with the caller's own dispatch modes (not torch's infrastructure modes) off this thread's
    stack, and put back after: a dispatch mode of the caller's (Lightning's FLOP counter around its model summary,
    which is where a routed model converts) would see every traced, timed and checked op of the conversion,
    symbolic sizes included. Nothing is touched where there are none: torch's infrastructure modes are shared with
    exports running in other threads."""

    @functools.wraps(function)
    def outside(*args: Any, **kwargs: Any) -> Any:
        if not any(not mode.is_infra_mode() for mode in _get_current_dispatch_mode_stack()):
            return function(*args, **kwargs)
        with _disable_current_modes():
            return function(*args, **kwargs)

    return outside


@_outside_callers_modes
def convert(
    model: nn.Module,
    example_inputs: Any = None,
    dtype: Any = "auto",
    *,
    example_kwargs: dict[str, Any] | None = None,
    target: str | None = None,
    plan_for: str = "speed",
    costs: Mapping[str, float] | None = None,
    mode: str | None = None,
    keep_io_types: bool = True,
    keep_fp32: Iterable[str] = (),
    force_low: Iterable[str] = (),
    dynamic_shapes: Any = "auto",
    low_weight_tables: bool = False,
    calibration: Iterable[Any] | None = None,
    tolerance: float | None = None,
    progress: bool = False,
    fp8_recipe: str = "dynamic",
) -> nn.Module:
    """Return a mixed-precision module computing what ``model`` computes (one of the kinds of
    :mod:`amppass.serving.artifact`, each of which :func:`amppass.report` reads; the last paragraph says which).

    Args:
        model: the module to convert; it is never changed. A ``torch.export.ExportedProgram`` (from
            ``torch.export.load``) converts too, for inference: its graph is the capture.
        example_inputs: positional inputs (a tuple, or one tensor) for capture with ``torch.export``;
            without them (and without ``example_kwargs``) the module is traced symbolically.
        dtype: ``torch.float16``, ``torch.bfloat16``, ``"fp16"``, ``"bf16"`` or ``"auto"`` (bf16 on CPU,
            fp16 on CUDA, judged by the model's parameters). ``"fp8"`` (or ``"e4m3"``,
            ``torch.float8_e4m3fn``): a bf16 plan whose matrix products run in e4m3 where measured sensitivity allows
            (:mod:`amppass.fx.runners.fp8`, docs/fp8.md); for CUDA targets of compute capability 8.9 or later, and
            for a CPU target with ``plan_for="coverage"`` (testing only: slow), inference only.
        example_kwargs: keyword inputs for capture.
        target: the device the converted model will run on, "cpu" or "cuda" (default: the device of the
            model's parameters). It is recorded in the model and shown in the report.
        plan_for: ``"speed"`` (default): where this machine has the target device and example inputs are
            given, a region of the plan runs low only if measuring shows its low kernels and casts are
            faster than fp32 there, and the original module is kept in fp32 if the converted graph
            measures slower than it (profitability: :mod:`amppass.analysis.profitability`,
            :mod:`amppass.serving.fp32_original`).
            ``"coverage"``: every op that numerics allow runs low, nothing is measured (the plan is the
            same on every machine). ``"memory"``: as "coverage", and every weight is stored in the low dtype
            (where its values fit), cast up at use by the ops that run fp32: the smallest model.
        costs: a cost table a previous conversion measured (``amppass.report(m).info["costs"]``); its
            times are used instead of measuring again, so the plan is the same on any machine.
        mode: ``"inference"`` (the default) stores low-precision copies of the weights once; ``"train"`` keeps
            fp32 master parameters and casts them inside the graph so gradients come back fp32, and returns a
            :class:`~amppass.serving.train_eval.TrainEvalGraphs`: a train graph and an eval graph that switch
            on ``.train()``/``.eval()`` and own a copy of the model's parameters and buffers. A model in train
            mode (every module, as ``model.train()`` leaves it) converted without ``mode=`` is converted for
            inference with a warning naming both ways; the
            module comes back in eval mode, and a call of it in train mode with gradients enabled (training it)
            raises an :class:`~amppass.errors.InputError` saying the same.
        keep_io_types: cast floating outputs back to fp32 (inputs are never changed).
        keep_fp32: op names or node-name regexes to keep in fp32.
        force_low: op names or node-name regexes to run in low precision regardless of the policy.
        dynamic_shapes: passed to ``torch.export``; by default every input dimension is dynamic where
            the model allows it, and a call with a shape the captured graph does not take is captured and
            converted again for it (see :mod:`amppass.serving.serving_graph`).
        low_weight_tables: store tables read by weight-only ops (embeddings) in low precision even when
            they feed fp32 work: half the bytes of those tables, at the cost of rounding them.
        calibration: an iterable of input tuples like ``example_inputs``; the fp32 model runs on each and
            the range rules of :mod:`amppass.analysis.rules` decide from what it computed. User overrides
            (``keep_fp32``/``force_low``) still win. :mod:`amppass.analysis.calibration` lists the steps and
            where each lives.
        tolerance: the largest relative error ``||out - out_fp32|| / ||out_fp32||`` allowed on any floating
            output over the calibration batches; the most sensitive nodes move back to fp32 until it is met
            (see :mod:`amppass.analysis.tolerance`). Needs ``calibration``.
        progress: show a progress bar on stderr while calibrating.
        fp8_recipe: how ``dtype="fp8", mode="train"`` scales each fp8 product's input and output gradient:
            ``"dynamic"`` (default) from each call's own largest magnitude, no state; ``"delayed"`` from the
            largest of their last 16 (TransformerEngine's recipe), amax histories held as buffers of the converted
            model, in its ``state_dict()``, recorded in train mode only (docs/fp8.md, Training).

    The returned module records its decisions in ``node.meta["amppass"]``; ``amppass.report`` reads them.
    Captured with example inputs, it is a :class:`~amppass.serving.serving_graph.ServingGraph` (a
    ``torch.fx.GraphModule``): it takes every input shape the original model takes, converting again (a few plans at
    most, cached) where torch.export had to fix a dimension. Without example inputs it is a symbolically traced
    ``GraphModule``. A transformers model (any head), and a module whose class offers more than ``forward``
    (sentence-transformers' ``encode()``), comes back in its own class with its attributes and ``forward``'s
    signature, ``generate()`` included, its ``forward`` running the converted graphs
    (:mod:`amppass.serving.dropin`); a train-mode model's ``forward`` shows the original's signature too. Where
    profitability keeps the original in fp32, it is the original in its own class
    (:mod:`amppass.serving.fp32_original`). A model torch.export cannot capture whole (with example inputs) comes
    back converted by parts: a copy in its own class whose largest submodules that capture are converted, its own
    Python running between them in fp32 (:mod:`amppass.pipelines.parts`); a
    :class:`~amppass.errors.CaptureError` is raised only where no submodule converts either.
    """
    # train mode as model.train() (or a fresh module) leaves it: every module; a model whose library put its layers
    # in eval (a SentenceTransformer around a from_pretrained model) is not being trained
    from_train_mode = (mode is None and isinstance(model, nn.Module) and all(m.training for m in model.modules())
                       and record_of(model) is None)
    mode = "inference" if mode is None else mode
    fp8 = fp8_format(dtype)
    if fp8 is not None:  # an fp8 plan is a bf16 plan with some products lowered further
        check_fp8(device_name(target, model), plan_for)
        dtype = "bf16"
    settings = Settings.of(mode, dtype=dtype, target=target, dynamic_shapes=dynamic_shapes, plan_for=plan_for,
                           keep_io_types=keep_io_types, keep_fp32=keep_fp32, force_low=force_low,
                           low_weight_tables=low_weight_tables, calibration=calibration, tolerance=tolerance,
                           progress=progress, costs=costs, fp8=fp8, fp8_recipe=fp8_recipe)
    return convert_planned(model, example_inputs, settings, example_kwargs=example_kwargs,
                           from_train_mode=from_train_mode)


@_outside_callers_modes
def convert_planned(model: nn.Module, example_inputs: Any, settings: Settings, *,
                    example_kwargs: dict[str, Any] | None = None, from_train_mode: bool = False) -> nn.Module:
    """:func:`convert` with its settings built and checked already (:meth:`Settings.of`): what an integration
    calls with the settings it checked where it was made. ``example_inputs`` and ``example_kwargs`` are
    :func:`convert`'s; ``from_train_mode``: the model is in train mode and :func:`convert` was given no ``mode=``
    (it warned), so the inference module comes back in eval mode and refuses to be trained."""
    found = record_of(model)
    if found is not None:
        return _unchanged(model, found.record, settings)
    if isinstance(model, torch.export.ExportedProgram):
        return _convert_program(model, settings)
    module = isinstance(model, nn.Module)  # anything else is refused where it is captured, naming what it is
    if module:
        _check_weights(model)
    settings = settings.on(model)
    example_inputs, example_kwargs = plain_inputs(example_inputs), plain_inputs(example_kwargs)  # BatchEncoding: a dict
    example_kwargs = transformers_call(model, example_kwargs)  # as the drop-in's forward passes them on
    example = None if example_inputs is None and example_kwargs is None else (example_inputs, example_kwargs or {})
    if module and example is not None:
        _check_example_dtypes(model, *example_call(example))
    if from_train_mode:
        log.warning("%s is in train mode (every module, as model.train() leaves it) and amppass.convert was given no "
                    "mode=: it is converted for inference, an eval graph (dropout off, batch norm's running statistics "
                    "read, never updated) that cannot be trained. To train it, convert with mode='train'; to serve it, "
                    "call model.eval() before converting (or pass mode='inference')", type(model).__name__)
    if settings.trains and example is None:
        raise InputError(
            f"amppass.convert({type(model).__name__}, mode='train') needs example_inputs: a train-mode model keeps "
            "fp32 master weights and casts them inside the graph, which takes a graph captured by torch.export "
            "(a symbolically traced graph calls the model's own modules, which read their fp32 weights); pass "
            "one batch, e.g. amppass.convert(model, (x,), mode='train')")
    if settings.trains and module:  # the device alone may keep a train plan fp32: then nothing is captured
        record = fp32_by_device(type(model).__name__, settings.resolved, module_device(model), settings.options,
                                weight_bytes(model))
        kept = keep_original(model, record, train=True) if record is not None else None
        if kept is not None:
            check_example(model, *(plain_inputs(part) for part in example_call(example)))  # as a capture would
            return kept
    try:
        converted = _convert_module(model, example, settings)
    except CaptureError as err:
        if example is None:
            raise
        return _convert_parts(model, example, err, settings)
    if from_train_mode:
        _inference_only(converted, type(model).__name__)
    return converted


def _check_weights(model: nn.Module) -> None:
    """InputError for weights amppass cannot plan from: on the ``meta`` device (no values), or already fp16/bf16
    (the plan is made from fp32 weights, and which ops stay fp32 is decided for fp32 ones)."""
    name = type(model).__name__
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    meta = next((n for n, t in tensors if t.is_meta), None)
    if meta is not None:
        raise InputError(f"amppass.convert({name}): the model is on the 'meta' device ({meta} and the others hold "
                         "shapes without values, as from_pretrained(..., device_map='meta') or init_empty_weights() "
                         "leave them), so there is nothing to plan from or run: materialize the weights first, "
                         "model.to_empty(device='cpu') then model.load_state_dict(weights), or load the model "
                         "without device_map='meta'")
    low = [(n, t.dtype) for n, t in model.named_parameters() if t.dtype in (torch.float16, torch.bfloat16)]
    if low:
        floating = sum(t.is_floating_point() for _, t in model.named_parameters())
        dtype = str(low[0][1]).removeprefix("torch.")
        raise InputError(f"amppass.convert({name}): the model's weights are already {dtype} ({low[0][0]}: "
                         f"{len(low)} of {floating} floating parameters), and amppass plans a float32 model (which ops "
                         "run low, which stay fp32, each weight's low copy): convert a float32 copy, "
                         "amppass.convert(copy.deepcopy(model).float(), ...), or load it in float32 "
                         "(from_pretrained(..., dtype=torch.float32)); the converted model stores its own low copies")


def _check_example_dtypes(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """InputError where the example holds floating tensors of another dtype than the model's weights and the model
    itself does not run on it (torch's own error would come from inside the captured graph)."""
    weights = {t.dtype for t in model.parameters() if t.is_floating_point()}
    other = sorted({str(t.dtype).removeprefix("torch.") for t in torch.utils._pytree.tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in weights})
    if len(weights) != 1 or not other:
        return
    refused = example_refusal(shared_copy(model), args, kwargs)
    if refused is not None:
        dtype = str(next(iter(weights))).removeprefix("torch.")
        raise InputError(f"amppass.convert({type(model).__name__}): the example holds {' and '.join(other)} tensors "
                         f"and the model's weights are {dtype}, and the model itself does not run on it "
                         f"({refused[0]}): pass the example in {dtype} (x.to(torch.{dtype})); the converted model then "
                         "takes calls in other floating dtypes, casting them at its boundary") from refused[1]


def _inference_only(converted: nn.Module, name: str) -> None:
    """A model converted for inference from train mode without ``mode=`` (:func:`convert` warned): in eval mode,
    its converted graph refusing a call in train mode with gradients enabled (training it)."""
    record_of(converted).refuse_training(
        f"{name} was converted for inference (amppass.convert without mode=, from a model in "
        "train mode): its graph computes eval behaviour and holds no trainable weights, so it cannot be trained; "
        "convert the original with mode='train' to train it, or call .eval() (or run it under torch.no_grad()) "
        "to use it for inference")
    converted.eval()




def _convert_module(model: nn.Module, example: tuple[Any, dict] | None, settings: Settings) -> nn.Module:
    """``model`` converted whole: captured in one graph (both modes' graphs in train mode), or CaptureError."""
    example_inputs, example_kwargs = example if example is not None else (None, None)
    dynamic_shapes = settings.dynamic_shapes
    if settings.trains:
        # torch.export bakes the training flag into the graph: one graph per mode over one set of fp32 tensors
        captured = {flag: capture(model, example_inputs, example_kwargs, train=flag, dynamic_shapes=dynamic_shapes)
                    for flag in (True, False)}
        for gm in captured.values():
            functional_writes(gm)  # the check's backward runs them under autograd, as training will
        args, kwargs = example_call(example)
        check_fidelity(model, captured[False], plain_inputs(args), plain_inputs(kwargs))
        check_backward(model, captured, plain_inputs(args), plain_inputs(kwargs))  # a Function's own backward
        train_gm, eval_gm = (Captures(model, settings, flag).served(captured[flag], example) for flag in (True, False))
        with local_amaxes():  # its check runs are this process's own, under data parallelism too
            trained = TrainEvalGraphs(train_gm, eval_gm, training=model.training, original=model, example=example)
        return with_signature(trained, model)  # Trainer keeps the dataset columns forward() names
    gm = capture(model, example_inputs, example_kwargs, train=False, dynamic_shapes=dynamic_shapes)
    if example is not None:
        check_fidelity(model, gm, *example_call(example))  # the graph computes what the model does
    served = Captures(model, settings, False).served(gm, example)
    if settings.measures_whole_model and example is not None:
        served = _faster_of(served, model, example, settings.options.costs)
        if record_of(served).in_model_class:
            return served  # the original itself, in its own class already
    # a drop-in: the model's class, attributes and signature; its saves write the plan beside the weights
    return in_own_class(model, served, plan_file)


def _convert_parts(model: nn.Module, example: tuple[Any, dict], why: CaptureError, settings: Settings) -> nn.Module:
    """``model``, which does not capture whole, converted by parts (:mod:`amppass.pipelines.parts`)."""
    from .parts import convert_by_parts

    options = settings.options

    def convert_one(child: nn.Module, call: tuple[tuple, dict], calibration: list | None) -> nn.Module:
        args, kwargs = call
        own = dataclasses.replace(settings, dynamic_shapes="auto", options=options.replace(
            keep_io_types=True, calibration=calibration, tolerance=options.tolerance if calibration else None))
        return _convert_module(child, (args, transformers_call(child, kwargs)), own)

    calibration = options.calibration
    return convert_by_parts(model, example, why, settings.trains, settings.low.name, convert_one,
                            list(calibration) if calibration is not None else None)


class Captures:
    """The captures of one module in one training flag after the first: calibration's fp32 capture for a batch of
    shapes the first does not take (:meth:`fp32`), and the converted capture a :class:`ServingGraph` makes for a
    call of such shapes (:meth:`converted`), planned with the first plan's carried decisions."""

    def __init__(self, model: nn.Module, settings: Settings, train: bool):
        self.model, self.settings, self.train = model, settings, train
        self.carried: dict[str, Any] = {}

    def served(self, gm: fx.GraphModule, example: tuple[Any, dict] | None) -> nn.Module:
        """The captured ``gm`` converted (:func:`amppass.pipelines.stages.plan_captured`); one captured by
        torch.export comes back serving every input shape."""
        gm = plan_captured(gm, self.model, self.settings, example=example, recapture=self.fp32, training=self.train)
        if GUARDS_KEY not in gm.meta:  # symbolically traced: no shapes in the graph to guard
            return TracedGraph(gm)
        self.carried = carried_decisions(gm)
        return ServingGraph(gm, gm.meta[GUARDS_KEY], self.converted, original=self.model,
                            name=type(self.model).__name__)

    def fp32(self, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, GraphView]:
        """The fp32 graph of a calibration batch and its view; for a batch the model itself rejects, the model's
        own error."""
        try:
            gm = capture(self.model, args, kwargs, train=self.train, note_fixed_dims=False)
        except CaptureError:
            with torch.no_grad(), module_mode(self.model, self.train):
                self.model(*plain_inputs(args), **plain_inputs(kwargs))
            raise
        return gm, build_view(gm, self.settings.resolved)[0]

    def converted(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        """A capture for a call of other shapes, converted with the first plan's carried decisions."""
        new = capture(self.model, args, kwargs, train=self.train, note_fixed_dims=False, static_image_sizes=False)
        return plan_captured(new, self.model, self.settings.later(), example=(args, kwargs),
                             carried=carried_into(new, self.carried), training=self.train)


def _convert_program(program: torch.export.ExportedProgram, settings: Settings) -> fx.GraphModule:
    """Convert a program exported elsewhere (``torch.export.load``): its graph is the capture."""
    from .serialize import from_program, is_converted

    if settings.trains:
        raise InputError("an ExportedProgram is converted for inference only (export fixed its train/eval "
                         "behaviour); convert the nn.Module itself with mode='train' to train it")
    if is_converted(program):
        loaded = from_program(program, {"dtype": _converted_dtype(program), "mode": "inference"}, "ExportedProgram")
        return _unchanged(loaded, loaded.meta[META_KEY], settings)
    gm = capture_program(program)
    gm = plan_captured(gm, gm, settings.on(gm))
    return ServingGraph(gm, gm.meta[GUARDS_KEY], name="ExportedProgram",
                        origin="it was converted from a torch.export program, which serves the shapes its export "
                               "left dynamic; export it with dynamic_shapes to serve more")


def _converted_dtype(program: torch.export.ExportedProgram) -> str:
    """The low dtype a converted program's casts go to (its plan's summary is not in the program itself)."""
    from .serialize import stored_decision

    for node in program.graph.nodes:
        decision = stored_decision(node, "ExportedProgram") or {}
        if decision.get("cast") and decision.get("to") in ("fp16", "bf16"):
            return decision["to"]
    return "unknown"


def _faster_of(gm: fx.GraphModule, model: nn.Module, example: tuple[Any, dict],
               costs: Mapping[str, float] | None) -> nn.Module:
    """``gm``, or the original module kept in fp32 (:mod:`amppass.serving.fp32_original`) where nothing in the plan
    runs low or where the converted graph did not measure faster than the original here: plan_for="speed" promises a
    model no slower than the original, and a graph of fp32 ops costs its own call overhead besides."""
    args, kwargs = example
    args = split_batch(args)[0] if args is not None else ()
    info = gm.meta[META_KEY]
    if not any(_runs_low(node) for node in gm.graph.nodes):
        device = info.get("profitability", {}).get("device", {})
        why = "nothing in the plan runs low on this device" + (
            f" ({device['why']})" if device.get("native_low") is False and device.get("why") else "")
        log.warning("%s: nothing in the plan runs low on this device; keeping the original (plan_for='coverage' "
                    "converts it anyway)", type(model).__name__)  # the device's reason is said once (_say_once)
        return _kept(gm, model, info, why)
    device = next((t.device for t in gm.parameters()), torch.device("cpu"))
    table = CostModel({**info.get("costs", {}), **(costs or {})}, TimingCache(fingerprint(device)))
    # timed even where the regions' timings were not (a region of hundreds of kernels rarely has an undisturbed
    # round where two calls do): the check that keeps a plan estimated from the prior from being slower
    measured = region_timing.whole_model(gm, model, args, kwargs, table)
    if measured is None:
        # keeping the original throws the whole plan away: only on measurements load left undisturbed
        log.warning("%s: not timed against your original module as a whole: other programs were using the CPU, so "
                    "repeated timings disagreed; the converted model is returned (convert again when the machine is "
                    "idle, or pass costs= from an idle run)", type(model).__name__)
        info["whole_model"] = {"skipped": "the machine was too busy for the timings to agree"}
        return gm
    converted_s, original_s = measured
    info["costs"] = table.table() if not info.get("costs") else {**info["costs"], **table.table()}
    info["whole_model"] = {"converted_ms": round(converted_s * 1e3, 4), "original_ms": round(original_s * 1e3, 4)}
    if converted_s < original_s:
        return gm
    log.warning("%s: the converted graph measured %.3g ms against %.3g ms for the original module in fp32 on "
                "this device; keeping the original (plan_for='coverage' converts it anyway)",
                type(model).__name__, converted_s * 1e3, original_s * 1e3)
    return _kept(gm, model, info)


def _runs_low(node: fx.Node) -> bool:
    decision = node.meta.get(META_KEY)
    return bool(decision) and not decision.get("cast") and decision.get("precision") == Precision.LOW.value


def _kept(gm: fx.GraphModule, model: nn.Module, info: dict, why: str | None = None) -> nn.Module:
    """The original kept in fp32 with what the conversion measured (``why`` instead of times, where none were)."""
    record = {**info, "casts": 0, "weights_converted": 0, "weight_copies": 0,
              "weight_bytes_after": info["weight_bytes_before"]}
    if why is not None:
        record["whole_model"] = {"skipped": why}
    kept = keep_original(model, record)
    return gm if kept is None else kept


def _unchanged(model: nn.Module, info: Mapping[str, Any], settings: Settings) -> nn.Module:
    """An already converted ``model``, returned as it is when the caller asks for what it already is."""
    done, dtype = info.get("dtype", "unknown"), settings.dtype
    wanted = done if isinstance(dtype, str) and dtype.strip().lower() == "auto" else low_type(dtype).name
    check_reconversion(type(model).__name__, done, wanted, "convert the original float32 module instead",
                       done_mode=info.get("mode"), wanted_mode=settings.mode)
    return model
