"""amppass: a mixed-precision compiler pass for PyTorch (torch.fx / torch.export) and ONNX models.

Every node is labelled fp16/bf16-safe or fp32-required from op semantics (and, with calibration data,
from measured value ranges); casts are inserted on the fewest edges; every decision is explained in a
per-node report that is stored in the converted model itself.

The public names are imported on first use (PEP 562), so ``import amppass`` and ``amppass --help`` do not
import torch, onnx or onnxruntime until a function that needs them is called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# public name -> the module that defines it
_HOMES = {
    "AmpPassError": ".errors",
    "CalibrationError": ".errors",
    "CaptureError": ".errors",
    "InputError": ".errors",
    "ScaleCollapseError": ".errors",
    "convert": ".pipelines.convert",
    "load": ".pipelines.serialize",
    "load_pretrained": ".pipelines.serialize",
    "load_program": ".pipelines.serialize",
    "save": ".pipelines.save",
    "convert_onnx": ".pipelines.convert_onnx",
    "export_onnx": ".pipelines.export_onnx",
    "report": ".pipelines.report",
    "LossScaler": ".training",
}

__all__ = ["__version__", *_HOMES]

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time __getattr__ imports on first use
    # ruff: the names are public through __all__ (built from _HOMES, which it cannot read)
    from .errors import AmpPassError, CalibrationError, CaptureError, InputError, ScaleCollapseError  # noqa: F401
    from .pipelines.convert import convert  # noqa: F401
    from .pipelines.convert_onnx import convert_onnx  # noqa: F401
    from .pipelines.export_onnx import export_onnx  # noqa: F401
    from .pipelines.report import report  # noqa: F401
    from .pipelines.save import save  # noqa: F401
    from .pipelines.serialize import load, load_pretrained, load_program  # noqa: F401
    from .training import LossScaler  # noqa: F401


# The report's modules are in reporting/; report/ keeps only the old paths amppass.report.report and
# amppass.report.terminal until they go. Importing one would bind ``amppass.report`` to that old package
# instead of the function, so the package (a docstring, no imports) is imported now and its name unbound; later
# imports find it in sys.modules and bind nothing here. Delete these two lines with the old report/ package.
importlib.import_module(".report", __name__)
del globals()["report"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'amppass' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
