"""Target-aware FX plans: profitability regions, saved cost tables, the kept original, memory-first plans.

Timings on a shared machine are not asserted on. The decisions are: each test hands the conversion a cost
table (``costs=``, the form a converted model records in ``info["costs"]``) whose times it chose, so the
outcome is fixed, and the real measuring path is exercised by recording and reusing its own table.
"""

from __future__ import annotations

import copy
import io
import logging

import pytest
import torch
from torch import nn

import amppass
from amppass import InputError
from amppass.analysis.plan import Category, Decision, Precision, PrecisionPlan, Source
from amppass.analysis.profitability import regions
from amppass.analysis.view import GraphView, OpView
from amppass.fx.runners.region_timing import whole_model_key
from amppass.serving.fp32_original import Fp32Original
from amppass.serving.fp32_parameters import stored_parameters
from tests.helpers.load import native_bf16_cpu

X = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)),)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64), nn.LayerNorm(64), nn.Linear(64, 8)).eval()


def _decisions(plan_rows, low):
    plan = PrecisionPlan()
    for name, precision in plan_rows:
        plan[name] = Decision(Precision.LOW if precision == "low" else Precision.FP32, "r", Source.POLICY)
    return plan


def test_regions_join_connected_low_nodes_and_cast_once_on_their_boundary():
    # x -> a (low) -> b (low) -> n (fp32) -> c (low) -> out ; b also returned
    view = GraphView([
        OpView("a", "mm", Category.LOW, "", ["x", "w1"], ["a"]),
        OpView("b", "relu", Category.FOLLOW, "", ["a"], ["b"]),
        OpView("n", "norm", Category.FP32, "", ["b"], ["n"]),
        OpView("c", "mm", Category.LOW, "", ["n", "w2"], ["c"]),
    ], weights={"w1": 1.0, "w2": 1.0}, outputs=["c", "b"])
    plan = _decisions([("a", "low"), ("b", "low"), ("n", "fp32"), ("c", "low")], "bf16")
    found = regions(view, plan, keep_io_types=True)
    assert [r.nodes for r in found] == [("a", "b"), ("c",)]
    assert found[0].cast_in == ("x",) and found[0].cast_out == ("b",)  # weights cost nothing: converted ahead
    assert found[1].cast_in == ("n",) and found[1].cast_out == ("c",)
    assert regions(view, plan, keep_io_types=False)[1].cast_out == ()


def _measured(model, **options):
    converted = amppass.convert(model, X, "bf16", **options)
    return converted, amppass.report(converted)


def _costs_favouring(costs: dict, low_faster: bool) -> dict:
    """The recorded table with every bf16 op 10x faster (or slower) than its fp32 twin, casts free when low
    precision is to win, and the converted graph faster than the original module."""
    whole = whole_model_key(mlp(), X, {})
    table = {**costs, f"{whole}|converted": 1.0, f"{whole}|original": 2.0}
    for key in table:
        if key.startswith("cast") and low_faster:
            table[key] = 1e-9
        if "bfloat16" in key and not key.startswith(("cast", "whole model")):
            twin = key.replace("bfloat16", "float32")
            if twin in table:
                table[key] = table[twin] / 10 if low_faster else table[twin] * 10
    return table


def test_a_saved_cost_table_decides_and_makes_plans_reproducible(monkeypatch):
    native_bf16_cpu(monkeypatch)
    model = mlp()
    first, report = _measured(model)
    costs = report.info["costs"]
    assert any(k.startswith("aten.linear|float32") for k in costs) and any("bfloat16" in k for k in costs)
    assert "whole_model" in report.info and report.info["target"]["profitability"] == "measured on this machine"
    assert set(report.info["whole_model"]) in ({"converted_ms", "original_ms"}, {"skipped"})  # skipped when busy

    slow = _costs_favouring(costs, low_faster=False)
    kept, kept_fp32 = _measured(model, costs=slow)
    # every linear region slower low: nothing runs low, so the original itself comes back, with the plan's record
    assert isinstance(kept, Fp32Original) and kept_fp32.info["profitability"]["nodes_fp32"] >= 3
    assert "nothing in the plan runs low" in kept_fp32.rows[0].reason
    regions = kept_fp32.info["profitability"]["regions"]
    assert regions and all(r["runs"] == "fp32" for r in regions)
    again, again_report = _measured(model, costs=kept_fp32.info["costs"])
    assert isinstance(again, Fp32Original)  # the recorded table reproduces the decision without measuring
    assert again_report.info["profitability"]["regions"] == regions

    fast, low = _measured(model, costs=_costs_favouring(costs, low_faster=True))
    assert not [r for r in low.rows if r.source == "profitability"]
    assert all(r.precision == "bf16" for r in low.rows if r.op == "aten.linear")
    with torch.no_grad():
        assert torch.allclose(fast(*X), model(*X), rtol=0.05, atol=0.05)


def _saved_and_loaded(module: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_the_original_module_is_kept_where_it_is_faster(caplog):
    model = mlp()
    _, report = _measured(model)
    key = whole_model_key(model, X, {})
    costs = {**report.info["costs"], f"{key}|converted": 3.0, f"{key}|original": 1.0}
    with caplog.at_level(logging.WARNING, logger="amppass"):
        kept = amppass.convert(model, X, "bf16", costs=costs)
    assert isinstance(kept, Fp32Original) and "keeping the original" in caplog.text
    # the original itself, not a wrapper: its class's forward, its module tree, its tensors
    assert isinstance(kept, type(model)) and type(kept).forward is type(model).forward
    assert [n for n, _ in kept.named_modules()] == [n for n, _ in model.named_modules()]
    assert all(a is b for a, b in zip(kept.parameters(), model.parameters(), strict=True))
    calls = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, args: calls.append(type(m).__name__))
    try:
        with torch.no_grad():
            model(*X)
            original_calls, calls[:] = list(calls), []
            kept(*X)
    finally:
        hook.remove()
    assert calls == original_calls  # no module call in between
    for copied in (copy.deepcopy(kept), _saved_and_loaded(kept)):  # copies and pickles as what it is
        assert isinstance(copied, Fp32Original) and isinstance(copied, type(model))
        assert copied.meta == kept.meta and amppass.report(copied).rows[0].source == "profitability"
        with torch.no_grad():
            assert torch.equal(copied(*X), model(*X))
    row, = amppass.report(kept).rows
    assert row.precision == "fp32" and row.source == "profitability" and "plan_for='coverage'" in row.reason
    with torch.no_grad():
        assert torch.equal(kept(*X), model(*X))
    kept.train()
    assert not model.training  # the caller's module is not the one switched
    assert amppass.convert(kept, X, "bf16") is kept


def test_memory_first_plans_store_every_fitting_weight_low():
    model = mlp()
    coverage = amppass.report(amppass.convert(model, X, "bf16", plan_for="coverage")).info
    memory_gm = amppass.convert(model, X, "bf16", plan_for="memory")
    memory = amppass.report(memory_gm).info
    assert memory["weight_bytes_after"] < coverage["weight_bytes_after"]
    assert memory["weight_bytes_after"] == memory["weight_bytes_before"] // 2  # LayerNorm's weights too
    assert all(p.dtype == torch.bfloat16 for _, p in stored_parameters(memory_gm))  # parameters() faces fp32
    assert "costs" not in memory and memory["target"]["profitability"] == "measured on this machine"
    with torch.no_grad():
        ref, out = model(*X), memory_gm(*X)
    assert float((out - ref).norm() / ref.norm()) < 2e-2


def test_plan_for_and_target_are_checked_and_recorded():
    with pytest.raises(InputError, match="plan_for='fast' is not one of"):
        amppass.convert(mlp(), X, "bf16", plan_for="fast")
    with pytest.raises(InputError, match="target='tpu'"):
        amppass.convert(mlp(), X, "bf16", target="tpu")
    if not torch.cuda.is_available():  # a CUDA target planned here: nothing to measure, fp16 by default
        info = amppass.report(amppass.convert(mlp(), X, target="cuda")).info
        assert info["dtype"] == "fp16" and info["target"]["name"] == "cuda"
        assert info["target"]["profitability"] == "off" and "costs" not in info


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def test_run_time_constants_read_low_are_created_low():
    """An RNN's zero initial state is created in bf16, not created in fp32 and cast on every call."""
    model = Recurrent().eval()
    x = (torch.randn(2, 5, 16),)
    gm = amppass.convert(model, x, "bf16", plan_for="coverage")
    zeros = [n for n in gm.graph.nodes if n.target is torch.ops.aten.zeros.default]
    assert zeros and all(n.kwargs["dtype"] == torch.bfloat16 for n in zeros)
    assert not any(a in zeros for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default for a in n.args)
    with torch.no_grad():
        ref, out = model(*x), gm(*x)
    assert float((out - ref).norm() / ref.norm()) < 2e-2


def test_gru_runs_fp32_on_cpu_where_torch_has_no_fused_low_kernel_for_it():
    """torch on CPU runs GRU and plain RNN layers in bf16 through an unfused path (slower, less accurate):
    the CPU target keeps them fp32 whatever the plan; LSTM, which oneDNN fuses, runs low."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.lstm = nn.GRU(8, 8, batch_first=True), nn.LSTM(8, 8, batch_first=True)

        def forward(self, x):
            return self.lstm(self.gru(x)[0])[0]

    x = (torch.randn(2, 5, 8),)
    rows = {r.op: r for r in amppass.report(amppass.convert(Net().eval(), x, "bf16", plan_for="coverage")).rows}
    assert rows["aten.gru"].precision == "fp32" and "unfused reference path" in rows["aten.gru"].reason
    assert rows["aten.lstm"].precision == "bf16"
