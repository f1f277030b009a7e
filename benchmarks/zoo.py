"""transformers' model zoo through amppass: outcomes per step, with counts (``tests/conformance/zoo_harness.py``).

``--quick`` runs one of the default suite's representative classes through one step (:data:`QUICK`: ~4 CPU s, where
the 16 representative classes' steps take ~200); ``--full`` runs every class of the
auto-model mappings through every step (the per-type steps on one class of each model type), keeping each class's
outcomes in ``zoo_outcomes.json`` beside RESULTS.md as
it goes: a run stopped part way resumes from there when the torch and transformers versions are the same (delete the
file to measure again).
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

from tests.conformance import zoo_harness as harness

from .results import Section, markdown_table

HERE = Path(__file__).resolve().parent

TITLE = "transformers model zoo: outcomes per step (convert, generate, compile, train, export_onnx)"

NOTES = (
    "Steps: `convert-speed`/`convert-coverage` (bf16; every float output within max(2^-5, 4x torch.autocast's error) "
    "of fp32's), `generate` (causal LMs: greedy tokens as fp32's up to a near-tie), `compile` (the amppass backend at "
    "two input shapes, judged as convert), `train` (fp16, 3 steps with LossScaler; each parameter's first-step "
    "gradient error, 1 - cosine to fp32's, within 2x autocast+GradScaler's for it plus 0.01; gradients fp16 autocast "
    "cannot resolve are counted, not judged), `export-onnx` (fp16; onnx.checker full check, onnxruntime CPU within "
    "max(2^-8, 4x fp16 autocast's error)). `compile` and `export-onnx` run on the first class of each model type "
    "that builds, `covered` on its others; a model that fails under autocast is judged against the floor. "
    "`unbuilt`: classes a tiny offline config cannot build (their reasons, counted, below). Expected deviations with "
    "reasons: tests/conformance/zoo_expected.json."
)


QUICK = {"BertForSequenceClassification": ("convert-coverage",)}  # class -> its steps, in --quick


def outcomes(quick: bool, path: Path | None = None) -> list[dict]:
    """Every class's outcomes: :data:`QUICK` or the whole zoo, resumed from ``path``."""
    found = harness.classes()
    if quick:
        return [vars(harness.run_class(name, *found[name], steps)) for name, steps in QUICK.items()]
    results: list[dict] = []
    if path is not None and path.exists():
        stored = json.loads(path.read_text(encoding="utf-8"))
        if stored.get("versions") == harness.versions():
            results = stored["results"]
    done = {r["name"] for r in results}
    types = harness.by_type(found)
    for model_type in harness.type_order(found):
        names = types[model_type]
        if all(name in done for name in names):
            continue
        results[:] = [r for r in results if r["name"] not in names]  # a type stopped part way runs again whole
        for result in harness.run_type(names, found):
            results.append(vars(result))
            if path is not None:
                harness.write_json(path, {"versions": harness.versions(), "results": results})
    return results


def failures(results: list[dict]) -> list[dict]:
    """One row per class with a failing step: the class and each step's outcome (its detail where it failed)."""
    rows = []
    for result in results:
        failed = {s: v for s, v in result["steps"].items() if v["outcome"] == "fail"}
        if failed:
            rows.append({"class": result["name"], "kind": result["kind"],
                         **{s: f"fail: {v['detail']}" if s in failed else v["outcome"]
                            for s, v in result["steps"].items()}})
    return rows


def unbuilt(results: list[dict]) -> list[dict]:
    """Why classes were not built: each reason's first words, with how many classes and one of them."""
    reasons: dict[str, list[str]] = collections.defaultdict(list)
    for result in results:
        if not result["built"]:
            reasons[result["reason"][:90]].append(result["name"])
    return [{"classes": len(names), "reason": reason, "e.g.": names[0]}
            for reason, names in sorted(reasons.items(), key=lambda item: -len(item[1]))]


def section(results: list[dict], which: str) -> Section:
    """The RESULTS.md section of ``results``: counts per step, the failing classes, the reasons for unbuilt ones."""
    found = Section(TITLE, "", notes=[NOTES])
    found.tables.append((f"Classes per outcome, {which} ({len(results)} classes)", harness.counts(results)))
    found.tables.append(("Classes with a failing step", failures(results)))
    found.tables.append(("Why classes were not built", unbuilt(results)))
    return found


def main(argv: list[str] | None = None) -> None:
    """Print the tables of an outcomes file the harness wrote (``zoo_harness.py --json``), as RESULTS.md shows
    them."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo", description=main.__doc__.split("\n")[0])
    parser.add_argument("outcomes", type=Path, help="the JSON file zoo_harness.py --json wrote")
    stored = json.loads(parser.parse_args(argv).outcomes.read_text(encoding="utf-8"))
    for caption, rows in section(stored["results"], f"torch {stored['versions']['torch']}, transformers "
                                 f"{stored['versions']['transformers']}").tables:
        print(f"**{caption}**\n\n{markdown_table(rows)}\n")


if __name__ == "__main__":
    main()
