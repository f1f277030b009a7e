"""Static kernel tables (amppass.targets): their facts, the loader, the parser that makes them, and
agreement with the live onnxruntime registries (CPU here; CUDA only where a CUDA session starts)."""

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto

from amppass import InputError
from amppass.targets import KernelTable, load, onnx_kernel_tables
from tests.helpers.paths import ROOT

DATA = ROOT / "amppass" / "targets" / "data"
FP16, BF16, FP32 = TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT
CURRENT = onnx.defs.onnx_opset_version()  # the newest opset the installed onnx writes


def _script():
    spec = importlib.util.spec_from_file_location("kernel_tables", ROOT / "scripts" / "kernel_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- facts ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["MatMul", "Gemm"])
@pytest.mark.parametrize("elem_type", [FP16, BF16])
def test_cuda_matrix_multiply_is_native_in_fp16_and_bf16(op, elem_type):
    cuda = load("onnxruntime-cuda")
    for opset in (13, 17, CURRENT):
        assert cuda.status("", op, opset, elem_type) == "native"


@pytest.mark.parametrize("op, opset", [("LayerNormalization", 17), ("Softmax", 13), ("Conv", 11), ("Conv", CURRENT)])
def test_cuda_fp16_kernels(op, opset):
    assert load("onnxruntime-cuda").status("ai.onnx", op, opset, FP16) == "native"


def test_cuda_bf16_conv_only_from_opset_22():
    # onnxruntime registers its bf16 CUDA Conv with the opset-22 kernel only: a model exported at opset 17
    # has fp16 Conv kernels on CUDA but no bf16 one
    cuda = load("onnxruntime-cuda")
    assert [cuda.status("", "Conv", opset, BF16) for opset in (11, 17, 21, 22, CURRENT)] == \
        ["none", "none", "none", "native", "native"]


@pytest.mark.parametrize("domain, op, opset, elem_type", [
    ("", "ConvTranspose", CURRENT, BF16),
    ("", "LogSoftmax", 13, BF16),
    ("", "ReduceMean", 18, BF16),
    ("", "GridSample", CURRENT, FP16),
    ("com.microsoft", "FusedConv", 1, FP16),
])
def test_cuda_lacks(domain, op, opset, elem_type):
    assert load("onnxruntime-cuda").status(domain, op, opset, elem_type) == "none"


def test_cuda_and_cpu_differ_where_expected():
    cpu, cuda = load("onnxruntime-cpu"), load("onnxruntime-cuda")
    for op in ("Conv", "Softmax", "Erf"):
        assert cpu.status("", op, 13, FP16) == "none" and cuda.status("", op, 13, FP16) == "native"
    assert cpu.status("", "LayerNormalization", 17, BF16) == "none"
    assert cuda.status("", "LayerNormalization", 17, BF16) == "native"


def test_tensorrt_facts():
    trt = load("tensorrt")
    for op in ("Conv", "MatMul", "Gemm", "ConvTranspose", "LayerNormalization"):
        assert trt.status("", op, 17, FP16) == "native" and trt.status("", op, 17, BF16) == "native"
    assert trt.status("", "GridSample", 17, FP16) == "native"
    assert trt.status("", "GridSample", 17, BF16) == "none"  # FP32 and FP16 only in the matrix
    assert trt.status("", "Unique", 17, FP32) == "none"  # listed as unsupported
    assert trt.status("com.microsoft", "FusedMatMul", 1, FP16) == "unknown"  # contrib ops are not TensorRT's
    data = json.loads((DATA / "tensorrt.json").read_text())
    assert "Conv" in data["fp16_native"] and "MatMul" in data["bf16_native"]
    assert "Unique" in data["unsupported"]


# -- loader -----------------------------------------------------------------------------------------------

def test_loader_semantics():
    cuda = load("onnxruntime-cuda")
    assert load("onnxruntime-cuda") is cuda  # cached
    assert isinstance(cuda, KernelTable) and cuda.provider == "CUDAExecutionProvider"
    assert cuda.status("ai.onnx", "MatMul", 13, FP16) == cuda.status("", "MatMul", 13, FP16) == "native"
    assert cuda.status("", "Gemm", 6, FP32) == "none"  # the op is known, but no kernel covers opset 6
    assert cuda.status("custom.domain", "MyOp", 1, FP16) == "unknown"
    assert cuda.status("", "MyOp", 13, FP16) == "unknown"
    assert ("", "MatMul") in cuda.ops() and ("com.microsoft", "FusedMatMul") in cuda.ops()
    assert list(cuda.ops()) == sorted(cuda.ops())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cuda.provider = "x"


def test_loader_errors():
    with pytest.raises(InputError, match="onnxruntime-cpu, onnxruntime-cuda, tensorrt"):
        load("cuda")
    with pytest.raises(InputError, match="float types only"):
        load("tensorrt").status("", "Conv", 17, TensorProto.INT64)


# -- the files --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(onnx_kernel_tables.TABLES))
def test_files_are_valid_sorted_and_name_their_source(name):
    text = (DATA / onnx_kernel_tables.TABLES[name]).read_text()
    data = json.loads(text)
    source = data["source"]
    assert source["repo"] in ("microsoft/onnxruntime", "onnx/onnx-tensorrt")
    assert source["file"] in ("docs/OperatorKernels.md", "docs/operators.md") and source["version"]
    assert re.fullmatch(r"[0-9a-f]{40}", source["commit"]) and re.fullmatch(r"\d{4}-\d\d-\d\d", source["date"])
    assert list(data["ops"]) == sorted(data["ops"])
    for domain, ops in data["ops"].items():
        assert ops and list(ops) == sorted(ops), domain
        for op, spans in ops.items():
            # spans may overlap: onnxruntime registers CUDA ThresholdedRelu as both 1+ and 10+
            assert spans == sorted(spans) and len({(a, b) for a, b, _ in spans}) == len(spans), op
            for since, until, types in spans:
                assert 1 <= since <= until and types == sorted(set(types))
                assert set(types) <= {"float", "float16", "bfloat16", "double"}
    assert text == _script().dumps(data), "not in the generator's canonical form"


def test_tensorrt_lists_match_its_ops():
    data = json.loads((DATA / "tensorrt.json").read_text())
    ops = data["ops"]["ai.onnx"]
    assert data["fp16_native"] == sorted(op for op, spans in ops.items() if "float16" in spans[0][2])
    assert data["bf16_native"] == sorted(op for op, spans in ops.items() if "bfloat16" in spans[0][2])
    assert all(ops[op] == [[1, 2147483647, []]] for op in data["unsupported"])


# -- the parser -------------------------------------------------------------------------------------------

_ORT_DOC = """\
## Operators implemented by CPUExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|Relu|*in* X:**T**<br> *out* Y:**T**|14+|**T** = tensor(bfloat16), tensor(float), tensor(int8)|
|||13|**T** = tensor(float)|
|||[6, 12]|**T** = tensor(double), tensor(float)|
|SequenceAt|*in* S:**S**<br> *out* T:**T**|11+|**S** = seq(tensor(float16))<br/> **T** = tensor(int64)|
| |
| |
|**Operator Domain:** *com.microsoft*||||
|Gelu|*in* X:**T**<br> *out* Y:**T**|1+|**T** = tensor(float), tensor(float16)|

<a name="cudaexecutionprovider"/>

## Operators implemented by CUDAExecutionProvider

| Op Name | Parameters | OpSet Version | Types Supported |
|---------|------------|---------------|-----------------|
|**Operator Domain:** *ai.onnx*||||
|Relu|*in* X:**T**<br> *out* Y:**T**|14+|**T** = tensor(float16)|
"""


def test_parser_reads_spans_domains_and_plain_tensor_types():
    script = _script()
    cpu = script.parse_onnxruntime(_ORT_DOC, "CPUExecutionProvider")
    assert cpu == {
        "ai.onnx": {
            "Relu": [[6, 12, ["double", "float"]], [13, 13, ["float"]], [14, 2147483647, ["bfloat16", "float"]]],
            "SequenceAt": [[11, 2147483647, []]],  # seq(tensor(float16)) is a sequence, not a float16 tensor
        },
        "com.microsoft": {"Gelu": [[1, 2147483647, ["float", "float16"]]]},
    }
    assert script.parse_onnxruntime(_ORT_DOC, "CUDAExecutionProvider") == \
        {"ai.onnx": {"Relu": [[14, 2147483647, ["float16"]]]}}


@pytest.mark.parametrize("line, message", [
    ("|Relu|*in* X:**T**|14-|**T** = tensor(float)|", "opset cell"),
    ("|Relu|*in* X:**T**|14+|tensor(float)|", "type constraint"),
    ("|Relu|14+|**T** = tensor(float)|", "expected 4 cells"),
])
def test_parser_refuses_lines_it_does_not_understand(line, message):
    script = _script()
    doc = _ORT_DOC.replace("|||13|**T** = tensor(float)|", line)
    with pytest.raises(script.ParseError, match=message):
        script.parse_onnxruntime(doc, "CPUExecutionProvider")


def test_tensorrt_parser():
    doc = """\
## Operator Support Matrix

| Operator                  | Supported  | Supported Types | Restrictions |
|---------------------------|------------|-----------------|--------------|
| Conv                      | Y          | FP32, FP16, BF16 |
| NonZero                   | Y          | FP32, FP16
| Selu                      | Y          | FP32, FP16, BF16, |
| Cast                      | Y          | FP32, INT64, BOOL | note |
| Bernoulli                 | N          |
"""
    rows, unsupported = _script().parse_tensorrt(doc)
    assert rows == {"ai.onnx": {
        "Bernoulli": [[1, 2147483647, []]],
        "Cast": [[1, 2147483647, ["float"]]],
        "Conv": [[1, 2147483647, ["bfloat16", "float", "float16"]]],
        "NonZero": [[1, 2147483647, ["float", "float16"]]],
        "Selu": [[1, 2147483647, ["bfloat16", "float", "float16"]]],
    }}
    assert unsupported == ["Bernoulli"]


# -- live registries --------------------------------------------------------------------------------------

def _float_spans(kernel_defs) -> dict[tuple[str, str], dict[tuple[int, int], set[str]]]:
    """(domain, op) -> {(since, until): float types} from onnxruntime's registry, kernels of a span merged."""
    spans: dict[tuple[str, str], dict[tuple[int, int], set[str]]] = {}
    for domain, op, (since, until), types in kernel_defs:
        floats = {t[len("tensor("):-1] for t in types} & set(onnx_kernel_tables.TYPE_NAMES.values())
        spans.setdefault((domain, op), {}).setdefault((since, until), set()).update(floats)
    return spans


def _table_spans(table: KernelTable) -> dict[tuple[str, str], dict[tuple[int, int], set[str]]]:
    return {key: {(a, b): set(types) for a, b, types in spans} for key, spans in table.spans.items()}


# The CPU table is read from onnxruntime's main branch of 2026-08-18 (1.30.0-dev), the newest copy of
# OperatorKernels.md that could be had; the installed runtime is 1.31.1. Ops present in both agree on every
# opset span and float type except these, each a change between the two versions:
# (float types only in the document, float types only in the runtime).
CPU_DIFFERENCES_1_31_1 = {
    # fp16 CPU MatMul/Gemm kernels were registered on main by PR #29709 (2026-07-28, MLAS/KleidiAI
    # half-precision GEMM); the 1.31.1 wheel registers none
    ("", "MatMul"): ({"float16"}, set()),
    ("", "Gemm"): ({"float16"}, set()),
    # bf16 layer-norm kernels came after the document
    ("", "LayerNormalization"): (set(), {"bfloat16"}),
    ("", "SimplifiedLayerNormalization"): (set(), {"bfloat16"}),
    ("com.microsoft", "SkipLayerNormalization"): (set(), {"bfloat16"}),
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): (set(), {"bfloat16"}),
}


def test_static_cpu_table_matches_the_live_cpu_registry():
    ort = pytest.importorskip("onnxruntime")
    if ort.__version__ != "1.31.1":
        pytest.skip(f"the allowed differences were established against onnxruntime 1.31.1, not {ort.__version__}")
    from onnxruntime.capi import _pybind_state as capi

    live = _float_spans(
        (k.domain, k.op_name, tuple(k.version_range), [t for ts in k.type_constraints.values() for t in ts])
        for k in capi.get_registered_ep_kernel_defs("CPUExecutionProvider")
    )
    static = _table_spans(load("onnxruntime-cpu"))
    assert not set(static) - set(live), "ops the document lists that the runtime has no kernel for"
    differences = {}
    for key in set(static) & set(live):
        assert set(static[key]) == set(live[key]), f"{key}: opset spans differ"
        doc_only = set().union(*(static[key][span] - live[key][span] for span in static[key]))
        live_only = set().union(*(live[key][span] - static[key][span] for span in static[key]))
        if doc_only or live_only:
            differences[key] = (doc_only, live_only)
    assert differences == CPU_DIFFERENCES_1_31_1


_CUDA_PROBE = r"""
import json, sys
import onnxruntime as ort
from onnx import TensorProto, helper

graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
model.ir_version = 8
options = ort.SessionOptions()
options.log_severity_level = 4
try:
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CUDAExecutionProvider"])
except Exception as err:
    print("no CUDA session:", err)
    sys.exit(0)
if "CUDAExecutionProvider" not in session.get_providers():
    print("no CUDA session: providers", session.get_providers())
    sys.exit(0)
print("CUDA session started", flush=True)
from onnxruntime.capi import _pybind_state as capi
defs = capi.get_registered_ep_kernel_defs("CUDAExecutionProvider")
print(json.dumps([[k.domain, k.op_name, list(k.version_range), [t for ts in k.type_constraints.values() for t in ts]]
                  for k in defs]))
"""


def test_static_cuda_table_against_the_live_cuda_registry():
    # a subprocess: loading the CUDA provider where its libraries are missing can take the process down;
    # the all-provider kernel listing is never called for the same reason
    pytest.importorskip("onnxruntime")
    try:
        run = subprocess.run([sys.executable, "-c", _CUDA_PROBE], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("the CUDA probe did not finish in 300 s")
    lines = run.stdout.splitlines()
    if "CUDA session started" not in lines:
        pytest.skip(f"no CUDA session here ({(lines or [run.stderr.strip()[-200:] or 'no output'])[0]})")
    assert run.returncode == 0, f"listing the CUDA kernels failed after the session started:\n{run.stderr[-2000:]}"
    live = _float_spans((domain, op, tuple(span), types) for domain, op, span, types in json.loads(lines[-1]))
    static = _table_spans(load("onnxruntime-cuda"))
    # the table must never claim a kernel the runtime lacks (a plan would lower a node nothing runs);
    # kernels the runtime gained after the document only make the table conservative
    bounds = [n for spans in (*static.values(), *live.values()) for span in spans for n in span if n < 2**31 - 1]
    top = max(bounds) + 1  # open spans are compared up to one past the newest opset either side names
    claims = []
    for key in set(static) & set(live):
        for (since, until), types in static[key].items():
            for opset in range(since, min(until, top) + 1):
                has = set().union(*(t for (a, b), t in live[key].items() if a <= opset <= b))
                claims += [(key, opset, t) for t in types - has]
    assert not claims, f"the static CUDA table claims kernels the live registry lacks: {sorted(claims)[:40]}"
