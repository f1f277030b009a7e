"""What the installed onnxruntime accepts, asked of onnxruntime itself and cached for the process.

Three facts decide whether a converted model loads and runs (CPUExecutionProvider):

1. The highest IR version and opset it loads: found by loading one-node models, newest first.
2. Which ops have a kernel for fp16 / bf16: its kernel registry (``get_registered_ep_kernel_defs``).
3. Whether it runs a low-precision op that has only an fp32 kernel: its graph transformer inserts casts
   around such nodes for fp16 (not for bf16); found by running a one-node fp16/bf16 MatMul. The recurrent
   ops (:data:`NO_CAST_AROUND`) are the exception: a model whose fp16 LSTM or GRU it casts around can crash
   the process that loads it, so they count as having no fp16 kernel.

Without onnxruntime installed every op is allowed and the versions are not capped.
"""

from __future__ import annotations

import functools
import logging
from importlib import metadata

import numpy as np
import onnx
from onnx import TensorProto, helper

log = logging.getLogger(__name__)

PROVIDER = "CPUExecutionProvider"


# the distributions on PyPI that each install the one ``onnxruntime`` package (its folder in site-packages)
BUILDS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn",
          "onnxruntime-training", "ort-nightly", "ort-nightly-gpu")


@functools.lru_cache(maxsize=None)
def installed_builds() -> tuple[str, ...]:
    """The onnxruntime builds installed, as "name version"; where there are two or more, warns once naming them.

    amppass depends on ``onnxruntime``, the CPU build: pip installs it beside an ``onnxruntime-gpu`` that is
    already there (another name to pip), into the same folder, and the build installed last overwrites the
    other's files. Either build runs the CPU provider amppass plans with; which providers the mixed folder has is
    anyone's guess, so it is said at first use, with the fix.
    """
    found = []
    for name in BUILDS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    if len(found) > 1:
        names = " ".join(f.split()[0] for f in found)
        log.warning("onnxruntime: %s are installed into the one `onnxruntime` folder, where the one installed last "
                    "overwrote the other's files; keep one build: `pip uninstall -y %s`, then `pip install "
                    "onnxruntime` (CPU) or `pip install onnxruntime-gpu` (CUDA, which also runs the CPU provider)",
                    " and ".join(found), names)
    return tuple(found)


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    installed_builds()

    options = ort.SessionOptions()
    options.log_severity_level = 4  # probes fail on purpose; keep onnxruntime's own log quiet
    return ort.InferenceSession(model.SerializeToString(), options, providers=[PROVIDER])


def _one_node(op: str, elem_type: int, ir_version: int, opset: int) -> onnx.ModelProto:
    inputs = ["x", "x"] if op == "MatMul" else ["x"]
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"])], "probe",
        [helper.make_tensor_value_info("x", elem_type, [2, 2])],
        [helper.make_tensor_value_info("y", elem_type, [2, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def _loads(model: onnx.ModelProto) -> bool:
    try:
        _session(model)
    except ImportError:
        return True
    except Exception:  # noqa: BLE001 - onnxruntime raises its own exception types for "too new"
        return False
    return True


@functools.lru_cache(maxsize=None)
def max_ir_version() -> int:
    """Highest IR version the installed onnxruntime loads (onnx's own when onnxruntime is absent)."""
    for ir_version in range(onnx.IR_VERSION, 6, -1):
        if _loads(_one_node("Relu", TensorProto.FLOAT, ir_version, 13)):
            return ir_version
    return 7


@functools.lru_cache(maxsize=None)
def max_opset() -> int:
    """Highest default-domain opset the installed onnxruntime loads."""
    for opset in range(onnx.defs.onnx_opset_version(), 12, -1):
        if _loads(_one_node("Relu", TensorProto.FLOAT, min(max_ir_version(), 10), opset)):
            return opset
    return 13


@functools.lru_cache(maxsize=None)
def _kernels() -> dict[tuple[str, str], list[tuple[int, int, frozenset[str]]]]:
    """(domain, op) -> [(since, until, every type the kernel accepts)] for :data:`PROVIDER`."""
    try:
        from onnxruntime.capi import _pybind_state as capi

        defs = capi.get_registered_ep_kernel_defs(PROVIDER)
    except (ImportError, AttributeError, RuntimeError) as err:
        log.info("onnxruntime kernel registry unavailable (%s); kernels are not checked", err)
        return {}
    table: dict[tuple[str, str], list[tuple[int, int, frozenset[str]]]] = {}
    for kernel in defs:
        types = frozenset(t for allowed in kernel.type_constraints.values() for t in allowed)
        since, until = kernel.version_range
        table.setdefault((_domain(kernel.domain), kernel.op_name), []).append((since, until, types))
    return table


# Ops onnxruntime must not be left to cast around. The CPU provider registers LSTM, GRU and RNN for float and
# double only; onnxruntime 1.31.1 segfaults (in its NchwcTransformer, ORT_ENABLE_ALL, the session default) while
# creating a session for a model exported from an nn.LSTM or nn.GRU with the recurrent node in fp16 and the rest
# of the model fp16 around it. A crash cannot be caught, so these ops have no low-precision path: status "none".
NO_CAST_AROUND = frozenset({("", "LSTM"), ("", "GRU"), ("", "RNN")})


@functools.lru_cache(maxsize=None)
def casts_around_fp32_kernels(elem_type: int) -> bool:
    """Whether onnxruntime runs an ``elem_type`` MatMul, which has only fp32 kernels, by casting around it."""
    np_type = {int(TensorProto.FLOAT16): np.float16}.get(elem_type)
    try:
        session = _session(_one_node("MatMul", elem_type, min(max_ir_version(), 10), 17))
        if np_type is not None:
            session.run(None, {"x": np.ones((2, 2), np_type)})
    except ImportError:
        return True
    except Exception:  # noqa: BLE001 - onnxruntime raises its own exception types for "too new"
        return False
    return True


def kernel_status(domain: str, op: str, opset: int, elem_type: int) -> str:
    """How onnxruntime runs ``op`` on ``elem_type`` tensors: "native", "via-fp32", "none" or "unknown".

    "unknown" means the registry is unavailable or holds no kernel of any type for the op (a custom op).
    An op of :data:`NO_CAST_AROUND` without a native kernel is "none", not "via-fp32".
    """
    kernels = _kernels()
    if not kernels:
        return "unknown"
    rows = [(a, b, t) for a, b, t in kernels.get((_domain(domain), op), []) if a <= opset <= b]
    if not rows:
        return "unknown" if (_domain(domain), op) not in kernels else "none"
    name = f"tensor({_TYPE_NAMES[elem_type]})"
    if any(name in types for _, _, types in rows):
        return "native"
    if (any("tensor(float)" in types for _, _, types in rows) and (_domain(domain), op) not in NO_CAST_AROUND
            and casts_around_fp32_kernels(elem_type)):
        return "via-fp32"
    return "none"


_TYPE_NAMES: dict[int, str] = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16",
                               TensorProto.FLOAT: "float"}


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain

