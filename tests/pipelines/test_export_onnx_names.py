"""export_onnx names the file's outputs as the model declares them (a ModelOutput's or a dict's keys, ``output``
for a tensor, ``output_<i>`` for a tuple) or as ``output_names=`` says, and gives the inputs of one batch one
``batch`` symbol and the token inputs of one length one ``sequence`` symbol: consumers such as optimum's
ORTModelForFeatureExtraction bind outputs by name and read one batch size, where the export named them
``layer_norm_2`` and ``tanh`` and gave input_ids and attention_mask different batch symbols."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass.onnx.rename import rename_outputs
from amppass.pipelines.export_onnx import declared_output_names

transformers = pytest.importorskip("transformers")


def dims(info: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in info.type.tensor_type.shape.dim]


def rel(got: np.ndarray, want: torch.Tensor) -> float:
    want = want.detach().double().numpy()
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100)
    return transformers.BertModel(config).eval()


class Tokens(torch.nn.Module):
    """A dict of two outputs, one from each token input: nothing in its code ties their batch or length."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 4)

    def forward(self, input_ids, attention_mask):
        return {"hidden": self.fc(self.emb(input_ids)), "lengths": attention_mask.float().sum(-1)}


def tokens(batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, length // 2:] = 0
    return ids, mask


def test_a_bert_model_exports_last_hidden_state_and_pooler_output_with_shared_symbols(tmp_path):
    """What optimum's ORTModelForFeatureExtraction reads: the output named last_hidden_state, fed by name."""
    bert = tiny_bert()
    path = tmp_path / "bert.fp16.onnx"
    returned = amppass.export_onnx(bert, tokens(2, 8), path, dtype="fp16")
    saved = onnx.load(str(path))
    onnx.checker.check_model(saved, full_check=True)
    for model in (returned, saved):
        assert [o.name for o in model.graph.output] == ["last_hidden_state", "pooler_output"]
        ids, mask = model.graph.input
        assert (ids.name, mask.name) == ("input_ids", "attention_mask")
        assert dims(ids) == dims(mask) == ["batch", "sequence"]
        assert dims(model.graph.output[0])[:2] == ["batch", "sequence"] and dims(model.graph.output[1])[0] == "batch"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids, mask = tokens(3, 13)
    got = dict(zip(["last_hidden_state", "pooler_output"],
                   session.run(["last_hidden_state", "pooler_output"],
                               {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}), strict=False))
    with torch.no_grad():
        want = bert(input_ids=ids, attention_mask=mask)
    for name in got:
        assert got[name].shape == tuple(want[name].shape)
        assert rel(got[name], want[name]) < 1e-2, name


def test_a_dict_output_is_named_by_its_keys_and_unrelated_token_inputs_share_symbols(tmp_path):
    net = Tokens().eval()
    path = tmp_path / "tokens.onnx"
    model = amppass.export_onnx(net, tokens(2, 6), path)
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["hidden", "lengths"]
    assert [dims(i) for i in model.graph.input] == [["batch", "sequence"]] * 2
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids, mask = tokens(5, 3)
    got = session.run(["lengths", "hidden"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
    with torch.no_grad():
        want = net(ids, mask)
    assert rel(got[0], want["lengths"]) < 1e-2 and rel(got[1], want["hidden"]) < 1e-2


def test_output_names_given_name_the_outputs_of_the_file(tmp_path):
    net = Tokens().eval()
    model = amppass.export_onnx(net, tokens(2, 6), tmp_path / "named.onnx", output_names=["h", "n"])
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in onnx.load(str(tmp_path / "named.onnx")).graph.output] == ["h", "n"]
    session = ort.InferenceSession(str(tmp_path / "named.onnx"), providers=["CPUExecutionProvider"])
    ids, mask = tokens(2, 6)
    with torch.no_grad():
        assert rel(session.run(["n"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0],
                   net(ids, mask)["lengths"]) < 1e-2


def test_a_tuple_output_is_output_0_and_output_1_and_a_model_refusing_a_shared_batch_still_exports(tmp_path):
    """y.view(2, 4) fixes y's batch: a batch symbol shared with x is refused, and each keeps its own."""

    class Two(torch.nn.Module):
        def forward(self, x, y):
            return x * 2, y.view(2, 4) + 1

    model = amppass.export_onnx(Two().eval(), (torch.randn(2, 4), torch.randn(2, 4)), tmp_path / "two.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["output_0", "output_1"]
    single = amppass.export_onnx(torch.nn.Linear(4, 3).eval(), (torch.randn(2, 4),), tmp_path / "one.onnx")
    assert [o.name for o in single.graph.output] == ["output"]


def test_declared_names_follow_the_flattened_outputs():
    t = torch.zeros(1)
    pair = collections.namedtuple("Pair", "boxes scores")
    assert declared_output_names(t) == ["output"]
    assert declared_output_names((t, [t, t], None, 3)) == ["output_0", "output_1.0", "output_1.1"]
    assert declared_output_names({"logits": t, "past_key_values": ((t, t),)}) == [
        "logits", "past_key_values.0.0", "past_key_values.0.1"]
    assert declared_output_names((pair(t, t), {"a.b": t, "a": {"b": t}})) == [
        "output_0.boxes", "output_0.scores", "output_1.a.b", "output_1.a.b_1"]
    assert declared_output_names({"x": t, "y": t}, inputs={"x"}) == ["x_output", "y"]


@pytest.mark.parametrize("names, words", [
    ("hidden", ("output_names must be a list of strings", "got str", "one distinct string per output")),
    (["hidden", 3], ("holds 3", "not a non-empty string")),
    (["h", "h"], ("names 'h' more than once", "a name of its own")),
    (["h"], ("output_names gives 1 name,", "has 2 outputs (named by the exporter:", "pass 2 names")),
    (["input_ids", "n"], ("'input_ids', the name of an input", "choose another output name")),
])
def test_bad_output_names_are_refused_with_the_fix(tmp_path, names, words):
    with pytest.raises(amppass.InputError) as caught:
        amppass.export_onnx(Tokens().eval(), tokens(2, 6), tmp_path / "bad.onnx", output_names=names)
    for word in words:
        assert word in str(caught.value), str(caught.value)
    assert not (tmp_path / "bad.onnx").exists()


def test_renaming_reaches_every_reader_and_gives_inputs_and_repeats_an_identity():
    """Outputs: the graph input, a value read by a nested If body, the same value again, an initializer, a value
    whose wanted name an inner value holds; names swapped between outputs."""
    f32 = TensorProto.FLOAT
    then = helper.make_graph([helper.make_node("Neg", ["h"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", f32, [2])])
    other = helper.make_graph([helper.make_node("Abs", ["h"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", f32, [2])])
    nodes = [helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Sigmoid", ["h"], ["b"]),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["c"]),
             helper.make_node("If", ["c"], ["a"], then_branch=then, else_branch=other)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", f32, [2])],
        [helper.make_tensor_value_info(n, f32, [2] if n != "zero" else []) for n in ("x", "h", "a", "h", "b", "zero")],
        [numpy_helper.from_array(np.zeros((), np.float32), "zero")],
        value_info=[helper.make_tensor_value_info("h", f32, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    x = np.array([1.0, -2.0], np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    names = ["echo", "a", "b", "again", "h", "zero_out"]
    assert rename_outputs(model, names)
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == names and model.graph.input[0].name == "x"
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for g, w in zip(got, want, strict=False):
        np.testing.assert_array_equal(g, w)
    assert not rename_outputs(model, names)
    with pytest.raises(ValueError, match="name inputs"):
        rename_outputs(model, ["x", "a", "b", "again", "h", "zero_out2"])


def test_the_torchscript_fallback_names_outputs_and_shares_symbols_too(tmp_path, monkeypatch):
    real = torch.onnx.export

    def dynamo_fails(*args, dynamo=True, **kwargs):
        if dynamo:
            raise RuntimeError("dynamo off in this test")
        return real(*args, dynamo=False, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_fails)
    model = amppass.export_onnx(Tokens().eval(), tokens(2, 6), tmp_path / "ts.onnx")
    onnx.checker.check_model(model, full_check=True)
    assert [o.name for o in model.graph.output] == ["hidden", "lengths"]
    assert [dims(i) for i in model.graph.input] == [["batch", "sequence"]] * 2
