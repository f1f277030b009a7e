"""torch.compile(model, backend="amppass"): the amppass plan on every graph dynamo captures, compiled by inductor.

Installing amppass registers the backend under its name. Dynamo captures and converts on the first call, so
the report is asked for after it; a call of another batch size is served by the same dynamic graph or a
recompile, dynamo's choice.
"""

from __future__ import annotations

import torch

import amppass
from models import build


def main() -> None:
    case = build("mlp", "small")
    compiled = torch.compile(case.model, backend="amppass", options={"dtype": "bf16", "plan_for": "coverage"})
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, case.example_inputs[0].shape[1], generator=torch.Generator().manual_seed(batch))
            want, got = case.model(x), compiled(x)
            error = float((got - want).norm() / want.norm())
            print(f"batch {batch}: output {tuple(got.shape)} {got.dtype}, relative error against fp32 {error:.1e}")
            assert got.dtype == torch.float32 and error < 2e-2
    print(amppass.report(compiled).summary())


if __name__ == "__main__":
    main()
