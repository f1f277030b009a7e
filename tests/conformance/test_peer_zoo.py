"""The peer zoo as amppass's regression suite: timm, diffusers, torchvision (classifiers, segmentation, optical flow,
video, detectors), ultralytics YOLO, open_clip and torchaudio models, each the smallest variant built offline with
random weights, through convert (bf16, coverage plan; a detector judged part by part), train (fp16) and export_onnx
(fp16), judged against fp32 and torch.autocast as the transformers zoo judges (``tests/conformance/peer_zoo.py``).

Every outcome is held to ``tests/conformance/peer_expected.json``: a step that fails must be listed there and fail
with a detail that starts with the listed reason; a listed step that passes fails the test too, so the list cannot go
stale. The default run takes :data:`peer_zoo.DEFAULT` (a CNN, a ViT, a diffusers UNet, YOLO, a detector by parts,
wav2vec2, each with the steps it stands for); every model with every step runs under ``-m slow``. Regenerate the
expected file after a fix: ``python tests/conformance/peer_zoo.py --write-expected``.
"""

from __future__ import annotations

import json

import pytest

for _library in ("timm", "diffusers", "torchvision", "torchaudio", "ultralytics", "open_clip", "onnxruntime"):
    pytest.importorskip(_library)

from tests.conformance import peer_zoo as harness  # noqa: E402 - after the skips

DATA = json.loads(harness.EXPECTED.read_text(encoding="utf-8"))


def _check(name: str, steps: tuple[str, ...]) -> None:
    result = harness.run_model(name, steps)
    failures = harness.verdict(result, DATA)
    assert not failures, "\n".join(failures)


def test_expected_entries_name_real_models_and_steps_with_reasons():
    for name, reason in DATA["unbuilt"].items():
        assert name in harness.ENTRIES and reason, name
    for name, steps in DATA["expected"].items():
        assert name in harness.ENTRIES and name not in DATA["unbuilt"], name
        for step, reason in steps.items():
            assert step in harness.STEPS and reason, (name, step)
    assert set(harness.DEFAULT) <= set(harness.ENTRIES) and not set(harness.DEFAULT) & set(DATA["unbuilt"])


def test_reasons_keep_the_words_and_drop_the_numbers():
    assert harness.reason_of("outputs: error 0.12, autocast 0.01, bound 0.04") == "outputs: error"
    assert harness.reason_of("RuntimeError: Conv2d got 3 channels") == "RuntimeError: Conv2d got"
    assert harness.reason_of("part backbone.body.layer1: error inf") == "part backbone.body.layer1: error inf"


def test_a_verdict_holds_failures_to_their_reasons_and_listed_ones_to_failing():
    data = {"unbuilt": {}, "expected": {"m": {"convert": "outputs: error"}}}
    result = harness.Result("m", "timm", True, steps={"convert": {"outcome": "fail", "detail": "outputs: error 2"}})
    assert harness.verdict(result, data) == []
    result.steps["convert"]["detail"] = "ValueError: boom"
    assert "another reason" in harness.verdict(result, data)[0]
    result.steps["convert"] = {"outcome": "pass", "detail": "outputs: error 0.001"}
    assert "convert no longer fails (pass" in harness.verdict(result, data)[0]
    result.steps["train"] = {"outcome": "fail", "detail": "gradients: w: cosine 0.1"}
    assert any(line.startswith("m train: gradients") for line in harness.verdict(result, data))


@pytest.mark.parametrize("name", list(harness.DEFAULT))
def test_default(name):
    _check(name, harness.DEFAULT[name])


SLOW = [(name, step) for name in harness.ENTRIES for step in harness.STEPS
        if step not in harness.DEFAULT.get(name, ())]


@pytest.mark.slow
@pytest.mark.parametrize("name,step", SLOW, ids=[f"{n}-{s}" for n, s in SLOW])
def test_whole_zoo(name, step):
    _check(name, (step,))
