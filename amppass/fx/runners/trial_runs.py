"""Tolerance-search runs that start where the trial graph first differs from the fp32 graph.

Every run of the tolerance search rewrites the fp32 graph by a trial plan and runs it on the kept
calibration batches. Up to the first node the trial changes (the first node run in low precision, or a
cast or low-precision weight it reads) the trial computes exactly what the fp32 graph computed on the same
batch during calibration: that fp32 prefix need not run again. Rules:

1. Checkpoints: at most :data:`~amppass.analysis.calibration.CHECKPOINTS` nodes of the graph, spread evenly
   over the search's candidates in graph order. While calibration runs a batch, the values live at each
   checkpoint (computed before it and read by it or after it; the interpreter has freed every other one) are
   kept for that batch, the same tensor once for all the checkpoints it crosses, within
   :data:`~amppass.analysis.calibration.CACHE_BYTES` over all batches (later checkpoints of a batch that
   would pass it are not kept).
2. A trial's cut is the last checkpoint before which every node of the trial graph is the fp32 graph's own
   node (same name, op, arguments, and weights of the same dtype). The trial then runs from the cut: a
   graph of the nodes from there on, fed the batch's inputs and the kept values; a batch without that
   checkpoint uses its latest one before it, or the whole trial.
3. The result is the whole trial's, to the bit: the values fed are the ones the fp32 nodes computed.
4. No checkpoint lies after a value of an aliasing group (:mod:`amppass.fx.prepare.aliasing`) and at or before a
   write into that group: a kept value is the tensor itself, which the rest of the fp32 run goes on writing,
   so a run from there would apply the writes twice (``h.div_(s)`` divided again).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ...analysis.calibration import CACHE_BYTES, CHECKPOINTS
from ..prepare.aliasing import alias_groups
from ..view.build import fetch_attr

log = logging.getLogger(__name__)

_FREE = ("placeholder", "get_attr", "output")  # nodes that compute nothing


class Checkpoints:
    """The fp32 values live at the checkpoints of one graph, per kept batch (module docstring, rule 1)."""

    def __init__(self, gm: fx.GraphModule, candidates: set[str]):
        within = _within_writes(gm)
        ordered = [n.name for n in gm.graph.nodes if n.name in candidates and n.name not in within]
        step = max(1, len(ordered) // CHECKPOINTS)
        self.order = {name: i for i, name in enumerate(ordered[step // 2::step][:CHECKPOINTS])}
        self.signatures = {n.name: _signature(gm, n) for n in gm.graph.nodes if n.op not in _FREE}
        self.values: dict[int, dict[str, dict[str, Any]]] = {}  # batch -> checkpoint -> value name -> value
        self.bytes = 0
        self.nodes_skipped = 0
        self.nodes_run = 0
        self._held: dict[int, set[int]] = {}  # batch -> ids of the tensors kept for it

    def record(self, batch: int, checkpoint: str, env: dict[fx.Node, Any]) -> None:
        """Keep the values live in an interpreter's ``env`` as it reaches ``checkpoint`` on kept ``batch``."""
        live = {node.name: value for node, value in env.items() if node.op not in _FREE}
        held = self._held.setdefault(batch, set())
        fresh = {id(t): t.numel() * t.element_size() for t in pytree.tree_leaves(list(live.values()))
                 if isinstance(t, torch.Tensor) and id(t) not in held}
        if self.bytes + sum(fresh.values()) > CACHE_BYTES:
            return
        self.bytes += sum(fresh.values())
        held.update(fresh)
        self.values.setdefault(batch, {})[checkpoint] = live

    def run(self, trial: fx.GraphModule, batches: list[tuple[int, tuple, dict, list]]) -> list[Any]:
        """The outputs of ``trial`` (their floating leaves in the graph's order) on each ``(kept batch, args,
        kwargs, flat inputs)``, run from its cut where it has one."""
        cut = self.cut(trial)
        total = sum(n.op not in _FREE for n in trial.graph.nodes)
        suffixes: dict[str, tuple[fx.GraphModule, list[str], int]] = {}
        outputs = []
        for batch, args, kwargs, flat in batches:
            kept = self.values.get(batch, {})
            usable = [c for c in kept if cut is not None and self.order[c] <= self.order[cut]]
            if not usable:
                outputs.append(trial(*args, **kwargs))
                self.nodes_run += total
                continue
            start = max(usable, key=self.order.__getitem__)
            if start not in suffixes:
                suffixes[start] = _suffix(trial, start, list(kept[start]))
            suffix, fed, skipped = suffixes[start]
            outputs.append(suffix(*flat, *(kept[start][name] for name in fed)))
            self.nodes_skipped += skipped
            self.nodes_run += total - skipped
        return outputs

    def cut(self, trial: fx.GraphModule) -> str | None:
        """Rule 2: the last checkpoint the trial graph reaches unchanged, or None."""
        found = None
        for node in trial.graph.nodes:
            if node.op in _FREE:
                continue
            if node.name in self.order:
                found = node.name
            if self.signatures.get(node.name) != _signature(trial, node):
                break
        return found


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

    state = ()
    if node.op == "call_module":  # a module whose weights the rewrite converted computes something else
        module = gm.get_submodule(str(node.target))
        state = tuple((name, t.dtype) for name, t in list(module.named_parameters()) + list(module.named_buffers()))
    return node.op, node.target, pytree.tree_map(key, node.args), pytree.tree_map(key, node.kwargs), state
