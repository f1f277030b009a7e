"""The checks every fuzzed program's conversion must pass, for both front ends (tests/guarantees/test_fuzz_*.py).

Tolerances: the norm-relative error of each output, where fp32 is finite, within 3e-2 (fp16) and 6e-2 (bf16);
test_fuzz_onnx.py's docstring gives the reasoning.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import amppass
from amppass.analysis.record import META_KEY
from amppass.pipelines.convert_onnx import missing_low_kernels
from amppass.targets import onnxruntime_facts
from tests.helpers.fuzz_graphs import Program, ProgramModule, relative_error, to_onnx
from tests.helpers.onnx_graphs import meta, session

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


RTOL = {"fp16": 3e-2, "bf16": 6e-2}


def check_fx(program: Program, dtype: str, **options) -> torch.fx.GraphModule:
    """Lints, one cast per (value, dtype), ops forced low run low, the caller's module untouched, outputs
    near fp32 (and fp32 with ``keep_io_types``). ``options`` go to amppass.convert."""
    module = ProgramModule(program).eval()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    example = tuple(torch.from_numpy(x) for x in program.feeds(0))
    fast = amppass.convert(module, example, DTYPES[dtype], **{"plan_for": "coverage", **options})
    fast.graph.lint()
    casts = collections.Counter(
        (n.args[0], n.kwargs.get("dtype")) for n in fast.graph.nodes if n.meta.get(META_KEY, {}).get("cast"))
    assert all(c == 1 for c in casts.values()), f"repeated casts: {[k for k, c in casts.items() if c > 1]}"
    forced = set(options.get("force_low", ())) - set(options.get("keep_fp32", ()))
    for node in fast.graph.nodes:
        decision = node.meta.get(META_KEY, {})
        if decision.get("op") in forced and not decision.get("cast"):
            assert decision["precision"] == "low", (node.name, decision)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items()), "the caller's model changed"
    for seed in (0, 1):
        inputs = tuple(torch.from_numpy(x) for x in program.feeds(seed))
        with torch.no_grad():
            want, got = module(*inputs), fast(*inputs)
        assert len(got) == len(want)
        for i, w, g in zip(program.outputs, want, got, strict=False):
            if options.get("keep_io_types", True):
                assert g.dtype == torch.float32, f"output v{i} is {g.dtype} with keep_io_types"
            err = relative_error(g.float().numpy(), w.numpy())
            assert err <= RTOL[dtype], f"output v{i}: relative error {err:.3g} > {RTOL[dtype]} ({dtype})"
    return fast


def check_onnx(program: Program, dtype: str, **options) -> onnx.ModelProto | None:
    """Valid, loadable by the installed onnxruntime, one Cast per (value, type), ops forced low run low
    (unless onnxruntime has no kernel for them), outputs near fp32. ``options`` go to convert_onnx. None where
    the conversion is refused (:func:`refused`)."""
    model = to_onnx(program)
    onnx.checker.check_model(model, full_check=True)
    if refused(model, dtype, **options):
        return None
    converted = amppass.convert_onnx(model, dtype=dtype, **options)
    onnx.checker.check_model(converted, full_check=True)
    assert converted.ir_version <= onnxruntime_facts.max_ir_version()
    casts = collections.Counter(
        (n.input[0], next(a.i for a in n.attribute if a.name == "to")) for n in converted.graph.node
        if n.op_type == "Cast")
    assert all(c == 1 for c in casts.values()), f"repeated casts: {[k for k, c in casts.items() if c > 1]}"
    forced = set(options.get("force_low", ())) - set(options.get("keep_fp32", ()))
    for node in converted.graph.node:
        decision = meta(node)
        if node.op_type in forced and not decision.get("cast"):
            assert decision["precision"] == "low" or decision["evidence"].get("no_low_kernel"), decision
    ref, low = session(model), converted_session(converted)
    for seed in (0, 1):
        feeds = onnx_feed(program, seed)
        for i, want, got in zip(program.outputs, ref.run(None, feeds), low.run(None, feeds), strict=False):
            if not options.get("keep_io_types", True):
                assert got.dtype in (np.float32, np.float16), got.dtype
                got = got.astype(np.float32)
            err = relative_error(got, want)
            assert err <= RTOL[dtype], f"output v{i}: relative error {err:.3g} > {RTOL[dtype]} ({dtype})"
    return converted


def refused(model: onnx.ModelProto, dtype: str, **options) -> bool:
    """Whether the CPU provider runs none of the model's float32 heavy ops in ``dtype`` (bf16 MatMul, Gemm, Conv);
    if so, check that convert_onnx refuses it, naming the dtype, the target and the fix."""
    if missing_low_kernels(model, "cpu", dtype) is None:
        return False
    with pytest.raises(amppass.InputError, match=f"dtype='{dtype}' with target='cpu': .* no {dtype} kernel for .*"
                       "convert with dtype='fp16'"):
        amppass.convert_onnx(model, dtype=dtype, **options)
    return True


def onnx_feed(program: Program, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    return {f"v{i}": x for i, x in enumerate(program.feeds(seed, scale))}


def converted_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """A session for a converted model, without onnxruntime 1.31's MatmulTransposeFusion: it segfaults on
    Transpose(perm=[1, 0, 2]) -> Cast(to=float) -> MatMul, which a low Transpose read by an fp32 MatMul
    gives (test_fuzz_regressions.py::test_onnxruntime_loads_low_batch_transpose_read_by_fp32_matmul, xfail
    until the converter avoids the pattern); a crash would end the whole fuzz run."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=["MatmulTransposeFusion"])
