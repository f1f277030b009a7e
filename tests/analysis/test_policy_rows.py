"""The op kinds of both policy tables: each meaning written once (amppass.analysis.policy.KINDS), each front end
naming its own ops for it, and the kinds only one front end has listed here as such; the heavy ops of both front
ends are the ops of the heavy kinds (amppass.analysis.policy.HEAVY), and the MAC counters count no other."""

import pytest
from onnx import helper

from amppass.analysis.plan import Category
from amppass.analysis.policy import HEAVY, KINDS, REDUCTION, OpKind
from amppass.fx.view import macs as fx_macs
from amppass.fx.view import policy as fx_policy
from amppass.onnx import macs as onnx_macs
from amppass.onnx import policy as onnx_policy

FX_ROWS = (*fx_policy.POLICY, *fx_policy.TRAINING)
ONNX_ROWS = (*onnx_policy.POLICY, *onnx_policy.TRAINING)

# kinds only one front end has, and why
FX_ONLY = {
    "matrix-vector product": "ONNX spells these MatMul",
    "grouped matrix multiply": "an ATen and transformers op",
    "dot product": "an ATen op",
    "softmax": "accumulated in fp32 through dtype=, which ONNX's Softmax lacks",
    "reduction": "accumulated in fp32 through dtype=, which ONNX's reductions lack",
    "batch normalisation": "reads its statistics through ATen slots kept fp32",
    "batch normalisation in training": "torch's kernels accumulate the batch's statistics in fp32",
    "logarithm near one": "ATen ops",
    "distance": "ATen ops",
    "3-D adaptive average pooling": "torch's CPU kernel sums its windows in the low dtype",
    "output or index": "Python's operator.getitem",
}
ONNX_ONLY = {
    "contrib matrix multiply": "onnxruntime's contrib ops",
    "contrib normalisation": "onnxruntime's contrib ops",
    "contrib elementwise": "onnxruntime's contrib ops",
    "log-softmax": "cast up: ONNX has no fp32-accumulate form",
    "reduction": "cast up: ONNX has no fp32-accumulate form",
    "softmax": "the runtimes' low-precision kernels keep their statistics in fp32",
    "batch normalisation": "a per-channel scale and shift by its weights",
    "batch normalisation in training": "its statistics computed in fp32",
    "affine grid": "an ONNX op",
    "box selection": "an ONNX op",
    "value creation": "ONNX ops",
    "shape": "ONNX ops",
    "constant": "an ONNX op",
    "quantization": "ONNX's QDQ ops",
    "control flow": "ONNX's subgraphs",
    "container": "ONNX's sequences and optionals",
    "data movement": "a weight's layout op, fact 'layout' (ATen's follow as elementwise)",
}

# ops both front ends have: (ATen name, (domain, ONNX op_type, opset))
PAIRS = [
    ("mm", ("", "MatMul", 17)), ("linear", ("", "Gemm", 17)), ("einsum", ("", "Einsum", 17)),
    ("conv2d", ("", "Conv", 17)), ("conv_transpose2d", ("", "ConvTranspose", 17)),
    ("scaled_dot_product_attention", ("", "Attention", 23)), ("lstm", ("", "LSTM", 17)), ("gru", ("", "GRU", 17)),
    ("layer_norm", ("", "LayerNormalization", 17)), ("group_norm", ("", "GroupNormalization", 21)),
    ("instance_norm", ("", "InstanceNormalization", 17)), ("rms_norm", ("", "RMSNormalization", 23)),
    ("local_response_norm", ("", "LRN", 17)), ("exp", ("", "Exp", 17)), ("log", ("", "Log", 17)),
    ("pow", ("", "Pow", 17)), ("reciprocal", ("", "Reciprocal", 17)), ("tan", ("", "Tan", 17)),
    ("cross_entropy_loss", ("", "SoftmaxCrossEntropyLoss", 17)), ("nll_loss", ("", "NegativeLogLikelihoodLoss", 17)),
    ("upsample_bilinear2d", ("", "Resize", 19)), ("grid_sampler", ("", "GridSample", 20)),
    ("div", ("", "Div", 17)), ("fmod", ("", "Mod", 17)), ("avg_pool2d", ("", "AveragePool", 17)),
    ("adaptive_avg_pool2d", ("", "GlobalAveragePool", 17)), ("cat", ("", "Concat", 17)), ("add", ("", "Add", 17)),
    ("sub", ("", "Sub", 17)), ("mul", ("", "Mul", 17)), ("relu", ("", "Relu", 17)), ("gelu", ("", "Gelu", 20)),
    ("max_pool2d", ("", "MaxPool", 17)), ("amax", ("", "ReduceMax", 17)), ("gather", ("", "Gather", 17)),
]
# ops both front ends have that mean different things there, each side a kind of its own front end
DIFFERENT = [
    ("softmax", ("", "Softmax", 17)),  # fp32 through dtype= in ATen; ONNX's kernels keep fp32 statistics
    ("log_softmax", ("", "LogSoftmax", 17)),  # fp32 through dtype= in ATen; cast up in ONNX
    ("sum", ("", "ReduceSum", 17)), ("cumsum", ("", "CumSum", 17)),  # dtype= in ATen; cast up in ONNX
    ("sum", ("", "Sum", 17)), ("mean", ("", "Mean", 17)),  # an ATen reduction; ONNX's adds or averages its inputs
    # ONNX's carry a weight's layout (fact "layout"); ATen's follow as elementwise ops
    ("reshape", ("", "Reshape", 17)), ("transpose", ("", "Transpose", 17)), ("squeeze", ("", "Squeeze", 17)),
    ("unsqueeze", ("", "Unsqueeze", 17)), ("flatten", ("", "Flatten", 17)),
    ("batch_norm", ("", "BatchNormalization", 15)),
]


def _fx(name):
    row = fx_policy.lookup(name)
    assert row is not None, name
    return row


def _onnx(domain, op_type, opset):
    row = onnx_policy.lookup(domain, op_type, opset)
    assert row is not None, (domain, op_type, opset)
    return row


def test_every_shared_kind_is_named_by_a_front_end():
    reached = {id(row.kind) for row in (*FX_ROWS, *ONNX_ROWS)}
    unreached = [name for name, kind in KINDS.items() if id(kind) not in reached]
    assert not unreached, f"kinds no front end's table names: {unreached}"
    assert all(name == kind.name for name, kind in KINDS.items())


def test_a_meaning_both_tables_give_is_written_once():
    """Two rows that give their ops the same category, reason and facts hold the one shared kind."""
    for fx_row in FX_ROWS:
        for onnx_row in ONNX_ROWS:
            if (fx_row.category, fx_row.reason, fx_row.facts) == (onnx_row.category, onnx_row.reason, onnx_row.facts):
                assert fx_row.kind is onnx_row.kind is KINDS[fx_row.kind.name], (fx_row.ops[:2], onnx_row.ops[:2])


@pytest.mark.parametrize("aten, onnx_op", PAIRS, ids=[aten for aten, _ in PAIRS])
def test_an_op_both_front_ends_have_gets_one_meaning(aten, onnx_op):
    fx_row, onnx_row = _fx(aten), _onnx(*onnx_op)
    assert fx_row.kind is onnx_row.kind is KINDS[fx_row.kind.name]
    assert (fx_row.category, fx_row.reason, fx_row.facts) == (onnx_row.category, onnx_row.reason, onnx_row.facts)


@pytest.mark.parametrize("aten, onnx_op", DIFFERENT, ids=[f"{aten}-{op[1]}" for aten, op in DIFFERENT])
def test_ops_that_differ_on_purpose_are_front_end_kinds(aten, onnx_op):
    fx_row, onnx_row = _fx(aten), _onnx(*onnx_op)
    assert fx_row.kind.name in FX_ONLY or onnx_row.kind.name in ONNX_ONLY
    assert (fx_row.category, fx_row.reason, fx_row.facts) != (onnx_row.category, onnx_row.reason, onnx_row.facts)


def test_ops_of_one_spelling_in_both_tables_agree_unless_listed():
    """An ATen op and an ONNX op of the same name (aten.log and Log) get one meaning, or are listed in DIFFERENT."""
    different = {(aten, op[1]) for aten, op in DIFFERENT}
    fx_names = {op.lower(): op for row in fx_policy.POLICY for op in row.ops}
    checked = 0
    for row in onnx_policy.POLICY:
        for op in row.ops:
            aten = fx_names.get(op.lower())
            if aten is None or row.domain or (aten, op) in different:
                continue
            checked += 1
            assert _fx(aten).kind is row.kind, (aten, op)
    assert checked > 50


@pytest.mark.parametrize("rows, listed", [(FX_ROWS, FX_ONLY), (ONNX_ROWS, ONNX_ONLY)], ids=["fx", "onnx"])
def test_front_end_only_kinds_are_listed(rows, listed):
    own = {row.kind.name for row in rows if KINDS.get(row.kind.name) is not row.kind}
    assert own == set(listed)
    assert not own & set(KINDS), "a front end's own kind takes the name of a shared one"


def test_a_kind_checks_its_facts():
    assert OpKind("sum", Category.FP32, "sums", frozenset({REDUCTION})).facts == {REDUCTION}
    with pytest.raises(ValueError, match="op kind 'sum': unknown facts"):
        OpKind("sum", Category.FP32, "sums", frozenset({"sums"}))


def test_the_heavy_ops_of_both_front_ends_are_the_ops_of_the_heavy_kinds():
    assert {kind.name for kind in HEAVY} == {"matrix multiply", "convolution", "attention", "recurrent cell"}
    assert all(kind.category is Category.LOW for kind in HEAVY)
    assert onnx_policy.HEAVY_OPS == {"MatMul", "Gemm", "Einsum", "Conv", "ConvTranspose", "Attention", "LSTM", "GRU",
                                     "RNN"}
    assert {"linear", "mm", "conv2d", "conv_transpose2d", "scaled_dot_product_attention", "lstm", "gru_cell"} \
        <= fx_policy.HEAVY_OPS
    assert not fx_policy.HEAVY_OPS & {"mv", "_grouped_mm", "linalg_vecdot", "softmax", "add"}
    ms_attention = helper.make_node("Attention", ["q"], ["y"], domain="com.microsoft")
    assert onnx_policy.is_heavy(helper.make_node("Einsum", ["a", "b"], ["c"], equation="ij,jk->ik"))
    assert not onnx_policy.is_heavy(ms_attention) and not onnx_policy.is_heavy(helper.make_node("Relu", ["a"], ["b"]))


def test_every_op_the_mac_counters_count_is_a_heavy_op():
    counted = {*fx_macs._MATMULS, *fx_macs._CONVS, *fx_macs._CONV_TRANSPOSES, *fx_macs._RECURRENT_LAYERS,
               *fx_macs._RECURRENT_CELLS, "scaled_dot_product_attention"}
    assert counted <= fx_policy.HEAVY_OPS, sorted(counted - fx_policy.HEAVY_OPS)
    assert set(onnx_macs._COUNTERS) <= onnx_policy.HEAVY_OPS, sorted(set(onnx_macs._COUNTERS) - onnx_policy.HEAVY_OPS)
