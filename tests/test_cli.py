"""The ``amppass`` command line: end to end on an exported zoo model, and every kind of bad input."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
import torch

import amppass
from amppass.cli import main
from amppass.reporting.report import load_schema
from models import build
from tests.helpers.paths import ROOT

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
    done = _run("convert", mlp_onnx, "-o", str(out), "--dtype", "fp16", "--report", str(html), str(data),
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

    shown = _run("report", str(out), "--report", str(tmp_path / "again.json"))
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
    ("notes.txt", b"just some text, not a model\n", ["notes.txt", "could not be read as an ONNX model"]),
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
    code, err = _convert(capsys, folder, "--dtype", "fp4")
    assert code == 2
    _one_error_line(err, "fp4")
    assert not (folder / "out.onnx").exists()


def test_output_equal_to_input_needs_force(capsys, folder):
    before = (folder / "mlp.onnx").read_bytes()
    code = main(["convert", str(folder / "mlp.onnx"), "-o", str(folder / "." / "mlp.onnx")])
    assert code == 2
    _one_error_line(capsys.readouterr().err, "mlp.onnx", "--force")
    assert (folder / "mlp.onnx").read_bytes() == before


@pytest.mark.parametrize("outputs", [
    ["-o", "r.html", "--report", "r.html"],
    ["-o", "out.onnx", "--report", "r.json", "./r.json"],
    ["-o", "out.onnx", "--report", "r.html", "link.html"],  # link.html -> r.html
    ["-o", "link.html", "--report", "r.html"],
], ids=["output-and-report", "two-reports", "report-through-a-link", "output-through-a-link"])
def test_two_outputs_that_name_one_file_are_refused_before_anything_is_written(capsys, folder, outputs, monkeypatch):
    (folder / "r.html").write_text("mine")
    os.symlink("r.html", folder / "link.html")
    monkeypatch.chdir(folder)
    code = main(["convert", "mlp.onnx", *outputs])
    assert code == 2
    _one_error_line(capsys.readouterr().err, "name one file", "its own file name")
    assert (folder / "r.html").read_text() == "mine" and os.path.islink(folder / "link.html")
    assert sorted(os.listdir(folder)) == ["link.html", "mlp.onnx", "r.html"]


def test_a_report_that_is_the_input_model_is_refused(capsys, folder):
    os.symlink("mlp.onnx", folder / "model.html")
    before = (folder / "mlp.onnx").read_bytes()
    for command in (["report", str(folder / "mlp.onnx")], ["convert", str(folder / "mlp.onnx"), "-o",
                                                           str(folder / "out.onnx"), "--force"]):
        assert main([*command, "--report", str(folder / "model.html")]) == 2
        _one_error_line(capsys.readouterr().err, "model.html", "the input model")
    assert (folder / "mlp.onnx").read_bytes() == before and not (folder / "out.onnx").exists()


@needs_onnx
def test_an_output_that_is_a_link_replaces_the_file_it_points_to(capsys, folder):
    """The link is followed (as a shell's > does): its target gets the converted model, atomically, and the link
    stays a link."""
    (folder / "models").mkdir()
    (folder / "models" / "v2.onnx").write_bytes(b"old")
    (folder / "models" / "v2.html").write_bytes(b"old")
    os.symlink(os.path.join("models", "v2.onnx"), folder / "current.onnx")
    os.symlink(os.path.join("models", "v2.html"), folder / "current.html")
    code = main(["convert", str(folder / "mlp.onnx"), "-o", str(folder / "current.onnx"),
                 "--report", str(folder / "current.html")])
    assert code == 0, capsys.readouterr().err
    assert os.path.islink(folder / "current.onnx") and os.path.islink(folder / "current.html")
    converted = onnx.load(str(folder / "models" / "v2.onnx"))
    assert any(p.key == "amppass" for p in converted.metadata_props)
    assert "<html" in (folder / "models" / "v2.html").read_text()
    assert amppass.report(str(folder / "current.onnx")).info["dtype"] == "fp16"


def test_a_failed_write_names_its_file(folder):
    """A write that fails halfway (here the file-size limit, as a full disk would) names the output it could not
    write, and leaves nothing behind."""
    code = ("import resource, signal, sys\nfrom amppass.cli import main\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\nsys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "convert", str(folder / "mlp.onnx"), "-o",
                           str(folder / "out.onnx")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1
    line = _one_error_line(done.stderr, f"cannot write {folder / 'out.onnx'}", "nothing was changed")
    assert ".amppass-" not in line and _leftovers(folder) == []


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
def _bomb(path, name: str, rows: int, compress: int = zipfile.ZIP_DEFLATED, shape: tuple | None = None) -> str:
    """A .npz whose one array ``name`` of float32 zeros, ``rows`` x 64, is compressed (zeros deflate a
    thousandfold); its header declares ``shape`` when given."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": shape or (rows, 64)})
    with zipfile.ZipFile(path, "w", compress) as archive, archive.open(f"{name}.npy", "w", force_zip64=True) as out:
        out.write(header.getvalue())
        chunk, left = memoryview(bytes(1 << 20)), rows * 64 * 4
        while left:
            out.write(chunk[:min(left, len(chunk))])
            left -= min(left, len(chunk))
    return str(path)


def test_calibration_feeds_that_inflate_past_the_bound_are_refused_unread(capsys, folder):
    """A 200 KB file of arrays that inflate to 256 MiB: refused from its zip directory, nothing inflated."""
    feeds = _bomb(folder / "feeds.npz", "x", 1 << 20)
    assert os.path.getsize(feeds) < 1 << 20
    code, err = _convert(capsys, folder, "--calib", feeds)
    assert code == 1
    _one_error_line(err, "feeds.npz", "would inflate to 268,435,", "numpy.savez (uncompressed)")
    assert _leftovers(folder) == []


@pytest.mark.parametrize("shape, words", [
    ((1 << 40, 64), ["declares 281,474,976,710,656 bytes", "entry holds 4,096"]),
    ((8, 64), ["declares 2,048 bytes", "entry holds 4,096"]),
], ids=["larger", "smaller"])
def test_an_array_whose_header_disagrees_with_its_entry_is_refused(capsys, folder, shape, words):
    feeds = _bomb(folder / "feeds.npz", "x", 16, zipfile.ZIP_STORED, shape=shape)
    code, err = _convert(capsys, folder, "--calib", feeds)
    assert code == 1
    _one_error_line(err, "feeds.npz", "array x", *words)


def test_compressed_feeds_within_the_bound_calibrate(capsys, folder):
    np.savez_compressed(folder / "feeds.npz", x=np.random.default_rng(0).standard_normal((3, 2, 64), np.float32))
    code, err = _convert(capsys, folder, "--calib", str(folder / "feeds.npz"), "--report", str(folder / "r.json"))
    assert code == 0, err
    assert json.loads((folder / "r.json").read_text())["info"]["calibration_batches"] == 3


def test_matching_calibration_feeds_calibrate_and_meet_the_tolerance(capsys, folder):
    feeds = _feeds(folder, x=np.random.default_rng(0).standard_normal((3, 2, 64)).astype(np.float32))
    code, err = _convert(capsys, folder, "--calib", feeds, "--tolerance", "1e-2")
    assert code == 0, err
    assert main(["report", str(folder / "out.onnx"), "--report", str(folder / "r.json")]) == 0
    info = json.loads((folder / "r.json").read_text())["info"]
    assert info["calibrated"] is True and info["calibration_batches"] == 3
    assert info["tolerance"] == 1e-2 and info["tolerance_met"] is True and info["achieved_error"] <= 1e-2


@needs_onnx
def test_fp8_converts_an_onnx_model_with_its_feeds_and_reports_each_product_in_fp8(capsys, folder):
    rng = np.random.default_rng(0)
    feeds = _feeds(folder, x=rng.standard_normal((4, 8, 64)).astype(np.float32))
    code, err = _convert(capsys, folder, "--dtype", "fp8", "--calib", feeds, "--tolerance", "0.1", "--report",
                         str(folder / "r.json"))
    assert code == 0, err
    report = json.loads((folder / "r.json").read_text())
    record = report["info"]["fp8"]
    assert record["products"]["fp8"] >= 1 and record["tolerance"] == 0.1
    rows = [row for row in report["rows"] if row["precision"] == "fp8"]
    assert len(rows) == record["products"]["fp8"] and all(row["op"] in ("MatMul", "Gemm") for row in rows)
    assert all(o["scale"] > 0 for row in rows for o in row["evidence"]["fp8"]["operands"])
    import jsonschema

    jsonschema.validate(report, load_schema())
    x = rng.standard_normal((8, 64)).astype(np.float32)
    with torch.no_grad():
        want = build("mlp", "small").model(torch.from_numpy(x)).numpy()
    import onnxruntime as ort

    got = ort.InferenceSession(str(folder / "out.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 0.1  # within the tolerance, on a new batch
    assert main(["report", str(folder / "out.onnx"), "--precision", "fp8"]) == 0
    listed = capsys.readouterr().out
    assert f"fp8 (e4m3): {len(rows)} of 2 matrix products" in " ".join(listed.split())  # the summary, unwrapped
    assert f"{len(rows)} of" in listed and rows[0]["name"][-6:] in listed


def test_fp8_for_an_onnx_model_without_feeds_is_a_usage_error_naming_calib(capsys, folder):
    code, err = _convert(capsys, folder, "--dtype", "fp8")
    assert code == 2
    _one_error_line(err, "--dtype fp8 needs --calib FEEDS.npz", "--dtype fp16")
    assert _leftovers(folder) == []


@needs_onnx
def test_fp8_with_feeds_defaults_to_the_fp8_tolerance(capsys, folder):
    feeds = _feeds(folder, x=np.random.default_rng(1).standard_normal((4, 8, 64)).astype(np.float32))
    assert _convert(capsys, folder, "--dtype", "fp8", "--calib", feeds, "--report", str(folder / "r.json"))[0] == 0
    info = json.loads((folder / "r.json").read_text())["info"]
    assert info["fp8"]["tolerance"] == 2e-2 and sum(info["fp8"]["products"].values()) == 2


def test_plan_for_is_for_a_program_not_an_onnx_model(capsys, folder):
    code, err = _convert(capsys, folder, "--plan-for", "coverage")
    assert code == 2
    _one_error_line(err, "--plan-for coverage", "applies to a .pt2 program")


@pytest.fixture
def mlp_pt2(tmp_path) -> str:
    """The zoo's small MLP saved by torch.export.save."""
    case = build("mlp", "small")
    path = tmp_path / "mlp.pt2"
    torch.export.save(torch.export.export(case.model, case.example_inputs), str(path))
    return str(path)


def test_fp8_of_a_program_for_the_cpu_needs_plan_for_coverage(capsys, mlp_pt2, tmp_path):
    out = tmp_path / "mlp.fp8.pt2"
    assert main(["convert", mlp_pt2, "-o", str(out), "--dtype", "fp8"]) == 2
    _one_error_line(capsys.readouterr().err, "--dtype fp8 --target cpu", "add --plan-for coverage", "--dtype bf16")
    assert not out.exists()
    code = main(["convert", mlp_pt2, "-o", str(out), "--dtype", "fp8", "--plan-for", "coverage", "--report",
                 str(tmp_path / "r.json")])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "r.json").read_text())
    fp8_rows = [row for row in report["rows"] if row["precision"] == "fp8"]
    assert fp8_rows and all(row["evidence"]["fp8"]["input_scale"] == "dynamic" for row in fp8_rows)
    assert report["info"]["fp8"]["products"]["fp8"] == len(fp8_rows)
    loaded, case = amppass.load(str(out)), build("mlp", "small")
    x = case.example_inputs[0]
    with torch.no_grad():
        want = case.model(x)
        assert float((loaded(x).float() - want).norm() / want.norm()) <= 3 * 2 * 2.0 ** -4  # e4m3 per product


def test_tolerance_without_calibration_feeds_is_a_usage_error(capsys, folder):
    code, err = _convert(capsys, folder, "--tolerance", "1e-2")
    assert code == 2
    _one_error_line(err, "--tolerance needs --calib")
    assert _leftovers(folder) == []


@needs_onnx
def test_report_on_a_model_amppass_did_not_convert(capsys, folder):
    code = main(["report", str(folder / "mlp.onnx"), "--report", str(folder / "r.json")])
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

    from amppass.onnx.io import save as onnx_save

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


# -- the report command and its options ------------------------------------------------------------------

LONG = "/encoder/layer.{i}/attention/output/dense/a_rather_long_scope/Gemm_{i}"


@pytest.fixture(scope="module")
def long_names(mlp_onnx, tmp_path_factory) -> tuple[str, list[str]]:
    """The MLP converted to fp16 after its nodes got long, scoped names (as TorchScript exports write)."""
    model = onnx.load(mlp_onnx)
    names = [LONG.format(i=i) for i in range(len(model.graph.node))]
    for node, name in zip(model.graph.node, names, strict=False):
        node.name = name
    folder = tmp_path_factory.mktemp("long")
    onnx.save(model, str(folder / "in.onnx"))
    assert main(["convert", str(folder / "in.onnx"), "-o", str(folder / "out.onnx")]) == 0
    return str(folder / "out.onnx"), names


@needs_onnx
def test_report_fits_80_columns_with_the_summary_first(long_names, capsys, monkeypatch):
    path, names = long_names
    monkeypatch.setenv("COLUMNS", "80")
    capsys.readouterr()
    assert main(["report", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert lines[0].startswith("╭─ amppass onnx") and any("casts inserted" in line for line in lines[:10])
    header = next(i for i, line in enumerate(lines) if line.startswith("node "))
    assert header > max(i for i, line in enumerate(lines) if "casts inserted" in line)  # summary, then table
    rows = [line for line in lines[header + 2:] if "layer." in line.split(" ")[0]]
    assert len(rows) == len(names)  # one line per node: no wrapping
    shown = [row.split()[0] for row in rows]
    assert len(set(shown)) == len(names)  # shortened, and still one name per node
    indexes = {f"layer.{i}/" for i in range(len(names))}
    assert {next(i for i in indexes if i in name) for name in shown} == indexes  # each keeps its layer


@needs_onnx
def test_report_filters_and_groups(long_names, capsys, monkeypatch):
    path, names = long_names
    monkeypatch.setenv("COLUMNS", "120")
    precisions = {row.name: row.precision for row in amppass.report(path).rows}
    capsys.readouterr()
    assert main(["report", path, "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    fp32 = [n for n in names if precisions[n] == "fp32"]
    assert 0 < len(fp32) < len(names) and f"{len(fp32)} of {len(names)} nodes: precision fp32" in out
    assert sum("layer." in line.split(" ")[0] for line in out.splitlines()) == len(fp32)
    assert main(["report", path, "--op", "gemm"]) == 0  # case-insensitive
    out = capsys.readouterr().out
    assert sum("layer." in line.split(" ")[0] and " Gemm " in line for line in out.splitlines()) == 2
    assert main(["report", path, "--by-op"]) == 0
    ops = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
           if line.split() and line.split()[0] in ("Gemm", "Gelu", "LayerNormalization")}
    assert ops["Gemm"][:2] == ["2", "2"] and ops["LayerNormalization"][0] == "1"
    assert main(["report", path, "--op", "Softmax"]) == 0
    assert "no node matches op Softmax; the model's ops: Gelu, Gemm, LayerNormalization" in \
        " ".join(capsys.readouterr().out.split())


@needs_onnx
@pytest.mark.parametrize("command", ["convert", "report"])
def test_report_files_take_their_format_from_the_extension(command, capsys, folder):
    source = str(folder / "mlp.onnx")
    if command == "report":
        assert main(["convert", source, "-o", str(folder / "out.onnx")]) == 0
        args = ["report", str(folder / "out.onnx")]
    else:
        args = ["convert", source, "-o", str(folder / "out.onnx")]
    assert main([*args, "--report", str(folder / "r.json"), "--report", str(folder / "r.HTML")]) == 0
    import jsonschema

    jsonschema.validate(json.loads((folder / "r.json").read_text()), load_schema())
    assert (folder / "r.HTML").read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("args, words", [
    (["--report", "r.txt"], ["r.txt", "--report writes HTML (.html, .htm) or JSON (.json)"]),
    (["--report", "r.html", "r"], ["r:", "extension"]),
    (["--json", "r.json"], ["--json is now --report", "--report /"]),
    (["--html", "r.html"], ["--html is now --report"]),
])
@pytest.mark.parametrize("command", ["convert", "report"])
def test_report_files_without_a_known_extension_are_refused_before_any_work(capsys, folder, command, args, words):
    args = [str(folder / a) if a.startswith("r") else a for a in args]
    extra = ["-o", str(folder / "out.onnx")] if command == "convert" else []
    assert main([command, str(folder / "mlp.onnx"), *extra, *args]) == 2
    _one_error_line(capsys.readouterr().err, *words)
    assert _leftovers(folder) == []


@needs_onnx
def test_dtype_auto_picks_a_dtype_the_runtime_runs_matrix_products_in(capsys, folder):
    code, err = _convert(capsys, folder, "--dtype", "auto")
    assert code == 0, err
    report = amppass.report(str(folder / "out.onnx"))
    gemms = [row for row in report.rows if row.op == "Gemm"]
    # onnxruntime's CPU provider has no bf16 Gemm: bf16 would have left both in fp32
    assert report.info["dtype"] == "fp16" and [row.precision for row in gemms] == ["fp16", "fp16"]


# -- options of convert_onnx on the command line ----------------------------------------------------------

class _Lookup(torch.nn.Module):
    """An embedding table feeding a layer norm (fp32 work): the table stays fp32 unless asked otherwise."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(2000, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 8)

    def forward(self, ids):
        return self.head(self.norm(self.table(ids)))


@pytest.fixture(scope="module")
def lookup_onnx(tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("lookup") / "lookup.onnx"
    torch.onnx.export(_Lookup().eval(), (torch.randint(0, 2000, (2, 7)),), str(path), dynamo=False,
                      input_names=["ids"], output_names=["y"], dynamic_axes={"ids": {0: "batch", 1: "length"}})
    return str(path)


def _table_type(path) -> int:
    model = onnx.load(str(path))
    return next(t.data_type for t in model.graph.initializer if tuple(t.dims) == (2000, 64))


@needs_onnx
def test_low_weight_tables_halves_the_embedding_table(lookup_onnx, tmp_path, capsys):
    plain, low = tmp_path / "plain.onnx", tmp_path / "low.onnx"
    assert main(["convert", lookup_onnx, "-o", str(plain)]) == 0
    assert main(["convert", lookup_onnx, "-o", str(low), "--low-weight-tables"]) == 0
    capsys.readouterr()
    assert _table_type(plain) == onnx.TensorProto.FLOAT and _table_type(low) == onnx.TensorProto.FLOAT16
    assert os.path.getsize(low) < 0.6 * os.path.getsize(plain)


@needs_onnx
def test_no_keep_io_types_gives_low_precision_outputs(lookup_onnx, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    assert main(["convert", lookup_onnx, "-o", str(out), "--no-keep-io-types"]) == 0, capsys.readouterr().err
    outputs = onnx.load(str(out)).graph.output
    assert [o.type.tensor_type.elem_type for o in outputs] == [onnx.TensorProto.FLOAT16]


def test_bf16_for_a_target_without_bf16_kernels_is_refused_naming_the_targets_that_have_them(capsys, folder):
    """onnxruntime's CPU provider has no bf16 Gemm: the file written had nothing in bf16."""
    code, err = _convert(capsys, folder, "--dtype", "bf16")
    assert code == 2
    _one_error_line(err, "--dtype bf16", "Gemm", "--target cuda", "--target tensorrt", "--dtype fp16")
    assert not (folder / "out.onnx").exists()


@needs_onnx
def test_bf16_for_a_target_with_bf16_kernels_converts(capsys, folder):
    code, err = _convert(capsys, folder, "--dtype", "bf16", "--target", "tensorrt")
    assert code == 0, err
    report = amppass.report(str(folder / "out.onnx"))
    assert report.info["dtype"] == "bf16" and {r.precision for r in report.rows if r.op == "Gemm"} == {"bf16"}


@needs_onnx
def test_report_on_a_truncated_model_names_the_damage(mlp_onnx, tmp_path):
    """Exit 1 with one line naming the damage (it was "cannot close exported pointers exist")."""
    cut = tmp_path / "cut.onnx"
    data = open(mlp_onnx, "rb").read()
    cut.write_bytes(data[:len(data) // 2])
    done = _run("report", str(cut))
    assert done.returncode == 1
    _one_error_line(done.stderr, "cut.onnx", "runs past the end of its message", "cut short or damaged")
    done = _run("convert", str(cut), "-o", str(tmp_path / "out.onnx"))
    assert done.returncode == 1
    _one_error_line(done.stderr, "cut.onnx", "runs past the end of its message", "cut short or damaged")
