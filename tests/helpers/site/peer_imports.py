"""Make ``import torchvision`` and ``import torchaudio`` work beside the CPU torch wheel, in every process of
the test environment.

PyPI's torchvision and torchaudio are built against the CUDA torch: beside ``torch==2.13.0+cpu`` their compiled
extensions do not load, ``import torchvision`` fails (``operator torchvision::nms does not exist``) and
``import torchaudio`` raises OSError (``libc10_cuda.so``), which also breaks every ``import transformers`` (its
image and audio utilities import both). ``scripts/setup`` puts a ``.pth`` file in site-packages that imports
this module at start-up: it adds an import hook and imports nothing itself. The first ``import torchvision``
then runs ``tests/helpers/torchvision_ops.register()``, which gives the ops pure-PyTorch kernels where the
compiled ones do not load (and does nothing where they do); the first ``import torchaudio`` finds its
extension loader reporting a library that does not load as absent (its models are plain Python).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import pathlib
import sys

_OPS = pathlib.Path(__file__).resolve().parent.parent / "torchvision_ops.py"


class _Loaded(importlib.abc.Loader):
    """Hands the import machinery the module :func:`register` already imported."""

    def create_module(self, spec):
        return sys.modules[spec.name]

    def exec_module(self, module):
        pass


class _Hook(importlib.abc.MetaPathFinder):
    registering = False

    def find_spec(self, name, path=None, target=None):
        if name == "torchaudio":
            _quiet_torchaudio_extension()
            return None
        if name != "torchvision" or self.registering or not _OPS.exists():
            return None
        self.registering = True  # register() imports torchvision itself, past this hook
        spec = importlib.util.spec_from_file_location("amppass_torchvision_ops", _OPS)
        ops = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = ops
        spec.loader.exec_module(ops)
        ops.register()
        return importlib.machinery.ModuleSpec(name, _Loaded(), origin=sys.modules[name].__file__)


def _quiet_torchaudio_extension() -> None:
    """Seed ``torchaudio._extension.utils`` (plain Python) with a loader that reports a library failing to load
    as no extension, before torchaudio's own import reads it."""
    name = "torchaudio._extension.utils"
    spec = importlib.machinery.PathFinder.find_spec("torchaudio")
    if name in sys.modules or spec is None or not spec.submodule_search_locations:
        return
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "_extension" / "utils.py"
    utils_spec = importlib.util.spec_from_file_location(name, path)
    utils = importlib.util.module_from_spec(utils_spec)
    utils_spec.loader.exec_module(utils)
    load = utils._load_lib

    def _load_lib(lib: str) -> bool:
        try:
            return load(lib)
        except OSError:
            return False

    utils._load_lib = _load_lib
    sys.modules[name] = utils


if not any(isinstance(finder, _Hook) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Hook())
