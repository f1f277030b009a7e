"""Property: a hostile model file gives a valid converted model or an AmpPassError, nothing else.

Hypothesis builds small models (a weight as an initializer, a Constant node or an If-branch initializer,
kept in an external data file) and damages them the ways an attacker or a broken exporter would: external
data locations (absolute, climbing out, links pointing out or in, folders, devices, the store's reserved
name), offsets and lengths (negative, huge, not numbers, past the end), shapes (negative, disagreeing with
the bytes), nesting depth, node order (shuffled, cycles, a value written twice) and the report metadata of
converted models. Whatever comes out: ``convert_onnx`` returns a model that passes the full checker and runs
in onnxruntime, or raises :class:`amppass.AmpPassError`; a weight whose data resolves outside the model's
folder never converts; ``amppass.report`` returns a report that renders, or raises AmpPassError.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import amppass
from amppass import AmpPassError
from amppass.targets import onnxruntime_facts
from amppass.report.terminal import render_text
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
          "moved_by_tolerance", "calibrated", "front_end"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**80, 2**80), st.floats(allow_nan=True),
                   st.text(max_size=5), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                             st.integers(), max_size=2))
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
    render_text(report, width=80)
    report.to_json()
    report.to_html()
