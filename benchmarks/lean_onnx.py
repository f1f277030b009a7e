"""How lean the ONNX plans are against the FX plan of the same model.

For each model, the fp32 ONNX export is converted to fp16 for the default target (onnxruntime CPU) and the
same torch model is converted by the FX path (``plan_for="coverage"``: the numerics plan, no profitability,
as the ONNX plan has none). Columns:

- ``casts_onnx`` / ``casts_fx``: Casts the conversion added (ONNX: Cast nodes in the output less those in the
  input; FX: the plan's count, ``meta["amppass"]["casts"]``);
- ``float_low``: nodes doing float work (report rows with a precision) planned fp16, of all of them;
- ``err_runtime`` / ``err_simulated``: ``||out - out_fp32|| / ||out_fp32||`` on a held-out feed (largest over
  floating outputs), the converted model run in onnxruntime's CPU provider and in the fp16-storage
  simulation (:func:`amppass.onnx.simulate.simulated`, an fp32-accumulating GPU kernel's numerics).

The models: a 4-layer BERT (hidden 256, 64 tokens) and a 4-layer ViT-Base/16 (224x224), both from the dynamo
exporter, and a net of six Conv-BatchNorm-ReLU blocks exported by the TorchScript exporter without constant
folding, so that its eval BatchNorm stays a node; and BERT-base, 12 layers. That is ``--full``; without it (and in
``python -m benchmarks run --quick``) the Conv-BN net alone, ~3 CPU s, where BERT's export alone takes ~13.

``python -m benchmarks.lean_onnx [--full] [--root CHECKOUT ...]`` measures each checkout's amppass in a fresh
process (default: this one), so before/after tables come from one run.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

try:
    from . import checkouts
except ImportError:  # run as a script in another checkout's process (--measure): this folder is on sys.path
    import checkouts
from torch import nn


class ConvBN(nn.Module):
    """Six Conv-BatchNorm-ReLU blocks (two strided), global pooling and a linear head; the batch norms hold
    trained-looking statistics, not the identity."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for i in range(6):
            layers += [nn.Conv2d(channels, width, 3, stride=2 if i in (1, 3) else 1, padding=1, bias=False),
                       nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)
        for norm in self.body:
            if isinstance(norm, nn.BatchNorm2d):
                generator = torch.Generator().manual_seed(norm.num_features)
                norm.running_mean.uniform_(-0.5, 0.5, generator=generator)
                norm.running_var.uniform_(0.5, 2.0, generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).mean((2, 3)))


def seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` in eval mode, its weights drawn from seed 0 (the caller's random state untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().eval()


def bert(layers: int, hidden: int) -> tuple[nn.Module, Callable[[int], tuple]]:
    """A random-weight BERT (vocabulary 1000, heads of 64) and its feeds: seed -> (1x64 token ids,)."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                        intermediate_size=4 * hidden, attn_implementation="sdpa")
    ids = lambda seed: (torch.randint(1, 1000, (1, 64), generator=torch.Generator().manual_seed(seed)),)  # noqa: E731
    return seeded(lambda: BertModel(config)), ids


def vit() -> tuple[nn.Module, Callable[[int], tuple]]:
    """A random-weight ViT-Base/16 with 4 layers and its feeds: seed -> (1x3x224x224 image,)."""
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(num_hidden_layers=4, attn_implementation="sdpa")
    return seeded(lambda: ViTModel(config)), images(224)


def images(side: int) -> Callable[[int], tuple]:
    """seed -> (one random 3-channel image of ``side`` x ``side``,)."""
    return lambda seed: (torch.randn(1, 3, side, side, generator=torch.Generator().manual_seed(seed)),)


# name -> (builder, exporter: "dynamo" or "torchscript")
MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, Callable[[int], tuple]]], str]] = {
    "BERT 4 layers (dynamo)": (lambda: bert(4, 256), "dynamo"),
    "ViT-Base/16 4 layers (dynamo)": (vit, "dynamo"),
    "6 Conv-BN-ReLU blocks (BN unfolded)": (lambda: (seeded(ConvBN), images(64)), "torchscript"),
    "BERT-base (dynamo)": (lambda: bert(12, 768), "dynamo"),
}
QUICK = ("6 Conv-BN-ReLU blocks (BN unfolded)",)  # without --full


def _export(model: nn.Module, args: tuple, exporter: str, path: str) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":
            torch.onnx.export(model, args, path, dynamo=True, verbose=False)
        else:
            torch.onnx.export(model, args, path, dynamo=False, do_constant_folding=False, input_names=["x"])


def measure(name: str) -> dict[str, Any]:
    """One row for the amppass this process imports."""
    import onnx
    import onnxruntime as ort

    import amppass
    from amppass.onnx.simulate import simulated

    build, exporter = MODELS[name]
    model, inputs = build()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "m.onnx")
        _export(model, inputs(0), exporter, path)
        fp32 = onnx.load(path)
    converted = amppass.convert_onnx(fp32, "fp16")
    fx = amppass.convert(model, inputs(0), torch.float16, plan_for="coverage")
    rows = [r for r in amppass.report(converted).rows if r.precision != "-"]

    def run(m: onnx.ModelProto) -> list[np.ndarray]:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        feed = {i.name: t.numpy() for i, t in zip(m.graph.input, inputs(7), strict=False)}
        return session.run(None, feed)

    def error(got: list[np.ndarray]) -> float:
        return max(float(np.linalg.norm(g.astype(np.float64) - w) / np.linalg.norm(w))
                   for g, w in zip(got, want, strict=False) if np.issubdtype(w.dtype, np.floating))

    want = [w.astype(np.float64) if np.issubdtype(w.dtype, np.floating) else w for w in run(fp32)]
    cast_count = lambda m: sum(n.op_type == "Cast" for n in m.graph.node)  # noqa: E731
    return {
        "model": name,
        "casts_onnx": cast_count(converted) - cast_count(fp32),
        "casts_fx": fx.meta["amppass"]["casts"],
        "float_low": f"{sum(r.precision == 'fp16' for r in rows)}/{len(rows)}",
        "err_runtime": f"{error(run(converted)):.2e}",
        "err_simulated": f"{error(run(simulated(converted))):.2e}",
    }


def run(full: bool, roots: list[Path] | None = None) -> list[dict[str, Any]]:
    """One row per model and checkout (default: this checkout, in this process)."""
    names = list(MODELS) if full else list(QUICK)
    return checkouts.run(str(Path(__file__)), measure, names, roots)


def main() -> None:
    checkouts.main(__doc__.splitlines()[0], measure, run, "every model, not the Conv-BN net alone")


if __name__ == "__main__":
    main()
