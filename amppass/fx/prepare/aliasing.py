"""Aliasing groups: values that share storage with a value the graph writes in place.

A model that fills a buffer through views (``k = q.new_empty(...)``; ``k[..., :8] = a``; ``k[..., 8:] = b``,
captured as ``aten.new_empty``, ``aten.slice``, ``aten.copy_``) reads the buffer later, not the result of
each write. A cast between a write and a read is a *copy*: a write through a cast copy never reaches the
buffer, and a read through a cast made before the write misses it. So every value that shares storage with
a value written in place is one aliasing group, which runs in one precision with no cast between its members
(:func:`amppass.analysis.painting.paint`, rule 9), and a cast of a group member read outside the group is
made after the last write before that read (:mod:`amppass.fx.rewrite.apply`, rule 10).

Rules:

1. Which op writes which argument, and which output shares storage with which argument, comes from the ATen
   schema's alias annotations (``Tensor(a!) self``: written; ``-> Tensor(a)``: a view of the argument in set
   ``a``), never from a list of op names. A tensor method of a symbolically traced graph is read from the
   schemas of its ATen packet (every overload that takes ``self`` must agree).
2. Python-level writes a symbolic trace keeps as they are: ``__setitem__`` (``k[..., :8] = a``) writes its
   first argument; a call with ``inplace=True`` (``F.relu(x, inplace=True)``, a module built with
   ``inplace=True``) writes its first input. Indexing a tensor (``operator.getitem``) may return a view, so it
   joins the group.
3. A group matters only when some member is written: groups of views that are never written are ordinary
   values, cast freely.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx


@dataclass
class AliasGroups:
    """The aliasing groups of a graph that hold an in-place write (rule 3)."""

    # node -> index of its group in ``members``
    group_of: dict[fx.Node, int] = field(default_factory=dict)
    # each group's nodes, in graph order
    members: list[list[fx.Node]] = field(default_factory=list)
    # nodes that write in place, each with the member it writes
    writes: dict[fx.Node, fx.Node] = field(default_factory=dict)

    def group(self, node: fx.Node) -> list[fx.Node]:
        """The members of ``node``'s group; [] for a node in none."""
        index = self.group_of.get(node)
        return self.members[index] if index is not None else []

    def written(self, node: fx.Node) -> bool:
        """Whether ``node`` is in a group that some node writes in place."""
        return node in self.group_of


def alias_groups(gm: fx.GraphModule) -> AliasGroups:
    """The aliasing groups of ``gm`` that some node writes in place (module docstring)."""
    parent: dict[fx.Node, fx.Node] = {}

    def find(node: fx.Node) -> fx.Node:
        while parent.get(node, node) is not node:
            parent[node] = parent.get(parent[node], parent[node])
            node = parent[node]
        return node

    def union(a: fx.Node, b: fx.Node) -> None:
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        root_a, root_b = find(a), find(b)
        if root_a is not root_b:
            parent[root_a] = root_b

    writes: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        written, aliased = _effects(node, gm)
        for arg in aliased:
            union(node, arg)
        if written is not None:
            union(node, written)
            writes[node] = written
    groups = AliasGroups(writes=writes)
    roots: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node not in parent:
            continue
        root = find(node)
        if root not in roots:
            roots[root] = len(groups.members)
            groups.members.append([])
        groups.group_of[node] = roots[root]
        groups.members[roots[root]].append(node)
    touched = {groups.group_of[n] for n in writes}
    kept = [i for i in range(len(groups.members)) if i in touched]
    renumber = {old: new for new, old in enumerate(kept)}
    groups.members = [groups.members[i] for i in kept]
    groups.group_of = {n: renumber[i] for n, i in groups.group_of.items() if i in renumber}
    return groups


def writes_an_input(gm: fx.GraphModule) -> bool:
    """Whether the graph writes into one of its inputs (a placeholder in an aliasing group): running it on the
    caller's tensors would change them."""
    written = {n for members in alias_groups(gm).members for n in members}
    return any(n.op == "placeholder" and n in written for n in gm.graph.nodes)


def _effects(node: fx.Node, gm: fx.GraphModule) -> tuple[fx.Node | None, list[fx.Node]]:
    """(the argument ``node`` writes in place or None, the arguments its output shares storage with)."""
    target = node.target
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
        return _from_schema(node, target._schema)
    if (node.op, target) in (("call_function", operator.setitem), ("call_method", "__setitem__")):
        return first, []
    if node.op == "call_function" and target is operator.getitem:
        # an element of a multi-output view (split, unbind) or an index of a tensor: may share its storage
        return None, [first] if first is not None else []
    if node.op == "call_method":
        schemas = _method_schemas(str(target))
        if schemas:
            effects = {_schema_effect(s) for s in schemas}
            if len(effects) == 1:
                writes, views = effects.pop()
                return (first if writes else None), ([first] if views and first is not None else [])
            # overloads disagree: the conservative reading, written and a view
            return first, [first] if first is not None else []
    if node.op == "call_module":
        return (first if getattr(gm.get_submodule(str(target)), "inplace", False) is True else None), []
    if node.kwargs.get("inplace") is True:
        return first, []
    return None, []


def _from_schema(node: fx.Node, schema: Any) -> tuple[fx.Node | None, list[fx.Node]]:
    """Rule 1 for an ATen overload: its written argument and the arguments its output aliases."""
    written: fx.Node | None = None
    aliased: list[fx.Node] = []
    returned: set[str] = set()
    listed = False  # a list of views (split, unbind) names no alias set on the list itself
    for ret in schema.returns:
        if ret.alias_info is not None:
            returned |= set(ret.alias_info.before_set)
            listed |= not ret.alias_info.before_set
    for index, argument in enumerate(schema.arguments):
        info = argument.alias_info
        if info is None:
            continue
        value = node.kwargs.get(argument.name) if argument.kwarg_only or index >= len(node.args) else node.args[index]
        values = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, fx.Node)]
        if not values:
            continue
        if info.is_write:
            written = written or values[0]
        if listed or returned & set(info.before_set):
            aliased.extend(values)
    return written, aliased


def _method_schemas(name: str) -> list[Any]:
    """The schemas of the ATen packet a tensor method stands for: the overloads that take a tensor ``self``
    first and write no other argument (a method call never reaches an ``out=`` variant)."""
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return []
    schemas = []
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if not schema.arguments or schema.arguments[0].name != "self" or not isinstance(
                schema.arguments[0].type, torch.TensorType):
            continue
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments[1:]):
            continue
        schemas.append(schema)
    return schemas


def _schema_effect(schema: Any) -> tuple[bool, bool]:
    """(writes ``self``, returns a view of ``self``) for one schema."""
    info = schema.arguments[0].alias_info
    if info is None:
        return False, False
    views = any(r.alias_info is not None and (set(r.alias_info.before_set) & set(info.before_set)
                                              or not r.alias_info.before_set)
                for r in schema.returns)
    return bool(info.is_write), views


def functional_writes(gm: fx.GraphModule) -> list[str]:
    """Rewrite each in-place write to a value nothing else aliases into its out-of-place op; return the names
    of the writes rewritten.

    A train graph runs eagerly under autograd, and an in-place write to a value an op saved for its backward
    fails there (DeBERTa-style masked softmax, ``probs.masked_fill_(mask, 0)``, which the model wraps in its
    own ``autograd.Function`` and torch.export inlines). Where the written value is an intermediate result (not
    an input, a weight or a buffer) and its aliasing group holds no view of it taken before the write and no
    other write, the write becomes the out-of-place overload of the same op and every later reader of the
    value reads its result: the same values forward, and a backward autograd can run. Views taken after the
    write view the result.
    """
    groups = alias_groups(gm)
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    rewritten = []
    for node, written in list(groups.writes.items()):
        pure = _out_of_place(node)
        members = groups.group(node)
        alone = sum(m in groups.writes for m in members) == 1 and all(
            order[m] >= order[node] for m in members if m is not written)  # views only of the written value
        if pure is None or written.op != "call_function" or not alone:
            continue
        with gm.graph.inserting_after(node):
            replacement = gm.graph.call_function(pure, node.args, node.kwargs)
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        for user in list(written.users):
            if user is not replacement and order.get(user, len(order)) > order[node]:
                user.replace_input_with(written, replacement)
        gm.graph.erase_node(node)
        replacement.name = node.name
        rewritten.append(node.name)
    if rewritten:
        gm.recompile()
    return rewritten


def _out_of_place(node: fx.Node) -> torch._ops.OpOverload | None:
    """The out-of-place overload of an in-place ATen op (``masked_fill_.Scalar`` -> ``masked_fill.Scalar``)
    taking the same arguments, or None."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None) if packet is not None else None
    if not isinstance(overload, torch._ops.OpOverload):
        return None
    same = [a.name for a in overload._schema.arguments] == [a.name for a in target._schema.arguments]
    return overload if same else None
