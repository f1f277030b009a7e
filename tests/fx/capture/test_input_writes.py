"""A model that writes into an input object without returning it is refused at capture, never served wrong.

XLM-RoBERTa-XL as a causal LM without ``is_decoder`` (transformers warns, and runs it): with a cache it appends
each step's keys and values to the caller's ``DynamicCache`` and returns ``past_key_values=None``. A captured
graph writes into a copy export rebuilds from the cache's tensors, so the converted model's cache stayed empty
and ``generate()`` departed from fp32 at the second token (logits error 0.53) without a word. Now the capture
says why it cannot serve that call, and the decoder configuration, which returns its cache, generates fp32's
tokens.
"""

from __future__ import annotations

import re

import pytest
import torch

import amppass
from amppass.errors import CaptureError

transformers = pytest.importorskip("transformers")


def _model(is_decoder: bool) -> torch.nn.Module:
    config = transformers.XLMRobertaXLConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=4, intermediate_size=64, is_decoder=is_decoder,
                                             max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.XLMRobertaXLForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(1))


def test_an_input_cache_written_without_being_returned_converts_by_parts_and_the_model_writes_it():
    """No graph can write into the caller's cache: the capture is refused naming the input, and the model converts
    by parts, its own code filling the cache around the converted layers."""
    from amppass.serving.parts import parts_of

    model = _model(is_decoder=False)
    cache = transformers.DynamicCache(config=model.config)
    fast = amppass.convert(model, example_kwargs={"input_ids": _ids(), "cache": cache, "use_cache": True},
                           dtype="bf16", plan_for="coverage")
    assert re.search(r"writes into its input 'cache' \(DynamicCache: 0 tensors -> 4 tensors", parts_of(fast).why_whole)
    assert cache.get_seq_length() == 0  # the conversion ran on copies: the caller's cache is untouched
    theirs, ours = transformers.DynamicCache(config=model.config), transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        want = model(input_ids=_ids(), cache=theirs, use_cache=True).logits
        got = fast(input_ids=_ids(), cache=ours, use_cache=True).logits
    assert ours.get_seq_length() == theirs.get_seq_length() == 8
    assert (got - want).norm() / want.norm() < 3e-2


def test_generate_on_such_a_model_raises_instead_of_departing_from_fp32():
    model = _model(is_decoder=False)
    fast = amppass.convert(model, (_ids(),), example_kwargs={"use_cache": False}, dtype="bf16", plan_for="coverage")
    with pytest.raises(CaptureError, match="use_cache=False"):
        fast.generate(_ids(), max_new_tokens=4, do_sample=False)
    # without a cache it generates, and agrees with fp32
    want = model.generate(_ids(), max_new_tokens=4, do_sample=False, use_cache=False)
    assert torch.equal(fast.generate(_ids(), max_new_tokens=4, do_sample=False, use_cache=False), want)


def test_a_decoder_that_returns_its_cache_generates_fp32s_tokens():
    model = _model(is_decoder=True)
    fast = amppass.convert(model, (_ids(),), example_kwargs={"use_cache": False}, dtype="bf16", plan_for="coverage")
    settings = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want, got = model.generate(_ids(), **settings), fast.generate(_ids(), **settings)
    for step, (a, b) in enumerate(zip(want.logits, got.logits, strict=False)):
        assert (a - b).norm() / a.norm() < 3e-2, step
