"""An fp32 model that computes what a mixed-precision ONNX model computes on low-precision hardware.

onnxruntime's CPU provider has fp32 kernels only for most ops; it runs a low-precision node by casting its
inputs up and its outputs down, and then removes every ``Cast(fp32 -> fp16) -> Cast(fp16 -> fp32)`` chain
those casts form with the model's own casts. So on the CPU a converted model computes almost everything in
fp32 (only weights stay rounded), and its error says little about a GPU, where fp16 values are stored as
fp16. :func:`simulated` builds the model to measure instead; the tolerance search measures its in-place
twin :func:`simulate` of each trial model.

Which values are low is read from the converted model alone, never from amppass's metadata, so the
simulation judges any converter's output (onnxconverter-common's included) by one rule:

- a *value is low* when the model holds it in fp16 or bf16: its type from onnx shape inference of the
  model itself (the model's own ``value_info`` dropped first: a converter may leave it stale; a value
  inference cannot type keeps its declared type), or the type of an initializer / Constant tensor;
- a *node runs low* (:func:`runs_low`) when it writes a low value. A node that only reads low values and
  writes fp32 or integer ones (``Cast`` up, ``Shape``, ``Greater``) computes from exact inputs, as a GPU
  kernel does, so nothing of it is rounded.

In the simulation every low value becomes an fp32 value rounded through an explicit ``Cast`` pair to its
own low dtype and back (which onnxruntime keeps): node outputs after the op, the model's low graph inputs on
entry. Low weights (initializers, Constant and ConstantOfShape tensors) are widened exactly, ``dtype``
attributes asking for a low type ask for fp32, and every op runs its fp32 kernel.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .io.weight_store import WeightStore
from .rewrite import all_names, unique_name
from .view import FLOAT, all_nodes, clear_value_info, subgraphs, value_types

LOW_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.BFLOAT16})
_TYPE_ATTRIBUTES = frozenset({"dtype", "output_dtype"})  # RandomNormal, EyeLike, DequantizeLinear, ...


def simulated(model: onnx.ModelProto) -> onnx.ModelProto:
    """The fp32 simulation of a mixed-precision ``model`` (any converter's; ``model`` is never changed).

    What it models: fp16/bf16 *storage* of every value the model holds in a low dtype (each is rounded to
    that dtype where it is written, and where a low graph input enters), low weights exactly as stored,
    and fp32 arithmetic inside each op on those rounded inputs, as a GPU kernel with fp32 accumulation.
    What it does not model: accumulation in fp16 inside a kernel (a kernel that sums in fp16 loses more),
    kernel-specific algorithms (Winograd or FFT convolutions, fused or reordered reductions, fast
    approximations of exp/tanh), nor values a fused kernel keeps in fp32 between the ops it fuses. Its error
    is what low-precision storage costs: kernels that accumulate in fp16 lose more, fused kernels that keep
    intermediates in fp32 lose less.

    The result has fp32 wherever ``model`` has a low dtype (graph inputs and outputs included: feed it fp32
    arrays, which it rounds on entry). A model with external data must have it loaded.
    """
    store = WeightStore()
    work = store.skeleton(model)  # a copy whose large payloads stay in the caller's tensors until the end
    simulate(work, store)
    store.materialize(work)
    return work


def simulate(model: onnx.ModelProto, store: WeightStore) -> onnx.ModelProto:
    """Turn the mixed-precision ``model`` (a private copy whose payloads ``store`` holds) into its fp32
    simulation (module docstring) in place and return it."""
    low = _low_types(model)
    taken = all_names(model)
    _round_inputs(model.graph, low, taken)
    _graph(model.graph, store, low, taken)
    return model


def low_types(model: onnx.ModelProto) -> dict[str, int]:
    """Value name -> its low dtype (TensorProto.FLOAT16 or BFLOAT16), for every value ``model`` holds in
    fp16 or bf16, bodies included, as shape inference of the model itself types it (module docstring).
    ``model`` is only read."""
    return _low_types(WeightStore().skeleton(model))


def runs_low(node: onnx.NodeProto, low: Mapping[str, int]) -> bool:
    """Whether ``node`` runs in low precision: it writes a value held in a low dtype (``low`` as
    :func:`low_types` gives it). A Constant holds a weight, stored exactly: it does not run."""
    return node.op_type != "Constant" and any(v in low for v in node.output if v)


def _low_types(model: onnx.ModelProto) -> dict[str, int]:
    """:func:`low_types` of ``model``, whose value_info it drops (stale after a converter's rewrite)."""
    declared = value_types(model)
    clear_value_info(model.graph)
    types = {**declared, **value_types(onnx.shape_inference.infer_shapes(model))}
    return {name: t for name, t in types.items() if t in LOW_TYPES}


def _round_inputs(graph: onnx.GraphProto, low: Mapping[str, int], taken: set[str]) -> None:
    """Round the main graph's low inputs (fed fp32 in the simulation) on entry: every reader, in the graph
    or a body, reads the rounded value instead."""
    entry: list[onnx.NodeProto] = []
    renamed: dict[str, str] = {}
    for value in graph.input:
        if value.name in low:
            renamed[value.name] = unique_name(taken, f"{value.name}__sim_in")
            entry += rounding(value.name, renamed[value.name], low[value.name], taken)
    if not renamed:
        return
    for node in all_nodes(graph):
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
    entry.extend(graph.node)
    del graph.node[:]
    graph.node.extend(entry)


def _graph(graph: onnx.GraphProto, store: WeightStore, low: Mapping[str, int], taken: set[str]) -> None:
    for tensor in graph.initializer:
        if tensor.data_type in LOW_TYPES:
            tensor.CopyFrom(_widened(tensor, store))
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for body in subgraphs(node):
            _graph(body, store, low, taken)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in LOW_TYPES:
                attr.t.CopyFrom(_widened(attr.t, store))
            elif attr.name in _TYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and attr.i in LOW_TYPES:
                attr.i = FLOAT
        nodes.append(node)
        if not runs_low(node, low):
            continue
        cast_down = node.op_type == "Cast" and any(a.name == "to" and a.i in LOW_TYPES for a in node.attribute)
        for j, value in enumerate(node.output):
            if value not in low:
                continue
            node.output[j] = computed = unique_name(taken, f"{value}__sim")
            if cast_down:  # the Cast itself rounds; only widen its result
                nodes.append(helper.make_node("Cast", [computed], [value], to=FLOAT,
                                              name=unique_name(taken, f"{value}_sim_cast")))
            else:  # computed in fp32, stored in the low dtype
                nodes += rounding(computed, value, low[value], taken)
    del graph.node[:]
    graph.node.extend(nodes)
    for value in list(graph.output) + list(graph.input):
        if value.type.tensor_type.elem_type in LOW_TYPES:
            value.type.tensor_type.elem_type = FLOAT


def rounding(source: str, target: str, dtype: int, taken: set[str]) -> list[onnx.NodeProto]:
    """``Cast(source -> dtype) -> Cast(-> fp32) = target``: ``source`` stored in ``dtype``."""
    stored = unique_name(taken, f"{target}__sim_low")
    return [helper.make_node("Cast", [source], [stored], name=unique_name(taken, f"{stored}_cast"), to=dtype),
            helper.make_node("Cast", [stored], [target], name=unique_name(taken, f"{target}_sim_cast"), to=FLOAT)]


def _widened(tensor: onnx.TensorProto, store: WeightStore) -> onnx.TensorProto:
    """``tensor`` (fp16 or bf16, in the store or inline) as an fp32 tensor holding exactly its values."""
    values = np.asarray(store.array(tensor))
    if tensor.data_type == TensorProto.BFLOAT16:
        values = (values.astype(np.uint32) << 16).view(np.float32)
    return numpy_helper.from_array(values.astype(np.float32).reshape(tuple(tensor.dims)), tensor.name)

