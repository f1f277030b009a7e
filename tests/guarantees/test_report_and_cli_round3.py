"""What a converted model carries besides its program, read as untrusted data: the names and decisions stored on
its nodes and its summary (a .pt2 or an ONNX model), and the files the CLI reads and writes.

Every value must come through a reader that checks its type and bounds it, and every failure must be an
:class:`~amppass.InputError` naming the node or field; no stored text is ever a format string.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import subprocess
import sys
import zipfile

import numpy as np
import onnx
import pytest
import torch

import amppass
from amppass import InputError
from amppass.cli import main
from tests.helpers.paths import ROOT
from tests.helpers.pt2_files import (
    X,
    edit_program,
    mlp,
    rewrite,
    stored_name,
    stored_names,  # saved is a fixture
)
from tests.helpers.small_models import matmul_model


@pytest.mark.parametrize("value", [7, None, ["linear"], "", "x = 1", "class", "n" * 513],
                         ids=["int", "null", "list", "empty", "code", "keyword", "long"])
def test_a_stored_node_name_that_is_not_an_identifier_is_refused(saved, tmp_path, value, capsys):
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", edit_program(stored_name(value)))
    with pytest.raises(InputError) as caught:
        amppass.load(evil)
    said = str(caught.value)
    assert (
        "evil.pt2" in said and "amppass_name" in said and "Python identifier" in said and "convert the original" in said
    )
    assert main(["report", str(evil)]) == 1
    assert "amppass: error:" in capsys.readouterr().err


def test_two_nodes_with_one_stored_name_are_refused(saved, tmp_path):
    import zipfile

    with zipfile.ZipFile(saved["converted"]) as archive:
        entries = {i.filename.partition("/")[2]: archive.read(i) for i in archive.infolist()}
    first = stored_names(entries)[0]
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", edit_program(stored_name(first, node=1)))
    with pytest.raises(InputError, match=f"is '{first}', which another node of the file also names itself"):
        amppass.load(evil)


def test_honest_stored_names_come_back(saved):
    loaded = amppass.load(saved["converted"])
    names = [row.name for row in amppass.report(loaded).rows]
    assert names == [row.name for row in amppass.report(amppass.convert(mlp(), X, "bf16", plan_for="coverage")).rows]
    assert torch.isfinite(loaded(*X)).all()


# --- the summary and decisions an ONNX model stores: every field checked, no text a format string -------------

@pytest.fixture(scope="module")
def converted_onnx():
    """A small ONNX model as amppass.convert_onnx returns it."""
    return amppass.convert_onnx(matmul_model())


def forged(model: onnx.ModelProto, info: dict | None = None, decision: dict | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose stored summary is updated with ``info`` and whose first planned node's decision
    with ``decision``."""
    model = copy.deepcopy(model)
    entry = next(p for p in model.metadata_props if p.key == "amppass")
    entry.value = json.dumps({**json.loads(entry.value), **(info or {})})
    for node in model.graph.node:
        stored = next((p for p in node.metadata_props if p.key == "amppass"), None)
        if stored is not None and "precision" in json.loads(stored.value):
            stored.value = json.dumps({**json.loads(stored.value), **(decision or {})})
            break
    return model


def _speed(timing) -> dict:
    return {"profitability": {"nodes_fp32": 1, "regions_fp32": 1, "timing": timing}}


FORGED_INFO = {  # a field, what a forger writes there, the words the error must hold
    "dtype": ({"dtype": "fp8"}, ("'dtype'", "not one of fp16, bf16")),
    "casts": ({"casts": -1}, ("'casts'", "outside")),
    "casts-huge": ({"casts": 10 ** 300}, ("'casts'", "outside")),
    "moved": ({"moved_by_tolerance": 1.5}, ("'moved_by_tolerance'",)),
    "timing-count": (_speed({"measured": "many"}), ('profitability.timing["measured"]', "not an integer")),
    "timing-count-huge": (_speed({"measured": 10 ** 18}), ('profitability.timing["measured"]', "outside")),
    "timing-key-long": (_speed({"m" * 600: 1}), ("profitability.timing[", "more than 512")),
    "nodes-fp32": ({"profitability": {"nodes_fp32": "{0:>99999999}"}}, ("profitability.nodes_fp32",)),
    "parts": ({"parts": {"converted": "abc"}}, ("parts.converted", "not a list")),
    "parts-eager": ({"parts": {"converted": ["a"], "eager": ["b"]}}, ("parts.eager", "not an object")),
    "whole-model": ({"whole_model": {"converted_ms": "1", "original_ms": 1}}, ("whole_model.converted_ms",)),
    "backward": ({"backward": {"saved_bytes": 1, "saved_bytes_by_dtype": {"fp32": [1]}}},
                 ('backward.saved_bytes_by_dtype["fp32"]',)),
    "target": ({"target": {"name": 3}}, ("target.name", "not text")),
    "fixed-dims": ({"fixed_dims": "batch"}, ("fixed_dims", "not a list")),
    "reason-long": ({"held_out": "x" * 5000}, ("'held_out'", "5,000 characters long")),
    "tolerance": ({"tolerance": float("inf")}, ("'tolerance'", "not a finite number")),
}


@pytest.mark.parametrize("case", FORGED_INFO)
def test_every_summary_field_is_checked(converted_onnx, case):
    info, words = FORGED_INFO[case]
    with pytest.raises(InputError) as caught:
        amppass.report(forged(converted_onnx, info=info))
    said = str(caught.value)
    assert all(w in said for w in words), said
    assert "metadata" in said and "convert the original model again" in said and len(said) < 600


FORGED_DECISION = {
    "precision": ({"precision": 3}, ("'precision'", "not text")),
    "reason": ({"reason": "r" * 5000}, ("'reason'", "more than 4,096")),
    "casts-in": ({"casts_in": [1]}, ("casts_in[0]", "not text")),
    "evidence": ({"evidence": []}, ("'evidence'", "not an object")),
    "macs": ({"evidence": {"macs": -5}}, ("evidence.macs", "outside")),
    "macs-text": ({"evidence": {"macs": "1e300"}}, ("evidence.macs", "not a number")),
    "absmax": ({"evidence": {"absmax": "big"}}, ("evidence.absmax", "not a number")),
    "rule": ({"rule": ["r"]}, ("'rule'", "not text")),
}


@pytest.mark.parametrize("case", FORGED_DECISION)
def test_every_decision_field_is_checked(converted_onnx, case):
    decision, words = FORGED_DECISION[case]
    with pytest.raises(InputError) as caught:
        amppass.report(forged(converted_onnx, decision=decision))
    said = str(caught.value)
    assert all(w in said for w in words) and "its amppass decision" in said and "node " in said, said


def test_a_timing_kind_is_never_a_format_string(converted_onnx):
    """A kind of timing the file names is its own text: '{dtype:>300000000}' is shown as written (it was 300 MB of
    spaces per key, gigabytes for a few keys, and a gigabyte HTML page)."""
    kinds = {"{dtype:>300000000}": 1, "{dtype.__class__}": 2, "{0}": 3, "measured": 1}
    report = amppass.report(forged(converted_onnx, info=_speed(kinds)))
    summary = report.summary()
    assert "1 group {dtype:>300000000}; 2 groups {dtype.__class__}; 3 groups {0}; 1 group timed on this machine" \
        in summary
    assert len(summary) < 5000 and len(report.to_html()) < 100_000


def test_the_summary_reads_a_partial_record_without_a_raw_error(converted_onnx):
    """Fields an older amppass did not write (the low-precision MACs of a model converted by parts) are left out
    of the summary, not a TypeError."""
    report = amppass.report(forged(converted_onnx, info={"parts": {"converted": ["a"], "macs_total": 10}}))
    assert "converted by parts" in report.summary() and "heavy compute of the whole model" not in report.summary()
    assert "converted by parts" in report.to_html()


def _cost(argv: list[str], cwd) -> tuple[float, float, int]:
    """Peak memory (MiB) and CPU seconds of ``amppass ARGV`` in a fresh process, and its exit status."""
    code = ("import resource, sys\nfrom amppass.cli import main\nrc = main(sys.argv[1:])\n"
            "r = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print('COST', r.ru_maxrss / 1024, r.ru_utime + r.ru_stime, rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    line = next(text for text in done.stdout.splitlines() if text.startswith("COST"))
    _, peak, cpu, rc = line.split()
    return float(peak), float(cpu), int(rc)


def test_a_hostile_summary_costs_what_an_honest_one_does(converted_onnx, tmp_path):
    """The budget for a hostile file under 1 MB: at most 500 MB and 10 s of CPU above an honest file's report."""
    kinds = {"{dtype:>%d}" % (400_000_000 + i): 1 for i in range(10)}
    onnx.save(forged(converted_onnx, info=_speed(kinds)), tmp_path / "evil.onnx")
    onnx.save(converted_onnx, tmp_path / "honest.onnx")
    assert (tmp_path / "evil.onnx").stat().st_size < 1 << 20
    honest = _cost(["report", "honest.onnx", "--report", "honest.html"], tmp_path)
    evil = _cost(["report", "evil.onnx", "--report", "evil.html"], tmp_path)
    assert honest[2] == evil[2] == 0
    assert evil[0] < honest[0] + 500 and evil[1] < honest[1] + 10, (honest, evil)
    assert (tmp_path / "evil.html").stat().st_size < 200_000


def _zeros_npz(path, name: str, shape: tuple[int, ...]) -> None:
    """A compressed .npz of one float32 array of zeros, written a megabyte at a time (zeros deflate a
    thousandfold, so the file is small whatever ``shape`` says)."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive, \
            archive.open(f"{name}.npy", "w", force_zip64=True) as out:
        out.write(header.getvalue())
        chunk, left = memoryview(bytes(1 << 20)), math.prod(shape) * 4
        while left:
            out.write(chunk[:min(left, len(chunk))])
            left -= min(left, len(chunk))


def test_a_calibration_bomb_costs_what_honest_feeds_do(tmp_path):
    """``amppass convert --calib`` of a file under 1 MB whose array inflates to 896 MiB (2.1 GB peak before):
    refused from its zip directory, within the budget of an honest calibrated conversion."""
    onnx.save(matmul_model(), tmp_path / "m.onnx")
    _zeros_npz(tmp_path / "evil.npz", "x", (896 * (1 << 20) // (2 * 8 * 4), 2, 8))  # that many batches of x[2, 8]
    np.savez(tmp_path / "honest.npz", x=np.ones((3, 2, 8), np.float32))
    assert (tmp_path / "evil.npz").stat().st_size < 1 << 20
    honest = _cost(["convert", "m.onnx", "-o", "honest.onnx", "--calib", "honest.npz"], tmp_path)
    evil = _cost(["convert", "m.onnx", "-o", "evil.onnx", "--calib", "evil.npz"], tmp_path)
    assert honest[2] == 0 and evil[2] == 1 and not (tmp_path / "evil.onnx").exists()
    assert evil[0] < honest[0] + 500 and evil[1] < honest[1] + 10, (honest, evil)
