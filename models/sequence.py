"""Sequence models over token ids: recurrent language models, a ``nn.TransformerEncoder``, and small configs of
transformers' Mamba, Mistral, Qwen2, T5 and DistilBERT (instantiated from configs, nothing downloaded).

Transformers models use sdpa attention. Weights are random: callers seed the global RNG
(:func:`models.arch.build_arch` does).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

VOCAB = 2000


def token_inputs(vocab: int = VOCAB) -> Callable[[torch.Generator, int, int], tuple]:
    """A maker of (batch, length) token ids in [1, vocab): id 0 is left for padding."""

    def make(g: torch.Generator, batch: int, length: int) -> tuple:
        return (torch.randint(1, vocab, (batch, length), generator=g),)

    return make


def seq2seq_inputs(g: torch.Generator, batch: int, length: int) -> tuple:
    """(input_ids, attention_mask, decoder_input_ids) as a translation batch has them: every row after the first
    is right-padded (id 0, mask 0) to a random length of at least half of ``length``; the decoder sequence is
    half as long and starts with the decoder start token 0."""
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    lengths = torch.randint((length + 1) // 2, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = (torch.arange(length) < lengths[:, None]).long()
    decoder = torch.randint(1, VOCAB, (batch, max(1, length // 2)), generator=g)
    decoder[:, 0] = 0
    return ids * mask, mask, decoder


class RNNLanguageModel(nn.Module):
    """Token embedding -> 2-layer ``nn.LSTM`` or ``nn.GRU`` (batch first) -> linear head over the vocabulary."""

    def __init__(self, cell: type[nn.LSTM] | type[nn.GRU], vocab: int = VOCAB, embed: int = 128, hidden: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.rnn = cell(embed, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)


class TransformerEncoderModel(nn.Module):
    """Token and learned position embeddings -> ``nn.TransformerEncoder`` (d_model 128, 4 heads, 4 post-norm
    layers, feed-forward 512, batch first) with a final LayerNorm."""

    def __init__(self, vocab: int = VOCAB, d_model: int = 128, layers: int = 4, max_len: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d_model), enable_nested_tensor=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.encoder(self.embed(tokens) + self.position(positions))


def lstm() -> nn.Module:
    return RNNLanguageModel(nn.LSTM)


def gru() -> nn.Module:
    return RNNLanguageModel(nn.GRU)


def transformer_encoder() -> nn.Module:
    return TransformerEncoderModel()


def mamba() -> nn.Module:
    """Mamba (hidden 128, state 16, 4 layers); without the mamba_ssm/causal_conv1d kernels transformers runs
    its pure-torch selective scan, a Python loop over the sequence."""
    from transformers import MambaConfig, MambaModel

    config = MambaConfig(vocab_size=VOCAB, hidden_size=128, state_size=16, num_hidden_layers=4, use_cache=False)
    return MambaModel(config)


def _decoder_config(family: str, use_cache: bool):
    from transformers import MistralConfig, Qwen2Config

    if family == "mistral":  # a 64-token sliding window, so sequences longer than it use the banded mask
        return MistralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                             sliding_window=64, use_cache=use_cache, attn_implementation="sdpa")
    return Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       use_cache=use_cache, attn_implementation="sdpa")


def mistral() -> nn.Module:
    from transformers import MistralModel

    return MistralModel(_decoder_config("mistral", use_cache=False))


def mistral_cache() -> nn.Module:
    """Mistral with transformers' default ``use_cache=True``: the output carries a ``DynamicCache``."""
    from transformers import MistralModel

    return MistralModel(_decoder_config("mistral", use_cache=True))


def qwen2() -> nn.Module:
    from transformers import Qwen2Model

    return Qwen2Model(_decoder_config("qwen2", use_cache=False))


def t5_small() -> nn.Module:
    """T5 encoder-decoder (d_model 256, 8 heads of 32, feed-forward 1024, 2 + 2 layers, relative position
    buckets); called as ``model(input_ids, attention_mask, decoder_input_ids)``."""
    from transformers import T5Config, T5Model

    config = T5Config(vocab_size=VOCAB, d_model=256, d_kv=32, d_ff=1024, num_layers=2, num_decoder_layers=2,
                      num_heads=8, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
                      attn_implementation="sdpa")
    return T5Model(config)


def distilbert() -> nn.Module:
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=VOCAB, dim=128, n_layers=2, n_heads=4, hidden_dim=512,
                              attn_implementation="sdpa")
    return DistilBertModel(config)
