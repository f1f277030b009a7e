"""amppass.save / amppass.load: a converted torch model shipped as a torch.export program."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import amppass
from amppass.cli import main
from amppass.pipelines import serialize
from models import build
from tests.helpers.paths import ROOT
from tests.helpers.shape_models import Recurrent


def floats(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rows(model) -> list[tuple[str, str, str, str]]:
    """Every decision on floating-point work (the re-export recomputes sizes, so shape nodes may differ)."""
    return sorted((r.name, r.op, r.precision, r.source) for r in amppass.report(model).rows if r.precision != "-")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    case = build("bert", batch=2, seq=16)
    fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")
    path = tmp_path_factory.mktemp("saved") / "bert.bf16.pt2"
    amppass.save(fast, path)
    return case, fast, str(path)


def test_round_trip_is_bit_identical_at_every_shape_and_keeps_the_report(bert):
    case, fast, path = bert
    loaded = amppass.load(path)
    for batch, seq in ((2, 16), (1, 16), (5, 9)):
        ids = torch.randint(1, 1000, (batch, seq), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            ours, theirs = fast(ids), loaded(ids)
        assert type(theirs) is type(ours)
        assert torch.equal(ours.last_hidden_state, theirs.last_hidden_state)
        assert torch.equal(ours.pooler_output, theirs.pooler_output)
    assert rows(loaded) == rows(fast)
    info = amppass.report(loaded).info
    assert info["dtype"] == "bf16" and info["weight_bytes_after"] == amppass.report(fast).info["weight_bytes_after"]
    assert {p.dtype for p in loaded.parameters()} == {p.dtype for p in fast.parameters()}
    names = {n.name for n in loaded.graph.nodes}
    for row in amppass.report(loaded).rows:
        assert set(row.casts) <= names, f"{row.name} names casts the loaded graph does not have"


def test_a_fresh_process_loads_it_with_amppass_and_with_plain_torch(bert):
    case, fast, path = bert
    ids = case.example_inputs[0]
    with torch.no_grad():
        expected = fast(ids).last_hidden_state
    torch.save(ids, path + ".ids")
    script = (
        "import sys, torch, amppass\n"
        "ids = torch.load(sys.argv[2])\n"
        "loaded = amppass.load(sys.argv[1])\n"
        "print(amppass.report(loaded).info['dtype'])\n"
        "import transformers.modeling_outputs\n"  # plain torch.export.load needs the output type registered
        "plain = torch.export.load(sys.argv[1]).module()\n"
        "with torch.no_grad():\n"
        "    a, b = loaded(ids).last_hidden_state, plain(ids).last_hidden_state\n"
        "torch.save((a, b), sys.argv[2] + '.out')\n"
    )
    done = subprocess.run([sys.executable, "-c", script, path, path + ".ids"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "bf16"
    a, b = torch.load(path + ".ids.out")
    assert torch.equal(a, expected) and torch.equal(b, expected)


def test_loaded_model_keeps_the_guards_and_names_the_dim_it_cannot_take(tmp_path):
    torch.manual_seed(0)
    model = Recurrent(torch.nn.LSTM).eval()
    fast = amppass.convert(model, (floats(3, 8, 16),), torch.bfloat16, plan_for="coverage")
    path = tmp_path / "lstm.pt2"
    amppass.save(fast, path)
    loaded = amppass.load(path)
    names = [row.name for row in amppass.report(loaded).rows]  # the LSTM's outputs carry no copy of its name
    assert names.count("lstm") == 1 and len(names) == len(set(names))
    with torch.no_grad():
        for x in (floats(3, 8, 16, seed=2), floats(7, 8, 16, seed=3)):
            assert torch.equal(loaded(x), fast(x))
    with pytest.raises(amppass.InputError, match=r"input x dim 1 is 5, the plan takes 8 only.*x: \[s\d+, 8, 16\]"):
        loaded(floats(3, 5, 16))
    with pytest.raises(amppass.InputError, match=r"input x dim 0 is 1"):
        loaded(floats(1, 8, 16))


def test_convert_takes_an_exported_program_and_the_cli_converts_pt2_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich prints op names unfolded
    case = build("mlp")
    program = torch.export.export(case.model, case.example_inputs)
    fast = amppass.convert(program, dtype="bf16", plan_for="coverage")
    x = floats(2, 64)
    with pytest.raises(amppass.InputError, match="input x dim 0 is 5, the plan takes 2 only.*dynamic_shapes"):
        fast(floats(5, 64))
    with torch.no_grad():
        assert float((fast(x) - case.model(x)).norm() / case.model(x).norm()) < 2e-2
    source, target, report = tmp_path / "mlp.pt2", tmp_path / "mlp.bf16.pt2", tmp_path / "r.json"
    torch.export.save(program, source)
    assert main(["convert", str(source), "-o", str(target), "--dtype", "bf16", "--report", str(report)]) == 0
    assert f"wrote {target}" in capsys.readouterr().out
    loaded = amppass.load(target)
    with torch.no_grad():
        assert torch.equal(loaded(x), fast(x))
    data = json.loads(report.read_text())
    assert data["info"]["dtype"] == "bf16" and any(r["precision"] == "bf16" for r in data["rows"])
    assert main(["report", str(target)]) == 0 and "aten.linear" in capsys.readouterr().out
    assert main(["convert", str(source), "-o", str(tmp_path / "x.onnx")]) == 2
    assert "name it .pt2" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "none.pt2"), "-o", str(tmp_path / "y.pt2")]) == 1
    assert "none.pt2: no such file" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["mlp.bf16.pt2", "mlp.pt2", "r.json"]


_OUTPUT_CLASS = """
from dataclasses import dataclass

import torch


@dataclass
class Out:
    y: torch.Tensor


torch.export.register_dataclass(Out, serialized_type_name="outtypes.Out")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return Out(self.fc(x))
"""


def test_the_cli_names_the_module_to_import_for_a_program_whose_outputs_hold_a_class(tmp_path):
    """A program saved with torch.export.save whose outputs hold a registered class (a transformers ModelOutput)
    loads only where that class's module is imported; the command line imports none and says what to do."""
    (tmp_path / "outtypes.py").write_text(_OUTPUT_CLASS)
    save = ("import sys, torch; sys.path.insert(0, sys.argv[1]); import outtypes; "
            "torch.export.save(torch.export.export(outtypes.Net(), (torch.randn(2, 4),)), sys.argv[2])")
    source = tmp_path / "net.pt2"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    subprocess.run([sys.executable, "-c", save, str(tmp_path), str(source)], check=True, env=env, timeout=300)
    done = subprocess.run([sys.executable, "-m", "amppass", "convert", str(source), "-o", str(tmp_path / "o.pt2")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"amppass: error: {source}: the program's inputs or outputs hold the class outtypes.Out, which "
        "torch.export.load rebuilds only once its module is imported, and the command line imports no module a file "
        f"names; convert it in Python: import outtypes, then amppass.convert(amppass.load_program({str(source)!r}), "
        "dtype=...)"]
    assert not (tmp_path / "o.pt2").exists()


def test_what_cannot_be_saved_says_why_and_leaves_no_file(tmp_path, monkeypatch):
    case = build("mlp")
    train = amppass.convert(case.model, case.example_inputs, torch.bfloat16, mode="train", plan_for="coverage")
    with pytest.raises(amppass.InputError, match="state_dict"):
        amppass.save(train, tmp_path / "t.pt2")
    traced = amppass.convert(case.model, dtype=torch.bfloat16, plan_for="coverage")
    with pytest.raises(amppass.InputError, match="example_inputs"):
        amppass.save(traced, tmp_path / "s.pt2")
    fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")

    def broken(program, out, **kwargs):
        out.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch.export, "save", broken)
    with pytest.raises(OSError, match="disk full"):
        amppass.save(fast, tmp_path / "m.pt2")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    (tmp_path / "plain.pt2").write_bytes(b"not a zip")
    with pytest.raises(amppass.InputError, match="not a torch.export program"):
        amppass.load(tmp_path / "plain.pt2")
    torch.export.save(torch.export.export(case.model, case.example_inputs), tmp_path / "fp32.pt2")
    with pytest.raises(amppass.InputError, match="did not convert"):
        amppass.load(tmp_path / "fp32.pt2")
    assert serialize.PLAN_FILE == "amppass.json"
