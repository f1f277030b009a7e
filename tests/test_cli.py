"""The ``amppass`` command line: end to end on an exported zoo model, and every kind of bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

import amppass
from amppass.cli import main
from amppass.report.report import load_schema
from models import build

needs_onnx = pytest.mark.skipif(not hasattr(amppass, "convert_onnx"), reason="amppass.convert_onnx has not landed")


@pytest.fixture(scope="module")
def mlp_onnx(tmp_path_factory) -> str:
    """The zoo's small MLP exported to ONNX with a dynamic batch axis (input "x": [batch, 64])."""
    case = build("mlp", "small")
    path = tmp_path_factory.mktemp("models") / "mlp.onnx"
    torch.onnx.export(case.model, case.example_inputs, str(path), dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}})
    return str(path)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}  # wide enough that rich prints node names unfolded
    return subprocess.run([sys.executable, "-m", "amppass", *args], capture_output=True, text=True, timeout=120,
                          env=env)


def _one_error_line(stderr: str, *words: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("amppass: error: ") and "Traceback" not in stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def _leftovers(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if p != "mlp.onnx" and not p.endswith(".npz") and p != "notes.txt")


# -- end to end ---------------------------------------------------------------------------------------

@needs_onnx
def test_convert_then_report_end_to_end(mlp_onnx, tmp_path):
    out, html, data = tmp_path / "mlp.fp16.onnx", tmp_path / "r.html", tmp_path / "r.json"
    done = _run("convert", mlp_onnx, "-o", str(out), "--dtype", "fp16", "--report", str(html), "--json", str(data),
                "--keep-fp32", "Gelu")
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout and "fp16" in done.stdout

    import onnxruntime as ort

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 64), dtype=np.float32)
    expected = build("mlp", "small").model(torch.from_numpy(x)).detach().numpy()
    (result,) = session.run(None, {"x": x})
    assert result.dtype == np.float32 and np.allclose(result, expected, rtol=2e-2, atol=2e-2)

    report = json.loads(data.read_text())
    import jsonschema

    jsonschema.validate(report, load_schema())
    sources = {r["op"]: (r["precision"], r["source"]) for r in report["rows"]}
    assert sources["Gelu"] == ("fp32", "override") and sources["Gemm"][0] == "fp16"
    assert html.read_text().count('<tr data-precision=') == len(report["rows"])

    shown = _run("report", str(out), "--json", str(tmp_path / "again.json"))
    assert shown.returncode == 0, shown.stderr
    for row in report["rows"]:
        assert row["name"] in shown.stdout
    assert json.loads((tmp_path / "again.json").read_text())["rows"] == report["rows"]


def test_help_and_version():
    done = _run("--help")
    assert done.returncode == 0 and "convert" in done.stdout and "report" in done.stdout
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0


def test_missing_file_from_a_real_process(tmp_path):
    done = _run("convert", str(tmp_path / "nope.onnx"), "-o", str(tmp_path / "out.onnx"))
    assert done.returncode == 1
    _one_error_line(done.stderr, "nope.onnx", "no such file")
    assert os.listdir(tmp_path) == []


# -- bad input, in process ------------------------------------------------------------------------------

@pytest.fixture()
def folder(tmp_path, mlp_onnx):
    """A folder holding a copy of the exported model as mlp.onnx."""
    (tmp_path / "mlp.onnx").write_bytes(open(mlp_onnx, "rb").read())
    return tmp_path


def _convert(capsys, folder, *extra: str, model: str = "mlp.onnx") -> tuple[int, str]:
    code = main(["convert", str(folder / model), "-o", str(folder / "out.onnx"), *extra])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name, content, words", [
    ("missing.onnx", None, ["missing.onnx", "no such file"]),
    ("notes.txt", b"just some text, not a model\n", ["notes.txt", "not a readable ONNX model"]),
    ("empty.onnx", b"", ["empty.onnx", "not an ONNX model"]),
])
def test_unusable_model_files(capsys, folder, name, content, words):
    if content is not None:
        (folder / name).write_bytes(content)
    code, err = _convert(capsys, folder, model=name)
    assert code == 1
    _one_error_line(err, *words)
    assert not (folder / "out.onnx").exists()


def test_truncated_model(capsys, folder):
    (folder / "cut.onnx").write_bytes((folder / "mlp.onnx").read_bytes()[:400])
    code, err = _convert(capsys, folder, model="cut.onnx")
    assert code == 1
    _one_error_line(err, "cut.onnx", "ONNX")
    assert not (folder / "out.onnx").exists()


def test_invalid_graph(capsys, folder):
    model = onnx.load(str(folder / "mlp.onnx"))
    model.graph.node[0].input[0] = "no_such_value"
    onnx.save(model, str(folder / "broken.onnx"))
    code, err = _convert(capsys, folder, model="broken.onnx")
    assert code == 1
    _one_error_line(err, "broken.onnx", "invalid ONNX model")


def test_unknown_dtype_is_a_usage_error(capsys, folder):
    code, err = _convert(capsys, folder, "--dtype", "fp8")
    assert code == 2
    _one_error_line(err, "fp8")
    assert not (folder / "out.onnx").exists()


def test_output_equal_to_input_needs_force(capsys, folder):
    before = (folder / "mlp.onnx").read_bytes()
    code = main(["convert", str(folder / "mlp.onnx"), "-o", str(folder / "." / "mlp.onnx")])
    assert code == 2
    _one_error_line(capsys.readouterr().err, "mlp.onnx", "--force")
    assert (folder / "mlp.onnx").read_bytes() == before


def test_output_folder_must_exist(capsys, folder):
    code = main(["convert", str(folder / "mlp.onnx"), "-o", str(folder / "no" / "out.onnx")])
    assert code == 1
    _one_error_line(capsys.readouterr().err, "does not exist")


def _feeds(folder, **arrays) -> str:
    path = folder / "feeds.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("arrays, words", [
    ({"y": np.zeros((2, 64), np.float32)}, ["no array for model input(s) x", "arrays y"]),
    ({"x": np.zeros((2, 64), np.float32), "z": np.zeros(3)}, ["z are not model inputs"]),
    ({"x": np.zeros((64,), np.float32)}, ["array x has shape (64,)", "rank 2"]),
    ({"x": np.zeros((2, 32), np.float32)}, ["batch of shape (2, 32)", "['?', 64]"]),
    ({"x": np.zeros((2, 64), np.int64)}, ["array x is int64", "float32"]),
])
def test_calibration_feeds_that_do_not_match_the_model(capsys, folder, arrays, words):
    code, err = _convert(capsys, folder, "--calib", _feeds(folder, **arrays))
    assert code == 1
    _one_error_line(err, "feeds.npz", *words)
    assert _leftovers(folder) == []


def test_calibration_file_that_is_not_npz(capsys, folder):
    (folder / "feeds.npz").write_text("x = 1\n")
    code, err = _convert(capsys, folder, "--calib", str(folder / "feeds.npz"))
    assert code == 1
    _one_error_line(err, "feeds.npz", "not a .npz")


@needs_onnx
def test_matching_calibration_feeds_calibrate_and_meet_the_tolerance(capsys, folder):
    feeds = _feeds(folder, x=np.random.default_rng(0).standard_normal((3, 2, 64)).astype(np.float32))
    code, err = _convert(capsys, folder, "--calib", feeds, "--tolerance", "1e-2")
    assert code == 0, err
    assert main(["report", str(folder / "out.onnx"), "--json", str(folder / "r.json")]) == 0
    info = json.loads((folder / "r.json").read_text())["info"]
    assert info["calibrated"] is True and info["calibration_batches"] == 3
    assert info["tolerance"] == 1e-2 and info["tolerance_met"] is True and info["achieved_error"] <= 1e-2


def test_tolerance_without_calibration_feeds_is_a_usage_error(capsys, folder):
    code, err = _convert(capsys, folder, "--tolerance", "1e-2")
    assert code == 2
    _one_error_line(err, "--tolerance needs --calib")
    assert _leftovers(folder) == []


@needs_onnx
def test_report_on_a_model_amppass_did_not_convert(capsys, folder):
    code = main(["report", str(folder / "mlp.onnx"), "--json", str(folder / "r.json")])
    assert code == 1
    _one_error_line(capsys.readouterr().err, "mlp.onnx")
    assert _leftovers(folder) == []


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "convert" in capsys.readouterr().err


def test_convert_writes_external_data_models_from_the_path(tmp_path, monkeypatch):
    """The CLI converts from the path (external data memory-mapped) and writes through save(), which puts the
    weights in a .data file when the model is over 2 GB; the limit is lowered here to exercise that path."""
    from onnx import TensorProto, helper, numpy_helper

    from amppass.onnx import save as onnx_save

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), "w")
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64])], [w]),
        opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    source = tmp_path / "in.onnx"
    onnx.save_model(model, source, save_as_external_data=True, location="in.onnx.data", size_threshold=0)
    monkeypatch.setattr(onnx_save, "PROTOBUF_LIMIT", 1024)
    assert main(["convert", str(source), "-o", str(tmp_path / "out.onnx")]) == 0
    data, = tmp_path.glob("out.onnx.*.data")  # a fresh name only the new model reads
    assert data.stat().st_size == 64 * 64 * 2  # the fp16 weight, outside the proto
    written = onnx.load(tmp_path / "out.onnx")
    onnx.checker.check_model(written, full_check=True)
    assert numpy_helper.to_array(written.graph.initializer[0]).dtype == np.float16
