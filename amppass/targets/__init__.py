"""Where the model runs and what that device or runtime can do: the :class:`Target` a plan is made for,
kernel tables for providers this machine may not load, the device's fingerprint and native-arithmetic facts,
interleaved timing, the roofline prior, the per-device timing cache, and the installed onnxruntime's facts."""

from .onnx_kernel_tables import KernelTable, load
from .target import ONNX_TARGETS, TORCH_TARGETS, Target, onnx_target, torch_target

__all__ = ["KernelTable", "ONNX_TARGETS", "TORCH_TARGETS", "Target", "load", "onnx_target", "torch_target"]
