"""Entry point: ``python -m benchmarks run --quick|--full [--out DIR] [--only SECTION,...]``.

Runs every section in one process, then writes ``RESULTS.md`` and the PNG plots into ``--out``
(default: this folder). Sections of other modules (ONNX converter comparison, training step,
hostile models) are imported only when they are run; a missing module leaves a note in RESULTS.md
instead of its table. A section that fails is reported there too, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from . import results
from .results import Section

HERE = Path(__file__).resolve().parent

LATENCY_NOTES = (
    "Variants: `fp32` eager; `autocast` = `torch.autocast('cpu', dtype=torch.bfloat16)`; `bf16_model` = "
    "`copy.deepcopy(model).bfloat16()`; `amppass` = `amppass.convert(model, inputs, torch.bfloat16)`; "
    "`amppass_lowtables` adds `low_weight_tables=True`. All under `torch.inference_mode()`, same inputs.",
    "Columns: `latency_ms` median of interleaved repeats after warm-up (`min_ms`: the fastest, least disturbed "
    "by other load); `vs_autocast` = autocast's latency / "
    "this one's (above 1: faster than autocast); `err_vs_fp32` / `err_vs_fp64` = ||out - ref|| / ||ref|| over all "
    "floating outputs, the reference being the fp32 model or its `.double()` copy; `weight_ratio` = floating "
    "parameter and buffer bytes / fp32's; `peak_alloc_MB` = high-water mark of torch CPU allocations during one "
    "forward (torch.profiler memory events: activations plus per-call weight casts, not the resident weights); "
    "`convert_s` = time of the `amppass.convert` call for this shape.",
)


def _latency(quick: bool, out: Path) -> Section:
    from . import latency

    rows = latency.run(quick)
    target_points = [r for r in rows if r["model"].startswith(("bert", "gpt2"))]
    zoo = [r for r in rows if not r["model"].startswith(("bert", "gpt2"))]
    section = Section("Inference latency, error and memory (bf16, CPU)", "", notes=list(LATENCY_NOTES))
    section.tables.append((
        "Latency targets: amppass >= 1.5x autocast's speed at batch 1, >= 1.0x at batch 8, error <= 1.1x "
        "autocast's, weights <= 0.55 of fp32",
        latency.target_verdict(rows),
    ))
    section.tables.append(("BERT and GPT-2, every variant", target_points))
    if zoo:
        section.tables.append(("Rest of the zoo at batch 1", zoo))
    results.plot_latency(rows, out / "latency.png")
    section.notes.append("Plot: [latency.png](latency.png).")
    point = latency.settings(quick)[0]
    section.tables.append((
        f"Where the time goes: heaviest ATen ops by self CPU time, {point.label}, autocast against amppass "
        "(torch.profiler, mean of 3 calls)",
        latency.profile_top(point),
    ))
    return section


def _scaling(quick: bool, out: Path) -> Section:
    from . import scaling

    section = Section("ONNX conversion time against graph size", "")
    if not scaling.available():
        section.notes.append("Skipped: this amppass has no `convert_onnx` yet.")
        return section
    rows = scaling.run(quick)
    fitted = scaling.fit(rows)
    section.notes.append(
        f"Synthetic chains of MatMul/Add/Relu/MatMul/Softmax/LayerNormalization/Add blocks (width "
        f"{scaling.WIDTH}, opset {scaling.OPSET}), converted to fp16. Fit t = a + b*n: a = "
        f"{fitted['intercept_s']:.3g} s, b = {fitted['s_per_node'] * 1e6:.3g} µs/node, R² = {fitted['r2']:.3f}; "
        f"power-law exponent {fitted['exponent']:.2f} "
        f"({'linear' if fitted['linear'] else 'NOT linear'}: linear means an exponent in [0.8, 1.25]). "
        "Plot: [scaling.png](scaling.png)."
    )
    section.tables.append(("", rows))
    results.plot_scaling(rows, fitted, out / "scaling.png")
    return section


def _external(module: str, title: str, call: Callable) -> Callable[[bool, Path], Section]:
    """A section whose rows come from another engineer's module, imported only if it exists."""

    def section(quick: bool, out: Path) -> Section:
        found = Section(title, "")
        if importlib.util.find_spec(f"benchmarks.{module}") is None:
            found.notes.append(f"Skipped: `benchmarks/{module}.py` is not in this checkout yet.")
            return found
        imported = importlib.import_module(f"benchmarks.{module}")
        found.tables.append(("", call(imported, quick)))
        if getattr(imported, "NOTES", None):  # what its columns mean, in the module's own words
            found.notes.append(imported.NOTES)
        return found

    return section


def _before_after(module: Any, quick: bool) -> list[dict]:
    """Rows of a section comparing amppass at ``module.BEFORE`` with this checkout, each in a fresh process; with
    ``--quick``, this checkout alone on ``module.QUICK``, in this process."""
    from . import checkouts

    return checkouts.this_checkout(module.measure, list(module.QUICK)) if quick else module.against(module.BEFORE, True)


def _onnx_calibration(quick: bool, out: Path) -> Section:
    from . import onnx_calibration

    timing, search, zoo = onnx_calibration.run(quick)
    section = Section("ONNX calibration and tolerance search", "", notes=list(onnx_calibration.NOTES))
    section.tables.append(("Conversion time: amppass without and with one calibration batch, onnxconverter-common "
                           f"({'one conversion each' if quick else 'median of 5'})", timing))
    section.tables.append(("Tolerance search on the sensor conv net (models/sensor.py): 3 calibration feeds, "
                           "2 held out", search))
    section.tables.append(("Tolerance search on the small zoo (both front ends; calibration seeds 1-4 for FX, "
                           "0-1 for ONNX; held out: seed 10)", zoo))
    return section


def _never_slower(quick: bool, out: Path) -> Section:
    from . import never_slower

    section = Section("Never slower than fp32 or autocast (target-aware plans, bf16, this CPU)", "",
                      notes=[never_slower.NOTES])
    rows = never_slower.run(quick)
    met = sum(r["met"] == "yes" for r in rows)
    section.tables.append((f"Every model at batch 1 and a large batch: {met} of {len(rows)} rows met", rows))
    which = "dynamo with the eager backend, the small MLP (--quick)" if quick else "inductor freezing, BERT 1x16"
    section.tables.append((f"torch.compile with {which}", never_slower.compiled(quick)))
    section.tables.append(("A kept original costs what the original costs (microseconds per call)",
                           never_slower.kept_cost(quick)))
    return section


def _never_slower_small(quick: bool, out: Path) -> Section:
    from . import never_slower

    section = Section("Never slower on small models: batch 1, where a wrapper's microseconds show (bf16, this "
                      "CPU)", "", notes=[never_slower.SMALL_NOTES])
    rows = never_slower.small(quick)
    met = sum(r["met"] == "yes" for r in rows)
    section.tables.append((f"{met} of {len(rows)} rows met", rows))
    section.tables.append(("A kept original costs what the original costs (microseconds per call)",
                           never_slower.kept_cost(quick)))
    return section


def _onnx_targets(quick: bool, out: Path) -> Section:
    from . import onnx_targets

    heavy, gap, tolerance = onnx_targets.run(quick)
    section = Section("ONNX plans per target (CPU, CUDA, TensorRT) and how their error is judged", "",
                      notes=[onnx_targets.NOTES])
    section.tables.append(("Heavy nodes low per target and dtype", heavy))
    section.tables.append(("Plain fp16 plan: onnxruntime CPU error against the fp16-storage simulation (held-out "
                           "feed)", gap))
    section.tables.append(("Tolerance 1e-2 on the CPU target, judged by onnxruntime", tolerance))
    return section


def _shapes(quick: bool, out: Path) -> Section:
    from . import shapes

    rows = shapes.run(quick)
    section = Section("Shapes: converted at one shape, called at three others (bf16, CPU)", "",
                      notes=[shapes.SHAPES_NOTES])
    section.tables.append(("Per architecture: every call ran, worst error ratio against autocast (target <= 1.1), "
                           "re-captures", shapes.verdict(rows)))
    section.tables.append(("Every call", rows))
    return section


def _lean_onnx(quick: bool, out: Path) -> Section:
    from . import lean_onnx

    section = Section("Lean ONNX plans against the FX plan of the same model (fp16)", "",
                      notes=[lean_onnx.__doc__.split("\n\n", 1)[1]])
    section.tables.append(("Casts added, float-work nodes low, error against fp32", lean_onnx.run(full=not quick)))
    return section


def _compile(quick: bool, out: Path) -> Section:
    from . import shapes

    section = Section("torch.compile backend against autocast with inductor freezing (bf16, CPU)", "",
                      notes=[shapes.COMPILE_NOTES])
    section.tables.append(("Compile-backend target: amppass latency <= autocast+freezing's, first call <= its",
                           shapes.compile_rows(quick)))
    return section


def _train_step(quick: bool, out: Path) -> Section:
    from . import train_step

    section = Section("Training step: amppass against autocast + GradScaler", "", notes=[train_step.NOTES])
    section.tables.append(("Training step time, small models", train_step.run(quick)))
    return section


def _train_gpt(quick: bool, out: Path) -> Section:
    from . import train_gpt

    section = Section("Training: amppass against autocast + GradScaler", "", notes=[train_gpt.NOTES])
    described, rows, sharded = train_gpt.run(quick)
    section.tables.append((f"Character GPT-2 on the standard library's source: {described}", rows))
    section.tables.append(("FSDP2 on 2 processes (gloo, CPU): amppass fp16, fully_shard per block and on the root; "
                           "held-out loss in eval mode after training", sharded))
    return section


def _conformance(quick: bool, out: Path) -> Section:
    from . import onnx_conformance

    section = Section("ONNX conformance: the ONNX backend test suite converted to fp16", "",
                      notes=[onnx_conformance.NOTES])
    cases, which = onnx_conformance.cases(quick), onnx_conformance.QUICK_CASES if quick else ""
    section.tables.append((f"Outcomes per converter ({len(cases)} cases{which})", onnx_conformance.table(cases)))
    section.tables.append((f"Casts added to the light nets: amppass at {onnx_conformance.BEFORE} (before the "
                           "conformance fixes) and now, with the fp16 nodes it plans; the other converters' Casts and "
                           "outcome",
                           onnx_conformance.casts_table(quick)))
    return section


def _plans_under_load(quick: bool, out: Path) -> Section:
    from . import plans_under_load

    section = Section("Plans under load: made quiet and made beside 4 busy processes (bf16, this CPU)", "",
                      notes=[plans_under_load.NOTES])
    rows = plans_under_load.run(quick)
    same = sum(r["same_as_quiet_cached"] for r in rows)
    section.tables.append((f"Heavy nodes low per plan; {same} of {len(rows)} busy plans with the quiet cache equal "
                           "the quiet plan", rows))
    return section


def _generate(quick: bool, out: Path) -> Section:
    from . import generate

    section = Section("Decoding with generate(): amppass against autocast and torch.compile(autocast) (bf16, CPU)",
                      "", notes=[generate.NOTES])
    section.tables.append((generate.title(quick), generate.run(quick)))
    return section


def _gpu(quick: bool, out: Path) -> Section:
    from . import gpu

    described, tables = gpu.run(quick)
    section = Section(f"GPU: amppass against fp32, autocast, the all-low model and torch.compile on {described}", "",
                      notes=[gpu.NOTES])
    section.tables += tables
    return section


def _zoo(quick: bool, out: Path) -> Section:
    from . import zoo

    rows = zoo.outcomes(quick, None if quick else out / "zoo_outcomes.json")
    return zoo.section(rows, "one representative class, one step (--quick)" if quick else
                       "every class of the auto-model mappings")


SECTIONS: dict[str, Callable[[bool, Path], Section]] = {
    "latency": _latency,
    "never_slower": _never_slower,
    "never_slower_small": _never_slower_small,
    "onnx_targets": _onnx_targets,
    "scaling": _scaling,
    "onnx": _external("onnx_compare", "ONNX converters: onnxconverter-common against amppass",
                      lambda m, quick: m.run(quick)),
    "onnx_calib": _onnx_calibration,
    "train_step": _train_step,
    "train_gpt": _train_gpt,
    "hostile": _external("hostile", "Hostile models", lambda m, quick: m.run(quick)),
    "shapes": _shapes,
    "compile": _compile,
    "generate": _generate,
    "lean_onnx": _lean_onnx,
    "conformance": _conformance,
    "plans_under_load": _plans_under_load,
    "zoo": _zoo,
    "tolerance_ref": _external("tolerance_reference", "Tolerance search against a reference ranking (ONNX fp16, "
                               "onnxruntime CPU)", lambda m, quick: m.run(quick)),
    "integrations": _external("integrations", "amppass in the tools' own training loops against their precision "
                              "flags (Lightning, transformers Trainer, accelerate; CPU)",
                              lambda m, quick: m.run(quick)),
    "tolerance_time": _external("tolerance_time", "Tolerance-search time (FX fp16, tolerance 1e-4, 4 calibration "
                                "batches; real-sized models in --full, the small CNN in --quick): amppass at "
                                "d7ec324 (no held-out check, prefix reuse or run bound) and now", _before_after),
    "call_overhead": _external("call_overhead", "Per-call cost of the returned module over its graph (bf16, one "
                               "thread, microseconds): amppass at e70efd1 and now", _before_after),
    "startup": _external("startup", "Start-up: `amppass --help` and `import amppass` (wall time of a fresh process, "
                         "median of 7): amppass at e70efd1 and now", _before_after),
    "conversion_time": _external("conversion_time", "Conversion time and plan digest (coverage plans, calibration "
                                 "and tolerance on both front ends): amppass at 71b06f8 and now", _before_after),
    "conversion_profile": _external("conversion_profile", "Where the conversion time of a large 3D model goes: a 3D "
                                    "Swin segmentation net (SwinUNETR's shape), bf16 coverage plan, under cProfile",
                                    lambda m, quick: m.run(quick)),
    "dynamic_padding": _external("dynamic_padding", "Fine-tuning with dynamic padding: AmpPassTrainer against the "
                                 "transformers Trainer in fp32 and with bf16=True (rounds of the same steps: wall and "
                                 "CPU ratios, conversion included)",
                                 lambda m, quick: m.run(quick)),
    "fp8": lambda quick, out: importlib.import_module("benchmarks.fp8").section(quick),
    "gpu": _gpu,
    "fp8_train": _external("fp8_train", "fp8 training: the character GPT-2 (CPU, fp8 emulated)", lambda m, q: m.run(q)),
}


def _cpu_seconds() -> float:
    """User plus system CPU seconds of this process and of its children that have ended."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def run(mode: str, out: Path, only: list[str]) -> int:
    """Run the chosen sections, write RESULTS.md and plots into ``out``; 1 if any section failed."""
    out.mkdir(parents=True, exist_ok=True)
    started, load_before = results.now(), results.load()
    sections, failed = [], False
    for name in only:
        print(f"[benchmarks] {name} ({mode}) ...", file=sys.stderr, flush=True)
        start, cpu_start = time.perf_counter(), _cpu_seconds()
        try:
            section = SECTIONS[name](mode == "quick", out)
        except Exception as err:  # noqa: BLE001 - one broken section must not lose the others' figures
            traceback.print_exc()
            section = Section(name, "", notes=[f"FAILED: `{type(err).__name__}: {err}`"])
            failed = True
        section.command = f"python -m benchmarks run --{mode} --only {name}"
        wall, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
        section.notes.append(f"Measured {started} (UTC), load at start {load_before}; section wall time: "
                             f"{wall:.0f} s, CPU time {cpu:.0f} s (user+sys, this process and its children).")
        sections.append(section)
        print(f"[benchmarks] {name} done in {wall:.1f} s, {cpu:.1f} CPU s, load {results.load()}", file=sys.stderr,
              flush=True)
    results.write_markdown(out / "RESULTS.md", mode, sections, started, load_before)
    print(f"[benchmarks] wrote {out / 'RESULTS.md'}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="measure and write RESULTS.md and plots")
    mode = run_parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--quick", action="store_const", const="quick", dest="mode",
                      help="small models, few repeats: a smoke run of every section (minutes on 2 cores; each "
                           "section says its CPU seconds; "
                           "--only picks sections)")
    mode.add_argument("--full", action="store_const", const="full", dest="mode",
                      help="base-sized models, more repeats, the whole zoo (several minutes)")
    run_parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: benchmarks/)")
    run_parser.add_argument("--only", default=",".join(SECTIONS),
                            help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all); "
                                 "the other sections of an existing RESULTS.md are kept as they were")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    logging.basicConfig(level=logging.WARNING)
    return run(args.mode, args.out, only)


if __name__ == "__main__":
    sys.exit(main())
