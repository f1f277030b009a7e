"""Tests for the model zoo: every small model builds, runs, is finite, has the expected shape, and is deterministic."""

import pytest
import torch

from models import ZOO, ModelCase, build

EXPECTED_SHAPES = {
    "mlp": (2, 10),
    "cnn": (2, 10),
    "resnet": (2, 64, 4, 4),
    "bert": (2, 16, 64),
    "gpt2": (2, 16, 64),
    "vit": (2, 17, 64),
    "llama": (2, 16, 64),
}
KINDS = {"mlp": "mlp", "cnn": "cnn", "resnet": "cnn"}


def _run(case: ModelCase, inputs: tuple) -> torch.Tensor:
    with torch.no_grad():
        out = case.model(*inputs, **case.example_kwargs)
    return out if isinstance(out, torch.Tensor) else out[0]


def test_zoo_names():
    assert set(ZOO) == set(EXPECTED_SHAPES)


@pytest.mark.parametrize("name", ZOO)
def test_small_model_runs(name):
    case = build(name, "small")
    assert case.name == name
    assert case.kind == KINDS.get(name, "transformer")
    assert not case.model.training
    out = _run(case, case.example_inputs)
    assert tuple(out.shape) == EXPECTED_SHAPES[name]
    assert torch.isfinite(out).all()
    assert out.std() > 0


@pytest.mark.parametrize("name", ZOO)
def test_small_model_deterministic(name):
    a, b = build(name, "small"), build(name, "small")
    torch.testing.assert_close(_run(a, a.example_inputs), _run(b, a.example_inputs), rtol=0, atol=0)
    assert all(torch.equal(x, y) for x, y in zip(a.make_inputs(0), a.example_inputs, strict=False))
    assert all(torch.equal(x, y) for x, y in zip(a.make_inputs(5), b.make_inputs(5), strict=False))
    other = a.make_inputs(1)
    assert not torch.equal(other[0], a.example_inputs[0])
    assert [(x.shape, x.dtype) for x in other] == [(x.shape, x.dtype) for x in a.example_inputs]


def test_build_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build("mlp", "small")
    assert torch.equal(torch.rand(3), expected)


def test_unknown_name_and_size():
    with pytest.raises(KeyError):
        build("nope")
    with pytest.raises(ValueError):
        build("mlp", "huge")
