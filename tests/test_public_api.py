"""The public API does not move when the package's layout does: ``amppass.__all__``, the torch.compile entry
point, and every module path README.md and docs/ show."""

from __future__ import annotations

import importlib
import pathlib
import tomllib

import amppass

ROOT = pathlib.Path(__file__).resolve().parents[1]

# module paths the README and docs show, with a name each must still hold
SHOWN_PATHS = {
    "amppass.onnx.convert": "save",
    "amppass.onnx.simulate": "simulated",
    "amppass.onnx.io.lazy_read": "load",
    "amppass.analysis.tolerance": "search_runs",
    "amppass.analysis.calibration": "max_runs",
    "amppass.report.report": "load_schema",
    "amppass.report.terminal": "render_text",
    "amppass.cli": "main",
    "amppass.fx.backend": "amppass_backend",
}


def test_all_is_pinned():
    assert sorted(amppass.__all__) == [
        "AmpPassError", "CalibrationError", "CaptureError", "InputError", "LossScaler", "ScaleCollapseError",
        "__version__", "convert", "convert_onnx", "export_onnx", "load", "load_program", "report", "save",
    ]
    for name in amppass.__all__:
        assert getattr(amppass, name) is not None
    assert callable(amppass.report) and callable(amppass.convert)  # the function, not the report/ package


def test_compile_backend_entry_point_resolves():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch_dynamo_backends"]
    assert entry == {"amppass": "amppass.pipelines.backend:amppass_backend"}
    module, name = entry["amppass"].split(":")
    backend = getattr(importlib.import_module(module), name)
    assert backend is importlib.import_module("amppass.fx.backend").amppass_backend  # the path of older installs


def test_paths_the_docs_show_still_import():
    for module, name in SHOWN_PATHS.items():
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    assert importlib.import_module("amppass.onnx.convert").save is importlib.import_module(
        "amppass.pipelines.convert_onnx").save
