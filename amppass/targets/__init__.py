"""What a deployment target runs: static kernel tables for providers this machine may not load."""

from .kernels import KernelTable, load

__all__ = ["KernelTable", "load"]
