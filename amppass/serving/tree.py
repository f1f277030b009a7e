"""A converted train-mode model as the original's module tree, each module running its own part of the graph.

FSDP2 (``torch.distributed.fsdp.fully_shard``) swaps a module's parameters for sharded DTensors between
calls and for whole tensors in a pre-forward hook of the module it wraps; DDP and activation checkpointing
also work through module calls. A single flat graph that reads every parameter from the root never calls
the wrapped blocks, so their hooks never run and it reads sharded parameters beside whole ones. So the
converted graph is outlined the way ``torch.export.unflatten`` outlines an exported program: each module
the original model called gets the part of the graph that ran inside it (found from the nodes'
``nn_module_stack``), its parent calls it as a module, and every part reads its parameters from its own
module at call time.

Rules:

1. A node the rewrite added (a cast, a clamp) runs in the innermost module that holds all of its readers,
   so the cast of a block's weight runs inside the block, after its hooks have gathered the weight.
2. The converted graph is exported again (torch.export keeps each node's module stack) with the same
   dynamic dimensions as the capture, then unflattened; if export fixes a dimension the capture left
   dynamic, there is no tree and the flat graph runs (logged).
3. The tree has one :class:`~amppass.serving.tree_modules.TreeModule` per module of the original model, in the
   original's order and under its names; each holds the code of its part in train mode and in eval mode, and
   runs the one of the mode its root is in.
4. Each part is also an instance of its original module's class, under that class's name (as ``fully_shard``
   makes a module an ``FSDPModule`` too), with the original's plain attributes (``in_features``,
   ``padding_idx``, ``config``; never tensors, modules or anything holding them, but a dict or list holding
   tensors comes as an empty one of its kind: a cache the class's own code refills, which timm's LeViT and
   EfficientFormer read in their ``train()``). So the code users point at
   a model keeps finding what it looks for: FSDP2 and activation-checkpointing wrap policies
   (``isinstance(m, Block)``, accelerate's class names), ``model.apply(init_weights)``, containers that
   iterate as their class does. Its ``forward`` is always the part's; a class that cannot be mixed in
   (``__slots__``, a failing ``__init_subclass__``) leaves a plain part, logged.
5. A part is one module called at one place with exactly the values its code takes. A node of a parent
   that runs between two nodes of one module (a cast rule 1 placed there) runs inside that module. A module
   still called twice (a dropout applied twice in one layer), or handed other values than its code takes,
   runs inside its parent's part instead (logged; FSDP2 cannot wrap that module alone); the whole model
   runs as one graph only where the root itself is such a module. Subgraphs of higher-order ops
   (``torch.no_grad()`` regions) are held by the part that runs them.
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import logging
import warnings
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import fx, nn
from torch.export.unflatten import InterpreterModule
from torch.utils import _pytree as pytree

from ..fx.capture.export import auto_dims, size_one_dynamic, without_dtype_asserts
from ..fx.capture.guards import GUARDS_KEY
from ..fx.capture.inputs import example_call
from ..fx.capture.quiet import quiet_torch
from ..fx.rewrite.device_literals import retarget_graph
from .serving_graph import set_state
from .tree_modules import Mode, as_original

log = logging.getLogger(__name__)

STACK = "nn_module_stack"


class Outline:
    """What one mode's tree needs: the root's code and pytree specs, and each called module's code.

    ``graphs`` holds the graph each code was generated from (the root's under ""), owned by no module (so
    holding no tensor), for :meth:`retarget` to generate the code again after a device move."""

    def __init__(self, root: Callable[..., Any], in_spec: Any, out_spec: Any, parts: dict[str, Callable[..., Any]],
                 constants: dict[str, Any], inlined: dict[str, str], graphs: dict[str, fx.Graph]):
        self.root, self.in_spec, self.out_spec = root, in_spec, out_spec
        self.parts, self.constants = parts, constants
        self.inlined = inlined  # the modules whose nodes run in their parent's part, each with why (rule 5)
        self.graphs = graphs

    def retarget(self, moves: Mapping[torch.device, torch.device], tree: nn.Module) -> dict[str, Callable[..., Any]]:
        """Move every part's device literals by ``moves`` (:mod:`amppass.fx.rewrite.device_literals`); the code of
        each part that changed, by module name (the root's under "", which this outline now runs too). ``tree`` is the
        module tree the code runs in: each part's code is generated in a module over that part's attributes."""
        changed = {}
        for name, graph in self.graphs.items():
            if retarget_graph(graph, moves):
                changed[name] = type(fx.GraphModule(tree.get_submodule(name), graph)).forward  # its code, anew
                graph.owning_module = None
        self.root = changed.get("", self.root)
        self.parts.update((name, code) for name, code in changed.items() if name)
        return changed

    def outputs(self, leaves: Any) -> Any:
        """The root code's flat outputs arranged as the model returns them (a single leaf may come bare)."""
        return pytree.tree_unflatten(leaves if isinstance(leaves, (list, tuple)) else [leaves], self.out_spec)

    def flat_inputs(self, args: tuple, kwargs: dict) -> list[Any] | None:
        """The call's leaves in the root graph's order, or None if the call is laid out differently."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        return leaves if spec == self.in_spec else None


def outline(
    gm: fx.GraphModule, example: tuple[tuple, dict] | None, device: torch.device | None = None
) -> Outline | None:
    """The module tree of converted graph ``gm`` (rule 2), or None with the reason logged.

    With ``device``, state ``gm`` holds only as a stand-in (on the meta device, or sharded by FSDP2) is
    exported as an uninitialised tensor of its shape on ``device``: export reads shapes, never values."""
    guards = gm.meta.get(GUARDS_KEY)
    if example is None or guards is None:
        return None
    _place_new_nodes(gm)
    args, kwargs = example_call(example)
    plain = fx.GraphModule(gm, gm.graph)  # not the serving wrapper: export calls forward on fake inputs
    if device is not None:
        _unshard_shapes(plain, device)
    try:
        program = _export_like(plain, args, kwargs, guards)
    finally:
        gm.graph.owning_module = gm  # the copy took the graph over; it must not keep the copy (and its tensors)
    if program is None:
        return None
    _absorb_gaps(program)
    inlined: dict[str, str] = {}
    for _ in range(_MAX_UNFLATTENS):
        tree = _unflatten(program)
        if tree is None:
            return None
        misfits = _misfits(tree)
        if not misfits:
            break
        if "" in misfits:
            log.warning("the converted graph cannot run in the model's module tree (%s); it runs as one graph, so "
                        "FSDP2 can wrap only the whole model", misfits[""])
            return None
        for name, why in misfits.items():
            log.info("%s: %s; its part of the graph runs inside its parent's instead (FSDP2 cannot wrap it alone)",
                     name, why)
        inlined.update(misfits)
        _inline(program, set(misfits))
    else:
        log.warning("the converted graph could not be outlined into its modules (%s ...); it runs as one graph, so "
                    "FSDP2 can wrap only the whole model", next(iter(misfits.values())))
        return None
    parts, constants, graphs = {}, {}, {}
    for name, module in tree.named_modules(remove_duplicate=False):
        if not name or isinstance(module, fx.GraphModule):  # the root, or a subgraph of a higher-order op
            continue
        held = []
        if isinstance(module, InterpreterModule):
            held = _hold_subgraphs(module)
            if any(n.op != "placeholder" and n.op != "output" for n in module.graph.nodes):
                _unshadow_self(module.graph_module)
                parts[name] = type(module.graph_module).forward
                graphs[name] = module.graph_module.graph
        # a module not called (its nodes run in a parent's part) still holds the constants its nodes read
        constants.update((f"{name}.{attr}", value) for attr, value in itertools.chain(_tensors(module), held))
    constants.update(itertools.chain(_tensors(tree), _hold_subgraphs(tree)))
    signature = tree.module_call_graph[0].signature
    _unshadow_self(tree.graph_module)
    graphs[""] = tree.graph_module.graph
    for graph in graphs.values():  # the code runs in the tree's parts: no whole parameter stays alive here (rule 6)
        graph.owning_module = None
    return Outline(type(tree.graph_module).forward, signature.in_spec, signature.out_spec, parts, constants,
                   inlined, graphs)


# Each round inlines at least one module into its parent; a model this deep is not outlined.
_MAX_UNFLATTENS = 16
_SUBGRAPHS = itertools.count()  # unique names for the subgraphs of higher-order ops, across all outlines


def _unflatten(program: torch.export.ExportedProgram) -> nn.Module | None:
    """``torch.export.unflatten(program)``, or None with the reason logged."""
    try:
        with quiet_torch(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            # torch 2.13's unflatten prints a debug line, and copying its pytree specs trips a deprecation notice
            warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
            return torch.export.unflatten(program)
    except Exception as err:  # noqa: BLE001 - the flat graph still runs; only module hooks are lost
        log.warning("the converted graph could not be split into its modules (%s); it runs as one graph, so "
                    "FSDP2 can wrap only the whole model", err)
        return None


def _misfits(tree: nn.Module) -> dict[str, str]:
    """Rule 5: the modules of ``tree`` (by path) whose part cannot run as unflatten outlined it, each with why.

    A part must be one module called at one place (unflatten splits a module called twice into ``name@1``
    copies or a dispatcher, which the original's tree does not have), and each call must hand it exactly the
    values its code takes (unflatten's deduplication of equivalent-looking parts can break that). The
    generated code of every part is rebuilt from its graph first: unflatten edits call targets after
    generating it.
    """
    misfits: dict[str, str] = {}
    for name, module in tree.named_modules(remove_duplicate=False):
        if "@" in name:
            base = name[:name.index("@")]
            misfits.setdefault(base, "it is called more than once")
            continue
        if hasattr(module, "_call_modules"):
            misfits.setdefault(name, "it is called more than once")
            continue
        if not hasattr(module, "graph_module"):
            continue
        module.graph_module.recompile()
        called: collections.Counter[str] = collections.Counter()
        for node in module.graph.nodes:
            if node.op != "call_module":
                continue
            child = _join(name, node.target.split("@")[0])
            called[child] += 1
            try:
                target = module.get_submodule(node.target)
            except AttributeError:
                misfits.setdefault(child, "its parent's part calls a module it does not hold")
                continue
            takes = sum(n.op == "placeholder" for n in getattr(target, "graph", fx.Graph()).nodes)
            if node.kwargs or len(node.args) != takes:
                misfits.setdefault(child, f"its call hands it {len(node.args) + len(node.kwargs)} values where "
                                          f"its part takes {takes}")
        misfits.update((child, "it is called more than once") for child, n in called.items() if n > 1)
    return misfits


def _absorb_gaps(program: torch.export.ExportedProgram) -> None:
    """Rule 1 again, on the order of the nodes: a node of a parent that runs between two nodes of one module (a
    cast placed in the layer that holds all its readers, between two ops of the layer's attention) would make
    unflatten call that module twice; it runs inside the module instead, whose part hands it to the parent.
    A gap holding another module's nodes is left: that module really is called twice."""
    nodes = [n for n in program.graph.nodes if n.op not in ("placeholder", "output")]
    paths = [[value[0].split("@")[0] for value in (n.meta.get(STACK) or {}).values()] for n in nodes]
    spans: dict[str, list[int]] = {}
    for index, stack in enumerate(paths):
        for path in stack:
            spans.setdefault(path, []).append(index)
    for path, inside in sorted(spans.items(), key=lambda item: -len(item[0].split("."))):
        depth = paths[inside[0]].index(path) + 1
        gaps = sorted(set(range(inside[0], inside[-1] + 1)) - set(inside))
        if not gaps or any(paths[i] != paths[inside[0]][:len(paths[i])] or len(paths[i]) >= depth for i in gaps):
            continue
        stack = dict(itertools.islice(nodes[inside[0]].meta[STACK].items(), depth))
        for i in gaps:
            nodes[i].meta[STACK] = dict(stack)
            paths[i] = paths[inside[0]][:depth]


def _inline(program: torch.export.ExportedProgram, paths: set[str]) -> None:
    """Take the modules at ``paths`` (and their submodules) out of the module stacks of ``program``'s nodes, so
    the next unflatten runs their nodes in their parents' parts."""
    def kept(path: str) -> bool:
        path = ".".join(part.split("@")[0] for part in path.split("."))
        return not any(path == p or path.startswith(p + ".") for p in paths)

    for node in program.graph.nodes:
        stack = node.meta.get(STACK)
        if stack:
            node.meta[STACK] = {key: value for key, value in stack.items() if kept(value[0])}


def _hold_subgraphs(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The subgraphs of higher-order ops (``wrap_with_set_grad_enabled``, ``cond``) that ``module``'s part
    reads, renamed uniquely: the tree's part holds them as constants, as it holds the graph's tensors."""
    held = []
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(module, node.target, None)
        if isinstance(value, fx.GraphModule) and "." not in node.target:
            node.target = f"{node.target}_amppass{next(_SUBGRAPHS)}"
            held.append((node.target, value))
    if held:
        module.graph_module.recompile()
    return held


def _unshard_shapes(gm: fx.GraphModule, device: torch.device) -> None:
    """Give ``gm`` an uninitialised tensor of each meta or sharded tensor's whole shape (:func:`outline`)."""
    for name, tensor in list(named_state(gm)):
        if tensor.is_meta or sharded(tensor):
            set_state(gm, name, stand_in(tensor, device))


def stand_in(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of ``tensor``'s whole shape and dtype on ``device`` (on the meta device it holds
    no memory), a parameter where ``tensor`` is one."""
    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def named_state(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` under each of its names (tied ones under every name)."""
    return itertools.chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )


def sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (FSDP2's sharded parameters between calls)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors an unflattened module holds besides parameters: its buffers (the original's, and constants
    the rewrite made, which export lifts to buffers) and plain tensor attributes."""
    for attr, value in itertools.chain(vars(module).items(), module._buffers.items()):
        if isinstance(value, torch.Tensor) and attr not in module._parameters:
            yield attr, value


def _unshadow_self(gm: fx.GraphModule) -> None:
    """Rename the values named ``self`` in ``gm``'s code. A submodule called ``self`` (transformers'
    ``BertAttention.self``, in every BERT-like model) names its call's result ``self`` in the unflattened
    parent, whose generated ``forward(self, ...)`` then rebinds ``self`` to that tensor and fails on its next
    submodule call. The code is called positionally, so a renamed placeholder changes no call."""
    clashing = [node for node in gm.graph.nodes if node.name == "self" or (node.op == "placeholder"
                                                                            and node.target == "self")]
    for node in clashing:
        node._rename("self_value")
        if node.op == "placeholder":
            node.target = node.name
    if clashing:
        gm.recompile()


def _place_new_nodes(gm: fx.GraphModule) -> None:
    """Rule 1: a node without a module stack runs in the innermost module holding all its readers."""
    outermost = next(({key: value} for n in gm.graph.nodes for key, value in (n.meta.get(STACK) or {}).items()
                      if value[0] == ""), {})
    for node in reversed(gm.graph.nodes):
        if node.op in ("placeholder", "output", "get_attr") or node.meta.get(STACK):
            continue
        node.meta[STACK] = _common([user.meta.get(STACK) or outermost for user in node.users] or [outermost])


def _common(stacks: list[dict[str, Any]]) -> dict[str, Any]:
    """The longest shared prefix of several module stacks (ordered dicts, outermost first)."""
    shared = list(stacks[0].items())
    for stack in stacks[1:]:
        items = list(stack.items())
        n = 0
        while n < min(len(shared), len(items)) and shared[n] == items[n]:
            n += 1
        shared = shared[:n]
    return dict(shared)


def _export_like(gm: fx.GraphModule, args: tuple, kwargs: dict, guards: Any) -> torch.export.ExportedProgram | None:
    """Export ``gm`` with every dimension dynamic that the capture left dynamic (rule 2)."""
    dims = auto_dims(gm, args, kwargs)
    last: Exception | None = None
    for oblivious in (True, False):
        try:
            with size_one_dynamic(oblivious), quiet_torch():
                program = torch.export.export(gm, args, kwargs, dynamic_shapes=dims, strict=False)
        except Exception as err:  # noqa: BLE001 - tried again without size-1 dims dynamic, then reported
            last = err
            continue
        if _same_dynamism(program, guards):
            without_dtype_asserts(program.graph_module)
            return program
    log.warning("the converted graph could not be exported again with the capture's dynamic dimensions (%s); "
                "it runs as one graph, so FSDP2 can wrap only the whole model", last or "a dimension became fixed")
    return None


def _same_dynamism(program: torch.export.ExportedProgram, guards: Any) -> bool:
    """Whether every dimension the capture kept dynamic is dynamic in ``program`` too.

    Tensor inputs are compared in order; other inputs (``use_cache=False``) export may bake in as constants."""
    names = set(program.graph_signature.user_inputs)
    values = [v for n in program.graph.nodes if n.op == "placeholder" and n.name in names
              if isinstance(v := n.meta.get("val"), torch.Tensor)]
    specs = [spec for spec in guards.inputs if spec.dtype is not None]
    if len(values) != len(specs):
        return False
    for spec, value in zip(specs, values, strict=False):
        if value.dim() != len(spec.dims):
            return False
        for wanted, size in zip(spec.dims, value.shape, strict=False):
            if isinstance(wanted, str) and not isinstance(size, torch.SymInt):
                return False
    return True


def build_tree(root: nn.Module, original: nn.Module, mode: Mode, outlines: dict[bool, Outline],
               state: dict[str, torch.Tensor], persistent: set[str]) -> None:
    """Give ``root`` the original's module tree (rule 3): a :class:`~amppass.serving.tree_modules.TreeModule` per
    module, each holding the tensors of ``state`` under the original's names (tied names share one tensor) and its
    part of each graph.

    Args:
        root: the converted module; it becomes the tree's root.
        original: the caller's model, read for its structure and names only.
        mode: the mode object every part reads.
        outlines: the tree of each mode's graph, by ``training`` flag.
        state: every parameter and buffer the converted model owns, by each name it has in the original; a name
            the original does not have (state the conversion added) is a buffer of the module its prefix names.
        persistent: the buffer names that go into ``state_dict()``.
    """
    tree_modules: dict[str, nn.Module] = {"": root}
    for name, module in original.named_modules(remove_duplicate=False):
        if not name:
            continue
        parent, _, leaf = name.rpartition(".")
        tree_module = as_original(module, mode, name)
        # not add_module: its hasattr check meets a class's own __getattr__ (peft's wrappers) on a part that
        # never ran that class's __init__
        tree_modules[parent]._modules[leaf] = tree_module
        tree_modules[name] = tree_module
    placed = set()
    for name, module in original.named_modules(remove_duplicate=False):
        owner = tree_modules[name]
        for leaf, param in module._parameters.items():
            if param is not None:
                owner.register_parameter(leaf, state[_join(name, leaf)])
                placed.add(_join(name, leaf))
        for leaf, buf in module._buffers.items():
            if buf is not None:
                full = _join(name, leaf)
                owner.register_buffer(leaf, state[full], persistent=full in persistent)
                placed.add(full)
    for full in sorted(state.keys() - placed):
        owner_name, _, leaf = full.rpartition(".")
        tree_modules[owner_name].register_buffer(leaf, state[full], persistent=full in persistent)
    for training, found in outlines.items():
        install(root, training, found)  # unfit() checked that both modes' constants agree


def install(root: nn.Module, key: Any, found: Outline) -> str | None:
    """Give every part of ``root``'s tree its code of ``found`` under ``key``, and the constants that code reads
    (the original's buffers are the tree's already); or say why not, installing nothing, where a constant
    differs from the one the tree holds under its name."""
    state = {name for name, _ in named_state(root)}
    constants = [(name.rpartition("."), value) for name, value in found.constants.items() if name not in state]
    for (owner, _, leaf), value in constants:
        held = vars(root.get_submodule(owner)).get(leaf)
        if held is not None and not _same(held, value):
            return f"its constant {owner}.{leaf} differs from the one the tree holds"
    for name, code in found.parts.items():
        root.get_submodule(name)._code[key] = code
    for (owner, _, leaf), value in constants:
        root.get_submodule(owner).__dict__.setdefault(leaf, value)
    return None


def _same(a: Any, b: Any) -> bool:
    """Whether two constants of the graphs are the same (subgraphs only when they are one object)."""
    if a is b:
        return True
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)


def unfit(original: nn.Module, outlines: dict[bool, Outline | None]) -> str | None:
    """Why the outlined graphs cannot run in the original's module tree, or None when they can."""
    if any(found is None for found in outlines.values()):
        return "a graph could not be outlined (logged above)"
    names = {name for name, _ in original.named_modules(remove_duplicate=False)}
    buffers = {name for name, _ in original.named_buffers(remove_duplicate=False)}
    constants: dict[str, Any] = {}
    for found in outlines.values():
        strangers = sorted({n for n in found.parts if n not in names} |
                           {n.rpartition(".")[0] for n in found.constants if n.rpartition(".")[0] not in names})
        if strangers:
            return f"the graph calls modules the original does not name ({', '.join(strangers[:3])})"
        for name, value in found.constants.items():
            if name in buffers:
                continue
            if not _same(constants.setdefault(name, value), value):
                return f"the train and eval graphs hold different constants named {name}"
    return None


def _join(prefix: str, leaf: str) -> str:
    return f"{prefix}.{leaf}" if prefix else leaf
