"""In-place writes through views: a buffer and its views share one precision, with no cast between write and read.

The pattern is multi-head latent attention's (DeepSeek-V3): the key is built in a buffer, ``k = q.new_empty(...)``,
filled in two slices (``k[..., :8] = a``; ``k[..., 8:] = b``), then read by attention. A plan that ran one slice
low and the other fp32 cast the buffer to a copy for the second write, so attention read a buffer half never
written: uninitialised memory, a different wrong answer on every call.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx, nn

import amppass
from amppass.analysis.stats import CalibrationStats
from amppass.fx.capture.copies import shared_copy
from amppass.fx.capture.export import capture
from amppass.fx.prepare.aliasing import alias_groups
from amppass.fx.runners.calibrate import _candidates, _Recorder
from amppass.fx.runners.trial_runs import Checkpoints
from amppass.fx.view.build import build_view
from amppass.targets.target import torch_target
from tests.helpers.aliasing_models import filled_key_model, key_input

BF16_TOLERANCE = 2e-2  # relative L2 error of a few bf16 matrix products (8 significand bits)


class ReadBetweenWrites(nn.Module):
    """A buffer read low before an fp32 write and again after it: the later read must see the write."""

    def __init__(self):
        super().__init__()
        self.a, self.out = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.a(x).clone()
        before = self.out(buf)
        buf[..., :8] = torch.exp(0.1 * x[..., :8])
        return before + self.out(buf)


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def _stable_and_close(fn, model: nn.Module, x: torch.Tensor, tolerance: float = BF16_TOLERANCE) -> None:
    """Three calls give bit-identical outputs within ``tolerance`` of fp32's (uninitialised memory would not)."""
    with torch.no_grad():
        ref = model(x)
        outs = [fn(x) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "outputs differ between calls"
    assert torch.isfinite(outs[0]).all()
    assert _error(outs[0], ref) < tolerance, _error(outs[0], ref)


def _written_groups(gm: fx.GraphModule) -> list[set[str]]:
    found = alias_groups(gm)
    return [{n.name for n in members} for members in found.members]


def test_groups_come_from_schemas():
    gm = capture(filled_key_model(), (key_input(),), None, train=False)
    groups = alias_groups(gm)
    assert [[n.name for n in m] for m in groups.members] == [["new_empty", "slice_1", "copy_", "slice_2", "copy__1"]]
    assert {w.name: n.name for w, n in groups.writes.items()} == {"copy_": "slice_1", "copy__1": "slice_2"}


def test_groups_of_a_symbolic_trace():
    class Methods(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            k = x.new_zeros(x.shape)
            k.narrow(1, 0, 2).copy_(x[:, :2])
            k.transpose(0, 1).mul_(2)
            first, _ = k.split(2, 1)
            return k, first.relu_(), self.act(x * 2), x.add(1).view(-1)

    groups = _written_groups(fx.symbolic_trace(Methods()))
    assert {"new_zeros", "narrow", "copy_", "transpose", "mul_", "split", "getitem_1", "relu_"} <= groups[0]
    assert groups[1] == {"mul", "act"}  # the module built with inplace=True writes its input
    assert not any("add" in g or "view" in g for g in groups)  # views never written are not grouped


@pytest.mark.parametrize("plan_for", ["coverage", "speed"])
def test_convert_writes_reach_the_buffer(plan_for):
    model, x = filled_key_model(), key_input()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = amppass.convert(model, (x,), dtype="bf16", plan_for=plan_for)
    _stable_and_close(fast, model, x)
    _stable_and_close(fast, model, key_input(3, 7, seed=2))
    rows = {r.name: r for r in amppass.report(fast).rows}
    if plan_for == "coverage":
        group = ["new_empty", "slice_1", "copy_", "slice_2", "copy__1"]
        assert {rows[n].precision for n in group} == {"fp32"}, {n: rows[n].precision for n in group}
        assert "no cast between a write and a read" in rows["new_empty"].reason
        assert "copy__1 runs fp32" in rows["new_empty"].reason
        # the converted graph writes into the buffer attention reads: still one group, no cast copy in it
        graph = fast.graph if hasattr(fast, "graph") else fast.converted.graph
        assert _written_groups(graph.owning_module) == [set(group)]


def test_group_stays_low_when_every_write_is_low():
    model, x = filled_key_model(fp32_half=False), key_input()
    fast = amppass.convert(model, (x,), dtype="bf16", plan_for="coverage")
    _stable_and_close(fast, model, x)
    rows = {r.name: r for r in amppass.report(fast).rows}
    assert {rows[n].precision for n in ("new_empty", "slice_1", "copy_", "slice_2", "copy__1")} == {"bf16"}


def test_a_read_after_a_write_casts_again():
    model, x = filled_key_model(ReadBetweenWrites), key_input()
    fast = amppass.convert(model, (x,), dtype="bf16", plan_for="coverage")
    _stable_and_close(fast, model, x)
    casts = [
        n for n in fast.graph.nodes if n.meta.get("amppass", {}).get("cast") and n.meta["amppass"]["of"] == "clone"
    ]
    assert len(casts) == 2  # one for the read before the write, one after it


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_compile_backend_writes_reach_the_buffer(compiler):
    model = filled_key_model()
    compiled = torch.compile(model, backend="amppass", options={"dtype": "bf16", "compiler": compiler,
                                                                 "plan_for": "coverage"})
    for x in (key_input(), key_input(3, 7, seed=2)):
        _stable_and_close(compiled, model, x)
    rows = [r for r in amppass.report(compiled).rows if r.name.endswith(("new_empty", "copy_", "copy__1"))]
    assert rows and {r.precision for r in rows} == {"fp32"}
    torch._dynamo.reset()


def test_train_mode_writes_reach_the_buffer():
    model, x = filled_key_model(), key_input()
    trained = amppass.convert(model.train(), (x,), dtype="bf16", mode="train", plan_for="coverage")
    out = trained(x)
    with torch.no_grad():
        ref = model(x)
    assert _error(out.detach(), ref) < BF16_TOLERANCE
    out.square().sum().backward()
    reference = filled_key_model().train()
    reference(x).square().sum().backward()
    for (name, p), q in zip(trained.named_parameters(), reference.parameters(), strict=False):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert _error(p.grad, q.grad) < 5e-2, (name, _error(p.grad, q.grad))


# -- DeepSeek-V3: multi-head latent attention, grouped top-k routing, shared experts ---------------------------

def _deepseek():
    pytest.importorskip("transformers")
    from tests.helpers.decoders import deepseek_v3

    return deepseek_v3()


def test_deepseek_v3_logits_as_close_as_autocast():
    model = _deepseek()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = _error(model(ids).logits, ref)
    fast = amppass.convert(model, (ids,), dtype="bf16", plan_for="coverage")
    with torch.no_grad():
        outs = [fast(ids).logits for _ in range(2)]
    assert torch.equal(outs[0], outs[1])
    # bf16 rounding differs in where it lands, not in size: within twice autocast's error
    assert _error(outs[0], ref) < max(2 * autocast, 1e-2), (_error(outs[0], ref), autocast)
    rows = amppass.report(fast).rows
    grouped = {r.name for r in rows if "alias_group" in r.evidence}
    assert {"new_empty", "copy_", "scatter_"} <= grouped  # the key buffer and the routing's group mask


def test_deepseek_v3_routing_and_shared_experts():
    """The MoE block alone (grouped top-k routing, its group mask written in place, shared experts). The model
    casts its router's operands to fp32 itself; autocast runs the router in bf16 anyway, where near-tied experts
    swap (0.1-0.2 off fp32 here); the plan keeps it fp32 and picks fp32's experts."""
    block = _deepseek().model.layers[1].mlp
    fast = amppass.convert(block, (torch.randn(2, 12, 64),), dtype="bf16", plan_for="coverage")
    for seed in range(3):
        hidden = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = block(hidden)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = _error(block(hidden), ref)
            out = fast(hidden)
        assert torch.isfinite(out).all()
        assert _error(out, ref) < min(autocast, BF16_TOLERANCE), (seed, _error(out, ref), autocast)
    rows = {r.name: r for r in amppass.report(fast).rows}
    assert rows["linear"].precision == "fp32" and "casts every operand" in rows["linear"].reason  # the router
    assert rows["topk"].precision == "fp32"
    assert rows["scatter_"].precision == rows["zeros_like"].precision  # the group mask: one precision
    experts = [r for r in rows.values() if r.op == "transformers.grouped_mm_fallback"]
    assert experts and all(r.precision == "bf16" for r in experts)  # the experts' products: matrix multiplies


@pytest.mark.slow
def test_deepseek_v3_generates_fp32s_tokens():
    from tests.helpers.decoders import agreeing_steps, greedy

    model = _deepseek()
    prompt = torch.randint(1, 127, (1, 8), generator=torch.Generator().manual_seed(5))
    fast = amppass.convert(model, (prompt,), dtype="bf16", plan_for="coverage")
    reference, out = greedy(model, prompt, 12), greedy(fast, prompt, 12)
    assert agreeing_steps(reference, out) >= 4


# -- the tolerance search's runs from kept fp32 values -----------------------------------------------------------

class DividedInPlace(nn.Module):
    """A value divided in place (``topk_weights /= denominator``, as DeepSeek-V3's router writes it)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        scale = torch.relu(self.b(x)) + 1.0
        h /= scale
        return h


def test_runs_from_kept_values_never_write_twice():
    """A tolerance-search run started from a value kept during calibration computes what the whole run does."""
    model, x = filled_key_model(DividedInPlace), key_input()
    gm = capture(model, (x,), None, train=False)
    view, _ = build_view(gm, torch_target("cpu", "bf16"))
    checkpoints = Checkpoints(gm, _candidates(view))
    assert "div_" not in checkpoints.order and "linear" in checkpoints.order  # none between h and its write
    recorder = _Recorder(gm, CalibrationStats(), set())
    recorder.checkpoints = checkpoints
    with torch.no_grad():
        recorder.run(x, enable_io_processing=False)
        trial = shared_copy(gm)
        whole = trial(x)
        from_kept = checkpoints.run(trial, [(0, (x,), {}, [x])])[0]
    assert torch.equal(torch.utils._pytree.tree_leaves(whole)[0], torch.utils._pytree.tree_leaves(from_kept)[0])
