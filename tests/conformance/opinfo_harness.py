"""Run PyTorch's own op database through amppass: build, convert, run and judge one OpInfo sample.

Each case is one op applied to one sample input from ``op_db`` (or one entry of autocast's CPU test
lists), wrapped in a module whose forward takes the sample's tensors and passes every other argument as
it is. Two feeds:

- ``"fp32"``: the sample's tensors as they are.
- ``"low"``: each float32 input first goes through ``x @ eye(n)``, which any plan runs in the low dtype,
  so the op reads a low-precision value as it does inside a real network. ``x @ eye(n)`` in the low dtype
  is ``x`` rounded to it, exactly; the fp32 reference is therefore the same module fed the rounded inputs,
  and the error measured is the op's own.

Outcomes: "correct" (every output within the bound), "wrong" (beyond it), "refused" (an
``AmpPassError`` from ``amppass.convert``), "convert-crash" (any other exception from it), "crash" (the
converted module fails when called), "skipped" (the fp32 module itself fails on the sample).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

import amppass
from amppass.dtypes import low_type
from amppass.errors import first_line

FEEDS = ("fp32", "low")
SAMPLES = 2  # the first samples of each OpInfo entry
SEED = 0  # set before each run of a case, so random ops draw the same numbers in each


@dataclass
class Case:
    """One op on one sample: ``fn(*args, **kwargs)`` with the sample's values."""

    key: str  # "opinfo:<name>[.<variant>]#<sample>" or "autocast:<list>:<op>"
    op: str  # the name expectations are matched on: OpInfo name (with variant) or autocast op
    fn: Callable[..., Any]
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass
class Outcome:
    """What happened to one case for one dtype and feed."""

    outcome: str
    error: float = 0.0  # largest relative L2 error over the float outputs
    autocast_error: float | None = None
    detail: str = ""
    same_structure: bool = False  # outputs of the reference's types, shapes and dtypes (values aside)


def opinfo_cases(names: set[str] | None = None, samples: int = SAMPLES) -> Iterator[Case]:
    """The first ``samples`` samples of every OpInfo entry that supports float32 on the CPU (or of the
    entries whose full name is in ``names``)."""
    from torch.testing._internal.common_methods_invocations import op_db

    for info in op_db:
        name = info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")
        if names is not None and name not in names:
            continue
        if torch.float32 not in info.supported_dtypes("cpu"):
            continue
        torch.manual_seed(0)
        try:
            found = list(_first(info.sample_inputs("cpu", torch.float32), samples))
        except Exception:  # noqa: BLE001 - an entry whose samples this torch cannot build has nothing to run
            continue
        for index, sample in enumerate(found):
            yield Case(f"opinfo:{name}#{index}", name, info.op, (sample.input, *sample.args), dict(sample.kwargs))


def autocast_cases(names: set[str] | None = None) -> Iterator[Case]:
    """Every entry of ``torch.testing._internal.autocast_test_lists.AutocastCPUTestLists``; the low-precision
    tensors of its fp32 lists (there to check that autocast casts them up) as the fp32 ones a model has."""
    from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists

    torch.manual_seed(0)
    lists = AutocastCPUTestLists(torch.device("cpu"))
    for list_name, entries in vars(lists).items():
        if not isinstance(entries, list):
            continue
        for entry in entries:
            op, args = entry[0], entry[1]
            if names is not None and op not in names:
                continue
            module = torch._C._nn if list_name.startswith("nn") else (torch.Tensor if list_name.startswith(
                "methods") else torch)
            fn = getattr(module, op)
            kwargs = entry[2] if len(entry) > 2 and isinstance(entry[2], dict) else {}  # else: the dtype expected
            if list_name.endswith("fp32"):  # bf16 tensors, to see autocast cast them up: an fp32 model has fp32
                args, kwargs = pytree.tree_map(_as_fp32, (tuple(args), kwargs))
            yield Case(f"autocast:{list_name}:{op}", op, fn, tuple(args), dict(kwargs))


def _as_fp32(value: Any) -> Any:
    return value.float() if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16) \
        else value


def _first(iterable: Any, count: int) -> Iterator[Any]:
    for index, item in enumerate(iterable):
        if index >= count:
            return
        yield item


class OpModule(nn.Module):
    """``fn`` applied to a sample: tensors come in as inputs, everything else is fixed at construction.
    With ``through_eye`` each float32 input is first multiplied by an identity matrix (module docstring)."""

    def __init__(self, case: Case, through_eye: bool):
        super().__init__()
        leaves, self.spec = pytree.tree_flatten((case.args, case.kwargs))
        self.fn = case.fn
        self.slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.fixed = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.eyed = []
        for slot in self.slots:
            tensor = leaves[slot]
            eyed = through_eye and tensor.dtype == torch.float32
            self.eyed.append(eyed)
            if eyed:
                n = tensor.shape[-1] if tensor.dim() else 1
                self.register_buffer(f"eye{slot}", torch.eye(n))

    def inputs(self, case: Case) -> tuple:
        leaves, _ = pytree.tree_flatten((case.args, case.kwargs))
        return tuple(leaves[i].detach().clone() for i in self.slots)

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self.fixed)
        for slot, eyed, tensor in zip(self.slots, self.eyed, tensors, strict=False):
            if eyed:
                eye = getattr(self, f"eye{slot}")
                tensor = (tensor.reshape(1) @ eye).reshape(()) if tensor.dim() == 0 else tensor @ eye
            leaves[slot] = tensor
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.fn(*args, **kwargs)


def named_module(case: Case, through_eye: bool) -> OpModule:
    """An :class:`OpModule` whose class is named after the op, as a user's module names what it does."""
    cls = type("Op_" + "".join(c if c.isalnum() else "_" for c in case.op), (OpModule,), {})
    return cls(case, through_eye).eval()


def rounded(inputs: tuple, dtype: torch.dtype) -> tuple:
    """The inputs as a low-precision ``x @ eye`` hands them on: float32 tensors rounded to ``dtype``."""
    return tuple(t.to(dtype).float() if t.dtype == torch.float32 else t for t in inputs)


def relative_error(out: Any, ref: Any) -> float:
    """The largest ``||out - ref|| / ||ref||`` over the float tensors of two outputs (finite entries; a
    non-finite entry or an exact value that differs counts as infinite error)."""
    outs, ref_spec = pytree.tree_flatten(_sizes_as_tuples(out))
    refs, spec = pytree.tree_flatten(_sizes_as_tuples(ref))
    if ref_spec != spec or len(outs) != len(refs):
        return math.inf
    worst = 0.0
    for got, want in zip(outs, refs, strict=False):
        worst = max(worst, _leaf_error(got, want))
    return worst


def _leaf_error(got: Any, want: Any) -> float:
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype \
                or got.layout != want.layout:
            return math.inf
        if want.layout != torch.strided:  # a sparse result: compared as the dense tensor it stands for
            got, want = got.to_dense(), want.to_dense()
        if not (want.is_floating_point() or want.is_complex()):
            return 0.0 if torch.equal(got, want) else math.inf
        got, want = got.detach().to(torch.complex128 if want.is_complex() else torch.float64), \
            want.detach().to(torch.complex128 if want.is_complex() else torch.float64)
        finite = torch.isfinite(want)
        if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].nan_to_num(),
                                                                            want[~finite].nan_to_num()):
            return math.inf
        diff, scale = float(torch.linalg.vector_norm(got[finite] - want[finite])), \
            float(torch.linalg.vector_norm(want[finite]))
        return diff / scale if scale > 0 else diff
    if isinstance(want, float):
        if not isinstance(got, (int, float)):
            return math.inf
        if math.isnan(want):
            return 0.0 if math.isnan(got) else math.inf
        return abs(got - want) / abs(want) if want else abs(got - want)
    return 0.0 if got == want else math.inf


def run_case(case: Case, dtype: str, feed: str, bound: float, with_autocast: bool = False) -> Outcome:
    """Convert ``case`` for ``dtype`` with ``plan_for="coverage"``, run it and judge it against fp32."""
    low = low_type(dtype).torch
    module = named_module(case, through_eye=feed == "low")
    inputs = module.inputs(case)
    reference_inputs = rounded(inputs, low) if feed == "low" else inputs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.no_grad():
                torch.manual_seed(SEED)
                reference = module(*reference_inputs)
        except Exception as err:  # noqa: BLE001 - a sample the wrapped op itself rejects
            return Outcome("skipped", detail=first_line(err, 300))
        try:
            converted = amppass.convert(module, inputs, dtype=dtype, plan_for="coverage")
        except amppass.AmpPassError as err:
            return Outcome("refused", detail=f"{type(err).__name__}: {first_line(err, 300)}")
        except Exception as err:  # noqa: BLE001 - what the suite is here to find
            return Outcome("convert-crash", detail=f"{type(err).__name__}: {first_line(err, 300)}")
        try:
            with torch.no_grad():
                torch.manual_seed(SEED)
                out = converted(*inputs)
        except Exception as err:  # noqa: BLE001 - what the suite is here to find
            return Outcome("crash", detail=f"{type(err).__name__}: {first_line(err, 300)}")
        error = relative_error(out, reference)
        autocast = _autocast_error(module, inputs, reference, low) if with_autocast or error > bound else None
    return Outcome("correct" if error <= bound else "wrong", error, autocast,
                   same_structure=_structure(out) == _structure(reference))


def _structure(value: Any) -> Any:
    """Types, shapes and dtypes of an output, values aside (a torch.Size reads as the tuple export returns)."""
    leaves, spec = pytree.tree_flatten(_sizes_as_tuples(value))
    return str(spec), [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__ for t in leaves]


def _sizes_as_tuples(value: Any) -> Any:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_sizes_as_tuples(v) for v in value)
    return value


def _autocast_error(module: nn.Module, inputs: tuple, reference: Any, low: torch.dtype) -> float | None:
    """torch.autocast's error on the same module and inputs (None where autocast fails)."""
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=low):
            torch.manual_seed(SEED)
            out = module(*inputs)
    except Exception:  # noqa: BLE001 - autocast crashing on an op is a fact, not a harness failure
        return None
    out = pytree.tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == low else t, out)
    out = pytree.tree_map(lambda t: t.to(torch.complex64) if isinstance(t, torch.Tensor)
                          and t.dtype == torch.complex32 else t, out)
    return relative_error(out, reference)


def case_names() -> set[str]:
    """The op names cases are matched on, without building any sample."""
    from torch.testing._internal.autocast_test_lists import AutocastCPUTestLists
    from torch.testing._internal.common_methods_invocations import op_db

    lists = AutocastCPUTestLists(torch.device("cpu"))
    return {info.name + (f".{info.variant_test_name}" if info.variant_test_name else "") for info in op_db} | {
        entry[0] for entries in vars(lists).values() if isinstance(entries, list) for entry in entries}


def all_cases(names: set[str] | None = None) -> list[Case]:
    """The OpInfo cases followed by the autocast-list cases."""
    return [*opinfo_cases(names), *autocast_cases(names)]


def main(argv: list[str] | None = None) -> None:
    """Run every case for the dtypes and feeds asked for (bounds from ``opinfo_expected.json``); print the
    outcome counts, write the outcomes."""
    import argparse
    import collections
    import json
    import logging

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp16"])
    parser.add_argument("--feed", nargs="+", default=list(FEEDS))
    parser.add_argument("--op", nargs="*", help="only these ops (OpInfo names, autocast op names)")
    parser.add_argument("--shard", default="0/1", help="i/n: every n-th case from the i-th")
    parser.add_argument("--json", help="write every outcome here")
    options = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    bounds = json.loads(Path(__file__).with_name("opinfo_expected.json").read_text(encoding="utf-8"))["bounds"]
    index, count = (int(p) for p in options.shard.split("/"))
    cases = all_cases(set(options.op) if options.op else None)[index::count]
    results = []
    for dtype in options.dtype:
        for feed in options.feed:
            tally: collections.Counter = collections.Counter()
            for case in cases:
                outcome = run_case(case, dtype, feed, bounds[dtype])
                tally[outcome.outcome] += 1
                results.append({"key": case.key, "op": case.op, "dtype": dtype, "feed": feed, **vars(outcome)})
            print(dtype, feed, dict(sorted(tally.items())), flush=True)
    if options.json:
        with open(options.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)



if __name__ == "__main__":
    main()
