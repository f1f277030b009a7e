"""generate(): a transformers decoder converted to bf16 comes back in its own class and generates.

A small Llama with random weights (built from a config: nothing is downloaded). ``amppass.convert`` returns a
``LlamaForCausalLM`` whose forward runs the converted graphs: one plan for the prompt and one that serves
every decode step with its growing cache. Greedy tokens follow fp32's until two logits are nearly tied,
where either is a correct rounding; the logits of the prompt are compared directly.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import amppass


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    prompt = torch.randint(0, 1000, (2, 12))

    fast = amppass.convert(model, (prompt,), dtype="bf16", plan_for="coverage")
    assert isinstance(fast, LlamaForCausalLM)
    tokens = fast.generate(prompt, max_new_tokens=16, do_sample=False)
    reference = model.generate(prompt, max_new_tokens=16, do_sample=False)
    with torch.no_grad():
        want, got = model(prompt).logits, fast(prompt).logits
    error = float((got - want).norm() / want.norm())
    same = int((tokens == reference).all(dim=0).long().cumprod(0).sum()) - prompt.shape[1]
    print(amppass.report(fast).summary())
    print(f"{tokens.shape[1] - prompt.shape[1]} new tokens per row; the first {same} equal fp32's in every row; "
          f"prompt logits' relative error against fp32: {error:.1e}")
    assert tokens.shape == reference.shape and error < 2e-2


if __name__ == "__main__":
    main()
