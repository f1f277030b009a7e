"""ONNX plans made for their target: onnxruntime CPU, CUDA or TensorRT kernels, and how error is judged."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass import InputError
from amppass.cli import main
from amppass.targets import onnx_target

F32 = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def net() -> onnx.ModelProto:
    """Conv -> Relu -> GlobalAveragePool -> Flatten -> MatMul -> Softmax, opset 17."""
    w = numpy_helper.from_array((RNG.standard_normal((8, 3, 3, 3)) * 0.2).astype(np.float32), "cw")
    m = numpy_helper.from_array((RNG.standard_normal((8, 10)) * 0.3).astype(np.float32), "mw")
    nodes = [helper.make_node("Conv", ["x", "cw"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["f"], name="flat"),
             helper.make_node("MatMul", ["f", "mw"], ["l"], name="mm"),
             helper.make_node("Softmax", ["l"], ["y"], name="softmax", axis=-1)]
    graph = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", F32, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", F32, ["n", 10])], [w, m])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def rows(model: onnx.ModelProto) -> dict[str, amppass.report]:
    return {row.name: row for row in amppass.report(model).rows}


def test_bf16_for_cuda_runs_the_heavy_ops_the_cpu_provider_cannot():
    with pytest.raises(InputError, match="has no bf16 kernel for Conv, MatMul"):
        amppass.convert_onnx(net(), "bf16")
    cuda_model = amppass.convert_onnx(net(), "bf16", target="cuda")
    onnx.checker.check_model(cuda_model, full_check=True)
    cuda = rows(cuda_model)
    # ONNX allows bf16 Conv only from opset 22 (so does onnxruntime's CUDA provider): the model is upgraded
    assert cuda["mm"].precision == cuda["conv"].precision == "bf16"
    info = amppass.report(cuda_model).info
    assert info["opset_upgraded"] == [17, 22] and {o.domain: o.version for o in cuda_model.opset_import}[""] == 22
    assert info["target"]["name"] == "cuda" and "onnxruntime" in info["target"]["kernels"]["source"]
    assert "opset_upgraded" not in amppass.report(amppass.convert_onnx(net(), "fp16", target="cuda")).info


def test_fp16_for_tensorrt_and_cuda_run_every_heavy_op_low():
    for target in ("cuda", "tensorrt"):
        converted = amppass.convert_onnx(net(), "fp16", target=target)
        onnx.checker.check_model(converted, full_check=True)
        found = rows(converted)
        assert found["conv"].precision == found["mm"].precision == "fp16", target
    info = amppass.report(amppass.convert_onnx(net(), target="tensorrt")).info["target"]
    assert "onnx-tensorrt" in info["kernels"]["source"] and info["kernels"]["fallback"]["provider"]


def test_bf16_on_the_cpu_provider_is_refused_as_the_command_line_refuses_it(tmp_path, capsys):
    """Python wrote an all-fp32 file with a warning where the command line refused (exit 2), two answers to one
    request. Both
    refuse now, naming the dtype, the target, the ops and what to do, and write nothing."""
    with pytest.raises(InputError) as refused:
        amppass.convert_onnx(net(), "bf16")
    message = str(refused.value)
    assert message.startswith("dtype='bf16' with target='cpu': onnxruntime CPUExecutionProvider has no bf16 kernel "
                              "for Conv, MatMul")
    assert "pass target='cuda' or target='tensorrt'" in message and "convert with dtype='fp16'" in message
    with pytest.raises(InputError, match="dtype='bf16' with target='cpu'"):
        amppass.convert_onnx(net(), "bfloat16", target="cpu")
    onnx.save(net(), tmp_path / "net.onnx")
    assert main(["convert", str(tmp_path / "net.onnx"), "-o", str(tmp_path / "out.onnx"), "--dtype", "bf16"]) == 2
    assert "--dtype bf16 --target cpu" in capsys.readouterr().err and not (tmp_path / "out.onnx").exists()
    assert rows(amppass.convert_onnx(net(), "fp16"))["mm"].precision == "fp16"  # fp16 runs there


def test_export_onnx_to_bf16_for_the_cpu_provider_is_refused_and_writes_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    model, path = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval(), tmp_path / "m.onnx"
    with pytest.raises(InputError, match="dtype='bf16' with target='cpu'.*no bf16 kernel for (Gemm|MatMul)"):
        amppass.export_onnx(model, (torch.randn(2, 8),), str(path), dtype="bf16")
    assert list(tmp_path.iterdir()) == []


def test_an_fp16_model_is_not_refused_bf16_on_the_cpu_provider():
    """The refusal is about float32 work that would stay fp32: a model already in fp16 has none."""
    model = net()
    for tensor in model.graph.initializer:
        tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), tensor.name))
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.elem_type = TensorProto.FLOAT16
    converted = amppass.convert_onnx(model, "bf16")
    assert {r.precision for r in rows(converted).values()} == {"-"}


def test_targets_are_checked():
    with pytest.raises(InputError, match="target='gpu'.*'cpu', 'cuda', 'tensorrt'"):
        amppass.convert_onnx(net(), target="gpu")
    assert onnx_target("cpu", "fp16") is onnx_target("cpu", "fp16")  # shared: policy caches key on it
    assert onnx_target("cuda", "auto").low.name == "fp16"


def test_tolerance_is_judged_by_running_the_cpu_target_and_simulated_for_gpu_targets():
    feeds = [{"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)} for _ in range(2)]
    cpu = amppass.report(amppass.convert_onnx(net(), calibration=feeds, tolerance=1e-2)).info
    assert cpu["error_judged_by"] == "onnxruntime CPUExecutionProvider" and cpu["tolerance_met"]
    cuda = amppass.report(amppass.convert_onnx(net(), target="cuda", calibration=feeds, tolerance=1e-2)).info
    assert cuda["error_judged_by"] == "fp16-storage simulation"
    assert cuda["target"]["error_judged_by"].startswith("fp16-storage simulation")


def test_cli_target(tmp_path, capsys):
    source = tmp_path / "net.onnx"
    source.write_bytes(net().SerializeToString())
    out = tmp_path / "net.bf16.onnx"
    assert main(["convert", str(source), "-o", str(out), "--dtype", "bf16", "--target", "cuda"]) == 0
    assert rows(onnx.load(out))["mm"].precision == "bf16"
    assert main(["convert", str(source), "-o", str(out), "--target", "tpu"]) == 2
    assert "tpu" in capsys.readouterr().err
