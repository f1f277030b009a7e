"""Model zoo: small and base-sized models built from code with random, seeded weights.

Each entry of ``ZOO`` is built by :func:`build` into a :class:`ModelCase` holding an
eval-mode ``torch.nn.Module``, example inputs, and a ``make_inputs(seed)`` factory that
produces fresh inputs of the same shapes and dtypes (for calibration / held-out data).
Nothing is downloaded: transformers models are instantiated from configs.

Every model is capturable with
``torch.export.export(case.model, case.example_inputs, case.example_kwargs, strict=False)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

ZOO: tuple[str, ...] = ("mlp", "cnn", "resnet", "bert", "gpt2", "vit", "llama")
SIZES: tuple[str, ...] = ("small", "base")
SEED = 0


@dataclass
class ModelCase:
    """A model in eval mode plus the inputs needed to run, trace and calibrate it.

    ``example_inputs`` equals ``make_inputs(0)``; use other seeds for held-out data.
    """

    name: str
    model: nn.Module
    example_inputs: tuple
    example_kwargs: dict
    make_inputs: Callable[[int], tuple]
    kind: str  # "mlp" | "cnn" | "transformer"


class MLP(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.act(self.fc1(x))))


class CNN(nn.Module):
    """Stages of conv -> batchnorm -> relu -> maxpool, then adaptive avgpool and a linear head."""

    def __init__(self, channels: tuple[int, ...], num_classes: int, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        c_prev = in_channels
        for c in channels:
            layers += [
                nn.Conv2d(c_prev, c, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(c),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            c_prev = c
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_prev, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def _randomize_batchnorm(model: nn.Module) -> None:
    """Give every BatchNorm non-trivial affine params and running stats, so BN is not an identity."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.1)
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)


def _damp_resnet_residuals(model: nn.Module, scale: float = 0.2) -> None:
    """Shrink the last BatchNorm gain of every residual branch, as training tends to.

    With plain random init each ResNet-50 block grows activations ~1.5x (final std ~300);
    damping keeps activation magnitudes in the range of a trained network.
    """
    from transformers.models.resnet.modeling_resnet import ResNetBasicLayer, ResNetBottleNeckLayer

    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (ResNetBasicLayer, ResNetBottleNeckLayer)):
                m.layer[-1].normalization.weight.mul_(scale)


def _token_inputs(batch: int, seq: int, vocab: int) -> Callable[[int], tuple]:
    def make_inputs(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randint(1, vocab, (batch, seq), generator=g),)

    return make_inputs


def _float_inputs(*shape: int) -> Callable[[int], tuple]:
    def make_inputs(seed: int) -> tuple:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=g),)

    return make_inputs


def _mlp(size: str, batch: int, seq: int):
    d_in, d_hidden, d_out = {"small": (64, 128, 10), "base": (1024, 4096, 1000)}[size]
    return MLP(d_in, d_hidden, d_out), _float_inputs(batch, d_in), "mlp"


def _cnn(size: str, batch: int, seq: int):
    channels, num_classes, hw = {
        "small": ((16, 32), 10, 32),
        "base": ((64, 128, 256, 512), 1000, 224),
    }[size]
    model = CNN(channels, num_classes)
    _randomize_batchnorm(model)
    return model, _float_inputs(batch, 3, hw, hw), "cnn"


def _resnet(size: str, batch: int, seq: int):
    from transformers import ResNetConfig, ResNetModel

    if size == "small":
        config = ResNetConfig(
            embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1], layer_type="bottleneck"
        )
        hw = 32
    else:
        config = ResNetConfig()  # ResNet-50
        hw = 224
    model = ResNetModel(config)
    _randomize_batchnorm(model)
    _damp_resnet_residuals(model)
    return model, _float_inputs(batch, 3, hw, hw), "cnn"


def _bert(size: str, batch: int, seq: int):
    from transformers import BertConfig, BertModel

    if size == "small":
        config = BertConfig(
            vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=512, attn_implementation="sdpa",
        )
    else:
        config = BertConfig(attn_implementation="sdpa")  # BERT-base
    return BertModel(config), _token_inputs(batch, seq, config.vocab_size), "transformer"


def _gpt2(size: str, batch: int, seq: int):
    from transformers import GPT2Config, GPT2Model

    if size == "small":
        config = GPT2Config(
            vocab_size=1000, n_positions=512, n_embd=64, n_layer=2, n_head=4,
            bos_token_id=999, eos_token_id=999, use_cache=False, attn_implementation="sdpa",
        )
    else:
        config = GPT2Config(use_cache=False, attn_implementation="sdpa")  # GPT-2 small (124M)
    return GPT2Model(config), _token_inputs(batch, seq, config.vocab_size), "transformer"


def _vit(size: str, batch: int, seq: int):
    from transformers import ViTConfig, ViTModel

    if size == "small":
        config = ViTConfig(
            image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=128, attn_implementation="sdpa",
        )
    else:
        config = ViTConfig(attn_implementation="sdpa")  # ViT-base/16, 224x224
    hw = config.image_size
    return ViTModel(config), _float_inputs(batch, 3, hw, hw), "transformer"


def _llama(size: str, batch: int, seq: int):
    from transformers import LlamaConfig, LlamaModel

    if size == "small":
        config = LlamaConfig(
            vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            use_cache=False, attn_implementation="sdpa",
        )
    else:
        config = LlamaConfig(
            vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
            num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
            use_cache=False, attn_implementation="sdpa",
        )
    return LlamaModel(config), _token_inputs(batch, seq, config.vocab_size), "transformer"


_BUILDERS = {
    "mlp": _mlp,
    "cnn": _cnn,
    "resnet": _resnet,
    "bert": _bert,
    "gpt2": _gpt2,
    "vit": _vit,
    "llama": _llama,
}


def build(name: str, size: str = "small", batch: int = 2, seq: int = 16) -> ModelCase:
    """Build zoo model ``name`` at ``size`` ("small" or "base") with weights seeded by ``SEED``.

    ``seq`` is the token count for text models and is ignored by the others.
    The global torch RNG state is left untouched.
    """
    if name not in _BUILDERS:
        raise KeyError(f"unknown model {name!r}; expected one of {ZOO}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model, make_inputs, kind = _BUILDERS[name](size, batch, seq)
    model.eval()
    return ModelCase(
        name=name,
        model=model,
        example_inputs=make_inputs(0),
        example_kwargs={},
        make_inputs=make_inputs,
        kind=kind,
    )
