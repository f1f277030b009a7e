"""The --quick configuration stays a smoke run: few models, small sizes, few repeats, while --full keeps its own.
Counts only (no timing is asserted): benchmarks/README.md states what the quick run took."""

import torch

from benchmarks import conversion_profile, latency, never_slower


def test_latency_quick_is_the_small_bert_at_one_point_per_target_batch():
    quick, full = latency.settings(True), latency.settings(False)
    assert [(p.model, p.size, p.batch) for p in quick] == [("bert", "small", 1), ("bert", "small", 8)]
    assert max(p.seq for p in quick) <= 32
    assert len(full) == 9 and {p.size for p in full} == {"base"}  # the full run is unchanged


def test_never_slower_quick_converts_four_models_and_one_small_one():
    quick = never_slower.cases(True)
    assert len(quick) == 4 and {label for label, _, _ in quick} == {"bert-small", "lstm"}
    assert len(never_slower.cases(False)) > 3 * len(quick)


def test_conversion_profile_quick_net_is_a_small_3d_swin():
    model, (x,) = conversion_profile.build(quick=True)
    full, (big,) = conversion_profile.build(quick=False)
    assert x.numel() <= 16 ** 3 and big.numel() == 64 ** 3
    assert len(model.stages) == 1 and len(full.stages) == 4
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in full.parameters()) / 50
    assert isinstance(model.embed, torch.nn.Conv3d)


def test_shapes_quick_set_is_three_architectures():
    from benchmarks import shapes

    assert [name for name, _ in shapes.architectures(True)] == list(shapes.QUICK) and len(shapes.QUICK) == 3
    assert len(shapes.architectures(False)) > 3 * len(shapes.QUICK)


def test_fp8_quick_is_one_tiny_model_and_full_the_four_of_the_goal():
    from benchmarks import fp8

    quick, full = fp8.cases(True), fp8.cases(False)
    assert len(quick) == 1 and [build.__name__ for build in full] == ["_minilm", "_bert_base", "_gpt2", "_vit"]
    case = quick[0]()
    assert sum(p.numel() for p in case.model.parameters()) < 100_000
    assert len(case.calibration) == 4 and len(case.held_out) == 2
    assert max(batch["input_ids"].numel() for batch in case.calibration + case.held_out) <= 64
