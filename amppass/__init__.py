"""amppass: a mixed-precision compiler pass for PyTorch (torch.fx / torch.export) and ONNX models.

Every node is labelled fp16/bf16-safe or fp32-required from op semantics (and, with calibration data,
from measured value ranges); casts are inserted on the fewest edges; every decision is explained in a
per-node report that is stored in the converted model itself.
"""

__version__ = "0.1.0"

from .errors import AmpPassError, CalibrationError, CaptureError, InputError, ScaleCollapseError  # noqa: E402
from .pipelines.convert import convert  # noqa: E402
from .pipelines.serialize import load, load_program, save  # noqa: E402
from .pipelines.convert_onnx import convert_onnx  # noqa: E402
from .pipelines.export_onnx import export_onnx  # noqa: E402
from .pipelines.report import report  # noqa: E402
from .training import LossScaler  # noqa: E402

__all__ = [
    "AmpPassError",
    "CalibrationError",
    "CaptureError",
    "InputError",
    "LossScaler",
    "ScaleCollapseError",
    "__version__",
    "convert",
    "convert_onnx",
    "export_onnx",
    "load",
    "load_program",
    "report",
    "save",
]
