"""A converted model moved with ``.to(device)`` runs there: the device literals torch.export wrote into its
graphs (``arange(n, device=cpu)`` for position ids, a mask built on the inputs' device) move with its tensors.

The CPU here has one device, so the move goes to the meta device, which runs every op's shape logic and
raises on mixed devices as CUDA does (``Tensor on device cpu is not on the expected device meta``);
tests/pipelines/test_cuda.py moves a model converted on the CPU to a GPU and compares it with fp32 there.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import fx, nn

import amppass
from amppass.fx.rewrite.device_literals import retarget
from tests.helpers.small_models import Positions


def _device_literals(gm: fx.GraphModule) -> set[str]:
    found = set()
    for node in gm.graph.nodes:
        values = [*node.args, node.kwargs.get("device")]
        found.update(str(v) for v in values if isinstance(v, torch.device))
    return found


def test_retarget_rewrites_device_literals_and_regenerates_the_code():
    graph = fx.Graph()
    x = graph.placeholder("x")
    ones = graph.call_function(torch.ones, (3,), {"device": "cpu"})
    zeros = graph.call_function(torch.zeros, (3,), {"device": torch.device("cpu")})
    graph.output(graph.call_function(operator.add, (graph.call_function(operator.add, (x, ones)), zeros)))
    gm = fx.GraphModule(nn.Module(), graph)
    assert retarget(gm, {torch.device("cpu"): torch.device("cpu")}) == 0  # no move, no change
    assert retarget(gm, {torch.device("cpu"): torch.device("meta")}) == 2
    gm.graph.lint()
    assert "meta" in gm.code and "'cpu'" not in gm.code and "device(type='cpu')" not in gm.code
    assert gm(torch.zeros(3, device="meta")).device.type == "meta"


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_a_model_converted_on_the_cpu_runs_after_a_device_move(mode):
    torch.manual_seed(0)
    model = Positions().train(mode == "train")
    x = torch.randn(2, 8, 16)
    fast = amppass.convert(model, (x,), "bf16", mode=mode, plan_for="coverage")
    before = copy.deepcopy(model.state_dict())
    assert "cpu" in {d for g in _graphs(fast) for d in _device_literals(g)}  # the capture wrote the device in

    fast.to("meta")
    assert all(d == "meta" for g in _graphs(fast) for d in _device_literals(g))
    out = fast(x.to("meta"))
    assert out.device.type == "meta" and out.shape == x.shape
    if mode == "train":
        out.sum().backward()
        fast.eval()
        assert fast(x.to("meta")).device.type == "meta"
    # the caller's model stays where it was, unchanged
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _graphs(fast: nn.Module) -> list[fx.GraphModule]:
    converted = getattr(fast, "converted", fast)
    if hasattr(converted, "train_graph"):
        return [p for g in (converted.train_graph, converted.eval_graph) for p in g.plans]
    return list(converted.plans)
