"""Lean ONNX plans: weights and constants beside low activations run low and are stored low once
when they fit; MatMul+Add and Conv+BatchNorm(+ReLU/Clip/HardSwish) chains stay low; softmax follows its
input; what does not fit keeps fp32 with its reason. Structure, numerics against fp32, validity."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.onnx.simulate import simulated
from tests.helpers.onnx_graphs import check_converted, meta, model_of, session, vinfo, weight

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
RNG = np.random.default_rng(16)


def casts(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if meta(n).get("cast")]


def plan(model: onnx.ModelProto) -> dict[str, dict]:
    return {n.name: meta(n) for n in model.graph.node if meta(n) and not meta(n).get("cast")}


def feed(shape=(2, 8), scale: float = 1.0) -> dict:
    return {"x": (RNG.standard_normal(shape) * scale).astype(np.float32)}


def const(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, np.float32), name)


def test_matmul_bias_gelu_matmul_chain_stays_low_with_its_weights_stored_low_once():
    """x -> MatMul -> Add(b) -> Gelu -> MatMul -> Add(b) -> Mul(scale): one cast in, one out; every bias and
    the scale stored fp16, the bias read twice stored once."""
    model = model_of(
        [helper.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
         helper.make_node("Add", ["h", "b"], ["hb"], name="bias1"),
         helper.make_node("Gelu", ["hb"], ["g"], name="gelu"),
         helper.make_node("MatMul", ["g", "W2"], ["o"], name="mm2"),
         helper.make_node("Add", ["o", "b"], ["ob"], name="bias2"),
         helper.make_node("Mul", ["ob", "scale"], ["y"], name="scale")],
        [vinfo("x")], [vinfo("y")],
        [weight("W1", 8, 8), weight("W2", 8, 8), weight("b", 8), const("scale", 0.125)], opset=20,
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, feed())
    decisions = plan(converted)
    assert all(decisions[n]["precision"] == "low" for n in ("mm1", "bias1", "gelu", "mm2", "bias2", "scale"))
    assert "the weights it reads fit fp16" in decisions["bias1"]["reason"]
    assert [c.input[0] for c in casts(converted)] == ["x", "y__fp16"]
    inits = {i.name: i.data_type for i in converted.graph.initializer}
    assert inits == {"W1": F16, "W2": F16, "b": F16, "scale": F16}


def _conv_bn_block(opset: int = 17, training: bool = False) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> Conv -> BatchNormalization -> Clip(0, 6) -> HardSwish."""
    c = 4
    inits = [weight("w1", c, 3, 3, 3), weight("w2", c, c, 3, 3), const("lo", 0.0), const("hi", 6.0)]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1])]
    for i, (src, dst) in enumerate((("c1", "n1"), ("c2", "n2")), 1):
        inits += [const(f"g{i}", RNG.uniform(0.5, 1.5, c)), const(f"beta{i}", RNG.uniform(-0.2, 0.2, c)),
                  const(f"mean{i}", RNG.uniform(-0.5, 0.5, c)), const(f"var{i}", RNG.uniform(0.5, 2.0, c))]
        trains = training and i == 2
        outputs = [dst, f"running_mean{i}", f"running_var{i}"] if trains else [dst]
        nodes.append(helper.make_node("BatchNormalization", [src, f"g{i}", f"beta{i}", f"mean{i}", f"var{i}"],
                                      outputs, name=f"bn{i}", **({"training_mode": 1} if trains else {})))
        if i == 1:
            nodes += [helper.make_node("Relu", ["n1"], ["r1"], name="relu"),
                      helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1])]
    nodes += [helper.make_node("Clip", ["n2", "lo", "hi"], ["k"], name="clip"),
              helper.make_node("HardSwish", ["k"], ["y"], name="hardswish")]
    return model_of(nodes, [vinfo("x", shape=(2, 3, 8, 8))], [vinfo("y", shape=(2, c, 8, 8))], inits, opset=opset)


def test_conv_batchnorm_relu_clip_hardswish_chain_stays_low():
    model = _conv_bn_block()
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, feed((2, 3, 8, 8)))
    decisions = plan(converted)
    assert {d["precision"] for d in decisions.values()} == {"low"}
    assert "batch normalisation with stored statistics" in decisions["bn1"]["reason"]
    assert len(casts(converted)) == 2  # the input in, the output out
    assert all(i.data_type == F16 for i in converted.graph.initializer)


def test_batchnorm_in_training_mode_keeps_fp32():
    model = _conv_bn_block(opset=15, training=True)
    converted = amppass.convert_onnx(model)
    onnx.checker.check_model(converted, full_check=True)
    decisions = plan(converted)
    assert decisions["bn2"]["precision"] == "fp32" and "training mode" in decisions["bn2"]["reason"]
    assert decisions["bn1"]["precision"] == "low"


@pytest.mark.parametrize("constant, why", [
    (1e-12, "moves by 1 of its size"),  # an epsilon: flushes to zero in fp16
    ([1e-6] * 8, "below fp16's smallest normal"),  # a layer scale at its initial value: 4 of 11 bits left
    (-3.4e38, "beyond fp16's largest"),  # a mask fill: painting's range rule
])
def test_constant_that_does_not_fit_fp16_keeps_its_op_fp32_with_the_reason(constant, why):
    model = model_of(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "c"], ["y"], name="add_c")],
        [vinfo("x")], [vinfo("y")], [weight("W", 8, 8), const("c", constant)],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, feed())
    decision = plan(converted)["add_c"]
    assert decision["precision"] == "fp32" and why in decision["reason"], decision["reason"]
    assert {i.name: i.data_type for i in converted.graph.initializer}["c"] == F32


def test_bias_with_a_few_subnormal_entries_fits_but_a_subnormal_divisor_does_not():
    bias = RNG.standard_normal(8).astype(np.float32)
    bias[:2] = [3e-6, 1e-9]  # subnormal and flushed entries among normal ones barely move the norm
    divisor = np.full(8, 2.0, np.float32)
    divisor[0] = 3e-6
    model = model_of(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "b"], ["a"], name="add_b"),
         helper.make_node("MatMul", ["a", "W"], ["m"], name="mm2"),
         helper.make_node("Div", ["m", "d"], ["y"], name="div_d")],
        [vinfo("x")], [vinfo("y")], [weight("W", 8, 8), const("b", bias), const("d", divisor)],
    )
    converted = amppass.convert_onnx(model)
    decisions = plan(converted)
    assert decisions["add_b"]["precision"] == "low"
    assert decisions["div_d"]["precision"] == "fp32" and "divides by it" in decisions["div_d"]["reason"]
    assert decisions["div_d"]["evidence"]["rule"] == "weight-fit"
    check_converted(model, converted, feed(), min_heavy=1.0)


def test_concat_with_a_weight_keeps_the_weight_fp32_as_type_promotion_does():
    """A class token joined to patch embeddings (ViT): its values become data of the result."""
    model = model_of(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Concat", ["cls", "h"], ["y"], name="cat", axis=0)],
        [vinfo("x")], [vinfo("y", shape=(3, 8))], [weight("W", 8, 8), weight("cls", 1, 8)],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, feed())
    decision = plan(converted)["cat"]
    assert decision["precision"] == "fp32" and "joins weight 'cls'" in decision["reason"]


def test_softmax_follows_its_input_between_low_matmuls():
    """Decomposed attention: MatMul -> Mul(scale) -> Add(mask) -> Softmax -> MatMul needs no cast inside."""
    model = model_of(
        [helper.make_node("MatMul", ["x", "Wq"], ["q"], name="q"),
         helper.make_node("MatMul", ["q", "Wk"], ["s"], name="scores"),
         helper.make_node("Mul", ["s", "scale"], ["ss"], name="scale"),
         helper.make_node("Add", ["ss", "mask"], ["sm"], name="mask"),
         helper.make_node("Softmax", ["sm"], ["p"], name="softmax", axis=-1),
         helper.make_node("MatMul", ["p", "Wv"], ["y"], name="mix")],
        [vinfo("x", shape=(8, 8))], [vinfo("y", shape=(8, 8))],
        [weight("Wq", 8, 8), weight("Wk", 8, 8), weight("Wv", 8, 8), const("scale", 0.35),
         const("mask", np.triu(np.full((8, 8), -1e4, np.float32), 1))],
    )
    converted = amppass.convert_onnx(model)
    check_converted(model, converted, feed((8, 8)))
    assert {d["precision"] for d in plan(converted).values()} == {"low"}
    assert len(casts(converted)) == 2


@pytest.mark.slow
def test_dynamo_bert_needs_no_more_casts_than_the_fx_plan():
    """The headline measurement: a 4-layer BERT from the dynamo exporter; Casts within the FX plan's + 2, most
    float work low, and the error against fp32 (onnxruntime CPU and fp16-storage simulation) small."""
    from transformers import BertConfig, BertModel

    from amppass.pipelines.export_onnx import export_fp32

    config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=256, attn_implementation="sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = BertModel(config).eval()
    ids = (torch.randint(1, 1000, (1, 32), generator=torch.Generator().manual_seed(0)),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = export_fp32(model, ids)
    converted = amppass.convert_onnx(fp32, "fp16")
    fx_casts = amppass.convert(model, ids, torch.float16, plan_for="coverage").meta["amppass"]["casts"]
    assert len(casts(converted)) <= fx_casts + 2
    rows = [r for r in amppass.report(converted).rows if r.precision != "-"]
    assert sum(r.precision == "fp16" for r in rows) >= 0.75 * len(rows)
    feeds = {fp32.graph.input[0].name: ids[0].numpy()}
    want = session(fp32).run(None, feeds)
    for run in (session(converted), session(simulated(converted))):
        got = run.run(None, feeds)
        assert np.linalg.norm(got[0] - want[0]) / np.linalg.norm(want[0]) < 2e-3


def test_batchnorm_weights_behind_identity_nodes_are_weights(tmp_path):
    """The TorchScript exporter without constant folding (eval BatchNorm kept as a node) reads the BN's
    parameters through Identity nodes: they are bypassed, so Conv-BN-ReLU runs fp16 with its statistics
    stored fp16 (the last block's BN may take the output's cast before it), with as many Casts as the FX
    plan (+2)."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8),
                              torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1, bias=False),
                              torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    with torch.no_grad():
        for module in net:
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    net.eval()
    x = torch.randn(1, 3, 16, 16)
    path = tmp_path / "convbn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (x,), str(path), dynamo=False, do_constant_folding=False, input_names=["x"])
    exported = onnx.load(str(path))
    identities = [n for n in exported.graph.node if n.op_type == "Identity"]
    assert identities, "the exporter no longer wraps the parameters: this test checks nothing"
    converted = amppass.convert_onnx(exported)
    check_converted(exported, converted, {"x": x.numpy()})
    decisions = plan(converted)
    bns = [n.name for n in converted.graph.node if n.op_type == "BatchNormalization"]
    assert decisions[bns[0]]["precision"] == "low" and "fit fp16" in decisions[bns[0]]["reason"]
    assert not [n for n in converted.graph.node if n.op_type == "Identity"]
    first = next(n for n in converted.graph.node if n.name == bns[0])
    stored = {i.name: i.data_type for i in converted.graph.initializer}
    assert [stored[v] for v in first.input[1:]] == [F16] * 4  # scale, bias, mean, variance
    fx_casts = amppass.convert(net, (x,), torch.float16, plan_for="coverage").meta["amppass"]["casts"]
    assert len(casts(converted)) <= fx_casts + 2


def test_identity_of_a_weight_that_is_a_graph_output_or_read_in_a_subgraph_stays():
    from amppass.onnx.normalize import bypass_weight_identities

    then = helper.make_graph([helper.make_node("Identity", ["wi2"], ["t"])], "then", [], [vinfo("t", shape=(8,))])
    model = model_of(
        [helper.make_node("Identity", ["w"], ["wi1"], name="id1"),
         helper.make_node("Identity", ["w"], ["wi2"], name="id2"),
         helper.make_node("Identity", ["w"], ["wi3"], name="id3"),
         helper.make_node("Add", ["x", "wi3"], ["y"], name="add"),
         helper.make_node("If", ["c"], ["z"], name="if", then_branch=then, else_branch=then)],
        [vinfo("x", shape=(8,)), helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [vinfo("y", shape=(8,)), vinfo("wi1", shape=(8,)), vinfo("z", shape=(8,))], [weight("w", 8)])
    assert bypass_weight_identities(model) == 1
    assert [n.name for n in model.graph.node] == ["id1", "id2", "add", "if"]
    assert list(model.graph.node[2].input) == ["x", "w"]
    onnx.checker.check_model(model, full_check=True)
