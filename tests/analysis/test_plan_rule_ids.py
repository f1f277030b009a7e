"""Every precision decision names the rule that made it: a short id from ``amppass.analysis.plan.RULES``, stored
with the decision in the converted model and shown in the report's JSON."""

from __future__ import annotations

import ast
import io
import pathlib
import warnings

import onnx
import pytest
import torch

import amppass
from amppass.analysis.plan import RULES
from models import build

PACKAGE = pathlib.Path(amppass.__file__).parent


def _rules_of(report: amppass.Report) -> dict[str, str]:
    return {row["name"]: row["rule"] for row in report.to_dict()["rows"]}


@pytest.mark.parametrize("name", ["mlp", "cnn", "bert"])
def test_every_fx_decision_of_a_zoo_model_names_a_known_rule(name):
    case = build(name, "small")
    fast = amppass.convert(case.model, case.example_inputs, "bf16", example_kwargs=case.example_kwargs or None,
                           plan_for="coverage", keep_fp32=["aten.layer_norm"] if name == "mlp" else ())
    rules = _rules_of(amppass.report(fast))
    assert rules and {node: rule for node, rule in rules.items() if rule not in RULES} == {}
    assert "policy" in rules.values()
    if name == "mlp":
        assert "keep-fp32" in rules.values()


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_every_onnx_decision_of_a_zoo_model_names_a_known_rule(name):
    case = build(name, "small")
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(case.model, case.example_inputs, buffer, dynamo=False)
    converted = amppass.convert_onnx(onnx.load_from_string(buffer.getvalue()), "fp16")
    rules = _rules_of(amppass.report(converted))
    assert rules and {node: rule for node, rule in rules.items() if rule not in RULES} == {}


def test_calibration_rules_store_their_id_beside_the_evidence():
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(4, 8) * 1e5  # beyond fp16's range after the first Linear
    fast = amppass.convert(net, (x,), "fp16", target="cpu", plan_for="coverage", calibration=[(x,)])
    rows = amppass.report(fast).rows
    calibrated = [row for row in rows if row.source == "calibration"]
    assert calibrated and all(row.rule == row.evidence["rule"] for row in calibrated)


def test_every_decision_made_in_the_code_names_a_known_rule():
    """Read from the source: each ``Decision(...)`` passes ``rule=``, and each literal id is in RULES."""
    missing, unknown = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        for call in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "Decision"):
                continue
            rule = next((k.value for k in call.keywords if k.arg == "rule"), None)
            where = f"{path.relative_to(PACKAGE.parent)}:{call.lineno}"
            if rule is None:
                missing.append(where)
            elif isinstance(rule, ast.Constant) and rule.value not in RULES:
                unknown.append(f"{where} {rule.value!r}")
    assert missing == [] and unknown == []
