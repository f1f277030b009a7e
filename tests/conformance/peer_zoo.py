"""A second zoo beside the transformers one (``zoo_harness.py``): the model families people bring beyond
transformers, run through amppass as a regression suite.

Each model is the smallest variant of its family, built from code with seeded random weights and nothing
downloaded (``tests/helpers/peer_models.py``), on small inputs: timm's CNNs and vision transformers, diffusers'
UNets, VAE and DiT/SD3/Flux transformers, torchvision's classifiers, segmentation, optical flow, video and four
detectors, ultralytics' YOLOv8n and YOLO11n, open_clip's image and text towers, torchaudio's wav2vec2, HuBERT and
Conformer (:data:`ENTRIES`). Each goes through :data:`STEPS`, judged as ``zoo_harness`` judges (its bounds
``FLOOR``/``FLOOR_FP16``/``RATIO``, its relative-L2 ``error`` and its ``judge_gradients``, imported from it):

- ``convert``: ``amppass.convert(model, args, "bf16", example_kwargs=kwargs, plan_for="coverage")``; every float
  output within ``max(FLOOR, RATIO * autocast's error)`` of fp32's (relative L2, the worst output), autocast being
  ``torch.autocast("cpu", torch.bfloat16)`` on the same model and inputs. A model whose outputs are not
  comparable element by element (a detector after NMS: with random weights, the counts and order of boxes move
  with any rounding) converted by parts is judged part by part instead: each converted part (``amppass.report(m)
  .info["parts"]["converted"]``) on the inputs the fp32 model called it with, against the fp32 part and autocast
  on that part. The caller's model must come back unchanged (its state dict, bit for bit). Recorded: whole or by
  parts, the parts, the share of multiply-adds that runs low.
- ``train``: ``amppass.convert(model.train(), args, "fp16", mode="train")``, 3 SGD steps with
  ``amppass.LossScaler``; first-step gradients against fp32's by per-parameter cosine, judged by
  ``zoo_harness.judge_gradients`` against fp16 autocast + GradScaler's. The loss is the model's own where it has
  one (the torchvision detectors in train mode take targets and return their losses), else the sum over every
  float output of its mean against fixed random weights (a sum of squares is constant after a final
  normalisation, its gradients rounding noise). Every dropout is 0 in the three runs (fp32, autocast, amppass);
  LayerDrop (wav2vec2, HuBERT) is kept, each run seeded the same. Every loss must be finite.
- ``export-onnx``: ``amppass.export_onnx(model, args, path, dtype="fp16")``, ``onnx.checker`` (full check),
  onnxruntime's CPU provider; the first output within ``max(FLOOR_FP16, RATIO * fp16 autocast's error)`` of fp32's.
  Where the file declares a dynamic batch, it runs again at one more in the batch (judged the same way); where it
  declares other dynamic dimensions, it runs again with each of them half as large again; either run failing in
  onnxruntime fails the step (a dynamic dimension the file cannot run).

A step is "pass", "fail" (the first line of the error, or the errors measured) or "n/a" (with why); each with its
wall time. A model that does not build is "unbuilt" with the reason. Each step has a deadline (:data:`STEP_SECONDS`);
from the command line every model runs in a child process with its own deadline (``--model-seconds``), so a hang or
a native crash costs that model only.

``python tests/conformance/peer_zoo.py --write-expected`` runs the whole zoo and writes ``peer_expected.json``: each
failing step with the stable start of its reason (:func:`reason_of`), which ``tests/conformance/test_peer_zoo.py``
holds the code to. ``--only NAME ...``, ``--steps STEP ...``, ``--json OUT`` (every outcome, with details and times).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
if str(ROOT) not in sys.path:  # after the rest: a PYTHONPATH copy of amppass (a commit's snapshot) is the one run
    sys.path.append(str(ROOT))

import zoo_harness as zoo  # noqa: E402 - the transformers zoo: its bounds, error and gradient judge

import amppass  # noqa: E402
from tests.helpers import peer_models as peers  # noqa: E402
from tests.helpers.load import read_as_native_cpu  # noqa: E402

EXPECTED = Path(__file__).with_name("peer_expected.json")
STEPS = ("convert", "train", "export-onnx")
FLOOR, FLOOR_FP16, RATIO = zoo.FLOOR, zoo.FLOOR_FP16, zoo.RATIO
STEP_SECONDS = 600  # a step still running then fails ("timed out")
MODEL_SECONDS = 1500  # a model's child process still running then is killed, its unfinished steps failed
SEED = 1234  # every forward that the train step compares starts from this seed (LayerDrop draws the same layers)
REASON_CHARS = 120
FP32_RESOLVED = 0.9  # an fp32 gradient less aligned than this with itself after a nudge is rounding noise
NUDGE = 2.0**-20  # relative size of that nudge to every weight: 8 units of fp32 roundoff


@dataclass(frozen=True)
class Entry:
    """One model of the zoo: how to build it and what its steps need."""

    name: str
    family: str
    build: Callable[[], tuple]  # () -> (model in eval mode, args, kwargs)
    batch: int | None = 2  # the size of dim 0 of the batched inputs (None: no batch dimension, a list of images)
    elementwise: bool = True  # outputs comparable element by element with fp32's (not after NMS)
    # "outputs": a loss made from the outputs; "targets": its own loss on targets; else n/a's why
    train: str = "outputs"
    note: str = ""


def _timm(name: str, size: int = 64, **kwargs) -> Callable[[], tuple]:
    return lambda: peers.build_timm(name, size, **kwargs)


def _tv(name: str, **kwargs) -> Callable[[], tuple]:
    return lambda: peers.build_tv_classifier(name, **kwargs)


DETECTOR_TRAIN = "targets"
ENTRIES: dict[str, Entry] = {e.name: e for e in (
    # timm
    Entry("timm/resnet18", "timm", _timm("resnet18")),
    Entry("timm/efficientnet_b0", "timm", _timm("efficientnet_b0")),
    Entry("timm/mobilenetv3_small_050", "timm", _timm("mobilenetv3_small_050")),
    Entry("timm/convnext_atto", "timm", _timm("convnext_atto")),
    Entry("timm/regnetx_002", "timm", _timm("regnetx_002")),
    Entry("timm/fastvit_t8", "timm", _timm("fastvit_t8")),
    Entry("timm/vit_tiny_patch16_224", "timm", _timm("vit_tiny_patch16_224", 64), note="img_size 64"),
    Entry("timm/deit_tiny_patch16_224", "timm", _timm("deit_tiny_patch16_224", 64), note="img_size 64"),
    Entry("timm/swin_tiny_patch4_window7_224", "timm", _timm("swin_tiny_patch4_window7_224", 128, window_size=4),
          note="img_size 128, window 4 (7 divides no stage of a small image)"),
    Entry("timm/levit_128s", "timm", peers.build_levit_128s, note="224x224: its attention biases fix the size"),
    Entry("timm/maxvit_pico_rw_256", "timm", _timm("maxvit_pico_rw_256", 128), note="img_size 128"),
    Entry("timm/coatnet_pico_rw_224", "timm", _timm("coatnet_pico_rw_224", 128), note="img_size 128"),
    Entry("timm/efficientformer_l1", "timm", peers.build_efficientformer_l1,
          note="224x224: its pooling fixes the size"),
    Entry("timm/eva02_tiny_patch14_224", "timm", _timm("eva02_tiny_patch14_224", 112), note="img_size 112"),
    Entry("timm/mixer_s32_224", "timm", _timm("mixer_s32_224", 128), note="img_size 128"),
    # diffusers
    Entry("diffusers/UNet2DConditionModel", "diffusers", peers.build_unet2d_condition),
    Entry("diffusers/UNet2DModel", "diffusers", peers.build_unet2d),
    Entry("diffusers/AutoencoderKL", "diffusers", peers.build_autoencoder_kl),
    Entry("diffusers/SD3Transformer2DModel", "diffusers", peers.build_sd3_transformer),
    Entry("diffusers/DiTTransformer2DModel", "diffusers", peers.build_dit_transformer),
    Entry("diffusers/FluxTransformer2DModel", "diffusers", peers.build_flux_transformer),
    # torchvision
    Entry("tv/resnet18", "torchvision", _tv("resnet18")),
    Entry("tv/mobilenet_v3_small", "torchvision", _tv("mobilenet_v3_small", dropout=0.0)),
    Entry("tv/deeplabv3_mobilenet_v3_large", "torchvision", peers.build_deeplabv3),
    Entry("tv/raft_small", "torchvision", peers.build_raft_small, batch=1,
          note="128x128 (RAFT's smallest), 12 updates"),
    Entry("tv/r3d_18", "torchvision", peers.build_r3d_18, note="clip 4 frames of 32x32"),
    Entry("tv/fasterrcnn_mobilenet_v3_large_320_fpn", "torchvision", peers.build_fasterrcnn, batch=None,
          elementwise=False, train=DETECTOR_TRAIN),
    Entry("tv/retinanet_resnet50_fpn", "torchvision", peers.build_retinanet, batch=None, elementwise=False,
          train=DETECTOR_TRAIN),
    Entry("tv/maskrcnn_resnet50_fpn", "torchvision", peers.build_maskrcnn, batch=None, elementwise=False,
          train=DETECTOR_TRAIN),
    Entry("tv/ssdlite320_mobilenet_v3_large", "torchvision", peers.build_ssdlite, batch=None, elementwise=False,
          train=DETECTOR_TRAIN),
    # ultralytics
    Entry("ultralytics/yolov8n", "ultralytics", peers.build_yolov8n, batch=1, note="128x128, outputs before NMS"),
    Entry("ultralytics/yolo11n", "ultralytics", peers.build_yolo11n, batch=1, note="128x128, outputs before NMS"),
    # open_clip
    Entry("open_clip/ViT-S-32-image", "open_clip", peers.build_open_clip_image,
          note="ViT-S-32 (open_clip's smallest ViT config) image tower, 96x96"),
    Entry("open_clip/ViT-S-32-text", "open_clip", peers.build_open_clip_text,
          note="ViT-S-32 text tower, context 16 tokens"),
    # torchaudio
    Entry("torchaudio/wav2vec2_base", "torchaudio", peers.build_wav2vec2, batch=1, note="0.5 s, LayerDrop 0.1"),
    Entry("torchaudio/hubert_base", "torchaudio", peers.build_hubert, batch=1, note="0.5 s, LayerDrop 0.05"),
    Entry("torchaudio/conformer", "torchaudio", peers.build_conformer, note="100 frames, unequal lengths"),
)}
# model -> the steps it runs in the default test run: one of each family's kinds, a few minutes on 2 cores in all
DEFAULT: dict[str, tuple[str, ...]] = {
    "tv/resnet18": ("convert", "train"),
    "timm/vit_tiny_patch16_224": ("convert",),
    "diffusers/UNet2DConditionModel": ("convert",),
    "ultralytics/yolov8n": ("convert",),
    "tv/fasterrcnn_mobilenet_v3_large_320_fpn": ("convert",),
    "torchaudio/wav2vec2_base": ("convert", "train"),
}


def _commit() -> str:
    """The amppass code that runs: this checkout's commit (zoo_harness.COMMIT, "+dirty" with changes), or where
    amppass is imported from elsewhere (a snapshot on PYTHONPATH), the commit its folder's SNAPSHOT file names."""
    package = Path(amppass.__file__).resolve().parent
    if package.parent == ROOT:
        return zoo.COMMIT
    marker = package.parent / "SNAPSHOT"
    return marker.read_text(encoding="utf-8").strip() if marker.exists() else f"amppass from {package}"


@dataclass
class Result:
    """Every step's outcome for one model."""

    name: str
    family: str
    built: bool
    reason: str = ""  # why it was not built
    steps: dict[str, dict] = field(default_factory=dict)  # step -> {"outcome", "detail", "seconds", "info"?}
    seconds: float = 0.0  # building it
    commit: str = field(default_factory=_commit)


# ------------------------------------------------------------------------------------------------ helpers
def _fresh(value: Any) -> Any:
    """A private copy of a call's inputs: a model's code may write into them."""
    return copy.deepcopy(value)


def _call(model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    return model(*_fresh(args), **_fresh(kwargs))


def autocast_error(model: torch.nn.Module, args: tuple, kwargs: dict, reference: Any, dtype: torch.dtype,
                   first: bool = False) -> float:
    """``zoo_harness.autocast_error`` for positional and keyword inputs: torch.autocast's error on the same inputs
    (the first float output only, with ``first``); NaN where the model fails under autocast."""
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            out = _call(model, args, kwargs)
    except Exception:  # noqa: BLE001 - the model's own code under autocast: no comparison to make
        return math.nan
    if first:
        return zoo.error(zoo.tensors(out)[0].float(), zoo.tensors(reference)[0])
    return zoo.error(out, reference)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """The state-dict entries of ``model`` that differ from ``before`` (added, removed or other values)."""
    after = model.state_dict()
    names = sorted(set(before) ^ set(after))
    names += [k for k in before if k in after and not (before[k].shape == after[k].shape and before[k].dtype ==
                                                       after[k].dtype and torch.equal(before[k], after[k]))]
    return names


def conversion_info(converted: torch.nn.Module) -> dict:
    """How ``converted`` was converted: whole or by parts, the parts (and why the rest runs as the model's code),
    the share of multiply-adds that runs low."""
    report = amppass.report(converted)
    parts = report.info.get("parts")
    if parts:
        total, low = parts.get("macs_total"), parts.get("macs_low")
        return {"how": "parts", "parts": list(parts.get("converted", [])), "eager": dict(parts.get("eager", {})),
                "why_whole": parts.get("why_whole", ""), "low_share": (low / total) if total and low is not None
                else None}
    stats = report.stats()
    return {"how": "whole", "low_share": stats["macs"]["low_share"], "nodes": stats["nodes"],
            "by_precision": stats["by_precision"]}


def _judged(err: float, autocast: float, floor: float, what: str) -> tuple[str, str]:
    """``zoo_harness``'s judgement, the detail led by ``what`` was judged (a stable reason prefix when it fails)."""
    outcome, detail = zoo._judge(err, autocast, floor)
    return outcome, f"{what}: {detail}"


def _record_calls(model: torch.nn.Module, paths: list[str], args: tuple, kwargs: dict) -> dict[str, tuple]:
    """The first call (arguments cloned) of each submodule at ``paths`` in one fp32 call of ``model``."""
    calls: dict[str, tuple] = {}
    handles = []
    for path in paths:
        def keep(module, module_args, module_kwargs, path=path):
            if path not in calls:
                calls[path] = _fresh((module_args, module_kwargs))
        handles.append(model.get_submodule(path).register_forward_pre_hook(keep, with_kwargs=True))
    try:
        with torch.no_grad():
            _call(model, args, kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def judge_parts(model: torch.nn.Module, converted: torch.nn.Module, paths: list[str], args: tuple,
                kwargs: dict) -> tuple[str, str]:
    """Each converted part of ``converted`` on the inputs the fp32 ``model`` called it with, against the fp32 part
    and bf16 autocast on it; fails on the part furthest past its bound."""
    if not paths:
        return "fail", "parts: no part converted"
    calls = _record_calls(model, paths, args, kwargs)
    judged = []
    for path in paths:
        if path not in calls:
            judged.append((math.inf, path, "not called by the fp32 model on the example"))
            continue
        part_args, part_kwargs = calls[path]
        original = model.get_submodule(path)
        with torch.no_grad():
            reference = _call(original, part_args, part_kwargs)
            out = _call(converted.get_submodule(path), part_args, part_kwargs)
        err = zoo.error(out, reference)
        autocast = autocast_error(original, part_args, part_kwargs, reference, torch.bfloat16)
        outcome, detail = zoo._judge(err, autocast, FLOOR)
        bound = max(FLOOR, RATIO * autocast) if math.isfinite(autocast) else FLOOR
        judged.append((err / bound if outcome == "pass" or err > bound else math.inf, path, detail))
    worst = max(judged, key=lambda j: j[0])
    if worst[0] > 1.0:
        return "fail", f"part {worst[1]}: {worst[2]} ({len(paths)} parts judged on their fp32 inputs)"
    return "pass", f"{len(paths)} parts judged on their fp32 inputs; closest to its bound {worst[1]}: {worst[2]}"


# --------------------------------------------------------------------------------------------------- steps
def step_convert(entry: Entry, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[str, str, dict]:
    before = _state(model)
    with torch.no_grad():
        reference = _call(model, args, kwargs)
    converted = amppass.convert(model, args, "bf16", example_kwargs=kwargs or None, plan_for="coverage")
    with torch.no_grad():
        out = _call(converted, args, kwargs)
    info = conversion_info(converted)
    if entry.elementwise:
        outcome, detail = _judged(zoo.error(out, reference),
                                  autocast_error(model, args, kwargs, reference, torch.bfloat16), FLOOR, "outputs")
    elif info["how"] == "parts":
        outcome, detail = judge_parts(model, converted, info["parts"], args, kwargs)
    else:  # converted whole although its outputs are not comparable: whatever they are, judged as they are
        outcome, detail = _judged(zoo.error(out, reference),
                                  autocast_error(model, args, kwargs, reference, torch.bfloat16), FLOOR, "outputs")
    changed = _changed(model, before)
    if changed:
        outcome, detail = "fail", f"the caller's model changed: {', '.join(changed[:3])}; {detail}"
    return outcome, detail, info


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every dropout probability 0 (modules and float attributes such as torchaudio's attention
    ``dropout``), LayerDrop kept: the three training runs then compute the same function."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if isinstance(value, float) and "drop" in key and "layer" not in key and 0.0 < value < 1.0:
                setattr(module, key, 0.0)
    return model


def _targets(images: list[torch.Tensor], masks: bool) -> list[dict]:
    """Two boxes an image (with masks for Mask R-CNN): what a torchvision detector trains on."""
    found = []
    for i, image in enumerate(images):
        h, w = image.shape[-2:]
        boxes = torch.tensor([[0.1 * w, 0.2 * h, 0.6 * w, 0.7 * h], [0.4 * w, 0.3 * h, 0.9 * w, 0.95 * h]])
        target = {"boxes": boxes, "labels": torch.tensor([1 + i, 5])}
        if masks:
            mask = torch.zeros(2, h, w, dtype=torch.uint8)
            for j, (x0, y0, x1, y1) in enumerate(boxes.round().long().tolist()):
                mask[j, y0:y1, x0:x1] = 1
            target["masks"] = mask
        found.append(target)
    return found


def train_loss(out: Any) -> torch.Tensor:
    """The model's own loss (a ``loss`` field, or a detector's dict of losses, summed), else the sum over every
    float output of its mean against fixed random weights."""
    own = zoo._loss(out)
    if own is not None:
        return own
    if isinstance(out, dict) and out and all(str(k).startswith("loss") for k in out):
        return sum(v.float() for v in out.values())
    total = torch.zeros(())
    for i, value in enumerate(zoo.tensors(out)):
        weights = torch.randn(value.shape, generator=torch.Generator().manual_seed(7 + i), dtype=torch.float32)
        total = total + (value.float() * weights.to(value.device)).mean()
    return total


def _seeded(model: torch.nn.Module, args: tuple, kwargs: dict, seed: int = SEED) -> Any:
    torch.manual_seed(seed)
    return _call(model, args, kwargs)


def _autocast_cosines(base: torch.nn.Module, args: tuple, kwargs: dict, reference: dict) -> dict[str, float]:
    """``zoo_harness._autocast_cosines`` for positional inputs: each parameter's first-step gradient cosine under
    fp16 autocast + GradScaler; empty where autocast itself fails."""
    model = copy.deepcopy(base).train()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = train_loss(_seeded(model, args, kwargs))
        scaler.scale(loss.float()).backward()
    except Exception:  # noqa: BLE001 - an op autocast cannot run in fp16 on this CPU: no comparison to make
        return {}
    scaler.unscale_(torch.optim.SGD(model.parameters(), lr=1e-3))
    return zoo._cosines(zoo._gradients(model), reference)


def _unresolved_in_fp32(base: torch.nn.Module, args: tuple, kwargs: dict, reference: dict) -> set[str]:
    """The parameters whose fp32 gradient is itself rounding noise: less than :data:`FP32_RESOLVED` aligned with the
    fp32 gradient of the same step after every weight moved by a relative :data:`NUDGE` (a resolved gradient moves
    by about as much; one that is 0 in exact arithmetic, such as a convolution's bias before an instance norm,
    is rounding noise that any nudge turns another way, and so is any cosine to it). float64 would say the same
    where a model runs in it, but some (RAFT) cast to float32 in their own code."""
    model = copy.deepcopy(base).train()
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float32)
                parameter.mul_(1 + NUDGE * noise.to(parameter.device, parameter.dtype))
    try:
        train_loss(_seeded(model, args, kwargs)).backward()
    except Exception:  # noqa: BLE001 - it ran once already: then every parameter is judged, as zoo_harness judges
        return set()
    cosines = zoo._cosines(zoo._gradients(model), reference)
    return {n for n, c in cosines.items() if c < FP32_RESOLVED}


def step_train(entry: Entry, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[str, str, dict]:
    if entry.train not in ("outputs", "targets"):
        return "n/a", entry.train, {}
    if entry.train == "targets":
        args = (args[0], _targets(args[0], masks="maskrcnn" in entry.name))
    base = _without_dropout(copy.deepcopy(model)).train()
    fp32 = copy.deepcopy(base)
    train_loss(_seeded(fp32, args, kwargs)).backward()
    reference = zoo._gradients(fp32)
    autocast = _autocast_cosines(base, args, kwargs, reference)
    noise = _unresolved_in_fp32(base, args, kwargs, reference)

    with read_as_native_cpu():  # the plan for speed of a CPU with fp16 instructions (one without trains in fp32)
        converted = amppass.convert(copy.deepcopy(base), args, "fp16", mode="train", example_kwargs=kwargs or None)
    info = conversion_info(converted)
    optimizer = torch.optim.SGD(converted.parameters(), lr=1e-3)
    scaler = amppass.LossScaler(init_scale=2.0**10)
    cosines, losses = None, []
    for step in range(3):
        optimizer.zero_grad()
        loss = train_loss(_seeded(converted, args, kwargs, SEED + step))
        losses.append(float(loss))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if cosines is None:
            cosines = zoo._cosines(zoo._gradients(converted), reference)
        scaler.step(optimizer)
        scaler.update()
    if not all(math.isfinite(x) for x in losses):
        return "fail", f"gradients: non-finite loss in 3 steps {losses}", info
    missing = sorted(set(reference) - set(dict(converted.named_parameters())))
    if missing:
        return "fail", (f"gradients: {len(missing)} of the model's parameters are not parameters of the converted "
                        f"model by name (first {missing[0]})"), info
    outcome, detail = zoo.judge_gradients({n: c for n, c in cosines.items() if n not in noise}, autocast)
    if noise:
        detail += f"; {len(noise)} parameters whose fp32 gradient is rounding noise not judged"
    return outcome, f"gradients: {detail}; losses {', '.join(f'{x:.4g}' for x in losses)}", info


def _positional(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """The inputs as one positional tuple (what export_onnx takes): keyword inputs at their forward() places,
    None between."""
    if not kwargs:
        return tuple(args)
    names = [p.name for p in inspect.signature(model.forward).parameters.values()
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = [k for k in kwargs if k not in names]
    if unknown:
        raise TypeError(f"keyword inputs {unknown} are not positional parameters of forward()")
    last = max(names.index(k) for k in kwargs)
    values = list(args) + [None] * (last + 1 - len(args))
    for key, value in kwargs.items():
        values[names.index(key)] = value
    return tuple(values)


def _leaves(model: torch.nn.Module, args: tuple) -> dict[str, torch.Tensor]:
    """The example's tensors by the names the exporters give them (a forward() name, ``<name>_<i>`` in a list)."""
    try:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        names = []
    named: dict[str, torch.Tensor] = {}
    for i, value in enumerate(args):
        name = names[i] if i < len(names) else f"input_{i}"
        if isinstance(value, torch.Tensor):
            named[name] = value
        elif value is not None:
            flat = [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
            named.update((f"{name}_{j}", t) for j, t in enumerate(flat))
    return named


def _feed(session: Any, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """onnxruntime's inputs from the named tensors: by name, or in order where the names differ."""
    inputs = session.get_inputs()
    if all(i.name in named for i in inputs):
        return {i.name: named[i.name] for i in inputs}
    if len(inputs) == len(named):
        return {i.name: t for i, t in zip(inputs, named.values(), strict=True)}
    raise LookupError(f"the file's inputs {[i.name for i in inputs]} match none of the example's {list(named)}")


def _grown(tensor: torch.Tensor, dims: dict[int, int]) -> torch.Tensor:
    """``tensor`` with each dimension ``d`` in ``dims`` tiled to ``dims[d]`` entries (index modulo its size)."""
    for dim, size in dims.items():
        tensor = tensor.index_select(dim, torch.arange(size) % tensor.shape[dim])
    return tensor


def _run_at(session: Any, model: torch.nn.Module, args: tuple, feed: dict[str, torch.Tensor],
            grow: dict[str, dict[int, int]], what: str) -> tuple[str, str]:
    """Run the file with the inputs of ``grow`` grown (name -> dim -> new size) and judge its first output against
    the fp32 model on the same grown inputs; a file that does not run there fails."""
    grown = {name: _grown(t, grow.get(name, {})) for name, t in feed.items()}
    try:
        got = torch.from_numpy(session.run(None, {n: t.numpy() for n, t in grown.items()})[0])
    except Exception as err:  # noqa: BLE001 - onnxruntime's own error types
        return "fail", f"{what}: the file declares it dynamic but does not run it: {zoo.first_line(err)}"
    replaced = {id(feed[name]): grown[name] for name in feed}
    torch_args = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: replaced.get(id(t), t), args)
    try:
        with torch.no_grad():
            reference = zoo.tensors(_call(model, torch_args, {}))[0]
    except Exception as err:  # noqa: BLE001 - the model itself refuses the size: nothing to judge the file by
        return "pass", f"{what}: runs (the fp32 model itself refuses it: {zoo.first_line(err)[:80]})"
    err = zoo.error(got.float(), reference)
    return _judged(err, autocast_error(model, torch_args, {}, reference, torch.float16, first=True), FLOOR_FP16, what)


def _runs_as_fp32(out: torch.Tensor, reference: torch.Tensor, measured: str) -> tuple[str, str]:
    """A detector's first output from the file (boxes after NMS), which no element-wise bound judges: finite, and
    of fp32's kind (its rank and every dimension but the count of boxes)."""
    measured = measured.replace(", bound", ", not judged: boxes after NMS, bound")
    if out.dim() != reference.dim() or tuple(out.shape[1:]) != tuple(reference.shape[1:]):
        return "fail", f"first output: shape {tuple(out.shape)}, fp32's {tuple(reference.shape)} ({measured})"
    if out.is_floating_point() and not torch.isfinite(out).all():
        return "fail", f"first output: not finite ({measured})"
    return "pass", f"first output: finite, {out.shape[0]} boxes against fp32's {reference.shape[0]} ({measured})"


def step_export(entry: Entry, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[str, str, dict]:
    import onnx
    import onnxruntime

    export_args = _positional(model, args, kwargs)
    with torch.no_grad():
        reference = zoo.tensors(_call(model, args, kwargs))[0]
    with tempfile.TemporaryDirectory(prefix="peer-zoo-onnx-") as folder:
        path = os.path.join(folder, "model.onnx")
        amppass.export_onnx(model, export_args, path, dtype="fp16")
        onnx.checker.check_model(path, full_check=True)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        feed = _feed(session, _leaves(model, export_args))
        out = torch.from_numpy(session.run(None, {n: t.numpy() for n, t in feed.items()})[0])
        outcome, detail = _judged(zoo.error(out.float(), reference),
                                  autocast_error(model, args, kwargs, reference, torch.float16, first=True),
                                  FLOOR_FP16, "first output")
        if not entry.elementwise:  # boxes after NMS: their count and order move with any rounding (autocast's too)
            outcome, detail = _runs_as_fp32(out, reference, detail)
        shapes = {i.name: list(i.shape) for i in session.get_inputs()}
        dynamic = {name: [d for d, s in enumerate(shape) if not isinstance(s, int)] for name, shape in shapes.items()}
        info = {"inputs": {n: [s if isinstance(s, int) else str(s) for s in shape] for n, shape in shapes.items()}}
        batch = {n: {0: entry.batch + 1} for n, dims in dynamic.items()
                 if entry.batch and 0 in dims and feed[n].dim() and feed[n].shape[0] == entry.batch}
        other = {n: {d: feed[n].shape[d] + max(1, feed[n].shape[d] // 2) for d in dims
                     if d not in batch.get(n, {})} for n, dims in dynamic.items()}
        other = {n: dims for n, dims in other.items() if dims}
        checks = [(outcome, detail)]
        if outcome == "pass" and batch:
            checks.append(_run_at(session, model, export_args, feed, batch, f"at batch {entry.batch + 1}"))
        if outcome == "pass" and other:
            where = ", ".join(f"{n}[{d}] {feed[n].shape[d]}->{s}" for n, dims in other.items() for d, s in dims.items())
            checks.append(_run_at(session, model, export_args, feed, other, f"at {where}"))
    failed = [c for c in checks if c[0] != "pass"]
    if failed:
        return failed[0][0], failed[0][1], info
    return "pass", "; ".join(c[1] for c in checks), info


RUNNERS = {"convert": step_convert, "train": step_train, "export-onnx": step_export}


# ------------------------------------------------------------------------------------------------- running
def run_model(name: str, steps: tuple[str, ...] = STEPS) -> Result:
    """Build ``name`` and run ``steps`` on it; never raises."""
    entry = ENTRIES[name]
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            try:
                with zoo._deadline(STEP_SECONDS):
                    model, args, kwargs = entry.build()
                    with torch.no_grad():  # the fp32 model must run (YOLO's head caches its anchors on this call)
                        _call(model, args, kwargs)
            except Exception as err:  # noqa: BLE001 - an unbuilt model is data, with its reason
                return Result(name, entry.family, False, zoo.first_line(err))
            result = Result(name, entry.family, True, seconds=round(time.perf_counter() - start, 2))
            for step in steps:
                start = time.perf_counter()
                info: dict = {}
                try:
                    with zoo._deadline(STEP_SECONDS):
                        outcome, detail, info = RUNNERS[step](entry, model, args, kwargs)
                except Exception as err:  # noqa: BLE001 - what the zoo is here to find
                    outcome, detail = "fail", zoo.first_line(err)
                    info = {"where": _where(err)}
                result.steps[step] = {"outcome": outcome, "detail": detail,
                                      "seconds": round(time.perf_counter() - start, 2),
                                      **({"info": info} if info else {})}
            return result
    finally:
        logging.disable(logging.NOTSET)


def _where(err: BaseException) -> str:
    """The innermost frame of the traceback inside amppass (file:function:line), else the innermost frame."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    inside = [f for f in frames if "/amppass/" in f.filename.replace(os.sep, "/")]
    frame = (inside or frames or [None])[-1]
    if frame is None:
        return ""
    path = frame.filename.replace(os.sep, "/")
    path = path.split("/work/main/")[-1] if "/amppass/" in path else path.split("site-packages/")[-1]
    return f"{path}:{frame.name}:{frame.lineno}"


def run_isolated(name: str, steps: tuple[str, ...], seconds: int, memory_gb: float) -> Result:
    """:func:`run_model` in a child process killed after ``seconds``: a hang or a native crash costs this model
    only (its steps then fail with what happened)."""
    with tempfile.TemporaryDirectory(prefix="peer-zoo-") as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, __file__, "--child", "--only", name, "--steps", *steps, "--json", str(out),
                   "--memory-gb", str(memory_gb)]
        try:
            done = subprocess.run(command, cwd=ROOT, timeout=seconds, capture_output=True, text=True)
            why = f"the process died (exit {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1][:200]}"
        except subprocess.TimeoutExpired:
            why = f"timed out: the model's process ran past {seconds} s and was killed"
        if out.exists():
            data = json.loads(out.read_text(encoding="utf-8"))["results"]
            if data:
                return Result(**data[0])
        result = Result(name, ENTRIES[name].family, True)
        result.steps = {s: {"outcome": "fail", "detail": why, "seconds": 0.0} for s in steps}
        return result


# ---------------------------------------------------------------------------------------------- expected
def reason_of(detail: str) -> str:
    """The stable start of a failure's detail, which peer_expected.json keeps: up to the first number (errors
    measured, sizes and counts move with the CPU and library versions), at most :data:`REASON_CHARS` characters."""
    match = re.search(r"(?<![A-Za-z_\d.])[-+]?\d", detail)
    cut = detail[:match.start()] if match else detail
    return cut[:REASON_CHARS].rstrip(" :;,([{'\"=").strip()


ABOUT = ("Expected deviations of the peer zoo (tests/conformance/test_peer_zoo.py, tests/conformance/peer_zoo.py): "
         "'unbuilt' lists the models that do not build here, with the reason; 'expected' lists per model the steps "
         "that fail today, each with the start of its reason (the detail up to its first number): such a step must "
         "fail with a detail that starts so. A listed step that passes fails the test, as does an unlisted one that "
         "fails. Regenerate: python tests/conformance/peer_zoo.py --write-expected")


def expected_from(results: list[dict]) -> dict:
    """The ``peer_expected.json`` content that ``results`` satisfy; entries of models and steps not run are kept."""
    return zoo.expected_from(results, EXPECTED, ABOUT, reason_of)


def verdict(result: Result, data: dict) -> list[str]:
    """Why ``result`` is not what ``data`` (peer_expected.json's content) says; empty when it is."""
    name, unbuilt = result.name, data.get("unbuilt", {}).get(result.name)
    if not result.built:
        return [] if unbuilt is not None and result.reason.startswith(unbuilt[:40]) else \
            [f"{name} does not build: {result.reason}"]
    if unbuilt is not None:
        return [f"{name} builds now: remove it from 'unbuilt' in peer_expected.json (it was: {unbuilt})"]
    found = []
    listed = data.get("expected", {}).get(name, {})
    for step, got in result.steps.items():
        reason = listed.get(step)
        if got["outcome"] == "fail":
            if reason is None:
                where = got.get("info", {}).get("where", "")
                found.append(f"{name} {step}: {got['detail']}" + (f" (at {where})" if where else ""))
            elif not got["detail"].startswith(reason):
                found.append(f"{name} {step} fails for another reason: {got['detail']} (expected: {reason})")
        elif reason is not None:
            found.append(f"{name} {step} no longer fails ({got['outcome']}: {got['detail']}): remove it from "
                         f"peer_expected.json (it was: {reason})")
    return found


# ------------------------------------------------------------------------------------------------- the CLI
def table(results: list[dict]) -> str:
    """The outcomes as a markdown table: one row per model, a column per step, and how convert converted it."""
    rows = ["| model | build s | " + " | ".join(STEPS) + " | converted | low MACs |",
            "| --- | --- | " + " | ".join("---" for _ in STEPS) + " | --- | --- |"]
    for r in results:
        if not r["built"]:
            rows.append(f"| {r['name']} | unbuilt: {r['reason']} |" + " |" * (len(STEPS) + 2))
            continue
        cells = []
        for step in STEPS:
            s = r["steps"].get(step)
            cells.append("-" if s is None else f"{s['outcome']} ({s['seconds']:.0f} s): {s['detail']}")
        info = r["steps"].get("convert", {}).get("info", {})
        how = info.get("how", "")
        if how == "parts":
            how = f"parts: {', '.join(info.get('parts', []))}"
        share = info.get("low_share")
        rows.append(f"| {r['name']} | {r.get('seconds', 0):.0f} | " + " | ".join(cells) +
                    f" | {how} | {'' if share is None else f'{share:.1%}'} |")
    return "\n".join(rows)


def versions() -> dict:
    found = {"torch": torch.__version__, "amppass": _commit()}
    for module in ("timm", "diffusers", "torchvision", "torchaudio", "ultralytics", "open_clip", "onnx",
                   "onnxruntime"):
        with contextlib.suppress(Exception):
            found[module] = __import__(module).__version__
    return found


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="these models only (names of ENTRIES)")
    parser.add_argument("--steps", nargs="*", default=list(STEPS))
    parser.add_argument("--default", action="store_true", help="the default test run's models, each with its steps")
    parser.add_argument("--json", default=None, help="write every outcome here (after each model)")
    parser.add_argument("--resume", action="store_true", help="keep the models already in --json")
    parser.add_argument("--write-expected", action="store_true", help=f"write {EXPECTED.name} from the outcomes")
    parser.add_argument("--table", default=None, help="write the outcomes as a markdown table here")
    parser.add_argument("--in-process", action="store_true", help="run every model in this process (no child)")
    parser.add_argument("--model-seconds", type=int, default=MODEL_SECONDS, help="a model's child process deadline")
    parser.add_argument("--memory-gb", type=float, default=0.0,
                        help="address space of a model's process: past it the step fails instead of the machine "
                             "swapping (default 0: no limit; at 12, torch's TorchScript ONNX exporter failed on "
                             "SSDlite, whose export passes without one: address space reserved, not memory used)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.child and options.memory_gb:
        import resource

        limit = int(options.memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    unknown = [n for n in options.only or () if n not in ENTRIES]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(ENTRIES)}")
    plan = [(n, DEFAULT[n]) for n in DEFAULT] if options.default else \
        [(n, tuple(options.steps)) for n in (options.only or ENTRIES)]
    results: list[dict] = []
    if options.resume and options.json and os.path.exists(options.json):
        results = json.loads(Path(options.json).read_text(encoding="utf-8"))["results"]
    done = {r["name"] for r in results}
    for number, (name, steps) in enumerate(plan):
        if name in done:
            continue
        if options.in_process or options.child:
            result = run_model(name, steps)
        else:
            result = run_isolated(name, steps, options.model_seconds, options.memory_gb)
        results.append(vars(result))
        summary = result.reason if not result.built else " ".join(
            f"{s}={v['outcome']}({v['seconds']:.0f}s)" for s, v in result.steps.items())
        print(f"[{number + 1}/{len(plan)}] {name}: {summary}", flush=True)
        if options.json:
            zoo.write_json(Path(options.json), {"versions": versions(), "results": results})
    if options.child:
        return
    if options.table:
        Path(options.table).write_text(table(results) + "\n", encoding="utf-8")
    if options.write_expected:
        zoo.write_json(EXPECTED, expected_from(results))


if __name__ == "__main__":
    main()
