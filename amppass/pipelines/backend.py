"""``torch.compile(model, backend="amppass", options={...})``: the amppass plan on every graph dynamo captures.

Dynamo hands the backend one graph per region it traces (graph breaks, guards and recompiles are its own).
Each graph is traced to ATen ops over dynamo's own fake inputs, goes through the pipeline
:func:`amppass.convert` uses, and the rewritten graph goes to inductor with the example inputs dynamo passed
(or runs as it is with ``compiler="eager"``). Models torch.export cannot capture whole (data-dependent
Python in a detector's post-processing, a generate loop) still get mixed precision on every traced region.

Rules:

1. A dynamo graph takes the model's parameters and buffers as inputs. They become attributes of the graph
   (the very tensors, shared), so the rewrite stores low-precision copies of the weights once per graph
   (inference) or casts the fp32 parameters inside the graph, so gradients reach them (training: grad mode
   on and a parameter that requires grad, when the graph is compiled).
2. Before each call, a parameter whose version counter moved (an optimizer step, ``load_state_dict``) or
   that is another tensor now has its low-precision copies refreshed in place, so compiled code that holds
   them sees the new values; code that folded them (inductor's freezing) or holds the old tensor is
   compiled again, for the same symbolic inputs.
3. The graph is rewritten as dynamo traced it: sizes dynamo made dynamic stay symbols of its shape
   environment, and a size dynamo passes as its own input is read from the tensor it measures. Inductor
   compiles it inside dynamo's compile, for dynamo's example inputs, so its code serves every shape dynamo's
   guards admit, and a guard the trace or inductor adds on a size is one more guard dynamo checks. A new
   shape dynamo's guards reject is dynamo's recompile: a new graph, converted on its own.
4. Each graph of static sizes (dynamo's first compile of a model) runs dynamo's example inputs once in fp32
   and converted (inference), as :func:`amppass.convert` runs its example: a node whose low value goes inf or
   NaN where fp32's is finite is kept fp32 (:mod:`amppass.fx.runners.finite`), and the report's ``info["non_finite"]``
   names it with its graph.
5. Every graph's plan is kept with the ``torch.compile`` call that made it: ``amppass.report(compiled)``
   shows every graph's rows (named ``g<i>.<node>``) and the inputs each takes.
6. In training, a graph that applies a ``torch.autograd.Function`` runs as dynamo traced it, in fp32 (logged;
   the report's ``info["unconverted"]`` says why): tracing it to ATen ops would keep the Function's forward and
   differentiate that, losing the backward the model wrote (a straight-through estimator's, YOSO's).
7. With ``plan_for="speed"`` (the default), in training and in inference, profitability's device rule decides
   before any graph is traced, as it does for :func:`amppass.convert` in train mode (the same function,
   :func:`amppass.analysis.profitability.fp32_by_device`): on a device without native arithmetic for the low dtype
   (a CPU without bf16/fp16 instructions: no avx512_bf16 or AMX for bf16, no avx512_fp16 or AMX-FP16 for fp16) no
   op would run or train faster low, so every graph runs as dynamo traced it, in fp32, at plain ``torch.compile``'s
   speed; one warning per ``torch.compile`` call says why, and the report's ``info["unconverted"]`` and
   ``info["profitability"]`` too. ``plan_for="coverage"`` converts every graph anyway. A GPU, or a CPU with the
   instructions, converts as before. ``dtype="fp8"`` is checked by rule 8 first (a CPU needs "coverage" there).
8. ``dtype="fp8"`` (or ``"e4m3"``, ``torch.float8_e4m3fn``) plans each graph as :func:`amppass.convert` plans it
   (docs/fp8.md): a bf16 plan whose chosen matrix products run in e4m3, ``amppass::fp8_linear`` in inference and
   ``amppass::fp8_train_linear`` in training, each one op for inductor. The device of a graph's inputs is checked as
   convert checks its target, once per device (a CPU needs ``plan_for="coverage"``, a GPU compute capability 8.9).
   Training reads the fp32 master weights on every call, so an optimizer step leaves nothing to refresh; an
   inference graph whose weights changed is planned again on the new ones (its e4m3 copies and their scales came
   from the old ones, which also chose its products). The report's ``info["fp8"]`` counts every graph's products.

Options (all optional): ``dtype`` ("auto", "fp16", "bf16", "fp8", torch dtypes), ``compiler`` ("inductor" or
"eager"), ``plan_for`` ("speed", the default, or "coverage": every graph is planned as "coverage", without timing
kernels, since profitability times eager kernels, not the fused code inductor makes; "speed" adds rule 7),
``keep_io_types``, ``keep_fp32``, ``force_low``, ``low_weight_tables`` as for :func:`amppass.convert`, and
``calibration`` / ``tolerance``: batches of inputs for the graphs whose inputs they match (the model's first graph: a
tuple in the graph's input order or a dict by argument name); other graphs are planned without them, and their
report info says so.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Iterator, cast

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..analysis.options import PlanOptions
from ..analysis.profitability import fp32_by_device
from ..analysis.record import META_KEY, fp8_record, stored_fp8_products
from ..dtypes import fp8_format, low_type
from ..errors import CaptureError, InputError
from ..fx.capture.dynamo_graph import (
    fake_mode,
    lift_state,
    refuse_own_backward,
    state_inputs,
    symbol_ranges,
    trace_aten,
    views_as_reshapes,
)
from ..fx.capture.guards import input_spec
from ..reporting.fx_reader import read_graph_module
from ..reporting.report import Report, merged
from ..serving.serving_graph import set_state
from ..targets.target import check_fp8
from .settings import MODES, Settings
from .stages import plan_captured

log = logging.getLogger(__name__)

COMPILERS = ("inductor", "eager")
_OPTIONS = ("dtype", "mode", "compiler", "plan_for", "freezing", "keep_io_types", "keep_fp32", "force_low",
            "low_weight_tables", "calibration", "tolerance")
PLANS = ("speed", "coverage")
_PLAN_OPTIONS = ("keep_io_types", "keep_fp32", "force_low", "low_weight_tables")  # every graph's plan options
@dataclass
class Session:
    """What one ``torch.compile(..., backend="amppass")`` call converted: its graphs, in compile order."""

    settings: "BackendSettings"  # without the calibration batches
    graphs: list["CompiledGraph"] = field(default_factory=list)
    by_device: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # rule 7's record, per device type
    fp8_checked: set[str] = field(default_factory=set)  # rule 8: the device types dtype='fp8' was checked for

    def check_fp8(self, example_inputs: list[Any]) -> None:
        """Rule 8: dtype='fp8' checked for the device of ``example_inputs`` as :func:`amppass.convert` checks its
        target (an InputError where it cannot be planned; the CPU's warning), once per device for this compile."""
        fp8, device = self.settings.conversion.options.fp8, _device(example_inputs).type
        if fp8 is None or device in self.fp8_checked:
            return
        try:
            check_fp8(device, self.settings.conversion.options.plan_for)
        except InputError as err:
            raise InputError(f"torch.compile(backend='amppass', options={{'dtype': 'fp8'}}) plans each graph as "
                             f"amppass.convert does, which refuses it here: {err} (in options=)") from None
        self.fp8_checked.add(device)

    def kept_fp32(self, example_inputs: list[Any], weights: int) -> str | None:
        """Rule 7: why a graph on the device of ``example_inputs`` runs unconverted (the device alone keeps a plan
        for speed fp32, in either mode), or None; decided, and warned about, once per device for this compile.
        ``weights``: the bytes of the graph's parameters and buffers, for the record."""
        conversion = self.settings.conversion
        device = _device(example_inputs)
        if device.type not in self.by_device:
            self.by_device[device.type] = fp32_by_device(
                "torch.compile(backend='amppass')", conversion.on(device).resolved, device, conversion.options, weights,
                anyway="options={'plan_for': 'coverage'} converts it anyway; compiled on a GPU, its graphs are "
                       "planned for the GPU", mode=conversion.mode)
        record = self.by_device[device.type]
        return None if record is None else record["whole_model"]["skipped"]

    def report(self) -> Report:
        """One report over every graph: rows named ``g<i>.<node>``, the summary summed over graphs."""
        if not self.graphs:
            raise InputError("this compiled model has not run yet, so dynamo has given amppass no graph to "
                             "convert; call it once, then ask for the report")
        converted = [g for g in self.graphs if g.converted is not None]
        parts = [(f"g{graph.index}", read_graph_module(graph.plan)) for graph in converted]
        whole = merged(parts)
        rows, info = whole.rows, {k: v for k, v in whole.info.items() if k != "target"}
        fp8 = [part.info["fp8"] for _, part in parts if isinstance(part.info.get("fp8"), dict)]
        if fp8:  # rule 8: every graph's matrix products counted again, the first graph's scales and search said
            low = str(fp8[0].get("low"))
            decisions = ({"precision": row.precision, "reason": row.reason, "evidence": row.evidence} for row in rows)
            info["fp8"] = {**fp8[0], **fp8_record(str(fp8[0].get("format")), low, stored_fp8_products(decisions, low))}
        if not converted:  # every graph runs as dynamo traced it (info["unconverted"] says why)
            info.update({"dtype": "fp32", "mode": self.settings.conversion.mode})
        kept = [record for record in self.by_device.values() if record is not None]
        if kept:  # rule 7: the device's facts that kept the graphs fp32
            info["profitability"] = kept[0]["profitability"]
        info.update({"front_end": "fx", "compiler": self.settings.compiler,
                     "graphs": len(converted), "calibrated": any(g.calibrated for g in converted),
                     "unconverted": [{"graph": g.index, "reason": g.failed} for g in self.graphs if g.failed],
                     "graph_plans": [{"graph": g.index, "calibrated": g.calibrated, "inputs": g.inputs(),
                                      "refreshes": g.refreshes} for g in converted]})
        checked = {g.index: g.plan.meta[META_KEY]["non_finite"] for g in converted
                   if "non_finite" in g.plan.meta[META_KEY]}
        if checked:  # the example call's check (fx.finite), per graph, its nodes named as the rows are
            info["non_finite"] = [{"graph": index, **{k: [f"g{index}.{n}" for n in v] if k == "kept_fp32" else v
                                                      for k, v in found.items()}} for index, found in checked.items()]
        return Report(rows, info)


def amppass_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                    **unused: Any) -> Callable[..., Any]:
    """The torch.compile backend registered as ``"amppass"`` (module docstring for the options)."""
    settings = _settings(options)
    session = _session(options, settings)
    graph = CompiledGraph(gm, example_inputs, settings, len(session.graphs), session)
    session.graphs.append(graph)
    return graph


class CompiledGraph:
    """One dynamo graph, converted when dynamo hands it over: called with dynamo's flat inputs, it runs the plan.

    The graph is rewritten as dynamo traced it, with its symbolic sizes (rule 3), and inductor compiles the
    rewritten graph for the example inputs dynamo passed, inside dynamo's compile: the code it makes serves
    every shape dynamo's guards let through, and any guard inductor adds on the sizes is dynamo's to check.
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], settings: "BackendSettings", index: int,
                 session: Session):
        self.gm, self.settings, self.index = gm, settings, index
        self.compiler, self.refreshes, self.calibrated = settings.compiler, 0, False
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.state = state_inputs(self.placeholders, example_inputs)  # position -> attribute name (rule 1)
        self.converted: fx.GraphModule | None = None
        self.users: list[int] = []
        self.fakes = [n.meta.get("example_value") for n in self.placeholders]
        session.check_fp8(example_inputs)
        # why the graph is not converted (it then runs as dynamo traced it): the device (rule 7), or its trace
        self.failed = session.kept_fp32(example_inputs, _bytes(example_inputs[i] for i in self.state))
        if self.failed is None:
            try:
                self._convert(example_inputs)
            except CaptureError as err:  # one region stays fp32 rather than the whole model failing
                self.failed = str(err)
                log.warning("amppass backend: graph %d runs as dynamo traced it, in fp32: %s", self.index, err)
        if self.failed is not None:
            self.run = gm.forward if self.compiler == "eager" else _inductor(gm, example_inputs, freeze=False)
            return
        self.run = self._compile([example_inputs[i] for i in self.users], inside_dynamo=True)

    def __call__(self, *args: Any) -> Any:
        """Run the graph on dynamo's inputs: the converted one on the inputs it uses, else dynamo's as traced."""
        if self.converted is None:
            return self.run(*args)
        self._refresh(args)
        return self.run(*(args[i] for i in self.users))

    @property
    def plan(self) -> fx.GraphModule:
        """The converted graph; asked for only where the graph converted (a failed one has none)."""
        if self.converted is None:
            raise AssertionError(f"amppass backend: graph {self.index} was not converted ({self.failed})")
        return self.converted

    def inputs(self) -> str:
        """The inputs the converted graph takes, as dynamo traced them: ``x: [s0, 3, s1, s1] float32``."""
        ranges = symbol_ranges(self.fakes)
        return "; ".join(input_spec(self.placeholders[i].name, self.fakes[i]).describe(ranges) for i in self.users
                         if isinstance(self.fakes[i], torch.Tensor))

    def _frozen(self) -> bool:
        """Inductor's freezing folds the weights (and their casts) into the compiled code: inference only."""
        return self.settings.freezing and not self.settings.conversion.trains and not torch.is_grad_enabled()

    def _convert(self, example_inputs: list[Any]) -> None:
        if self.settings.conversion.trains:
            refuse_own_backward(self.gm)
        traced = trace_aten(self.gm, self.fakes, self.index)
        lifted, self.users = lift_state(traced, self.placeholders, example_inputs, self.state)
        settings, self.calibrated = self.settings.of_graph(self.placeholders, self.users, example_inputs, self.index)
        # planned without measuring: profitability times eager kernels, not the fused code inductor makes; the
        # example dynamo passed is run once in fp32 and converted, as convert's is (fx.finite)
        self.converted = plan_captured(lifted, lifted, settings, example=self._static_example(example_inputs, lifted))
        self.frozen = self._frozen()
        self.bound = {i: (example_inputs[i], _version(example_inputs[i])) for i in self.state}
        # state dynamo kept as attributes of its graph (constants the trace made never change)
        self.attributes = {name: (t, _version(t)) for name, t in traced.meta["attributes"]
                           if name not in self.state.values()}
        log.info("amppass backend: graph %d converted (%s, %s, %d state tensors)", self.index, settings.mode,
                 self.compiler,
                 len(self.state))

    def _static_example(self, example_inputs: list[Any], traced: fx.GraphModule) -> tuple[tuple, dict] | None:
        """Dynamo's example inputs as convert's ``example`` for the graph's check on them (rule 4); None where a
        size anywhere in the traced graph is a symbol (the graph's sizes are expressions of dynamo's shape
        environment, which only its compiled code evaluates) or an input is fake (an ahead-of-time compile)."""
        from torch._subclasses.fake_tensor import FakeTensor

        inputs = [example_inputs[i] for i in self.users]
        if any(isinstance(t, FakeTensor) for t in inputs):
            return None
        for node in traced.graph.nodes:
            for value in pytree.tree_leaves(node.meta.get("val")):
                if isinstance(value, torch.SymInt) or (isinstance(value, torch.Tensor) and any(
                        isinstance(size, torch.SymInt) for size in value.shape)):
                    return None
        return tuple(inputs), {}

    def _compile(self, inputs: list[Any], inside_dynamo: bool) -> Callable[..., Any]:
        """The converted graph as it runs: itself (eager) or inductor's code for it.

        Inside dynamo's compile inductor reads the symbolic sizes of dynamo's example inputs from its tracing
        context; a compile after that (rule 2) gives it the fake inputs dynamo traced, in their own context.
        """
        if self.compiler == "eager":
            return self.plan
        if inside_dynamo:
            return _inductor(self.plan, inputs, freeze=self.frozen)
        from torch._guards import TracingContext, tracing

        fakes = [self.fakes[i] for i in self.users]
        with tracing(TracingContext(fake_mode(fakes))):
            return _inductor(self.plan, fakes, freeze=self.frozen)

    def _refresh(self, args: tuple) -> None:
        """Rule 2: new values in a parameter reach its low-precision copies, in place.

        In training the graph casts the parameters itself (an optimizer step changes nothing to refresh);
        only a parameter that is another tensor now is pointed at.
        """
        training = self.settings.conversion.trains
        refreshed = replaced = False
        for position, name in self.state.items():
            tensor = args[position]
            seen, version = self.bound[position]
            if tensor is seen and (training or _version(tensor) == version):
                continue
            self._copy_into_graph(name, tensor)
            replaced |= tensor is not seen
            refreshed = True
            self.bound[position] = (tensor, _version(tensor))
        for name, (tensor, version) in self.attributes.items():  # state dynamo kept as the graph's attributes
            if not training and _version(tensor) != version:
                self._copy_into_graph(name, tensor)
                refreshed = True
                self.attributes[name] = (tensor, _version(tensor))
        if refreshed and not training and self.settings.conversion.options.fp8 is not None:
            self._replan(args)
        elif self.compiler != "eager" and (replaced or (refreshed and self.frozen)):
            # compiled code holds the tensors it was compiled with, and frozen code their values: compile again
            self.run = self._compile([], inside_dynamo=False)

    def _replan(self, args: tuple) -> None:
        """Rule 8: an fp8 inference plan whose weights changed is made again on the new weights (its products hold
        e4m3 copies quantized with scales from the old ones, and the old weights chose its products), for the
        call's own inputs, and compiled again."""
        log.info("amppass backend: graph %d's weights changed; its fp8 plan is made again on the new ones", self.index)
        self._convert(list(args))
        from torch._inductor import config

        # inductor's graph cache served this compile the code frozen with the old plan's e4m3 weights (measured with
        # torch 2.13: the old outputs), so the new plan is compiled past it
        with config.patch(fx_graph_cache=False):
            self.run = self._compile([], inside_dynamo=False)

    def _copy_into_graph(self, name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            _refresh_copies(self.plan, name, tensor)
        self.refreshes += 1


def session_of(compiled: Any) -> Session | None:
    """The session of a module or function ``torch.compile(backend="amppass")`` returned, if it has run."""
    for callback in _backend_chain(compiled):
        found = _SESSIONS.get(id(callback))
        if found is not None and found[0]() is callback:
            return found[1]
    return None


def compiled_with_amppass(compiled: Any) -> bool:
    """Whether ``compiled`` is what ``torch.compile(..., backend="amppass")`` returned, called or not."""
    return any(callback is amppass_backend for callback in _backend_chain(compiled))


def _backend_chain(compiled: Any) -> Iterator[Any]:
    """Every wrapper from a ``torch.compile`` result down to the backend function it calls.

    A compiled module keeps dynamo's context as ``dynamo_ctx``, a compiled function in its closure; from its
    callback, the chain of wrappers leads to the ``torch.compile`` wrapper (a session belongs to it) and then
    to the backend function.
    """
    starts = []
    context = getattr(compiled, "dynamo_ctx", None)
    if context is not None:
        starts.append(getattr(context, "callback", None))
    for cell in getattr(compiled, "__closure__", None) or ():
        value = cell.cell_contents
        starts.append(getattr(value, "callback", None) if hasattr(value, "callback") else value)
    for callback in starts:
        for _ in range(16):
            if callback is None:
                break
            yield callback
            callback = getattr(callback, "_torchdynamo_orig_backend", None) or getattr(callback, "compiler_fn", None)


# -- sessions: which torch.compile call a graph belongs to (rule 5) ------------------------------------------

_SESSIONS: dict[int, tuple[weakref.ref, Session]] = {}


def _session(options: dict[str, Any] | None, settings: "BackendSettings") -> Session:
    """The session of the ``torch.compile`` wrapper calling this backend (the one holding ``options``)."""
    frame: FrameType | None = sys._getframe(2)
    owner: object | None = None
    for _ in range(12):
        if frame is None:
            break
        candidate = frame.f_locals.get("self")
        if type(candidate).__name__ == "_TorchCompileWrapper" and getattr(candidate, "kwargs", {}).get(
                "options") is options:
            owner = candidate
            break
        frame = frame.f_back
    if owner is None:  # called some other way (torch._dynamo.optimize, directly): one session per options
        owner = _Anonymous.for_options(options)
    found = _SESSIONS.get(id(owner))
    if found is not None and found[0]() is owner:
        return found[1]
    session = Session(dataclasses.replace(settings, calibration=None))  # not the batches themselves
    key = id(owner)
    _SESSIONS[key] = (weakref.ref(owner, lambda _: _SESSIONS.pop(key, None)), session)
    return session


class _Anonymous:
    """A session owner for calls without a torch.compile wrapper, kept for the options object's lifetime."""

    _by_options: dict[int, "_Anonymous"] = {}

    @classmethod
    def for_options(cls, options: Any) -> "_Anonymous":
        key = id(options)
        if key not in cls._by_options:
            cls._by_options[key] = cls()
        return cls._by_options[key]


# -- options, calibration batches, refreshes, compiling ------------------------------------------------------

@dataclass(frozen=True)
class BackendSettings:
    """The backend's ``options``, checked once (:func:`_settings`): the settings every graph is converted with
    (``conversion``, its ``plan_for`` as given: each graph is planned for coverage, rule 7 applies to "speed"), how
    the converted graphs run (``compiler``, ``freezing``), and the calibration batches with their tolerance, for
    the graphs whose inputs they match (:meth:`of_graph`)."""

    conversion: Settings
    compiler: str = "inductor"
    freezing: bool = True
    calibration: list[Any] | None = None
    tolerance: float | None = None

    def of_graph(self, placeholders: list[fx.Node], users: list[int], example_inputs: list[Any],
                 index: int) -> tuple[Settings, bool]:
        """The settings of one graph, for the device of its inputs: a coverage plan, made without measuring
        (profitability times eager kernels, not the fused code inductor makes), calibrated only where its batches
        fit; and whether they do."""
        settings = self.conversion.on(_device(example_inputs)).replace(plan_for="coverage")
        batches = _aligned(self.calibration, [placeholders[i] for i in users], [example_inputs[i] for i in users])
        if self.calibration is not None and batches is None:
            log.info("amppass backend: graph %d takes other tensors than the calibration batches; planned without "
                     "them", index)
        if batches is None:
            return settings, False
        return settings.replace(calibration=batches, tolerance=self.tolerance), True


def _settings(options: dict[str, Any] | None) -> BackendSettings:
    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise InputError(f"torch.compile(backend='amppass'): unknown option(s) {unknown}; the options are "
                         f"{list(_OPTIONS)}, e.g. options={{'dtype': 'bf16', 'compiler': 'inductor'}}")
    settings = {"dtype": "auto", "mode": "inference", "compiler": "inductor", "plan_for": "speed", "freezing": True,
                "calibration": None, "tolerance": None, **options}
    if settings["mode"] not in MODES:
        raise InputError(f"torch.compile(backend='amppass'): mode={settings['mode']!r} is not one of {MODES}; "
                         "'train' casts the fp32 parameters inside each graph so gradients reach them")
    if settings["compiler"] not in COMPILERS:
        raise InputError(f"torch.compile(backend='amppass'): compiler={settings['compiler']!r} is not one of "
                         f"{COMPILERS}; 'inductor' compiles the converted graphs, 'eager' runs them as they are")
    if settings["plan_for"] not in PLANS:
        raise InputError(f"torch.compile(backend='amppass'): plan_for={settings['plan_for']!r} is not one of {PLANS}; "
                         "'speed' runs every graph in fp32 on a device where no op runs faster low, 'coverage' "
                         "converts every graph anyway (amppass.convert(..., plan_for='memory') stores weights low)")
    calibration = settings["calibration"]
    calibration = list(calibration) if calibration is not None else None  # every graph it matches reads it
    fp8 = fp8_format(settings["dtype"])  # rule 8: a bf16 plan with some products lowered further
    dtype = "bf16" if fp8 is not None else settings["dtype"]
    low_type(dtype)  # a bad dtype is reported now, not at the first graph
    plan = PlanOptions(plan_for=settings["plan_for"], fp8=fp8,
                       **{name: options[name] for name in _PLAN_OPTIONS if name in options})
    return BackendSettings(Settings(plan, settings["mode"], dtype), settings["compiler"],
                           settings["freezing"], calibration, settings["tolerance"])


def _measured_by(node: fx.Node, tensors: list[fx.Node]) -> tuple[int, int] | None:
    """The position among ``tensors`` and the dimension whose size a SymInt input is."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.SymInt):
        return None
    for position, tensor in enumerate(tensors):
        fake = tensor.meta.get("example_value")
        for dim, size in enumerate(getattr(fake, "shape", ())):
            if isinstance(size, torch.SymInt) and size.node.expr == value.node.expr:
                return position, dim
    return None


def _aligned(batches: list[Any] | None, inputs: list[fx.Node], examples: list[Any]) -> list[tuple] | None:
    """The calibration batches as this graph's input tuples, or None if they do not fit it.

    A batch holds the graph's tensor inputs; a size dynamo passes as its own input is read from the batch
    tensor it measures.
    """
    if not batches:
        return None
    tensors = [n for n, e in zip(inputs, examples, strict=False) if isinstance(e, torch.Tensor)]
    examples = [e for e in examples if isinstance(e, torch.Tensor)]
    measured = {n: _measured_by(n, tensors) for n in inputs if n not in tensors}
    sizes = {n: where for n, where in measured.items() if where is not None}
    if len(sizes) < len(measured):
        return None
    names = [str(getattr(getattr(n.meta.get("grapharg"), "source", None), "local_name", n.name)) for n in tensors]
    aligned = []
    for batch in batches:
        if isinstance(batch, dict):
            if not all(name in batch for name in names):
                return None
            batch = tuple(batch[name] for name in names)
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if len(batch) != len(examples) or not all(
            _fits(b, t, n) for b, t, n in zip(batch, examples, tensors, strict=False)
        ):
            return None
        given = dict(zip(tensors, batch, strict=False))
        aligned.append(tuple(given[n] if n in given else batch[sizes[n][0]].shape[sizes[n][1]] for n in inputs))
    return aligned


def _fits(batch: Any, tensor: torch.Tensor, node: fx.Node) -> bool:
    """A calibration tensor fits a graph input: same dtype and rank, same size wherever dynamo fixed it."""
    if not isinstance(batch, torch.Tensor) or batch.dtype != tensor.dtype or batch.dim() != tensor.dim():
        return False
    traced = getattr(node.meta.get("example_value"), "shape", tensor.shape)
    return all(isinstance(s, torch.SymInt) or int(s) == b for s, b in zip(traced, batch.shape, strict=False))


def _refresh_copies(plan: fx.GraphModule, name: str, tensor: torch.Tensor) -> None:
    """Point ``name`` at ``tensor`` where the plan reads it in fp32; copy it into its low-precision copies."""
    for attr in (name, *(f"{name}__{low}" for low in ("fp16", "bf16"))):
        try:
            held = plan.get_parameter(attr) if _is_parameter(plan, attr) else plan.get_buffer(attr)
        except AttributeError:
            continue
        if held.dtype == tensor.dtype:
            if held is not tensor:
                set_state(plan, attr, tensor)
        else:
            held.copy_(tensor)


def _is_parameter(module: nn.Module, name: str) -> bool:
    *path, leaf = name.split(".")
    try:
        return leaf in module.get_submodule(".".join(path))._parameters
    except AttributeError:
        return False


def _inductor(plan: fx.GraphModule, inputs: list[Any], freeze: bool) -> Callable[..., Any]:
    """Compile one plan with inductor (a plain GraphModule over its tensors: inductor traces forward())."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    plain = fx.GraphModule(plan, views_as_reshapes(plan.graph))
    with config.patch(freezing=freeze):
        # compile_fx returns a path, paths or weights only for an ahead-of-time compile; this one is just in time
        return cast(Callable[..., Any], compile_fx(plain, list(inputs)))


def _version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter; None for a tensor made under ``torch.inference_mode()``, which has none."""
    return None if tensor.is_inference() else tensor._version


def _bytes(tensors: Iterator[Any]) -> int:
    """Bytes of the floating tensors among ``tensors``."""
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point())


def _device(values: list[Any]) -> torch.device:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")

