"""The fp8 parts of benchmark section "gpu" without an fp8 device: ``--full`` leaves one row per part saying why it
was skipped, ``--quick`` runs every part's code on the CPU (a dry run: no times asserted), and the numerics
helper counts bf16 steps exactly."""

from __future__ import annotations

import logging

import pytest
import torch

from benchmarks import gpu, gpu_fp8

PARTS = (gpu_fp8.products, gpu_fp8.whole_model, gpu_fp8.numerics)


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)  # the CPU target's "fp8 for testing only" warning
    yield
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("part", PARTS, ids=lambda p: p.__name__)
def test_without_an_fp8_device_the_full_run_skips_each_part_in_one_row_saying_why(part, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert part(False) == [{"failed": "skipped: no CUDA device; scripts/gpu_check on an H100 or H200 gives these "
                                      "figures"}]


def test_a_gpu_without_fp8_kernels_is_named_with_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    assert gpu_fp8.no_fp8_device() == "NVIDIA A100 has compute capability 8.0, below 8.9 (no fp8 kernels)"


def test_the_product_shapes_are_the_zoo_transformers_linear_layers_gpt2s_included():
    shapes = gpu_fp8.product_shapes(quick=True)
    assert ("gpt2", 64, 192) in shapes  # GPT-2's fused q, k, v projection, a transformers Conv1D
    assert all(k > 0 and n > 0 for _, k, n in shapes) and len({(k, n) for _, k, n in shapes}) == len(shapes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU's")
def test_the_quick_dry_run_runs_every_part_on_the_cpu(monkeypatch):
    monkeypatch.setattr(gpu, "BUDGET_S", dict.fromkeys(gpu.BUDGET_S, 600.0))
    products, model, numerics = (part(True) for part in PARTS)
    assert products and all("failed" not in row and row["ms_scaled_mm"] > 0 for row in products), products
    assert [row["dtype"] for row in model] == ["bf16", "fp8"] and "failed" not in model[1], model
    assert model[1]["fp8_products"] != "-" and model[1]["err_fp32"] < 0.05  # e4m3 ran, near fp32
    assert numerics and all(row["max_diff_bf16_steps"] == 0 and 0 < row["err_fp32_cpu"] < 2 * 2 ** -4
                            for row in numerics), numerics


def test_bf16_steps_counts_the_step_at_each_magnitude():
    a = torch.tensor([1.0, 256.0, 0.0, -3.0])
    b = torch.tensor([1.0 + 2 ** -7, 256.0 - 4.0, 0.0, -3.0 - 2 ** -6])
    assert gpu_fp8.bf16_steps(a, b) == 2.0  # 256 - 4 is two steps of 2 below 256; -3 - 2^-6 is one step of 2^-6
