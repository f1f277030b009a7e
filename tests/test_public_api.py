"""The public API does not move when the package's layout does: ``amppass.__all__``, the torch.compile entry
point, every module path README.md and docs/ show, and the old paths kept for a release, which still work and warn
(amppass.deprecation)."""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import re
import tomllib
import warnings

import pytest

import amppass

ROOT = pathlib.Path(__file__).resolve().parents[1]

# module paths the README and docs show, with a name each must still hold
SHOWN_PATHS = {
    "amppass.onnx.simulate": "simulated",
    "amppass.onnx.io.lazy_read": "load",
    "amppass.analysis.tolerance": "search_runs",
    "amppass.analysis.calibration": "max_runs",
    "amppass.reporting.report": "load_schema",
    "amppass.reporting.terminal": "render_text",
    "amppass.cli": "main",
    "amppass.fx.rewrite.fp8_train": "swap_linears",
}

# old module path -> {name it still gives: the module that holds it now}; reading one warns (tests/test_layering.py
# holds the release that removes each path)
DEPRECATED_PATHS = {
    "amppass.report.report": {"load_schema": "amppass.reporting.report", "Report": "amppass.reporting.report"},
    "amppass.report.terminal": {"render": "amppass.reporting.terminal",
                                "render_text": "amppass.reporting.terminal"},
    "amppass.onnx.convert": {"save": "amppass", "convert_onnx": "amppass"},
    "amppass.fx.backend": {"amppass_backend": "amppass.pipelines.backend"},
}


def test_all_is_pinned():
    assert sorted(amppass.__all__) == [
        "AmpPassError", "CalibrationError", "CaptureError", "InputError", "LossScaler", "ScaleCollapseError",
        "__version__", "convert", "convert_onnx", "export_onnx", "load", "load_pretrained", "load_program", "report",
        "save",
    ]
    for name in amppass.__all__:
        assert getattr(amppass, name) is not None
    assert callable(amppass.report) and callable(amppass.convert)  # the function, not the report/ package


def test_compile_backend_entry_point_resolves():
    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch_dynamo_backends"]
    assert entry == {"amppass": "amppass.pipelines.backend:amppass_backend"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = importlib.metadata.EntryPoint("amppass", entry["amppass"], "torch_dynamo_backends").load()
    assert not [w for w in caught if "amppass" in str(w.message)]  # this install's entry point: no warning
    old_install = importlib.metadata.EntryPoint("amppass", "amppass.fx.backend:amppass_backend",
                                                "torch_dynamo_backends")
    with pytest.warns(DeprecationWarning, match=r"amppass\.fx\.backend will be removed") as caught:
        assert old_install.load() is backend  # an install made before the move still compiles, and is told once
    assert len([w for w in caught if "amppass" in str(w.message)]) == 1


def test_paths_the_docs_show_still_import():
    for module, name in SHOWN_PATHS.items():
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


@pytest.mark.parametrize("old", sorted(DEPRECATED_PATHS))
def test_old_paths_still_work_and_warn_naming_the_new_home_and_the_removal(old):
    module = importlib.import_module(old)
    for name, home in DEPRECATED_PATHS[old].items():
        said = rf"{re.escape(old)}\.{name} has moved to {re.escape(home)}\.{name}.*removed in amppass \d+\.\d+\.\d+"
        with pytest.warns(DeprecationWarning, match=said):
            value = getattr(module, name)
        assert value is getattr(importlib.import_module(home), name)
    with pytest.raises(AttributeError):
        module.not_there  # noqa: B018 - only the names that moved are given, and nothing else warns
