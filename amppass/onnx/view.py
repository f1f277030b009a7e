"""Build the neutral :class:`GraphView` of an ONNX model, subgraphs included.

Value types come from ``onnx.shape_inference``; only float32 values are planned. Float32 initializers,
``Constant`` nodes and ``ConstantOfShape`` fills (a float32 ``value`` repeated to a shape: exporters make
zeros, masks and the ONNX suite's light nets their weights so) are weights (stored in low precision ahead of
time where their readers run low);
graph inputs and the formal inputs of If/Loop/Scan bodies are fixed fp32. A body's nodes come before the
control node that owns them, so painting sees the outer values they capture already decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import onnx
from onnx import TensorProto

from ..analysis.plan import Category
from ..analysis.view import GraphView, OpView
from ..targets.target import Target
from . import policy

FLOAT = TensorProto.FLOAT
_ANY_FLOAT_TYPE = frozenset({"Shape", "Size"})
_READS_BITS = frozenset({"BitCast"})  # typed by an attribute, but its input's width sets the result


@dataclass
class NodeRef:
    """Where a view node lives and which of its inputs the plan converts."""

    node: onnx.NodeProto
    planned: list[int]  # input positions holding float32 values the plan may cast
    # facts the policy found (no low kernel, custom op), reported; the policy's cached, read-only mapping
    evidence: Mapping[str, Any] = field(default_factory=dict)
    # input positions the policy keeps as the model wrote them (Resize's scales, NonMaxSuppression's
    # thresholds) that hold float32 values: read in fp32 even where their producer runs low
    kept_fp32: list[int] = field(default_factory=list)


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs held in ``node``'s attributes (If branches, Loop/Scan bodies)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    """Initializers and Constant tensors of ``graph`` and its bodies."""
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
        for sub in subgraphs(node):
            yield from tensors(sub)


def all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs, bodies before their owners."""
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_nodes(sub)
        yield node


def replace_nodes(graph: onnx.GraphProto, nodes: list[onnx.NodeProto]) -> None:
    """Make ``nodes`` (messages of ``graph``, in any order, some left out) ``graph``'s node list. They are
    copied first: removing messages from a repeated field may free them."""
    kept = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(kept, nodes, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(kept)


def clear_value_info(graph: onnx.GraphProto) -> None:
    """Drop the inferred types of ``graph`` and every body (stale once a rewrite changed dtypes)."""
    del graph.value_info[:]
    for node in graph.node:
        for sub in subgraphs(node):
            clear_value_info(sub)


def name_nodes(model: onnx.ModelProto) -> None:
    """Give every node a name unique across the model (unnamed or repeated names are legal in ONNX).

    Mutates ``model``: call it on the private copy the conversion works on.
    """
    seen: set[str] = set()
    counts: dict[str, int] = {}
    for node in all_nodes(model.graph):
        name = node.name
        while not name or name in seen:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
            name = f"{node.name or node.op_type}_amp{counts[node.op_type]}"
        node.name = name
        seen.add(name)


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Value name -> ONNX element type, for every value shape inference or the model itself types."""
    types: dict[str, int] = {}

    def visit(graph: onnx.GraphProto) -> None:
        for info in list(graph.input) + list(graph.output) + list(graph.value_info):
            if info.type.HasField("tensor_type") and info.type.tensor_type.elem_type:
                types[info.name] = info.type.tensor_type.elem_type
        for init in graph.initializer:
            types[init.name] = init.data_type
        for node in graph.node:
            if node.op_type == "Constant" and node.output:
                tensor = constant_tensor(node)
                if tensor is not None:
                    types[node.output[0]] = tensor.data_type
            for sub in subgraphs(node):
                visit(sub)

    visit(model.graph)
    return types


def constant_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor of a ``Constant`` node given by its ``value`` attribute, or None."""
    for attr in node.attribute:
        if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
            return attr.t
    return None


def weight_tensor(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The float32 tensor a ``Constant`` node writes, or a ``ConstantOfShape`` node fills its output with;
    None for any other node (module docstring)."""
    if node.op_type not in ("Constant", "ConstantOfShape") or node.domain not in ("", "ai.onnx"):
        return None
    tensor = constant_tensor(node)
    return tensor if tensor is not None and tensor.data_type == FLOAT else None


def dims(info: onnx.ValueInfoProto) -> list[int | None]:
    """The dimensions of a tensor value: fixed sizes, None for symbolic ones and for negative ones (Paddle and
    some TF exports write ``dim_value: -1`` for a dynamic dimension)."""
    return [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None
            for d in info.type.tensor_type.shape.dim]


def opsets(model: onnx.ModelProto) -> dict[str, int]:
    """Domain -> opset version imported by ``model`` ("" for the default domain)."""
    return {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}


def build_view(
    model: onnx.ModelProto, target: Target, absmax: Callable[[onnx.TensorProto], float] | None,
    values: Callable[[onnx.TensorProto], Any] | None = None,
) -> tuple[GraphView, dict[str, NodeRef], dict[str, int]]:
    """The view of ``model`` (named by :func:`name_nodes`, typed by shape inference) for ``target``.

    Returns the view, view name -> :class:`NodeRef`, and value name -> element type. ``absmax`` measures a
    weight's largest magnitude (the weight store's; None where the low dtype's range needs no check);
    ``values`` reads a weight's values, for the painting's check that a weight fits the low dtype.
    """
    types = value_types(model)
    versions = opsets(model)
    view = GraphView(nodes=[])
    refs: dict[str, NodeRef] = {}
    held: dict[str, onnx.TensorProto] = {}

    def visit(graph: onnx.GraphProto) -> None:
        graph_inputs = {i.name for i in graph.input}
        for init in graph.initializer:
            if init.data_type == FLOAT and init.name not in graph_inputs:
                view.weights[init.name] = absmax(init) if absmax else 0.0
                held[init.name] = init
        for node in graph.node:
            tensor = weight_tensor(node)
            if tensor is not None:
                view.weights[node.output[0]] = absmax(tensor) if absmax else 0.0
                held[node.output[0]] = tensor
                continue
            for sub in subgraphs(node):
                visit(sub)
            view.nodes.append(_op_view(node, types, versions, target, refs))

    visit(model.graph)
    view.outputs = [o.name for o in model.graph.output if types.get(o.name) == FLOAT]
    if values is not None:
        view.weight_values = lambda name: values(held[name])
    return view, refs, types


def _float_tensor_attributes(node: onnx.NodeProto) -> list[str]:
    """Names of ``node``'s float32 tensor attributes (TreeEnsemble's split values, say)."""
    return [a.name for a in node.attribute if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == FLOAT]


def _op_view(node: onnx.NodeProto, types: dict[str, int], versions: dict[str, int], target: Target,
             refs: dict[str, NodeRef]) -> OpView:
    domain = "" if node.domain == "ai.onnx" else node.domain
    opset = versions.get(domain, 1)
    found = policy.classify(domain, node.op_type, opset, len(node.input), target, policy.in_training(node),
                            policy.kernel_attributes(node, target))
    category, reason = found.category, found.reason
    planned = [i for i, v in enumerate(node.input) if v and types.get(v) == FLOAT and i not in found.kept_slots]
    kept_fp32 = [i for i, v in enumerate(node.input) if v and types.get(v) == FLOAT and i in found.kept_slots]
    outputs = [v for v in node.output if v and types.get(v) == FLOAT]
    typed_by_attribute = [a for a in node.attribute if a.name in ("to", "dtype")]
    if node.op_type == "Cast" and typed_by_attribute and typed_by_attribute[0].i != FLOAT:
        category, reason = Category.KEEP, (
            f"explicit cast to {TensorProto.DataType.Name(typed_by_attribute[0].i).lower()} in the model; kept")
    elif node.op_type == "Cast":
        reason = "cast to fp32, the model's working dtype: follows its input"
    elif typed_by_attribute and category is not Category.KEEP:
        category, reason = Category.KEEP, "output dtype set by an attribute; kept as the model wrote it"
    elif category is not Category.KEEP and any(v and v not in types for v in node.output) and not list(
            subgraphs(node)):
        category, reason = Category.FP32, "onnx shape inference could not type its outputs; kept fp32"
    elif category is not Category.KEEP and _float_tensor_attributes(node):
        category, reason = Category.FP32, (
            f"holds float32 tensors in its attributes ({', '.join(_float_tensor_attributes(node))}), which ONNX "
            "types like its inputs; kept fp32")
    if category is Category.KEEP or (not planned and (category is not Category.FP32 or not outputs)):
        planned_view: list[str] = []
        if category is not Category.KEEP:
            category, reason = Category.KEEP, (
                "creates fp32 values at run time; kept as they are" if outputs else "no fp32 tensors in or out")
    else:
        planned_view = list(dict.fromkeys(node.input[i] for i in planned))
    if category is Category.KEEP and (node.op_type in _ANY_FLOAT_TYPE or (
            typed_by_attribute and node.op_type not in _READS_BITS)):
        planned = []  # reads any float type as it is; other KEEP ops (If/Loop/Scan, Range, BitCast) read fp32
    refs[node.name] = NodeRef(node, planned, found.evidence, kept_fp32)
    return OpView(
        name=node.name,
        op=node.op_type if not domain else f"{domain}.{node.op_type}",
        category=category,
        reason=reason,
        inputs=planned_view,
        outputs=outputs,
        unknown=found.unknown,
        low_blocked=found.low_blocked,
        facts=found.facts,
        scalars=[float(a.f) for a in node.attribute if a.type == onnx.AttributeProto.FLOAT],
    )

