"""transformers' model zoo as amppass's regression suite: every model class of the auto-model mappings that a tiny
config builds offline, through convert (speed and coverage plans), generate, the compile backend, train mode and
export_onnx (``tests/conformance/zoo_harness.py`` says how each step is judged).

Every outcome is asserted against ``tests/conformance/zoo_expected.json``: a step that fails must be listed there with
its reason, and a listed step that passes fails the test too (so is a listed unbuilt class that builds), so the list
cannot go stale. The compile and export steps run on one class of each model type (``harness.PER_TYPE``). The
default run takes a representative subset (:data:`DEFAULT`: decoders, MoE and MLA, a state-space
model, encoders, encoder-decoders, vision, audio), each with the steps that class stands for; the whole zoo, every step,
runs under ``-m slow``. Regenerate the expected file after a fix: ``python tests/conformance/zoo_harness.py
--write-expected``.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

pytest.importorskip("transformers")
from tests.conformance import zoo_harness as harness  # after the skip

DATA = json.loads(harness.EXPECTED.read_text(encoding="utf-8"))

DEFAULT = harness.REPRESENTATIVE


@functools.cache
def _classes() -> dict[str, tuple[str, str]]:
    return harness.classes()


def verdict(result: harness.Result) -> list[str]:
    """Why ``result`` is not what ``zoo_expected.json`` says (empty when it is)."""
    name, unbuilt = result.name, DATA["unbuilt"].get(result.name)
    if not result.built:
        return [] if unbuilt is not None else [f"{name} no longer builds: {result.reason}"]
    if unbuilt is not None:
        return [f"{name} builds now: remove it from 'unbuilt' in zoo_expected.json (it was: {unbuilt})"]
    found = []
    listed = DATA["expected"].get(name, {})
    for step, got in result.steps.items():
        reason = listed.get(step)
        if got["outcome"] == "fail" and reason is None:
            found.append(f"{name} {step}: {got['detail']}")
        elif got["outcome"] != "fail" and reason is not None:
            found.append(f"{name} {step} {got['outcome']}s now ({got['detail']}): remove it from zoo_expected.json "
                         f"(it was: {reason})")
    return found


def _check(name: str, steps: tuple[str, ...]) -> None:
    kind, model_type = _classes()[name]
    failures = verdict(harness.run_class(name, kind, model_type, steps))
    assert not failures, "\n".join(failures)


def test_expected_entries_name_real_classes_and_steps_with_reasons():
    classes = _classes()
    assert len(classes) > 500, "the auto-model mappings are walked"
    for name, reason in DATA["unbuilt"].items():
        assert name in classes and reason, name
    for name, steps in DATA["expected"].items():
        assert name in classes and name not in DATA["unbuilt"], name
        for step, reason in steps.items():
            assert step in harness.STEPS and reason, (name, step)
    assert set(DEFAULT) <= set(classes) and not set(DEFAULT) & set(DATA["unbuilt"])


def test_tiny_configs_shrink_what_the_class_has():
    config = harness.tiny_config("mistral")
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 32, 4)
    assert config.num_key_value_heads == 2 and config.vocab_size == harness.VOCAB  # grouped-query kept
    assert harness.tiny_config("llama").num_key_value_heads == 4  # a class without GQA gets none
    assert harness.tiny_config("bert").hidden_dropout_prob == 0.0


def test_a_model_type_takes_the_sizes_shrink_cannot_name():
    built = harness.build("YolosModel", "base", "yolos")  # its [512, 864] image gave 16,485 tokens
    assert tuple(built.inputs["pixel_values"].shape[-2:]) == (32, 32)
    with torch.no_grad():
        assert built.model(**built.inputs).last_hidden_state.shape[1] == (32 // 4) ** 2 + 1 + 10


def test_tiny_configs_switch_off_training_randomness():
    config = harness.tiny_config("wav2vec2")
    assert (config.mask_time_prob, config.layerdrop, config.hidden_dropout) == (0.0, 0.0, 0.0)


def test_a_hybrid_keeps_every_layer_kind_and_a_class_gets_another_tiny_config_where_one_cannot_build():
    from transformers import CONFIG_MAPPING, Qwen3_5ForCausalLM, Qwen3_5ForSequenceClassification

    assert harness.tiny_config("qwen3_5_text").layer_types == ["linear_attention", "linear_attention"]
    hybrid = harness.tiny_config("qwen3_5_text", every_layer_kind=True)  # its first layers lack full attention
    assert hybrid.layer_types == ["linear_attention", "full_attention"] and hybrid.num_hidden_layers == 2
    tried = [config() for config in harness.configs(Qwen3_5ForCausalLM, "qwen3_5")]
    assert [type(c) for c in tried] == [CONFIG_MAPPING["qwen3_5"]] * 2 + [Qwen3_5ForCausalLM.config_class] * 2
    assert [c.get_text_config().layer_types for c in tried[:2]] == [hybrid.layer_types, ["linear_attention"] * 2]
    assert tried[2].layer_types == hybrid.layer_types  # each config class, with every kind first
    # a sequence-classification head reads a cache length only full attention layers give
    built = harness.build("Qwen3_5ForSequenceClassification", "seq-cls", "qwen3_5")
    assert isinstance(built.model, Qwen3_5ForSequenceClassification)
    assert built.model.config.text_config.layer_types == ["linear_attention", "full_attention"]

def test_gradients_are_judged_per_parameter_against_autocast_s():
    autocast = {"a": 0.9999, "b": 0.97, "noise": -0.04}
    # b: error 0.07 against autocast's 0.03, within 2 x 0.03 + 0.01
    assert harness.judge_gradients({"a": 0.9995, "b": 0.93, "noise": -0.3}, autocast)[0] == "pass"
    assert harness.judge_gradients({"a": 0.9995, "b": 0.92, "noise": -0.3}, autocast)[0] == "fail"
    outcome, detail = harness.judge_gradients({"a": 0.95, "b": 0.97, "noise": 0.1}, autocast)
    assert outcome == "fail" and detail.startswith("a: cosine 0.9500")  # worse than autocast on a resolved one
    assert "1 parameters unresolved" in detail
    assert harness.judge_gradients({"a": 0.985}, {})[0] == "fail"  # autocast failed: judged against 0.999


def test_a_rerun_of_some_steps_updates_those_steps_only():
    first = [
        vars(
            harness.Result(
                "A", "base", True, steps={"train": {"outcome": "fail"}, "compile": {"outcome": "pass"}}, commit="old"
            )
        ),
        vars(harness.Result("B", "base", False, "KeyError")),
    ]
    again = [vars(harness.Result("A", "base", True, steps={"train": {"outcome": "pass"}}, commit="new")),
             vars(harness.Result("B", "base", True, steps={"train": {"outcome": "pass"}}))]
    a, b = harness.merged(first, again)
    assert a["steps"] == {"train": {"outcome": "pass"}, "compile": {"outcome": "pass"}} and a["commit"] == "new"
    assert b["built"] and b["steps"] == {"train": {"outcome": "pass"}}


def test_a_step_that_starts_passing_fails_the_suite(monkeypatch):
    result = harness.Result("LlamaForCausalLM", "causal-lm", True, steps={"train": {"outcome": "pass", "detail": ""}})
    monkeypatch.setitem(DATA["expected"], "LlamaForCausalLM", {"train": "listed as failing"})
    assert "remove it from zoo_expected.json" in verdict(result)[0]
    monkeypatch.setitem(DATA["expected"], "LlamaForCausalLM", {})
    assert verdict(result) == []
    result.steps["train"]["outcome"] = "fail"
    assert verdict(result) == ["LlamaForCausalLM train: "]


@pytest.mark.parametrize("name", sorted(DEFAULT))
def test_representative(name):
    _check(name, DEFAULT[name])


def _all() -> list[str]:
    try:
        return sorted(_classes())
    except Exception:  # noqa: BLE001 - collection must not fail where transformers' mappings cannot be read
        return []


@pytest.mark.slow
@pytest.mark.parametrize("name", _all())
def test_every_class(name):
    _check(name, harness.steps_of(name, _classes(), DATA["unbuilt"]))


def test_per_type_steps_run_on_the_first_class_of_a_model_type_that_builds(monkeypatch):
    found = {"XForCausalLM": ("causal-lm", "x"), "XForMaskedLM": ("masked-lm", "x"), "XModel": ("base", "x"),
             "YModel": ("base", "y")}
    ran: list[tuple[str, str]] = []

    def build(name, kind, model_type):
        if name == "XForCausalLM":
            raise KeyError("no recipe")
        return harness.Built(name, kind, None, {}, {}, {}, False)

    monkeypatch.setattr(harness, "build", build)
    for step in harness.STEPS:
        monkeypatch.setitem(
            harness.RUNNERS, step, lambda built, step=step: ran.append((built.name, step)) or ("pass", "")
        )
    results = [r for names in harness.by_type(found).values() for r in harness.run_type(names, found)]
    assert [r.built for r in results] == [False, True, True, True]
    masked, base = results[1].steps, results[2].steps
    assert {s: v["outcome"] for s, v in masked.items()} == dict.fromkeys(harness.STEPS, "pass")
    assert {s: base[s] for s in harness.PER_TYPE} == {
        s: {"outcome": "covered", "detail": "by XForMaskedLM", "seconds": 0.0} for s in harness.PER_TYPE}
    assert sum(step == "compile" for _, step in ran) == 2  # once per model type
    unbuilt = {"XForCausalLM": "KeyError: no recipe"}
    assert harness.owners(found, unbuilt) == {"x": "XForMaskedLM", "y": "YModel"}
    assert harness.steps_of("XModel", found, unbuilt) == tuple(s for s in harness.STEPS if s not in harness.PER_TYPE)
    assert harness.steps_of("YModel", found, unbuilt) == harness.STEPS
    rows = {row["step"]: row for row in harness.counts([vars(r) for r in results])}
    assert (rows["compile"]["pass"], rows["compile"]["covered"], rows["build"]["unbuilt"]) == (2, 1, 1)


def test_a_step_that_killed_the_process_is_recorded_failed_on_resume_not_run_again(monkeypatch, tmp_path):
    found = {"XForCausalLM": ("causal-lm", "x")}
    ran: list[str] = []
    monkeypatch.setattr(harness, "classes", lambda: found)
    monkeypatch.setattr(harness, "build", lambda name, kind, model_type: harness.Built(name, kind, None, {}, {}, {},
                                                                                      False))
    for step in harness.STEPS:
        monkeypatch.setitem(harness.RUNNERS, step, lambda built, step=step: ran.append(step) or ("pass", ""))
    monkeypatch.setattr(harness, "RUNNING", None)  # main() points it at its --json; restored after the test
    monkeypatch.setattr(harness.signal, "signal", lambda signum, handler: None)  # this process keeps its SIGTERM
    outcomes = tmp_path / "zoo.json"
    # the marker a native crash in the compile step left behind
    outcomes.with_suffix(".running").write_text(json.dumps({"name": "XForCausalLM", "step": "compile"}))
    for only in (["--only", "XForCausalLM"], ["--shard", "0/1"]):
        ran.clear()
        outcomes.unlink(missing_ok=True)
        harness.main([*only, "--steps", "generate", "compile", "--json", str(outcomes), "--resume", "--memory-gb", "0"])
        (result,) = json.loads(outcomes.read_text())["results"]
        assert ran == ["generate"], only
        assert result["steps"]["compile"] == {"outcome": "fail", "detail": harness.CRASHED, "seconds": 0.0}
        assert not outcomes.with_suffix(".running").exists()  # the run ended: no step of it is running
        outcomes.with_suffix(".running").write_text(json.dumps({"name": "XForCausalLM", "step": "compile"}))
