"""benchmarks/fp8.py's ONNX part: ``python -m benchmarks.fp8 --onnx`` measures only the chosen models' fp8 files, one
model built once for its targets, and a cuda-target row says it ran in the CPU provider."""

import pytest

from benchmarks import fp8


def test_the_onnx_option_builds_each_chosen_model_once_and_prints_one_row_per_target(monkeypatch, capsys):
    built, measured = [], []

    def tiny() -> fp8.Case:
        built.append("tiny")
        return fp8._tiny()

    def row(case: fp8.Case, target: str) -> dict:
        measured.append((case.name, target))
        return {"model": case.name, "target": target, "checker": "full check passes"}

    monkeypatch.setattr(fp8, "MODELS", {"tiny": tiny, "unused": lambda: pytest.fail("not chosen, so not built")})
    monkeypatch.setattr(fp8, "onnx_row", row)
    fp8.main(["--onnx", "--model", "tiny", "--target", "cpu,cuda"])
    assert built == ["tiny"] and [t for _, t in measured] == ["cpu", "cuda"]
    table = capsys.readouterr().out
    assert table.startswith("| model | target | checker |") and table.count("full check passes") == 2


@pytest.mark.parametrize("argv, said", [
    (["--onnx", "--model", "vit,resnet"], "unknown model(s) ['resnet']; choose from minilm, bert, gpt2, vit"),
    (["--onnx", "--target", "tensorrt"], "unknown target(s) ['tensorrt']; choose from cpu, cuda"),
    (["--model", "vit"], "the following arguments are required: --onnx")])
def test_the_onnx_option_refuses_an_unknown_model_or_target_naming_the_choices(argv, said, capsys):
    with pytest.raises(SystemExit) as stopped:
        fp8.main(argv)
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_a_cuda_row_passes_the_full_checker_and_says_it_ran_in_the_cpu_provider():
    row = fp8.onnx_row(fp8._tiny(), "cuda")
    assert row["checker"] == "full check passes"
    assert row["onnxruntime"].startswith("CPU provider (no CUDA provider here)")
    assert row["within_tolerance"] and row["ort_held_out_error"] <= row["tolerance"] == fp8.TOLERANCE
    assert row["fp8_share"] > 0
