"""Quick start: convert a model from the bundled zoo and print what amppass decided, node by node."""

from __future__ import annotations

import argparse

import torch

import amppass
from models import ZOO, build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="bert", choices=ZOO)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args()

    case = build(args.model)
    fast = amppass.convert(case.model, case.example_inputs, dtype=args.dtype)
    inputs = case.make_inputs(1)
    with torch.no_grad():
        ref, out = case.model(*inputs), fast(*inputs)
    ref, out = (ref if isinstance(ref, torch.Tensor) else ref[0]), (out if isinstance(out, torch.Tensor) else out[0])
    report = amppass.report(fast)
    print(report.table())
    print()
    print(report.summary())
    print(f"output relative error against fp32: {float((out - ref).norm() / ref.norm()):.2e}")


if __name__ == "__main__":
    main()
