"""amppass depends on ``onnxruntime`` (the CPU build). pip treats ``onnxruntime-gpu`` as another package, so
installing amppass beside it puts both builds into the one ``onnxruntime`` folder, the one installed last
overwriting the other's files: that is said once, at first use, naming both builds and the fix."""

from __future__ import annotations

import logging
from importlib import metadata

import numpy as np
import pytest

import amppass
from amppass.targets import onnxruntime_facts
from tests.helpers.onnx_files import matmul_64

REAL_VERSION = metadata.version


@pytest.fixture
def builds(monkeypatch):
    """Pretends the given onnxruntime builds are installed (every other distribution as it is)."""
    def pretend(*installed: str) -> None:
        def version(name: str) -> str:
            if name in onnxruntime_facts.BUILDS:
                if name not in installed:
                    raise metadata.PackageNotFoundError(name)
                return "1.31.1"
            return REAL_VERSION(name)

        monkeypatch.setattr(onnxruntime_facts.metadata, "version", version)
        onnxruntime_facts.installed_builds.cache_clear()

    yield pretend
    onnxruntime_facts.installed_builds.cache_clear()


def _said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "`onnxruntime` folder" in r.getMessage()]


def test_two_builds_in_one_folder_are_said_once_at_first_use_with_the_fix(builds, caplog):
    builds("onnxruntime", "onnxruntime-gpu")
    feed = {"x": np.ones((2, 64), np.float32)}
    with caplog.at_level(logging.WARNING, logger="amppass"):
        amppass.convert_onnx(matmul_64(), "fp16", calibration=[feed])  # a real first use: a calibration session
        amppass.convert_onnx(matmul_64(), "fp16", calibration=[feed])
    said = _said(caplog)
    assert len(said) == 1, said
    assert "onnxruntime 1.31.1 and onnxruntime-gpu 1.31.1" in said[0]
    assert "pip uninstall -y onnxruntime onnxruntime-gpu" in said[0] and "pip install onnxruntime-gpu" in said[0]


@pytest.mark.parametrize("installed", [("onnxruntime",), ("onnxruntime-gpu",)])
def test_one_build_of_either_kind_is_left_alone(builds, caplog, installed):
    builds(*installed)
    with caplog.at_level(logging.WARNING, logger="amppass"):
        assert onnxruntime_facts.installed_builds() == (f"{installed[0]} 1.31.1",)
    assert not _said(caplog)

