"""Tolerance-search runs of an FX graph that start where the trial graph first differs from the fp32 graph.

The checkpoint rules of :mod:`amppass.analysis.checkpoints` (placement, budget, which checkpoint a trial
resumes from) hold here with a checkpoint named by its node. What is the FX front end's:

1. Placement: the candidates are the search's, in graph order, less rule 4's nodes. While calibration's
   interpreter (:mod:`amppass.fx.runners.calibrate`) reaches a checkpoint on a kept batch, the values live
   there are the ones in its environment (computed before the node and read by it or after it: the
   interpreter has freed every other one), kept by tensor: a tensor once for all the checkpoints it crosses.
   A checkpoint the budget refuses is left out for that batch; later ones may still fit.
2. A trial's nodes are unchanged up to the first whose signature differs from the fp32 graph's node of the
   same name (op, arguments, and weights of the same dtype). The trial then runs from the cut: a graph of the
   nodes from there on, fed the batch's inputs and the kept values.
3. The result is the whole trial's, to the bit: the values fed are the ones the fp32 nodes computed.
4. No checkpoint lies after a value of an aliasing group (:mod:`amppass.fx.prepare.aliasing`) and at or before a
   write into that group: a kept value is the tensor itself, which the rest of the fp32 run goes on writing,
   so a run from there would apply the writes twice (``h.div_(s)`` divided again).
"""

from __future__ import annotations

from typing import Any, Hashable

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...analysis import checkpoints
from ..prepare.aliasing import alias_groups
from ..view.build import fetch_attr

_FREE = ("placeholder", "get_attr", "output")  # nodes that compute nothing


class Checkpoints(checkpoints.Checkpoints[str]):
    """The fp32 values live at the checkpoints of one graph, per kept batch (module docstring)."""

    def __init__(self, gm: fx.GraphModule, candidates: set[str]):
        within = _within_writes(gm)
        super().__init__(checkpoints.place(
            [n.name for n in gm.graph.nodes if n.name in candidates and n.name not in within]))
        self.signatures = {n.name: _signature(gm, n) for n in gm.graph.nodes if n.op not in _FREE}

    def record(self, batch: int, checkpoint: str, env: dict[fx.Node, Any]) -> None:
        """Keep the values live in an interpreter's ``env`` as it reaches ``checkpoint`` on kept ``batch``."""
        live = {node.name: value for node, value in env.items() if node.op not in _FREE}
        sizes: dict[Hashable, int] = {id(t): t.numel() * t.element_size()
                                      for t in pytree.tree_leaves(list(live.values())) if isinstance(t, torch.Tensor)}
        self.keep(batch, checkpoint, live, sizes)

    def run(self, trial: fx.GraphModule, batches: list[tuple[int, tuple, dict, list]]) -> list[Any]:
        """The outputs of ``trial`` on each ``(kept batch, args, kwargs, flat inputs)``, run from the checkpoint
        it resumes from where it has one."""
        computing = [n for n in trial.graph.nodes if n.op not in _FREE]
        cut = self.cut((self.signatures.get(n.name) == _signature(trial, n) for n in computing),
                       {n.name: i for i, n in enumerate(computing)})
        suffixes: dict[str, tuple[fx.GraphModule, list[str], int]] = {}
        outputs = []
        for batch, args, kwargs, flat in batches:
            start = self.resume(batch, cut)
            if start is None:
                outputs.append(trial(*args, **kwargs))
                self.count(0, len(computing))
                continue
            kept = self.values[batch][start]
            if start not in suffixes:
                suffixes[start] = _suffix(trial, start, list(kept))
            suffix, fed, skipped = suffixes[start]
            outputs.append(suffix(*flat, *(kept[name] for name in fed)))
            self.count(skipped, len(computing))
        return outputs


def _within_writes(gm: fx.GraphModule) -> set[str]:
    """Rule 4: the nodes after a member of an aliasing group and up to its last write in place."""
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    groups = alias_groups(gm)
    spans = [(min(position[n] for n in members), max(position[w] for w in groups.writes if w in members))
             for members in (set(m) for m in groups.members)]
    return {node.name for node, i in position.items() if any(first < i <= last for first, last in spans)}


def _suffix(trial: fx.GraphModule, start: str, live: list[str]) -> tuple[fx.GraphModule, list[str], int]:
    """The trial from node ``start`` on, taking the graph's inputs then the ``live`` values it reads; the
    names fed (in order) and the number of computing nodes left out."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    nodes = list(trial.graph.nodes)
    for node in nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
    read = {a.name for node in nodes[[n.name for n in nodes].index(start):] for a in node.all_input_nodes}
    fed = [name for name in live if name in read]
    values = {name: graph.placeholder(f"{name}__fp32") for name in fed}
    before, skipped = True, 0
    for node in nodes:
        before = before and node.name != start
        if node.op == "placeholder":
            continue
        if before and node.op != "get_attr":
            skipped += 1
            if node.name in values:
                env[node] = values[node.name]
            continue
        env[node] = graph.node_copy(node, env.__getitem__)
    return fx.GraphModule(trial, graph), fed, skipped


def _signature(gm: fx.GraphModule, node: fx.Node) -> tuple:
    """What a node computes from what, comparable across a graph and its rewritten copies: its op and
    arguments, a node argument by name, a weight by name and dtype."""

    def key(arg: Any) -> Any:
        if not isinstance(arg, fx.Node):
            return arg
        if arg.op == "get_attr":
            value = fetch_attr(gm, str(arg.target))
            return ("weight", str(arg.target), getattr(value, "dtype", None))
        return ("node", arg.name)

    state: tuple[tuple[str, Any], ...] = ()
    if node.op == "call_module":  # a module whose weights the rewrite converted computes something else
        module = gm.get_submodule(str(node.target))
        state = tuple((name, t.dtype) for name, t in list(module.named_parameters()) + list(module.named_buffers()))
    return node.op, node.target, pytree.tree_map(key, node.args), pytree.tree_map(key, node.kwargs), state
