"""Small transformers decoders with random weights, and how to compare their greedy generations with fp32's.

Greedy decoding picks the largest logit; where fp32's two largest are closer than the low-precision run moves
logits, either token is a correct rounding of the same computation, and from there the two sequences may part.
:func:`agreeing_steps` therefore compares tokens step by step while fp32's top-2 margin is more than twice the
largest logit difference measured at that step (the two runs share the prefix up to there, so their logits
are comparable), and returns how many steps it compared: a test asserts both the tokens and that count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

VOCAB = 1000


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        attn_implementation="sdpa"))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4,
                                      bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, attn_implementation="sdpa"))


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        attn_implementation="sdpa"))


DECODERS: dict[str, Callable[[], torch.nn.Module]] = {"llama": _llama, "gpt2": _gpt2, "qwen2": _qwen2}


def deepseek_v3(hidden: int = 64, layers: int = 3, experts: int = 8, groups: int = 2) -> torch.nn.Module:
    """A tiny DeepSeek-V3 (multi-head latent attention, grouped top-k routing over ``experts``, a shared expert)
    in eval mode with seeded weights; its first layer dense, the rest mixtures of experts."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=32,
        num_hidden_layers=layers, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=experts, num_experts_per_tok=2, n_group=groups, topk_group=1, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        max_position_embeddings=128)
    torch.manual_seed(0)
    return DeepseekV3ForCausalLM(config).eval()


def decoder(name: str) -> torch.nn.Module:
    """An eval-mode ``*ForCausalLM`` of family ``name`` with seeded random weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return DECODERS[name]().eval()


def prompt(length: int = 8, batch: int = 1, seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(1, vocab - 1, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model: Any, ids: torch.Tensor, new_tokens: int) -> Any:
    """``generate`` greedily with the raw logits of every step kept."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=VOCAB - 1)


def agreeing_steps(reference: Any, out: Any, relative: float = 3e-2) -> int:
    """Steps at which ``out`` (a low-precision run) chose fp32's token, compared while that is decidable.

    Asserts, at every compared step, equal tokens and logits within ``relative`` of fp32's (L2). Stops at the
    first step whose fp32 top-2 margin is not more than twice the largest logit difference (module docstring).
    """
    start = reference.sequences.shape[1] - len(reference.logits)
    for step, (ref, got) in enumerate(zip(reference.logits, out.logits, strict=False)):
        top = ref.float().topk(2, dim=-1).values
        margin = float((top[..., 0] - top[..., 1]).min())
        difference = float((got.float() - ref.float()).abs().max())
        if margin <= 2 * difference:
            return step
        error = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert error < relative, f"step {step}: logits {error:.2e} off fp32's"
        assert torch.equal(out.sequences[:, start + step], reference.sequences[:, start + step]), f"step {step}"
    return len(reference.logits)
