"""The ONNX backend test suite's cases, and how a float16 conversion of one is judged: shared by the
conformance tests (``tests/conformance/test_onnx_backend.py``) and the conformance benchmark
(``benchmarks/onnx_conformance.py``).

The cases come with the ``onnx`` package: every node case of ``onnx.backend.test.case.node.collect_testcases``
(one op, its inputs and expected outputs) and the models of ``onnx/backend/test/data/{pytorch-converted,
pytorch-operator,simple,light}`` (``test_data_set_*`` protobufs; the ``light_*`` nets ship an expected output and
are fed the inputs onnx's own runner makes for them). A case is used when one of its inputs is a float32
tensor (or a sequence of them) and onnxruntime's CPU provider runs the float32 model and reproduces the
expected outputs (``rtol``/``atol`` of the case); the others say nothing about a float16 converter.

Each converted model gets one outcome (:data:`OUTCOMES`): it passes ``onnx.checker.check_model(full_check=True)``
and loads in onnxruntime (else ``invalid``), runs (else ``run failure``), and its outputs are within the bound
(else ``wrong``): floating outputs by ``||out - expected|| / ||expected||`` over their finite values, with NaN and
infinities where the expected output has them; integer and boolean outputs equal. A converter that raises
gives ``refused`` when the exception is amppass's :class:`~amppass.AmpPassError` (a message naming the cause) and
``crash`` otherwise.

The configurations (:data:`CONFIGS`):

- ``default``: ``convert_onnx(model)``, fp16 for onnxruntime's CPU provider.
- ``force_low``: ``force_low=`` every op type of the model (subgraphs included): the rewrite at its widest.
- ``low_input``: the default plan on the model with each float32 input of rank >= 1 passed through an
  ``Identity`` forced to fp16 first, so the op reads a low-precision value, as it does inside a network
  (a case without such an input is converted as in ``default``).
  Rounding the input to fp16 can move the op's result by itself (10001 and 10000 are one fp16 value), and
  onnxruntime may drop a fp32->fp16->fp32 cast pair; so the output counts as correct when it is within the
  bound of either the expected output or the float32 model's output on the fp16-rounded inputs.
"""

from __future__ import annotations

import functools
import glob
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

import amppass
from amppass.errors import first_line
from amppass.onnx.view import all_nodes

OUTCOMES = ("correct", "refused", "crash", "invalid", "run failure", "wrong")
CONFIGS = ("default", "force_low", "low_input")
FOLDERS = ("pytorch-converted", "pytorch-operator", "simple", "light")
FP16_BOUND = 5e-3  # ||out - expected|| / ||expected||: ten times fp16's unit roundoff (2**-11)
FORCED_BOUND = 2e-2  # the same under force_low= every op, where reductions and normalisations run fp16 too
LOW_INPUT_SUFFIX = "__fp32_input"
LOW_INPUT_NODE = "amppass_conformance_low_input_"


@dataclass(frozen=True)
class Case:
    """One model of the suite with its feeds (graph inputs that are not initializers, in order) and the
    outputs it must give."""

    name: str  # "node/test_abs", "light/light_densenet121", "simple/test_sequence_model1"
    model: onnx.ModelProto
    inputs: tuple
    expected: tuple
    rtol: float = 1e-3
    atol: float = 1e-7


@dataclass(frozen=True)
class Outcome:
    """What became of one converted case: one of :data:`OUTCOMES`, the detail (error message or the
    measured error) and the largest relative error on the outputs (None where nothing ran)."""

    kind: str
    detail: str
    error: float | None = None


def session(model: onnx.ModelProto):
    """A quiet onnxruntime CPU session of ``model``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feed_names(model: onnx.ModelProto) -> list[str]:
    """The graph inputs a caller feeds: those that are not initializers, in order."""
    constants = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in constants]


def _array(value: Any) -> Any:
    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, onnx.SequenceProto):
        return numpy_helper.to_list(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, list):
        return [_array(v) for v in value]
    return value


def _has_float32(value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return value.dtype == np.float32
    return isinstance(value, list) and any(_has_float32(v) for v in value)


def error(got: Any, want: Any) -> float:
    """The relative error of one output (module docstring): 0 for equal values, inf for a wrong shape, dtype
    kind, non-finite pattern or integer value."""
    if isinstance(want, list) or isinstance(got, list):
        if not (isinstance(want, list) and isinstance(got, list)) or len(got) != len(want):
            return float("inf")
        return max((error(g, w) for g, w in zip(got, want, strict=False)), default=0.0)
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf")
    if want.dtype.kind not in "fc":
        return 0.0 if np.array_equal(got, want) else float("inf")
    if got.dtype.kind not in "fc":
        return float("inf")
    got, want = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite], equal_nan=True):
        return float("inf")
    norm = float(np.linalg.norm(want[finite]))
    diff = float(np.linalg.norm(got[finite] - want[finite]))
    return diff / norm if norm > 0 else diff


def worst_error(got: Sequence, want: Sequence) -> float:
    """The largest :func:`error` over the outputs; inf when their numbers differ."""
    if len(got) != len(want):
        return float("inf")
    return max((error(g, w) for g, w in zip(got, want, strict=False)), default=0.0)


def _reproduces(case: Case) -> bool:
    """Whether onnxruntime's CPU provider runs the float32 model and gives the expected outputs."""
    try:
        got = session(case.model).run(None, dict(zip(feed_names(case.model), case.inputs, strict=False)))
    except Exception:  # noqa: BLE001 - an op or opset this onnxruntime lacks: the case says nothing here
        return False
    if len(got) != len(case.expected):
        return False
    for g, w in zip(got, case.expected, strict=False):
        try:
            if isinstance(w, list):
                if len(g) != len(w) or not all(np.allclose(a, b, case.rtol, case.atol, equal_nan=True)
                                               for a, b in zip(g, w, strict=False)):
                    return False
            elif not np.allclose(g, w, case.rtol, case.atol, equal_nan=True):
                return False
        except (TypeError, ValueError):  # strings, mismatched shapes
            return False
    return True


def _usable(case: Case) -> bool:
    return any(_has_float32(x) for x in case.inputs) and _reproduces(case)


@functools.lru_cache(maxsize=None)
def node_cases() -> tuple[Case, ...]:
    """The usable node cases (module docstring), named ``node/<test name>``."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():  # the case generators overflow casts on purpose
        warnings.simplefilter("ignore")
        collected = collect_testcases(None)
    found = []
    for test in collected:
        inputs, expected = test.data_sets[0]
        case = Case(f"node/{test.name}", test.model, tuple(_array(x) for x in inputs),
                    tuple(_array(x) for x in expected), test.rtol, test.atol)
        if _usable(case):
            found.append(case)
    return tuple(found)


def _read(path: str, declared: onnx.TypeProto) -> Any:
    """A test data protobuf, parsed as the type the model declares for it (as onnx's runner does)."""
    with open(path, "rb") as f:
        data = f.read()
    if declared.HasField("sequence_type"):
        sequence = onnx.SequenceProto()
        sequence.ParseFromString(data)
        return numpy_helper.to_list(sequence)
    if not declared.HasField("tensor_type"):
        raise ValueError(f"{path}: only tensors and sequences are read")
    tensor = onnx.TensorProto()
    tensor.ParseFromString(data)
    return numpy_helper.to_array(tensor)


def _numbered(folder: str, prefix: str) -> list[str]:
    paths = glob.glob(os.path.join(folder, f"{prefix}_*.pb"))
    return sorted(paths, key=lambda p: int(os.path.basename(p)[len(prefix) + 1:-3]))


def light_inputs(model: onnx.ModelProto) -> tuple:
    """The inputs onnx's backend runner feeds a light model (its ``generate_dummy_data`` with random=False),
    for which the packaged expected output was computed."""
    made = []
    for name in feed_names(model):
        info = next(i for i in model.graph.input if i.name == name)
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1 for d in info.type.tensor_type.shape.dim)
        n = int(np.prod(shape))
        made.append((np.arange(n).reshape(shape) / n).astype(np.float32))
    return tuple(made)


DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")


def light_case(name: str) -> Case:
    """The light model ``name`` (``light/light_<name>``, e.g. ``squeezenet``) with the inputs onnx's runner feeds it and
    its packaged output, as :func:`folder_cases` reads it."""
    path = os.path.join(DATA, "light", f"light_{name}.onnx")
    model = onnx.load(path)
    expected = (_read(path[:-len(".onnx")] + "_output_0.pb", model.graph.output[0].type),)
    return Case(f"light/light_{name}", model, light_inputs(model), expected, 2e-3, 1e-7)


@functools.lru_cache(maxsize=None)
def folder_cases(folders: tuple[str, ...] = FOLDERS) -> tuple[Case, ...]:
    """The usable models of ``folders`` (every one of :data:`FOLDERS` by default; first test data set), named
    ``<folder>/<model>``."""
    found = []
    for folder in folders:
        if folder == "light":
            for path in sorted(glob.glob(os.path.join(DATA, folder, "*.onnx"))):
                found.append(light_case(os.path.basename(path)[len("light_"):-len(".onnx")]))
            continue
        for directory in sorted(glob.glob(os.path.join(DATA, folder, "*", ""))):
            data = sorted(glob.glob(os.path.join(directory, "test_data_set_*")))
            if not data or not os.path.exists(os.path.join(directory, "model.onnx")):
                continue
            model = onnx.load(os.path.join(directory, "model.onnx"))
            declared = {i.name: i.type for i in model.graph.input}
            try:
                inputs = tuple(
                    _read(p, declared[n]) for p, n in zip(_numbered(data[0], "input"), feed_names(model), strict=False)
                )
                expected = tuple(
                    _read(p, o.type) for p, o in zip(_numbered(data[0], "output"), model.graph.output, strict=False)
                )
            except Exception:  # noqa: BLE001 - a data set of strings or maps: not a float model
                continue
            found.append(Case(f"{folder}/{os.path.basename(directory[:-1])}", model, inputs, expected))
    return tuple(c for c in found if _usable(c))


def all_cases() -> tuple[Case, ...]:
    """Every usable case: node cases, then the folder models."""
    return node_cases() + folder_cases()


def op_types(model: onnx.ModelProto) -> list[str]:
    """Every op type of ``model``, subgraphs included, sorted."""
    return sorted({node.op_type for node in all_nodes(model.graph)})


def low_input(case: Case) -> Case | None:
    """``case`` with each float32 input of rank >= 1 read through an Identity named ``LOW_INPUT_NODE<input>``
    (for ``force_low=[LOW_INPUT_NODE + '.*']``), or None when it has no such input. The feeds keep their
    order; an input is renamed ``<name>LOW_INPUT_SUFFIX`` and the Identity gives the original name back."""
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    wrapped = []
    feeds = feed_names(model)
    for info in model.graph.input:
        if info.name not in feeds:
            continue
        value = case.inputs[feeds.index(info.name)]
        if not (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.ndim >= 1):
            continue
        original = info.name
        info.name = original + LOW_INPUT_SUFFIX
        wrapped.append(helper.make_node("Identity", [info.name], [original], name=LOW_INPUT_NODE + original))
    if not wrapped:
        return None
    for node in reversed(wrapped):
        model.graph.node.insert(0, node)
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):  # an ai.onnx.ml-only model
        model.opset_import.append(helper.make_opsetid("", 13))
    return Case(case.name, model, case.inputs, case.expected, case.rtol, case.atol)


def rounded_reference(case: Case) -> tuple | None:
    """The float32 model's outputs on ``case``'s inputs rounded to fp16 (rank >= 1 float32 inputs only)."""
    inputs = [x.astype(np.float16).astype(np.float32) if isinstance(x, np.ndarray) and x.dtype == np.float32
              and x.ndim >= 1 else x for x in case.inputs]
    try:
        return tuple(session(case.model).run(None, dict(zip(feed_names(case.model), inputs, strict=False))))
    except Exception:  # noqa: BLE001 - the op refuses the rounded values (an infinity, say)
        return None


def amppass_converter(config: str) -> Callable[[Case], tuple[Case, onnx.ModelProto]]:
    """The amppass conversion of one configuration: case -> (the case as converted, the converted model)."""

    def convert(case: Case) -> tuple[Case, onnx.ModelProto]:
        if config == "force_low":
            return case, amppass.convert_onnx(case.model, force_low=op_types(case.model))
        wrapped = low_input(case) if config == "low_input" else None
        if wrapped is not None:
            return wrapped, amppass.convert_onnx(wrapped.model, force_low=[LOW_INPUT_NODE + ".*"])
        return case, amppass.convert_onnx(case.model)

    return convert


def judge(case: Case, converted: onnx.ModelProto, bound: float = FP16_BOUND,
          references: Sequence[Sequence] = ()) -> Outcome:
    """The outcome of ``converted`` (module docstring); ``references`` are output sets also accepted beside
    the expected outputs."""
    try:
        onnx.checker.check_model(converted, full_check=True)
    except Exception as err:  # noqa: BLE001 - the checker's own exception types
        return Outcome("invalid", f"onnx.checker: {first_line(err, 300)}")
    try:
        runner = session(converted)
    except Exception as err:  # noqa: BLE001
        return Outcome("invalid", f"onnxruntime refuses to load it: {first_line(err, 300)}")
    try:
        got = runner.run(None, dict(zip(feed_names(converted), case.inputs, strict=False)))
    except Exception as err:  # noqa: BLE001
        return Outcome("run failure", first_line(err, 300))
    worst = min(worst_error(got, want) for want in (case.expected, *references))
    kind = "correct" if worst <= bound else "wrong"
    return Outcome(kind, f"relative error {worst:.3g} (bound {bound:g})", worst)


def outcome(case: Case, convert: Callable[[Case], tuple[Case, onnx.ModelProto]], bound: float = FP16_BOUND,
            rounded: bool = False) -> Outcome:
    """Convert ``case`` with ``convert`` and judge the result; ``rounded`` also accepts
    :func:`rounded_reference` (the ``low_input`` configuration)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            converted_case, converted = convert(case)
    except amppass.AmpPassError as err:
        return Outcome("refused", f"{type(err).__name__}: {first_line(err, 300)}")
    except Exception as err:  # noqa: BLE001 - what a converter must never do: counted, not hidden
        return Outcome("crash", f"{type(err).__name__}: {first_line(err, 300)}")
    references = [r for r in [rounded_reference(case)] if r is not None] if rounded else []
    return judge(converted_case, converted, bound, references)
