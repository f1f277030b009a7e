"""A .pt2 program's own text never makes amppass run code, hang a call or cost gigabytes.

Each archive here is one amppass.save wrote, with ``models/model.json`` (or the plan entry) edited as an
attacker would: a higher-order op handed a Python function by name (``torch.os.system``, which torch's
deserializer resolves by ``getattr`` and the graph then calls), guards whose arithmetic costs minutes or
gigabytes or raises something other than an assertion, symbolic sizes that sympy flattens into a ``Max`` of
hundreds of values or whose number text is a huge exponent, and an output spec naming an importable class that
is not a container. Every way in refuses them before torch reads the file, and the budget holds: no such file
costs 10 s of CPU or 500 MB above an honest load.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils import _pytree as pytree

import amppass
from amppass import InputError
from amppass.cli import main
from tests.helpers.paths import ROOT
from tests.helpers.pt2_files import X, calling_node, edit_program, rewrite

OPERATOR_ATTACKS = {
    "wrap given os.system": ("torch.ops.higher_order.wrap", "torch.os.system", "higher-order op that amppass"),
    "cond given os.system": ("torch.ops.higher_order.cond", "torch.os.system", "'torch.os.system' is not an operator"),
    "a target that is os.system": ("torch.os.system", "torch.ops.aten.relu.default", "'torch.os.system' is not"),
    "an op that reads a file": ("torch.ops.higher_order.cond", "torch.ops.aten.from_file.default", "reads or writes a"),
    "an attribute of an op": ("torch.ops.higher_order.cond", "torch.ops.aten.__class__.__init__", "not an operator ov"),
    "an extension op": ("#custom:op", "torch.ops.aten.relu.default", "is not an operator of torch.ops"),
}


def _expression(text: str):
    """The archive's first symbolic size replaced by ``text``."""
    def edit(entries):
        model = entries["models/model.json"].decode()
        start = model.index('"expr_str": "') + 12
        end = model.index('"', start + 1)
        entries["models/model.json"] = (model[:start] + json.dumps(text) + model[end + 1:]).encode()
    return edit


def _many_maxes(count: int):
    """``count`` more tensor values, each of one size that is the Max of 16 symbols (each under the bound on
    one Max; together, without a bound on all of them, a 1 MB file takes torch a minute to read)."""
    def change(tree):
        values = tree["graph_module"]["graph"]["tensor_values"]
        base = next(iter(values.values()))
        for i in range(count):
            text = "Max(" + ", ".join(f"s{i + k}" for k in range(16)) + ")"
            values[f"t{i}"] = {**base, "sizes": [{"as_expr": {"expr_str": text, "hint": {"as_int": 2}}}],
                               "strides": [{"as_int": 1}]}
    return edit_program(change)


def _guard(text: str):
    def change(tree):
        tree["guards_code"].append(text)
    return edit_program(change)


def _output_type(name: str):
    """The program's output spec and the plan both naming ``name`` as the type of the output."""
    def edit(entries):
        tree = json.loads(entries["models/model.json"])
        signature = tree["graph_module"]["module_call_graph"][0]["signature"]
        signature["out_spec"] = json.dumps([1, {"type": name, "context": "[]", "children_spec": [
            {"type": None, "context": None, "children_spec": []}]}])
        entries["models/model.json"] = json.dumps(tree).encode()
        plan = json.loads(entries["extra/amppass.json"])
        plan["pytree_types"] = [name]
        entries["extra/amppass.json"] = json.dumps(plan).encode()
    return edit


MAX_OF_MAXES = "Max(" + ", ".join("Max(" + ", ".join(f"s{i}" for i in range(j, j + 32)) + ")"
                                  for j in range(0, 512, 32)) + ")"
COSTLY_GUARDS = ["9**9**9 != 0", "'x' * 1090000000 != ''", "math.log(0) > 0", "int('1' * 5000) > 0",
                 "len('a' * 10**11) > 0", "L['input'].size()[0] ** L['input'].size()[1] > 0",
                 "L['input'].size()[0] << 10**9 > 0", "round(L['input'].size()[0], -99999999) > 0",
                 "L['input'].size()[0] + 1e-999999999 > 0"]
COSTLY_EXPRESSIONS = [MAX_OF_MAXES, "s31 + 1e-999999999", "Min(s0, Min(s1, Min(s2, Min(" + ", ".join(
    f"s{i}" for i in range(3, 20)) + "))))"]


@pytest.mark.parametrize("attack", OPERATOR_ATTACKS)
def test_an_operator_that_is_not_torchs_is_refused_on_every_way_in(saved, tmp_path, attack, capsys):
    target, operator, words = OPERATOR_ATTACKS[attack]
    marker = tmp_path / "marker"
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2",
                   edit_program(calling_node(target, operator, f"touch {marker}")))
    for load in (amppass.load, amppass.load_program):
        with pytest.raises(InputError) as caught:
            load(evil)
        message = str(caught.value)
        assert "models/model.json" in message and "node 'evil'" in message and words in message, message
    assert main(["report", str(evil)]) == 1
    assert main(["convert", str(evil), "-o", str(tmp_path / "out.pt2")]) == 1
    assert capsys.readouterr().err.count("node 'evil'") == 2
    assert not marker.exists() and not (tmp_path / "out.pt2").exists()


@pytest.mark.parametrize(
    "function, refused",
    [
        ("torch.os.system", "'posix'"),
        ("torch.serialization.pickle.loads", "'_pickle'"),
        ("_operator.__builtins__", "dunder"),
        ("torch.nn.modules.linear.Linear", None),
        ("torch.nn.functional.relu", None),
        ("_operator.add", None),
    ],
)
def test_a_function_the_metadata_names_is_torchs_or_stays_text(saved, tmp_path, function, refused):
    """A node's source_fn_stack, which torch resolves by getattr as it resolves operators and stores in the
    node's meta: os.system or pickle.loads there is refused; the classes and functions torch records pass."""
    def change(tree):
        tree["graph_module"]["graph"]["nodes"][1]["metadata"]["source_fn_stack"] = f"linear,{function}"

    path = rewrite(saved["converted"], tmp_path / "meta.pt2", edit_program(change))
    if refused is None:
        assert any(n.meta.get("source_fn_stack") for n in amppass.load_program(path).graph.nodes)
        return
    with pytest.raises(InputError, match=f"node 'linear': operator '{function}' .*{refused}"):
        amppass.load_program(path)


def test_the_operator_attack_is_real_without_the_check(saved, tmp_path):
    """What the check stops: torch.export.load resolves ``torch.os.system`` by name, and running the graph with
    torch.fx.Interpreter calls it."""
    marker = tmp_path / "marker"
    evil = rewrite(saved["plain"], tmp_path / "evil.pt2",
                   edit_program(calling_node("torch.ops.higher_order.wrap", "torch.os.system", f"touch {marker}")))
    program = torch.export.load(evil)
    inputs = [*(t.detach() for t in program.state_dict.values()), *X]
    with contextlib.suppress(Exception):  # the forged node's output is os.system's exit status, not a tensor
        torch.fx.Interpreter(program.graph_module).run(*inputs)
    assert marker.exists()


def test_a_program_with_control_flow_loads_and_runs(tmp_path):
    """The higher-order ops torch.export writes pass: a torch.cond program loads through amppass and runs."""
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda y: y.relu() + 1, lambda y: y.sigmoid(), (x,))

    x = torch.randn(3, 4)
    torch.export.save(torch.export.export(Branchy(), (x,)), tmp_path / "cond.pt2")
    loaded = amppass.load_program(tmp_path / "cond.pt2")
    assert any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in loaded.graph.nodes)
    for value in (x.abs(), -x.abs()):
        assert torch.equal(loaded.module()(value), Branchy()(value))


def test_a_strict_export_with_its_metadata_loads_and_runs(tmp_path):
    """What strict export records in source_fn_stack (torch.nn classes, torch._C._nn.gelu, torch.add,
    _operator.matmul, builtins.getattr) passes the metadata check."""
    class Mixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

        def forward(self, x):
            y = torch.add(torch.nn.functional.gelu(self.linear(x)), x) * 2
            return torch.softmax(self.norm(y) @ y.T, -1), y[0] - x.mean()

    torch.manual_seed(0)
    model, x = Mixed().eval(), torch.randn(4, 4)
    torch.export.save(torch.export.export(model, (x,), strict=True), tmp_path / "strict.pt2")
    loaded = amppass.load_program(tmp_path / "strict.pt2")
    assert any("source_fn_stack" in n.meta for n in loaded.graph.nodes)
    with torch.no_grad():
        for ours, theirs in zip(loaded.module()(x), model(x), strict=False):
            assert torch.allclose(ours, theirs)


@pytest.mark.parametrize("guard", COSTLY_GUARDS)
def test_a_guard_that_costs_or_raises_is_refused_at_load(saved, tmp_path, guard, capsys):
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", _guard(guard))
    with pytest.raises(InputError, match="models/model.json.*guard") as caught:
        amppass.load(evil)
    assert guard[:30] in str(caught.value)
    assert main(["convert", str(evil), "-o", str(tmp_path / "out.pt2")]) == 1
    assert "unexpected" not in capsys.readouterr().err


def test_a_guard_that_raises_at_a_call_is_a_mismatch(saved, tmp_path):
    """A guard that parses and is cheap but raises ValueError for some sizes (log of 0) fails that call as a
    guard mismatch (InputError naming the inputs), never with the raw ValueError; other sizes run."""
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", _guard("math.log(L['input'].size()[0] - 2) > -100"))
    loaded = amppass.load(evil)
    with pytest.raises(InputError, match="ValueError: math domain error"):
        loaded(torch.ones(2, 8))
    with torch.no_grad():
        assert torch.equal(loaded(torch.ones(3, 8)), amppass.load(saved["converted"])(torch.ones(3, 8)))


@pytest.mark.parametrize("text", COSTLY_EXPRESSIONS, ids=["max-of-maxes", "tiny-exponent", "nested-min"])
def test_a_symbolic_size_is_bounded_as_sympy_sees_it(saved, tmp_path, text):
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", _expression(text))
    with pytest.raises(InputError, match="sympy.sympify") as caught:
        amppass.load_program(evil)
    assert "flattened" in str(caught.value) or "exponent of at most three" in str(caught.value)


def test_the_maxes_of_a_whole_program_are_bounded_together(saved, tmp_path):
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", _many_maxes(2500))
    assert evil.stat().st_size < 1 << 20
    with pytest.raises(InputError, match="Max and Min calls of more than 131,072 argument pairs in all"):
        amppass.load_program(evil)


def test_only_container_types_are_imported_and_registered(saved, tmp_path):
    """An output spec naming transformers' Trainer (or any class outside the output and cache modules) is
    refused before its module is imported; one naming a model class of an allowed module is refused without
    being registered."""
    trainer = rewrite(saved["converted"], tmp_path / "trainer.pt2", _output_type("transformers.trainer.Trainer"))
    script = ("import sys, amppass\n"
              "try:\n    amppass.load(sys.argv[1])\nexcept amppass.InputError as err:\n    print(err)\n"
              "print('imported' if 'transformers.trainer' in sys.modules else 'not imported')\n")
    done = subprocess.run([sys.executable, "-c", script, str(trainer)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "not imported", done.stdout + done.stderr[-2000:]
    assert "transformers.trainer.Trainer" in lines[-2] and "not a container amppass writes" in lines[-2]

    from transformers.models.bert.modeling_bert import BertModel

    model = rewrite(saved["converted"], tmp_path / "model.pt2",
                    _output_type("transformers.models.bert.modeling_bert.BertModel"))
    with pytest.raises(InputError, match="BertModel.*not a transformers model output or cache"):
        amppass.load(model)
    assert BertModel not in pytree.SUPPORTED_NODES


BUDGET_SCRIPT = """
import json, resource, sys, time
import torch, amppass
honest, hostile = sys.argv[1], json.loads(sys.argv[2])
def spent():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024
loaded = amppass.load(honest)
loaded(torch.ones(2, 8))
cpu, peak = spent()
for path in hostile:
    try:
        amppass.load(path)(torch.ones(2, 8))
    except amppass.AmpPassError:
        pass
    after, top = spent()
    print(json.dumps({"file": path, "cpu": after - cpu, "rss_over_honest": top - peak}))
    cpu = after
"""


def test_hostile_programs_stay_within_the_budget(saved, tmp_path):
    """Every file of this module's attacks, under 1 MB, loaded (and called) in one fresh process: each costs
    under 10 s of CPU and the process's peak stays within 500 MB of an honest load's. The process runs under
    a CPU limit, so a file that hangs fails the test instead of hanging it."""
    edits = [edit_program(calling_node("torch.ops.higher_order.wrap", "torch.os.system", "true"))]
    edits += [_guard(g) for g in COSTLY_GUARDS] + [_expression(t) for t in COSTLY_EXPRESSIONS]
    edits += [_guard("math.log(L['input'].size()[0] - 2) > -100"), _output_type("transformers.trainer.Trainer"),
              _many_maxes(2500), _many_maxes(500)]  # refused; and just under the bound, read by torch
    files = [str(rewrite(saved["converted"], tmp_path / f"evil{i}.pt2", edit)) for i, edit in enumerate(edits)]
    assert all(Path(f).stat().st_size < 1 << 20 for f in files)
    limit = f"import resource; resource.setrlimit(resource.RLIMIT_CPU, ({60 + 20 * len(files)},) * 2)\n"
    done = subprocess.run([sys.executable, "-c", limit + BUDGET_SCRIPT, str(saved["converted"]), json.dumps(files)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    costs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(costs) == len(files)
    for cost in costs:
        assert cost["cpu"] < 10 and cost["rss_over_honest"] < 500 << 20, cost
