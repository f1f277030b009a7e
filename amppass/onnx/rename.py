"""Giving an ONNX model's graph outputs public names (the names consumers bind outputs by).

Exporters name a graph output after the node that made it (``layer_norm_12``, ``tanh``); a consumer such as
optimum's ``ORTModelForFeatureExtraction`` reads the output named ``last_hidden_state``. An ONNX value has one
name everywhere it is written (the producing node's output, every reader's input, ``value_info``, the graph
output, and the inputs of If/Loop/Scan bodies that capture it from the outer scope), so a rename rewrites all
of them together. Rules:

1. An output whose value is a graph input or an initializer, or that an earlier output already names (a model
   returning the same tensor twice), keeps that value and gets an ``Identity`` node whose output carries the
   public name: an input's name is public too, and one value cannot hold two names.
2. Any other value already called by a name being given out (an inner node's output, another output that is
   being renamed) moves to a fresh name first, so renames that swap or reuse names never collide.
3. Names of graph inputs are never changed: a public output name that is an input's name is refused
   (``ValueError``; the caller says what to do).

The model is changed in place; :func:`rename_outputs` returns whether anything changed.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import onnx
from onnx import helper

from .rewrite import all_names, unique_name
from .view import subgraphs


def rename_outputs(model: onnx.ModelProto, names: Sequence[str]) -> bool:
    """Name the main graph's outputs ``names``, in order (one name per output)."""
    graph = model.graph
    if len(names) != len(graph.output):
        raise ValueError(f"{len(names)} names for {len(graph.output)} outputs")
    if len(set(names)) != len(names):
        raise ValueError(f"output names repeat: {list(names)}")
    inputs = {i.name for i in graph.input}
    clash = sorted(set(names) & inputs - {o.name for o, n in zip(graph.output, names, strict=False) if o.name == n})
    if clash:
        raise ValueError(f"{clash} name inputs of the model")
    if all(out.name == name for out, name in zip(graph.output, names, strict=False)):
        return False
    taken = all_names(model) | set(names) | {o.name for o in graph.output}
    _identities(model, names, taken)  # rule 1
    # rule 2: every value holding a name being given out moves aside, then each output takes its name
    wanted = [
        (index, name) for index, (out, name) in enumerate(zip(graph.output, names, strict=False)) if out.name != name
    ]
    aside = {old: unique_name(taken, f"{old}_renamed") for old in _values(model) & {name for _, name in wanted}}
    _apply(model, aside)
    _apply(model, {graph.output[index].name: name for index, name in wanted})
    return True


def _values(model: onnx.ModelProto) -> set[str]:
    """The name of every value of the model, its bodies included (node names are another namespace)."""
    names: set[str] = set()
    for graph in _graphs(model.graph):
        names.update(i.name for i in (*graph.input, *graph.initializer, *graph.output))
        for node in graph.node:
            names.update(node.output)
    return names


def _identities(model: onnx.ModelProto, names: Sequence[str], taken: set[str]) -> None:
    """Rule 1: an Identity for each output that cannot be renamed where its value is made."""
    graph = model.graph
    fixed = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    seen: set[str] = set()
    for out, name in zip(graph.output, names, strict=False):
        if (out.name in fixed and out.name != name) or out.name in seen:
            temporary = unique_name(taken, f"{name}_identity")
            graph.node.append(helper.make_node("Identity", [out.name], [temporary],
                                               name=unique_name(taken, f"{name}_identity")))
            out.name = temporary  # rule 2 then names it
        seen.add(out.name)


def _apply(model: onnx.ModelProto, mapping: Mapping[str, str]) -> None:
    """Rename values by ``mapping`` wherever they are written, bodies included."""
    if not mapping:
        return
    for graph in _graphs(model.graph):
        for node in graph.node:
            node.input[:] = [mapping.get(n, n) for n in node.input]
            node.output[:] = [mapping.get(n, n) for n in node.output]
        for info in (*graph.input, *graph.initializer, *graph.value_info, *graph.output):
            info.name = mapping.get(info.name, info.name)  # the main graph's inputs are never mapped (rule 3)


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every body below it."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _graphs(sub)
