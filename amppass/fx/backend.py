"""``torch.compile(model, backend="amppass", options={...})``: the amppass plan on every graph dynamo captures.

Dynamo hands the backend one graph per region it traces (graph breaks, guards and recompiles are its own).
Each graph goes through the pipeline :func:`amppass.convert` uses, and the result goes to inductor (or runs
as it is with ``compiler="eager"``). Models torch.export cannot capture whole (data-dependent Python in a
detector's post-processing, a generate loop) still get mixed precision on every traced region.

Rules:

1. A dynamo graph takes the model's parameters and buffers as inputs. They become attributes of the graph
   (the very tensors, shared), so the rewrite stores low-precision copies of the weights once per graph
   (inference) or casts the fp32 parameters inside the graph, so gradients reach them (training: grad mode
   on and a parameter that requires grad, when the graph is compiled).
2. Before each call, a parameter whose version counter moved (an optimizer step, ``load_state_dict``) or
   that is another tensor now has its low-precision copies refreshed in place, so compiled code that holds
   them sees the new values.
3. A size dynamo passes as its own input is read from the tensor it measures, so the exported graph takes
   tensors only. Dimensions dynamo made dynamic stay dynamic; a call the converted graph's guards reject is
   converted again, as :class:`~amppass.fx.shapes.ServingGraph` does.
4. Every graph's plan is kept with the ``torch.compile`` call that made it: ``amppass.report(compiled)``
   shows every graph's rows (named ``g<i>.<node>``).

Options (all optional): ``dtype`` ("auto", "fp16", "bf16", torch dtypes), ``compiler`` ("inductor" or
"eager"), ``keep_io_types``, ``keep_fp32``, ``force_low``, ``low_weight_tables`` as for
:func:`amppass.convert`, and ``calibration`` / ``tolerance``: batches of inputs for the graphs whose inputs
they match (the model's first graph: a tuple in the graph's input order or a dict by argument name); other
graphs are planned without them, and their report info says so.
"""

from __future__ import annotations

import logging
import re
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn

from ..dtypes import low_type
from ..targets.target import torch_target
from ..errors import CaptureError, InputError
from ..report.fx_reader import read_graph_module
from ..report.report import Report
from .capture import capture
from .convert import MODES, _served
from .shapes import ServingGraph, _set, _state

log = logging.getLogger(__name__)

COMPILERS = ("inductor", "eager")
_OPTIONS = ("dtype", "mode", "compiler", "freezing", "keep_io_types", "keep_fp32", "force_low", "low_weight_tables",
            "calibration", "tolerance")
_STATE_SOURCE = re.compile(r"\._(parameters|buffers)\['([^']+)'\]$")
_MODULE_STEP = re.compile(r"\._modules\['([^']+)'\]")


@dataclass
class Session:
    """What one ``torch.compile(..., backend="amppass")`` call converted: its graphs, in compile order."""

    options: dict[str, Any]
    graphs: list["CompiledGraph"] = field(default_factory=list)

    def report(self) -> Report:
        """One report over every graph: rows named ``g<i>.<node>``, the summary summed over graphs."""
        if not any(g.served is not None for g in self.graphs):
            raise InputError("this compiled model has not run yet, so dynamo has given amppass no graph to "
                             "convert; call it once, then ask for the report")
        rows, info = [], {}
        converted = [g for g in self.graphs if g.served is not None]
        for graph in converted:
            part = read_graph_module(graph.served)
            for row in part.rows:
                row.name = f"g{graph.index}.{row.name}"
                row.casts = [f"g{graph.index}.{c}" for c in row.casts]
                rows.append(row)
            for key in ("casts", "weights_converted", "weight_copies", "weight_bytes_before", "weight_bytes_after"):
                info[key] = info.get(key, 0) + int(part.info.get(key, 0))
            info.setdefault("dtype", part.info["dtype"])
            info.setdefault("mode", part.info.get("mode"))
        info.update({"front_end": "fx", "compiler": self.options.get("compiler", "inductor"),
                     "graphs": len(converted), "calibrated": any(g.calibrated for g in converted),
                     "unconverted": [{"graph": g.index, "reason": g.failed} for g in self.graphs if g.failed],
                     "graph_plans": [{"graph": g.index, "calibrated": g.calibrated, "inputs": g.served.guards.describe(),
                                      "refreshes": g.refreshes} for g in converted]})
        return Report(rows, info)


def amppass_backend(gm: fx.GraphModule, example_inputs: list[Any], options: dict[str, Any] | None = None,
                    **unused: Any) -> Callable[..., Any]:
    """The torch.compile backend registered as ``"amppass"`` (module docstring for the options)."""
    settings = _settings(options)
    session = _session(options, settings)
    graph = CompiledGraph(gm, example_inputs, settings, len(session.graphs))
    session.graphs.append(graph)
    return graph


class CompiledGraph:
    """One dynamo graph, converted on its first call: called with dynamo's flat inputs, it runs the plan.

    The conversion waits for the first call because torch.export cannot run while dynamo is still building
    the guards of the frame it compiles (export records dynamic dimensions that dynamo then finds changed).
    """

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], settings: dict[str, Any], index: int):
        self.gm, self.settings, self.index = gm, settings, index
        self.compiler, self.refreshes, self.calibrated = settings["compiler"], 0, False
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.state = _state_inputs(self.placeholders, example_inputs)  # position -> attribute name (rule 1)
        self.served: ServingGraph | None = None
        self.failed: str | None = None  # why the graph could not be converted (it then runs unconverted)
        # compiled code per plan, dropped with the plan when the served module lets it go
        self.compiled: weakref.WeakKeyDictionary[fx.GraphModule, Callable[..., Any]] = weakref.WeakKeyDictionary()
        self.last: tuple[tuple, fx.GraphModule] | None = None  # (input shapes and dtypes, the plan that ran)

    def __call__(self, *args: Any) -> Any:
        if self.served is None:
            if self.failed is not None:
                return self.gm(*args)
            try:
                self._convert(list(args))
            except CaptureError as err:  # one region stays fp32 rather than the whole model failing
                self.failed = str(err)
                log.warning("amppass backend: graph %d runs as dynamo traced it, in fp32: %s", self.index, err)
                return self.gm(*args)
        self._refresh(args)
        inputs = tuple(args[i] for i in self.users)
        # the plan of the last call serves this one when the shapes are the same: its guards hold again
        key = tuple((t.shape, t.dtype) for t in inputs)
        plan = self.last[1] if self.last is not None and self.last[0] == key else self.served.select(inputs, {})
        self.last = (key, plan)
        if self.compiler == "eager":
            return nn.Module.__call__(plan, *inputs)  # the plan's own forward: its guards were checked
        run = self.compiled.get(plan)
        if run is None:
            run = self.compiled[plan] = _inductor(plan, inputs, freeze=self._frozen())
        return run(*inputs)

    def _frozen(self) -> bool:
        """Inductor's freezing folds the weights (and their casts) into the compiled code: inference only."""
        return self.settings["freezing"] and self.settings["mode"] == "inference" and not torch.is_grad_enabled()

    def _convert(self, args: list[Any]) -> None:
        lifted, self.users = _lift(self.gm, self.placeholders, args, self.state)
        tensors = tuple(args[i] for i in self.users)
        mode = self.settings["mode"]
        options, self.calibrated = _plan_options(self.settings, self.placeholders, self.users, tensors, self.index)
        target = torch_target(_device(tensors, args).type, self.settings["dtype"])
        captured = _capture(lifted, tensors, self.placeholders, self.users)
        # planned without measuring: profitability times eager kernels, not the fused code inductor makes
        self.served = _served(lifted, captured, target, mode, False, {**options, "plan_for": "coverage"})
        self.served._plans.name = f"graph {self.index}"
        self.bound = {i: (args[i], args[i]._version) for i in self.state}
        self.attributes = {name: (t, t._version) for name, t in _state(lifted) if name not in self.state.values()}
        log.info("amppass backend: graph %d converted (%s, %s, %d state tensors)", self.index, mode, self.compiler,
                 len(self.state))

    def _refresh(self, args: tuple) -> None:
        """Rule 2: new values in a parameter reach its low-precision copies in every plan, in place.

        In training the graphs cast the parameters themselves (an optimizer step changes nothing to
        refresh); only a parameter that is another tensor now is pointed at.
        """
        training = self.settings["mode"] == "train"
        refreshed = replaced = False
        for position, name in self.state.items():
            tensor = args[position]
            seen, version = self.bound[position]
            if tensor is seen and (training or tensor._version == version):
                continue
            self._copy_into_plans(name, tensor)
            replaced |= tensor is not seen
            refreshed = True
            self.bound[position] = (tensor, tensor._version)
        for name, (tensor, version) in self.attributes.items():  # state dynamo kept as the graph's attributes
            if not training and tensor._version != version:
                self._copy_into_plans(name, tensor)
                refreshed = True
                self.attributes[name] = (tensor, tensor._version)
        if replaced or (refreshed and self._frozen()):
            # compiled code holds the tensors it was compiled with, and frozen code their values: compile again
            self.compiled.clear()

    def _copy_into_plans(self, name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            for plan in self.served.plans:
                _refresh_copies(plan, name, tensor)
        self.refreshes += 1


def session_of(compiled: Any) -> Session | None:
    """The session of a module or function ``torch.compile(backend="amppass")`` returned, if it has run.

    A compiled module keeps dynamo's context as ``dynamo_ctx``, a compiled function in its closure; from its
    callback, the chain of wrappers leads to the ``torch.compile`` wrapper the session belongs to.
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
            found = _SESSIONS.get(id(callback))
            if found is not None and found[0]() is callback:
                return found[1]
            callback = getattr(callback, "_torchdynamo_orig_backend", None) or getattr(callback, "compiler_fn", None)
    return None


# -- sessions: which torch.compile call a graph belongs to (rule 4) ------------------------------------------

_SESSIONS: dict[int, tuple[weakref.ref, Session]] = {}


def _session(options: dict[str, Any] | None, settings: dict[str, Any]) -> Session:
    """The session of the ``torch.compile`` wrapper calling this backend (the one holding ``options``)."""
    frame, owner = sys._getframe(2), None
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
    session = Session({k: v for k, v in settings.items() if k != "calibration"})  # not the batches themselves
    _SESSIONS[id(owner)] = (weakref.ref(owner, lambda _, key=id(owner): _SESSIONS.pop(key, None)), session)
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


# -- building the graph to convert ----------------------------------------------------------------------------

def _settings(options: dict[str, Any] | None) -> dict[str, Any]:
    options = dict(options or {})
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise InputError(f"torch.compile(backend='amppass'): unknown option(s) {unknown}; the options are "
                         f"{list(_OPTIONS)}, e.g. options={{'dtype': 'bf16', 'compiler': 'inductor'}}")
    settings = {"dtype": "auto", "mode": "inference", "compiler": "inductor", "freezing": True, "keep_io_types": True,
                "keep_fp32": (), "force_low": (), "low_weight_tables": False, "calibration": None, "tolerance": None,
                **options}
    if settings["mode"] not in MODES:
        raise InputError(f"torch.compile(backend='amppass'): mode={settings['mode']!r} is not one of {MODES}; "
                         "'train' casts the fp32 parameters inside each graph so gradients reach them")
    if settings["compiler"] not in COMPILERS:
        raise InputError(f"torch.compile(backend='amppass'): compiler={settings['compiler']!r} is not one of "
                         f"{COMPILERS}; 'inductor' compiles the converted graphs, 'eager' runs them as they are")
    if settings["calibration"] is not None:
        settings["calibration"] = list(settings["calibration"])  # every graph it matches reads it
    low_type(settings["dtype"])  # a bad dtype is reported now, not at the first graph
    return settings


def _state_inputs(placeholders: list[fx.Node], example_inputs: list[Any]) -> dict[int, str]:
    """Positions of the inputs that are the model's parameters and buffers, with their qualified names."""
    state = {}
    for position, node in enumerate(placeholders):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", "") or ""
        found = _STATE_SOURCE.search(source)
        if found is None and not isinstance(example_inputs[position], nn.Parameter):
            continue
        if found is not None:
            path = _MODULE_STEP.findall(source) + [found.group(2)]
            name = ".".join(path)
        else:
            name = node.name
        state[position] = re.sub(r"[^\w.]", "_", name)
    return state


def _lift(gm: fx.GraphModule, placeholders: list[fx.Node], example_inputs: list[Any],
          state: dict[int, str]) -> tuple[fx.GraphModule, list[int]]:
    """Rules 1 and 3: state inputs become attributes of a module, sizes are read from tensors.

    Returns the module and the positions of dynamo's inputs it takes (tensors other than state).
    """
    root = nn.Module()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    users = [i for i in range(len(placeholders)) if i not in state and isinstance(example_inputs[i], torch.Tensor)]
    for i in users:
        env[placeholders[i]] = graph.placeholder(placeholders[i].name)
        env[placeholders[i]].meta = dict(placeholders[i].meta)
    for i, name in state.items():
        _register(root, name, example_inputs[i])
        env[placeholders[i]] = graph.get_attr(name)
    for i, node in enumerate(placeholders):
        if node in env:
            continue
        measured = _measured_by(node, [placeholders[u] for u in users])
        if measured is None:
            raise CaptureError(f"graph input {node.name} ({type(example_inputs[i]).__name__}) is neither a tensor nor "
                               "a size of one; amppass cannot take it apart")
        tensor, dim = measured
        env[node] = graph.call_function(torch.ops.aten.sym_size.int, (env[tensor], dim))
    for node in gm.graph.nodes:
        if node.op == "get_attr" and not _has(root, str(node.target)):  # state dynamo kept as attributes
            _register(root, str(node.target), _fetch(gm, str(node.target)))
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(root, graph), users


def _fetch(module: nn.Module, name: str) -> Any:
    for step in name.split("."):
        module = getattr(module, step)
    return module


def _has(module: nn.Module, name: str) -> bool:
    try:
        _fetch(module, name)
    except AttributeError:
        return False
    return True


def _measured_by(node: fx.Node, tensors: list[fx.Node]) -> tuple[fx.Node, int] | None:
    """The tensor input and dimension whose size a SymInt input is."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.SymInt):
        return None
    for tensor in tensors:
        fake = tensor.meta.get("example_value")
        for dim, size in enumerate(getattr(fake, "shape", ())):
            if isinstance(size, torch.SymInt) and size.node.expr == value.node.expr:
                return tensor, dim
    return None


def _register(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    owner = root
    for step in path:
        if not hasattr(owner, step):
            owner.add_module(step, nn.Module())
        owner = getattr(owner, step)
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    elif isinstance(tensor, torch.Tensor):
        owner.register_buffer(leaf, tensor)
    else:
        setattr(owner, leaf, tensor)


def _capture(lifted: fx.GraphModule, tensors: tuple, placeholders: list[fx.Node], users: list[int]) -> fx.GraphModule:
    """Capture with the dimensions dynamo made dynamic (rule 3); with fixed shapes if export refuses that."""
    dynamic = tuple(
        {d: torch.export.Dim.AUTO for d, s in enumerate(getattr(placeholders[i].meta.get("example_value"), "shape", ()))
         if isinstance(s, torch.SymInt)} or None
        for i in users
    )
    try:
        return capture(lifted, tensors, dynamic_shapes=dynamic if any(dynamic) else None, note_fixed_dims=False)
    except CaptureError:
        if not any(dynamic):
            raise
        log.info("amppass backend: export refused dynamo's dynamic dims; capturing with fixed shapes")
        return capture(lifted, tensors, dynamic_shapes=None, note_fixed_dims=False)


def _plan_options(settings: dict[str, Any], placeholders: list[fx.Node], users: list[int], tensors: tuple,
                  index: int) -> tuple[dict[str, Any], bool]:
    """The options of :func:`amppass.convert` for this graph; calibration only where its batches fit."""
    options = {key: settings[key] for key in ("keep_io_types", "keep_fp32", "force_low", "low_weight_tables")}
    batches = _aligned(settings["calibration"], [placeholders[i] for i in users], tensors)
    if settings["calibration"] is not None and batches is None:
        log.info("amppass backend: graph %d takes other tensors than the calibration batches; planned without them",
                 index)
    options.update(calibration=batches, tolerance=settings["tolerance"] if batches is not None else None,
                   progress=False)
    return options, batches is not None


def _aligned(batches: list[Any] | None, inputs: list[fx.Node], tensors: tuple) -> list[tuple] | None:
    """The calibration batches as this graph's input tuples, or None if they do not fit it."""
    if not batches:
        return None
    names = [str(getattr(getattr(n.meta.get("grapharg"), "source", None), "local_name", n.name)) for n in inputs]
    aligned = []
    for batch in batches:
        if isinstance(batch, dict):
            if not all(name in batch for name in names):
                return None
            batch = tuple(batch[name] for name in names)
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if len(batch) != len(tensors) or not all(_fits(b, t, n) for b, t, n in zip(batch, tensors, inputs)):
            return None
        aligned.append(batch)
    return aligned


def _fits(batch: Any, tensor: torch.Tensor, node: fx.Node) -> bool:
    """A calibration tensor fits a graph input: same dtype and rank, same size wherever dynamo fixed it."""
    if not isinstance(batch, torch.Tensor) or batch.dtype != tensor.dtype or batch.dim() != tensor.dim():
        return False
    traced = getattr(node.meta.get("example_value"), "shape", tensor.shape)
    return all(isinstance(s, torch.SymInt) or int(s) == b for s, b in zip(traced, batch.shape))


def _refresh_copies(plan: fx.GraphModule, name: str, tensor: torch.Tensor) -> None:
    """Point ``name`` at ``tensor`` where the plan reads it in fp32; copy it into its low-precision copies."""
    for attr in (name, *(f"{name}__{low}" for low in ("fp16", "bf16"))):
        try:
            held = plan.get_parameter(attr) if _is_parameter(plan, attr) else plan.get_buffer(attr)
        except AttributeError:
            continue
        if held.dtype == tensor.dtype:
            if held is not tensor:
                _set(plan, attr, tensor)
        else:
            held.copy_(tensor)


def _is_parameter(module: nn.Module, name: str) -> bool:
    *path, leaf = name.split(".")
    try:
        return leaf in module.get_submodule(".".join(path))._parameters
    except AttributeError:
        return False


def _inductor(plan: fx.GraphModule, inputs: tuple, freeze: bool) -> Callable[..., Any]:
    """Compile one plan with inductor (a plain GraphModule over its tensors: inductor traces forward())."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx

    plain = fx.GraphModule(plan, plan.graph)
    with config.patch(freezing=freeze):
        return compile_fx(plain, list(inputs))


def _device(tensors: tuple, example_inputs: list[Any]) -> torch.device:
    for value in list(tensors) + list(example_inputs):
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.device("cpu")

