"""What the timing cache's fingerprint of a GPU reads from the machine, checked without one."""

from __future__ import annotations

from amppass.targets import device as device_facts


def test_the_driver_version_is_read_from_the_kernel_modules_file(tmp_path):
    file = tmp_path / "version"
    file.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs)\n"
                    "GCC version:  gcc version 12.2.0\n")
    assert device_facts.nvidia_driver(file) == "580.95.05"
    file.write_text("garbage")
    assert device_facts.nvidia_driver(file) is None
    assert device_facts.nvidia_driver(tmp_path / "missing") is None
