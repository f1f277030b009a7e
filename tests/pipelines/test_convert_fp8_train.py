"""amppass.convert(mode="train", dtype="fp8"): which products train in fp8, training against bf16, checkpoints, targets.

A product trains in fp8 with e4m3 forward operands and e5m2 gradients (tests/fx/rewrite/test_fp8_train.py holds the
op's numerics); here, the conversion around it: the graph, the module tree and state dict of bf16 training, the
loss falling as bf16's does, the refusals.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import InputError
from amppass.fx.rewrite.fp8_train import fp8_train_linear

FP8_OP = fp8_train_linear._opoverload


class Conv1D(nn.Module):
    """transformers' ``Conv1D``: ``addmm(bias, x, W)`` with W stored in x out (GPT-2's every product)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.proj, self.out = nn.Linear(32, 64), nn.Linear(64, 64), Conv1D(64, 64), \
            nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + torch.relu(self.proj(torch.relu(self.mid(h))))
        return self.out(h)


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning
    yield
    logging.disable(logging.NOTSET)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().train()


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 16, generator=generator)
    return [(x, (x @ teacher).argmax(-1)) for x in (torch.randn(64, 32, generator=generator) for _ in range(steps))]


def _train(model: nn.Module, data) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_middle_products_train_in_fp8_and_the_ends_stay_bf16_saying_why():
    net = _net()
    converted = amppass.convert(copy.deepcopy(net), (torch.randn(8, 32),), dtype="fp8", mode="train",
                                plan_for="coverage")
    for graph in (converted.train_graph, converted.eval_graph):
        fp8 = [n for n in graph.graph.nodes if n.target is FP8_OP]
        assert sorted(n.name for n in fp8) == ["addmm", "linear_1"]  # mid and proj (its weight transposed)
        assert all(n.args[1].op == "get_attr" or n.args[1].args[0].op == "get_attr" for n in fp8)  # fp32 master
    report = amppass.report(converted)
    rows = {row.name: row for row in report.fp8_rows()}
    assert "first fp8-capable product" in rows["linear"].reason
    assert "last fp8-capable product" in rows["linear_2"].reason
    assert rows["addmm"].evidence["fp8"]["gradient_format"] == "e5m2"
    assert "not needed" in report.info["fp8"]["loss_scaling"]
    assert [n for n, _ in converted.named_modules()] == [n for n, _ in net.named_modules()]
    assert list(converted.state_dict()) == list(net.state_dict())
    converted(torch.randn(8, 32)).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in converted.parameters())


def test_a_small_model_trains_in_fp8_as_far_as_in_bf16():
    """The loss falls, and the fp8 model's last losses are within a tenth of bf16's descent of bf16's."""
    data = _data(40)
    bf16 = _train(amppass.convert(_net(), (data[0][0],), mode="train", plan_for="coverage"), data)
    fp8 = _train(amppass.convert(_net(), (data[0][0],), dtype="fp8", mode="train", plan_for="coverage"), data)
    last = slice(-5, None)
    bf16_end, fp8_end = sum(bf16[last]) / 5, sum(fp8[last]) / 5
    assert fp8_end < 0.85 * fp8[0] and bf16_end < 0.85 * bf16[0]  # both fall by a quarter
    assert abs(fp8_end - bf16_end) <= 0.1 * (bf16[0] - bf16_end)


def test_a_checkpoint_resumes_fp8_training_bit_for_bit():
    """The state dict holds the original's keys (scales are dynamic: no amax history to keep); model and optimizer
    loaded into a second conversion continue with the same losses."""
    data = _data(6)
    first = amppass.convert(_net(), (data[0][0],), dtype="fp8", mode="train", plan_for="coverage")
    optimizer = torch.optim.AdamW(first.parameters(), lr=3e-3)
    for x, y in data[:3]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(first(x).float(), y).backward()
        optimizer.step()
    checkpoint = copy.deepcopy({"model": first.state_dict(), "optimizer": optimizer.state_dict()})
    second = amppass.convert(_net(), (data[0][0],), dtype="fp8", mode="train", plan_for="coverage")
    second.load_state_dict(checkpoint["model"])
    resumed = torch.optim.AdamW(second.parameters(), lr=3e-3)
    resumed.load_state_dict(checkpoint["optimizer"])
    optimizer_state = {"first": optimizer, "second": resumed}
    for x, y in data[3:]:
        losses = {}
        for name, model in (("first", first), ("second", second)):
            loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer_state[name].zero_grad()
            loss.backward()
            optimizer_state[name].step()
            losses[name] = loss.item()
        assert losses["first"] == losses["second"]


def test_fp8_training_is_refused_on_a_gpu_below_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(InputError, match=r"compute capability 8\.6.*8\.9.*dtype='bf16'"):
        amppass.convert(_net(), (torch.randn(8, 32),), dtype="fp8", mode="train", target="cuda")


def test_fp8_training_on_a_cpu_needs_coverage():
    with pytest.raises(InputError, match=r"plan_for='coverage'"):
        amppass.convert(_net(), (torch.randn(8, 32),), dtype="fp8", mode="train", target="cpu")
