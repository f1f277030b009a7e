"""Apply a precision plan to a GraphModule: casts on edges, weights converted once, fp32 accumulation.

Rules:

1. One cast per (value, dtype): every consumer that needs a value in a dtype shares the same cast, and
   no cast is placed where producer and consumer agree.
2. Weights are converted ahead of time (inference): a weight read only in low precision is replaced by
   its low-precision copy under the same name; one read in both keeps fp32 and gains a low copy. In
   training the graph casts the fp32 master weights instead, so autograd returns fp32 gradients. With
   ``weights_low`` (memory-first plans) every fp32 weight whose values fit the low dtype is stored low
   once, and the ops that run fp32 read it through a cast at use.
3. fp32-accumulating ops (softmax, sums, means) take their low-precision input as it is and get
   ``dtype=torch.float32``, so the widening happens inside the kernel rather than as a cast of the input.
4. Casts already in the model to fp32 run fp32 (the policy: what reads them runs fp32, as under torch.autocast);
   one the user forces low is retargeted to the low dtype; casts to other dtypes are kept.
5. Per-slot exceptions from the policy: an attention mask is clamped to the low dtype's range before it
   is cast, so -3.4e38 becomes the largest negative finite value instead of -inf; a batch norm's
   statistics and affine weights are read as they are stored (fp32 beside a low-precision input), in
   place or in its module.
6. With ``keep_io_types`` graph outputs are cast back to fp32; graph inputs are never changed.
7. The tuple or list of a multi-output op (split, unbind) is never cast: ``getitem`` selects from it as
   it is and its element keeps the container's dtype; readers of the element cast it where they need to.
8. A constant the graph creates at run time in fp32 (``zeros``, ``full``, ... : an RNN's initial state, a
   mask) that only low-precision readers read is created in the low dtype directly, instead of created in
   fp32 and cast on every call, when its fill value fits the low dtype.
9. Complex values follow the real ones they are made from: fp16 parts make complex32 where the original
   made complex64 (``torch.complex``, ``view_as_complex``), and reading real values out of complex32 gives
   fp16. Torch tracks neither as an fp32 value, so the rewrite does: with ``keep_io_types`` a complex32
   output is cast back to complex64, and an fp16 one read out of complex32 to fp32.
10. A value that shares storage with one written in place (:mod:`amppass.fx.prepare.aliasing`) is cast only where it
    is read, never shared with a read before a later write to its group: a write drops the group's casts,
    so a reader after it casts again. Such a weight is never converted or copied ahead of time (its values
    change at run time), and such a constant is never created in the low dtype (rule 8).
"""

from __future__ import annotations

import copy
import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ...analysis.options import RewriteOptions
from ...analysis.plan import Precision, PrecisionPlan
from ...analysis.record import META_KEY
from ...dtypes import LowType, short_name
from ..arguments import argument_names
from ..prepare.aliasing import alias_groups
from ..view import ops, policy
from ..view.build import carries_fp32, cast_target, fetch_attr, has_dtypes, module_state
from . import graph_calls

aten = torch.ops.aten


@dataclass
class RewriteStats:
    """What the rewrite did, for the report."""

    casts: int = 0
    weights_converted: int = 0
    weight_copies: int = 0
    saturated: list[str] = field(default_factory=list)


def input_dtype(precision: Precision, low: torch.dtype) -> torch.dtype | None:
    """The dtype a node of ``precision`` wants its fp32-or-converted float inputs in (None: as they come)."""
    return {Precision.LOW: low, Precision.FP32: torch.float32}.get(precision)


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, plan: PrecisionPlan, low: LowType, precast: bool, keep_io: bool,
                 weights_low: bool = False):
        self.gm, self.plan, self.low, self.precast, self.keep_io = gm, plan, low.torch, precast, keep_io
        self.low_max, self.weights_low = low.max, weights_low and precast
        self.typed = has_dtypes(gm)
        self.fp32 = {n: carries_fp32(n, gm, self.typed) for n in gm.graph.nodes}
        self.graph = fx.Graph()
        self.graph._codegen = copy.copy(gm.graph._codegen)  # its pytree specs are immutable: shared, not deep-copied
        self.env: dict[fx.Node, fx.Node] = {}
        self.dtype: dict[fx.Node, torch.dtype | None] = {}
        self.cache: dict[tuple[fx.Node, torch.dtype, bool], fx.Node] = {}
        self.stats = RewriteStats()
        self.aliases = alias_groups(gm)
        self.low_only_weights = self._low_only_weights() if precast else set()
        if self.weights_low:
            self.low_only_weights |= self._fitting_weights()

    # -- planning helpers -------------------------------------------------------------------------
    def _wanted(self, node: fx.Node) -> torch.dtype | None:
        decision = self.plan[node.name] if node.name in self.plan else None
        if decision is None:
            return None
        if decision.precision is Precision.FP32_ACCUM:
            return None if self._takes_dtype(node) else torch.float32
        return input_dtype(decision.precision, self.low)

    def _low_only_weights(self) -> set[fx.Node]:
        """get_attr nodes whose every consumer wants them in low precision (rule 2); a consumer that reads
        one in a slot its policy keeps (a batch norm's statistics) wants it as it is."""
        result = set()
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and self.fp32[node] and node.users and not self.aliases.written(node):
                wants = {None if node in policy.kept_arguments(user, self.gm)[0] else self._wanted(user)
                         for user in node.users}
                if wants == {self.low}:
                    result.add(node)
        return result

    def _fitting_weights(self) -> set[fx.Node]:
        """Every read fp32 weight whose values the low dtype holds (rule 2, ``weights_low``)."""
        result = set()
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and self.fp32[node] and node.users and not self.aliases.written(node):
                tensor = fetch_attr(self.gm, str(node.target))
                if not tensor.numel() or float(tensor.detach().abs().max()) <= self.low_max:
                    result.add(node)
        return result

    def _takes_dtype(self, node: fx.Node) -> bool:
        target = node.target
        return (
            node.op == "call_function"
            and isinstance(target, torch._ops.OpOverload)
            and any(a.name == "dtype" for a in target._schema.arguments)
            and not any(isinstance(a, torch.dtype) for a in node.args)
            and node.kwargs.get("dtype") is None
        )

    # -- emission ---------------------------------------------------------------------------------
    def run(self) -> fx.Graph:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                new = self.graph.node_copy(node, lambda a: self.env[a])
                self.dtype[new] = torch.float32 if self.fp32[node] else None
            elif node.op == "get_attr":
                new = self._weight(node)
            elif node.op == "output":
                self._output(node)
                continue
            else:
                new = self._call(node)
            self.env[node] = new
        self.graph.lint()
        return self.graph

    def _weight(self, node: fx.Node) -> fx.Node:
        new = self.graph.node_copy(node, lambda a: self.env[a])
        if node in self.low_only_weights:
            self._replace_attr(str(node.target), self.low)
            self.stats.weights_converted += 1
            self.dtype[new] = self.low
        else:
            self.dtype[new] = torch.float32 if self.fp32[node] else None
        return new

    def _call(self, node: fx.Node) -> fx.Node:
        decision = self.plan[node.name] if node.name in self.plan else None
        wanted = self._wanted(node)
        slots = self._slots(node)
        casts: list[str] = []

        def convert(arg: Any, slot: str | None) -> Any:
            if not isinstance(arg, fx.Node):
                return arg
            if wanted is None or not self.fp32[arg] or slots.get(slot or "") == "keep" or _is_container(arg):
                return self.env[arg]
            new_arg = self._value_as(arg, wanted, saturate=slots.get(slot or "") == "saturate")
            if new_arg is not self.env[arg]:
                casts.append(new_arg.name)
            return new_arg

        names = argument_names(node)
        args = tuple(
            torch.utils._pytree.tree_map(functools.partial(convert, slot=names[i] if i < len(names) else None), arg)
            for i, arg in enumerate(node.args)
        )
        kwargs = {
            k: torch.utils._pytree.tree_map(functools.partial(convert, slot=k), v) for k, v in node.kwargs.items()
        }
        target, args, kwargs = self._retarget_cast(node, args, kwargs, decision)
        created_low = self._created_low(node, args, kwargs)
        if created_low:
            kwargs = {**kwargs, "dtype": self.low}
        if decision is not None and decision.precision is Precision.FP32_ACCUM and wanted is None:
            kwargs["dtype"] = torch.float32
        if node.op == "call_module" and decision is not None and decision.precision is Precision.LOW and self.precast:
            kept = policy.kept_arguments(node, self.gm)[1]
            for name, _ in module_state(self.gm, node):
                if name.rsplit(".", 1)[-1] not in kept:
                    self._replace_attr(name, self.low)
                    self.stats.weights_converted += 1
        new = self.graph.create_node(node.op, target, args, kwargs, name=node.name, type_expr=node.type)
        new.meta = dict(node.meta)
        if decision is not None:
            new.meta[META_KEY] = {**decision.to_meta(), "op": ops.display_name(node, self.gm), "casts_in": casts}
        self.dtype[new] = self.low if created_low else self._out_dtype(node, decision)
        if node in self.aliases.writes:  # rule 10: casts of the group made before this write are stale
            group = set(self.aliases.group(node))
            self.cache = {key: cast for key, cast in self.cache.items() if key[0] not in group}
        return new

    def _created_low(self, node: fx.Node, args: tuple, kwargs: dict) -> bool:
        """Rule 8: whether ``node`` is an fp32 factory call whose every reader wants the low dtype."""
        if (node.op != "call_function" or ops.op_name(node) not in _FACTORIES or kwargs.get("dtype") != torch.float32
                or not self.fp32[node] or not node.users or self.aliases.written(node)):
            return False
        fills = [a for a in list(args[1:]) + [kwargs.get("fill_value")] if isinstance(a, (int, float))]
        if any(abs(f) > self.low_max and abs(f) != float("inf") for f in fills):
            return False
        return all(self._wanted(user) == self.low and not _is_container(node) for user in node.users)

    def _retarget_cast(self, node: fx.Node, args: tuple, kwargs: dict, decision: Any) -> tuple[Any, tuple, dict]:
        """Rule 4: a model's cast to fp32 on a node painted low now casts to the low dtype."""
        if decision is None or decision.precision is not Precision.LOW or cast_target(node) != torch.float32:
            return node.target, args, kwargs
        if node.op == "call_method" and node.target == "float":
            return "to", (args[0], self.low), kwargs
        args = tuple(self.low if a == torch.float32 else a for a in args)
        kwargs = {k: (self.low if v == torch.float32 else v) for k, v in kwargs.items()}
        return node.target, args, kwargs

    def _out_dtype(self, node: fx.Node, decision: Any) -> torch.dtype | None:
        complex_half = self._complex_half(node, decision)
        if complex_half is not None:
            return complex_half
        if not self.fp32[node]:
            return None
        if node.target is operator.getitem and _is_container(node.args[0]):
            return self.dtype.get(self.env[node.args[0]])  # rule 7: an element of the uncast container
        if decision is None or decision.precision is Precision.KEEP:
            return torch.float32
        return self.low if decision.precision is Precision.LOW else torch.float32

    def _complex_half(self, node: fx.Node, decision: Any) -> torch.dtype | None:
        """Rule 9: complex32 for a complex64 value made from fp16 values (fp16 has a complex twin, bf16 none),
        fp16 for an fp32 value read out of complex32 ones (``view_as_real``, ``abs``); None otherwise."""
        val = node.meta.get("val")
        if (self.low != torch.float16 or not isinstance(val, torch.Tensor)
                or val.dtype not in (torch.complex64, torch.float32)
                or (decision is not None and decision.precision in (Precision.FP32, Precision.FP32_ACCUM))):
            return None
        complex_inputs = [a for a in node.all_input_nodes
                          if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_complex()]
        halves = [a for a in complex_inputs if self.dtype.get(self.env[a]) == torch.complex32]
        if val.dtype == torch.float32:
            return self.low if halves else None
        made_low = decision is not None and decision.precision is Precision.LOW
        return torch.complex32 if (halves or made_low) and len(halves) == len(complex_inputs) else None

    def _output(self, node: fx.Node) -> None:
        def back(arg: Any) -> Any:
            if not isinstance(arg, fx.Node):
                return arg
            if self.keep_io and self.fp32[arg]:
                return self._value_as(arg, torch.float32)
            if self.keep_io and self.dtype.get(self.env[arg]) == torch.complex32:
                return self._value_as(arg, torch.complex64)
            return self.env[arg]

        args = torch.utils._pytree.tree_map(back, node.args)
        new = self.graph.output(args[0], type_expr=node.type)
        new.meta = dict(node.meta)

    def _value_as(self, arg: fx.Node, dtype: torch.dtype, saturate: bool = False) -> fx.Node:
        """Rule 1: ``arg``'s rewritten value in ``dtype``, casting once and sharing the cast."""
        source = self.env[arg]
        if self.dtype.get(source) == dtype:
            return source
        key = (arg, dtype, saturate)
        if key in self.cache:
            return self.cache[key]
        if arg.op == "get_attr" and self.precast and not self.weights_low and not self.aliases.written(arg):
            cast = self._weight_copy(arg, dtype)
        else:
            value = source
            if saturate:
                limit = float(torch.finfo(dtype).max)
                value = self.graph.call_function(aten.clamp.default, (source, -limit, limit))
                self.stats.saturated.append(arg.name)
            if self.typed:
                cast = self.graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
            else:
                cast = self.graph.call_function(graph_calls.cast_floating, (value, dtype))
            cast.name = self.graph._graph_namespace.create_name(f"{arg.name}_to_{short_name(dtype)}", None)
            cast.meta[META_KEY] = {"cast": True, "of": arg.name, "to": short_name(dtype)}
            self.stats.casts += 1
        self.dtype[cast] = dtype
        self.cache[key] = cast
        return cast

    def _weight_copy(self, arg: fx.Node, dtype: torch.dtype) -> fx.Node:
        """Rule 2 for a weight read in two dtypes: a converted copy stored beside the fp32 original."""
        target = f"{arg.target}__{short_name(dtype)}"
        tensor = fetch_attr(self.gm, str(arg.target))
        _assign(self.gm, target, _converted(tensor, dtype))
        self.stats.weight_copies += 1
        return self.graph.get_attr(target)

    def _replace_attr(self, target: str, dtype: torch.dtype) -> None:
        tensor = fetch_attr(self.gm, target)
        if tensor.dtype != dtype:
            _assign(self.gm, target, _converted(tensor, dtype))

    def _slots(self, node: fx.Node) -> dict[str, str]:
        row = policy.lookup(ops.op_name(node, self.gm), policy.in_training(node, self.gm))
        return dict(row.slots) if row is not None else {}


def rewrite(
    gm: fx.GraphModule,
    plan: PrecisionPlan,
    low: LowType,
    options: RewriteOptions | None = None,
) -> RewriteStats:
    """Rewrite ``gm`` (a private copy the caller owns) in place according to ``plan``, as ``options`` say (by
    default :class:`~amppass.analysis.options.RewriteOptions`' defaults)."""
    options = options or RewriteOptions()
    rewriter = _Rewriter(gm, plan, low, options.precast_weights, options.keep_io_types, options.weights_low)
    graph = rewriter.run()
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    gm.graph = graph
    gm.recompile()
    return rewriter.stats


_FACTORIES = frozenset({"zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like",
                        "new_zeros", "new_ones", "new_full", "new_empty", "scalar_tensor"})


def _is_container(node: fx.Node) -> bool:
    """Whether ``node`` produces a tuple or list of tensors (a multi-output op) rather than one tensor."""
    return isinstance(node.meta.get("val"), (tuple, list))


def _converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    data = tensor.detach().to(dtype)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(data, requires_grad=False)
    return data


def _assign(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Store ``value`` at dotted ``target`` as a parameter if it is one, else as a buffer."""
    *path, leaf = target.split(".")
    owner = gm.get_submodule(".".join(path))
    owner._parameters.pop(leaf, None)
    owner._buffers.pop(leaf, None)
    owner.__dict__.pop(leaf, None)
    if isinstance(value, torch.nn.Parameter):
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value)
