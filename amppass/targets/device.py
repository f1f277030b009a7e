"""What this machine's device is, and whether its low-precision kernels can beat fp32 at all.

Profitability (:mod:`amppass.analysis.profitability`) times kernels on the device a plan is made for. Two facts about
that device come first:

1. **Fingerprint** (:func:`fingerprint`): what a timing depends on besides the kernel itself. For a CPU:
   its model name, the ISA flags that decide which low-precision instructions exist (None where the
   operating system does not list them), torch's CPU capability (the kernel set torch dispatches to), the
   torch and oneDNN versions and torch's thread count; for a GPU: its name, compute capability and number
   of streaming multiprocessors, the torch, CUDA, driver, cuBLAS and cuDNN versions (None where unreadable). Timings are
   cached under it (:mod:`amppass.targets.timing_cache`): a change of any field (a new CPU, a torch upgrade,
   ``torch.set_num_threads``) starts a new table.
2. **Native low precision** (:func:`native_low`): whether the device has instructions for the low dtype.
   An x86 CPU multiplies bf16 natively with ``avx512_bf16`` or AMX (``amx_bf16``), fp16 with
   ``avx512_fp16`` or ``amx_fp16``; an Arm CPU with the ``bf16`` and ``fphp``/``asimdhp`` features;
   without them oneDNN and torch convert to fp32 and back around every operation, so low-precision
   kernels run several to 30 times slower than fp32 and no region can win: the plan keeps fp32 without
   timing any kernel. Where the flags cannot be read, a one-time probe (a matrix product in both
   precisions, :func:`amppass.targets.measure.probe`) answers instead, stored with the device's timings. NVIDIA GPUs run
   fp16 natively from compute capability 5.3 and bf16 from 8.0.

Tests inject the CPU facts by patching :func:`cpu_facts`; nothing here depends on the CPU that runs them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dtypes import LowType

FORMAT = 1  # bump when what a cached timing means changes: every older table is then ignored

# the ISA flags a low-precision kernel's speed depends on (x86 /proc/cpuinfo names, then Arm features)
ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
             "bf16", "fphp", "asimdhp", "sve", "sve2", "sme")
_NATIVE_FLAGS = {"bf16": ("amx_bf16", "avx512_bf16", "bf16"), "fp16": ("amx_fp16", "avx512_fp16", "fphp", "asimdhp")}


@dataclass(frozen=True)
class CpuFacts:
    """What the operating system says about the CPU: its model name and every flag it lists (empty where
    the flags cannot be read, e.g. outside Linux)."""

    model: str
    flags: frozenset[str]


def cpu_facts() -> CpuFacts:
    """The CPU's model name and flags from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``)."""
    model, flags = platform.processor() or platform.machine(), frozenset[str]()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return CpuFacts(model, flags)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and model in ("", platform.machine()):
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return CpuFacts(model, flags)


@functools.lru_cache(maxsize=1)
def onednn_version() -> str:
    """The oneDNN version torch was built with ("none" without it), from ``torch.__config__.show()``."""
    found = re.search(r"(?:MKL-DNN|oneDNN)\s+v?([\w.]+)", torch.__config__.show())
    return found.group(1) if found else "none"


def fingerprint(device: torch.device) -> dict[str, Any]:
    """What a timing on ``device`` depends on besides the kernel (module docstring, 1); JSON-ready."""
    found: dict[str, Any] = {"format": FORMAT, "device": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        properties = torch.cuda.get_device_properties(index)
        torch.ones(1, 1, device=device) @ torch.ones(1, 1, device=device)  # loads cuBLAS, whose version is asked
        found.update(name=properties.name, capability=f"{properties.major}.{properties.minor}",
                     sm_count=properties.multi_processor_count, cuda=torch.version.cuda,
                     driver=nvidia_driver(), cublas=cublas_version(), cudnn=torch.backends.cudnn.version())
        return found
    facts = cpu_facts()
    found.update(cpu=facts.model, isa=sorted(facts.flags & set(ISA_FLAGS)) if facts.flags else None,
                 capability=torch.backends.cpu.get_cpu_capability(), onednn=onednn_version(),
                 threads=torch.get_num_threads())
    return found


def nvidia_driver(path: Path = Path("/proc/driver/nvidia/version")) -> str | None:
    """The NVIDIA kernel driver's version, from ``path`` (None where unreadable)."""
    try:
        text = path.read_text(errors="replace")[:4096]
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def cublas_version() -> int | None:
    """The version of the cuBLASLt library this process loaded (``cublasLtGetVersion``), read through the
    library's own path in ``/proc/self/maps``; None where it is not loaded or cannot be asked."""
    try:
        maps = Path("/proc/self/maps").read_text(errors="replace")
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "libcublasLt" in line and "/" in line})
    for path in paths:
        try:
            return int(ctypes.CDLL(path).cublasLtGetVersion())
        except (OSError, AttributeError):
            continue
    return None


def digest(found: dict[str, Any]) -> str:
    """A short stable name for a fingerprint (the timing cache's file name)."""
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Native:
    """Whether the device runs the low dtype natively: ``known`` False when neither its flags nor a
    probe could tell (then it is assumed to, and every region is timed)."""

    native: bool
    known: bool
    reason: str


def native_low(found: dict[str, Any], low: LowType, probed: dict[str, float] | None = None) -> Native:
    """Whether the device of fingerprint ``found`` has instructions for ``low`` (module docstring, 2).

    ``probed`` (from :func:`amppass.targets.measure.probe`) decides where the fingerprint's flags cannot."""
    if found["device"] == "cuda":
        major, minor = (int(p) for p in found["capability"].split("."))
        needed = (8, 0) if low.name == "bf16" else (5, 3)
        native = (major, minor) >= needed
        return Native(native, True, f"{found['name']} (compute capability {found['capability']}) "
                      f"{'runs' if native else 'has no'} native {low.name} arithmetic"
                      + ("" if native else f" (it needs {needed[0]}.{needed[1]})"))
    isa, wanted = found.get("isa"), _NATIVE_FLAGS[low.name]
    if isa is not None:
        has = [flag for flag in wanted if flag in isa]
        if has:
            return Native(True, True, f"this CPU has {', '.join(has)} (torch capability {found['capability']})")
        return Native(False, True, f"this CPU has none of {', '.join(wanted)} in its ISA flags (torch capability "
                      f"{found['capability']}): {low.name} kernels convert to fp32 and back around every "
                      "operation and run slower than fp32")
    if probed:
        ratio = probed["gemm_low"] / probed["gemm_fp32"]
        native = ratio <= 1.0
        return Native(native, True, f"its ISA flags are unknown; a matrix product probed {ratio:.2f}x fp32's "
                      f"time in {low.name}")
    return Native(True, False, "its ISA flags are unknown and no probe was taken")
