"""Every failure a user can cause, one row each: the AmpPassError subclass and a message naming the culprit
and the fix. ``python -m tests.guarantees.test_bad_inputs docs/errors.md`` writes the table users see (docs/errors.md).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import amppass
from amppass import AmpPassError, CalibrationError, CaptureError, InputError, archive
from amppass.errors import ScaleCollapseError, ScalerUsageError, ScalerValueError
from amppass.onnx.io.validate import MAX_NODES
from amppass.serving.fp32_original import keep_original
from amppass.targets import onnxruntime_facts, timing_cache
from tests.helpers.autograd_functions import RoundSTE
from tests.helpers.ddp_harness import one_rank_group
from tests.helpers.onnx_graphs import relu_chain
from tests.helpers.paths import ROOT
from tests.helpers.small_models import X, matmul_model, mlp

F32 = TensorProto.FLOAT


class StraightThrough(torch.nn.Module):
    """A straight-through estimator on the model's own weight: train mode cannot keep the Function's backward in a
    graph, and no submodule holds the weight to convert by parts."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RoundSTE.apply(x @ self.weight * 4)


def _by_parts() -> torch.nn.Module:
    """A layer, then a branch on a size from the data: no single graph takes it, its layer converts alone."""
    class Selecting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            keep = torch.nonzero(self.fc(x)[:, 0] > 0).squeeze(-1)
            return x[keep[:2]] if keep.numel() > 2 else x[keep]

    torch.manual_seed(0)
    return Selecting().eval()


class DataDependent(torch.nn.Module):
    """Python control flow on a tensor's value: neither torch.export nor symbolic tracing can capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


class Viewing(torch.nn.Module):
    """A model whose own code takes 8 values per row (``x.view(2, 8)``)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(2, 8))


def _fx(**kwargs) -> Callable[[Path], object]:
    return lambda tmp: amppass.convert(mlp(), X, "fp16", **kwargs)


def _onnx(model: Callable[[Path], object], **kwargs) -> Callable[[Path], object]:
    return lambda tmp: amppass.convert_onnx(model(tmp), **kwargs)


def _file(name: str, content: bytes | None = None, mode: int | None = None) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        path = tmp / name
        if content is not None:
            path.write_bytes(content)
        if mode is not None:
            os.chmod(path, mode)
        return str(path)
    return make


def _torch_checkpoint(tmp: Path) -> str:
    torch.save(mlp().state_dict(), tmp / "model.pt")
    return str(tmp / "model.pt")


def _unreadable(tmp: Path) -> str:
    """A file that exists but cannot be read: mode 000, or (as root, whom modes do not stop) /proc/self/mem."""
    if os.geteuid() == 0:
        return "/proc/self/mem"
    return _file("locked.onnx", matmul_model().SerializeToString(), 0)(tmp)


def _external(location: str, **fields: str) -> Callable[[Path], str]:
    """matmul_model saved in tmp with W's bytes in an external file named by ``location`` (and ``fields``)."""
    def make(tmp: Path) -> str:
        model = matmul_model()
        weight = model.graph.initializer[0]
        (tmp / "w.data").write_bytes(weight.raw_data)
        weight.ClearField("raw_data")
        weight.data_location = TensorProto.EXTERNAL
        for key, value in {"location": location, "offset": "0", **fields}.items():
            weight.external_data.add(key=key, value=value)
        (tmp / "m.onnx").write_bytes(model.SerializeToString())
        return str(tmp / "m.onnx")
    return make


def _truncated(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-4]
    return model


def _cycle(tmp: Path) -> onnx.ModelProto:
    model = matmul_model()
    model.graph.node[0].input[0] = "y"
    return model


def _forged_report(tmp: Path) -> object:
    model = amppass.convert_onnx(matmul_model())
    next(p for p in model.metadata_props if p.key == "amppass").value = '{"dtype": "fp16", "casts": 1e999}'
    return amppass.report(model)


def _forged_timing(tmp: Path) -> object:
    model = amppass.convert_onnx(matmul_model())
    entry = next(p for p in model.metadata_props if p.key == "amppass")
    entry.value = entry.value[:-1] + ', "profitability": {"nodes_fp32": 1, "timing": {"{dtype:>999999999}": "x"}}}'
    return amppass.report(model)


def _cut_short(tmp: Path) -> str:
    """matmul_model with a 64 KiB weight, saved and cut in half (a copy that stopped early)."""
    model = matmul_model()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.zeros((128, 128), np.float32), "W"))
    data = model.SerializeToString()
    (tmp / "cut.onnx").write_bytes(data[:len(data) // 2])
    return str(tmp / "cut.onnx")


def _deep_report(tmp: Path) -> object:
    model = amppass.convert_onnx(matmul_model())
    entry = next(p for p in model.metadata_props if p.key == "amppass")
    entry.value = entry.value[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    return amppass.report(model)


def _fifo(tmp: Path) -> Path:
    os.mkfifo(tmp / "out.onnx")
    return tmp / "out.onnx"


def _bad_calibration(value: float) -> list[tuple[torch.Tensor]]:
    return [(torch.ones(2, 4),), (torch.full((2, 4), value),)]


def _onnx_calibration(feeds: list[dict]) -> Callable[[Path], object]:
    return _onnx(lambda tmp: matmul_model(), calibration=feeds)


@functools.lru_cache(maxsize=None)
def _saved_pt2() -> Path:
    """A small converted model saved once per process (amppass.save), for the .pt2 cases to edit."""
    from tests.helpers.pt2_files import X as x8
    from tests.helpers.pt2_files import mlp as mlp8

    path = Path(tempfile.mkdtemp(prefix="amppass-bad-inputs-")) / "model.pt2"
    amppass.save(amppass.convert(mlp8(), x8, "bf16", plan_for="coverage"), path)
    return path


def _hostile_pt2(attack: str) -> Callable[[Path], object]:
    """amppass.load of the saved model edited by one of the attacks in tests/helpers/pt2_files.py."""
    def load(tmp: Path) -> object:
        from tests.helpers import pt2_files as attacks

        plan = {"plan-not-json": b"{not json", "plan-bomb": b" " * (archive.MAX_EXTRA + 1)}.get(attack)
        if plan is None:
            edit = {"pickle": attacks.pickled_weight, "sympy": attacks.sympy_code, "aoti": attacks.aoti,
                    "samples": attacks.sample_inputs,
                    "guard": lambda marker: attacks.edit_program(attacks.guard_with_statements(marker)),
                    "range-escape": lambda marker: attacks.edit_program(
                        lambda tree: tree["range_constraints"].update({"s1\x1b]0;pwned\x07": {"min_val": 2}})),
                    "empty-weight": lambda marker: attacks.empty_weight,
                    "shared-samples": lambda marker: attacks.shared_branches,
                    "stored-name": lambda marker: attacks.edit_program(attacks.stored_name(7))}[attack](tmp / "marker")
        else:
            edit = lambda entries: entries.update({"extra/amppass.json": plan})  # noqa: E731
        return amppass.load(attacks.rewrite(_saved_pt2(), tmp / "model.pt2", edit, compress=("extra/amppass.json",)))
    return load


@dataclass(frozen=True)
class Case:
    """One bad input: what the user passed, the call, the error class and words the message must hold."""

    id: str
    what: str
    call: Callable[[Path], object]
    error: type[AmpPassError]
    words: tuple[str, ...]
    needs_onnx_calibration: bool = False


def _train_step(model: torch.nn.Module) -> None:
    """One training step: train mode, forward with gradients, backward."""
    model.train()
    model(*X).sum().backward()


def _scaler_at_floor_overflows(tmp: Path) -> None:
    """fp16 training whose loss is inf every step: the loss scale backs off to min_scale=1, then raises."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = amppass.LossScaler(init_scale=4.0)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale((param * float("inf")).sum()).backward()
        scaler.step(opt)
        scaler.update()


def _world_scaler_steps_without_init(tmp: Path) -> None:
    """A scaler asked to agree over the default group steps in a process with no process group."""
    param = torch.nn.Parameter(torch.ones(3))
    scaler = amppass.LossScaler(process_group="world")
    scaler.scale(param.sum()).backward()
    scaler.step(torch.optim.SGD([param], lr=0.1))


def _fsdp2_casting_parameters_itself(tmp: Path) -> None:
    """A train-mode converted model under fully_shard with MixedPrecisionPolicy(param_dtype=...), one rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    converted = amppass.convert(mlp(), X, "bf16", mode="train", plan_for="coverage")
    with one_rank_group():
        fully_shard(converted, mesh=init_device_mesh("cpu", (1,)),
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        converted(*X)


class WithMethods(torch.nn.Module):
    """A module whose class has a method of its own: it converts to an instance of its class (amppass.fx.dropin)."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def labels(self, x: torch.Tensor) -> list[int]:
        return self(x).argmax(-1).tolist()


def _call_a_part(tmp: Path) -> None:
    amppass.convert(WithMethods().eval(), X, "bf16", plan_for="coverage").body(*X)


def _pickle_in_its_class(tmp: Path) -> None:
    torch.save(amppass.convert(WithMethods().eval(), X, "bf16", plan_for="coverage"), tmp / "model.pt")


CASES = [
    Case("onnx-unreadable", "a file that cannot be read", lambda tmp: amppass.convert_onnx(_unreadable(tmp)),
         InputError, ("cannot be read", "check the file's permissions")),
    Case("onnx-text-file", "a text file", _onnx(_file("notes.txt", b"just some text\n")),
         InputError, ("notes.txt", "could not be read as an ONNX model", "is it an .onnx file")),
    Case("onnx-torch-file", "a PyTorch checkpoint (.pt)", _onnx(_torch_checkpoint),
         InputError, ("model.pt", "PyTorch checkpoint", "amppass.convert")),
    Case("onnx-empty-file", "an empty file", _onnx(_file("empty.onnx", b"")),
         InputError, ("empty.onnx", "not an ONNX model", "torch.onnx.export")),
    Case("onnx-missing-path", "a path that does not exist", _onnx(_file("missing.onnx")),
         InputError, ("missing.onnx", "no such path", "pass the path")),
    Case("onnx-directory", "a folder", _onnx(str), InputError, ("is a folder", "pass the path of the .onnx model")),
    Case("onnx-external-absolute", "external data at an absolute path (/etc/passwd)",
         _onnx(_external("/etc/passwd")), InputError, ("'W'", "'/etc/passwd'", "absolute path", "inside the model's folder")),
    Case("onnx-external-climbing", "external data outside the model's folder (../x)",
         _onnx(_external("../secret.data")), InputError, ("'W'", "climbs out of the model's folder")),
    Case("onnx-external-reserved", "external data at amppass's reserved location",
         _onnx(_external("amppass:weight-store")), InputError, ("'W'", "reserves for its own weight store")),
    Case("onnx-external-offset", "an external-data offset past the end of the file",
         _onnx(_external("w.data", offset="999999")), InputError, ("'W'", "would end at byte", "truncated")),
    Case("onnx-external-offset-text", "an external-data offset that is not a number",
         _onnx(_external("w.data", offset="-8")), InputError, ("'W'", "offset '-8'", "non-negative whole number")),
    Case("onnx-external-offset-digits", "an external-data offset of 5,000 digits",
         _onnx(_external("w.data", offset="9" * 5000)), InputError,
         ("'W'", "external-data offset", "(5,000 characters)", "at most 19 digits")),
    Case("onnx-raw-data-short", "raw data shorter than the tensor's shape",
         _onnx(lambda tmp: _truncated(matmul_model())), InputError, ("'W'", "bytes of raw data", "needs 256")),
    Case("onnx-cycle", "a graph with a cycle", _onnx(_cycle), InputError, ("in a cycle", "acyclic")),
    Case("onnx-forged-metadata", "amppass.report of a model with forged metadata", _forged_report,
         InputError, ("'casts'", "not a finite number", "convert the original model again")),
    Case("onnx-forged-timing", "amppass.report of a model whose speed-check record counts groups with a text",
         _forged_timing, InputError, ('profitability.timing["{dtype:>999999999}"]', "not an integer",
                                      "convert the original model again")),
    Case("onnx-cut-short", "an .onnx file cut short (a copy that stopped early)", _onnx(_cut_short),
         InputError, ("cut.onnx", "runs past the end of its message", "cut short or damaged",
                      "copy or export it again")),
    Case("onnx-deep-metadata", "amppass.report of a model whose metadata nests 100,000 deep", _deep_report,
         InputError, ("metadata_props['amppass']", "nests deeper than 64 levels", "convert the original model again")),
    Case("onnx-too-many-nodes", "an ONNX model of more nodes than amppass reads (500,000)",
         _onnx(lambda tmp: relu_chain(MAX_NODES + 1)), InputError,
         ("500,001 nodes", "at most 500,000", "AMPPASS_MAX_NODES")),
    Case("output-fifo", "an output path that is a FIFO", lambda tmp: amppass.export_onnx(mlp(), X, _fifo(tmp)),
         InputError, ("out.onnx", "a FIFO", "not a regular file", "choose another path")),
    Case("onnx-not-a-model", "bytes instead of a model", _onnx(lambda tmp: matmul_model().SerializeToString()),
         InputError, ("not bytes", "path to a .onnx file or an onnx.ModelProto")),
    Case("onnx-unknown-dtype", "convert_onnx(dtype='int8')", _onnx(lambda tmp: matmul_model(), dtype="int8"),
         InputError, ("dtype='int8'", "'fp16', 'bf16' or 'auto'")),
    Case("fx-unknown-dtype", "convert(dtype='int8')", lambda tmp: amppass.convert(mlp(), X, "int8"),
         InputError, ("dtype='int8'", "torch.float16", "'bf16'")),
    Case("fx-untraceable-export", "`if x.sum() > 0` in forward (torch.export)",
         lambda tmp: amppass.convert(DataDependent(), X, "fp16"),
         CaptureError, ("DataDependent", "data-dependent", "torch.cond")),
    Case("fx-untraceable-symbolic", "`if x.sum() > 0` in forward (no example inputs)",
         lambda tmp: amppass.convert(DataDependent(), None, "fp16"),
         CaptureError, ("DataDependent", "control flow", "Pass example_inputs")),
    Case("fx-train-own-backward", "a torch.autograd.Function whose backward is not its forward's derivative "
         "(mode='train')", lambda tmp: amppass.convert(StraightThrough(), (torch.randn(4, 8),), "bf16", mode="train", plan_for="coverage"),
         CaptureError, ("StraightThrough", "RoundSTE", "differs from the model's own", "No submodule")),
    Case("fx-calibration-nan", "calibration batch holding NaN", _fx(calibration=_bad_calibration(float("nan"))),
         CalibrationError, ("batch 1", "NaN", "nan_to_num")),
    Case("fx-calibration-inf", "calibration batch holding inf", _fx(calibration=_bad_calibration(float("inf"))),
         CalibrationError, ("batch 1", "inf", "nan_to_num")),
    Case("fx-calibration-shape", "calibration batch of a shape the model cannot take", _fx(calibration=[(torch.ones(2, 5),)]),
         CalibrationError, ("batch 0", "the fp32 model failed on it", "batches the model takes")),
    Case("fx-calibration-arity", "calibration batch with an extra input",
         _fx(calibration=[(torch.ones(2, 4), torch.ones(2))]),
         CalibrationError, ("batch 0", "2 positional", "batches the model takes")),
    Case("fx-calibration-empty", "empty calibration", _fx(calibration=[]),
         CalibrationError, ("empty", "calibration=")),
    Case("onnx-calibration-nan", "ONNX calibration feed holding NaN",
         _onnx_calibration([{"x": np.full((2, 8), np.nan, np.float32)}]),
         CalibrationError, ("batch 0", "'x'", "NaN"), needs_onnx_calibration=True),
    Case("onnx-calibration-missing-input", "ONNX calibration feed without the model's input",
         _onnx_calibration([{"y": np.ones((2, 8), np.float32)}]),
         CalibrationError, ("batch 0", "'x'"), needs_onnx_calibration=True),
    Case("onnx-calibration-shape", "ONNX calibration feed of another shape",
         _onnx_calibration([{"x": np.ones((2, 9), np.float32)}]),
         CalibrationError, ("batch 0", "'x'"), needs_onnx_calibration=True),
    Case("onnx-calibration-unloadable", "ONNX calibration of a model onnxruntime cannot load (a custom op)",
         _onnx(lambda tmp: matmul_model(custom=True), calibration=[{"x": np.ones((2, 8), np.float32)}]),
         CalibrationError, ("onnxruntime cannot load", "calibrate"), needs_onnx_calibration=True),
    Case("onnx-bf16-old-opset", "bf16 for an opset-11 model", _onnx(lambda tmp: matmul_model(11), dtype="bf16"),
         InputError, ("opset 11", "opset 13", "dtype='fp16'")),
    Case("onnx-bf16-cpu", "bf16 for onnxruntime's CPU provider (no bf16 MatMul)", _onnx(lambda tmp: matmul_model(), dtype="bf16"),
         InputError, ("dtype='bf16' with target='cpu'", "no bf16 kernel for MatMul", "target='cuda'", "dtype='fp16'")),
    Case("onnx-opset-too-new", "an opset newer than onnxruntime loads",
         _onnx(lambda tmp: matmul_model(onnxruntime_facts.max_opset() + 1)),
         InputError, (f"opset {onnxruntime_facts.max_opset() + 1}", f"re-export with opset <= {onnxruntime_facts.max_opset()}")),
    Case("fx-example-inputs-dict", "example_inputs as a dict", lambda tmp: amppass.convert(mlp(), {"x": X[0]}),
         InputError, ("example_inputs is a dict", "example_kwargs=")),
    Case("fx-example-kwargs-tuple", "example_kwargs as a tuple",
         lambda tmp: amppass.convert(mlp(), None, example_kwargs=X),
         InputError, ("example_kwargs must be a dict", "got tuple")),
    Case("fx-example-inputs-wrong-type", "example_inputs of the wrong type (an int)",
         lambda tmp: amppass.convert(mlp(), 3, "fp16"),
         CaptureError, ("Sequential", "must be Tensor, not int", "exactly as forward() takes them")),
    Case("fx-example-wrong-shape", "example_inputs of the wrong shape ([2, 5] for a first layer of 4 features)",
         lambda tmp: amppass.convert(mlp(), (torch.ones(2, 5),), "fp16"),
         CaptureError, ("input 'input' of shape [2, 5] does not fit Sequential: linear (0) takes [*, 4]",)),
    Case("fx-example-refused", "example_inputs the model's own code refuses (`x.view(2, 8)` of a [2, 5] input)",
         lambda tmp: amppass.convert(Viewing(), (torch.ones(2, 5),), "fp16"),
         CaptureError, ("Viewing does not run on its example (x: [2, 5] float32)", "view (Viewing.forward) raised",
                        "shape '[2, 8]' is invalid", "exactly as forward() takes them")),
    Case("fx-keep-fp32-bad-regex", "keep_fp32=['linear[(']", _fx(keep_fp32=["linear[("]),
         InputError, ("keep_fp32", "'linear[('", "not a valid regular expression", "escape")),
    Case("onnx-keep-fp32-bad-regex", "convert_onnx(keep_fp32=['mm[('])",
         _onnx(lambda tmp: matmul_model(), keep_fp32=["mm[("]),
         InputError, ("keep_fp32", "'mm[('", "not a valid regular expression")),
    Case("fx-force-low-not-string", "force_low=[3]", _fx(force_low=[3]),
         InputError, ("force_low", "3 is a int", "as strings")),
    Case("onnx-keep-fp32-not-list", "convert_onnx(keep_fp32=3)", _onnx(lambda tmp: matmul_model(), keep_fp32=3),
         InputError, ("keep_fp32=3", "not a list of patterns")),
    Case("onnx-keep-fp32-no-match", "keep_fp32 naming no node", _onnx(lambda tmp: matmul_model(), keep_fp32=["Nope"]),
         InputError, ("keep_fp32", "'Nope'", "matches no node", "amppass.report")),
    Case("fx-tolerance-negative", "tolerance=-1", _fx(calibration=[X], tolerance=-1),
         InputError, ("tolerance=-1", "positive number", "tolerance=1e-3")),
    Case("fx-tolerance-nan", "tolerance=nan", _fx(calibration=[X], tolerance=float("nan")),
         InputError, ("tolerance=nan", "positive number")),
    Case("fx-tolerance-string", "tolerance='1e-3'", _fx(calibration=[X], tolerance="1e-3"),
         InputError, ("tolerance='1e-3'", "positive number")),
    Case("fx-tolerance-no-calibration", "tolerance without calibration", _fx(tolerance=1e-3),
         InputError, ("tolerance=0.001", "calibration=")),
    Case("fx-not-a-module", "a function instead of an nn.Module", lambda tmp: amppass.convert(lambda x: x, X),
         InputError, ("torch.nn.Module", "got function", "pass the module object")),
    Case("fx-path-not-a-module", "a file path instead of an nn.Module", lambda tmp: amppass.convert("model.pt", X),
         InputError, ("got str", "torch.load", "amppass.convert_onnx")),
    Case("fx-unknown-mode", "convert(mode='eval')", _fx(mode="eval"), InputError, ("mode='eval'", "'inference'")),
    Case("fx-unknown-plan-for", "convert(plan_for='fast')", _fx(plan_for="fast"), InputError,
         ("plan_for='fast'", "'speed'", "'memory'")),
    Case("fx-unknown-target", "convert(target='tpu')", _fx(target="tpu"), InputError, ("target='tpu'", "'cpu', 'cuda'")),
    Case("fx-model-on-meta", "a model on the 'meta' device (shapes without weights)",
         lambda tmp: amppass.convert(mlp().to("meta"), X, "bf16"),
         InputError, ("amppass.convert(Sequential): the model is on the 'meta' device (0.weight", "to_empty(",
                      "without device_map='meta'")),
    Case("fx-model-half", "a model already in fp16 (model.half())", lambda tmp: amppass.convert(mlp().half(), X, "bf16"),
         InputError, ("weights are already float16 (0.weight: 4 of 4", "amppass.convert(copy.deepcopy(model).float()",
                      "dtype=torch.float32")),
    Case("fx-model-bf16", "a model already in bf16, with an fp32 example",
         lambda tmp: amppass.convert(mlp().bfloat16(), X, "fp16"), InputError, ("already bfloat16", ".float()")),
    Case("fx-example-other-dtype", "an fp16 example for a float32 model (the model itself refuses it)",
         lambda tmp: amppass.convert(mlp().eval(), (X[0].half(),), "bf16"),
         InputError, ("the example holds float16 tensors and the model's weights are float32",
                      "mat1 and mat2 must have the same dtype", "x.to(torch.float32)")),
    Case("fx-train-an-inference-graph", "training a model converted from train mode without mode=",
         lambda tmp: _train_step(amppass.convert(mlp().train(), X, "bf16", plan_for="coverage")),
         InputError, ("Sequential was converted for inference (amppass.convert without mode=, from a model in train "
                      "mode)", "mode='train'", ".eval()")),
    Case("load-a-folder", "amppass.load of a folder (a converted model's save_pretrained folder)",
         lambda tmp: amppass.load(tmp), InputError, ("a folder, and amppass.load reads a .pt2 file",
                                                     "amppass.load_pretrained(")),
    Case("load-pretrained-no-plan", "amppass.load_pretrained of a folder no converted model saved",
         lambda tmp: amppass.load_pretrained(tmp), InputError, ("no amppass.pt2 in it", "convert it with amppass.convert")),
    Case("onnx-unknown-target", "convert_onnx(target='gpu')", _onnx(lambda tmp: matmul_model(), target="gpu"),
         InputError, ("target='gpu'", "'cpu', 'cuda', 'tensorrt'")),
    Case("save-train-module", "amppass.save of a train-mode module",
         lambda tmp: amppass.save(amppass.convert(mlp(), X, "bf16", mode="train", plan_for="coverage"), tmp / "m.pt2"),
         InputError, ("train", "state_dict")),
    Case("save-kept-fp32", "amppass.save of a module that convert kept in fp32 (measured faster)",
         lambda tmp: amppass.save(keep_original(mlp(), {"whole_model": {"converted_ms": 0.2, "original_ms": 0.1}}),
                                  tmp / "m.pt2"),
         InputError, ("kept the original", "0.2 ms", "plan_for='coverage'")),
    Case("pt2-pickle", "a .pt2 whose weight is a pickle (use_pickle in its config)", _hostile_pt2("pickle"),
         InputError, ("model_weights_config.json", "weights_only=False", "trusted=True", "--trust-pickle")),
    Case("pt2-sample-inputs", "a .pt2 whose sample inputs are not tensors only", _hostile_pt2("samples"),
         InputError, ("data/sample_inputs/model.pt", "pickle", "trusted=True")),
    Case("pt2-sympy", "a .pt2 whose symbolic size is Python code", _hostile_pt2("sympy"),
         InputError, ("models/model.json", "sympy.sympify", "trusted=True")),
    Case("pt2-aoti", "a .pt2 holding an AOTInductor library", _hostile_pt2("aoti"),
         InputError, ("data/aotinductor/", "AOTInductor", "trusted=True")),
    Case("pt2-guard-code", "a .pt2 whose guard carries statements after a newline and a '#'", _hostile_pt2("guard"),
         InputError, ("models/model.json", "guard", "line break, comment", "trusted=True")),
    Case("pt2-range-escape", "a .pt2 whose range-constraint name holds terminal escapes", _hostile_pt2("range-escape"),
         InputError, ("range constraint", "\\x1b", "not a size symbol")),
    Case("pt2-empty-weight", "a .pt2 whose weight has no bytes but declares 2**29 elements",
         _hostile_pt2("empty-weight"), InputError, ("model_weights_config.json", "declares 536,870,912 elements",
                                                    "more than its file holds")),
    Case("pt2-shared-samples", "a .pt2 whose sample inputs share branches (8**7 leaves in a small file)",
         _hostile_pt2("shared-samples"), InputError, ("data/sample_inputs/model.pt", "more than 100,000 values")),
    Case("save-parts", "amppass.save of a model converted by parts",
         lambda tmp: amppass.save(amppass.convert(_by_parts(), (torch.randn(6, 8),), "bf16", plan_for="coverage"),
                                  tmp / "m.pt2"),
         InputError, ("converted by parts", "state_dict")),
    Case("save-onnx-as-pt2", "amppass.save of an onnx.ModelProto to a .pt2 path",
         lambda tmp: amppass.save(matmul_model(), tmp / "m.pt2"),
         InputError, ("path '", "m.pt2'", "model is an onnx.ModelProto", "name the file .onnx")),
    Case("save-torch-as-onnx", "amppass.save of a converted torch model to an .onnx path",
         lambda tmp: amppass.save(amppass.convert(mlp(), X, "bf16", plan_for="coverage"), tmp / "m.onnx"),
         InputError, ("path '", "m.onnx'", "torch.export program", "name the file .pt2", "amppass.export_onnx")),
    Case("pt2-stored-name", "a .pt2 whose node's stored name is not an identifier (an int)",
         _hostile_pt2("stored-name"), InputError, ("node '_to_copy'", "'amppass_name'", "not a Python identifier",
                                                   "convert the original again")),
    Case("pt2-plan-not-json", "a .pt2 whose amppass plan entry is not JSON", _hostile_pt2("plan-not-json"),
         InputError, ("extra/amppass.json", "not UTF-8 JSON", "save the model again")),
    Case("pt2-plan-bomb", "a .pt2 whose plan entry would inflate past its bound", _hostile_pt2("plan-bomb"),
         InputError, ("extra/amppass.json", "would inflate to", "save the model again")),
    Case("report-compiled-before-call", "amppass.report of a torch.compile(backend='amppass') module before its "
         "first call", lambda tmp: amppass.report(torch.compile(mlp(), backend="amppass")),
         InputError, ("has not been called yet", "call it once")),
    Case("export-not-a-module", "export_onnx of a function",
         lambda tmp: amppass.export_onnx(lambda x: x, X, tmp / "o.onnx"),
         InputError, ("export_onnx", "got function", "amppass.convert_onnx")),
    Case("export-to-folder", "export_onnx to a folder", lambda tmp: amppass.export_onnx(mlp(), X, tmp),
         InputError, ("is a folder", "model.onnx")),
    Case("export-to-missing-folder", "export_onnx into a folder that does not exist",
         lambda tmp: amppass.export_onnx(mlp(), X, tmp / "no" / "o.onnx"),
         InputError, ("no/o.onnx", "does not exist", "create it first")),
    Case("export-output-names-repeated", "export_onnx(output_names=['out', 'out']): a name twice",
         lambda tmp: amppass.export_onnx(mlp(), X, tmp / "o.onnx", output_names=["out", "out"]),
         InputError, ("output_names names 'out' more than once", "one distinct string per output")),
    Case("export-output-names-count", "export_onnx(output_names=[...]) of another count than the model's outputs",
         lambda tmp: amppass.export_onnx(mlp(), X, tmp / "o.onnx", output_names=["logits", "probs"]),
         InputError, ("output_names gives 2 names", "has 1 output", "pass 1 name,")),
    Case("onnx-reconvert-other-dtype", "bf16 of a model amppass converted to fp16",
         _onnx(lambda tmp: amppass.convert_onnx(matmul_model()), dtype="bf16"),
         InputError, ("already converted", "to fp16", "to bf16", "original float32 model")),
    Case("fx-reconvert-other-dtype", "bf16 of a module amppass converted to fp16",
         lambda tmp: amppass.convert(amppass.convert(mlp(), X, "fp16"), X, "bf16"),
         InputError, ("already converted", "to fp16", "to bf16", "original float32 module")),
    Case("train-without-example", "mode='train' without example inputs (a symbolic trace)",
         lambda tmp: amppass.convert(mlp(), dtype="bf16", mode="train"), InputError,
         ("mode='train'", "needs example_inputs", "amppass.convert(model, (x,), mode='train')")),
    Case("export-onnx-converted", "amppass.export_onnx of a module amppass already converted",
         lambda tmp: amppass.export_onnx(amppass.convert(mlp(), X, "fp16"), X, tmp / "m.onnx"), InputError,
         ("export_onnx exports a float32 model", "already converted", "pass the original float32 model")),
    Case("export-onnx-train-mode", "amppass.export_onnx of a model converted in train mode",
         lambda tmp: amppass.export_onnx(amppass.convert(mlp().train(), X, "fp16", mode="train", plan_for="coverage"), X, tmp / "m.onnx"),
         InputError, ("train mode", "original.load_state_dict(model.state_dict())", "pass the original")),
    Case("train-part-called-alone", "a submodule of a train-mode model called on its own",
         lambda tmp: amppass.convert(mlp().train(), X, "fp16", mode="train", plan_for="coverage")[2](torch.ones(2, 4)), InputError,
         ("2 (Linear) is a part of a model amppass converted in train mode", "Call the whole model",
          "amppass.convert(original.2")),
    Case("fsdp2-param-dtype", "FSDP2 MixedPrecisionPolicy(param_dtype=torch.bfloat16) on a train-mode model",
         _fsdp2_casting_parameters_itself, InputError,
         ("fully_shard(model)", "param_dtype=torch.bfloat16", "leave param_dtype unset")),
    Case("scaler-min-scale-zero", "LossScaler(min_scale=0)", lambda tmp: amppass.LossScaler(min_scale=0.0),
         ScalerValueError, ("min_scale=0.0", "2**-126", "finite")),
    Case("scaler-init-below-min", "LossScaler(init_scale=0.5) below the default min_scale=1",
         lambda tmp: amppass.LossScaler(init_scale=0.5), ScalerValueError, ("init_scale=0.5", "min_scale=...")),
    Case("scaler-bad-process-group", "LossScaler(process_group='mesh')",
         lambda tmp: amppass.LossScaler(process_group="mesh"), ScalerValueError,
         ("process_group='mesh'", "'world'", "leave it out")),
    Case("scaler-world-without-init", "LossScaler(process_group='world') stepping without init_process_group",
         _world_scaler_steps_without_init, ScalerUsageError, ("process_group='world'", "init_process_group")),
    Case("scaler-step-before-scale", "scaler.step(optimizer) before scaler.scale(loss)",
         lambda tmp: amppass.LossScaler().step(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])),
         ScalerUsageError, ("before scaler.scale()", "scaler.scale(loss).backward()")),
    Case("scaler-collapse", "fp16 gradients that overflow at the loss scale's minimum", _scaler_at_floor_overflows,
         ScaleCollapseError, ("min_scale=1", "inf/NaN", "bf16")),
    Case("dropin-part-called", "a submodule of a converted model called on its own", _call_a_part, InputError,
         ("holds no weights", "call the converted model itself")),
    Case("dropin-pickled", "torch.save of a converted model returned in its own class", _pickle_in_its_class,
         InputError, ("torch.save cannot pickle", "amppass.save(model.converted")),
]


def _onnx_calibration_available() -> bool:
    return "calibration" in inspect.signature(amppass.convert_onnx).parameters


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, tmp_path: Path):
    if case.needs_onnx_calibration and not _onnx_calibration_available():
        pytest.skip("convert_onnx has no calibration= yet")
    with pytest.raises(AmpPassError) as caught:
        case.call(tmp_path)
    assert type(caught.value) is case.error, f"{type(caught.value).__name__}: {caught.value}"
    for word in case.words:
        assert word in str(caught.value), f"{word!r} not in: {caught.value}"


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(4, 16), torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _ConvNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return self.bn(self.conv(x))


class _RootMatmul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        return x @ self.w


class _Concat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = torch.nn.LayerNorm(8), torch.nn.Linear(8, 4)

    def forward(self, x, y):
        return self.fc(self.norm(torch.cat([x, y], -1)))


class _Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.table(ids)


WRONG_SHAPES = [
    (_TwoLayers, (torch.ones(2, 5),), "input 'x' of shape [2, 5] does not fit _TwoLayers: linear (fc1) takes [*, 4]"),
    (_TwoLayers, (torch.ones(3, 2, 5),), "input 'x' of shape [3, 2, 5] does not fit _TwoLayers: linear (fc1) takes [*, 4]"),
    (_ConvNorm, (torch.ones(2, 4, 16, 16),),
     "input 'x' of shape [2, 4, 16, 16] does not fit _ConvNorm: conv2d (conv) takes [N, 3, H, W]"),
    (_RootMatmul, (torch.ones(2, 5),), "input 'x' of shape [2, 5] does not fit _RootMatmul: matmul (_RootMatmul.forward) "
                                        "takes [*, 4]"),
    (_Concat, (torch.ones(2, 4), torch.ones(2, 5)),
     "the example (x: [2, 4] float32, y: [2, 5] float32) does not fit _Concat: layer_norm (norm) takes [*, 8], got [2, 9]"),
    (_Lookup, (torch.ones(2, 3),), "input 'ids' of shape [2, 3] does not fit _Lookup: embedding (table) takes integer "
                                   "indices in [0, 10), got float32"),
]


@pytest.mark.parametrize("mode", ["inference", "train"])
@pytest.mark.parametrize("make, example, expected", WRONG_SHAPES, ids=lambda v: getattr(v, "__name__", None))
def test_an_example_of_the_wrong_shape_is_one_short_line(make, example, expected, mode):
    """Which input, its shape, the op (and module) that refused it and what it takes: not torch.export's symbols
    (``[s31, s81] X [16, 4]..``) and advice about control flow, and not a conversion by parts."""
    torch.manual_seed(0)
    with pytest.raises(CaptureError) as caught:
        amppass.convert(make(), example, "bf16", mode=mode)
    message = str(caught.value)
    assert message == expected
    assert len(message) < 130 and "Try:" not in message and "No submodule" not in message


def test_a_capture_error_ends_its_sentence_once(monkeypatch):
    """torch.export's reason ending in a period is followed by the hint, not by a second period."""
    def refuse(*args, **kwargs):
        raise RuntimeError("a and b must have same reduction dim.")

    monkeypatch.setattr(torch.export, "export", refuse)
    with pytest.raises(CaptureError) as caught:
        amppass.convert(mlp(), X, "fp16")
    assert "reduction dim. Try:" in str(caught.value) and ".." not in str(caught.value)


def test_running_the_model_to_explain_a_capture_leaves_its_statistics():
    """A capture that fails runs the model once on the example to see whether the example is at fault; in
    training mode that run updates batch norm's statistics, which are the caller's and are put back."""
    class BranchAfterNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

        def forward(self, x):
            h = self.bn(self.fc(x))
            return h * 2 if h.sum() > 0 else h - 1

    torch.manual_seed(0)
    model = BranchAfterNorm().train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    try:
        amppass.convert(model, (torch.randn(8, 4) + 3,), "bf16", mode="train", plan_for="coverage")
    except AmpPassError:
        pass
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())
    assert not model.bn._forward_pre_hooks and not model.bn._forward_hooks


def test_docs_errors_md_has_a_row_for_every_case():
    """docs/errors.md is generated: a case added without regenerating it is missing there."""
    rows = (ROOT / "docs" / "errors.md").read_text()
    missing = [case.what for case in CASES if f"| {case.what} |" not in rows
               and not (case.needs_onnx_calibration and not _onnx_calibration_available())]
    assert not missing, f"regenerate it with python -m tests.guarantees.test_bad_inputs docs/errors.md: missing {missing}"


def test_custom_op_is_fed_fp32_and_reported():
    """An op ONNX and onnxruntime do not know keeps the fp32 inputs it was written for, never silently fp16.

    With a user's kernel registered the converted model runs as the original did; here ``Foo`` is swapped for
    Relu in both models to run them.
    """
    original = matmul_model(custom=True)
    converted = amppass.convert_onnx(original)
    onnx.checker.check_model(converted)
    foo = next(n for n in converted.graph.node if n.op_type == "Foo")
    producer = next(n for n in converted.graph.node if foo.input[0] in n.output)
    assert producer.op_type == "Cast" and helper.get_attribute_value(producer.attribute[0]) == F32
    row = next(r for r in amppass.report(converted).rows if r.name == "foo")
    assert row.precision == "fp32" and row.evidence.get("unknown") is True
    assert "custom op Foo (domain my.custom)" in row.reason and "force_low=['Foo']" in row.reason
    assert next(r for r in amppass.report(converted).rows if r.name == "mm2").precision == "fp16"

    import onnxruntime as ort

    def as_relu(model: onnx.ModelProto) -> bytes:
        model = onnx.ModelProto.FromString(model.SerializeToString())
        model.ir_version = min(model.ir_version, onnxruntime_facts.max_ir_version())
        node = next(n for n in model.graph.node if n.op_type == "Foo")
        node.op_type, node.domain = "Relu", ""
        return model.SerializeToString()

    feed = {"x": np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)}
    want, got = (ort.InferenceSession(as_relu(m), providers=["CPUExecutionProvider"]).run(None, feed)[0]
                 for m in (original, converted))
    assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)


def custom_op_row() -> str:
    """What the report says about a custom op (the one non-failure row of docs/errors.md)."""
    converted = amppass.convert_onnx(matmul_model(custom=True))
    return next(r for r in amppass.report(converted).rows if r.name == "foo").reason


def _first_timing_cache_warning(open_cache: Callable[[], object]) -> str:
    """The first warning the timing cache logs while ``open_cache`` runs (the table's generator silences warnings)."""
    import logging

    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger, disabled = logging.getLogger(timing_cache.__name__), logging.root.manager.disable
    logger.addHandler(handler)
    logging.disable(logging.NOTSET)
    try:
        open_cache()
    finally:
        logger.removeHandler(handler)
        logging.disable(disabled)
    return said[0]


def cache_warning() -> str:
    """The warning a timing-cache file amppass cannot use gives (the cache reads as empty; <tmp> for its folder)."""
    with tempfile.TemporaryDirectory() as folder:
        cache = timing_cache.TimingCache({"device": "cpu"}, Path(folder))
        cache.path.write_text("[" * 100_000)
        timing_cache._WARNED.discard(cache.path)
        said = _first_timing_cache_warning(lambda: timing_cache.TimingCache({"device": "cpu"}, Path(folder)))
        return said.replace(folder, "<tmp>")


def test_a_cache_file_amppass_cannot_use_is_one_warning():
    assert "treated as empty" in cache_warning()


def cache_folder_warning() -> str:
    """The warning a timing-cache folder every user may write gives (neither read nor written; <tmp>)."""
    with tempfile.TemporaryDirectory() as folder:
        shared = Path(folder) / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)
        said = _first_timing_cache_warning(lambda: timing_cache.TimingCache({"device": "cpu"}, shared))
        return said.replace(folder, "<tmp>")


def test_a_cache_folder_others_may_write_is_one_warning():
    said = cache_folder_warning()
    assert "not used, neither read nor written" in said and "chmod go-w" in said and "AMPPASS_CACHE" in said


def table() -> str:
    """The markdown table of every case: the input, the error class and the message (paths as <tmp>)."""
    lines = ["# What users see when an input is wrong", "",
             "Generated by `python -m tests.guarantees.test_bad_inputs docs/errors.md`; each row is a case of "
             "tests/guarantees/test_bad_inputs.py.", "",
             "| input | error | message |", "|---|---|---|"]
    for case in CASES:
        if case.needs_onnx_calibration and not _onnx_calibration_available():
            continue
        with tempfile.TemporaryDirectory() as folder:
            try:
                case.call(Path(folder))
                message, name = "(no error)", "-"
            except AmpPassError as err:
                message, name = str(err).replace(folder, "<tmp>"), type(err).__name__
        lines.append(f"| {case.what} | {name} | {_cell(message)} |")
    lines.append(f"| custom op (unknown domain) in ONNX | converts; op kept fp32 | {_cell(custom_op_row())} |")
    lines.append(f"| a timing-cache file that cannot be used (nested, not UTF-8, a FIFO, a link, over "
                 f"{timing_cache.MAX_BYTES >> 20} MiB) | converts; one warning, cache treated as empty | "
                 f"{_cell(cache_warning())} |")
    lines.append(f"| a timing-cache folder another user may write or owns (AMPPASS_CACHE in a shared folder) | "
                 f"converts; one warning, cache neither read nor written | {_cell(cache_folder_warning())} |")
    return "\n".join(lines + ["", *PRINCIPLE]) + "\n"


PRINCIPLE = [  # the section after the table: why a file's messages look as they do
    "## Reading a file",
    "",
    "Every value amppass reads from a model file passes a validating reader with a size, a count and a depth bound",
    "before any library (torch, sympy, json, zipfile, numpy) sees it: a zip's directory before anything is",
    "inflated, a pickle's opcodes before an unpickler runs, JSON's size and value count before it is parsed.",
    "Every failure is an `AmpPassError` naming the file and the entry, value or node. A hostile file under 1 MB",
    "costs at most 500 MB more memory and 10 s more CPU than an honest file of its kind, to load, report, convert",
    "or call (`tests/guarantees/test_pt2_containers_round3.py` measures the `.pt2` containers).",
]


def _cell(text: str) -> str:
    text = " ".join(text.split())
    text = text if len(text) <= 400 else text[:400] + "…"
    return text.replace("|", "\\|")


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)
    rendered = table()
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(rendered)
    else:
        print(rendered, end="")
