"""Property: a hostile model file gives a valid converted model or an AmpPassError, nothing else.

Hypothesis builds small models (a weight as an initializer, a Constant node or an If-branch initializer,
kept in an external data file) and damages them the ways an attacker or a broken exporter would: external
data locations (absolute, climbing out, links pointing out or in, folders, devices, the store's reserved
name), offsets and lengths (negative, huge, not numbers, past the end), shapes (negative, disagreeing with
the bytes), nesting depth, node order (shuffled, cycles, a value written twice) and the report metadata of
converted models (every field the summary reads, texts a format string would inflate). Whatever comes out:
``convert_onnx`` returns a model that passes the full checker and runs
in onnxruntime, or raises :class:`amppass.AmpPassError`; a weight whose data resolves outside the model's
folder never converts; ``amppass.report`` returns a report that renders no larger than the file, or raises
AmpPassError. Calibration files (``amppass convert --calib``) whose headers, dtypes or zip directory lie feed the
conversion or are refused in one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import amppass
from amppass import AmpPassError
from amppass.cli import main
from amppass.reporting.terminal import render_text
from amppass.targets import onnxruntime_facts
from tests.helpers.onnx_files import SECRET, matmul_64, weights_named_w

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

LOCATIONS = st.sampled_from([
    "w.data", "./w.data", "sub/../w.data", "inside-link.data", "outside-link.data", "dir-link/secret",
    "{secret}", "../elsewhere/secret", "../../etc/passwd", "/dev/zero", "sub", "", "amppass:weight-store",
    "missing.data", "w.data/x",
])
NUMBERS = st.one_of(st.none(), st.integers(-2**70, 2**70).map(str),
                    st.sampled_from(["0", "16384", "-0", "1e3", "0x10", " 8", "abc", "٣", ""]))


def _hostile_folder(root: Path) -> Path:
    """root/model (with w.data, sub/, links in and out) and root/elsewhere/secret."""
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "secret").write_bytes(SECRET)
    folder = root / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "inside-link.data").symlink_to(folder / "w.data")
    (folder / "outside-link.data").symlink_to(root / "elsewhere" / "secret")
    (folder / "dir-link").symlink_to(root / "elsewhere")
    return folder


def _outside(folder: Path, location: str) -> bool:
    """Whether ``location`` names a file outside ``folder`` once links are resolved."""
    if not location or os.path.isabs(location):
        return bool(location)
    real = os.path.realpath(folder / location)
    return os.path.commonpath([real, os.path.realpath(folder)]) != os.path.realpath(folder)


@st.composite
def hostile(draw):
    where = draw(st.sampled_from(["initializer", "constant", "body"]))
    location = draw(LOCATIONS)
    fields = {"offset": draw(NUMBERS), "length": draw(NUMBERS)}
    dims = draw(st.sampled_from([None, [64, 64], [64, -64], [4096], [63, 64], [2**31, 2**31]]))
    order = draw(st.sampled_from(["as is", "reversed", "cycle", "written twice"]))
    nesting = draw(st.sampled_from([0, 0, 3, 60]))
    return where, location, fields, dims, order, nesting


def _write(folder: Path, case) -> Path:
    where, location, fields, dims, order, nesting = case
    model = matmul_64(where)
    (tensor,) = weights_named_w(model)
    (folder / "w.data").write_bytes(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    location = location.format(secret=folder.parent / "elsewhere" / "secret")
    entries = {"location": location, **{k: v for k, v in fields.items() if v is not None}}
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)
    if dims is not None:
        del tensor.dims[:]
        tensor.dims.extend(dims)
    graph = model.graph
    if order == "reversed":
        graph.node.reverse()
    elif order == "cycle":
        graph.node.append(helper.make_node("Relu", ["y"], ["x2"], name="back"))
        next(n for n in graph.node if n.input).input[0] = "x2"
    elif order == "written twice":
        graph.node.append(helper.make_node("Neg", ["x"], [graph.output[0].name], name="again"))
    for level in range(nesting):
        branch = graph.node.add(op_type="If", input=["c"], output=[f"n{level}"], name=f"nest{level}")
        inner = branch.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH).g
        inner.name = f"nested{level}"
        inner.node.add(op_type="Identity", input=["x"], output=[f"i{level}"])
        inner.output.add().CopyFrom(helper.make_tensor_value_info(f"i{level}", TensorProto.FLOAT, [2, 64]))
        branch.attribute.add(name="else_branch", type=onnx.AttributeProto.GRAPH).g.CopyFrom(inner)
        graph = inner
    if nesting:
        model.graph.input.append(helper.make_tensor_value_info("c", TensorProto.BOOL, []))
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _check_valid(converted: onnx.ModelProto) -> None:
    onnx.checker.check_model(converted, full_check=True)
    session = ort.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.ones((2, 64), np.float32)}
    if any(i.name == "cond" for i in session.get_inputs()):
        feeds["cond"] = np.array(True)
    if any(i.name == "c" for i in session.get_inputs()):
        feeds["c"] = np.array(False)
    session.run(None, feeds)
    assert converted.ir_version <= onnxruntime_facts.max_ir_version()


@SETTINGS
@given(case=hostile())
def test_hostile_files_convert_validly_or_raise_amppass_errors(case):
    with tempfile.TemporaryDirectory() as root:
        folder = _hostile_folder(Path(root))
        path = _write(folder, case)
        location = case[1].format(secret=folder.parent / "elsewhere" / "secret")
        try:
            converted = amppass.convert_onnx(str(path))
        except AmpPassError:
            return
        assert not _outside(folder, location), f"converted with data at {location!r}, outside the folder"
        _check_valid(converted)


FIELDS = ["dtype", "casts", "weight_bytes_before", "weight_bytes_after", "tolerance", "achieved_error",
          "moved_by_tolerance", "calibrated", "front_end", "mode", "target", "profitability", "parts", "backward",
          "whole_model", "fixed_dims", "held_out_error", "tolerance_met"]
# texts that cost gigabytes if a view used them as format strings
FORMATS = st.sampled_from(["{dtype:>99999999}", "{0:>99999999}", "%s%s%n", "{dtype.__class__.__mro__}", "{}"])
TEXTS = st.one_of(st.text(max_size=5), FORMATS, st.sampled_from(["measured", "prior", "device", "fp32"]))
LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(allow_nan=True), TEXTS)
# the fields inside the summary's objects (profitability, parts, backward, whole_model, target)
INNER = ["nodes_fp32", "regions_fp32", "timing", "device", "native_low", "why", "converted", "eager", "why_whole",
         "macs_total", "macs_low", "saved_bytes", "saved_bytes_by_dtype", "skipped", "converted_ms", "original_ms",
         "name", "runtime", "error_judged_by"]
NESTED = st.dictionaries(st.sampled_from(INNER), st.one_of(LEAVES, st.lists(LEAVES, max_size=3),
                                                           st.dictionaries(TEXTS, LEAVES, max_size=3)), max_size=4)
VALUES = st.one_of(LEAVES, st.lists(st.one_of(st.integers(), TEXTS), max_size=3),
                   st.dictionaries(TEXTS, st.integers(), max_size=2), NESTED)
NODE_FIELDS = ["precision", "op", "reason", "source", "casts_in", "evidence"]


@SETTINGS
@given(model_edits=st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3),
       node_edits=st.dictionaries(st.sampled_from(NODE_FIELDS), VALUES, max_size=2),
       evidence=st.dictionaries(st.sampled_from(["macs", "absmax", "min_nonzero", "local_error"]), VALUES,
                                max_size=3))
def test_forged_metadata_reports_or_raises_amppass_errors(model_edits, node_edits, evidence):
    model = amppass.convert_onnx(matmul_64())
    entry = next(p for p in model.metadata_props if p.key == "amppass")
    info = json.loads(entry.value)
    info.update(model_edits)
    entry.value = json.dumps(info)
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    stored = next(p for p in node.metadata_props if p.key == "amppass")
    decision = json.loads(stored.value)
    decision.update(node_edits)
    if isinstance(decision.get("evidence"), dict):
        decision["evidence"].update(evidence)
    stored.value = json.dumps(decision)
    try:
        report = amppass.report(model)
    except AmpPassError:
        return
    # nothing the file holds is a format string or sizes anything: the views stay about as small as the file
    assert len(render_text(report, width=80)) < 1 << 20
    assert len(report.to_json()) < 1 << 20
    assert len(report.to_html()) < 1 << 20


def _feeds_file(path: Path, compressed: bool, descr: str, shape: tuple, declared: int | None) -> None:
    """A .npz of one array "x" whose header says ``descr`` and ``shape``, holding the bytes of 2 x 64 float32
    zeros; its zip directory says the entry inflates to ``declared`` bytes when given."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": descr, "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED) as archive:
        archive.writestr("x.npy", header.getvalue() + bytes(2 * 64 * 4))
    if declared is not None:  # the central directory's uncompressed size field
        data = bytearray(path.read_bytes())
        central = data.rindex(b"PK\x01\x02")
        data[central + 24:central + 28] = (declared % 2**32).to_bytes(4, "little")
        path.write_bytes(bytes(data))


@SETTINGS
@given(compressed=st.booleans(), descr=st.sampled_from(["<f4", "<f8", "<i8", "|O", "|V8", "<U4"]),
       shape=st.one_of(st.just((2, 64)), st.lists(st.integers(0, 2**40), max_size=3).map(tuple)),
       declared=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_hostile_calibration_files_feed_or_are_refused(compressed, descr, shape, declared):
    """``amppass convert --calib``: a .npz whose header, dtype or directory lies converts or is refused in one line
    (exit 1 or 2), never an unexpected error, whatever it declares."""
    with tempfile.TemporaryDirectory() as root:
        folder = Path(root)
        onnx.save(matmul_64(), folder / "m.onnx")
        _feeds_file(folder / "feeds.npz", compressed, descr, shape, declared)
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            code = main(["convert", str(folder / "m.onnx"), "-o", str(folder / "out.onnx"), "--calib",
                         str(folder / "feeds.npz")])
        assert code in (0, 1), said.getvalue()
        assert "unexpected" not in said.getvalue() and said.getvalue().count("\n") <= 1, said.getvalue()
        assert (code == 0) == (folder / "out.onnx").exists()
