"""Quick start: convert a model from the bundled zoo for this machine, print what amppass decided and how
fast and how close to fp32 the result is, against fp32 and torch.autocast on the same inputs.

``--size base`` (the default) is BERT-base and its kin: where mixed precision pays on a CPU. ``--size small``
models are so small that amppass may keep them in fp32 (a converted graph is not faster there), and says so.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import amppass
from models import SIZES, ZOO, build


def _median_ms(call, repeats: int = 15) -> float:
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bert", choices=ZOO)
    parser.add_argument("--size", default="base", choices=SIZES)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--rows", type=int, default=25, help="decision rows to print (the summary comes first)")
    args = parser.parse_args()

    case = build(args.model, size=args.size, batch=1, seq=16)
    start = time.perf_counter()
    fast = amppass.convert(case.model, case.example_inputs, dtype=args.dtype)
    converted_s = time.perf_counter() - start
    inputs = case.make_inputs(1)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]

    def autocast():
        with torch.autocast("cpu", dtype=low):
            return case.model(*inputs)

    with torch.inference_mode():
        ref, out = case.model(*inputs), fast(*inputs)
        times = {name: _median_ms(call) for name, call in
                 (("fp32", lambda: case.model(*inputs)), ("autocast", autocast), ("amppass", lambda: fast(*inputs)))}
    ref, out = (ref if isinstance(ref, torch.Tensor) else ref[0]), (out if isinstance(out, torch.Tensor) else out[0])
    from amppass.reporting.terminal import render_text

    print(render_text(amppass.report(fast), max_rows=args.rows))
    print(f"converted in {converted_s:.1f} s; output relative error against fp32: "
          f"{float((out - ref).norm() / ref.norm()):.2e}")
    print("latency (median ms): " + ", ".join(f"{name} {ms:.2f}" for name, ms in times.items()))


if __name__ == "__main__":
    main()
