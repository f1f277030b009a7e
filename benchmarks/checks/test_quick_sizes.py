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


def test_dynamic_padding_quick_is_two_variants_of_a_one_layer_bert_for_two_short_rounds():
    from benchmarks import dynamic_padding

    quick, full = dynamic_padding.settings(True), dynamic_padding.settings(False)
    assert quick["layers"] == 1 and quick["rounds"] * quick["per_round"] <= 2 and quick["batch"] <= 4
    assert dynamic_padding.QUICK_VARIANTS == ("Trainer fp32", "AmpPassTrainer bf16")
    assert full["rounds"] >= 10 and full["rounds"] * full["per_round"] == 100  # the full run: rounds to take a median
    assert len(dynamic_padding.VARIANTS) == 4 and "AmpPassTrainer bf16 coverage" in dynamic_padding.VARIANTS


def test_train_step_quick_times_the_digits_cnn_only():
    from benchmarks import train_step

    assert list(train_step._models(True)) == ["digits_cnn (batch 16)"]
    assert list(train_step._models(False))[0] == "digits_cnn (batch 64)" and len(train_step._models(False)) == 2


def test_train_gpt_quick_is_a_one_layer_gpt_for_four_steps():
    from benchmarks import train_gpt

    quick, full = train_gpt.QUICK, train_gpt.FULL
    assert (quick.layers, quick.steps) == (1, 4) and quick.width <= 32 and quick.block <= 32
    assert (full.layers, full.width, full.steps) == (4, 256, 300)


def test_integrations_quick_runs_fp32_and_the_default_amppass_plan_on_a_one_layer_bert():
    from benchmarks import integrations

    quick, full = integrations.settings(True), integrations.settings(False)
    assert (quick.layers, quick.steps) == (1, 3) and quick.hidden <= 32 and quick.seq <= 16
    assert integrations.QUICK_VARIANTS == ("fp32", "amppass bf16")
    assert "amppass bf16 coverage" in integrations.VARIANTS and (full.layers, full.steps) == (4, 20)


def test_fp8_quick_is_one_tiny_model_and_full_the_four_of_the_goal():
    from benchmarks import fp8

    quick, full = fp8.cases(True), fp8.cases(False)
    assert len(quick) == 1 and [build.__name__ for build in full] == ["_minilm", "_bert_base", "_gpt2", "_vit"]
    case = quick[0]()
    assert sum(p.numel() for p in case.model.parameters()) < 100_000
    assert len(case.calibration) == 4 and len(case.held_out) == 2
    assert max(batch["input_ids"].numel() for batch in case.calibration + case.held_out) <= 64


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


def test_gpu_quick_is_one_bert_point_and_one_decoding_batch():
    from benchmarks import gpu

    assert [(p.model, p.batch, p.seq) for p in gpu.points(True)] == [("bert", 1, 16)]
    assert len(gpu.points(False)) == 8


def test_a_quick_before_after_section_leaves_amppass_warnings_on_for_the_sections_after_it():
    import logging

    from benchmarks import checkouts

    def measure(name: str) -> dict:
        logging.getLogger("amppass").setLevel(logging.ERROR)  # as each section's measure does for its own process
        return {"model": name}

    level = logging.getLogger("amppass").level
    assert checkouts.this_checkout(measure, ["m"]) == [{"checkout": "this", "model": "m"}]
    assert logging.getLogger("amppass").level == level
