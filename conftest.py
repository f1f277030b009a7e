"""Test-wide settings: conversions never read or write the user's timing cache; shared fixtures."""

from __future__ import annotations

import os

import pytest

# fixtures every test may ask for by name: ``saved`` (a converted .pt2 and torch's own), built once a module
pytest_plugins = ["tests.helpers.pt2_files"]


@pytest.fixture(autouse=True, scope="session")
def _private_timing_cache(tmp_path_factory: pytest.TempPathFactory):
    """Point ``AMPPASS_CACHE`` at a folder of this test session (subprocesses inherit it)."""
    before = os.environ.get("AMPPASS_CACHE")
    os.environ["AMPPASS_CACHE"] = str(tmp_path_factory.mktemp("amppass-timings"))
    yield
    if before is None:
        os.environ.pop("AMPPASS_CACHE", None)
    else:
        os.environ["AMPPASS_CACHE"] = before
