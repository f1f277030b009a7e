"""Image classifiers and a segmentation net built from code with the layouts of the published models.

The layer tables (kernels, widths, strides, depths) are those of torchvision's ``mobilenet_v3_small``,
``efficientnet_b0``, ``regnet_y_400mf``, ``convnext_tiny`` and ``swin_t``; the code is written here because
torchvision cannot be used with the CPU build of torch. Weights are random: callers seed the global RNG
(:func:`models.arch.build_arch` does). Stochastic depth is an identity in eval mode and is left out.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from models.blocks import ConvBNAct, SqueezeExcite, damp
from models.zoo import _randomize_batchnorm


def image_hw(shape: int | tuple[int, int]) -> tuple[int, int]:
    """``shape`` as (height, width): an int is a square side."""
    return (shape, shape) if isinstance(shape, int) else (int(shape[0]), int(shape[1]))


def image_inputs(g: torch.Generator, batch: int, shape: int | tuple[int, int]) -> tuple[torch.Tensor]:
    """A batch of normalised RGB images: standard normal values, as after mean/std normalisation."""
    return (torch.randn(batch, 3, *image_hw(shape), generator=g),)


def _divisible(value: float, divisor: int = 8) -> int:
    """Round a channel count to a multiple of ``divisor``, never more than 10% below it (MobileNet's rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class InvertedResidual(nn.Module):
    """MobileNetV3 bottleneck / EfficientNet MBConv: 1x1 expansion (skipped when it would not widen) ->
    depthwise kxk -> optional squeeze-excitation -> 1x1 projection without activation; the input is added
    back when stride is 1 and the widths match."""

    def __init__(self, c_in: int, kernel: int, c_mid: int, c_out: int, stride: int,
                 act: type[nn.Module], se: SqueezeExcite | None, eps: float):
        super().__init__()
        layers: list[nn.Module] = []
        if c_mid != c_in:
            layers.append(ConvBNAct(c_in, c_mid, 1, act=act, eps=eps))
        layers.append(ConvBNAct(c_mid, c_mid, kernel, stride, groups=c_mid, act=act, eps=eps))
        if se is not None:
            layers.append(se)
        layers.append(ConvBNAct(c_mid, c_out, 1, act=None, eps=eps))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


def _damp_inverted_residuals(model: nn.Module, scale: float) -> None:
    damp((m.block[-1][1] for m in model.modules() if isinstance(m, InvertedResidual) and m.residual), scale)


# (input, kernel, expanded, output, squeeze-excitation, hardswish, stride): torchvision's "small" table
_MOBILENET_V3_SMALL = (
    (16, 3, 16, 16, True, False, 2),
    (16, 3, 72, 24, False, False, 2),
    (24, 3, 88, 24, False, False, 1),
    (24, 5, 96, 40, True, True, 2),
    (40, 5, 240, 40, True, True, 1),
    (40, 5, 240, 40, True, True, 1),
    (40, 5, 120, 48, True, True, 1),
    (48, 5, 144, 48, True, True, 1),
    (48, 5, 288, 96, True, True, 2),
    (96, 5, 576, 96, True, True, 1),
    (96, 5, 576, 96, True, True, 1),
)


class MobileNetV3Small(nn.Module):
    """MobileNetV3-Small (2.5M parameters): hardswish stem, 11 inverted residuals with hardsigmoid SE,
    a 1x1 conv to 576 channels, and a 1024-wide hardswish classifier."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        eps = 1e-3
        layers: list[nn.Module] = [ConvBNAct(3, 16, 3, 2, act=nn.Hardswish, eps=eps)]
        for c_in, k, c_mid, c_out, use_se, hardswish, stride in _MOBILENET_V3_SMALL:
            se = SqueezeExcite(c_mid, _divisible(c_mid // 4), nn.ReLU, nn.Hardsigmoid) if use_se else None
            act = nn.Hardswish if hardswish else nn.ReLU
            layers.append(InvertedResidual(c_in, k, c_mid, c_out, stride, act, se, eps))
        layers.append(ConvBNAct(96, 576, 1, act=nn.Hardswish, eps=eps))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(576, 1024), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(1024, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


# (expand ratio, kernel, stride, input, output, repeats): the EfficientNet-B0 stages
_EFFICIENTNET_B0 = (
    (1, 3, 1, 32, 16, 1),
    (6, 3, 2, 16, 24, 2),
    (6, 5, 2, 24, 40, 2),
    (6, 3, 2, 40, 80, 3),
    (6, 5, 1, 80, 112, 3),
    (6, 5, 2, 112, 192, 4),
    (6, 3, 1, 192, 320, 1),
)


class EfficientNetB0(nn.Module):
    """EfficientNet-B0 (5.3M parameters): SiLU stem, 16 MBConv blocks with sigmoid SE (squeezed to a quarter
    of the block's input width), a 1x1 conv to 1280 channels and a linear classifier."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        eps = 1e-5
        layers: list[nn.Module] = [ConvBNAct(3, 32, 3, 2, act=nn.SiLU, eps=eps)]
        for ratio, k, stride, c_in, c_out, repeats in _EFFICIENTNET_B0:
            for i in range(repeats):
                block_in = c_in if i == 0 else c_out
                c_mid = _divisible(block_in * ratio)
                se = SqueezeExcite(c_mid, max(1, block_in // 4), nn.SiLU, nn.Sigmoid)
                layers.append(InvertedResidual(block_in, k, c_mid, c_out, stride if i == 0 else 1, nn.SiLU, se, eps))
        layers.append(ConvBNAct(320, 1280, 1, act=nn.SiLU, eps=eps))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


class RegNetBottleneck(nn.Module):
    """RegNetY block: 1x1 conv -> grouped 3x3 conv (groups of ``group_width`` channels) -> SE squeezed to a
    quarter of the block's input width -> 1x1 conv; a strided 1x1 projection on the shortcut when needed."""

    def __init__(self, c_in: int, c_out: int, stride: int, group_width: int, se_ratio: float = 0.25):
        super().__init__()
        self.branch = nn.Sequential(
            ConvBNAct(c_in, c_out, 1),
            ConvBNAct(c_out, c_out, 3, stride, groups=c_out // group_width),
            SqueezeExcite(c_out, int(round(se_ratio * c_in)), nn.ReLU, nn.Sigmoid),
            ConvBNAct(c_out, c_out, 1, act=None),
        )
        self.shortcut = ConvBNAct(c_in, c_out, 1, stride, act=None) if c_in != c_out or stride != 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.shortcut is None else self.shortcut(x)
        return F.relu(shortcut + self.branch(x))


# (width, depth) per stage: the RegNet design space (w0=48, wa=27.89, wm=2.09, depth 16) quantised for 400MF
_REGNET_Y_400MF = ((48, 1), (104, 3), (208, 6), (440, 6))


class RegNetY400MF(nn.Module):
    """RegNetY-400MF (4.3M parameters): a 32-channel stem, four stages of SE bottlenecks with grouped 3x3
    convs (group width 8), average pool and a linear classifier."""

    def __init__(self, num_classes: int = 1000, group_width: int = 8):
        super().__init__()
        self.stem = ConvBNAct(3, 32, 3, 2)
        blocks: list[nn.Module] = []
        c_in = 32
        for width, depth in _REGNET_Y_400MF:
            for i in range(depth):
                blocks.append(RegNetBottleneck(c_in, width, 2 if i == 0 else 1, group_width))
                c_in = width
        self.trunk = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.trunk(self.stem(x)), 1), 1))


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor (moved last and back, as torchvision does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 conv -> channels-last LayerNorm -> Linear 4x -> GELU -> Linear -> layer scale, plus
    the input."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.layer_scale = nn.Parameter(torch.full((dim, 1, 1), 1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(self.norm(self.dwconv(x).permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        return x + self.layer_scale * y


class ConvNeXtTiny(nn.Module):
    """ConvNeXt-T (28.6M parameters): 4x4 patchify stem, stages of 3/3/9/3 blocks at 96/192/384/768
    channels joined by LayerNorm + 2x2 stride-2 convs, then pool, LayerNorm and a linear classifier."""

    def __init__(self, num_classes: int = 1000, dims: tuple[int, ...] = (96, 192, 384, 768),
                 depths: tuple[int, ...] = (3, 3, 9, 3)):
        super().__init__()
        layers: list[nn.Module] = [nn.Sequential(nn.Conv2d(3, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6))]
        for i, (dim, depth) in enumerate(zip(dims, depths, strict=False)):
            if i > 0:
                layers.append(nn.Sequential(LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, 2)))
            layers.append(nn.Sequential(*(ConvNeXtBlock(dim) for _ in range(depth))))
        self.features = nn.Sequential(*layers)
        self.norm = LayerNorm2d(dims[-1], eps=1e-6)
        self.fc = nn.Linear(dims[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.norm(F.adaptive_avg_pool2d(self.features(x), 1)), 1))


def _trained_layer_scales(model: ConvNeXtTiny) -> None:
    """Layer scales start at 1e-6 (every block an identity); trained ConvNeXts hold values of order 0.1-1."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ConvNeXtBlock):
                m.layer_scale.uniform_(0.1, 0.6)


def _shift_regions(window: int, shift: int) -> tuple[slice, ...]:
    """The bands of one axis that a cyclic shift by ``shift`` brings from different parts of the image."""
    if shift == 0:
        return (slice(None),)
    return slice(0, -window), slice(-window, -shift), slice(-shift, None)


def _window_mask(pad_h: int, pad_w: int, window: int, shift: tuple[int, int], device: torch.device) -> torch.Tensor:
    """Additive attention mask (windows, window^2, window^2): -100 between positions that the cyclic shift
    brought together from different image regions, 0 elsewhere."""
    region = torch.zeros(pad_h, pad_w, device=device)
    count = 0
    for h in _shift_regions(window, shift[0]):
        for w in _shift_regions(window, shift[1]):
            region[h, w] = count
            count += 1
    region = region.view(pad_h // window, window, pad_w // window, window).permute(0, 2, 1, 3)
    region = region.reshape(-1, window * window)
    different = region.unsqueeze(1) != region.unsqueeze(2)
    return torch.zeros(different.shape, device=device).masked_fill(different, -100.0)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside non-overlapping windows, with a learned relative position bias and
    an optional cyclic shift. The input (B, H, W, C) is zero-padded to window multiples and cropped back."""

    def __init__(self, dim: int, heads: int, window: int, shift: int):
        super().__init__()
        self.heads, self.window, self.shift = heads, window, shift
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.bias_table = nn.Parameter(torch.empty((2 * window - 1) ** 2, heads))
        nn.init.trunc_normal_(self.bias_table, std=0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("bias_index", (rel[:, :, 0] * (2 * window - 1) + rel[:, :, 1]).flatten(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        win = self.window
        x = F.pad(x, (0, 0, 0, (win - w % win) % win, 0, (win - h % win) % win))
        _, ph, pw, _ = x.shape
        # along an axis no longer than one window, a shift would only reorder the window: none is made
        shift = (self.shift if ph > win else 0, self.shift if pw > win else 0)
        if any(shift):
            x = torch.roll(x, (-shift[0], -shift[1]), (1, 2))
        windows = (ph // win) * (pw // win)
        x = x.view(b, ph // win, win, pw // win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(b * windows, win * win, c)
        q, k, v = self.qkv(x).reshape(x.shape[0], win * win, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.bias_table[self.bias_index].view(win * win, win * win, self.heads).permute(2, 0, 1)
        attn = attn + bias
        if any(shift):
            attn = attn.view(b, windows, self.heads, win * win, win * win)
            attn = attn + _window_mask(ph, pw, win, shift, x.device)[None, :, None]
            attn = attn.view(-1, self.heads, win * win, win * win)
        x = (attn.softmax(-1) @ v).transpose(1, 2).reshape(x.shape[0], win * win, c)
        x = self.proj(x)
        x = x.view(b, ph // win, pw // win, win, win, c).permute(0, 1, 3, 2, 4, 5).reshape(b, ph, pw, c)
        if any(shift):
            x = torch.roll(x, shift, (1, 2))
        return x[:, :h, :w, :].contiguous()


class SwinBlock(nn.Module):
    """Pre-norm (shifted-)window attention and a 4x GELU MLP, each added to its input."""

    def __init__(self, dim: int, heads: int, window: int, shift: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window, shift)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """Concatenate each 2x2 neighbourhood (padding odd sizes), LayerNorm, and project 4C -> 2C."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[1:3]
        x = F.pad(x, (0, 0, 0, w % 2, 0, h % 2))
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x))


class SwinTiny(nn.Module):
    """Swin-T (28.3M parameters): 4x4 patch embedding to 96 channels, stages of 2/2/6/2 blocks with 3/6/12/24
    heads and 7x7 windows (every second block shifted by 3), patch merging between stages, LayerNorm,
    pool, and a linear classifier. Any image size works: feature maps are padded to window multiples."""

    def __init__(self, num_classes: int = 1000, dim: int = 96, depths: tuple[int, ...] = (2, 2, 6, 2),
                 heads: tuple[int, ...] = (3, 6, 12, 24), window: int = 7):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, 4, 4)
        self.embed_norm = nn.LayerNorm(dim)
        stages: list[nn.Module] = []
        for i, (depth, n_heads) in enumerate(zip(depths, heads, strict=False)):
            if i > 0:
                stages.append(PatchMerging(dim))
                dim *= 2
            stages += [SwinBlock(dim, n_heads, window, 0 if j % 2 == 0 else window // 2) for j in range(depth)]
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_norm(self.patch_embed(x).permute(0, 2, 3, 1))
        x = self.norm(self.stages(x))
        return self.head(x.mean((1, 2)))


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(ConvBNAct(c_in, c_out, 3), ConvBNAct(c_out, c_out, 3))


class InterpolateNet(nn.Module):
    """A small U-Net for segmentation: a stride-2 stem, an encoder of four conv stages with max pooling, a
    decoder that resizes each stage to its skip connection with ``F.interpolate(size=...)`` (so any image
    size works), and a head whose logits are upsampled to the input with ``scale_factor=2``. Even image sides
    come back at full size."""

    def __init__(self, num_classes: int = 8, widths: tuple[int, ...] = (32, 64, 128, 256)):
        super().__init__()
        self.stem = ConvBNAct(3, widths[0], 3, 2)
        ins = (widths[0],) + widths[:-1]
        self.encoder = nn.ModuleList(_double_conv(c_in, c) for c_in, c in zip(ins, widths, strict=False))
        # each decoder stage takes the deeper stage's output concatenated with the skip at its own width
        self.decoder = nn.ModuleList(
            _double_conv(deep + c, c) for deep, c in zip(widths[:0:-1], widths[-2::-1], strict=False)
        )
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        x = self.stem(x)
        for i, stage in enumerate(self.encoder):
            x = stage(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for stage, skip in zip(self.decoder, reversed(skips[:-1]), strict=False):
            x = F.interpolate(x, size=skip.shape[-2:], mode="bilinear", align_corners=False)
            x = stage(torch.cat([x, skip], 1))
        return F.interpolate(self.head(x), scale_factor=2, mode="bilinear", align_corners=False)


def mobilenet_v3_small() -> nn.Module:
    model = MobileNetV3Small()
    _randomize_batchnorm(model)
    _damp_inverted_residuals(model, 0.3)
    return model


def efficientnet_b0() -> nn.Module:
    model = EfficientNetB0()
    _randomize_batchnorm(model)
    _damp_inverted_residuals(model, 0.3)
    return model


def regnet_y_400mf() -> nn.Module:
    model = RegNetY400MF()
    _randomize_batchnorm(model)
    damp((m.branch[-1][1] for m in model.modules() if isinstance(m, RegNetBottleneck)), 0.2)
    return model


def convnext_tiny() -> nn.Module:
    model = ConvNeXtTiny()
    _trained_layer_scales(model)
    return model


def swin_t() -> nn.Module:
    return SwinTiny()


def interpolate_net() -> nn.Module:
    model = InterpolateNet()
    _randomize_batchnorm(model)
    return model
