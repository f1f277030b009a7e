"""Policy decisions that depend on the op's form or that the OpInfo suite found missing: einsum by its
equation, a matrix power by its exponent, the matrix products autocast runs low, 3-D resampling and pooling.

Each model is fed fp32 inputs (a graph input is fp32), so an op runs low only where the policy says it does;
outputs are checked against fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amppass
from amppass.fx.view.policy import einsum_form

G = torch.Generator().manual_seed(0)


class Call(nn.Module):
    """``fn(*inputs)``: one op on the graph's inputs."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def _converted(fn, *inputs, dtype="bf16"):
    model = Call(fn).eval()
    converted = amppass.convert(model, inputs, dtype=dtype, plan_for="coverage")
    rows = [r for r in amppass.report(converted).rows if not r.name.endswith(("_to_bf16", "_to_fp16", "_to_fp32"))]
    out, ref = converted(*inputs), model(*inputs)
    return rows, float((out.double() - ref.double()).norm() / ref.double().norm())


def _row(rows, op):
    return next(r for r in rows if r.op == f"aten.{op}")


@pytest.mark.parametrize("equation,form", [
    ("ij,jk->ik", "contraction"), ("bij,bjk->bik", "contraction"), ("ij,ij->i", "contraction"),
    ("ij,jk", "contraction"), ("...ij,...jk->...ik", "contraction"),
    ("ij->i", "sum"), ("ii->", "sum"), ("ii", "sum"),
    ("i,j->ij", "elementwise"), ("ij,ij->ij", "elementwise"), ("ij->ji", "elementwise"), ("ii->i", "elementwise"),
])
def test_einsum_form_reads_the_equation(equation, form):
    assert einsum_form(equation) == form


def test_einsum_runs_low_only_when_its_equation_multiplies_matrices():
    a, b = torch.randn(8, 32, generator=G), torch.randn(32, 8, generator=G)
    rows, error = _converted(lambda x, y: torch.einsum("ij,jk->ik", x, y), a, b)
    assert _row(rows, "einsum").precision == "bf16" and error < 1e-2
    rows, error = _converted(lambda x: torch.einsum("ij->i", x), a)
    assert _row(rows, "einsum").precision == "fp32" and "only sums" in _row(rows, "einsum").reason and error == 0
    rows, error = _converted(lambda x, y: torch.einsum("i,j->ij", x, y), a[0], b[0])
    einsum = _row(rows, "einsum")  # an outer product of fp32 inputs follows them
    assert einsum.precision == "fp32" and "sums nothing" in einsum.reason and error == 0


def test_matrix_power_runs_low_for_non_negative_exponents_only():
    a = torch.randn(8, 8, generator=G) / 4 + torch.eye(8)
    rows, error = _converted(lambda x: torch.linalg.matrix_power(x, 3), a)
    assert _row(rows, "linalg_matrix_power").precision == "bf16" and error < 2e-2
    rows, error = _converted(lambda x: torch.linalg.matrix_power(x, -2), a)
    power = _row(rows, "linalg_matrix_power")
    assert power.precision == "fp32" and "negative exponent" in power.reason and error == 0


@pytest.mark.parametrize("op,fn,shapes", [
    ("linalg_multi_dot", lambda a, b, c: torch.linalg.multi_dot([a, b, c]), [(8, 16), (16, 16), (16, 4)]),
    ("linalg_vecdot", lambda a, b: torch.linalg.vecdot(a, b), [(8, 64), (8, 64)]),
    ("mv", torch.mv, [(8, 64), (64,)]),
    ("addmv", torch.addmv, [(8,), (8, 64), (64,)]),
    ("tensordot", lambda a, b: torch.tensordot(a, b, dims=1), [(8, 64), (64, 4)]),
])
def test_matrix_products_run_low_with_their_reason(op, fn, shapes):
    inputs = [torch.randn(s, generator=G) for s in shapes]
    rows, error = _converted(fn, *inputs)
    row = _row(rows, op)
    assert row.precision == "bf16" and "fp32" in row.reason and "not in the policy table" not in row.reason
    assert error < 1e-2


def test_native_multi_head_attention_runs_low():
    n = 8
    q, k, v = (torch.randn(2, n, n, generator=G) for _ in range(3))
    weights = (torch.randn(3 * n, n, generator=G) / 3, torch.randn(3 * n, generator=G),
               torch.randn(n, n, generator=G) / 3, torch.randn(n, generator=G))
    rows, error = _converted(lambda a, b, c, w, wb, p, pb: torch._native_multi_head_attention(
        a, b, c, n, 4, w, wb, p, pb, need_weights=False)[0], q, k, v, *weights)
    assert _row(rows, "_native_multi_head_attention").precision == "bf16" and error < 2e-2


def test_grid_sampler_3d_computes_its_coordinates_in_fp32():
    volume = torch.randn(1, 2, 4, 8, 8, generator=G)
    grid = torch.rand(1, 3, 5, 5, 3, generator=G) * 2 - 1
    lin = torch.randn(8, 8, generator=G)
    rows, error = _converted(lambda v, g, w: torch.grid_sampler_3d(v @ w, g, 0, 0, False), volume, grid, lin)
    assert _row(rows, "grid_sampler_3d").precision == "fp32" and "resampling" in _row(rows, "grid_sampler_3d").reason
    assert error < 1e-2


def test_adaptive_avg_pool3d_sums_its_windows_in_fp32():
    # torch's CPU bf16 kernel accumulates each window in bf16: 20x the output's rounding on these windows
    volume = torch.randn(2, 4, 16, 16, 16, generator=G) + 3
    lin = torch.randn(16, 16, generator=G) / 4 + torch.eye(16)
    rows, error = _converted(lambda v, w: F.adaptive_avg_pool3d(v @ w, (3, 3, 3)), volume, lin)
    pool = _row(rows, "adaptive_avg_pool3d")
    assert pool.precision == "fp32" and "sums each window in the low dtype" in pool.reason
    assert error < 5e-3  # the bf16 matmul's rounding only; the bf16 pool itself is 3e-2 off
