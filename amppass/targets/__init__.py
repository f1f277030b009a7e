"""What a deployment target runs: the :class:`Target` a plan is made for, and static kernel tables for
providers this machine may not load."""

from .kernels import KernelTable, load
from .target import ONNX_TARGETS, TORCH_TARGETS, Target, onnx_target, torch_target

__all__ = ["KernelTable", "ONNX_TARGETS", "TORCH_TARGETS", "Target", "load", "onnx_target", "torch_target"]
