"""Pure-PyTorch stand-ins for torchvision's compiled ops, for tests on the CPU torch wheel.

The torchvision wheels on PyPI are built against the CUDA torch, so next to ``torch==2.13.0+cpu`` the
extension ``torchvision/_C.so`` cannot load (it links libc10_cuda.so) and ``import torchvision`` fails
with ``RuntimeError: operator torchvision::nms does not exist``. ``register()`` must run BEFORE the
first ``import torchvision`` (or anything importing it: timm, ultralytics, open_clip): when the real
extension loads it does nothing; otherwise it defines the ``torchvision::`` ops with torchvision's
own schemas, gives ``nms``, ``roi_align`` and ``_roi_align_backward`` CPU kernels that follow the C++
CPU kernels (torchvision/csrc/ops/cpu/{nms,roi_align}_kernel.cpp) and fake kernels for torch.export,
imports torchvision and turns its ``_has_ops()`` on. The other ops (roi_pool, ps_roi_*, deform_conv2d,
qnms, qroi_align) only get schemas, so torchvision imports: calling them raises
NotImplementedError. Enough for torchvision.models.detection (Faster/Mask R-CNN, RetinaNet, SSD)
and ultralytics. Test support, not product code. ``python -m tests.helpers.torchvision_ops`` runs
a self-check against brute-force loops.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import torch

_state: dict = {}

# the schemas declared in torchvision/csrc/ops/*.cpp (identical in torchvision 0.28)
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width,"
    " int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width,"
    " int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale,"
    " int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width,"
    " int sampling_ratio, bool aligned) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width)"
    " -> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height,"
    " SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width,"
    " int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale,"
    " SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels,"
    " SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width)"
    " -> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale,"
    " SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height,"
    " SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h,"
    " SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups,"
    " SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask,"
    " Tensor bias, SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h,"
    " SymInt dilation_w, SymInt groups, SymInt offset_groups, bool use_mask)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


# ---------------------------------------------------------------------------------------------- nms
def nms_cpu(dets: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Greedy NMS as torchvision's CPU kernel: visit boxes by descending score, keep a box unless a
    kept box overlaps it with IoU > iou_threshold; returns kept indices in that order (int64)."""
    torch._check(dets.dim() == 2 and dets.size(1) == 4, lambda: f"boxes must be [N, 4], got {tuple(dets.shape)}")
    torch._check(scores.dim() == 1 and scores.size(0) == dets.size(0), lambda: "scores must be [N]")
    torch._check(dets.dtype == scores.dtype, lambda: "dets should have the same type as scores")
    n = dets.size(0)
    if n == 0:
        return torch.empty(0, dtype=torch.long, device=dets.device)
    order = torch.sort(scores.detach(), descending=True, stable=True).indices
    x1, y1, x2, y2 = dets.detach()[order].unbind(1)
    areas = (x2 - x1) * (y2 - y1)  # the same float ops, in the same order, as the C++ kernel
    w = (torch.minimum(x2[:, None], x2[None, :]) - torch.maximum(x1[:, None], x1[None, :])).clamp(min=0)
    h = (torch.minimum(y2[:, None], y2[None, :]) - torch.maximum(y1[:, None], y1[None, :])).clamp(min=0)
    inter = w * h
    over = (inter / (areas[:, None] + areas[None, :] - inter) > iou_threshold).triu_(1).cpu().numpy()
    suppressed = np.zeros(n, dtype=bool)
    keep = []
    for i in range(n):  # in score order: keep i unless a kept box suppressed it, then suppress its overlaps
        if not suppressed[i]:
            keep.append(i)
            suppressed |= over[i]
    return order[torch.tensor(keep, dtype=torch.long, device=dets.device)]


def _nms_fake(dets, scores, iou_threshold):
    torch._check(dets.dim() == 2 and dets.size(1) == 4, lambda: "boxes must be [N, 4]")
    torch._check(scores.dim() == 1 and scores.size(0) == dets.size(0), lambda: "scores must be [N]")
    n = torch.library.get_ctx().new_dynamic_size()
    return dets.new_empty(n, dtype=torch.long)


# ---------------------------------------------------------------------------------------- roi_align
def _roi_align_samples(rois, spatial_scale, ph, pw, sampling_ratio, aligned, height, width, dtype):
    """Per ROI, the 4 bilinear neighbours and weights of every sampling point, as the C++ kernel's
    pre_calc_for_bilinear_interpolate. Returns (batch_idx [K], pos [4, K, S], w [4, K, S], count [K], shape)
    with S = PH*GH*PW*GW, GH/GW the largest sampling grid (points past a ROI's own grid weigh 0)."""
    dev = rois.device
    rois = rois.to(dtype)
    k = rois.size(0)
    off = 0.5 if aligned else 0.0
    start_w = rois[:, 1] * spatial_scale - off
    start_h = rois[:, 2] * spatial_scale - off
    roi_w = rois[:, 3] * spatial_scale - off - start_w
    roi_h = rois[:, 4] * spatial_scale - off - start_h
    if not aligned:  # force malformed ROIs to be 1x1
        roi_w = roi_w.clamp(min=1.0)
        roi_h = roi_h.clamp(min=1.0)
    bin_h = roi_h / ph
    bin_w = roi_w / pw
    if sampling_ratio > 0:
        grid_h = torch.full((k,), sampling_ratio, dtype=torch.long, device=dev)
        grid_w = grid_h
    else:
        grid_h = torch.nan_to_num(torch.ceil(roi_h / ph), nan=0.0).to(torch.long)
        grid_w = torch.nan_to_num(torch.ceil(roi_w / pw), nan=0.0).to(torch.long)
    count = (grid_h * grid_w).clamp(min=1)
    gh = max(int(grid_h.max()) if k else 1, 1)
    gw = max(int(grid_w.max()) if k else 1, 1)

    def axis(start, bin_size, grid, pooled, g, size):
        p = torch.arange(pooled, device=dev, dtype=dtype)
        i = torch.arange(g, device=dev)
        c = (start[:, None, None] + p[None, :, None] * bin_size[:, None, None]
             + (i[None, None, :] + 0.5).to(dtype) * bin_size[:, None, None] / grid[:, None, None].to(dtype))
        inside = (c >= -1.0) & (c <= size)  # NaN fails both: such a point weighs 0, as in C++
        used = (i[None, :] < grid[:, None])[:, None, :]  # [K, 1, G]
        c = torch.where(inside, c, 0.0).clamp(min=0.0)
        low = c.to(torch.long)
        top = low >= size - 1
        high = torch.where(top, size - 1, low + 1)
        low = torch.where(top, size - 1, low)
        c = torch.where(top, low.to(dtype), c)
        lw = c - low
        hw = 1.0 - lw
        return low, high, hw, lw, inside & used  # each [K, P, G]

    yl, yh, wyl, wyh, ok_y = axis(start_h, bin_h, grid_h, ph, gh, height)
    xl, xh, wxl, wxh, ok_x = axis(start_w, bin_w, grid_w, pw, gw, width)

    def outer(a, b):  # [K, PH, GH] x [K, PW, GW] -> [K, S] in (ph, iy, pw, ix) order
        return (a[:, :, :, None, None] * b[:, None, None, :, :]).reshape(k, -1)

    ok = outer(ok_y, ok_x)
    pos = torch.stack([(a[:, :, :, None, None] * width + b[:, None, None, :, :]).reshape(k, -1)
                       for a, b in ((yl, xl), (yl, xh), (yh, xl), (yh, xh))])  # flat y * W + x
    w = torch.stack([outer(wyl, wxl), outer(wyl, wxh), outer(wyh, wxl), outer(wyh, wxh)])
    w = torch.where(ok[None], w, 0.0)
    pos = torch.where(ok[None], pos, 0)
    batch = rois[:, 0].to(torch.long)  # (int) cast: truncation
    return batch, pos, w, count, (gh, gw)


_CHUNK = 64  # ROIs per step: bounds the [chunk, S, C] gathers


def roi_align_cpu(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    """RoIAlign forward with the semantics of torchvision's CPU kernel (average of bilinear samples)."""
    torch._check(rois.dim() == 2 and rois.size(1) == 5, lambda: "rois must have shape as Tensor[K, 5]")
    torch._check(input.dtype == rois.dtype, lambda: "input should have the same type as rois")
    n, c, height, width = input.shape
    k = rois.size(0)
    ph, pw = int(pooled_height), int(pooled_width)
    out = input.new_zeros((k, c, ph, pw))
    if out.numel() == 0:
        return out
    flat = input.reshape(n, c, height * width).transpose(1, 2)  # [N, HW, C]
    for s in range(0, k, _CHUNK):
        r = rois[s:s + _CHUNK]
        batch, pos, w, count, (gh, gw) = _roi_align_samples(
            r, spatial_scale, ph, pw, sampling_ratio, aligned, height, width, input.dtype)
        val = sum(w[i][..., None] * flat[batch[:, None], pos[i]] for i in range(4))  # [k, S, C]
        val = val.reshape(r.size(0), ph, gh, pw, gw, c).sum((2, 4))  # [k, PH, PW, C]
        out[s:s + _CHUNK] = (val / count[:, None, None, None].to(val.dtype)).permute(0, 3, 1, 2)
    return out


def roi_align_backward_cpu(grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels,
                           height, width, sampling_ratio, aligned):
    torch._check(grad.dtype == rois.dtype, lambda: "grad should have the same type as rois")
    height, width = int(height), int(width)
    ph, pw = int(pooled_height), int(pooled_width)
    gin = grad.new_zeros((int(batch_size), height * width, int(channels)))
    for s in range(0, rois.size(0), _CHUNK):
        r = rois[s:s + _CHUNK]
        batch, pos, w, count, (gh, gw) = _roi_align_samples(
            r, spatial_scale, ph, pw, sampling_ratio, aligned, height, width, grad.dtype)
        g = grad[s:s + _CHUNK].permute(0, 2, 3, 1) / count[:, None, None, None].to(grad.dtype)  # [k, PH, PW, C]
        g = g[:, :, None, :, None, :].expand(-1, ph, gh, pw, gw, -1).reshape(r.size(0), -1, g.size(-1))
        for i in range(4):
            gin.index_put_((batch[:, None].expand_as(pos[i]), pos[i]), w[i][..., None] * g, accumulate=True)
    return gin.transpose(1, 2).reshape(int(batch_size), int(channels), height, width).contiguous()


def _roi_align_fake(input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned):
    torch._check(rois.size(1) == 5, lambda: "rois must have shape as Tensor[K, 5]")
    torch._check(input.dtype == rois.dtype, lambda: "input should have the same type as rois")
    return input.new_empty((rois.size(0), input.size(1), pooled_height, pooled_width))


def _roi_align_backward_fake(grad, rois, spatial_scale, pooled_height, pooled_width, batch_size, channels,
                             height, width, sampling_ratio, aligned):
    torch._check(grad.dtype == rois.dtype, lambda: "grad should have the same type as rois")
    return grad.new_empty((batch_size, channels, height, width))


def _roi_align_setup_context(ctx, inputs, output):
    input, rois, spatial_scale, pooled_height, pooled_width, sampling_ratio, aligned = inputs
    ctx.save_for_backward(rois)
    ctx.args = (spatial_scale, pooled_height, pooled_width, *input.shape, sampling_ratio, aligned)


def _roi_align_autograd_backward(ctx, grad):
    (rois,) = ctx.saved_tensors
    return (torch.ops.torchvision._roi_align_backward(grad, rois, *ctx.args),) + (None,) * 6


def _not_on_cpu(name):
    def kernel(*args, **kwargs):
        raise NotImplementedError(f"torchvision::{name} has no CPU kernel in tests/helpers/torchvision_ops.py")
    return kernel


# ------------------------------------------------------------------------------------ registration
def _ops_defined() -> bool:
    """torchvision::nms exists: the real extension loaded, or register() ran (maybe from another copy of
    this file, e.g. one loaded under another module name by an import hook)."""
    try:
        torch.ops.torchvision.nms  # noqa: B018 - the look-up is the probe: it raises where nms is not registered
    except (AttributeError, RuntimeError):
        return False
    return True


def _has_ops() -> bool:
    """torchvision's check for its ops, answered yes: a plain function, which TorchScript can compile (the
    TorchScript ONNX exporter scripts the detection code that calls it)."""
    return True


def register() -> bool:
    """Make ``import torchvision`` work on the CPU torch. Idempotent; call before torchvision is
    imported. Returns True when the stand-in ops are in use, False when the real extension loaded."""
    if "done" in _state:
        return _state["done"]
    if "torchvision" not in sys.modules and not _ops_defined():
        spec = importlib.util.find_spec("torchvision")  # NB: an import hook may run register() right here
        if spec is None or not spec.submodule_search_locations:
            raise ImportError("torchvision is not installed")
        if "torchvision" not in sys.modules and not _ops_defined():
            so = os.path.join(list(spec.submodule_search_locations)[0], "_C.so")
            try:
                torch.ops.load_library(so)  # the real ops, where the wheel matches this torch
            except OSError:
                _define()
    import torchvision

    if not torchvision.extension._has_ops():
        raise RuntimeError("torchvision was imported before tests.helpers.torchvision_ops.register()")
    _state["done"] = bool(getattr(torchvision.extension, "_amppass_stand_in", False))
    return _state["done"]


def _define() -> None:
    lib = torch.library.Library("torchvision", "FRAGMENT")
    _state["lib"] = lib  # a Library's registrations die with it: keep it alive
    for schema in _SCHEMAS:
        lib.define(schema)
    lib.impl("nms", nms_cpu, "CPU")
    lib.impl("roi_align", roi_align_cpu, "CPU")
    lib.impl("_roi_align_backward", roi_align_backward_cpu, "CPU")
    for schema in _SCHEMAS:
        name = schema.split("(", 1)[0]
        if name not in ("nms", "roi_align", "_roi_align_backward"):
            lib.impl(name, _not_on_cpu(name), "CPU")
    # torchvision's _meta_registrations adds the fake nms/qnms itself (and would refuse a second one);
    # its Meta kernels for the rest are skipped while _has_ops() is False, so these are ours.
    torch.library.register_fake("torchvision::roi_align", _roi_align_fake, lib=lib)
    torch.library.register_fake("torchvision::_roi_align_backward", _roi_align_backward_fake, lib=lib)

    import torchvision

    tv_roi_align = sys.modules["torchvision.ops.roi_align"]  # the module (torchvision.ops.roi_align is the function)
    torchvision.extension._has_ops = _has_ops  # _assert_has_ops() reads this global
    tv_roi_align._has_ops = _has_ops  # imported by name: else roi_align takes a torch.compile'd path
    torchvision.extension._amppass_stand_in = True
    if not torch._C._dispatch_has_kernel_for_dispatch_key("torchvision::nms", "Meta"):  # fake nms is a Meta kernel
        torch.library.register_fake("torchvision::nms", _nms_fake, lib=lib)
    torch.library.register_autograd("torchvision::roi_align", _roi_align_autograd_backward,
                                    setup_context=_roi_align_setup_context, lib=lib)
    # autocast as the C++ build registers it for nms and roi_align (run in fp32, cast back)
    reg = getattr(torchvision, "_autograd_registrations", None)
    if reg is not None and hasattr(reg, "_autocast_nms") and hasattr(reg, "_autocast_roi_align"):
        for key in ("AutocastCPU", "AutocastCUDA"):
            lib.impl("nms", reg._autocast_nms, key)
            lib.impl("roi_align", reg._autocast_roi_align, key)


# ------------------------------------------------------------------------------------- self-check
def _nms_brute(boxes, scores, thr):
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    b = boxes.tolist()

    def iou(p, q):
        iw = max(0.0, min(p[2], q[2]) - max(p[0], q[0]))
        ih = max(0.0, min(p[3], q[3]) - max(p[1], q[1]))
        inter = iw * ih
        return inter / ((p[2] - p[0]) * (p[3] - p[1]) + (q[2] - q[0]) * (q[3] - q[1]) - inter)

    keep = []
    for i in order:
        if all(iou(b[i], b[j]) <= thr for j in keep):
            keep.append(i)
    return keep


def _roi_align_brute(inp, rois, scale, ph, pw, sr, aligned):
    """Per-sample loops transcribed from roi_align_kernel.cpp / roi_align_common.h (float64)."""
    import math

    n, c, h, w = inp.shape
    x = inp.double()
    out = torch.zeros(rois.size(0), c, ph, pw, dtype=torch.float64)
    for k, r in enumerate(rois.double().tolist()):
        b = int(r[0])
        off = 0.5 if aligned else 0.0
        sw, sh, ew, eh = (r[1] * scale - off, r[2] * scale - off, r[3] * scale - off, r[4] * scale - off)
        rw, rh = ew - sw, eh - sh
        if not aligned:
            rw, rh = max(rw, 1.0), max(rh, 1.0)
        bh, bw = rh / ph, rw / pw
        gh = sr if sr > 0 else math.ceil(rh / ph)
        gw = sr if sr > 0 else math.ceil(rw / pw)
        cnt = max(gh * gw, 1)
        for i in range(ph):
            for j in range(pw):
                acc = torch.zeros(c, dtype=torch.float64)
                for iy in range(gh):
                    yy = sh + i * bh + (iy + 0.5) * bh / gh
                    for ix in range(gw):
                        xx = sw + j * bw + (ix + 0.5) * bw / gw
                        if not (-1.0 <= yy <= h and -1.0 <= xx <= w):
                            continue
                        y, xq = max(yy, 0.0), max(xx, 0.0)
                        yl, xl = int(y), int(xq)
                        if yl >= h - 1:
                            yl = yh = h - 1
                            y = float(yl)
                        else:
                            yh = yl + 1
                        if xl >= w - 1:
                            xl = xh = w - 1
                            xq = float(xl)
                        else:
                            xh = xl + 1
                        ly, lx = y - yl, xq - xl
                        acc += ((1 - ly) * (1 - lx) * x[b, :, yl, xl] + (1 - ly) * lx * x[b, :, yl, xh]
                                + ly * (1 - lx) * x[b, :, yh, xl] + ly * lx * x[b, :, yh, xh])
                out[k, :, i, j] = acc / cnt
    return out


def self_check(seed: int = 0) -> None:
    register()
    import torchvision

    g = torch.Generator().manual_seed(seed)
    for trial in range(20):
        n = int(torch.randint(0, 60, (1,), generator=g))
        xy = torch.rand(n, 2, generator=g) * 50
        boxes = torch.cat([xy, xy + 1 + torch.rand(n, 2, generator=g) * 30], 1)
        scores = torch.rand(n, generator=g).round(decimals=1)  # ties: stable order, as the brute force
        thr = float(torch.rand(1, generator=g)) * 0.8
        got = torchvision.ops.nms(boxes, scores, thr).tolist()
        assert got == _nms_brute(boxes, scores, thr), (trial, got)
        idx = torch.randint(0, 3, (n,), generator=g)
        got = torchvision.ops.batched_nms(boxes, scores, idx, thr)
        assert got.dtype == torch.long
    inp = torch.randn(2, 3, 10, 12, generator=g)
    xy = torch.rand(9, 2, generator=g) * 14 - 3  # some ROIs reach past the map: zero samples
    rois = torch.cat([torch.randint(0, 2, (9, 1), generator=g).float(), xy,
                      xy + torch.rand(9, 2, generator=g) * 12 - 1], 1)  # some malformed (x2 < x1)
    for scale in (1.0, 0.5):
        for sr in (-1, 0, 2, 3):
            for aligned in (False, True):
                ref = _roi_align_brute(inp, rois, scale, 3, 4, sr, aligned)
                got = torchvision.ops.roi_align(inp, rois, (3, 4), scale, sr, aligned)
                torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
                got64 = torch.ops.torchvision.roi_align(inp.double(), rois.double(), scale, 3, 4, sr, aligned)
                torch.testing.assert_close(got64, ref, rtol=1e-10, atol=1e-10)
                # backward: roi_align is linear in the input, so its gradient must be the adjoint map,
                # <roi_align(x), g> == <x, grad_x> for every x and g (float64, exact up to rounding)
                x = torch.randn(inp.shape, generator=g, dtype=torch.float64, requires_grad=True)
                gout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
                y = torchvision.ops.roi_align(x, rois.double(), (3, 4), scale, sr, aligned)
                (gx,) = torch.autograd.grad(y, x, gout)
                torch.testing.assert_close((y * gout).sum(), (x * gx).sum(), rtol=1e-10, atol=1e-10)
    # the fake kernels: torch.export sees a data-dependent nms length and a roi_align of the right shape
    class M(torch.nn.Module):
        def forward(self, feat, boxes, scores):
            keep = torchvision.ops.nms(boxes, scores, 0.5)
            r = torchvision.ops.roi_align(feat, [boxes[keep]], (2, 2), 0.5, 2, True)
            return r.sum((1, 2, 3))

    m = M()
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 30, 30]])
    args = (torch.randn(1, 4, 16, 16), boxes, torch.tensor([0.9, 0.8, 0.7]))
    ep = torch.export.export(m, args, strict=False)
    torch.testing.assert_close(ep.module()(*args), m(*args))


if __name__ == "__main__":
    self_check()
    print("torchvision_ops self-check passed")
