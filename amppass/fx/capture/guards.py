"""The guards of a captured graph: what shapes it accepts, checked before a call, and why a call does not fit.

torch.export captures a graph that is valid for the shapes its guards accept: dimensions it kept dynamic,
within ranges (a batch of 1 is often excluded), and dimensions the model's code fixed (an RNN unrolled over
the example's length, a fast path taken only at batch 1). :class:`ShapeGuards` reads them from the exported
module (placeholders, symbol ranges, torch's own guard function) so a call is checked without running the
graph; :func:`specialised_dims` says at conversion time which dimensions the capture fixed, and
:func:`carried_decisions` / :func:`matching` carry the fp32 decisions calibration made to a capture of other
shapes. The module that serves every shape with them is :class:`amppass.serving.serving_graph.ServingGraph`.
"""

from __future__ import annotations

import collections
import copy
import inspect
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ...analysis.plan import Decision, Precision, Source
from ...analysis.record import META_KEY
from ...errors import first_line

MAX_PLANS = 8  # plans (captures) one converted model keeps for the shapes it serves
GUARDS_KEY = "amppass_guards"  # gm.meta entry holding the ShapeGuards of a captured graph
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
            bounds = (f">={low}" if low > 1 and high == math.inf
                      else f" in [{low}, {high}]" if high != math.inf else "")
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
                 guard_module: nn.Module | None, signature: inspect.Signature | None,
                 fixed: dict[str, Any] | None = None):
        self.in_spec, self.inputs, self.ranges = in_spec, inputs, ranges
        self.fixed = dict(fixed or {})  # keyword values the capture bound into the graph (capture._variadic_keywords)
        self.guard_module, self.signature = guard_module, signature  # the module: for export to trace again
        self.guard_fn = _guard_function(guard_module) or guard_module
        self._described: str | None = None  # describe(), formatted once: the report reads it on every call

    @classmethod
    def of(cls, gm: fx.GraphModule, fixed: dict[str, Any] | None = None) -> "ShapeGuards":
        """The guards of ``gm``, a module from ``ExportedProgram.module()`` (before its guard node is removed);
        ``fixed``: keyword values the capture bound into the graph (the call passes them, the graph takes none)."""
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        values = [n.meta.get("val") for n in placeholders]
        in_spec = getattr(gm, "_in_spec", None)
        signature = _signature(gm)
        names = _input_names(in_spec, values, signature) or [n.name for n in placeholders]
        inputs = [input_spec(name, value) for name, value in zip(names, values, strict=False)]
        ranges = {str(symbol): (max(range_bound(bounds.lower), 0), range_bound(bounds.upper))
                  for symbol, bounds in (getattr(gm, "range_constraints", None) or {}).items()}
        return cls(in_spec, inputs, ranges, getattr(gm, "_guards_fn", None), signature, fixed)

    def describe(self) -> str:
        """The inputs this plan takes, one per flattened input: ``x: [s0>=2, 40, 16] float32``."""
        if self._described is None:
            self._described = "; ".join([spec.describe(self.ranges) for spec in self.inputs] +
                                        [f"{k} = {v!r}" for k, v in self.fixed.items()])
        return self._described

    def key(self) -> str:
        """A short label of the plan's shapes for logs and the report: ``x[s0,40,16]``."""
        return ", ".join([
            f"{s.name}[{','.join(str(d) for d in s.dims)}]" if s.dtype is not None else f"{s.name}={s.value!r}"
            for s in self.inputs
        ] + [f"{k}={v!r}" for k, v in self.fixed.items()])

    def mismatch(self, args: tuple, kwargs: dict) -> Mismatch | None:
        """None if the plan takes this call; else the first input (and dimension) it does not take."""
        for key, wanted in self.fixed.items():
            got = kwargs.get(key, _ABSENT)
            if not _same(got, wanted):
                return Mismatch(key, "absent" if got is _ABSENT else _short(got), repr(wanted))
        leaves = self.flatten(args, kwargs)
        if leaves is None:
            return Mismatch("arguments", call_layout(args, kwargs), self._layout())
        if len(leaves) != len(self.inputs):
            return Mismatch("arguments", f"{len(leaves)} values", f"{len(self.inputs)} values")
        symbols: dict[str, int] = {}
        for spec, value in zip(self.inputs, leaves, strict=False):
            problem = self._check(spec, value, symbols)
            if problem is not None:
                return problem
        if self.guard_fn is not None:
            try:
                self.guard_fn(*leaves)
            except AssertionError as err:
                return self._from_guard(str(err), leaves)
            except Exception as err:  # noqa: BLE001 - a guard that cannot be evaluated on this call fails it
                return Mismatch("arguments", f"a value the capture's guards cannot check ({type(err).__name__}: "
                                f"{first_line(err, 100)})", "the sizes the capture's guards accept")
        return None

    def conform(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, list[str]]:
        """Rule 6: the call with each floating input of another floating dtype cast to the one this plan
        takes (arranged as :meth:`flatten` arranges it), and what was cast (``"x: float16"``); the call itself
        where its layout is not the capture's."""
        leaves = self.flatten(args, kwargs)
        if leaves is None or len(leaves) != len(self.inputs):
            return args, kwargs, []
        cast = []
        for index, (wanted, value) in enumerate(zip(self.inputs, leaves, strict=False)):
            if (isinstance(value, torch.Tensor) and wanted.dtype is not None and value.dtype != wanted.dtype
                    and value.dtype.is_floating_point and wanted.dtype.is_floating_point):
                cast.append(f"{wanted.name}: {str(value.dtype).replace('torch.', '')}")
                leaves[index] = value.to(wanted.dtype)
        if not cast:
            return args, kwargs, []
        fixed = {k: kwargs[k] for k in self.fixed if k in kwargs}
        spec = self.in_spec or pytree.tree_flatten(self.runnable(args, kwargs))[1]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        return args, {**kwargs, **fixed}, cast

    def runnable(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call as the graph takes it: without the keyword values the capture fixed (:attr:`fixed`)."""
        if not self.fixed:
            return args, kwargs
        return args, {k: v for k, v in kwargs.items() if k not in self.fixed}

    def flatten(self, args: tuple, kwargs: dict) -> list[Any] | None:
        """The call's leaves in the graph's placeholder order, or None if its layout is not the capture's.

        A call that spells an argument by keyword where the example passed it by position is arranged
        the way the graph's own forward() binds it. The keyword values the capture fixed are not leaves.
        """
        if any(not _same(kwargs.get(k, _ABSENT), v) for k, v in self.fixed.items()):
            return None
        args, kwargs = self.runnable(args, kwargs)
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
            return (tuple(arguments[n] for n in names[:positional]),
                    {k: arguments[k] for k in keywords if k in arguments})
        except KeyError:
            return None

    def _check(self, spec: InputSpec, value: Any, symbols: dict[str, int]) -> Mismatch | None:
        if spec.dtype is None:
            if isinstance(value, torch.Tensor) or (spec.value is not None and value != spec.value):
                return Mismatch(spec.name, _short(value) if not isinstance(value, torch.Tensor) else "a tensor",
                                repr(spec.value))
            return None
        if not isinstance(value, torch.Tensor):
            return Mismatch(spec.name, type(value).__name__, "a tensor")
        if value.dtype != spec.dtype:
            return Mismatch(spec.name, str(value.dtype).replace("torch.", ""), str(spec.dtype).replace("torch.", ""))
        if value.dim() != len(spec.dims):
            return Mismatch(spec.name, f"{value.dim()}-dimensional {tuple(value.shape)}",
                            f"{len(spec.dims)} dimensions")
        for dim, (size, wanted) in enumerate(zip(value.shape, spec.dims, strict=False)):
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
        got = next((str(v.shape[dim]) for s, v in zip(self.inputs, leaves, strict=False)
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
    """A call's arguments with each tensor shown by its shape and dtype, never its values:
    ``([2, 17, 16] float32, mask=[2, 17] int64, features={'ids': [2, 9] int64})``."""
    parts = [_shown(a) for a in args] + [f"{k}={_shown(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _shown(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_shown(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_shown(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    node = pytree.SUPPORTED_NODES.get(type(value))
    if node is not None:  # a registered container (a transformers cache): its children, by shape
        return f"{type(value).__name__}({', '.join(_shown(c) for c in node.flatten_fn(value)[0])})"
    return _short(value)


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut at ``limit`` characters: an object's repr may print every tensor it holds."""
    text = repr(value)
    return text if len(text) <= limit else f"<{type(value).__name__}>"


_ABSENT = object()


def _same(got: Any, wanted: Any) -> bool:
    """Whether a call's keyword value is the one the capture fixed (plain values compared by equality)."""
    if got is wanted:
        return True
    try:
        return type(got) is type(wanted) and bool(got == wanted)
    except Exception:  # noqa: BLE001 - a value whose == raises or is not a bool is not the same value
        return False


def plain_inputs(value: Any) -> Any:
    """``value`` with every mapping torch's pytree does not know (transformers' ``BatchEncoding``, a dict
    subclass) made a plain dict, and every list, tuple and dict rebuilt: what amppass passes on is never the
    caller's own container, so nothing it runs (the original model included) writes into the caller's inputs."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping) and type(value) not in pytree.SUPPORTED_NODES:
        return {k: plain_inputs(v) for k, v in value.items()}
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((k, plain_inputs(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(plain_inputs(v) for v in value)
    return value


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
    return [_argument(path) for path in paths]


def range_bound(value: Any) -> Any:
    """A range bound as an int, or +-inf for sympy's infinities (``int_oo``; ``oo`` bounds the unbacked
    symbol of a ``Tensor.item()``)."""
    import sympy
    from torch.utils._sympy.numbers import int_oo

    if value in (int_oo, sympy.oo):
        return math.inf
    return -math.inf if value in (-int_oo, -sympy.oo) else int(value)


def input_spec(name: str, value: Any) -> InputSpec:
    """The spec of input ``name``: a tensor's dims (symbolic ones by name) and dtype, or the plain value."""
    if isinstance(value, torch.Tensor):
        dims = tuple(int(d) if isinstance(d, int) or not _symbolic(d) else str(d) for d in value.shape)
        return InputSpec(name, value.dtype, dims)
    return InputSpec(name, None, value=value if isinstance(value, (int, float, bool, str, type(None))) else None)


def _symbolic(size: Any) -> bool:
    return isinstance(size, torch.SymInt) and not size.node.is_constant() and size.node.expr.free_symbols


# -- conversion-time notes --------------------------------------------------------------------------------

def specialised_dims(gm: fx.GraphModule, model: nn.Module, kept: Collection[str] = ()) -> list[str]:
    """Sentences for the dimensions the capture fixed although they were asked to stay dynamic.

    A dimension fixed at the size of one of the model's own weight dimensions (a feature width, the
    channels of a convolution) is what the model needs anyway and is left out, and so are the dimensions
    after the batch of the inputs named in ``kept``, which were asked to stay static.
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
            if isinstance(size, int) and size not in inherent and not (dim > 0 and spec.name in kept):
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


def _argument(path: tuple[Any, ...]) -> str:
    """The name of a leaf of a call's bound arguments (a mapping, so the path starts with its key): ``x``,
    ``kwargs['mask']``."""
    root: pytree.MappingKey = path[0]
    return root.key + pytree.keystr(path[1:])


def carried_into(gm: fx.GraphModule, carried: dict[str, tuple[Any, Decision]]) -> dict[str, Decision]:
    """The carried decisions whose node exists in ``gm`` with the same op."""
    targets = {n.name: n.target for n in gm.graph.nodes}
    return {name: decision for name, (target, decision) in carried.items() if targets.get(name) == target}


# -- an example the model itself refuses --------------------------------------------------------------------

def example_refusal(model: nn.Module, args: tuple, kwargs: dict) -> tuple[str, BaseException] | None:
    """Why ``model`` itself fails on the example ``(args, kwargs)``, in one line, and the error it raised; None
    where it runs.

    torch.export's error for an example of the wrong shape names the symbols it traced with (``[s31, s81] X
    [16, 4]``); the model run once eagerly on it says what the user can fix: which input, its shape, the op
    that refused it (and the module that called that op) and the shape the op takes:
    ``input 'x' of shape [2, 5] does not fit MLP: linear (fc1) takes [*, 4]``. An error that is not a shape
    mismatch is quoted with the op and module that raised it. ``model`` should be a private copy (its modules
    get hooks for the run); the buffers it shares with the caller's model are put back after a run in training
    mode (batch norm's running statistics), and the inputs it runs on are copies.
    """
    args, kwargs = copy.deepcopy((args, kwargs))  # the model's code may write into them (a cache)
    stack: list[str] = []
    names = {id(module): name for name, module in model.named_modules(remove_duplicate=False)}

    def enter(module: nn.Module, _: Any) -> None:
        stack.append(names.get(id(module), ""))

    def leave(module: nn.Module, _: Any, __: Any) -> None:
        if stack:
            stack.pop()

    handles = [h for m in model.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    training = any(m.training for m in model.modules())
    saved = [(b, b.detach().clone()) for b in model.buffers()] if training else []
    watch = _FirstFailure(stack)
    try:
        with torch.no_grad(), watch:
            model(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - whatever the model raises is what the example does wrong
        found = watch.found if watch.found is not None and watch.found[4] is err else None
        return _refusal_line(model, args, kwargs, found, stack, err), err
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
    return None


class _FirstFailure(torch.overrides.TorchFunctionMode):
    """Records the torch function the model's code called that raised last: the op, its arguments, the
    modules under way (innermost last) and the error."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack = stack
        self.found: tuple[Any, tuple, dict, list[str], BaseException] | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as err:  # the latest one: an error the model's code caught and went on from is not it
            self.found = (func, args, kwargs, list(self.stack), err)
            raise


def _refusal_line(model: nn.Module, args: tuple, kwargs: dict, found: tuple[Any, tuple, dict, list[str], Any] | None,
                  stack: list[str], err: BaseException) -> str:
    name = type(model).__name__
    inputs = _named_leaves(model, args, kwargs)
    tensors = [(n, v) for n, v in inputs if isinstance(v, torch.Tensor)]
    shown = ", ".join(f"{n}: {_shown(v)}" if isinstance(v, torch.Tensor) else f"{n} = {_short(v, 40)}"
                      for n, v in inputs) or "no inputs"
    path = (found[3] if found is not None else stack)[-1:] or [""]
    where = f"{path[0]}" if path[0] else f"{name}.forward"
    if found is not None:
        func, op_args, op_kwargs = found[:3]
        op = _op_name(func)
        fit = _wanted(op, op_args, op_kwargs)
        if fit is not None:
            refused, wanted, got = fit
            own = next((n for n, v in tensors if v is refused), None)
            if own is None and len(tensors) == 1:
                own = tensors[0][0]
            if own is not None:
                shape = list(dict(tensors)[own].shape)
                told = "" if dict(tensors)[own] is refused and op != "embedding" else f", got {got}"
                return f"input {own!r} of shape {shape} does not fit {name}: {op} ({where}) takes {wanted}{told}"
            return f"the example ({shown}) does not fit {name}: {op} ({where}) takes {wanted}, got {got}"
        raised = f"{op} ({where}) raised"
    else:
        module = model.get_submodule(path[0]) if path[0] else model
        raised = f"{path[0]} ({type(module).__name__}) raised" if path[0] else "its forward raised"
    return (f"{name} does not run on its example ({shown}): {raised} {type(err).__name__}: {first_line(err, 200)}; "
            "pass example_inputs (and example_kwargs) exactly as forward() takes them")


def _named_leaves(model: nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """Each leaf of the call, named as forward() names it (``x``, ``features['input_ids']``)."""
    try:
        arguments = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except (TypeError, ValueError):
        arguments = {**{f"input {i}": a for i, a in enumerate(args)}, **kwargs}
    return [(_argument(path), value) for path, value in pytree.tree_leaves_with_path(arguments)]


def _op_name(func: Any) -> str:
    """``linear``, ``conv2d``, ``matmul`` (``Tensor.__matmul__``), ``view``."""
    name = getattr(func, "__name__", None) or str(func)
    return name.strip("_") or name


_SPATIAL = {1: "L", 2: "H, W", 3: "D, H, W"}


def _wanted(op: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, str, str] | None:
    """For an op that refused a tensor of the wrong shape: (that tensor, the shape the op takes, the tensor's
    shape; an embedding: the indices it takes and the values it got); None where the op is not one whose rule
    is known, or the tensor fits that rule."""
    def arg(index: int, key: str) -> Any:
        return args[index] if len(args) > index else kwargs.get(key)

    x = arg(0, "input")
    if not isinstance(x, torch.Tensor):
        return None
    shape = list(x.shape)
    got = str(shape)
    if op == "linear":
        weight = arg(1, "weight")
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and (x.dim() == 0 or shape[-1] != weight.shape[1]):
            return x, f"[*, {weight.shape[1]}]", got
    elif op in ("matmul", "mm", "bmm"):
        other = arg(1, "other") if op == "matmul" else arg(1, "mat2")
        if isinstance(other, torch.Tensor) and other.dim() >= 2 and x.dim() >= 1 and shape[-1] != other.shape[-2]:
            return x, f"[*, {other.shape[-2]}]", got
    elif op in ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"):
        weight, groups = arg(1, "weight"), arg(6, "groups") or 1
        if isinstance(weight, torch.Tensor) and isinstance(groups, int):
            spatial = weight.dim() - 2
            channels = weight.shape[0] if op.startswith("conv_transpose") else weight.shape[1] * groups
            if x.dim() not in (spatial + 1, spatial + 2) or shape[-spatial - 1] != channels:
                return x, f"[N, {channels}, {_SPATIAL.get(spatial, '...')}]", got
    elif op == "layer_norm":
        normalized = list(arg(1, "normalized_shape") or [])
        if normalized and shape[-len(normalized):] != normalized:
            return x, f"[*, {', '.join(str(d) for d in normalized)}]", got
    elif op in ("batch_norm", "instance_norm", "group_norm"):
        stats = ([arg(i, k) for i, k in ((1, "running_mean"), (3, "weight"))] if op != "group_norm"
                 else [arg(2, "weight")])
        features = next((s.shape[0] for s in stats if isinstance(s, torch.Tensor)), None)
        if features is not None and (x.dim() < 2 or shape[1] != features):
            return x, f"[N, {features}, ...]", got
    elif op == "embedding":
        weight = arg(1, "weight")
        if isinstance(weight, torch.Tensor) and x.numel() and (x.is_floating_point() or x.is_complex()
                                                               or int(x.max()) >= weight.shape[0] or int(x.min()) < 0):
            got = str(x.dtype).replace("torch.", "") if x.is_floating_point() or x.is_complex() else \
                f"values {int(x.min())}..{int(x.max())}"
            return x, f"integer indices in [0, {weight.shape[0]})", got
    return None
