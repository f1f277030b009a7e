"""The ONNX op policy table: rows keyed by (domain, op_type) with opset ranges, categories and reasons.

The same facts as the FX table (:mod:`amppass.fx.view.policy`), in ONNX's spelling, in the same row type
(:class:`amppass.analysis.policy.PolicyRow`): a row of a kind both front ends have names ONNX's ops for a kind of
:data:`amppass.analysis.policy.KINDS`, which holds its category, reason and facts; ONNX's own kinds are written
here. ONNX reductions have no ``dtype=`` argument, so what FX runs as FP32_ACCUM runs here as FP32 (inputs cast
up); Softmax follows its input instead, because the runtimes' low-precision softmax kernels already keep their
statistics in fp32. An op whose training form computes statistics of its batch (BatchNormalization) has a second
row in :data:`TRAINING`, picked per node by :func:`in_training`. Per-input-slot exceptions name inputs by their
schema name; a slot marked "keep" is fed the value the model gives it, whatever the node's precision (Resize's
roi/scales, Dropout's ratio, shapes, indices).

:func:`classify` adds two checks on the table: the op's schema must allow the low dtype for the inputs
the plan would convert, and the target's runtime must run it (its kernels: :mod:`amppass.targets`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import onnx
from onnx import TensorProto

from ..analysis.plan import Category, Decision, Precision, Source
from ..analysis.policy import HEAVY, KINDS, LAYOUT, MATRIX_WORK, NORMALISATION, REDUCTION, OpKind, PolicyRow, for_target
from ..targets.target import Kernels, Target

_MS = "com.microsoft"

# A row of a kind both front ends have takes its meaning from amppass.analysis.policy.KINDS; a kind of ONNX's
# alone (or of onnxruntime's contrib ops) is written here.
POLICY: tuple[PolicyRow, ...] = (
    PolicyRow(KINDS["matrix multiply"], ("MatMul", "Gemm", "Einsum")),
    PolicyRow(KINDS["convolution"], ("Conv", "ConvTranspose")),
    PolicyRow(KINDS["attention"], ("Attention",), opsets=(23, 1 << 30)),
    PolicyRow(KINDS["recurrent cell"], ("LSTM", "GRU", "RNN")),
    PolicyRow(OpKind("contrib matrix multiply", Category.LOW,
                     f"fused matrix multiply or attention (onnxruntime contrib op): {MATRIX_WORK}"),
              ("FusedMatMul", "Attention", "MultiHeadAttention", "GroupQueryAttention", "FusedConv"), domain=_MS),
    PolicyRow(OpKind("log-softmax", Category.FP32,
                     "log-softmax: its log-probabilities are large negative numbers that fp16 holds to a few "
                     "hundredths; ONNX has no fp32-accumulate form, so its input is cast up"), ("LogSoftmax",)),
    PolicyRow(OpKind("reduction", Category.FP32,
                     "reduction: a sum over many terms loses bits and can overflow in fp16; ONNX has no "
                     "fp32-accumulate form, so its input is cast up", frozenset({REDUCTION})),
              ("ReduceSum", "ReduceMean", "ReduceProd", "ReduceSumSquare", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "CumSum")),
    PolicyRow(KINDS["normalisation"],
              ("LayerNormalization", "InstanceNormalization", "GroupNormalization",
               "RMSNormalization", "LpNormalization", "MeanVarianceNormalization")),
    PolicyRow(KINDS["norm"], ("LRN",)),
    PolicyRow(OpKind("contrib normalisation", Category.FP32,
                     "normalisation (onnxruntime contrib op): mean and variance statistics need fp32",
                     frozenset({NORMALISATION})),
              ("SkipLayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"),
              domain=_MS),
    PolicyRow(KINDS["exponential"], ("Exp",)),
    PolicyRow(KINDS["logarithm"], ("Log",)),
    PolicyRow(KINDS["power"], ("Pow",)),
    PolicyRow(KINDS["reciprocal"], ("Reciprocal",)),
    PolicyRow(KINDS["transcendental"], ("Tan", "Acos", "Asin", "Cosh", "Sinh", "Atanh", "Acosh", "Asinh")),
    PolicyRow(KINDS["loss"], ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")),
    PolicyRow(OpKind("affine grid", Category.FP32,
                     "affine grid: its outputs are sampling coordinates ([-1, 1] spans the image) that GridSample "
                     "interpolates at; fp16 rounds them to 2**-11 of their size (4e-3 on the ONNX suite's grids, "
                     "which reach 10: two pixels of a 1000-pixel side); computed in fp32"), ("AffineGrid",)),
    PolicyRow(KINDS["resampling"], ("Resize", "Upsample", "GridSample", "RoiAlign"),
              slots={"roi": "keep", "scales": "keep", "sizes": "keep", "rois": "keep", "batch_indices": "keep"}),
    PolicyRow(OpKind("box selection", Category.FP32, "box selection: coordinates and IoU thresholds need fp32"),
              ("NonMaxSuppression",),
              slots={"max_output_boxes_per_class": "keep", "iou_threshold": "keep", "score_threshold": "keep"}),
    PolicyRow(OpKind("value creation", Category.KEEP,
                     "creates values from its attributes or a range; kept as the model wrote it"),
              ("Range", "ConstantOfShape", "RandomNormal", "RandomUniform", "RandomNormalLike",
               "RandomUniformLike", "EyeLike", "Multinomial", "Bernoulli")),
    PolicyRow(OpKind("shape", Category.KEEP, "reads shape metadata only"), ("Shape", "Size")),
    # float tensors of Constant nodes are weights (onnx.view); what reaches the table is an integer,
    # boolean or attribute-typed constant
    PolicyRow(OpKind("constant", Category.KEEP, "constant written in the model; kept as it is"), ("Constant",)),
    PolicyRow(OpKind("quantization", Category.KEEP,
                     "quantization: its fp32 scales define the integer grid, and rounding them to low precision "
                     "would move every quantized value; kept as the model wrote it"),
              ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
               "MatMulInteger", "ConvInteger")),
    PolicyRow(OpKind("control flow", Category.KEEP,
                     "control flow: values cross the subgraph boundary in fp32; the body's nodes are planned one "
                     "by one"), ("If", "Loop", "Scan", "SequenceMap")),
    PolicyRow(OpKind("container", Category.KEEP,
                     "sequence or optional container: holds tensors as the model wrote them; values go in and come "
                     "out in fp32"),
              ("SequenceConstruct", "SequenceAt", "SequenceInsert", "SequenceErase", "SequenceEmpty",
               "SequenceLength", "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalGetElement",
               "OptionalHasElement")),
    PolicyRow(KINDS["division"], ("Div", "Mod")),
    PolicyRow(KINDS["average pooling"], ("AveragePool", "GlobalAveragePool")),
    PolicyRow(OpKind("softmax", Category.FOLLOW,
                     "softmax: runs in the precision of its input; low-precision kernels subtract the maximum and "
                     "sum in fp32 (onnxruntime's CUDA kernel accumulates fp16 in float, its CPU provider casts "
                     "around an fp32 kernel), as the FX path's fused attention does"), ("Softmax",)),
    PolicyRow(OpKind("batch normalisation", Category.FOLLOW,
                     "batch normalisation with stored statistics (inference): a per-channel scale and shift by its "
                     "weights; runs in the precision of its input"), ("BatchNormalization",)),
    PolicyRow(KINDS["concatenation"], ("Concat",)),
    PolicyRow(KINDS["addition"], ("Add", "Sub", "Sum")),
    PolicyRow(OpKind("data movement", Category.FOLLOW,
                     "data movement: runs in the precision of its input (of a weight, it is the weight reshaped, "
                     "stored low where its readers run low)", frozenset({LAYOUT})),
              ("Identity", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"),
              slots={"shape": "keep", "axes": "keep"}),
    PolicyRow(KINDS["elementwise"],
              ("Mul", "Neg", "Abs", "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu",
               "Gelu", "HardSigmoid", "HardSwish", "Mish", "Sigmoid", "Tanh", "Softplus", "Softsign", "Sqrt",
               "Sin", "Cos", "Atan", "Erf", "Sign", "Floor", "Ceil", "Round", "Max", "Min", "Mean",
               "Clip", "Where", "Dropout",
               "Split", "Slice", "Gather", "GatherElements", "GatherND", "Scatter",
               "ScatterElements", "ScatterND", "Expand", "Tile", "Pad", "DepthToSpace", "SpaceToDepth",
               "MaxPool", "GlobalMaxPool", "ReduceMax", "ReduceMin",
               "ArgMax", "ArgMin", "TopK", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual",
               "IsNaN", "IsInf", "Trilu", "Cast", "CastLike", "Compress", "ReverseSequence", "Hardmax",
               "ThresholdedRelu", "Shrink", "NonZero", "OneHot", "Unique"),
              slots={"ratio": "keep", "training_mode": "keep", "shape": "keep", "axes": "keep", "indices": "keep",
                     "starts": "keep", "ends": "keep", "steps": "keep", "pads": "keep", "repeats": "keep",
                     "split": "keep", "k": "keep", "K": "keep", "condition": "keep", "depth": "keep"}),
    PolicyRow(OpKind("contrib elementwise", Category.FOLLOW,
                     "elementwise (onnxruntime contrib op): runs in the precision of its inputs"),
              ("Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BiasAdd"), domain=_MS),
)

# rows for the training form of an op (:func:`in_training`), which computes statistics of its batch
TRAINING: tuple[PolicyRow, ...] = (
    PolicyRow(OpKind("batch normalisation in training", Category.FP32,
                     "batch normalisation in training mode: the batch's mean and variance statistics need fp32",
                     frozenset({NORMALISATION})), ("BatchNormalization",)),
)

QDQ_REASON = ("quantized (QDQ) node: it reads DequantizeLinear outputs and feeds QuantizeLinear only, so "
              "onnxruntime runs it as one integer kernel; casts would break that fusion, so it is kept fp32")
UNKNOWN_REASON = "not in the policy table: follows its inputs (override it if it needs fp32)"
CUSTOM_REASON = ("custom op {op} (domain {domain}): no ONNX schema and no onnxruntime kernel tells which dtypes it "
                 "takes, so it is fed the float32 values it was written for; force_low=['{op}'] if its kernel "
                 "takes low precision")

_BY_KEY: dict[tuple[str, str], list[PolicyRow]] = {}
_TRAINING_BY_KEY: dict[tuple[str, str], list[PolicyRow]] = {}
for _table, _index in ((POLICY, _BY_KEY), (TRAINING, _TRAINING_BY_KEY)):
    for _row in _table:
        for _op in _row.ops:
            _index.setdefault((_row.domain, _op), []).append(_row)


# ONNX's ops of the heavy kinds (amppass.analysis.policy.HEAVY): MatMul, Gemm, Einsum, Conv, ConvTranspose,
# Attention, LSTM, GRU, RNN
HEAVY_OPS = frozenset(op for row in POLICY if row.kind in HEAVY and not row.domain for op in row.ops)


def is_heavy(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is an ONNX op of a heavy kind (:data:`HEAVY_OPS`): matrix products, convolutions, attention
    and recurrent layers, the model's heavy compute."""
    return node.domain in ("", "ai.onnx") and node.op_type in HEAVY_OPS


def lookup(domain: str, op_type: str, opset: int, training: bool = False) -> PolicyRow | None:
    """The row for ``(domain, op_type)`` whose opset range holds ``opset``, or None; ``training`` picks the
    row of the op's training form where it has one."""
    domain = "" if domain == "ai.onnx" else domain
    rows = _TRAINING_BY_KEY.get((domain, op_type), []) if training else []
    for row in rows + _BY_KEY.get((domain, op_type), []):
        if row.opsets[0] <= opset <= row.opsets[1]:
            return row
    return None


def in_training(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a BatchNormalization that normalises by its batch's statistics: ``training_mode=1``
    (opset 14 on) or the mean and variance outputs (opsets 7-13) of the training form."""
    if node.op_type != "BatchNormalization" or node.domain not in ("", "ai.onnx"):
        return False
    flagged = any(a.name == "training_mode" and a.i for a in node.attribute)
    return flagged or sum(1 for v in node.output if v) > 1


def quantized_nodes(graph: onnx.GraphProto) -> dict[str, Decision]:
    """fp32 decisions for the nodes of ``graph`` between DequantizeLinear and QuantizeLinear (QDQ format):
    every input that is not an initializer comes from a DequantizeLinear, every output goes to
    QuantizeLinear only."""
    if not any(n.op_type == "DequantizeLinear" for n in graph.node):
        return {}  # no QDQ section: spare large graphs the two maps below
    producers = {v: n for n in graph.node for v in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for value in node.input:
            readers.setdefault(value, []).append(node)
    constants = {t.name for t in graph.initializer} | {""}
    graph_outputs = {o.name for o in graph.output}
    found = {}
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") or node.domain not in ("", "ai.onnx"):
            continue
        fed = [producers.get(v) for v in node.input if v not in constants]
        after = [r for v in node.output if v for r in readers.get(v, [])]
        if (fed and all(p is not None and p.op_type == "DequantizeLinear" for p in fed) and after
                and all(r.op_type == "QuantizeLinear" for r in after) and not graph_outputs & set(node.output)):
            found[node.name] = Decision(Precision.FP32, QDQ_REASON, Source.POLICY, {"qdq": True}, rule="qdq")
    return found


@dataclass(frozen=True)
class Classification:
    """An op's category for one node, and which of its inputs the plan leaves alone."""

    category: Category
    reason: str
    unknown: bool
    kept_slots: frozenset[int]  # input positions fed unchanged
    evidence: Mapping[str, Any]  # facts for the report: no low kernel, custom op, run through fp32 on CPU
    low_blocked: str = ""  # why the op cannot run in the low dtype (schema or runtime), whatever its category
    facts: frozenset[str] = frozenset()  # what the op computes, from its policy row


def input_names(domain: str, op_type: str, opset: int, count: int) -> list[str]:
    """Schema names of a node's ``count`` inputs (the variadic last one repeated); "" where unknown."""
    schema = _schema(domain, op_type, opset)
    if schema is None or not schema.inputs:
        return [""] * count
    names = [p.name for p in schema.inputs]
    return (names + [names[-1]] * count)[:count]


def kernel_attributes(node: onnx.NodeProto, target: Target) -> tuple[tuple[str, str], ...]:
    """The ``(name, value)`` attributes of ``node`` that the target's kernel conditions read (ScatterND's
    reduction), for :func:`classify`; empty for almost every node, which keeps its cache small."""
    names = target.conditions.attributes(node.domain, node.op_type)
    if not names:
        return ()
    found = [(a.name, onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name in names]
    return tuple(sorted((name, value.decode() if isinstance(value, bytes) else str(value)) for name, value in found))


@functools.lru_cache(maxsize=None)
def classify(domain: str, op_type: str, opset: int, input_count: int, target: Target,
             training: bool = False, attributes: tuple[tuple[str, str], ...] = ()) -> Classification:
    """Category, reason and slot exceptions of one node for ``target`` (its low dtype and kernels);
    ``training`` for a node in its training form (:func:`in_training`); ``attributes`` those of
    :func:`kernel_attributes`.

    Cached: a graph repeats a few dozen op forms thousands of times, and targets are shared objects.
    ``evidence`` is read-only.
    """
    kernels = target.kernels
    assert kernels is not None  # an ONNX target's (Target.kernels is ONNX only)
    row = lookup(domain, op_type, opset, training)
    names = input_names(domain, op_type, opset, input_count)
    kept = frozenset(i for i, n in enumerate(names) if row is not None and row.slots.get(n) == "keep")
    if row is None and _custom(domain, op_type, opset, kernels):
        return Classification(Category.FP32, CUSTOM_REASON.format(op=op_type, domain=domain or "ai.onnx"), True,
                              kept, MappingProxyType({"custom_op": True}))
    facts: frozenset[str]
    if row is None:
        category, reason, unknown, facts = Category.FOLLOW, UNKNOWN_REASON, True, frozenset()
    else:
        category, reason, unknown, facts = row.category, for_target(row.reason, target.name, target.low.name), False, \
            row.facts
    evidence: dict = {}
    # checked for fp32 ops too: a user's force_low must not put them where the target cannot run them
    blocked = _low_blocked(domain, op_type, opset, target, kept, input_count, attributes) \
        if category is not Category.KEEP else ""
    if category in (Category.LOW, Category.FOLLOW):
        if blocked:
            return Classification(Category.FP32, blocked, unknown, kept, MappingProxyType({"no_low_kernel": True}),
                                  blocked, facts)
        if kernels.status(domain, op_type, opset, target.low.onnx) == "via-fp32":
            evidence["onnxruntime_cpu"] = "no native low-precision kernel; onnxruntime casts around it on CPU"
    return Classification(category, reason, unknown, kept, MappingProxyType(evidence), blocked, facts)


def _low_blocked(domain: str, op_type: str, opset: int, target: Target, kept: frozenset[int], count: int,
                 attributes: tuple[tuple[str, str], ...]) -> str:
    """Why ``op_type`` cannot run in the target's low dtype (schema, kernels or their attribute conditions),
    or "" when it can."""
    low = target.low
    schema = _schema(domain, op_type, opset)
    if schema is not None:
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        wanted = f"tensor({'float16' if low.onnx == TensorProto.FLOAT16 else 'bfloat16'})"
        params = schema.inputs
        for i in range(min(count, len(params)) if params else 0):
            if i in kept:
                continue
            type_str = params[i].type_str
            types = allowed.get(type_str, {type_str})
            if "tensor(float)" in types and wanted not in types:
                return f"the ONNX schema of {op_type} (opset {opset}) does not allow {low} inputs; kept fp32"
    refused = target.conditions.refusal(domain, op_type, opset, low.onnx, attributes)
    if refused:
        return f"{target.runtime} has no {low} kernel for {op_type} {refused}; kept fp32"
    kernels = target.kernels
    assert kernels is not None  # an ONNX target's
    if kernels.status(domain, op_type, opset, low.onnx) == "none":
        around = " and does not cast around it" if target.name == "cpu" else ""
        return f"{target.runtime} has no {low} kernel for {op_type} (opset {opset}){around}; kept fp32"
    return ""


def _custom(domain: str, op_type: str, opset: int, kernels: Kernels) -> bool:
    """An op neither ONNX nor the target's runtime knows: its kernel (if any) comes from the user."""
    return _schema(domain, op_type, opset) is None and \
        kernels.status(domain, op_type, opset, TensorProto.FLOAT) == "unknown"


def _schema(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, "" if domain == "ai.onnx" else domain)
    except onnx.defs.SchemaError:
        return None
