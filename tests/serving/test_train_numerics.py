"""fp16 train-mode gradients are as close to fp32's as autocast's, on a convolutional net with batch norm in
train mode (transformers' ResNet): the worst parameter's gradient cosine to fp32 no worse than autocast's by
more than noise, both with a loss scale of 2**8."""

from __future__ import annotations

import copy

import pytest
import torch

import amppass

transformers = pytest.importorskip("transformers")

SCALE = 2.0 ** 8


def _resnet() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3)
    inputs = {"pixel_values": torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
              "labels": torch.tensor([0, 1, 2, 0])}
    return transformers.ResNetForImageClassification(config).train(), inputs


def _grads(model: torch.nn.Module, inputs: dict, autocast: bool = False) -> dict[str, torch.Tensor]:
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = model(**inputs).loss
    (loss * SCALE).backward()
    return {name: p.grad.double().flatten() / SCALE for name, p in model.named_parameters() if p.grad is not None}


def _worst_cosine(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    largest = max(float(g.norm()) for g in reference.values())
    return min(float(torch.nn.functional.cosine_similarity(grads[name], ref, dim=0))
               for name, ref in reference.items() if float(ref.norm()) > 1e-4 * largest)


def test_resnet_fp16_gradients_are_as_close_to_fp32_as_autocasts():
    model, inputs = _resnet()
    reference = _grads(copy.deepcopy(model), inputs)
    autocast = _worst_cosine(_grads(copy.deepcopy(model), inputs, autocast=True), reference)
    converted = amppass.convert(copy.deepcopy(model), (), example_kwargs=inputs, dtype=torch.float16, mode="train",
                                plan_for="coverage")
    ours = _worst_cosine(_grads(converted, inputs), reference)
    assert ours > autocast - 2e-3, (ours, autocast)
