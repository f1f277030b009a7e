"""Structural checks of an ONNX model from an untrusted file, before the conversion walks it.

1. Nesting: If/Loop/Scan bodies nested deeper than :data:`MAX_NESTING` are refused. The check itself walks
   the model with an explicit stack, so a model nested thousands deep fails with an
   :class:`~amppass.errors.InputError`, never a ``RecursionError``.
2. Tensors: negative dimensions, typed data fields whose length disagrees with the shape, and external-data
   locations outside the model's folder (:func:`amppass.onnx.io.external_data.check_location`) are refused.
3. Single assignment: a value defined twice in one graph (two nodes writing it, or a node writing a graph
   input or initializer) is refused: the converted model would be invalid.
4. Order: nodes must read only values defined before them (graph inputs, initializers, earlier nodes, the
   enclosing graphs' values for a body). A graph that is merely out of order is sorted on the conversion's
   private copy; one with a cycle is refused, naming a node on it.
5. Dynamic dimensions written as ``dim_value: -1`` (Paddle, some TF exports) become unknown dimensions on the
   private copy, so shape inference treats them as dynamic instead of as a size that contradicts the others.
6. On request (:func:`check_with_onnx`), ``onnx.checker`` itself, run on a stand-in of the conversion's
   skeleton whose tensors point at one empty file: the checker's schema and graph checks without reading,
   copying or serialising any weight.
7. Size: a model holds at most :data:`MAX_NODES` nodes, and at most as many initializers, counted over every
   graph, body and local function (:func:`check_size`). The largest models exported to ONNX hold about
   50,000 to 200,000 nodes (LLMs with every layer unrolled); each node costs the conversion about 3.5 KB and
   0.1 ms (a 1,000,000-node chain took 3.5 GB and 120 s), so the cap, 2.5 times the largest real graph,
   bounds a hostile file at about 2 GB and a minute. A file is counted while it is read
   (:mod:`amppass.onnx.io.lazy_read` stops at the cap, before protobuf builds the rest); a proto given in memory
   before anything walks it. ``AMPPASS_MAX_NODES`` (environment) raises or lowers the cap.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections import deque
from typing import Iterator

import onnx
from onnx import TensorProto

from ...errors import InputError
from ...limits import env_cap
from ..view import replace_nodes, subgraphs, tensors
from .external_data import check_location

MAX_NESTING = 48
MAX_NODES = 500_000  # rule 7: nodes, and separately initializers, of a model over all its graphs
ENV_MAX_NODES = "AMPPASS_MAX_NODES"  # the environment variable that sets another cap

# element type -> the repeated field that holds its values when raw_data is not used (one entry per element)
_TYPED_FIELDS: dict[int, str] = {
    TensorProto.FLOAT: "float_data", TensorProto.DOUBLE: "double_data", TensorProto.INT64: "int64_data",
    TensorProto.UINT32: "uint64_data", TensorProto.UINT64: "uint64_data", TensorProto.INT32: "int32_data",
    TensorProto.INT16: "int32_data", TensorProto.INT8: "int32_data", TensorProto.UINT16: "int32_data",
    TensorProto.UINT8: "int32_data", TensorProto.BOOL: "int32_data", TensorProto.FLOAT16: "int32_data",
    TensorProto.BFLOAT16: "int32_data", TensorProto.STRING: "string_data",
}


def check_nesting(model: onnx.ModelProto, where: str) -> None:
    """Rule 1."""
    stack = [(model.graph, 0)]
    while stack:
        graph, depth = stack.pop()
        if depth > MAX_NESTING:
            raise InputError(f"{where}: If/Loop/Scan bodies are nested more than {MAX_NESTING} deep; no exporter "
                             "writes such a model, so the file is damaged or malicious. Re-export the model")
        for node in graph.node:
            for body in subgraphs(node):
                stack.append((body, depth + 1))


def node_limit() -> int:
    """Rule 7's cap: ``$AMPPASS_MAX_NODES`` when set, else :data:`MAX_NODES`."""
    return env_cap(ENV_MAX_NODES, MAX_NODES, "the most nodes a model may hold", 2_000_000)


def too_large(where: str, what: str, count: int, limit: int, exact: bool = True) -> InputError:
    """Rule 7's error: ``where`` holds ``count`` ``what`` (nodes or initializers), more than ``limit``; at least
    ``count`` where the reader stopped counting there (``exact`` False)."""
    held = f"{count:,}" if exact else f"at least {count:,}"
    raised = -(-max(count, limit + 1) // 1_000_000) * 1_000_000  # a round number above what was counted
    return InputError(f"{where} holds {held} {what}, and amppass reads a model of at most {limit:,} (the largest "
                      f"exported models hold about 200,000 nodes; a file far over that is damaged or made to exhaust "
                      f"memory). If the model is real, raise the cap: set the environment variable {ENV_MAX_NODES} "
                      f"(e.g. {ENV_MAX_NODES}={raised}) or amppass.onnx.io.validate.MAX_NODES")


def count(message: onnx.ModelProto | onnx.GraphProto | onnx.NodeProto | onnx.AttributeProto | onnx.FunctionProto,
          stop: int | None = None) -> tuple[int, int, bool]:
    """The nodes and initializers inside ``message`` (a node's own bodies, not the node), every body and local
    function included, and whether that is all of them: counting stops once either count passes ``stop``.
    An explicit stack, so a deep message never recurses."""
    nodes = initializers = 0
    stack: list = [message]
    while stack:
        if stop is not None and max(nodes, initializers) > stop:
            return nodes, initializers, False
        item = stack.pop()
        if isinstance(item, (onnx.GraphProto, onnx.FunctionProto)):
            nodes += len(item.node)
            if isinstance(item, onnx.GraphProto):
                initializers += len(item.initializer)
            if stop is not None and max(nodes, initializers) > stop:
                continue  # refused without looking inside its nodes
            stack.extend(node for node in item.node if len(node.attribute))
        elif isinstance(item, onnx.NodeProto):
            stack.extend(item.attribute)
        elif isinstance(item, onnx.AttributeProto):
            if item.HasField("g"):
                stack.append(item.g)
            stack.extend(item.graphs)
        elif isinstance(item, onnx.ModelProto):
            if item.HasField("graph"):
                stack.append(item.graph)
            stack.extend(item.functions)
    return nodes, initializers, not stack


def check_size(model: onnx.ModelProto, where: str) -> None:
    """Rule 7 (counting stops at the cap: a model far over it is refused at once)."""
    limit = node_limit()
    nodes, initializers, exact = count(model, stop=limit)
    for what, held in (("nodes", nodes), ("initializers", initializers)):
        if held > limit:
            raise too_large(where, what, held, limit, exact)


def check_tensor(tensor: onnx.TensorProto, where: str) -> None:
    """Rule 2 for one tensor (its raw_data length is checked where the payload is read)."""
    if any(d < 0 for d in tensor.dims):
        raise InputError(f"{where}: tensor {tensor.name!r} has a negative dimension in its shape "
                         f"{list(tensor.dims)}; the model file is damaged: re-export it")
    if tensor.data_location == TensorProto.EXTERNAL:
        check_location(tensor, where)
        return
    field = _TYPED_FIELDS.get(tensor.data_type)
    if field is None or tensor.HasField("raw_data"):
        return
    count = math.prod(tensor.dims)
    held = len(getattr(tensor, field))
    if held != count:
        raise InputError(f"{where}: tensor {tensor.name!r} holds {held} values in {field} but its shape "
                         f"{list(tensor.dims)} needs {count}; the model file is damaged: re-export it")


def check_raw_length(tensor: onnx.TensorProto, held: int, itemsize: int, where: str) -> None:
    """Rule 2 for a raw payload of ``held`` bytes."""
    wanted = math.prod(tensor.dims) * itemsize
    if held != wanted:
        raise InputError(f"{where}: tensor {tensor.name!r} holds {held} bytes of raw data but its shape "
                         f"{list(tensor.dims)} needs {wanted}; the model file is damaged: re-export it")


def check_order(model: onnx.ModelProto, where: str) -> None:
    """Rules 3 and 4 on every graph of ``model`` (a private copy: out-of-order graphs are sorted in place)."""
    stack = [model.graph]
    while stack:
        graph = stack.pop()
        _order_graph(graph, where)
        for node in graph.node:
            stack.extend(subgraphs(node))


def check_with_onnx(skeleton: onnx.ModelProto, where: str) -> None:
    """Rule 6: ``onnx.checker.check_model`` on ``skeleton`` with every tensor that keeps its data outside the
    proto pointed at an empty stand-in file; InputError with the checker's words."""
    stand_in = onnx.ModelProto()
    stand_in.CopyFrom(skeleton)  # a skeleton holds no large payloads: this copy is small
    for tensor in tensors(stand_in.graph):
        if tensor.data_location == TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    entry.value = "stand-in.data"
    with tempfile.TemporaryDirectory(prefix="amppass-check-") as folder:
        open(os.path.join(folder, "stand-in.data"), "wb").close()
        path = os.path.join(folder, "model.onnx")
        with open(path, "wb") as out:
            out.write(stand_in.SerializeToString())
        try:
            onnx.checker.check_model(path)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
            raise InputError(f"{where}: invalid ONNX model: {' '.join(str(err).split())[:300]}; check it with "
                             "onnx.checker.check_model and fix the reported node or re-export the model") from None


def dynamic_negative_dims(model: onnx.ModelProto) -> None:
    """Rule 5, on every value info of every graph of ``model`` (a private copy)."""
    stack = [model.graph]
    while stack:
        graph = stack.pop()
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            for dim in info.type.tensor_type.shape.dim:
                if dim.HasField("dim_value") and dim.dim_value < 0:
                    dim.ClearField("dim_value")
        for node in graph.node:
            stack.extend(subgraphs(node))


def _order_graph(graph: onnx.GraphProto, where: str) -> None:
    fixed = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    writer: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        for value in node.output:
            if not value:
                continue
            if value in writer or value in fixed:
                first = graph.node[writer[value]].name if value in writer else "a graph input or initializer"
                raise InputError(f"{where}: value {value!r} is written by node {node.name or node.op_type!r} and "
                                 f"already by {first!r}; ONNX graphs assign each value once (SSA). The model file is "
                                 "damaged: re-export it")
            writer[value] = index
    needs = [[writer[v] for v in _reads(node) if v in writer] for node in graph.node]
    if all(all(i < index for i in deps) for index, deps in enumerate(needs)):
        return
    order = _topological(needs)
    if len(order) < len(needs):
        done = set(order)
        stuck = [i for i in range(len(needs)) if i not in done]  # on a cycle, or behind one
        names = [graph.node[i].name or graph.node[i].op_type for i in stuck[:4]]
        raise InputError(f"{where}: nodes {names} read each other's outputs in a cycle; an ONNX graph must be "
                         "acyclic. The model file is damaged or malicious: re-export it")
    replace_nodes(graph, [graph.node[i] for i in order])


def _reads(node: onnx.NodeProto) -> Iterator[str]:
    """Values ``node`` reads: its inputs and the outer values its bodies capture."""
    yield from (v for v in node.input if v)
    stack = list(subgraphs(node))
    while stack:
        body = stack.pop()
        inner = _defined(body)
        for inner_node in body.node:
            yield from (v for v in inner_node.input if v and v not in inner)
            stack.extend(subgraphs(inner_node))


def _defined(graph: onnx.GraphProto) -> frozenset[str]:
    return frozenset([i.name for i in graph.input] + [t.name for t in graph.initializer]
                     + [v for n in graph.node for v in n.output if v])


def _topological(needs: list[list[int]]) -> list[int]:
    """Kahn's order, keeping the original order among ready nodes; shorter than ``needs`` when nodes sit on or
    behind a cycle."""
    waiting = [len(set(deps)) for deps in needs]
    readers: dict[int, list[int]] = {}
    for index, deps in enumerate(needs):
        for dep in set(deps):
            readers.setdefault(dep, []).append(index)
    ready = deque(i for i, count in enumerate(waiting) if count == 0)
    order = []
    while ready:
        index = ready.popleft()
        order.append(index)
        for reader in readers.get(index, []):
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    return order
