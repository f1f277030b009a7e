"""Tolerance search time: at most the runs it documents, and each run starts where its
trial graph first differs from the fp32 graph, from fp32 values calibration kept (amppass.fx.runners.trial_runs),
with the same result as the whole trial."""

from __future__ import annotations

import random

import torch

import amppass
from amppass.analysis.calibration import max_runs
from amppass.analysis.options import RewriteOptions
from amppass.analysis.painting import paint
from amppass.analysis.plan import Decision, Precision, Source
from amppass.fx.capture.export import capture
from amppass.fx.runners.calibrate import FxTrials, calibrate
from amppass.fx.view.build import build_view
from amppass.targets.target import torch_target
from models import build
from models.onnx_export import export


def _trials(case, batches, dtype="fp16"):
    target = torch_target("cpu", dtype)
    gm = capture(case.model, case.example_inputs)
    view = build_view(gm, target)[0]
    data = calibrate(gm, batches, view, replay=target.low.torch, keep=True)
    return FxTrials(data, target.low, RewriteOptions(), False), view, target.low


def test_runs_from_the_kept_fp32_prefix_give_the_whole_trials_errors():
    case = build("cnn")
    trials, view, low = _trials(case, [case.make_inputs(s) for s in (1, 2)])
    names = [n.name for n in view.nodes if paint(view, low, {})[n.name].precision is Precision.LOW]
    rng = random.Random(0)
    for share in (0.0, 0.3, 0.7):
        moved = {n: Decision(Precision.FP32, "trial", Source.TOLERANCE) for n in names if rng.random() < share}
        moved.update({n: Decision(Precision.FP32, "trial", Source.TOLERANCE) for n in names[: len(names) // 2]}
                     if share == 0.7 else {})
        plan = paint(view, low, moved)
        reused = trials.error(plan, moved, [0, 1])
        checkpoints, trials.data.graphs[0].checkpoints = trials.data.graphs[0].checkpoints, None
        whole = trials.error(plan, moved, [0, 1])
        trials.data.graphs[0].checkpoints = checkpoints
        assert reused == whole, (share, reused, whole)
    assert trials.reused() > 0.1, "the trial that moved the first half to fp32 ran from a late checkpoint"


def test_search_stays_within_its_documented_runs_and_reuses_the_prefix():
    case = build("cnn")
    plain = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")
    candidates = sum(r.precision == "bf16" for r in amppass.report(plain).rows)
    fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage",
                           calibration=[case.make_inputs(s) for s in (1, 2, 3)], tolerance=1e-3, progress=True)
    info = amppass.report(fast).info
    assert info["moved_by_tolerance"] > 0 and info["tolerance_runs"] <= max_runs(candidates)
    assert info["tolerance_reused"] > 0.1 and info["tolerance_seconds"] > 0


def test_onnx_runs_from_the_kept_fp32_prefix_give_the_whole_trials_errors():
    from amppass.onnx.calibrate import OnnxTrials

    case = build("resnet")
    model = export(case.model, case.example_inputs, ["x"], ["y"])
    feeds = [{"x": case.make_inputs(s)[0].numpy()} for s in (1, 2)]
    seen = []
    original = OnnxTrials.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self)

    OnnxTrials.__init__ = keep
    try:
        converted = amppass.convert_onnx(model, "fp16", target="cpu", calibration=feeds, tolerance=1.5e-4)
    finally:
        OnnxTrials.__init__ = original
    trials = seen[0]
    assert amppass.report(converted).info["tolerance_reused"] == round(trials.reused(), 3) > 0.1
    view = trials.fp32.view
    low = trials.target.low
    names = [n.name for n in view.nodes if paint(view, low, {})[n.name].precision is Precision.LOW]
    for moved_names in (names[: len(names) // 2], names[len(names) // 3:], []):
        moved = {n: Decision(Precision.FP32, "trial", Source.TOLERANCE) for n in moved_names}
        plan = paint(view, low, moved)
        reused = trials.error(plan, moved, [0, 1])
        checkpoints, trials.data.checkpoints = trials.data.checkpoints, None
        whole = trials.error(plan, moved, [0, 1])
        trials.data.checkpoints = checkpoints
        assert reused == whole, (len(moved_names), reused, whole)
