"""An fp32 model that computes what a rewritten (mixed-precision) model computes on low-precision hardware.

onnxruntime's CPU provider has fp32 kernels only for most ops; it runs a low-precision node by casting its
inputs up and its outputs down, and then removes every ``Cast(fp32 -> fp16) -> Cast(fp16 -> fp32)`` chain
those casts form with the model's own casts. So on the CPU a converted model computes almost everything in
fp32 (only weights stay rounded), and its error says little about a GPU, where fp16 values are stored as
fp16. The tolerance search therefore measures :func:`simulate` of each trial model instead: every value the
rewritten model holds in the low dtype becomes an fp32 value rounded through an explicit ``Cast`` pair
(which onnxruntime keeps), low-precision weights are widened exactly, and every op runs its fp32 kernel —
fp32 arithmetic on low-precision inputs with a low-precision result, as a GPU kernel with fp32 accumulation.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .rewrite import META_KEY
from .view import FLOAT, all_nodes, constant_tensor, subgraphs
from .weights import WeightStore

LOW_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})


def simulate(model: onnx.ModelProto, store: WeightStore, types: dict[str, int], low: int) -> onnx.ModelProto:
    """Turn the rewritten ``model`` (a private copy) into its fp32 simulation in place and return it.

    ``low`` is the dtype it was converted to; ``types`` are the element types of the fp32 model's values
    (the rewrite leaves non-float outputs of low-precision nodes, e.g. TopK's indices, as they were).
    """
    taken = {v for n in all_nodes(model.graph) for v in list(n.input) + list(n.output)} | {
        n.name for n in all_nodes(model.graph)}
    _graph(model.graph, store, types, low, taken)
    return model


def _graph(graph: onnx.GraphProto, store: WeightStore, types: dict[str, int], low: int, taken: set[str]) -> None:
    for tensor in graph.initializer:
        if tensor.data_type in LOW_TYPES:
            tensor.CopyFrom(_widened(tensor, store))
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for body in subgraphs(node):
            _graph(body, store, types, low, taken)
        tensor = constant_tensor(node) if node.op_type == "Constant" else None
        if tensor is not None and tensor.data_type in LOW_TYPES:
            tensor.CopyFrom(_widened(tensor, store))
        nodes.append(node)
        to = next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None
        if to in LOW_TYPES:
            outputs = [0]
        elif node.op_type != "Cast" and _runs_low(node):
            outputs = [j for j, v in enumerate(node.output) if v and types.get(v, FLOAT) == FLOAT]
        else:
            continue
        for j in outputs:
            value = node.output[j]
            node.output[j] = rounded = unique_name(taken, f"{value}__sim")
            if node.op_type != "Cast":  # computed in fp32, stored in the low dtype
                rounded = unique_name(taken, f"{value}__sim_low")
                nodes.append(helper.make_node("Cast", [node.output[j]], [rounded],
                                              name=unique_name(taken, f"{rounded}_cast"), to=low))
            nodes.append(helper.make_node("Cast", [rounded], [value], name=unique_name(taken, f"{value}_sim_cast"),
                                          to=FLOAT))
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.value_info[:]  # stale: low values are fp32 now
    for value in list(graph.output) + list(graph.input):
        if value.type.tensor_type.elem_type in LOW_TYPES:
            value.type.tensor_type.elem_type = FLOAT


def _runs_low(node: onnx.NodeProto) -> bool:
    raw = next((p.value for p in node.metadata_props if p.key == META_KEY), None)
    return raw is not None and json.loads(raw).get("precision") == "low"


def _widened(tensor: onnx.TensorProto, store: WeightStore) -> onnx.TensorProto:
    """``tensor`` (fp16 or bf16, in the store or inline) as an fp32 tensor holding exactly its values."""
    values = np.asarray(store.array(tensor))
    if tensor.data_type == TensorProto.BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return numpy_helper.from_array(values.astype(np.float32).reshape(tuple(tensor.dims)), tensor.name)


def unique_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ... : the first not in ``taken``, which it joins."""
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name
