"""transformers' pipelines run converted encoders as they run the originals (amppass.serving.dropin).

Pipelines read ``model.device``, ``model.dtype``, ``model.config`` and ``can_generate()`` before calling the
model; a converted encoder came back as a bare graph module without them (``AttributeError: 'GraphModule'
object has no attribute 'device'``). Tiny BERTs with random weights and a tokenizer over a vocabulary written
here: nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

import amppass

transformers = pytest.importorskip("transformers")

WORDS = "the a cat dog sat on mat ran fast slow big small red blue house tree car road long".split()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    vocab = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS))
    return transformers.BertTokenizerFast(vocab_file=str(vocab))


def _model(cls):
    config = transformers.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                                     num_labels=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(config).eval()


def _converted(model, tokenizer):
    example = tokenizer(["the cat sat on the mat", "a dog ran"], return_tensors="pt", padding=True)
    return amppass.convert(model, example_kwargs=example, dtype="bf16", plan_for="coverage")  # a BatchEncoding


def test_feature_extraction_pipeline_runs_a_converted_encoder(tokenizer):
    model = _model(transformers.BertModel)
    fast = _converted(model, tokenizer)
    text = "the big red car ran on the long road fast"  # longer than the example: a dynamic length
    expected = torch.tensor(transformers.pipeline("feature-extraction", model=model, tokenizer=tokenizer)(text))
    got = torch.tensor(transformers.pipeline("feature-extraction", model=fast, tokenizer=tokenizer)(text))
    assert got.shape == expected.shape
    assert (got - expected).norm() <= 2e-2 * expected.norm()
    assert amppass.report(fast).info["recaptures"] == 0, "the example's plan took the pipeline's call"


def test_fill_mask_pipeline_runs_a_converted_masked_lm(tokenizer):
    model = _model(transformers.BertForMaskedLM)
    fast = _converted(model, tokenizer)
    text = "the big [MASK] ran on the road"
    every = len(WORDS) + 5
    expected = transformers.pipeline("fill-mask", model=model, tokenizer=tokenizer, top_k=every)(text)
    got = transformers.pipeline("fill-mask", model=fast, tokenizer=tokenizer, top_k=every)(text)
    expected_scores = {row["token"]: row["score"] for row in expected}
    got_scores = {row["token"]: row["score"] for row in got}
    assert got_scores.keys() == expected_scores.keys()
    assert max(abs(got_scores[t] - s) for t, s in expected_scores.items()) < 5e-3


def test_text_classification_pipeline_runs_a_converted_classifier(tokenizer):
    model = _model(transformers.BertForSequenceClassification)
    fast = _converted(model, tokenizer)
    texts = ["the cat sat", "a small blue house on the long road"]
    expected = transformers.pipeline("text-classification", model=model, tokenizer=tokenizer, top_k=None)(texts)
    got = transformers.pipeline("text-classification", model=fast, tokenizer=tokenizer, top_k=None)(texts)
    for want, have in zip(expected, got, strict=False):
        want, have = {r["label"]: r["score"] for r in want}, {r["label"]: r["score"] for r in have}
        assert want.keys() == have.keys() and max(abs(want[k] - have[k]) for k in want) < 5e-3
