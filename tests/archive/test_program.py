"""amppass.archive.program: the strings of a .pt2 program that torch evaluates or pastes into Python source.

Each hostile archive is one amppass.save wrote, with ``models/model.json`` edited as an attacker would: a guard
that carries statements after a newline and a ``#``, an argument name with a default value that runs code,
symbolic sizes that take sympy minutes, range keys that make torch count to 10**11 or print terminal escapes.
Where code could run, the model is also called (torch runs a guard on each call) and the marker must not appear.
"""

from __future__ import annotations

import ast
import json
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import amppass
from amppass import InputError
from amppass.archive.program import MAX_GUARD_BITS, check_expression, check_guard, check_program
from amppass.cli import main
from tests.helpers.pt2_files import MODEL_JSON, X, edit_program, guard_with_statements, guards, rewrite


def _signature(tree: dict) -> dict:
    return tree["graph_module"]["module_call_graph"][0]["signature"]


def argument_with_default(marker: Path) -> Callable[[dict], None]:
    """An argument name whose default value runs when torch defines the generated forward."""
    def change(tree):
        names = _signature(tree)["forward_arg_names"]
        names[0] = f"{names[0]}=__import__('pathlib').Path({str(marker)!r}).write_text('x')"
    return change


def parameter_path(marker: Path) -> Callable[[dict], None]:
    """A parameter name torch writes inside getattr(self, "...") in the forward it generates."""
    def change(tree):
        spec = tree["graph_module"]["signature"]["input_specs"][0]["parameter"]
        spec["parameter_name"] = f'0.weight"), open({str(marker)!r}, "w"), ("'
    return change


CODE_ATTACKS = {"guard": guard_with_statements, "argument name": argument_with_default,
                "parameter name": parameter_path}


@pytest.mark.parametrize("attack", CODE_ATTACKS)
def test_program_text_that_would_run_is_refused_on_every_way_in(saved, tmp_path, attack, capsys):
    marker = tmp_path / "marker"
    evil = rewrite(saved["converted"], tmp_path / "evil.pt2", edit_program(CODE_ATTACKS[attack](marker)))
    for load in (amppass.load, amppass.load_program):
        with pytest.raises(InputError) as caught:
            loaded = load(evil)
            (loaded.module() if isinstance(loaded, torch.export.ExportedProgram) else loaded)(*X)
        assert MODEL_JSON in str(caught.value) and "trusted=True" in str(caught.value)
    assert main(["report", str(evil)]) == 1
    assert main(["convert", str(evil), "-o", str(tmp_path / "out.pt2")]) == 1
    assert capsys.readouterr().err.count("amppass: error:") == 2
    assert not marker.exists(), f"{attack}: code from the file ran"


def test_the_guards_torch_writes_pass_and_still_guard(saved):
    """A real program's guards pass the check, and the loaded model still refuses a call they reject."""
    with zipfile.ZipFile(saved["converted"]) as archive:
        root = archive.namelist()[0].partition("/")[0]
        guards = json.loads(archive.read(f"{root}/{MODEL_JSON}"))["guards_code"]
    assert guards and all(check_guard(g, "m.pt2") is None for g in guards)
    with pytest.raises(InputError, match="input"):
        amppass.load(saved["converted"])(torch.ones(2, 7))


@pytest.mark.parametrize(
    "text",
    [
        "L['x'].size()[0] != 1",
        "2 <= L['x'].size()[0]",
        "L['input_ids'].size()[1] == min(512, L['input_ids'].size()[1])",
        "(32*L['x'].size()[0]*(L['x'].size()[3] // 2)*(L['x'].size()[2] // 2)) != 0",
        "3*L['pixel_values'].size()[2]*L['pixel_values'].size()[3] > 1",
        "L['x'].stride()[0] == math.floor(L['y'].size()[1] / 2)",
        "L['args'][0]['ids'].size()[1] <= 1024",
        "L['mode'] == 'a'",
        "L['cache'].key_cache[0].size()[2] >= 2",
    ],
)
def test_guard_forms_torch_writes_pass(text):
    check_guard(text, "m.pt2")


@pytest.mark.parametrize("text, words", [
    ("L['x'].size()[0] == 1 #\nimport os", "line break"),
    ("L['x'].size()[0] == 1 # comment", "comment"),
    ('L["x"].size()[0] == 1', "double quote"),
    ("__import__('os').system('true')", "__import__"),
    ("L['x'].__class__", "attribute '__class__'"),
    ("L['x'].size()[0] == (lambda: 1)()", "lambda"),
    ("torch.ops.aten.relu(L['x'])", "torch.ops"),
    ("open('f', 'w').write('x')", "open"),
    ("L['x'].size(*[0])", "unpacking"),
    ("[c for c in L]", "ListComp"),
    ("L['x'].size()[0] == 1 if L else 0", "IfExp"),
    ("L[L['x'].size()[0]]", "subscripts something other"),
    ("L['x\\u001b[31m'].size()[0] == 1", "backslash"),
    ("L['x'].size()[0] ==", "not an expression"),
], ids=lambda v: v[:24] if isinstance(v, str) else None)
def test_guards_that_are_not_size_comparisons_are_refused(text, words):
    with pytest.raises(InputError, match="runs it") as caught:
        check_guard(text, "m.pt2")
    assert words in str(caught.value)


@pytest.mark.parametrize("text", [
    "s31 + 1e999999999", "Float('1.5', precision=99999999)", "Symbol('s0', positive=1e999)",
    "FloorDiv(" + "+".join(f"s{i}" for i in range(12)) + ")**16, s0+s1)",
    "FloorDiv(Pow(" + "+".join(f"s{i}" for i in range(12)) + ", 16), s0)",
    "Mul(" + ", ".join("Add(s0, s1, s2, s3)" for _ in range(8)) + ")",
    "Max(" + ", ".join(f"s{i}" for i in range(600)) + ")",
    "u99999999999 + 1", "Integer(" + "9" * 60 + ")",
])
def test_expressions_that_take_sympy_minutes_are_refused_at_once(text):
    started = time.perf_counter()
    with pytest.raises(InputError, match="sympy.sympify"):
        check_expression(text, "m.pt2")
    assert time.perf_counter() - started < 1


def test_the_expressions_of_real_models_pass(tmp_path):
    """Every symbolic size of a converted BERT, a CNN and a model with a data-dependent size passes."""
    from amppass.archive import Pt2Archive
    from models import build

    class Select(torch.nn.Module):
        def forward(self, x):
            return torch.nonzero(x > 0).float().sum() + x

    torch.export.save(torch.export.export(Select(), (torch.randn(3, 4),)), tmp_path / "select.pt2")
    for name in ("bert", "cnn"):
        case = build(name, "small")
        amppass.save(amppass.convert(case.model, case.example_inputs, "bf16", plan_for="coverage"),
                     tmp_path / f"{name}.pt2")
    for path in tmp_path.glob("*.pt2"):
        with Pt2Archive(path) as archive:
            check_program(archive.program_json(), str(path))
    assert amppass.load_program(tmp_path / "select.pt2").range_constraints


@pytest.mark.parametrize("key, words", [
    ("u99999999999", "index up to 999,999"),
    ("s1\x1b]0;pwned\x07", "\\x1b"),
    ("s1\u009b31m", "\\x9b"),
    ("x y", "not a size symbol"),
], ids=["huge-index", "osc", "c1", "space"])
def test_range_keys_that_count_for_ever_or_carry_escapes_are_refused(saved, tmp_path, key, words, capsys):
    def change(tree):
        tree["range_constraints"][key] = {"min_val": 2, "max_val": None}

    odd = rewrite(saved["converted"], tmp_path / "odd.pt2", edit_program(change))
    started = time.perf_counter()
    with pytest.raises(InputError, match="range constraint") as caught:
        amppass.load(odd)
    assert words in str(caught.value) and time.perf_counter() - started < 30
    assert main(["report", str(odd)]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x9b" not in err and "\x07" not in err


@pytest.mark.parametrize("where, value", [
    ("kwargs key", "ids'] or open('x', 'w') or L['"),
    ("string input", "a' or open('x', 'w') or '"),
    ("subgraph name", 'true_graph_0"), open("x", "w"), ("'),
], ids=["kwargs-key", "string-input", "subgraph"])
def test_names_and_strings_torch_pastes_into_source_are_refused(where, value):
    tree: dict[str, Any] = {
        "graph_module": {
            "graph": {"inputs": [], "nodes": []},
            "signature": {},
            "module_call_graph": [{"fqn": "", "signature": {"forward_arg_names": ["x"]}}],
        }
    }
    if where == "kwargs key":
        spec = [1, {"type": "builtins.dict", "context": json.dumps([value]), "children_spec": []}]
        tree["graph_module"]["module_call_graph"][0]["signature"]["in_spec"] = json.dumps(spec)
    elif where == "string input":
        tree["graph_module"]["graph"]["inputs"].append({"as_string": value})
    else:
        tree["graph_module"]["graph"]["nodes"].append({"target": "torch.ops.higher_order.cond",
                                                      "inputs": [{"arg": {"as_graph": {"name": value}}}]})
    with pytest.raises(InputError, match="Python"):
        check_program(tree, "m.pt2")


def test_a_decision_that_is_not_an_object_is_an_input_error_with_or_without_a_plan(saved, tmp_path):
    def change(tree):
        for node in tree["graph_module"]["graph"]["nodes"]:
            custom = json.loads(node["metadata"].get("custom", "{}"))
            if "amppass" in custom:
                node["metadata"]["custom"] = json.dumps({**custom, "amppass": "[1, 2]"})

    with_plan = rewrite(saved["converted"], tmp_path / "with.pt2", edit_program(change))
    without = rewrite(with_plan, tmp_path / "without.pt2", lambda e: e.pop("extra/amppass.json"))
    with pytest.raises(InputError, match="its amppass decision is a JSON list"):
        amppass.load(with_plan)
    with pytest.raises(InputError, match="its amppass decision is a JSON list"):
        amppass.convert(amppass.load_program(without), dtype="bf16")


def test_only_the_types_the_program_uses_are_registered(saved, tmp_path):
    """A plan naming hundreds of transformers classes registers none that the program's specs do not use."""
    from transformers.models.bert import modeling_bert

    names = [f"transformers.models.bert.modeling_bert.{n}" for n in dir(modeling_bert) if n.startswith("Bert")]

    def edit(entries):
        plan = json.loads(entries["extra/amppass.json"])
        plan["pytree_types"] = names * 8
        entries["extra/amppass.json"] = json.dumps(plan).encode()

    many = rewrite(saved["converted"], tmp_path / "many.pt2", edit)
    before = set(pytree.SUPPORTED_NODES)
    assert torch.equal(amppass.load(many)(*X), amppass.load(saved["converted"])(*X))
    assert set(pytree.SUPPORTED_NODES) == before


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(guard=guards(), sizes=st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20)))
def test_a_guard_the_check_passes_is_cheap_to_evaluate(guard, sizes):
    """Whatever guard arithmetic the check passes evaluates on any sizes to a value or an arithmetic error (a
    mismatch at a call), computing no number past MAX_GUARD_BITS; the rest is refused with an InputError."""
    import math

    try:
        check_guard(guard, "m.pt2")
    except InputError:
        return
    inputs = {"input": torch.empty(sizes, device="meta")}
    values: list[Any] = []

    class Watch(ast.NodeTransformer):  # every value a subexpression computes, checked by size
        def visit_BinOp(self, node):
            self.generic_visit(node)
            return ast.Call(ast.Name("_seen", ast.Load()), [node], [])

    tree = ast.fix_missing_locations(Watch().visit(ast.parse(guard, mode="eval")))
    try:
        eval(compile(tree, "guard", "eval"), {"L": inputs, "math": math, "torch": torch,  # checked text
                                              "_seen": lambda v: values.append(v) or v})
    except (ArithmeticError, ValueError, TypeError):
        pass
    assert all(not isinstance(v, int) or v.bit_length() <= MAX_GUARD_BITS for v in values), guard
    assert all(not isinstance(v, (str, tuple)) or len(v) <= 1 << 16 for v in values), guard


@pytest.mark.parametrize("target, constant, refused", [
    ("_operator.pow", 999_999_999, True), ("_operator.lshift", 10**6, True), ("_operator.pow", 2, False),
    ("_operator.mul", 10**6, False),
])
def test_size_arithmetic_that_grows_without_bound_is_refused(target, constant, refused):
    """A size-arithmetic node raising to or shifting by a huge constant: every call would compute it."""
    node = {"target": target, "name": "p", "inputs": [{"name": "a", "arg": {"as_sym_int": {"as_name": "s0"}}},
                                                      {"name": "b", "arg": {"as_sym_int": {"as_int": constant}}}]}
    tree = {"graph_module": {"graph": {"inputs": [], "nodes": [node]}, "signature": {}, "module_call_graph": []}}
    if not refused:
        check_program(tree, "m.pt2")
        return
    with pytest.raises(InputError, match=f"m.pt2: node 'p': {target} by a constant beyond 64"):
        check_program(tree, "m.pt2")
