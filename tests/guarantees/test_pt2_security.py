"""A .pt2 file is untrusted input: nothing in it runs, no entry inflates unbounded, errors are one line.

Each archive here is one amppass.save (or torch.export.save) wrote, edited the way an attacker would: a
pickle whose ``__reduce__`` writes a marker file (and then hands back the real tensor, so the model would load
and run as if nothing happened), a symbolic size that is Python code, compiled code, a damaged plan entry.
Every way in (amppass.load, amppass.load_program, ``amppass report`` and ``amppass convert``) is tried, and
the marker must never appear.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tracemalloc

import pytest
import torch

import amppass
from amppass import InputError, archive
from amppass.archive import MAX_EXTRA, check_expression
from amppass.cli import main
from tests.helpers.paths import ROOT
from tests.helpers.pt2_files import (
    X,
    aoti,
    constant,
    legacy_weights,
    pickled_weight,
    rewrite,
    sample_inputs,
    sympy_code,
)

ATTACKS = {
    "pickled weight": (pickled_weight, "data/weights/model_weights_config.json"),
    "pickled tensor constant": (lambda m: constant(m, "tensor_9"), "data/constants/model_constants_config.json"),
    "opaque object": (lambda m: constant(m, "opaque_obj_0", use_pickle=False), "opaque_obj_0"),
    "torchbind object": (lambda m: constant(m, "custom_obj_0", use_pickle=False), "custom_obj_0"),
    "sample inputs": (sample_inputs, "data/sample_inputs/model.pt"),
    "legacy weights file": (legacy_weights, "data/weights/model.pt"),
    "symbolic size": (sympy_code, "models/model.json"),
    "AOTInductor library": (aoti, "data/aotinductor/model/model.so"),
}


@pytest.mark.parametrize("attack", ATTACKS)
def test_no_code_from_the_file_runs_on_any_way_in(saved, tmp_path, attack, capsys):
    make, entry = ATTACKS[attack]
    marker = tmp_path / "marker"
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", make(marker))
    with pytest.raises(InputError) as caught:
        amppass.load(evil)
    assert entry in str(caught.value) and "trusted=True" in str(caught.value) and "--trust-pickle" in str(caught.value)
    with pytest.raises(InputError):
        amppass.load_program(evil)
    assert main(["report", str(evil)]) == 1
    assert main(["convert", str(evil), "-o", str(tmp_path / "out.pt2")]) == 1
    err = capsys.readouterr().err
    assert err.count("amppass: error:") == 2 and entry in err
    assert not marker.exists(), f"{attack}: code from the file ran"
    assert not (tmp_path / "out.pt2").exists()


def test_an_unconverted_program_with_a_pickle_is_refused_too(saved, tmp_path):
    marker = tmp_path / "marker"
    evil = rewrite(saved["plain"], tmp_path / "evil.pt2", pickled_weight(marker))
    with pytest.raises(InputError, match="model_weights_config.json.*trusted=True"):
        amppass.load_program(evil)
    assert main(["convert", str(evil), "-o", str(tmp_path / "out.pt2")]) == 1
    assert not marker.exists()


def test_trusted_files_load_as_torch_reads_them(saved, tmp_path):
    """The user's explicit word lets torch read the pickle (the payload is real: the marker appears), and the
    archives amppass and torch write themselves load without it."""
    marker = tmp_path / "marker"
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", pickled_weight(marker))
    assert isinstance(amppass.load(evil, trusted=True), torch.nn.Module) and marker.exists()
    marker.unlink()
    assert main(["report", str(evil), "--trust-pickle"]) == 0 and marker.exists()
    with torch.no_grad():
        assert torch.equal(amppass.load(saved["converted"])(X[0]), amppass.load(saved["converted"])(X[0]))
    assert isinstance(amppass.load_program(saved["plain"]), torch.export.ExportedProgram)


def test_torch_export_load_itself_is_not_protected(saved, tmp_path):
    """What the README says: amppass.convert(torch.export.load(path)) hands the file to torch before amppass
    sees it. This pins that the attack is real, so the README's advice (amppass.load_program) matters."""
    marker = tmp_path / "marker"
    evil = rewrite(saved["plain"], tmp_path / "evil.pt2", pickled_weight(marker))
    torch.export.load(evil)
    assert marker.exists()


@pytest.mark.parametrize("plan, words", [
    (b"[" * 100_000 + b"]" * 100_000, ("extra/amppass.json", "not UTF-8 JSON", "RecursionError")),
    (b"\xff\xfe not text", ("extra/amppass.json", "not UTF-8 JSON")),
    (b"[1, 2]", ("extra/amppass.json", "not the object amppass.save writes")),
    (b'{"dtype": "bf16", "pytree_types": 5}', ("extra/amppass.json", "list of type names")),
    (b'{"a": ' * 70 + b"1" + b"}" * 70, ("extra/amppass.json", "nests deeper than 64")),
], ids=["deep", "not-utf8", "a-list", "wrong-types", "nested-70"])
def test_a_damaged_plan_entry_is_an_input_error_naming_it(saved, tmp_path, plan, words):
    def edit(entries):
        entries["extra/amppass.json"] = plan

    damaged = rewrite(saved["converted"], tmp_path / "damaged.pt2", edit)
    with pytest.raises(InputError) as caught:
        amppass.load(damaged)
    for word in words:
        assert word in str(caught.value)


def test_a_decision_that_is_not_json_names_its_node(saved, tmp_path):
    def edit(entries):
        text = entries["models/model.json"].decode()
        entries["models/model.json"] = text.replace('{\\"amppass\\": \\"{', '{\\"amppass\\": \\"[[[{', 1).encode()

    damaged = rewrite(saved["converted"], tmp_path / "damaged.pt2", edit)
    with pytest.raises(InputError, match="node '.*': its amppass decision is not UTF-8 JSON"):
        amppass.load(damaged)


def test_an_entry_that_inflates_past_its_bound_is_refused_before_it_is_read(saved, tmp_path):
    """A plan entry of 24 MB of spaces deflates to ~24 KB: refused from its header, memory stays small."""
    def edit(entries):
        entries["extra/amppass.json"] = b"{" + b" " * (MAX_EXTRA + (8 << 20)) + b"}"

    bomb = rewrite(saved["converted"], tmp_path / "bomb.pt2", edit, compress=("extra/amppass.json",))
    assert bomb.stat().st_size < 1 << 20
    tracemalloc.start()
    try:
        with pytest.raises(InputError, match="extra/amppass.json.*would inflate to 25,165,826 bytes"):
            amppass.load(bomb)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak:,} bytes allocated to refuse it"


def test_many_inflating_entries_are_bounded_together(saved, tmp_path, monkeypatch):
    """Each extra file under its own bound, but torch holds every one at once: their sum is bounded too."""
    monkeypatch.setattr(archive.layout, "MAX_DEFLATED", 1 << 20)
    extras = {f"extra/x{i}.txt": b" " * (600 << 10) for i in range(3)}
    many = rewrite(saved["converted"], tmp_path / "many.pt2", lambda e: e.update(extras), compress=tuple(extras))
    with pytest.raises(InputError, match="extra/x1.txt' brings its compressed entries past 1,048,576 bytes"):
        amppass.load(many)


@pytest.mark.parametrize("edit, words", [
    (lambda e: e.update({"data/weights/WEIGHT_0": e["data/weights/weight_0"]}), ("twice", "ignoring case")),
    (lambda e: e.update({"../escape": b"x"}), ("../escape",)),
    (lambda e: e.update({"data/executorch/model.pte": b"x"}), ("data/executorch/model.pte", "vouch")),
    (lambda e: e.update({"models/second.json": e["models/model.json"]}), ("models/second.json",)),
], ids=["case-twin", "climbing", "executorch", "second-program"])
def test_entries_torch_save_does_not_write_are_refused(saved, tmp_path, edit, words):
    odd = rewrite(saved["converted"], tmp_path / "odd.pt2", edit)
    with pytest.raises(InputError) as caught:
        amppass.load(odd)
    for word in words:
        assert word in str(caught.value)


def test_the_cli_prints_one_line_and_the_traceback_only_under_AMPPASS_DEBUG(saved, tmp_path):
    """A program torch cannot deserialize (a node reads a value no node makes): torch logs a long traceback
    before giving up; the CLI says one line."""
    def edit(entries):
        entries["models/model.json"] = entries["models/model.json"].replace(
            b'"torch.ops.aten.relu.default", "inputs": [{"name": "self", "arg": {"as_tensor": {"name": "linear"',
            b'"torch.ops.aten.relu.default", "inputs": [{"name": "self", "arg": {"as_tensor": {"name": "no_such_op"', 1)

    broken = rewrite(saved["converted"], tmp_path / "broken.pt2", edit)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-m", "amppass", "report", str(broken)]
    plain = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert plain.returncode == 1
    assert plain.stderr.strip().count("\n") == 0, plain.stderr[-3000:]
    assert "no_such_op" in plain.stderr and "broken.pt2" in plain.stderr and "Traceback" not in plain.stderr
    debug = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**env, "AMPPASS_DEBUG": "1"},
                           cwd=ROOT)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "SerializeError" in debug.stderr


def test_a_fifo_given_as_the_model_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "model.pt2"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        amppass.load(fifo)


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "().__class__.__base__.__subclasses__()", "sympify('1')",
    "open('x', 'w').write('y')", "Pow(Integer(9), Integer(99999))", "9**9**9", "Symbol('a; b')", "[s0][0]",
    "lambda: s0", "Max(s0, key=len)", "s0 if s0 else s1", "x" * 5000,
])
def test_symbolic_sizes_that_are_not_arithmetic_are_refused(text):
    with pytest.raises(InputError, match="sympy.sympify"):
        check_expression(text, "m.pt2")


@pytest.mark.parametrize("text", [
    "Symbol('s31', positive=True, integer=True)", "Mul(Integer(2), Symbol('s0', integer=True, positive=True))",
    "Pow(Symbol('s0', integer=True), Integer(2))", "FloorDiv(s0, 2) + Mod(s1, 8) - 1",
    "Float('1.5', precision=53)", "-oo", "Eq(s0, 1) & Ne(s1, 0)",
])
def test_the_expressions_torch_writes_pass(text):
    check_expression(text, "m.pt2")
