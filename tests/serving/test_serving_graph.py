"""Converted models serve every shape the original serves: dynamic capture, later plans, guard errors."""

from __future__ import annotations

import copy
import logging
import pickle
import re

import pytest
import torch
from torch import nn

import amppass
from amppass.analysis.record import META_KEY
from amppass.fx.capture import guards
from amppass.serving import serving_graph
from amppass.serving.fp32_parameters import stored_parameters
from amppass.serving.serving_graph import ServingGraph
from models import build
from tests.helpers.shape_models import Encoder, Recurrent, _decoder
from tests.helpers.shape_models import _floats as floats


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def within_autocast(model: nn.Module, fast: nn.Module, x: torch.Tensor, factor: float = 1.1) -> tuple[float, float]:
    with torch.no_grad():
        ref = model(x)
        out = fast(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = model(x)
    ours, theirs = rel_err(out, ref), rel_err(auto, ref)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ours <= theirs * factor + 1e-6, f"amppass {ours:.3e} vs autocast {theirs:.3e} at {tuple(x.shape)}"
    return ours, theirs


@pytest.fixture(scope="module")
def lstm():
    torch.manual_seed(0)
    model = Recurrent(nn.LSTM).eval()
    return model, floats(2, 10, 16)


def test_lstm_fixed_length_warned_at_conversion_and_every_shape_served(lstm, caplog):
    model, example = lstm
    with caplog.at_level(logging.WARNING, logger="amppass"):
        fast = amppass.convert(model, (example,), torch.bfloat16, plan_for="coverage")
    fixed = [r.getMessage() for r in caplog.records if "fixed at 10" in r.getMessage()]
    assert fixed and "x dim 1" in fixed[0] and "aten.lstm" in fixed[0], caplog.text
    assert isinstance(fast, ServingGraph) and isinstance(fast, torch.fx.GraphModule)
    fast.graph.lint()
    assert not any(n.op == "call_module" for n in fast.graph.nodes), "torch's guard node is not in the plan"

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="amppass"):
        for x in (floats(1, 10, 16, seed=2), floats(6, 10, 16, seed=3), floats(2, 7, 16, seed=4)):
            within_autocast(model, fast, x)
    recaptured = [r.getMessage() for r in caplog.records if "converting it again" in r.getMessage()]
    assert any("input x dim 1 is 7, the plan takes 10 only" in m for m in recaptured), recaptured
    info = amppass.report(fast).info
    assert info["recaptures"] == len(recaptured) == len(info["plans"]) - 1 >= 1
    assert info["plans"][0]["example"] and "x: [" in info["plans"][0]["inputs"]
    # a shape seen before runs its plan again without another capture
    within_autocast(model, fast, floats(2, 7, 16, seed=5))
    assert amppass.report(fast).info["recaptures"] == info["recaptures"]


def test_batch_one_example_serves_a_batch_of_eight_and_back():
    case = build("mlp", batch=1)
    fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")
    for batch in (8, 1, 3):
        x = floats(batch, 64, seed=batch)
        within_autocast(case.model, fast, x, factor=1.5)
    assert amppass.report(fast).info["recaptures"] == 0
    assert fast.guards.mismatch((floats(8, 64),), {}) is None


def test_transformer_encoder_batch_one_example_then_batch_two(caplog):
    torch.manual_seed(0)
    model = Encoder().eval()
    fast = amppass.convert(model, (floats(1, 6, 32),), torch.bfloat16, plan_for="coverage")
    with caplog.at_level(logging.WARNING, logger="amppass"):
        within_autocast(model, fast, floats(2, 6, 32, seed=2))
        within_autocast(model, fast, floats(1, 9, 32, seed=3))
    assert "input x dim 0 is 2" in caplog.text, caplog.text
    assert "AssertionError" not in caplog.text


class Looped(nn.Module):
    """A Python loop over the length (export fixes it) after a projection whose values overflow fp16."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * 3e4
        total = h[:, 0]
        for t in range(1, x.shape[1]):
            total = total + h[:, t]
        return self.out(total / 1e4)


def test_calibration_decisions_carry_over_to_a_later_plan():
    torch.manual_seed(0)
    model = Looped().eval()
    batches = [(floats(2, 5, 8, seed=s),) for s in range(3)]
    fast = amppass.convert(model, batches[0], torch.float16, calibration=batches, plan_for="coverage")
    first = {n.name: n.meta[META_KEY] for n in fast.graph.nodes if META_KEY in n.meta}
    moved = [name for name, m in first.items() if m.get("source") == "calibration" and m["precision"] == "fp32"]
    assert moved, "the range rules keep the overflowing values fp32"
    x = floats(2, 3, 8, seed=9)  # another length: a new plan, without calibration batches of its shape
    with torch.no_grad():
        out, ref = fast(x), model(x)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2
    later = fast.plans[1]
    carried = {n.name: n.meta[META_KEY] for n in later.graph.nodes if n.name in moved}
    assert carried and all(m["precision"] == "fp32" and m["source"] == "calibration" for m in carried.values())
    assert all("carried_over" in m["evidence"] for m in carried.values())


def test_a_shape_the_original_rejects_raises_the_originals_error():
    case = build("mlp")
    fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")
    bad = floats(2, 32)
    with pytest.raises(RuntimeError) as original:
        case.model(bad)
    for _ in range(2):  # the second time from memory, without another capture
        with pytest.raises(RuntimeError) as ours:
            fast(bad)
        assert str(ours.value) == str(original.value)
        assert not isinstance(ours.value, AssertionError)
    assert amppass.report(fast).info["recaptures"] == 0


def test_without_the_original_a_rejected_call_names_input_dim_and_plan(lstm):
    model, example = lstm
    fast = amppass.convert(model, (example,), torch.bfloat16, plan_for="coverage")
    loaded = ServingGraph(fast, fast.guards)  # what a program read back from a file holds
    with pytest.raises(amppass.InputError) as err:
        loaded(floats(2, 7, 16))
    message = str(err.value)
    assert "input x dim 1 is 7" in message and "x: [" in message and ", 10, 16] float32" in message
    assert "amppass.convert" in message
    fast.drop_original()  # no longer keeps the caller's fp32 model alive
    with pytest.raises(amppass.InputError, match=r"input x dim 1 is 7.*drop_original\(\) released it"):
        fast(floats(2, 7, 16))


def test_plans_are_bounded_and_share_the_first_plans_weights(lstm, monkeypatch):
    monkeypatch.setattr(serving_graph, "MAX_PLANS", 3)
    model, example = lstm
    fast = amppass.convert(model, (example,), torch.bfloat16, plan_for="coverage")
    lengths = (3, 4, 5, 3)  # the plan for length 3 is dropped (least recently used), then made again
    for length in lengths:
        fast(floats(2, length, 16))
    assert [p.meta[guards.GUARDS_KEY].inputs[0].dims[1] for p in fast.plans] == [10, 3, 5]
    info = amppass.report(fast).info
    assert info["recaptures"] == 4 and len(info["plans"]) == 3
    mine = dict(stored_parameters(fast))  # what the graph stores (named_parameters() shows the fp32 face)
    for plan in fast.plans[1:]:
        for name, tensor in plan.named_parameters():
            assert tensor is mine[name], f"{name} is stored twice"


def test_layout_by_keyword_uses_the_same_plan_and_copies_serve_too(lstm):
    model, example = lstm
    fast = amppass.convert(model, (example,), torch.bfloat16, plan_for="coverage")
    with torch.no_grad():
        assert torch.equal(fast(x=example), fast(example))
    assert amppass.report(fast).info["recaptures"] == 0
    twin = copy.deepcopy(fast)
    with torch.no_grad():
        assert torch.equal(twin(floats(2, 7, 16)), fast(floats(2, 7, 16)))
    with pytest.raises(amppass.InputError, match=re.escape("amppass.save")):
        pickle.dumps(fast)


def test_decoder_with_cache_returns_its_cache_and_decodes_with_it():
    case = _decoder("Qwen2Config", "Qwen2ForCausalLM")()
    model, (ids,) = case.model, case.example
    fast = amppass.convert(model, (ids,), torch.bfloat16, plan_for="coverage")
    with torch.no_grad():
        out, ref = fast(ids), model(ids)
        assert type(out) is type(ref) and type(out.past_key_values) is type(ref.past_key_values)
        assert rel_err(out.logits, ref.logits) < 2e-2
        step = out.logits[:, -1].argmax(-1, keepdim=True)
        out2 = fast(step, past_key_values=out.past_key_values)
        ref2 = model(step, past_key_values=ref.past_key_values)
    assert rel_err(out2.logits, ref2.logits) < 2e-2
    assert out2.past_key_values.get_seq_length() == ids.shape[1] + 1


def test_train_mode_serves_another_length_and_trains_its_own_parameters(lstm):
    model, example = lstm
    train = amppass.convert(model, (example,), torch.bfloat16, mode="train", plan_for="coverage")
    x = floats(2, 6, 16, seed=3)
    train(x).square().mean().backward()
    grads = {n: p.grad for n, p in train.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert all(p.grad is None for p in model.parameters()), "the caller's model is not trained"
    with pytest.raises(amppass.InputError, match="state_dict"):
        pickle.dumps(train)


def test_a_model_returning_a_python_number_from_item_converts():
    # Tensor.item() gives export an unbacked symbol bounded by sympy's oo (not int_oo): the guards take it
    class Scalar(nn.Module):
        def forward(self, x):
            return (x @ x.T).sum().item()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    converted = amppass.convert(Scalar(), (x,), dtype="bf16", plan_for="coverage")
    assert abs(converted(x) - Scalar()(x)) <= 2e-2 * abs(Scalar()(x))


def test_a_call_whose_shapes_an_earlier_call_had_skips_the_check():
    """Rule 9: the guards read shapes, dtypes and devices; a call keyed like one the own plan ran is a lookup."""
    from amppass.fx.capture.guards import ShapeGuards

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    fast = amppass.convert(model, (torch.randn(4, 8),), "bf16", plan_for="coverage")
    checks = []
    real = ShapeGuards.mismatch

    def counting(self, args, kwargs):
        checks.append(tuple(a.shape for a in args))
        return real(self, args, kwargs)

    ShapeGuards.mismatch = counting
    try:
        with torch.no_grad():
            for x in (torch.randn(4, 8), torch.randn(4, 8), torch.randn(6, 8), torch.randn(6, 8)):
                assert torch.allclose(fast(x), model(x), atol=3e-2, rtol=3e-2)
            assert len(checks) == 2  # once per new shape
            fast(torch.randn(4, 8, dtype=torch.float64))  # cast at the boundary: checked every time
            fast(torch.randn(4, 8, dtype=torch.float64))
            assert len(checks) > 4
            before = len(checks)
            fast.to(torch.device("cpu"))  # a move forgets the keys
            fast(torch.randn(4, 8))
            assert len(checks) == before + 1
    finally:
        ShapeGuards.mismatch = real
