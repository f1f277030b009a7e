"""Where the conversion time of a large 3D model goes: a 3D Swin segmentation net (the shape of MONAI's SwinUNETR:
a Conv3d patch embedding, four stages of shifted-window attention over 3D windows with patch merging, a
ConvTranspose3d decoder with skips), built from code with random weights, converted to bf16 with
``plan_for="coverage"`` (no kernel timed: the time is amppass's own) under cProfile.

Rows: the whole conversion, then amppass's functions with the most cumulative time, each with its module (the
stage: ``fx.capture`` for torch.export, ``fx.prepare``, ``analysis`` for the plan, ``fx.rewrite``, ``serving``)
and its calls; then the functions of any package with the most time of their own. The same conversion is timed
with every input dimension dynamic (``dynamic_shapes`` all ``Dim.AUTO``: amppass's default before it kept the
spatial sizes of image and volume inputs static) and with ``dynamic_shapes=None`` (every size fixed at the
example's): with the depth, height and width dynamic nearly all the time is torch.export's symbolic-shape
reasoning (sympy) over the window partitions, not amppass's planning. Each conversion is timed in wall and CPU
seconds (this process, user+sys: what a loaded machine does not inflate). ``--quick`` builds a smaller net (one
stage, 8³ input, window 2), converts nothing first to warm torch up and leaves out the conversion with every
dimension dynamic (~18 CPU s even for that net); ``--full`` SwinUNETR's sizes on a 64³ input (feature size 48, depths
2-2-2-2, heads 3-6-12-24, window 4).

Run: ``python -m benchmarks.conversion_profile [--full]``.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from typing import Any, Callable

import torch
from torch import nn
from torch.export import Dim

import amppass

NOTES = ("`cum_s`: time in the function and what it calls (cProfile, which slows Python code, so the whole is "
         "also timed without it: `convert_s` wall, `cpu_s` CPU seconds of this process); `stage`: the amppass "
         "module the function is in; `self_s`: time spent in the function itself, for the functions of any package "
         "with the most.")
TOP = 12
SELF_TOP = 6  # functions with the most time of their own, in any package


class _WindowAttention(nn.Module):
    def __init__(self, dim: int, heads: int, window: int):
        super().__init__()
        self.heads, self.window, self.scale = heads, window, (dim // heads) ** -0.5
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.randn(heads, window ** 3, window ** 3) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, D, H, W, C)
        b, d, h, w, c = x.shape
        s = self.window
        tokens = x.view(b, d // s, s, h // s, s, w // s, s, c).permute(0, 1, 3, 5, 2, 4, 6, 7).reshape(-1, s ** 3, c)
        n = tokens.shape[0]
        q, k, v = self.qkv(tokens).reshape(n, s ** 3, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attention = ((q @ k.transpose(-2, -1)) * self.scale + self.bias).softmax(-1)
        out = self.proj((attention @ v).transpose(1, 2).reshape(n, s ** 3, c))
        return out.view(b, d // s, h // s, w // s, s, s, s, c).permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, d, h, w, c)


class _SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, shift: bool):
        super().__init__()
        self.shift = window // 2 if shift else 0
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = _WindowAttention(dim, heads, window)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        if self.shift:
            y = torch.roll(y, (-self.shift,) * 3, dims=(1, 2, 3))
        y = self.attention(y)
        if self.shift:
            y = torch.roll(y, (self.shift,) * 3, dims=(1, 2, 3))
        x = x + y
        return x + self.mlp(self.norm2(x))


class _Merge(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.reduce = nn.LayerNorm(8 * dim), nn.Linear(8 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [x[:, i::2, j::2, k::2, :] for i in (0, 1) for j in (0, 1) for k in (0, 1)]
        return self.reduce(self.norm(torch.cat(parts, -1)))


class SwinSeg3d(nn.Module):
    """A 3D Swin encoder with a convolutional decoder, as SwinUNETR composes them."""

    def __init__(self, feature: int = 48, depths=(2, 2, 2, 2), heads=(3, 6, 12, 24), window: int = 4,
                 classes: int = 14):
        super().__init__()
        self.embed = nn.Conv3d(1, feature, 2, stride=2)
        self.stages, self.merges, self.ups = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        dims = [feature * 2 ** i for i in range(len(depths))]
        for dim, depth, count in zip(dims, depths, heads, strict=False):
            self.stages.append(nn.Sequential(*(_SwinBlock(dim, count, window, i % 2 == 1) for i in range(depth))))
            self.merges.append(_Merge(dim))
        for dim in reversed(dims):
            self.ups.append(nn.Sequential(nn.ConvTranspose3d(2 * dim, dim, 2, stride=2), nn.InstanceNorm3d(dim),
                                          nn.LeakyReLU(), nn.Conv3d(dim, dim, 3, padding=1)))
        self.head = nn.Sequential(nn.ConvTranspose3d(feature, feature, 2, stride=2), nn.Conv3d(feature, classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.embed(x).permute(0, 2, 3, 4, 1)
        skips = []
        for stage, merge in zip(self.stages, self.merges, strict=False):
            y = stage(y)
            skips.append(y)
            y = merge(y)
        y = y.permute(0, 4, 1, 2, 3)
        for up, skip in zip(self.ups, reversed(skips), strict=False):
            y = up(y) + skip.permute(0, 4, 1, 2, 3)
        return self.head(y)


def build(quick: bool) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The net and its example input: small for ``quick``, SwinUNETR's sizes otherwise."""
    torch.manual_seed(0)
    if quick:
        return SwinSeg3d(feature=12, depths=(2,), heads=(3,), window=2).eval(), (torch.randn(1, 1, 8, 8, 8),)
    return SwinSeg3d().eval(), (torch.randn(1, 1, 64, 64, 64),)


def run(quick: bool) -> list[dict[str, Any]]:
    """The conversion timed plainly, then under cProfile: the whole, then amppass's heaviest functions."""
    model, inputs = build(quick)
    if not quick:
        warm = nn.Sequential(nn.Conv3d(1, 2, 1), nn.GELU()).eval()  # torch's first-use imports, outside every figure
        amppass.convert(warm, (torch.randn(1, 1, 2, 2, 2),), "bf16", plan_for="coverage")
    converted, plain, plain_cpu = _timed(lambda: amppass.convert(model, inputs, "bf16", plan_for="coverage"))
    nodes = len(amppass.report(converted).rows)
    profile = cProfile.Profile()
    profile.enable()
    amppass.convert(model, inputs, "bf16", plan_for="coverage")
    profile.disable()
    stats = pstats.Stats(profile)
    rows = [{"function": "amppass.convert (whole)", "stage": f"{nodes} planned nodes; batch dynamic, spatial sizes "
             "static (the default)", "calls": 1, "cum_s": round(stats.total_tt, 2), "convert_s": round(plain, 2),
             "cpu_s": round(plain_cpu, 2)}]

    def timed_row(function: str, stage: str, shapes: Any) -> dict[str, Any]:
        _, wall, cpu = _timed(lambda: amppass.convert(model, inputs, "bf16", plan_for="coverage",
                                                      dynamic_shapes=shapes))
        return {"function": function, "stage": stage, "calls": 1, "convert_s": round(wall, 2), "cpu_s": round(cpu, 2)}

    every = {"x": dict.fromkeys(range(inputs[0].ndim), Dim.AUTO)}
    dynamic = ("amppass.convert(dynamic_shapes=every dim Dim.AUTO)", "the same, depth, height and width dynamic too")
    rows.append({"function": dynamic[0], "stage": f"{dynamic[1]} (not measured in --quick)", "calls": 1} if quick
                else timed_row(*dynamic, every))
    rows.append(timed_row("amppass.convert(dynamic_shapes=None)", "the same, exported at the example's sizes", None))
    found = []
    for (path, _line, function), (_, calls, _, cumulative, _) in stats.stats.items():
        if "/amppass/" in path and function != "convert":
            module = path.rsplit("/amppass/", 1)[1].removesuffix(".py").replace("/", ".")
            found.append((cumulative, function, module, calls))
    for cumulative, function, module, calls in sorted(found, reverse=True)[:TOP]:
        rows.append({"function": function, "stage": module, "calls": calls, "cum_s": round(cumulative, 2)})
    own = sorted(((own, path, function, calls) for (path, _, function), (_, calls, own, _, _) in stats.stats.items()),
                 reverse=True)[:SELF_TOP]
    for seconds, path, function, calls in own:  # where the time itself is spent, whoever's code it is
        where = path.rsplit("/site-packages/", 1)[-1].removesuffix(".py").replace("/", ".")
        rows.append({"function": function, "stage": f"self time in {where}", "calls": calls,
                     "self_s": round(seconds, 2)})
    return rows


def _timed(call: Callable[[], Any]) -> tuple[Any, float, float]:
    """What ``call()`` returns, and its wall and CPU seconds (this process, user+sys)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = call()
    return result, time.perf_counter() - wall, time.process_time() - cpu


if __name__ == "__main__":
    for row in run(quick="--full" not in sys.argv):
        print(row)
