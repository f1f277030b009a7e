"""Real peer-library models that torch.export cannot capture whole, built offline with random weights.

Each ``build_*`` returns ``(model, args, kwargs)``: the model in eval mode (call ``.train()`` yourself
for train-mode checks), example inputs small enough for a forward well under a few seconds on 2 CPU
cores. Seeds are fixed; nothing is downloaded (weights=None / pretrained=False, YOLO from its yaml).
Libraries are imported lazily, so a missing peer fails only its own builder (tests should use
``pytest.importorskip`` on the library first). torchvision is made importable on the CPU torch by
``torchvision_ops.register()`` (its compiled ops need the CUDA torch), torchaudio by the start-up hook
``scripts/setup`` installs (``tests/helpers/site/peer_imports.py``).

Installed beside torch==2.13.0+cpu without replacing it (--no-deps: these wheels are CUDA builds):
    pip install --no-deps torchvision==0.28.0 torchaudio==2.11.0
    pip install timm==1.0.31 diffusers==0.42.1 open_clip_torch==3.3.0
    pip install opencv-python-headless==5.0.0.93 "polars>=0.20" "nvidia-ml-py>=12" "ultralytics-thop>=2.2.3" \
        "ultralytics-platform>=0.1.45" && pip install --no-deps ultralytics==8.4.190
(ultralytics asks for opencv-python, which needs libGL: the headless build serves the models.)

``python -m tests.helpers.peer_models`` prints, per model, eager forward time and whether
torch.export.export(strict=False) captures it in eval and in train mode.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

from tests.helpers import torchvision_ops


def _seed(seed: int = 0) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _images(n: int, size: int, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.rand(3, size, size, generator=g) for _ in range(n)]


# ------------------------------------------------------------------------ torchvision detection
# Random heads score every box low (RetinaNet's prior gives sigmoid 0.01, a 91-way softmax ~0.011), so
# the score thresholds are lowered for the post-processing (NMS, RoIAlign, mask pasting) to have work.
def build_fasterrcnn(size: int = 128, batch: int = 2, **overrides):
    """fasterrcnn_mobilenet_v3_large_320_fpn (the smallest Faster R-CNN), images resized to ``size``."""
    torchvision_ops.register()
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn

    g = _seed()
    kw = dict(weights=None, weights_backbone=None, min_size=size, max_size=size, box_score_thresh=0.001)
    model = fasterrcnn_mobilenet_v3_large_320_fpn(**{**kw, **overrides}).eval()
    return model, (_images(batch, size, g),), {}


def build_retinanet(size: int = 128, batch: int = 2, **overrides):
    """retinanet_resnet50_fpn, images resized to ``size``."""
    torchvision_ops.register()
    from torchvision.models.detection import retinanet_resnet50_fpn

    g = _seed()
    kw = dict(weights=None, weights_backbone=None, min_size=size, max_size=size, score_thresh=0.005,
              topk_candidates=200)
    model = retinanet_resnet50_fpn(**{**kw, **overrides}).eval()
    return model, (_images(batch, size, g),), {}


def build_maskrcnn(size: int = 128, batch: int = 2, **overrides):
    """maskrcnn_resnet50_fpn, images resized to ``size``, at most 20 detections an image."""
    torchvision_ops.register()
    from torchvision.models.detection import maskrcnn_resnet50_fpn

    g = _seed()
    kw = dict(weights=None, weights_backbone=None, min_size=size, max_size=size, box_score_thresh=0.001,
              box_detections_per_img=20, rpn_pre_nms_top_n_test=300, rpn_post_nms_top_n_test=100)
    model = maskrcnn_resnet50_fpn(**{**kw, **overrides}).eval()
    return model, (_images(batch, size, g),), {}


def build_ssdlite(size: int = 128, batch: int = 2, **overrides):
    """ssdlite320_mobilenet_v3_large (its transform resizes every image to 320x320)."""
    torchvision_ops.register()
    from torchvision.models.detection import ssdlite320_mobilenet_v3_large

    g = _seed()
    kw = dict(weights=None, weights_backbone=None, detections_per_img=50)
    model = ssdlite320_mobilenet_v3_large(**{**kw, **overrides}).eval()
    return model, (_images(batch, size, g),), {}


# ----------------------------------------------------------------------------------- ultralytics
def import_ultralytics():
    """Import ultralytics offline: no connectivity probe, analytics or pip auto-installs."""
    os.environ.setdefault("YOLO_OFFLINE", "1")  # ultralytics.utils.ONLINE = False: no events, no downloads tried
    os.environ.setdefault("YOLO_AUTOINSTALL", "0")  # check_requirements never runs pip
    os.environ.setdefault("YOLO_VERBOSE", "0")
    torchvision_ops.register()
    import ultralytics

    return ultralytics


def _build_yolo(cfg: str, size: int, batch: int):
    ultralytics = import_ultralytics()
    g = _seed()
    model = ultralytics.YOLO(cfg).model.eval()  # DetectionModel built from the yaml, random init
    return model, (torch.rand(batch, 3, size, size, generator=g),), {}


def build_yolov8n(size: int = 128, batch: int = 1):
    """ultralytics YOLO('yolov8n.yaml').model (DetectionModel, 80 classes); size a multiple of 32.

    NB: the Detect head caches anchors/strides on itself at the first forward of a new input shape; if
    that forward is torch.export's, FakeTensors stay cached and later eager calls return FakeTensors.
    Run one eager forward before exporting (or set ``model.model[-1].dynamic = True``)."""
    return _build_yolo("yolov8n.yaml", size, batch)


def build_yolo11n(size: int = 128, batch: int = 1):
    """ultralytics YOLO('yolo11n.yaml').model (DetectionModel, 80 classes); size a multiple of 32."""
    return _build_yolo("yolo11n.yaml", size, batch)


# ------------------------------------------------------------------------------------ torchaudio
def build_wav2vec2(seconds: float = 0.5, batch: int = 1, layer_drop: float = 0.1):
    """torchaudio wav2vec2_base() (95M params, 12 layers) with random init; LayerDrop ``layer_drop``
    (acts in train mode only), input [batch, 16 kHz * seconds] waveform."""
    from torchaudio.models import wav2vec2_base

    g = _seed()
    model = wav2vec2_base(encoder_layer_drop=layer_drop).eval()
    return model, (torch.randn(batch, int(16000 * seconds), generator=g),), {}


def build_hubert(seconds: float = 0.5, batch: int = 1, layer_drop: float = 0.05):
    """torchaudio hubert_base() (95M params) with random init; LayerDrop ``layer_drop`` in train mode."""
    from torchaudio.models import hubert_base

    g = _seed()
    model = hubert_base(encoder_layer_drop=layer_drop).eval()
    return model, (torch.randn(batch, int(16000 * seconds), generator=g),), {}


def build_conformer(frames: int = 100, batch: int = 2):
    """torchaudio Conformer (input_dim 80, 4 heads, ffn 256, 4 layers); args (features [B, T, 80],
    lengths [B]) with unequal lengths, so the padding mask is real."""
    from torchaudio.models import Conformer

    g = _seed()
    model = Conformer(input_dim=80, num_heads=4, ffn_dim=256, num_layers=4, depthwise_conv_kernel_size=31).eval()
    lengths = torch.tensor([frames - 7 * i for i in range(batch)], dtype=torch.long)
    return model, (torch.randn(batch, frames, 80, generator=g), lengths), {}


# ------------------------------------------------------------------------------------------ timm
def _build_timm(name: str, batch: int):
    torchvision_ops.register()  # timm imports torchvision
    import timm

    g = _seed()
    model = timm.create_model(name, pretrained=False).eval()
    return model, (torch.rand(batch, 3, 224, 224, generator=g),), {}


def build_levit_128s(batch: int = 2):
    """timm levit_128s (attention biases fix the input at 224x224; batch >= 2 for its train-mode BatchNorm1d)."""
    return _build_timm("levit_128s", batch)


def build_efficientformer_l1(batch: int = 2):
    """timm efficientformer_l1 (input 224x224)."""
    return _build_timm("efficientformer_l1", batch)


BUILDERS = {
    "fasterrcnn_mobilenet_v3_large_320_fpn": build_fasterrcnn,
    "retinanet_resnet50_fpn": build_retinanet,
    "maskrcnn_resnet50_fpn": build_maskrcnn,
    "ssdlite320_mobilenet_v3_large": build_ssdlite,
    "yolov8n": build_yolov8n,
    "yolo11n": build_yolo11n,
    "wav2vec2_base": build_wav2vec2,
    "hubert_base": build_hubert,
    "conformer": build_conformer,
    "levit_128s": build_levit_128s,
    "efficientformer_l1": build_efficientformer_l1,
}
# train mode means something for these without targets (detection models need targets in train mode)
TRAIN_MODE = ("yolov8n", "yolo11n", "wav2vec2_base", "hubert_base", "conformer", "levit_128s", "efficientformer_l1")


def _survey(names=None) -> None:
    import time

    def attempt(fn):
        try:
            fn()
            return "ok"
        except Exception as e:  # noqa: BLE001 - report it
            first = (str(e).strip().splitlines() or [""])[0]
            return f"{type(e).__name__}: {first[:160]}"

    for name in names or BUILDERS:
        model, args, kwargs = BUILDERS[name]()
        with torch.no_grad():
            model(*args, **kwargs)  # warm-up
            times = []
            for _ in range(3):
                t = time.perf_counter()
                model(*args, **kwargs)
                times.append(time.perf_counter() - t)
            dt = sorted(times)[1]
        ev = attempt(functools.partial(torch.export.export, model, args, kwargs, strict=False))
        tr = "-"
        if name in TRAIN_MODE:
            model.train()
            tr = attempt(functools.partial(torch.export.export, model, args, kwargs, strict=False))
        print(f"{name}: eager {dt:.2f}s | export eval: {ev} | export train: {tr}", flush=True)


if __name__ == "__main__":
    _survey(sys.argv[1:] or None)


# ================================================================================== the peer zoo
# Builders for tests/conformance/peer_zoo.py: the model families people bring beyond transformers, each the
# smallest variant, built from code with seeded random weights (nothing downloaded), on small inputs. Same
# contract as the builders above: ``(model, args, kwargs)``, the model in eval mode, every dropout 0.
def _images_nchw(batch: int, size: int, g: torch.Generator, channels: int = 3) -> torch.Tensor:
    return torch.randn(batch, channels, size, size, generator=g)


def build_timm(name: str, size: int | None = 64, batch: int = 2, **kwargs):
    """timm ``name`` (pretrained=False, dropout and drop-path 0), input [batch, 3, size, size]; ``size`` is passed
    as ``img_size`` where the model takes one (ViTs, Swin, MaxViT, ...), else only the input is that size."""
    torchvision_ops.register()  # timm imports torchvision
    import timm

    g = _seed()
    options = dict(pretrained=False, drop_rate=0.0, drop_path_rate=0.0, **kwargs)
    try:
        model = timm.create_model(name, img_size=size, **options)
    except TypeError:  # a convolutional net: no img_size argument, it takes any size
        _seed()
        model = timm.create_model(name, **options)
    return model.eval(), (_images_nchw(batch, size, g),), {}


def build_tv_classifier(name: str, size: int = 64, batch: int = 2, **kwargs):
    """torchvision.models.<name>(weights=None), input [batch, 3, size, size]."""
    torchvision_ops.register()
    import torchvision

    g = _seed()
    model = getattr(torchvision.models, name)(weights=None, **kwargs).eval()
    return model, (_images_nchw(batch, size, g),), {}


def build_deeplabv3(size: int = 64, batch: int = 2):
    """torchvision deeplabv3_mobilenet_v3_large (21 classes, no aux head), input [batch, 3, size, size]; output
    ``{"out": [batch, 21, size, size]}``."""
    torchvision_ops.register()
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    g = _seed()
    model = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, aux_loss=False).eval()
    return model, (_images_nchw(batch, size, g),), {}


def build_raft_small(size: int = 128, batch: int = 1):
    """torchvision raft_small (its default 12 flow updates), two frames [batch, 3, size, size]; size a multiple
    of 8 and at least 128 (the encoders downsample by 8 and RAFT refuses feature maps under 16x16). Output: the
    12 flow estimates [batch, 2, size, size]."""
    torchvision_ops.register()
    from torchvision.models.optical_flow import raft_small

    g = _seed()
    model = raft_small(weights=None).eval()
    return model, (_images_nchw(batch, size, g), _images_nchw(batch, size, g)), {}


def build_r3d_18(frames: int = 4, size: int = 32, batch: int = 2):
    """torchvision video r3d_18, a clip [batch, 3, frames, size, size]."""
    torchvision_ops.register()
    from torchvision.models.video import r3d_18

    g = _seed()
    model = r3d_18(weights=None).eval()
    return model, (torch.randn(batch, 3, frames, size, size, generator=g),), {}


def _open_clip(name: str, size: int, context: int):
    torchvision_ops.register()  # open_clip imports timm/torchvision
    import open_clip

    _seed()
    return open_clip.create_model(name, pretrained=None, force_image_size=size, force_context_length=context).eval()


class OpenClipText(torch.nn.Module):
    """An open_clip CLIP's text tower as a module: ``forward(text) = clip.encode_text(text)`` (the image tower
    dropped)."""

    def __init__(self, clip):
        super().__init__()
        clip.visual = None
        self.clip = clip

    def forward(self, text):
        return self.clip.encode_text(text)


def build_open_clip_image(name: str = "ViT-S-32", size: int = 96, batch: int = 2):
    """open_clip ``name`` (pretrained=None)'s image tower ``model.visual``, images [batch, 3, size, size]."""
    model = _open_clip(name, size, 16).visual
    g = torch.Generator().manual_seed(1)
    return model.eval(), (_images_nchw(batch, size, g),), {}


def build_open_clip_text(name: str = "ViT-S-32", tokens: int = 16, batch: int = 2):
    """open_clip ``name`` (pretrained=None)'s text tower (:class:`OpenClipText`), context ``tokens`` long, token
    ids [batch, tokens] with the end-of-text id (the largest, where the pooling reads) at different places."""
    clip = _open_clip(name, 224, tokens)
    g = torch.Generator().manual_seed(1)
    text = torch.randint(1, 1000, (batch, tokens), generator=g)
    for i in range(batch):
        text[i, tokens - 1 - 3 * i] = clip.vocab_size - 1
    return OpenClipText(clip).eval(), (text,), {}


# ---------------------------------------------------------------------------------------- diffusers
# The tiny configurations follow diffusers' own model tests (tests/models/*/test_models_*.py).
def _diffusers(cls_name: str, **config):
    import diffusers

    _seed()
    return getattr(diffusers, cls_name)(**config).eval()


def build_unet2d_condition(size: int = 16, batch: int = 2, tokens: int = 8):
    """diffusers UNet2DConditionModel, 2 blocks (32, 64 channels), cross-attention width 32; args (sample
    [batch, 4, size, size], timestep [batch]), kwargs encoder_hidden_states [batch, tokens, 32]."""
    model = _diffusers("UNet2DConditionModel", block_out_channels=(32, 64), layers_per_block=1, sample_size=size,
                       in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
                       attention_head_dim=8, norm_num_groups=32)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 4, size, size, generator=g), _timesteps(batch)), \
        {"encoder_hidden_states": torch.randn(batch, tokens, 32, generator=g)}


def build_unet2d(size: int = 16, batch: int = 2):
    """diffusers UNet2DModel, 2 blocks (32, 64 channels, attention in the second); args (sample
    [batch, 3, size, size], timestep [batch])."""
    model = _diffusers("UNet2DModel", block_out_channels=(32, 64), layers_per_block=1, sample_size=size,
                       in_channels=3, out_channels=3, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8, norm_num_groups=32)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 3, size, size, generator=g), _timesteps(batch)), {}


def _timesteps(batch: int) -> torch.Tensor:
    return torch.tensor([10.0 + 490.0 * i for i in range(batch)])


def build_autoencoder_kl(size: int = 32, batch: int = 2):
    """diffusers AutoencoderKL, 2 blocks (32, 64 channels), 4 latent channels; args (sample [batch, 3, size,
    size],); forward's default sample_posterior=False (the posterior's mode: deterministic)."""
    model = _diffusers("AutoencoderKL", block_out_channels=(32, 64), in_channels=3, out_channels=3,
                       down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
                       up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), latent_channels=4,
                       norm_num_groups=32, sample_size=size)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 3, size, size, generator=g),), {}


def build_sd3_transformer(size: int = 16, batch: int = 2, tokens: int = 8):
    """diffusers SD3Transformer2DModel, 1 joint block (4 heads of 8), patch 2; args (hidden_states
    [batch, 4, size, size],), kwargs encoder_hidden_states [batch, tokens, 32], pooled_projections [batch, 64],
    timestep [batch]."""
    model = _diffusers("SD3Transformer2DModel", sample_size=size, patch_size=2, in_channels=4, num_layers=1,
                       attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                       pooled_projection_dim=64, out_channels=4, pos_embed_max_size=32)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 4, size, size, generator=g),), {
        "encoder_hidden_states": torch.randn(batch, tokens, 32, generator=g),
        "pooled_projections": torch.randn(batch, 64, generator=g), "timestep": _timesteps(batch)}


def build_dit_transformer(size: int = 8, batch: int = 2):
    """diffusers DiTTransformer2DModel, 1 block (2 heads of 8), patch 2, adaLN-zero over 1000 classes; args
    (hidden_states [batch, 4, size, size], timestep [batch], class_labels [batch])."""
    model = _diffusers("DiTTransformer2DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4,
                       out_channels=8, num_layers=1, sample_size=size, patch_size=2, norm_num_groups=32)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(batch, 4, size, size, generator=g), _timesteps(batch).long(),
                   torch.arange(batch) * 7), {}


def build_flux_transformer(side: int = 4, batch: int = 2, tokens: int = 8):
    """diffusers FluxTransformer2DModel, 1 double and 1 single block (2 heads of 16), rope axes (4, 4, 8); args
    (hidden_states [batch, side*side, 4],), kwargs encoder_hidden_states [batch, tokens, 32], pooled_projections
    [batch, 32], timestep [batch] in [0, 1], img_ids [side*side, 3], txt_ids [tokens, 3]."""
    model = _diffusers("FluxTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                       axes_dims_rope=(4, 4, 8))
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(side, side, 3)
    ids[..., 1] = torch.arange(side)[:, None]
    ids[..., 2] = torch.arange(side)[None, :]
    return model, (torch.randn(batch, side * side, 4, generator=g),), {
        "encoder_hidden_states": torch.randn(batch, tokens, 32, generator=g),
        "pooled_projections": torch.randn(batch, 32, generator=g),
        "timestep": torch.linspace(0.2, 0.8, batch), "img_ids": ids.reshape(-1, 3), "txt_ids": torch.zeros(tokens, 3)}
