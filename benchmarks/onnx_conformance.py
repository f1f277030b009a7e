"""The ONNX backend test suite as a conformance suite for fp16 converters.

The cases, their outcomes and amppass's configurations are those of
:mod:`tests.conformance.onnx_backend_harness`.

``--quick`` takes every fifth model of the small folders (no node case: collecting them alone takes ~15 CPU s) and
counts Casts on SqueezeNet alone, without amppass at :data:`BEFORE` (a fresh process of it: ~5 CPU s).

``python -m benchmarks.onnx_conformance [--quick]`` prints the outcome table of amppass, onnxconverter-common's
``convert_float_to_float16`` and onnxruntime's ``onnxruntime.transformers.float16`` (both with
``keep_io_types=True``) side by side, and the Casts each adds to the light nets, amppass before (commit
:data:`BEFORE`) and now; ``python -m benchmarks run --quick|--full --only conformance`` writes them into
RESULTS.md.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter
from typing import Any, Callable, Sequence

import onnx

import amppass
from amppass.onnx.view import all_nodes
from tests.conformance.onnx_backend_harness import (
    FORCED_BOUND,
    FP16_BOUND,
    OUTCOMES,
    Case,
    all_cases,
    amppass_converter,
    folder_cases,
    light_case,
    outcome,
)

QUICK_FOLDERS = ("simple", "pytorch-operator", "pytorch-converted")
QUICK_CASES = ": --quick, every fifth model of onnx/backend/test/data/{simple,pytorch-operator,pytorch-converted}"


def cases(quick: bool) -> tuple[Case, ...]:
    """The cases of :func:`table`: the whole suite, or (``quick``) every fifth model of :data:`QUICK_FOLDERS`."""
    return folder_cases(QUICK_FOLDERS)[::5] if quick else all_cases()


def _onnxconverter_common(case: Case) -> tuple[Case, onnx.ModelProto]:
    from onnxconverter_common import float16

    return case, float16.convert_float_to_float16(case.model, keep_io_types=True)


def _onnxruntime_tool(case: Case) -> tuple[Case, onnx.ModelProto]:
    from onnxruntime.transformers import float16

    return case, float16.convert_float_to_float16(case.model, keep_io_types=True)


def converters() -> dict[str, Callable[[Case], tuple[Case, onnx.ModelProto]]]:
    """The converters compared: amppass's default plan, onnxconverter-common and onnxruntime's tool (where
    they import)."""
    found = {"amppass": amppass_converter("default")}
    try:
        import onnxconverter_common  # noqa: F401

        found["onnxconverter-common"] = _onnxconverter_common
    except ImportError:
        pass
    try:
        from onnxruntime.transformers import float16  # noqa: F401

        found["onnxruntime float16"] = _onnxruntime_tool
    except ImportError:
        pass
    return found


def table(chosen: Sequence[Case]) -> list[dict]:
    """One row per converter (and amppass's two other configurations): how many of ``chosen`` ended in each
    outcome."""
    rows = []
    runs = [(name, convert, FP16_BOUND, False) for name, convert in converters().items()]
    runs.insert(1, ("amppass force_low", amppass_converter("force_low"), FORCED_BOUND, False))
    runs.insert(2, ("amppass low_input", amppass_converter("low_input"), FP16_BOUND, True))
    logging.disable(logging.WARNING)  # every converter warns per case; the table says what happened
    try:
        for name, convert, bound, rounded in runs:
            counts = Counter(outcome(case, convert, bound, rounded).kind for case in chosen)
            rows.append({"converter": name, "cases": len(chosen), **{kind: counts.get(kind, 0) for kind in OUTCOMES}})
    finally:
        logging.disable(logging.NOTSET)
    return rows


LIGHT_NETS = ("densenet121", "inception_v1", "inception_v2", "resnet50", "shufflenet", "squeezenet", "vgg19",
              "bvlc_alexnet", "zfnet512")
BEFORE = "d7ec324"  # amppass before the conformance fixes: DenseNet-121 converted with 364 Casts
NOTES = ("Cases: every node case of onnx.backend.test.case.node.collect_testcases with a float32 input that "
         "onnxruntime's CPU provider reproduces in float32, and the models of onnx/backend/test/data/"
         "{pytorch-converted,pytorch-operator,simple,light} it reproduces (first data set). Outcomes: correct = "
         "passes onnx.checker.check_model(full_check=True), loads and runs in onnxruntime CPU, and "
         "||out - expected|| / ||expected|| <= 5e-3 on every output (NaN/inf where expected, integers equal); "
         "refused = amppass.AmpPassError; crash = any other exception from the converter; invalid = the checker "
         "or onnxruntime refuses the model; run failure = onnxruntime raises when running it; wrong = outside "
         "the bound. amppass force_low = force_low= every op type of the model, bound 2e-2; amppass low_input "
         "= each float32 input read through an Identity forced to fp16 first (the default plan then decides on "
         "a low-precision value), also correct within the bound of the float32 model on fp16-rounded inputs. "
         "onnxconverter-common and onnxruntime's tool: convert_float_to_float16(model, keep_io_types=True).")


def casts(model: onnx.ModelProto) -> int:
    """Cast nodes of ``model``, subgraphs included."""
    return sum(1 for node in all_nodes(model.graph) if node.op_type == "Cast")


def amppass_casts(names: Sequence[str]) -> dict[str, dict[str, int]]:
    """For each light net: the Casts amppass's default plan adds and the nodes it plans fp16."""
    found = {}
    logging.disable(logging.WARNING)
    try:
        for name in names:
            case = light_case(name)
            converted = amppass.convert_onnx(case.model)
            low = sum(r.precision == "fp16" for r in amppass.report(converted).rows)
            found[name] = {"casts": casts(converted) - casts(case.model), "fp16_nodes": low}
    finally:
        logging.disable(logging.NOTSET)
    return found


def _before(names: Sequence[str]) -> dict[str, dict[str, int]] | str:
    """:func:`amppass_casts` of amppass at commit :data:`BEFORE` (``git archive`` into a temporary folder, measured
    in a fresh process), or why it could not be measured."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from . import checkouts

    repo = Path(__file__).resolve().parent.parent
    try:
        with checkouts.at_commit(BEFORE) as folder:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(repo)])}
            done = subprocess.run([sys.executable, "-m", "benchmarks.onnx_conformance", "--casts", *names],
                                  cwd=folder, env=env, capture_output=True, text=True)
    except RuntimeError as error:
        return str(error)
    if done.returncode:
        return f"measuring {BEFORE} failed: {done.stderr.strip().splitlines()[-1:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def casts_table(quick: bool = False) -> list[dict]:
    """Casts per light net (SqueezeNet alone and no :data:`BEFORE` with ``quick``): amppass at :data:`BEFORE` and now
    (Casts added, fp16 nodes), and the Casts the other converters add, with their outcome."""
    names = ("squeezenet",) if quick else LIGHT_NETS
    now, before = amppass_casts(names), "measured with --full" if quick else _before(names)
    others = {k: v for k, v in converters().items() if k != "amppass"}
    rows = []
    for name in names:
        case = light_case(name)
        row: dict[str, Any] = {"model": name}
        if isinstance(before, dict):
            row.update({f"casts_{BEFORE}": before[name]["casts"], f"fp16_nodes_{BEFORE}": before[name]["fp16_nodes"]})
        row.update({"casts_now": now[name]["casts"], "fp16_nodes_now": now[name]["fp16_nodes"]})
        for label, convert in others.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    converted = convert(case)[1]
                row[f"casts_{label}"] = casts(converted) - casts(case.model)
            except Exception as err:  # noqa: BLE001 - counted in the outcome column
                row[f"casts_{label}"] = f"crash: {type(err).__name__}"
            row[f"outcome_{label}"] = outcome(case, convert).kind
        rows.append(row)
    if not isinstance(before, dict):
        rows.append({"model": f"(before: {before})"})
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m benchmarks.onnx_conformance [--quick]``: the outcome table and the light nets' Casts;
    ``--casts NAME ...`` prints this checkout's :func:`amppass_casts` as JSON (how :func:`_before` measures)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.onnx_conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every fifth model of the small folders, SqueezeNet alone")
    parser.add_argument("--casts", nargs="+", metavar="NAME", help="print amppass's Casts on these light nets")
    args = parser.parse_args(argv)
    if args.casts:
        print(json.dumps(amppass_casts(args.casts)))
        return
    for row in table(cases(args.quick)) + casts_table(args.quick):
        print(row)


if __name__ == "__main__":
    main()
