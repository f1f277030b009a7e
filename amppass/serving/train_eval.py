"""The module ``amppass.convert(..., mode="train")`` returns: a train graph and an eval graph over one state.

torch.export bakes the training flag into the graph it captures (dropout's ``train`` argument, batch norm's
``training`` argument, any ``if self.training`` in Python) and its module refuses ``.train()``/``.eval()``.
torch.ao's ``move_exported_model_to_train/eval`` rewrote dropout and batch norm patterns in place, but
torch 2.13 no longer ships it and it cannot follow a model's own ``self.training`` branches. So both modes
are captured and converted, and :class:`TrainEvalGraphs` runs the one that matches ``self.training``.

Rules:

1. The module owns its state: parameters and buffers are cloned from the captured (caller's) tensors, so
   training the converted module never touches the caller's model. Tied weights stay tied.
2. Its module tree is the original model's (:mod:`amppass.serving.tree`): the same submodules under the
   same names, each holding the parameters and buffers it holds in the original, tied names included, in
   the original's order. So ``named_parameters()``, ``state_dict()`` and ``load_state_dict()`` read and
   write the original's keys, checkpoints go both ways, and any optimizer works on the parameters.
3. Each module of the tree runs its own part of the graph of the current mode and reads its tensors from
   itself at call time, so FSDP2's ``fully_shard`` per block and on the root, DDP, ``.to()`` and
   ``load_state_dict(assign=True)`` reach both modes.
4. Both modes read the very same tensors: a step taken in train mode is seen in eval mode, and batch norm's
   running statistics, updated in place by the train graph, are what the eval graph normalises with.
5. A call the example's plan does not take (a batch of 1 where the capture kept batches of 2 and more
   apart) gets a later plan (:mod:`amppass.serving.serving_graph`), outlined into the same tree under a key of its own
   the first time, so FSDP2 and hooks work at that shape too. A plan that cannot be outlined runs as one
   graph pointed at the tree's tensors (logged; refused under FSDP2, whose sharded parameters one graph
   cannot read).
6. Between calls the flat graphs hold no tensors, only stand-ins on the meta device: after FSDP2 shards the
   tree's parameters nothing else keeps the whole parameters alive on each rank. A call that runs as one
   graph points them at the tree's tensors for its duration.
7. Each graph runs every submodule in the mode it had when that graph was captured: the root's mode, or
   the submodule's own where the model was already in that mode (``model.train(); model.bn.eval()`` before
   converting freezes batch norm's statistics in the train graph). ``train()``/``eval()`` restore those
   flags, and a call with a submodule switched since raises :class:`~amppass.errors.InputError` (a graph
   cannot follow a flag set later).
8. The tree is used only where it is faithful, decided at conversion: each part is one module called once
   with the values its code takes (:mod:`amppass.serving.tree`, rule 5), and the tree computes on the
   example what the flat graph computes, in both modes. Where it does not, the model runs as one graph
   (logged), never the tree's error on a first call.

FSDP2's ``MixedPrecisionPolicy``: amppass's casts do the low-precision work, so ``param_dtype`` stays unset
(FSDP2 gathers the fp32 parameters and each op reads them in the precision its plan says); ``reduce_dtype``
may be set as usual. ``param_dtype=torch.float16`` would hand the ops the plan keeps fp32 (layer norms,
embeddings feeding fp32 work) low-precision weights: a call under such a policy raises
:class:`~amppass.errors.InputError` saying so.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Iterator, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..analysis.record import META_KEY
from ..errors import InputError
from ..fx.capture.guards import GUARDS_KEY, call_layout
from ..fx.capture.inputs import example_call, flatten_inputs
from ..fx.capture.modes import captured_flags
from ..fx.rewrite.fp8_train import STATE_KEY
from ..fx.rewrite.low_backward import record_saved_bytes
from .plan_dtypes import PlanDtypes
from .serving_graph import set_state
from .tree import Outline, build_tree, install, named_state, outline, sharded, stand_in, unfit
from .tree_modules import Children, Mode

log = logging.getLogger(__name__)

_TREE_KEY = "amppass_tree_code"  # a later plan's meta: its outline in the tree and key, or (None, None)


class TrainEvalGraphs(Children, nn.Module):
    """Runs the train graph in training mode and the eval graph in eval mode, over one set of fp32 tensors.

    Args:
        train_graph: the model captured and converted in training mode; its state becomes this module's.
        eval_graph: the same model captured and converted in eval mode; its state is replaced by this
            module's, so only its graph is used.
        training: the mode to start in.
        original: the caller's model, read for its module tree and names (rule 2); not kept.
        example: the example ``(args, kwargs)`` of the conversion, to outline the graphs into the tree.
    """

    def __init__(self, train_graph: fx.GraphModule, eval_graph: fx.GraphModule, training: bool = True,
                 original: nn.Module | None = None, example: tuple[Any, dict] | None = None):
        super().__init__()
        _own_state(train_graph)
        if example is not None and META_KEY in train_graph.meta:
            record_saved_bytes(train_graph, flatten_inputs(train_graph, *example_call(example), index=0))
        # Not submodules: their state is this module's, and registering them would prefix every name.
        object.__setattr__(self, "_graphs", {True: train_graph, False: eval_graph})
        self._mode = Mode(training)
        outlines = {flag: outline(graph, example) for flag, graph in self._graphs.items()}
        if original is None:
            original = train_graph
        why = unfit(original, outlines)
        runnable = why is None
        if why is not None and all(o is not None for o in outlines.values()):  # outline() logged its own failures
            log.warning("%s: %s; the converted model runs as one graph, so FSDP2 can wrap only the whole model",
                        type(original).__name__, why)
        build_tree(self, original, self._mode, outlines if runnable else {}, *_named_state(train_graph, original))
        self._outlines: dict[bool, Outline] = outlines if runnable else {}
        if self._outlines and example is not None:
            why = self._unfaithful(example)
            if why is not None:
                log.warning("%s: %s; the converted model runs as one graph, so FSDP2 can wrap only the whole model",
                            type(original).__name__, why)
                self._outlines = {}
                for module in self.modules():
                    getattr(module, "_code", {}).clear()
        read = {name for name, _ in named_state(train_graph)}
        # tied names, the one the graphs read first: after load_state_dict(assign=True) all point at its tensor
        self._tied = [sorted(names, key=lambda n: n not in read) for names in _groups(self)]
        self._made = 0  # later plans outlined into the tree (rule 5)
        # rule 7: the submodules each graph was captured with in the other mode (bn.eval() in a training model)
        self._flags = {flag: captured_flags(original, flag) if original is not train_graph else {}
                       for flag in (True, False)}
        self._submodules = [(name, module) for name, module in self.named_modules() if name]
        self._reset_graph_state()
        self.train(training)

    @property
    def train_graph(self) -> fx.GraphModule:
        """The converted graph of training mode, as one graph (the one :func:`amppass.report` reads); with a
        module tree its state attributes are meta-device stand-ins between calls (rule 6)."""
        return self._graphs[True]

    @property
    def eval_graph(self) -> fx.GraphModule:
        """The converted graph of eval mode, as one graph (stand-ins as in :attr:`train_graph`)."""
        return self._graphs[False]

    @property
    def outlined(self) -> bool:
        """Whether every module of the tree runs its own part of the graph (rule 3), so FSDP2 can wrap blocks."""
        return bool(self._outlines)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the plan of the current mode that takes the call: through the module tree (rule 5)."""
        _check_fsdp_policy(self)
        self._check_modes()
        served = self._graphs[self.training]
        if self._outlines:  # a module tree: its graphs serve shapes (ServingGraph)
            plan, args, kwargs = served.select(args, kwargs)  # a later plan is made now (and logged)
            found, key = self._outline_for(plan, args, kwargs)
            flat = found.flat_inputs(args, kwargs) if found is not None else None
            if flat is not None:
                self._mode.key = key
                self._mode.calls += 1
                try:
                    return found.outputs(found.root(self, *flat))
                finally:
                    self._mode.calls -= 1
        self._check_whole_tensors(args, kwargs)
        self._share_state()
        try:
            return served(*args, **kwargs)
        finally:
            self._reset_graph_state()

    def _unfaithful(self, example: tuple[Any, dict]) -> str | None:
        """Rule 8: why the module tree does not compute what the flat graphs compute on the example, or None.

        Each mode runs both ways on the example, without gradients, from one random seed (dropout draws the
        same masks), and the state the train graph updates in place (batch norm's statistics) is put back."""
        if any(tensor.is_meta for _, tensor in named_state(self)):
            return None  # no values to run on: the shapes were checked by export
        args, kwargs = example_call(example)
        saved = {name: tensor.detach().clone() for name, tensor in self.named_buffers(remove_duplicate=False)}
        leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        device = leaves[0].device if leaves else torch.device("cpu")
        rng = {"devices": []} if device.type == "cpu" else {"devices": [device], "device_type": device.type}
        try:
            for training, found in self._outlines.items():
                mode = "train" if training else "eval"
                with torch.no_grad(), torch.random.fork_rng(**rng):
                    torch.manual_seed(0)
                    self._share_state()
                    try:
                        expected = self._graphs[training](*args, **kwargs)
                    finally:
                        self._reset_graph_state()
                    self._restore(saved)
                    torch.manual_seed(0)
                    self._mode.key = training
                    self._mode.calls += 1
                    try:
                        got = found.outputs(found.root(self, *found.flat_inputs(args, kwargs)))
                    except Exception as err:  # noqa: BLE001 - the flat graph runs instead; the reason is logged
                        return f"its module tree fails on the example in {mode} mode ({type(err).__name__}: {err})"
                    finally:
                        self._mode.calls -= 1
                        self._mode.key = self.training
                    self._restore(saved)
                differs = _differs(expected, got)
                if differs is not None:
                    return f"its module tree computes other values than its graph on the example in {mode} mode " \
                           f"({differs})"
            return None
        finally:
            self._restore(saved)

    def _restore(self, saved: dict[str, torch.Tensor]) -> None:
        """Put back the buffers a run on the example updated in place."""
        with torch.no_grad():
            for name, value in saved.items():
                self.get_buffer(name).copy_(value)

    def _installed(self) -> Iterator[tuple[Any, Outline]]:
        """(key, outline) of every plan installed in the tree: both modes' example plans and the later ones."""
        yield from ((flag, found) for flag, found in self._outlines.items())
        for graph in self._graphs.values():
            for plan in graph.plans[1:]:
                found, key = plan.meta.get(_TREE_KEY) or (None, None)
                if found is not None:
                    yield key, found

    def _outline_for(self, plan: fx.GraphModule, args: tuple, kwargs: dict) -> tuple[Outline | None, Any]:
        """The tree code of ``plan``, the one that takes this call, and its key (rule 5); None if it runs as one
        graph."""
        if plan is self._graphs[self.training]:
            return self._outlines[self.training], self.training
        installed = plan.meta.get(_TREE_KEY)
        if installed is None:
            installed = plan.meta[_TREE_KEY] = self._install(plan, args, kwargs)
        return installed

    def _install(self, plan: fx.GraphModule, args: tuple, kwargs: dict) -> tuple[Outline | None, Any]:
        """Outline a later plan into the tree under a key of its own, or say why its shape runs as one graph."""
        leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        found = outline(plan, (args, kwargs), leaves[0].device if leaves else torch.device("cpu"))
        key = (self.training, self._made)
        why = unfit(self, {self.training: found}) or install(self, key, found)
        if why is not None:
            log.warning("%s: the plan for %s cannot run in the module tree (%s); calls of these shapes run as one "
                        "graph, which FSDP2 can only wrap whole", type(self).__name__,
                        plan.meta[GUARDS_KEY].describe(), why)
            return None, None
        self._made += 1
        return found, key

    def train(self, mode: bool = True) -> "TrainEvalGraphs":
        """Switch the whole tree; a submodule the graph of ``mode`` was captured with in the other mode keeps
        that mode (rule 7)."""
        super().train(mode)
        submodules = dict(self._submodules)
        for name, flag in self._flags[mode].items():
            submodules[name].training = flag
        self._mode.key = mode
        return self

    def _check_modes(self) -> None:
        """Rule 7: every submodule in the mode the graph of the root's mode was captured with it in."""
        expected = self._flags[self.training]
        for name, module in self._submodules:
            wanted = expected.get(name, self.training)
            if module.training != wanted:
                mode = "train" if self.training else "eval"
                now, then = ("train", "eval") if module.training else ("eval", "train")
                path = f".{name}" if all(p.isidentifier() for p in name.split(".")) else f".get_submodule({name!r})"
                raise InputError(
                    f"{name} ({type(module).__name__}) is in {now} mode, but the converted {mode}-mode graph runs it "
                    f"in {then} mode, as the model was when converted: a graph cannot follow a flag set later. "
                    f"Set the modes on the original before converting (original.{mode}(); "
                    f"original{path}.{now}(); amppass.convert(original, ..., mode='train')): the converted model "
                    "keeps them")

    def drop_original(self) -> None:
        """Stop holding the original model (its fp32 weights) for conversions of new shapes.

        Afterwards a call no plan takes raises :class:`~amppass.errors.InputError` naming the input and
        dimension. The module's own state is a copy and stays.
        """
        for graph in self._graphs.values():
            drop = getattr(graph, "drop_original", None)
            if drop is not None:
                drop()

    def __reduce__(self) -> Any:
        """Refuse pickling (``torch.save``, ``pickle``, multiprocessing): the graphs run generated code."""
        raise InputError(f"{type(self).__name__}: torch.save/pickle cannot pickle a converted model (its graphs run "
                         "generated code); checkpoint a train-mode model with torch.save(model.state_dict(), path) "
                         "and load it into a model converted the same way (copy.deepcopy copies it in memory)")

    def __copy__(self) -> "TrainEvalGraphs":
        """What ``copy.copy`` makes of any module: a new module object sharing this one's tensors, submodules and
        graphs (so a step or a mode switch of the shared submodules shows in both); ``copy.deepcopy`` makes an
        independent copy. Defined because ``__reduce__``, which ``copy.copy`` would call, refuses pickling."""
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> "TrainEvalGraphs":
        """A copy with its own tensors and modules (what ``copy.deepcopy`` does without ``__reduce__``)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        memo[id(self._mode)] = copy.copy(self._mode)  # the copy's parts share its mode, not this one's
        copied.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        return copied

    def _apply(self, fn: Any, recurse: bool = True) -> "TrainEvalGraphs":
        """``.to()`` and its relatives move the device; the fp32 master weights and the graphs' constants keep
        their dtypes (:mod:`amppass.serving.plan_dtypes`)."""
        kept = PlanDtypes(fn)
        result = super()._apply(kept, recurse)
        for module in self.modules():  # the graphs' constants move with the tree
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor):
                    module.__dict__[name] = kept(value)
        kept.retarget(plan for graph in self._graphs.values() for plan in graph.plans)
        for key, found in self._installed():  # the tree's code of every plan, generated again where a device moved
            for name, code in found.retarget(kept.moves, self).items():
                if name:
                    self.get_submodule(name)._code[key] = code
        kept.tell(type(self).__name__)
        self._reset_graph_state()  # rule 4: buffers (and, on some settings, parameters) are new tensors now
        return result

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``; with ``assign`` tied names are tied again to the tensor the graphs read."""
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            self._tie()
        self._reset_graph_state()
        return result

    def _tie(self) -> None:
        """Point every tied name at the tensor of the name the graphs read, as they read one tensor."""
        for names in self._tied:
            first = self.get_parameter(names[0]) if _is_param(self, names[0]) else self.get_buffer(names[0])
            for name in names[1:]:
                set_state(self, name, first)

    def _share_state(self) -> None:
        """Rule 4: point every state attribute of both flat graphs at this module's tensor of the same name."""
        mine = dict(named_state(self))
        for graph in self._graphs.values():
            for name, _ in list(named_state(graph)):
                if name in mine:
                    set_state(graph, name, mine[name])

    def _reset_graph_state(self) -> None:
        """Between calls (rule 6): with a module tree, the flat graphs and their later plans hold stand-ins on
        the meta device in place of this module's tensors; without one, they hold the tensors themselves."""
        if not self._outlines:
            self._share_state()
            return
        mine = {name for name, _ in named_state(self)}
        for graph in self._graphs.values():
            for name, tensor in list(named_state(graph)):
                if name in mine and not tensor.is_meta:
                    set_state(graph, name, stand_in(tensor, torch.device("meta")))
            graph.rebind()

    def _check_whole_tensors(self, args: tuple, kwargs: dict) -> None:
        """A call the tree cannot run reads every tensor from the root: sharded ones cannot be read there."""
        held = [name for name, tensor in named_state(self) if sharded(tensor)]
        if held:
            raise InputError(
                f"{type(self).__name__}: this call runs the converted model as one graph (the plan for "
                f"{call_layout(args, kwargs)} could not be outlined into its modules, see the log), which cannot read "
                f"parameters FSDP2 has sharded ({held[0]} ...): call it with inputs of the shapes it was converted "
                "for, or convert with an example of these shapes")


def _differs(expected: Any, got: Any) -> str | None:
    """Where two runs of one plan on one input part ways, or None: the same layout, and each tensor equal to a
    thousandth of its largest value (the same kernels on the same values; only their grouping may differ)."""
    want, want_spec = pytree.tree_flatten(expected)
    have, have_spec = pytree.tree_flatten(got)
    if want_spec != have_spec:
        return "its outputs are laid out differently"
    for index, (a, b) in enumerate(zip(want, have, strict=False)):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            if a != b:
                return f"output {index} is {b!r}, not {a!r}"
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {index} is {b.dtype}{list(b.shape)}, not {a.dtype}{list(a.shape)}"
        if a.is_floating_point() or a.is_complex():
            scale = float(a.detach().abs().nan_to_num(0, 0, 0).max()) if a.numel() else 0.0
            if not torch.allclose(a, b, rtol=1e-3, atol=1e-3 * max(scale, 1e-6), equal_nan=True):
                return f"output {index} differs by up to {float((a - b).abs().nan_to_num(0).max()):.3g}"
        elif not torch.equal(a, b):
            return f"output {index} differs"
    return None


def _check_fsdp_policy(root: nn.Module) -> None:
    """FSDP2 may not cast the parameters itself: the plan reads fp32 weights in the ops it keeps fp32."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule

    for name, module in root.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        low = getattr(getattr(group, "mp_policy", None), "param_dtype", None)
        if low not in (None, torch.float32):
            raise InputError(
                f"fully_shard({name or 'model'}) has MixedPrecisionPolicy(param_dtype={low}): amppass casts the "
                "parameters itself, and the ops its plan keeps fp32 (layer norms, embeddings) must read fp32 "
                "weights; leave param_dtype unset (reduce_dtype may be set)")


def _groups(module: nn.Module) -> list[list[str]]:
    """The names of every tensor the module holds under more than one name."""
    groups: dict[int, list[str]] = {}
    for name, tensor in named_state(module):
        groups.setdefault(id(tensor), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _named_state(gm: fx.GraphModule, original: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every name of the original's state mapped to the converted module's tensor, and the persistent buffers.

    torch.export keeps one name of tied tensors; the original's other names map to the same clone. State the
    conversion added to the graph (fp8 training's amax histories, ``gm.meta[STATE_KEY]``) follows, persistent.
    """
    own = dict(named_state(gm))
    by_id: dict[int, torch.Tensor] = {}
    named = list(named_state(original))
    for name, tensor in named:
        if name in own:
            by_id.setdefault(id(tensor), own[name])
    state = {}
    for name, tensor in named:
        found = by_id.get(id(tensor))
        if found is None:  # not in the captured graph: unused by forward; a clone keeps the name
            found = by_id[id(tensor)] = _clone(tensor)
        state[name] = found
    persistent = {k for k in original.state_dict(keep_vars=True)}
    for name in gm.meta.get(STATE_KEY, ()):
        state[name] = own[name]
        persistent.add(name)
    return state, persistent


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    data = tensor.detach().clone()
    return nn.Parameter(data, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else data


def _own_state(gm: fx.GraphModule) -> None:
    """Rule 1: replace every parameter and buffer of ``gm`` by a clone, keeping tied tensors tied."""
    clones: dict[int, torch.Tensor] = {}
    for name, tensor in list(named_state(gm)):
        if id(tensor) not in clones:
            clones[id(tensor)] = _clone(tensor)
        set_state(gm, name, clones[id(tensor)])
    log.debug("train-mode module owns %d cloned tensors", len(clones))


def _is_param(root: nn.Module, name: str) -> bool:
    *path, leaf = name.split(".")
    return leaf in root.get_submodule(".".join(path))._parameters
