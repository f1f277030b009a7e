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
   :mod:`amppass.fx.runners.calibrate`), so they are not run again.
5. A call that cannot be captured is run on the original model: if the original rejects it too, its own
   error is raised; otherwise a :class:`~amppass.errors.CaptureError` names the input, the dimension and
   what the model was converted for. Without the original model (a loaded program) a rejected call raises
   :class:`~amppass.errors.InputError` saying the same.
6. A floating-point input of another floating dtype than the example's (a bf16 or fp16 tensor from a
   pipeline that casts to the model's dtype, an fp64 one) is cast to the example's dtype first, as
   torch.autocast casts what an op reads, and logged once per input and dtype: it neither costs a re-capture
   nor reaches a kernel beside weights of another dtype (the model's own error would name a dtype the user
   never chose).
7. ``module.forward(...)`` takes the path ``module(...)`` takes. A keyword value the capture fixed in the graph
   (a flag passed through ``**kwargs``, :func:`amppass.fx.capture.export.capture`) is part of a plan's guards: a call
   with another value gets a plan of its own. Mappings torch's pytree does not know (``BatchEncoding``) are
   taken as dicts, and every container is copied before a plan or the original model runs, so neither
   writes into the caller's inputs.
8. A call on another device than the original model's (the module moved with ``.to("cuda")`` after converting
   on the CPU) captures its later plan from the original where that is, on the call's inputs moved there, and
   moves the plan to the call's device, device literals included (:mod:`amppass.fx.rewrite.device_literals`).
9. The guards read the shapes, dtypes and devices of a call's tensors and its plain values, nothing else: so a
   call of tensors and plain values (no container) whose key an earlier call had, one the module's own plan
   ran without a cast or a fixed keyword, skips the check and runs the plan at once. At most
   :data:`_ACCEPTED_MEMORY` keys are kept, the oldest dropped first, and none past a move to another device.
10. A model converted for inference from train mode without ``mode=`` (``amppass.convert`` warned) refuses a call
   in train mode with gradients enabled, an attempt to train an eval graph whose weights are not trainable, with
   an :class:`~amppass.errors.InputError` naming ``mode='train'`` (:meth:`ServingGraph.refuse_training`), instead
   of torch's "does not require grad" at ``backward()``.
"""

from __future__ import annotations

import collections
import copy
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..analysis.record import META_KEY
from ..errors import CaptureError, InputError
from ..fx.capture.guards import GUARDS_KEY, MAX_PLANS, ShapeGuards, call_layout, plain_inputs
from ..fx.capture.modes import module_mode
from ..fx.rewrite.device_literals import module_device
from .fp32_parameters import Fp32Face, stored_parameters
from .plan_dtypes import PlanDtypes

log = logging.getLogger(__name__)

_REJECTED_MEMORY = 16  # call signatures the original model rejected, answered without another capture
_ACCEPTED_MEMORY = 64  # call keys the module's own plan took (rule 9)
_PLAIN = (int, float, bool, str, type(None))


# -- the served module ------------------------------------------------------------------------------------

# captures and converts the original model for a call's (args, kwargs): the later plan that serves it
CaptureAndConvert = Callable[[tuple, dict], fx.GraphModule]


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
    recapture: CaptureAndConvert | None
    original: nn.Module | None
    origin: str
    extra: "collections.OrderedDict[int, _Plan]" = field(default_factory=collections.OrderedDict)
    rejected: "collections.OrderedDict[tuple, None]" = field(default_factory=collections.OrderedDict)
    made: int = 0
    told: set[str] = field(default_factory=set)  # inputs cast at the boundary and logged (rule 6)
    accepted: dict[tuple, None] = field(default_factory=dict)  # call keys the own plan took unchanged (rule 9)
    untrainable: str | None = None  # rule 10: why a call in train mode with gradients enabled is refused


class ServingGraph(Fp32Face, fx.GraphModule):
    """A converted graph that serves every input shape its original model takes (see the module docstring).

    It is the converted graph of the example's shapes (``graph``, ``meta``, parameters and buffers are
    that plan's); calls its guards reject go to a later plan, captured and converted on first use. Its
    ``parameters()`` and ``dtype`` face its caller in fp32 (:mod:`amppass.serving.fp32_parameters`).

    Args:
        gm: the converted graph module; its graph and state become this module's.
        guards: what ``gm`` accepts.
        recapture: captures and converts the original model for a call's ``(args, kwargs)``; None when
            the original is not at hand (a loaded program).
        original: the original model, run on a call that cannot be captured to raise its own error.
        name: the model's name in messages.
        origin: why there is no original model (when ``recapture`` is None), for the error message.
    """

    def __init__(self, gm: fx.GraphModule, guards: ShapeGuards, recapture: CaptureAndConvert | None = None,
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

    def refuse_training(self, why: str) -> None:
        """Rule 10: from now on a call in train mode with gradients enabled raises an
        :class:`~amppass.errors.InputError` saying ``why``."""
        self._plans.untrainable = why

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

    def recompile(self) -> Any:
        """Generate the graph's code as ``GraphModule`` does, as :meth:`run_graph`; ``forward`` is :meth:`serve`
        under the graph's own signature, so ``module.forward(...)`` and ``module(...)`` take the same path."""
        code = super().recompile()
        cls = type(self)  # GraphModule gives each instance a class of its own and puts forward() there
        cls.run_graph = cls.forward

        def forward(self: "ServingGraph", *args: Any, **kwargs: Any) -> Any:
            return self.serve(*args, **kwargs)

        cls.forward = functools.wraps(cls.run_graph)(forward)
        return code

    def serve(self, *args: Any, **kwargs: Any) -> Any:
        """Run the plan that takes this call (rules 1 and 2), on the call's inputs cast as rule 6 says.

        Rule 9: a call of tensors and plain values whose shapes, dtypes and devices an earlier call had, and that
        ran this module's own plan unchanged, runs it again at once (the check is a dictionary lookup)."""
        if self._plans.untrainable is not None and self.training and torch.is_grad_enabled():  # rule 10
            raise InputError(self._plans.untrainable)
        key = _call_key(args, kwargs)
        accepted = self._plans.accepted
        if key is not None and key in accepted:
            return self.run_graph(*args, **kwargs)
        args, kwargs = plain_inputs(args), plain_inputs(kwargs)
        plan, args, kwargs = self.select(args, kwargs)
        args, kwargs = plan.meta[GUARDS_KEY].runnable(args, kwargs)
        if plan is self:
            if key is not None and _call_key(args, kwargs) == key:
                accepted[key] = None
                if len(accepted) > _ACCEPTED_MEMORY:
                    accepted.pop(next(iter(accepted)))
            return self.run_graph(*args, **kwargs)
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
            graph = self._recaptured(args, kwargs)
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

    def _recaptured(self, args: tuple, kwargs: dict) -> fx.GraphModule:
        """The later plan for this call: captured from the original model where it is (rule 8), on the call's
        inputs moved there, and moved to the call's device with its device literals."""
        plans = self._plans
        here = next((t.device for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), None)
        there = module_device(plans.original)
        if here is None or there is None or here == there:
            return plans.recapture(args, kwargs)
        graph = plans.recapture(*_on(there, args, kwargs))
        moved = PlanDtypes(lambda t: t.to(here))
        graph._apply(moved)
        moved.retarget([graph])
        return graph

    def _raise_original(self, args: tuple, kwargs: dict) -> None:
        """Rule 5: run the original model on a call no plan takes; its own error propagates unchanged."""

        original = self._plans.original
        if original is None:
            return
        args, kwargs = copy.deepcopy((plain_inputs(args), plain_inputs(kwargs)))  # it may write into them (a cache)
        there = module_device(original)
        if there is not None:  # rule 8: the original may stay on another device
            args, kwargs = _on(there, args, kwargs)
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
            if found is not None and found is not tensor and found.shape == tensor.shape \
                    and found.dtype == tensor.dtype:
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
        kept.retarget(self.plans)
        self._plans.accepted.clear()  # rule 9's keys were taken on the module's old device
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
        object.__setattr__(copied, "_plans", _Plans(plans.name, plans.recapture, plans.original, plans.origin,
                                                    untrainable=plans.untrainable))
        copied._record()
        return copied

    def __reduce__(self) -> Any:
        if self.meta.get(META_KEY, {}).get("mode") == "train":
            raise InputError(f"{self._plans.name}: torch.save cannot pickle a converted model (its graphs run "
                             "generated code); checkpoint a train-mode model with "
                             "torch.save(model.state_dict(), path) and load "
                             "it into a model converted the same way")
        raise InputError(f"{self._plans.name}: torch.save cannot pickle a converted model (its graph runs generated "
                         "code): save it with amppass.save(model, 'model.pt2') and read it back with amppass.load")


def _on(device: torch.device, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's tensors on ``device`` (the same tensors where they are there already)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), (args, kwargs))


def _call_key(args: tuple, kwargs: dict) -> tuple | None:
    """Rule 9: what the guards of a call of tensors and plain values read (each tensor's shape, dtype and device,
    each plain value itself, the keywords' names), or None for any other call (containers, tensor subclasses)."""
    key: list[Any] = []
    for value in args:
        if type(value) is torch.Tensor:
            key.append((value.shape, value.dtype, value.device))
        elif type(value) in _PLAIN:
            key.append((type(value), value))
        else:
            return None
    for name, value in kwargs.items():
        if type(value) is torch.Tensor:
            key.append((name, value.shape, value.dtype, value.device))
        elif type(value) in _PLAIN:
            key.append((name, type(value), value))
        else:
            return None
    return tuple(key)


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
