"""Real peer-library models that torch.export cannot capture whole, built offline with random weights.

Each ``build_*`` returns ``(model, args, kwargs)``: the model in eval mode (call ``.train()`` yourself
for train-mode checks), example inputs small enough for a forward well under a few seconds on 2 CPU
cores. Seeds are fixed; nothing is downloaded (weights=None / pretrained=False, YOLO from its yaml).
Libraries are imported lazily, so a missing peer fails only its own builder (tests should use
``pytest.importorskip`` on the library first). torchvision is made importable on the CPU torch by
``torchvision_ops.register()`` (its compiled ops need the CUDA torch), torchaudio by ``import_torchaudio()``.

Installed beside torch==2.13.0+cpu without replacing it (--no-deps: these wheels are CUDA builds):
    pip install --no-deps torchvision==0.28.0 torchaudio==2.11.0
    pip install timm==1.0.31 diffusers==0.42.1 open_clip_torch==3.3.0
    pip install opencv-python-headless==5.0.0.93 "polars>=0.20" "nvidia-ml-py>=12" "ultralytics-thop>=2.2.3" \
        "ultralytics-platform>=0.1.45" && pip install --no-deps ultralytics==8.4.190
(ultralytics asks for opencv-python, which needs libGL: the headless build serves the models.)
With torchaudio installed, every process that imports transformers (or diffusers/peft) must run
patch_torchaudio_loader() before: transformers imports torchaudio whenever it is installed.

``python -m tests.helpers.peer_models`` prints, per model, eager forward time and whether
torch.export.export(strict=False) captures it in eval and in train mode.
"""

from __future__ import annotations

import importlib.util
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
def patch_torchaudio_loader() -> None:
    """Let ``import torchaudio`` succeed although its compiled extension (built for the CUDA torch)
    cannot load. Imports nothing from torchaudio; idempotent; must run before the first import of
    torchaudio, which transformers (audio_utils) and so diffusers and peft make whenever torchaudio is
    installed: without it ``import torchaudio`` raises OSError (libc10_cuda.so) and takes them down.

    torchaudio's _load_lib raises when lib/_torchaudio*.so exists but fails to load; this pre-seeds its
    ``torchaudio._extension.utils`` module (plain Python, imports only torch) with a _load_lib that
    reports such a failure as "no extension". The models (wav2vec2, HuBERT, Conformer, ...) are pure
    Python; the C++-backed functions (forced_align, RNNT loss, ...) stay unavailable."""
    name = "torchaudio._extension.utils"
    if name in sys.modules or "torchaudio" in sys.modules:
        return
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchaudio is not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "_extension", "utils.py")
    uspec = importlib.util.spec_from_file_location(name, path)
    utils = importlib.util.module_from_spec(uspec)
    uspec.loader.exec_module(utils)
    load = utils._load_lib

    def _load_lib(lib: str) -> bool:
        try:
            return load(lib)
        except OSError:
            return False

    utils._load_lib = _load_lib
    sys.modules[name] = utils


def import_torchaudio():
    """``import torchaudio`` after :func:`patch_torchaudio_loader`."""
    patch_torchaudio_loader()
    import torchaudio

    return torchaudio


def build_wav2vec2(seconds: float = 0.5, batch: int = 1, layer_drop: float = 0.1):
    """torchaudio wav2vec2_base() (95M params, 12 layers) with random init; LayerDrop ``layer_drop``
    (acts in train mode only), input [batch, 16 kHz * seconds] waveform."""
    import_torchaudio()
    from torchaudio.models import wav2vec2_base

    g = _seed()
    model = wav2vec2_base(encoder_layer_drop=layer_drop).eval()
    return model, (torch.randn(batch, int(16000 * seconds), generator=g),), {}


def build_hubert(seconds: float = 0.5, batch: int = 1, layer_drop: float = 0.05):
    """torchaudio hubert_base() (95M params) with random init; LayerDrop ``layer_drop`` in train mode."""
    import_torchaudio()
    from torchaudio.models import hubert_base

    g = _seed()
    model = hubert_base(encoder_layer_drop=layer_drop).eval()
    return model, (torch.randn(batch, int(16000 * seconds), generator=g),), {}


def build_conformer(frames: int = 100, batch: int = 2):
    """torchaudio Conformer (input_dim 80, 4 heads, ffn 256, 4 layers); args (features [B, T, 80],
    lengths [B]) with unequal lengths, so the padding mask is real."""
    import_torchaudio()
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
        ev = attempt(lambda: torch.export.export(model, args, kwargs, strict=False))
        tr = "-"
        if name in TRAIN_MODE:
            model.train()
            tr = attempt(lambda: torch.export.export(model, args, kwargs, strict=False))
        print(f"{name}: eager {dt:.2f}s | export eval: {ev} | export train: {tr}", flush=True)


if __name__ == "__main__":
    _survey(sys.argv[1:] or None)
