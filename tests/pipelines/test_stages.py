"""The torch pipeline's stages and settings (amppass.pipelines.stages, amppass.pipelines.settings): the stages run in
the order plan_captured documents, the finite check's retry runs again only the stages that make the graph from a
plan, and what the pipeline derives from the mode is said once, by the settings."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import amppass
from amppass.analysis.options import RewriteOptions
from amppass.analysis.plan import Precision
from amppass.analysis.record import META_KEY
from amppass.fx.capture.export import capture
from amppass.pipelines import stages
from amppass.pipelines.settings import Settings
from amppass.pipelines.stages import RETRY, STAGES, Work, plan_captured, run

NAMES = [stage.__name__ for stage in STAGES]


class Overflow(nn.Module):
    """A product whose fp16 value overflows where fp32's stays finite (the example's rows reach about 2e3)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        with torch.no_grad():
            self.linear.weight.fill_(30.0)

    def forward(self, x):
        y = self.linear(x)
        return (torch.matmul(y, y.transpose(-1, -2)) / 1e6).sum(-1)


def _work(model, example, mode="inference", dtype="fp16"):
    gm = capture(model, example, None, train=mode == "train", note_fixed_dims=False)
    settings = Settings.of(mode, dtype=dtype, plan_for="coverage").on(model)
    return Work(gm, model, settings, (example, {}))


def test_plan_captured_documents_the_stages_in_the_order_they_run():
    documented = re.findall(r"^\s+\d+\. :func:`(\w+)`", plan_captured.__doc__, re.MULTILINE)
    assert documented == NAMES
    assert [stage.__name__ for stage in RETRY] == ["pin", "plan_precision", "add_evidence", "rewrite_graph"]


def test_the_stages_run_once_each_in_order_when_the_example_stays_finite():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    work = _work(model, (torch.randn(4, 8),))
    run(work, STAGES)
    assert work.ran == NAMES
    assert work.non_finite == {} and work.kept_finite == {}
    assert work.gm.meta[META_KEY]["mode"] == "inference"


def test_the_finite_check_retry_runs_again_only_the_stages_that_make_the_graph():
    model, x = Overflow().eval(), torch.randn(4, 8) * 10
    work = _work(model, (x,))
    run(work, STAGES)
    finite_at = NAMES.index("finite_check")
    after = NAMES[finite_at + 1:]  # the stages after the check run once, after every retry
    retried = work.ran[finite_at + 1:-len(after)]
    assert work.ran[:finite_at + 1] == NAMES[:finite_at + 1] and work.ran[-len(after):] == after
    assert retried and retried == [stage.__name__ for stage in RETRY] * (len(retried) // len(RETRY))
    # the culprit is kept fp32 with the check's reason, and the converted graph's output is finite and right
    kept = next(iter(work.kept_finite))
    assert work.plan[kept].precision is Precision.FP32 and "inf or NaN" in work.plan[kept].reason
    assert work.non_finite == {"non_finite": {"kept_fp32": list(work.kept_finite)}}
    with torch.no_grad():
        got, want = work.gm(x), model(x)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=1e-3)


def test_a_train_conversion_has_no_finite_check_to_retry():
    model = Overflow().train()
    work = _work(model, (torch.randn(4, 8) * 10,), mode="train")
    run(work, STAGES)
    assert work.ran == NAMES and work.pristine is None and work.kept_finite == {}
    assert "backward" in work.gm.meta[META_KEY]


def test_the_evidence_stage_leaves_the_plans_own_decisions_as_they_are():
    """A retry stores its plan again: the fused op's note is said once, and the decisions a later plan reuses
    (pinned ones) keep their own reason."""
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    work = _work(model, (torch.randn(2, 8),))
    run(work, STAGES[:5])
    name = next(n for n in work.plan if work.plan[n].precision is Precision.LOW)
    work.fused = {name: "fused in the test"}
    reason = work.plan[name].reason
    for _ in range(2):
        stages.add_evidence(work)
    assert work.plan[name].reason == reason and "fused" not in work.plan[name].evidence
    assert work.stored[name].reason == f"{reason}; fused in the test"
    assert work.stored[name].evidence["fused"] == "fused in the test"


def test_the_settings_say_what_the_mode_and_plan_decide():
    cpu = torch.device("cpu")
    inference = Settings.of("inference", dtype="bf16", plan_for="memory").on(cpu)
    assert inference.rewrite == RewriteOptions(keep_io_types=True, precast_weights=True, weights_low=True)
    assert inference.checks_finite and not inference.trains and not inference.avoids_slow_backward
    train = Settings.of("train", dtype="bf16", plan_for="speed", calibration=iter([(torch.randn(2, 8),)])).on(cpu)
    assert train.rewrite == RewriteOptions(keep_io_types=True, precast_weights=False, weights_low=False)
    assert not train.checks_finite and not train.measures_regions and train.avoids_slow_backward
    assert isinstance(train.options.calibration, list)  # both graphs of a train conversion read it
    later = Settings.of("inference", calibration=[(torch.randn(2, 8),)], tolerance=1e-3).later()
    assert later.options.calibration is None and later.options.tolerance is None
    with pytest.raises(amppass.InputError, match=r"mode='serve' is not one of \('inference', 'train'\)"):
        Settings.of("serve")
    with pytest.raises(amppass.InputError, match=r"target=\['cpu'\] is not a device name; pass 'cpu' or 'cuda'"):
        Settings(target=["cpu"]).on(cpu)  # type: ignore[arg-type]
