"""Kernel facts on the FX path (amppass.fx.view.low_kernels, amppass.targets.torch_kernel_facts): an op the
target's torch has no low-precision kernel for runs fp32 with that reason, whatever the plan; complex outputs come
back in the dtype the model returned; transformers' FNet (torch.fft inside) converts and runs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from torch import nn

import amppass
from amppass.fx.capture.export import capture
from amppass.fx.runners import region_timing
from amppass.fx.view import low_kernels, policy
from amppass.fx.view.build import build_view
from amppass.targets import torch_target
from amppass.targets.torch_kernel_facts import torch_facts
from tests.helpers.load import native_bf16_cpu
from tests.helpers.paths import ROOT

X = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))


class Spectral(nn.Module):
    """A linear layer feeding torch.fft (no bf16/fp16 kernel on CPU), then a linear layer again."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.b(torch.fft.fft(self.a(x)).real)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).norm() / ref.norm())


def _rows(model: nn.Module, dtype: str = "bf16", **options) -> tuple[nn.Module, dict]:
    """The converted model and its report's rows by node name."""
    converted = amppass.convert(model, (X,), dtype=dtype, **options)
    return converted, {row.name: row for row in amppass.report(converted).rows}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_an_op_without_a_low_kernel_runs_fp32_and_says_why(dtype):
    torch.manual_seed(0)
    model = Spectral().eval()
    converted, rows = _rows(model, dtype, plan_for="coverage")
    fft = next(r for r in rows.values() if r.op == "aten.fft_fft")
    assert fft.precision == "fp32"
    assert f"no {dtype} kernel for aten.fft_fft" in fft.reason and "Unsupported dtype" in fft.reason
    assert policy.UNKNOWN_REASON not in fft.reason
    assert rows["linear"].precision == dtype  # the matrix multiplies around it still run low
    assert _rel(converted(X), model(X)) < 2e-2


def test_default_plan_for_speed_converts_a_model_with_such_an_op():
    torch.manual_seed(0)
    model = Spectral().eval()
    converted = amppass.convert(model, (X,), dtype="bf16")  # profitability times the low regions
    assert _rel(converted(X), model(X)) < 2e-2


def test_a_missing_kernel_the_facts_do_not_know_becomes_an_fp32_decision_when_timed(monkeypatch):
    # stand-in for a kernel the probe and the table both miss: the profitability timer finds it
    monkeypatch.setattr(low_kernels, "low_blocked", lambda node, gm, target: "")
    monkeypatch.setattr(low_kernels, "autocast_reason", lambda name, target: "")
    # the whole-model comparison is not under test: on a quiet machine this tiny model's fp32 original wins it,
    # and the report would then have no rows to read
    monkeypatch.setattr(region_timing, "whole_model", lambda *args, **kwargs: (1e-3, 2e-3))
    native_bf16_cpu(monkeypatch)
    torch.manual_seed(0)
    model = Spectral().eval()
    converted, rows = _rows(model, "bf16", plan_for="speed")
    fft = next(r for r in rows.values() if r.op == "aten.fft_fft")
    assert fft.precision == "fp32" and "kernel raised when timed" in fft.reason
    assert _rel(converted(X), model(X)) < 2e-2


def test_force_low_cannot_put_an_op_where_it_has_no_kernel():
    torch.manual_seed(0)
    model = Spectral().eval()
    converted, rows = _rows(model, "bf16", plan_for="coverage", force_low=["fft_fft"])
    fft = next(r for r in rows.values() if r.op == "aten.fft_fft")
    assert fft.precision == "fp32" and fft.reason.startswith("user asked for bf16") and "no bf16 kernel" in fft.reason
    converted(X)


class Traced(nn.Module):
    def forward(self, x):
        return torch.linalg.qr(x @ x.T).Q


def test_without_example_values_the_packaged_table_answers():
    # symbolically traced: nodes carry no meta["val"], so no probe; the op database says qr has no bf16 kernel
    gm = capture(Traced(), None)
    view, _ = build_view(gm, torch_target("cpu", "bf16"))
    qr = next(n for n in view.nodes if n.op == "aten.linalg_qr")
    assert qr.category.name == "FP32" and "op database" in qr.reason and qr.low_blocked


def test_a_cuda_target_planned_here_uses_the_table_and_its_notes():
    # this machine has no GPU (or it does: the notes win over any probe either way)
    gm = capture(Spectral().eval(), (X,))
    view, _ = build_view(gm, torch_target("cuda", "fp16"))
    fft = next(n for n in view.nodes if n.op == "aten.fft_fft")
    assert fft.category.name == "FP32" and "power-of-two" in fft.reason


class TraceOp(nn.Module):
    """torch.trace: not in the policy table, has a bf16 kernel, and autocast keeps it fp32 on CPU."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        return torch.trace(self.a(x)[:, :4] @ self.a(x)[:, :4].T)


def test_an_unlisted_op_autocast_keeps_fp32_runs_fp32_with_that_reason():
    torch.manual_seed(0)
    _, rows = _rows(TraceOp().eval(), "bf16", plan_for="coverage")
    trace = next(r for r in rows.values() if r.op == "aten.trace")
    assert trace.precision == "fp32" and "torch.autocast runs it in fp32 on cpu" in trace.reason


def test_probe_verdicts_are_cached_and_say_when_they_cannot_tell():
    gm = capture(Spectral().eval(), (X,))
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and "fft" in str(n.target))
    low = torch_target("cpu", "bf16").low
    first = low_kernels.probe(node, gm, low, torch.device("cpu"))
    assert "no bf16 kernel" in first
    assert low_kernels.probe(node, gm, low, torch.device("cpu")) is first  # the same verdict object: cached
    linear = next(n for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target))
    assert low_kernels.probe(linear, gm, low, torch.device("cpu")) == ""
    del node.meta["val"]
    node.args[0].meta.pop("val")
    assert low_kernels.probe(node, gm, low, torch.device("cpu")) is None


def test_the_packaged_table_names_its_sources_and_agrees_with_this_torch():
    facts = torch_facts()
    assert facts.source["torch"] and facts.source["autocast"]["commit"]
    assert facts.autocast_keeps_fp32("cpu", "fft_fft") and facts.autocast_keeps_fp32("cuda", "exp")
    assert "fft_fft" in facts.no_low_kernel[("cpu", "bfloat16")]
    spec = importlib.util.spec_from_file_location("torch_kernel_tables", ROOT / "scripts" / "torch_kernel_tables.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.check_autocast_lists() == []  # the lists match this torch's autocast registrations
    packaged = json.loads((ROOT / "amppass" / "targets" / "data" / "torch_kernel_facts.json").read_text())
    assert packaged["autocast_fp32"] == {
        "cpu": sorted(script.AUTOCAST_CPU_FP32),
        "cuda": sorted(script.AUTOCAST_CUDA_FP32),
    }


class ComplexOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        c = torch.complex(self.a(x), self.b(x))
        return c, torch.view_as_real(c), c.abs()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_keep_io_types_returns_complex_outputs_in_the_models_dtype(dtype):
    torch.manual_seed(0)
    model = ComplexOut().eval()
    converted = amppass.convert(model, (X,), dtype=dtype, plan_for="coverage")
    out, ref = converted(X), model(X)
    assert [o.dtype for o in out] == [torch.complex64, torch.float32, torch.float32]
    bound = 2e-2 if dtype == "bf16" else 2e-3
    assert all(_rel(torch.view_as_real(o) if o.is_complex() else o,
                    torch.view_as_real(r) if r.is_complex() else r) < bound for o, r in zip(out, ref, strict=False))


def _fnet():
    transformers = pytest.importorskip("transformers")
    config = transformers.FNetConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                                     max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.FNetModel(config).eval(), torch.randint(
        0, 100, (2, 16), generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize("dtype,plan_for,bound", [("bf16", "speed", 2e-2), ("fp16", "coverage", 3e-3)])
def test_fnet_converts_and_runs_within_a_bound_of_fp32(dtype, plan_for, bound):
    model, ids = _fnet()
    converted = amppass.convert(model, (ids,), dtype=dtype, plan_for=plan_for)
    out, ref = converted(ids).last_hidden_state, model(ids).last_hidden_state
    assert out.dtype == torch.float32 and _rel(out, ref) < bound
    assert all(r.precision == "fp32" for r in amppass.report(converted).rows if r.op.startswith("aten.fft"))


class EmptyBessel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x):
        return torch.special.bessel_j0(self.a(x)[:0])  # empty: the kernel still refuses bf16


def test_a_kernel_refusing_an_empty_tensor_is_a_verdict():
    torch.manual_seed(0)
    converted, rows = _rows(EmptyBessel().eval(), "bf16", plan_for="coverage")
    bessel = next(r for r in rows.values() if r.op == "aten.special_bessel_j0")
    assert bessel.precision == "fp32" and "no bf16 kernel" in bessel.reason
    assert converted(X).shape == (0, 16)
