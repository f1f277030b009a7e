"""Serving every input shape: the guards of a captured graph, and a bounded cache of plans keyed by them.

torch.export captures a graph that is valid for the shapes its guards accept: dimensions it kept
dynamic, within ranges (a batch of 1 is often excluded), and dimensions the model's code fixed (an RNN
unrolled over the example's length, a fast path taken only at batch 1). The module ``amppass.convert``
returns, :class:`ServingGraph`, checks each call against those guards itself instead of letting torch
raise ``AssertionError: Guard failed``.

Rules:

1. A call runs the first plan whose guards accept it: the plan of the example's shapes (the module's own
   graph) or one converted later, the most recently used first.
2. A call no plan accepts is captured and converted again for its own inputs (dimensions dynamic where
   export allows), with a warning that names the input, the dimension and the shapes the plans serve.
   At most :data:`MAX_PLANS` plans are kept; the least recently used later plan is dropped first.
3. A later plan reads the first plan's tensors wherever it has a state entry of the same name, so the
   converted module stays one snapshot of the model (and its low-precision weights are stored once).
4. Decisions calibration or the tolerance search made (fp32 for a node) carry over to later plans by
   node name and op: calibration already ran every batch (those of other shapes on captures of their own,
   :mod:`amppass.fx.calibrate`), so they are not run again.
5. A call that cannot be captured is run on the original model: if the original rejects it too, its own
   error is raised; otherwise a :class:`~amppass.errors.CaptureError` names the input, the dimension and
   what the model was converted for. Without the original model (a loaded program) a rejected call raises
   :class:`~amppass.errors.InputError` saying the same.
6. A floating-point input of another floating dtype than the example's (a bf16 or fp16 tensor from a
   pipeline that casts to the model's dtype, an fp64 one) is cast to the example's dtype first, as
   torch.autocast casts what an op reads, and logged once per input and dtype: it neither costs a re-capture
   nor reaches a kernel beside weights of another dtype (the model's own error would name a dtype the user
   never chose).
"""

from __future__ import annotations

import collections
import inspect
import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..analysis.plan import Decision, Precision, Source
from ..errors import CaptureError, InputError
from .face import Fp32Face, stored_parameters
from .modes import module_mode
from .plan_dtypes import PlanDtypes
from .rewrite import META_KEY

log = logging.getLogger(__name__)

MAX_PLANS = 8
GUARDS_KEY = "amppass_guards"  # gm.meta entry holding the ShapeGuards of a captured graph
_REJECTED_MEMORY = 16  # call signatures the original model rejected, answered without another capture
_UNROLLED = ("aten.lstm", "aten.gru", "aten.rnn_tanh", "aten.rnn_relu")  # ops export unrolls over the length
_GUARD_TEXT = re.compile(r"([A-Za-z_]\w*(?:\[[^\]]*\])*)\.size\(\)\[(\d+)\]")


@dataclass(frozen=True)
class InputSpec:
    """One flattened graph input as the captured graph takes it."""

    name: str  # the input's path as forward() names it: "x", "past_key_values['key_cache'][0]"
    dtype: torch.dtype | None  # None for a non-tensor input
    dims: tuple[int | str, ...] = ()  # an int: fixed by the capture; a str: a dynamic size's symbol
    value: Any = None  # a non-tensor input: the capture fixed its value

    def describe(self, ranges: dict[str, tuple[int, float]]) -> str:
        """``x: [s0>=2, 40, 16] float32``."""
        if self.dtype is None:
            return f"{self.name} = {self.value!r}"
        dims = []
        for d in self.dims:
            if isinstance(d, int):
                dims.append(str(d))
                continue
            low, high = ranges.get(d, (0, math.inf))
            bounds = f">={low}" if low > 1 and high == math.inf else (f" in [{low}, {high}]" if high != math.inf else "")
            dims.append(f"{d}{bounds}")
        return f"{self.name}: [{', '.join(dims)}] {str(self.dtype).replace('torch.', '')}"


@dataclass(frozen=True)
class Mismatch:
    """Why a call does not fit a plan: which input, which dimension, what it got and what the plan takes."""

    input: str
    got: str
    wanted: str
    dim: int | None = None

    def __str__(self) -> str:
        if self.input == "arguments":
            return f"the call passes {self.got}, the plan was captured for {self.wanted}"
        where = f"input {self.input}" + (f" dim {self.dim}" if self.dim is not None else "")
        return f"{where} is {self.got}, the plan takes {self.wanted}"


class ShapeGuards:
    """What a captured graph accepts, checked before each call without running the graph.

    Built from the module ``torch.export`` returns: the pytree layout of its inputs, each placeholder's
    dtype and fixed or symbolic dimensions, the symbols' ranges, and torch's own guard function for the
    relations between them (``x.size()[0] != 1``, ``x.size()[0] == mask.size()[0]``).
    """

    def __init__(self, in_spec: Any, inputs: list[InputSpec], ranges: dict[str, tuple[int, float]],
                 guard_module: nn.Module | None, signature: inspect.Signature | None):
        self.in_spec, self.inputs, self.ranges = in_spec, inputs, ranges
        self.guard_module, self.signature = guard_module, signature  # the module: for export to trace again
        self.guard_fn = _guard_function(guard_module) or guard_module
        self._described: str | None = None  # describe(), formatted once: the report reads it on every call

    @classmethod
    def of(cls, gm: fx.GraphModule) -> "ShapeGuards":
        """The guards of ``gm``, a module from ``ExportedProgram.module()`` (before its guard node is removed)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        values = [n.meta.get("val") for n in placeholders]
        in_spec = getattr(gm, "_in_spec", None)
        signature = _signature(gm)
        names = _input_names(in_spec, values, signature) or [n.name for n in placeholders]
        inputs = [_spec(name, value) for name, value in zip(names, values)]
        ranges = {str(symbol): (max(_bound(bounds.lower), 0), _bound(bounds.upper))
                  for symbol, bounds in (getattr(gm, "range_constraints", None) or {}).items()}
        return cls(in_spec, inputs, ranges, getattr(gm, "_guards_fn", None), signature)

    def describe(self) -> str:
        """The inputs this plan takes, one per flattened input: ``x: [s0>=2, 40, 16] float32``."""
        if self._described is None:
            self._described = "; ".join(spec.describe(self.ranges) for spec in self.inputs)
        return self._described

    def key(self) -> str:
        """A short label of the plan's shapes for logs and the report: ``x[s0,40,16]``."""
        return ", ".join(
            f"{s.name}[{','.join(str(d) for d in s.dims)}]" if s.dtype is not None else f"{s.name}={s.value!r}"
            for s in self.inputs
        )

    def mismatch(self, args: tuple, kwargs: dict) -> Mismatch | None:
        """None if the plan takes this call; else the first input (and dimension) it does not take."""
        leaves = self.flatten(args, kwargs)
        if leaves is None:
            return Mismatch("arguments", call_layout(args, kwargs), self._layout())
        if len(leaves) != len(self.inputs):
            return Mismatch("arguments", f"{len(leaves)} values", f"{len(self.inputs)} values")
        symbols: dict[str, int] = {}
        for spec, value in zip(self.inputs, leaves):
            problem = self._check(spec, value, symbols)
            if problem is not None:
                return problem
        if self.guard_fn is not None:
            try:
                self.guard_fn(*leaves)
            except AssertionError as err:
                return self._from_guard(str(err), leaves)
        return None

    def conform(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[str]]:
        """Rule 6: the call with each floating input of another floating dtype cast to the one this plan
        takes (arranged as :meth:`flatten` arranges it), and what was cast (``"x: float16"``); the call itself
        where its layout is not the capture's."""
        leaves = self.flatten(args, kwargs)
        if leaves is None or len(leaves) != len(self.inputs):
            return args, kwargs, []
        cast = []
        for index, (wanted, value) in enumerate(zip(self.inputs, leaves)):
            if (isinstance(value, torch.Tensor) and wanted.dtype is not None and value.dtype != wanted.dtype
                    and value.dtype.is_floating_point and wanted.dtype.is_floating_point):
                cast.append(f"{wanted.name}: {str(value.dtype).replace('torch.', '')}")
                leaves[index] = value.to(wanted.dtype)
        if not cast:
            return args, kwargs, []
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec or pytree.tree_flatten((args, kwargs))[1])
        return args, kwargs, cast

    def flatten(self, args: tuple, kwargs: dict) -> list[Any] | None:
        """The call's leaves in the graph's placeholder order, or None if its layout is not the capture's.

        A call that spells an argument by keyword where the example passed it by position is arranged
        the way the graph's own forward() binds it.
        """
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if self.in_spec is None or spec == self.in_spec:
            return leaves
        arranged = self._arranged(args, kwargs)
        if arranged is None:
            return None
        leaves, spec = pytree.tree_flatten(arranged)
        return leaves if spec == self.in_spec else None

    def _arranged(self, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.signature is None or self.in_spec.type is not tuple or self.in_spec.num_children != 2:
            return None
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        names = list(self.signature.parameters)
        positional = self.in_spec.child(0).num_children
        keywords = self.in_spec.child(1).context or []
        arguments = bound.arguments
        if set(arguments) - set(names[:positional]) - set(keywords):
            return None
        try:
            return tuple(arguments[n] for n in names[:positional]), {k: arguments[k] for k in keywords if k in arguments}
        except KeyError:
            return None

    def _check(self, spec: InputSpec, value: Any, symbols: dict[str, int]) -> Mismatch | None:
        if spec.dtype is None:
            if isinstance(value, torch.Tensor) or (spec.value is not None and value != spec.value):
                return Mismatch(spec.name, repr(value) if not isinstance(value, torch.Tensor) else "a tensor",
                                repr(spec.value))
            return None
        if not isinstance(value, torch.Tensor):
            return Mismatch(spec.name, type(value).__name__, "a tensor")
        if value.dtype != spec.dtype:
            return Mismatch(spec.name, str(value.dtype).replace("torch.", ""), str(spec.dtype).replace("torch.", ""))
        if value.dim() != len(spec.dims):
            return Mismatch(spec.name, f"{value.dim()}-dimensional {tuple(value.shape)}", f"{len(spec.dims)} dimensions")
        for dim, (size, wanted) in enumerate(zip(value.shape, spec.dims)):
            if isinstance(wanted, int):
                if size != wanted:
                    return Mismatch(spec.name, str(size), f"{wanted} only", dim)
                continue
            low, high = self.ranges.get(wanted, (0, math.inf))
            if not low <= size <= high:
                span = f">= {low}" if high == math.inf else f"{low}..{high}"
                return Mismatch(spec.name, str(size), span, dim)
            if symbols.setdefault(wanted, size) != size:
                return Mismatch(spec.name, str(size), f"the same size as another input's ({symbols[wanted]})", dim)
        return None

    def _from_guard(self, message: str, leaves: list[Any]) -> Mismatch:
        condition = message.split("Guard failed:", 1)[-1].strip() or message
        found = _GUARD_TEXT.search(condition)
        if found is None:
            return Mismatch("arguments", "outside the capture's guards", condition)
        name, dim = found.group(1), int(found.group(2))
        got = next((str(v.shape[dim]) for s, v in zip(self.inputs, leaves)
                    if s.name == name and isinstance(v, torch.Tensor) and v.dim() > dim), "?")
        return Mismatch(name, got, condition, dim)

    def _layout(self) -> str:
        try:
            return call_layout(*pytree.tree_unflatten([_Shown(s) for s in self.inputs], self.in_spec))
        except Exception:  # noqa: BLE001 - a container type that will not hold names (a cache class)
            return self.describe()


class _Shown:
    """A placeholder that prints as its input's name, to show a plan's argument layout."""

    def __init__(self, spec: InputSpec):
        self.name = spec.name

    def __repr__(self) -> str:
        return self.name


def call_layout(args: tuple, kwargs: dict) -> str:
    """A call's arguments with each tensor shown by its shape: ``([2, 17, 16], mask=[2, 17])``."""

    def shown(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return str(list(value.shape))
        return repr(value)

    parts = [pytree.tree_map(shown, a) if not isinstance(a, torch.Tensor) else shown(a) for a in args]
    parts += [f"{k}={pytree.tree_map(shown, v) if not isinstance(v, torch.Tensor) else shown(v)}"
              for k, v in kwargs.items()]
    return "(" + ", ".join(str(p) for p in parts) + ")"


def _signature(gm: fx.GraphModule) -> inspect.Signature | None:
    try:
        return inspect.signature(gm.forward)
    except (TypeError, ValueError):
        return None


def _input_names(in_spec: Any, values: list[Any], signature: inspect.Signature | None) -> list[str] | None:
    """Each placeholder's path as forward() names it, spelled as torch's guard messages spell it."""
    if in_spec is None or signature is None or len(values) != in_spec.num_leaves:
        return None
    try:
        args, kwargs = pytree.tree_unflatten(values, in_spec)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    paths = [path for path, _ in pytree.tree_leaves_with_path(bound.arguments)]
    if len(paths) != len(values):
        return None
    return [path[0].key + pytree.keystr(path[1:]) for path in paths]


def _bound(value: Any) -> Any:
    """A range bound as an int, or +-inf for sympy's infinities (``int_oo``; ``oo`` bounds the unbacked
    symbol of a ``Tensor.item()``)."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    if value in (int_oo, sympy.oo):
        return math.inf
    return -math.inf if value in (-int_oo, -sympy.oo) else int(value)


def _spec(name: str, value: Any) -> InputSpec:
    if isinstance(value, torch.Tensor):
        dims = tuple(int(d) if isinstance(d, int) or not _symbolic(d) else str(d) for d in value.shape)
        return InputSpec(name, value.dtype, dims)
    return InputSpec(name, None, value=value if isinstance(value, (int, float, bool, str, type(None))) else None)


def _symbolic(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and not size.node.is_constant() and size.node.expr.free_symbols


# -- conversion-time notes --------------------------------------------------------------------------------

def specialised_dims(gm: fx.GraphModule, model: nn.Module) -> list[str]:
    """Sentences for the dimensions the capture fixed although they were asked to stay dynamic.

    A dimension fixed at the size of one of the model's own weight dimensions (a feature width, the
    channels of a convolution) is what the model needs anyway and is left out.
    """
    guards = gm.meta.get(GUARDS_KEY)
    if guards is None:
        return []
    inherent = {int(s) for t in list(model.parameters()) + list(model.buffers()) for s in t.shape}
    where = _specialisation_sites(gm)
    unrolled = sorted({str(n.target.overloadpacket) for n in gm.graph.nodes
                       if isinstance(n.target, torch._ops.OpOverload) and str(n.target.overloadpacket) in _UNROLLED})
    notes = []
    for spec in guards.inputs:
        for dim, size in enumerate(spec.dims):
            if isinstance(size, int) and size not in inherent:
                site = where.get((spec.name, dim))
                if site and "decompose" in site and unrolled:
                    why = f"torch.export unrolls {' and '.join(unrolled)} over it"
                else:
                    why = f"torch.export fixed it at {site}" if site else "torch.export fixed it"
                notes.append(f"{spec.name} dim {dim} is fixed at {size} ({why})")
    for condition in _fixing_guards(guards):
        notes.append(f"{condition} (a guard torch.export added)")
    return notes



def _fixing_guards(guards: ShapeGuards) -> list[str]:
    """Guards of the form ``x.size()[0] == 1`` on a dimension the placeholder still shows as dynamic."""
    found = []
    for condition in guard_conditions(guards.guard_fn):
        match = re.fullmatch(r"([A-Za-z_]\w*(?:\[[^\]]*\])*)\.size\(\)\[(\d+)\] == (\d+)", condition)
        if match is None:
            continue
        spec = next((s for s in guards.inputs if s.name == match.group(1)), None)
        dim = int(match.group(2))
        if spec is not None and dim < len(spec.dims) and not isinstance(spec.dims[dim], int):
            found.append(f"{spec.name} dim {dim} is fixed at {match.group(3)}")
    return found


def guard_conditions(guard_fn: Any) -> list[str]:
    """The conditions torch's generated guard function asserts, as its failure messages spell them."""
    fn = _guard_function(guard_fn)
    if fn is None:
        return []
    return [c.split("Guard failed:", 1)[1].strip() for c in fn.__code__.co_consts
            if isinstance(c, str) and c.startswith("Guard failed:")]


def _guard_function(guard_fn: Any) -> Callable[..., None] | None:
    """The function torch generated for a guard module, unwrapped from dynamo's per-call context manager.

    Called directly it checks the same conditions without entering and leaving that context on every call.
    """
    pending, seen = [guard_fn, getattr(guard_fn, "forward", None)], set()
    while pending:
        fn = pending.pop()
        code = getattr(fn, "__code__", None)
        if code is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if any(isinstance(c, str) and c.startswith("Guard failed:") for c in code.co_consts):
            return fn
        pending += [cell.cell_contents for cell in fn.__closure__ or () if callable(cell.cell_contents)]
    return None


def _specialisation_sites(gm: fx.GraphModule) -> dict[tuple[str, int], str]:
    """(input name, dim) -> where in the code the shape environment replaced its size by a constant."""
    env = next((v.fake_mode.shape_env for n in gm.graph.nodes if n.op == "placeholder"
                for v in [n.meta.get("val")] if getattr(getattr(v, "fake_mode", None), "shape_env", None)), None)
    if env is None:
        return {}
    sites = {}
    for symbol, sources in env.var_to_sources.items():
        site = env.replacements_slocs.get(symbol)
        if site is None:
            continue
        for source in sources:
            found = re.fullmatch(r"L\['(\w+)'\](.*)\.size\(\)\[(\d+)\]", source.name)
            if found:
                sites[(found.group(1) + found.group(2), int(found.group(3)))] = str(site).strip("() ")
    return sites


# -- the served module ------------------------------------------------------------------------------------

Recapture = Callable[[tuple, dict], fx.GraphModule]


@dataclass
class _Plan:
    graph: fx.GraphModule
    guards: ShapeGuards
    calls: int = 0
    bound_to: tuple[int, ...] = ()  # ids of the serving module's tensors the plan reads (rule 3)


@dataclass
class _Plans:
    """The later plans of a :class:`ServingGraph` and what it needs to make more."""

    name: str
    recapture: Recapture | None
    original: nn.Module | None
    origin: str
    extra: "collections.OrderedDict[int, _Plan]" = field(default_factory=collections.OrderedDict)
    rejected: "collections.OrderedDict[tuple, None]" = field(default_factory=collections.OrderedDict)
    made: int = 0
    told: set[str] = field(default_factory=set)  # inputs cast at the boundary and logged (rule 6)


class ServingGraph(Fp32Face, fx.GraphModule):
    """A converted graph that serves every input shape its original model takes (see the module docstring).

    It is the converted graph of the example's shapes (``graph``, ``meta``, parameters and buffers are
    that plan's); calls its guards reject go to a later plan, captured and converted on first use. Its
    ``parameters()`` and ``dtype`` face its caller in fp32 (:mod:`amppass.fx.face`).

    Args:
        gm: the converted graph module; its graph and state become this module's.
        guards: what ``gm`` accepts.
        recapture: captures and converts the original model for a call's ``(args, kwargs)``; None when
            the original is not at hand (a loaded program).
        original: the original model, run on a call that cannot be captured to raise its own error.
        name: the model's name in messages.
        origin: why there is no original model (when ``recapture`` is None), for the error message.
    """

    def __init__(self, gm: fx.GraphModule, guards: ShapeGuards, recapture: Recapture | None = None,
                 original: nn.Module | None = None, name: str = "model", origin: str = "it was loaded from a file"):
        super().__init__(gm, gm.graph)
        self.meta = gm.meta
        self.meta[GUARDS_KEY] = guards
        keep_non_persistent(gm, self)
        _without_guard_node(self)
        object.__setattr__(self, "_plans", _Plans(name, recapture, original, origin))
        self._record()

    @property
    def guards(self) -> ShapeGuards:
        """What this module's own graph (the example's plan) accepts."""
        return self.meta[GUARDS_KEY]

    def drop_original(self) -> None:
        """Stop holding the original model (and so its fp32 weights) for conversions of new shapes.

        Afterwards a call no plan takes raises :class:`~amppass.errors.InputError` naming the input and
        dimension, as a loaded model does.
        """
        plans = self._plans
        plans.recapture, plans.original = None, None
        plans.origin = "drop_original() released it"

    @property
    def plans(self) -> list[fx.GraphModule]:
        """Every plan's graph: this module first, then later ones from the most recently used."""
        return [self] + [p.graph for p in reversed(self._plans.extra.values())]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        plan, args, kwargs = self.select(args, kwargs)
        if plan is self:
            return super().__call__(*args, **kwargs)
        return plan(*args, **kwargs)

    def conform(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Rule 6: floating inputs cast to the example's floating dtypes (logged once per input and dtype)."""
        args, kwargs, cast = self.guards.conform(args, kwargs)
        told = self._plans.told
        for what in cast:
            if what not in told:
                told.add(what)
                log.info("%s: input %s cast to the dtype the model was converted with (%s), as torch.autocast "
                         "casts what an op reads", self._plans.name, what, self.guards.describe())
        return args, kwargs

    def select(self, args: tuple, kwargs: dict) -> tuple[fx.GraphModule, tuple, dict]:
        """The plan that serves this call (this module, or a later plan, made now if none takes it), and the
        call as that plan runs it: floating inputs cast (rule 6) where this module's plan does not take them."""
        if self.guards.mismatch(args, kwargs) is None:
            return self, args, kwargs
        args, kwargs = self.conform(args, kwargs)
        if self.guards.mismatch(args, kwargs) is None:
            return self, args, kwargs
        return self._later_plan(args, kwargs), args, kwargs

    def _later_plan(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        plans = self._plans
        for key in reversed(plans.extra):
            plan = plans.extra[key]
            if plan.guards.mismatch(args, kwargs) is None:
                plans.extra.move_to_end(key)
                plan.calls += 1
                self._bind(plan)
                self._record()
                return plan.graph
        plan = self._new_plan(args, kwargs)
        plans.extra[plans.made] = plan
        plans.made += 1
        if len(plans.extra) > MAX_PLANS - 1:
            dropped = plans.extra.popitem(last=False)[1]
            log.info("%s: dropped the plan for %s (least recently used; at most %d plans are kept)",
                     plans.name, dropped.guards.key(), MAX_PLANS)
        self._record()
        return plan.graph

    def _new_plan(self, args: tuple, kwargs: dict) -> _Plan:
        plans = self._plans
        mismatch = self.guards.mismatch(args, kwargs)
        served = " | ".join([self.guards.describe()] + [p.guards.describe() for p in plans.extra.values()])
        if plans.recapture is None:
            raise InputError(
                f"{plans.name}: {mismatch}; this converted model serves {served}, and it has no original model to "
                f"convert again for this shape ({plans.origin}): convert the original with an example of this shape, "
                "e.g. amppass.convert(model, example_inputs)"
            )
        signature = _call_signature(args, kwargs)
        if signature in plans.rejected:
            self._raise_original(args, kwargs)
        log.warning("%s: %s; capturing and converting it again for %s (re-capture %d; at most %d plans are kept)",
                    plans.name, mismatch, call_layout(args, kwargs), plans.made + 1, MAX_PLANS)
        try:
            graph = plans.recapture(args, kwargs)
        except CaptureError as err:
            plans.rejected[signature] = None
            if len(plans.rejected) > _REJECTED_MEMORY:
                plans.rejected.popitem(last=False)
            self._raise_original(args, kwargs)
            raise CaptureError(f"{plans.name}: {mismatch}, and torch.export cannot capture the model for "
                               f"{call_layout(args, kwargs)} although the original model runs it ({err}); the "
                               f"converted model serves {served}") from err
        _without_guard_node(graph)
        plan = _Plan(graph, graph.meta[GUARDS_KEY], calls=1)
        self._bind(plan)
        return plan

    def _raise_original(self, args: tuple, kwargs: dict) -> None:
        """Rule 5: run the original model on a call no plan takes; its own error propagates unchanged."""

        original = self._plans.original
        if original is None:
            return
        with torch.no_grad(), module_mode(original, train=self.training):
            original(*args, **kwargs)

    def _bind(self, plan: _Plan) -> None:
        """Rule 3: point the plan's state entries at this module's tensors of the same name, shape and dtype."""
        mine = _state(self)
        ids = tuple(id(t) for _, t in mine)
        if plan.bound_to == ids:
            return
        own = dict(mine)
        for name, tensor in _state(plan.graph):
            found = own.get(name)
            if found is not None and found is not tensor and found.shape == tensor.shape and found.dtype == tensor.dtype:
                set_state(plan.graph, name, found)
        plan.bound_to = ids

    def rebind(self) -> None:
        """Point every later plan at this module's tensors again (after its state attributes were replaced)."""
        for plan in self._plans.extra.values():
            self._bind(plan)

    def _apply(self, fn: Any, recurse: bool = True) -> "ServingGraph":
        kept = fn if isinstance(fn, PlanDtypes) else PlanDtypes(fn)  # the plan's dtypes stay (plan_dtypes)
        result = super()._apply(kept, recurse)
        for plan in self._plans.extra.values():  # tensors a later plan holds alone move with this module
            plan.graph._apply(kept, recurse)
            plan.bound_to = ()
        if kept is not fn:
            kept.tell(self._plans.name)
        return result

    def _record(self) -> None:
        """What the report shows about the plans: the shapes each serves and how often a later one ran."""
        info = self.meta.get(META_KEY)
        if info is None:
            return
        extra = self._plans.extra.values()
        info["plans"] = [{"inputs": self.guards.describe(), "example": True}] + [
            {"inputs": p.guards.describe(), "example": False, "calls": p.calls} for p in extra
        ]
        info["recaptures"] = self._plans.made

    def __deepcopy__(self, memo: dict[int, Any]) -> "ServingGraph":
        plans = self.__dict__.pop("_plans")  # the original model is shared, not copied; later plans are not kept
        try:
            copied = super().__deepcopy__(memo)
        finally:
            object.__setattr__(self, "_plans", plans)
        object.__setattr__(copied, "_plans", _Plans(plans.name, plans.recapture, plans.original, plans.origin))
        copied._record()
        return copied

    def __reduce__(self) -> Any:
        if self.meta.get(META_KEY, {}).get("mode") == "train":
            raise InputError(f"{self._plans.name}: torch.save cannot pickle a converted model (its graphs run generated "
                             "code); checkpoint a train-mode model with torch.save(model.state_dict(), path) and load "
                             "it into a model converted the same way")
        raise InputError(f"{self._plans.name}: torch.save cannot pickle a converted model (its graph runs generated "
                         "code): save it with amppass.save(model, 'model.pt2') and read it back with amppass.load")


def carried_decisions(gm: fx.GraphModule) -> dict[str, tuple[Any, Decision]]:
    """Rule 4: node name -> (op, decision) for the fp32 decisions calibration or the tolerance search made."""
    carried = {}
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if not meta or meta.get("cast") or meta.get("precision") != Precision.FP32.value:
            continue
        if meta.get("source") in (Source.CALIBRATION.value, Source.TOLERANCE.value):
            decision = Decision.from_meta(meta)
            decision.evidence["carried_over"] = "decided on the calibration batches for the example's shapes"
            carried[node.name] = (node.target, decision)
    return carried


def matching(gm: fx.GraphModule, carried: dict[str, tuple[Any, Decision]]) -> dict[str, Decision]:
    """The carried decisions whose node exists in ``gm`` with the same op."""
    targets = {n.name: n.target for n in gm.graph.nodes}
    return {name: decision for name, (target, decision) in carried.items() if targets.get(name) == target}


def _call_signature(args: tuple, kwargs: dict) -> tuple:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    return (str(spec),) + tuple(
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in leaves
    )


def _without_guard_node(gm: fx.GraphModule) -> None:
    """Remove torch's guard node and input-check hooks: a plan's guards are checked before it is called."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if "_guards_fn" in gm._modules:
        del gm._modules["_guards_fn"]
    gm.recompile()
    gm._forward_pre_hooks.clear()
    gm._forward_hooks.clear()
    gm._forward_hooks_always_called.clear()


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return stored_parameters(module, remove_duplicate=False) + list(module.named_buffers(remove_duplicate=False))


def set_state(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Store ``tensor`` at dotted ``name`` under ``root`` as a parameter or a buffer, as it was there (a
    parameter where there was none and ``tensor`` is one, else a buffer)."""
    *path, leaf = name.split(".")
    owner = root.get_submodule(".".join(path))
    if leaf in owner._parameters:
        owner._parameters[leaf] = tensor
    elif leaf in owner._buffers:
        owner._buffers[leaf] = tensor
    elif isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)


def keep_non_persistent(source: nn.Module, target: nn.Module) -> None:
    """GraphModule's copy registers every buffer as persistent; restore the ones that were not."""
    for name, module in source.named_modules():
        hidden = getattr(module, "_non_persistent_buffers_set", set())
        if not hidden:
            continue
        try:
            owner = target.get_submodule(name)
        except AttributeError:
            continue
        owner._non_persistent_buffers_set.update(b for b in hidden if b in owner._buffers)
