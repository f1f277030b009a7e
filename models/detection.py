"""Detectors built from code: a small two-stage (Faster R-CNN style) object detector whose post-processing has
data-dependent control flow, and a DB (differentiable binarization) text detector with a ResNet-18-vd backbone.

Weights are random: callers seed the global RNG (:func:`models.arch.build_arch` does).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from models.blocks import ConvBNAct, damp
from models.zoo import _randomize_batchnorm

# Box regression deltas larger than this (log of a 1000/16 size ratio) would make exp() overflow.
_MAX_LOG_SCALE = math.log(1000.0 / 16)


def _upsample_to(x: torch.Tensor, like: torch.Tensor, mode: str = "nearest") -> torch.Tensor:
    return F.interpolate(x, size=like.shape[-2:], mode=mode)


class DetectorBackbone(nn.Module):
    """Conv-BN-ReLU stages returning feature maps at strides 4, 8 and 16 (32, 64 and 128 channels)."""

    def __init__(self, widths: tuple[int, int, int] = (32, 64, 128)):
        super().__init__()
        c2, c3, c4 = widths
        self.stem = nn.Sequential(ConvBNAct(3, c2, 3, 2), ConvBNAct(c2, c2, 3, 2))
        self.stage2 = nn.Sequential(ConvBNAct(c2, c2), ConvBNAct(c2, c2))
        self.stage3 = nn.Sequential(ConvBNAct(c2, c3, 3, 2), ConvBNAct(c3, c3))
        self.stage4 = nn.Sequential(ConvBNAct(c3, c4, 3, 2), ConvBNAct(c4, c4))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        c2 = self.stage2(self.stem(x))
        c3 = self.stage3(c2)
        return [c2, c3, self.stage4(c3)]


class TinyFPN(nn.Module):
    """Feature pyramid: 1x1 laterals to a common width, top-down nearest upsampling and addition, and a 3x3
    conv on every level."""

    def __init__(self, in_channels: tuple[int, ...], width: int):
        super().__init__()
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1) for c in in_channels)
        self.smooth = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1) for _ in in_channels)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        laterals = [conv(f) for conv, f in zip(self.lateral, features, strict=False)]
        for i in range(len(laterals) - 2, -1, -1):
            laterals[i] = laterals[i] + _upsample_to(laterals[i + 1], laterals[i])
        return [conv(f) for conv, f in zip(self.smooth, laterals, strict=False)]


class RPNHead(nn.Module):
    """Shared 3x3 conv, then per anchor an objectness logit and four box deltas, on every pyramid level."""

    def __init__(self, width: int, anchors: int):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.objectness = nn.Conv2d(width, anchors, 1)
        self.deltas = nn.Conv2d(width, 4 * anchors, 1)

    def forward(self, features: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for f in features:
            h = F.relu(self.conv(f))
            out.append((self.objectness(h), self.deltas(h)))
        return out


class BoxHead(nn.Module):
    """Two fully connected layers over pooled RoI features, then class logits (background first) and
    class-specific box deltas."""

    def __init__(self, in_features: int, hidden: int, num_classes: int):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.cls = nn.Linear(hidden, num_classes + 1)
        self.box = nn.Linear(hidden, 4 * (num_classes + 1))

    def forward(self, rois: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(rois.flatten(1))
        return self.cls(h), self.box(h)


def grid_anchors(height: int, width: int, stride: int, size: float, ratios: tuple[float, ...],
                 device: torch.device) -> torch.Tensor:
    """Anchors (height * width * len(ratios), 4) as x1, y1, x2, y2, centred on every cell, ordered by row,
    column, then ratio (height / width)."""
    r = torch.tensor(ratios, device=device)
    half = torch.stack([size / r.sqrt(), size * r.sqrt()], 1) / 2
    base = torch.cat([-half, half], 1)
    ys = (torch.arange(height, device=device) + 0.5) * stride
    xs = (torch.arange(width, device=device) + 0.5) * stride
    cy, cx = torch.meshgrid(ys, xs, indexing="ij")
    centres = torch.stack([cx, cy, cx, cy], -1).reshape(-1, 1, 4)
    return (centres + base).reshape(-1, 4)


def decode_boxes(deltas: torch.Tensor, boxes: torch.Tensor, weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
                 ) -> torch.Tensor:
    """Apply (dx, dy, dw, dh) deltas to x1, y1, x2, y2 boxes (shapes broadcast; last axis 4)."""
    size = boxes[..., 2:] - boxes[..., :2]
    centre = boxes[..., :2] + 0.5 * size
    d = deltas / deltas.new_tensor(weights)
    new_centre = centre + d[..., :2] * size
    new_size = torch.exp(d[..., 2:].clamp(max=_MAX_LOG_SCALE)) * size
    return torch.cat([new_centre - 0.5 * new_size, new_centre + 0.5 * new_size], -1)


def clip_boxes(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    x = boxes[..., 0::2].clamp(0, width)
    y = boxes[..., 1::2].clamp(0, height)
    return torch.stack([x[..., 0], y[..., 0], x[..., 1], y[..., 1]], -1)


def box_iou(box: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """IoU of one box (4,) with each of ``boxes`` (N, 4)."""
    top_left = torch.maximum(box[:2], boxes[:, :2])
    bottom_right = torch.minimum(box[2:], boxes[:, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(1)
    area = (box[2:] - box[:2]).prod()
    areas = (boxes[:, 2:] - boxes[:, :2]).prod(1)
    return inter / (area + areas - inter).clamp(min=1e-9)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float, limit: int) -> torch.Tensor:
    """Greedy non-maximum suppression: indices of at most ``limit`` kept boxes, best score first.

    The loop runs once per kept box, a count that depends on the boxes' values.
    """
    order = scores.argsort(descending=True)
    keep = []
    while order.numel() > 0 and len(keep) < limit:
        best, rest = order[0], order[1:]
        keep.append(best)
        order = rest[box_iou(boxes[best], boxes[rest]) <= iou_threshold]
    return torch.stack(keep) if keep else scores.new_zeros(0, dtype=torch.long)


def roi_align(feature: torch.Tensor, boxes: torch.Tensor, stride: int, size: int = 7, samples: int = 2
              ) -> torch.Tensor:
    """Pool ``feature`` (1, C, H, W) inside each box (N, 4, image coordinates) to (N, C, size, size): bilinear
    samples on a ``size * samples`` square grid (``F.grid_sample``), averaged in ``samples x samples`` bins."""
    n = size * samples
    t = (torch.arange(n, device=boxes.device) + 0.5) / n
    xs = boxes[:, 0:1] + t * (boxes[:, 2:3] - boxes[:, 0:1])
    ys = boxes[:, 1:2] + t * (boxes[:, 3:4] - boxes[:, 1:2])
    height, width = feature.shape[-2:]
    # grid_sample (align_corners=False) maps -1..1 to the outer edges of the map: feature pixel j spans
    # image pixels [j * stride, (j + 1) * stride)
    gx = xs / (stride * width) * 2 - 1
    gy = ys / (stride * height) * 2 - 1
    grid = torch.stack([gx[:, None, :].expand(-1, n, n), gy[:, :, None].expand(-1, n, n)], -1)
    sampled = F.grid_sample(feature.expand(len(boxes), -1, -1, -1), grid, mode="bilinear", align_corners=False)
    return F.avg_pool2d(sampled, samples)


class TwoStageDetector(nn.Module):
    """A small Faster R-CNN with FPN: backbone -> 3-level FPN -> RPN (3 anchor ratios per cell, one anchor size
    per level) -> box decoding, per-level top-k and NMS -> RoI-align of each proposal on the level its size maps
    to -> box head -> class-aware NMS of the class-specific boxes.

    ``forward(images)`` returns ``(boxes, scores, labels)`` of shapes (B, D, 4), (B, D), (B, D) with D =
    ``detections``: each image's detections by descending score, padded with zero boxes and scores and label
    -1 when fewer survive. Labels count from 1 (0 is background). The post-processing loops over images and
    over NMS survivors in Python, so ``torch.export`` cannot capture the whole model; ``backbone``, ``fpn``,
    ``rpn`` and ``box_head`` are plain modules that it can.
    """

    def __init__(self, num_classes: int = 10, width: int = 64, anchor_sizes: tuple[float, ...] = (32, 64, 128),
                 ratios: tuple[float, ...] = (0.5, 1.0, 2.0), pre_nms: int = 300, proposals: int = 100,
                 detections: int = 20, roi_size: int = 7):
        super().__init__()
        self.strides = (4, 8, 16)
        self.anchor_sizes, self.ratios = anchor_sizes, ratios
        self.pre_nms, self.proposals, self.detections, self.roi_size = pre_nms, proposals, detections, roi_size
        self.backbone = DetectorBackbone()
        self.fpn = TinyFPN((32, 64, 128), width)
        self.rpn = RPNHead(width, len(ratios))
        self.box_head = BoxHead(width * roi_size * roi_size, 256, num_classes)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        height, width = images.shape[-2:]
        features = self.fpn(self.backbone(images))
        rpn = self.rpn(features)
        anchors = [grid_anchors(f.shape[-2], f.shape[-1], s, a, self.ratios, images.device)
                   for f, s, a in zip(features, self.strides, self.anchor_sizes, strict=False)]
        outputs = [self._detect([f[b:b + 1] for f in features],
                                [(obj[b], dlt[b]) for obj, dlt in rpn], anchors, height, width)
                   for b in range(images.shape[0])]
        boxes, scores, labels = zip(*outputs, strict=False)
        return torch.stack(boxes), torch.stack(scores), torch.stack(labels)

    def _proposals(self, rpn: list[tuple[torch.Tensor, torch.Tensor]], anchors: list[torch.Tensor],
                   height: int, width: int) -> torch.Tensor:
        boxes, scores = [], []
        for (objectness, deltas), level_anchors in zip(rpn, anchors, strict=False):
            # (A, H, W) and (4A, H, W) -> one row per anchor, in grid_anchors' (row, column, ratio) order
            objectness = objectness.permute(1, 2, 0).reshape(-1)
            deltas = deltas.view(-1, 4, *deltas.shape[-2:]).permute(2, 3, 0, 1).reshape(-1, 4)
            top = objectness.topk(min(self.pre_nms, objectness.numel())).indices
            boxes.append(clip_boxes(decode_boxes(deltas[top], level_anchors[top]), height, width))
            scores.append(objectness[top].sigmoid())
        boxes, scores = torch.cat(boxes), torch.cat(scores)
        sizes = boxes[:, 2:] - boxes[:, :2]
        valid = (sizes >= 1e-3).all(1)
        boxes, scores = boxes[valid], scores[valid]
        return boxes[nms(boxes, scores, 0.7, self.proposals)]

    def _pool(self, features: list[torch.Tensor], proposals: torch.Tensor) -> torch.Tensor:
        # FPN's level rule: a box of side 224 * 2^(k - 4) pools from P_k, here clamped to P2..P4
        side = (proposals[:, 2:] - proposals[:, :2]).prod(1).sqrt()
        level = torch.floor(4 + torch.log2(side / 224 + 1e-6)).clamp(2, 4).long() - 2
        pooled = features[0].new_zeros(len(proposals), features[0].shape[1], self.roi_size, self.roi_size)
        for k, (feature, stride) in enumerate(zip(features, self.strides, strict=False)):
            chosen = (level == k).nonzero().squeeze(1)
            if chosen.numel():
                pooled[chosen] = roi_align(feature, proposals[chosen], stride, self.roi_size)
        return pooled

    def _detect(self, features: list[torch.Tensor], rpn: list[tuple[torch.Tensor, torch.Tensor]],
                anchors: list[torch.Tensor], height: int, width: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        proposals = self._proposals(rpn, anchors, height, width)
        logits, deltas = self.box_head(self._pool(features, proposals))
        classes = logits.shape[1] - 1
        scores = logits.softmax(-1)[:, 1:].reshape(-1)
        boxes = decode_boxes(deltas.view(-1, classes + 1, 4)[:, 1:], proposals[:, None], (10.0, 10.0, 5.0, 5.0))
        boxes = clip_boxes(boxes, height, width).reshape(-1, 4)
        labels = torch.arange(1, classes + 1, device=boxes.device).repeat(len(proposals))
        confident = scores > 0.05
        boxes, scores, labels = boxes[confident], scores[confident], labels[confident]
        # class-aware NMS in one pass: boxes of different classes are moved apart so they never overlap
        offsets = labels[:, None] * (max(height, width) + 1)
        keep = nms(boxes + offsets, scores, 0.5, self.detections)
        out_boxes = boxes.new_zeros(self.detections, 4)
        out_scores = scores.new_zeros(self.detections)
        out_labels = labels.new_full((self.detections,), -1)
        out_boxes[:len(keep)], out_scores[:len(keep)], out_labels[:len(keep)] = boxes[keep], scores[keep], labels[keep]
        return out_boxes, out_scores, out_labels


class ResNetBlock(nn.Module):
    """ResNet basic block; the "vd" shortcut average-pools before its 1x1 conv when it downsamples."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.branch = nn.Sequential(ConvBNAct(c_in, c_out, 3, stride), ConvBNAct(c_out, c_out, 3, act=None))
        if stride != 1 or c_in != c_out:
            pool = nn.AvgPool2d(stride, stride, ceil_mode=True) if stride != 1 else nn.Identity()
            self.shortcut = nn.Sequential(pool, ConvBNAct(c_in, c_out, 1, act=None))
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.shortcut(x) + self.branch(x))


class ResNet18vd(nn.Module):
    """ResNet-18-vd (22 convs): a stem of three 3x3 convs and a max pool, then four stages of two basic
    blocks at 64/128/256/512 channels; returns the stages' outputs (strides 4, 8, 16, 32)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(ConvBNAct(3, 32, 3, 2), ConvBNAct(32, 32), ConvBNAct(32, 64),
                                  nn.MaxPool2d(3, 2, 1))
        widths = (64, 128, 256, 512)
        self.stages = nn.ModuleList(
            nn.Sequential(ResNetBlock(c_in, c, 1 if i == 0 else 2), ResNetBlock(c, c, 1))
            for i, (c_in, c) in enumerate(zip((64,) + widths[:-1], widths, strict=False)))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self.stem(x)
        out = []
        for stage in self.stages:
            x = stage(x)
            out.append(x)
        return out


class FPNPAN(nn.Module):
    """FPN with a bottom-up path (PaddleOCR's LKPAN layout, 3x3 kernels): 1x1 laterals to 256 channels,
    top-down addition, 3x3 convs to 64, stride-2 3x3 convs adding each level into the next coarser one,
    3x3 convs per level, and every level upsampled to stride 4 and concatenated (256 channels)."""

    def __init__(self, in_channels: tuple[int, ...] = (64, 128, 256, 512), width: int = 256):
        super().__init__()
        quarter = width // 4
        self.lateral = nn.ModuleList(nn.Conv2d(c, width, 1, bias=False) for c in in_channels)
        self.top_down = nn.ModuleList(nn.Conv2d(width, quarter, 3, padding=1, bias=False) for _ in in_channels)
        self.down = nn.ModuleList(nn.Conv2d(quarter, quarter, 3, 2, 1, bias=False) for _ in in_channels[1:])
        self.bottom_up = nn.ModuleList(nn.Conv2d(quarter, quarter, 3, padding=1, bias=False) for _ in in_channels)

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        laterals = [conv(f) for conv, f in zip(self.lateral, features, strict=False)]
        for i in range(len(laterals) - 2, -1, -1):
            laterals[i] = laterals[i] + _upsample_to(laterals[i + 1], laterals[i])
        levels = [conv(f) for conv, f in zip(self.top_down, laterals, strict=False)]
        for i, conv in enumerate(self.down):
            levels[i + 1] = levels[i + 1] + conv(levels[i])
        levels = [conv(f) for conv, f in zip(self.bottom_up, levels, strict=False)]
        return [levels[0]] + [_upsample_to(f, levels[0]) for f in levels[1:]]


class ScaleAttention(nn.Module):
    """DBNet++'s adaptive scale fusion: a 3x3 conv over the concatenated levels, channel and spatial attention,
    and one sigmoid weight map per level that scales it before concatenation."""

    def __init__(self, levels: int, level_width: int):
        super().__init__()
        width = levels * level_width
        self.fuse = nn.Conv2d(width, level_width, 3, padding=1)
        self.channel = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(level_width, level_width // 4, 1),
                                     nn.ReLU(), nn.Conv2d(level_width // 4, level_width, 1), nn.Sigmoid())
        self.spatial = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.ReLU(), nn.Conv2d(1, 1, 1), nn.Sigmoid())
        self.weights = nn.Sequential(nn.Conv2d(level_width, levels, 1), nn.Sigmoid())

    def forward(self, levels: list[torch.Tensor]) -> torch.Tensor:
        fused = self.fuse(torch.cat(levels, 1))
        x = fused + self.channel(fused)
        x = x + self.spatial(x.mean(1, keepdim=True))
        weights = self.weights(x)
        return torch.cat([f * weights[:, i:i + 1] for i, f in enumerate(levels)], 1)


def _db_branch(width: int) -> nn.Sequential:
    """3x3 conv -> BN -> ReLU -> 2x2 transposed conv (x2) -> BN -> ReLU -> 2x2 transposed conv to one map
    (x2, back to input resolution) -> sigmoid."""
    quarter = width // 4
    return nn.Sequential(ConvBNAct(width, quarter, 3), nn.ConvTranspose2d(quarter, quarter, 2, 2),
                         nn.BatchNorm2d(quarter), nn.ReLU(), nn.ConvTranspose2d(quarter, 1, 2, 2), nn.Sigmoid())


class DBTextDetector(nn.Module):
    """DB text detector (49 convs): ResNet-18-vd -> FPN/PAN neck -> adaptive scale fusion -> probability map P
    and threshold map T; ``forward`` returns ``(sigmoid(k * (P - T)), P, T)``, each (B, 1, H, W) for image
    sides that are multiples of 32, with the binarization steepness k = 50."""

    def __init__(self, k: float = 50.0):
        super().__init__()
        self.k = k
        self.backbone = ResNet18vd()
        self.neck = FPNPAN()
        self.fusion = ScaleAttention(4, 64)
        self.probability = _db_branch(256)
        self.threshold = _db_branch(256)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.fusion(self.neck(self.backbone(images)))
        p, t = self.probability(x), self.threshold(x)
        return torch.sigmoid(self.k * (p - t)), p, t


def detector() -> nn.Module:
    model = TwoStageDetector()
    _randomize_batchnorm(model)
    return model


def db_text_detector() -> nn.Module:
    model = DBTextDetector()
    _randomize_batchnorm(model)
    damp((m.branch[-1][1] for m in model.modules() if isinstance(m, ResNetBlock)), 0.3)
    with torch.no_grad():  # logits of std ~2, so P and T spread over (0, 1) as a trained detector's maps do
        for branch in (model.probability, model.threshold):
            branch[-2].weight.mul_(10.0)
    return model


