"""The --quick configuration stays a smoke run: few models, small sizes, few repeats, while --full keeps its own.
Counts only (no timing is asserted): benchmarks/README.md states what the quick run took."""

import torch

from benchmarks import conversion_profile, latency, never_slower


def test_latency_quick_is_the_small_bert_at_one_point():
    quick, full = latency.settings(True), latency.settings(False)
    assert [(p.model, p.size, p.batch, p.seq) for p in quick] == [("bert", "small", 1, 16)]
    assert len(full) == 9 and {p.size for p in full} == {"base"}  # the full run is unchanged


def test_never_slower_quick_converts_one_small_model_per_table():
    quick = never_slower.cases(True)
    assert [(label, batch) for label, batch, _ in quick] == [("mlp-small", 1)]
    assert len(never_slower.cases(False)) > 10 * len(quick)
    assert never_slower.QUICK_COMPILED == ("mlp", "eager") and never_slower.QUICK_SMALL == ("distilbert",)


def test_conversion_profile_quick_net_is_a_small_3d_swin():
    model, (x,) = conversion_profile.build(quick=True)
    full, (big,) = conversion_profile.build(quick=False)
    assert x.numel() <= 8 ** 3 and big.numel() == 64 ** 3
    assert len(model.stages) == 1 and len(full.stages) == 4
    assert sum(p.numel() for p in model.parameters()) < sum(p.numel() for p in full.parameters()) / 50
    assert isinstance(model.embed, torch.nn.Conv3d)


def test_shapes_quick_set_is_two_small_architectures():
    from benchmarks import shapes

    assert [name for name, _ in shapes.architectures(True)] == list(shapes.QUICK) == ["zoo:mlp", "interpolate"]
    assert len(shapes.architectures(False)) > 5 * len(shapes.QUICK)


def test_other_sections_quick_sets_hold_one_model():
    from benchmarks import (
        call_overhead,
        conversion_time,
        generate,
        hostile,
        lean_onnx,
        onnx_compare,
        onnx_targets,
        plans_under_load,
        startup,
        tolerance_reference,
        tolerance_time,
        zoo,
    )

    assert onnx_compare.QUICK == ("bert", "small", 1, 16) and list(onnx_targets.models(True)) == ["bert-small"]
    assert [c.name for c in tolerance_reference.cases() if c.quick] == ["sensor net"]
    assert lean_onnx.QUICK == ("6 Conv-BN-ReLU blocks (BN unfolded)",) and len(hostile.QUICK) == 1
    assert plans_under_load.QUICK == "mlp" and list(zoo.QUICK.values()) == [("convert-coverage",)]
    point = generate.setting(True)
    assert point.batches == (1,) and point.layers == 2 and not point.compiled_baseline and point.compiler == "eager"
    for module in (call_overhead, startup, tolerance_time, conversion_time):
        assert 1 <= len(module.QUICK) <= 2 and set(module.QUICK) <= set(getattr(module, "MODELS", None) or
                                                                         getattr(module, "CASES", None) or
                                                                         module.CODE)
