"""amppass.convert on a transformers decoder keeps generate(): amppass.serving.dropin."""

from __future__ import annotations

import copy

import pytest
import torch

import amppass
from tests.helpers.decoders import agreeing_steps, decoder, greedy, prompt


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen2"])
def test_converted_decoder_generates_fp32s_greedy_tokens_with_its_cache(family):
    model = decoder(family)
    before = copy.deepcopy(model.state_dict())
    fast = amppass.convert(model, (prompt(),), "bf16", plan_for="coverage")
    assert isinstance(fast, type(model)) and fast.config.to_dict() == model.config.to_dict()
    assert fast.config is not model.config and fast.dtype == torch.float32
    ids = prompt(seed=4)  # fp32's top-2 logits are apart at every step of this prompt (tests/helpers/decoders.py)
    assert agreeing_steps(greedy(model, ids, 12), greedy(fast, ids, 12)) >= 8
    # the prompt and every decode step ran on the converted graphs: a plan for the prompt with generate()'s
    # empty cache, one for the decode steps with the cache length dynamic
    report = amppass.report(fast)
    plans = report.info["plans"]
    assert len(plans) == 3 and ">=" in plans[2]["inputs"].split("cache")[1]
    assert report.info["dtype"] == "bf16" and any(r.precision == "bf16" for r in report.rows if "linear" in r.op)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "the caller's model is unchanged"
    assert not set(map(id, model.modules())) & set(map(id, fast.modules())), "it holds none of the original's modules"


def test_converted_decoder_serves_forward_calls_as_the_model_does():
    model = decoder("llama")
    ids = prompt(length=6, batch=2, seed=2)
    fast = amppass.convert(model, (ids,), "bf16", plan_for="coverage")
    with torch.no_grad():
        out, ref = fast(ids), model(ids)
        assert type(out) is type(ref) and torch.allclose(out.logits, ref.logits, atol=5e-2)
        as_tuple = fast(ids, return_dict=False)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], fast(ids).logits)
        step = out.logits[:, -1:].argmax(-1)
        later = fast(step, past_key_values=out.past_key_values)
        ref_later = model(step, past_key_values=ref.past_key_values)
    assert torch.allclose(later.logits, ref_later.logits, atol=5e-2)
    fast.generation_config.max_new_tokens = 3  # its own copy
    assert model.generation_config.max_new_tokens != 3


def test_a_model_that_does_not_generate_comes_back_in_its_class_without_generate():
    from transformers import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)).eval()
    fast = amppass.convert(model, (prompt(vocab=100),), "bf16", plan_for="coverage")
    assert isinstance(fast, LlamaModel) and not fast.can_generate() and not hasattr(fast, "generate")
    assert isinstance(fast.converted, torch.fx.GraphModule) and fast.graph is fast.converted.graph


def test_saving_a_converted_decoder_says_what_is_saved(tmp_path):
    model = decoder("gpt2")
    fast = amppass.convert(model, (prompt(),), "bf16", plan_for="coverage")
    with pytest.raises(amppass.InputError, match=r"amppass.save\(model.converted, path\)"):
        amppass.save(fast, tmp_path / "model.pt2")
    assert not (tmp_path / "model.pt2").exists()


def test_an_encoder_decoder_converts_without_a_generate_that_cannot_run_and_says_what_does(caplog):
    """T5 came back in its class with generate(), whose encoder step then failed ('You must specify exactly one
    of input_ids or inputs_embeds'): the converted graph is the whole model's forward."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                num_heads=4, decoder_start_token_id=0)).eval()
    ids, decoder_ids = torch.randint(0, 300, (2, 12)), torch.randint(0, 300, (2, 5))
    with caplog.at_level("WARNING", logger="amppass"):
        fast = amppass.convert(model, (ids,), example_kwargs={"decoder_input_ids": decoder_ids}, dtype="bf16",
                               plan_for="coverage")
    assert isinstance(fast, T5ForConditionalGeneration) and fast.config.d_model == 64
    assert "encoder-decoder" in caplog.text and "backend='amppass'" in caplog.text
    with pytest.raises(amppass.InputError, match=r"encoder-decoder.*backend='amppass'"):
        fast.generate(ids, max_new_tokens=2)
    got, expected = fast(ids, decoder_input_ids=decoder_ids).logits, model(ids, decoder_input_ids=decoder_ids).logits
    assert (got - expected).norm() <= 3e-2 * expected.norm()
