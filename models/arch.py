"""Registry of real architectures built from code: ``ARCHS`` names them, :func:`build_arch` builds one.

Where :mod:`models.zoo` has a few families at two sizes, this registry has one faithful configuration per
architecture (full size for the vision nets, small configs for the language models) with the facts a
benchmark or test needs beside the model: the kind of network, the other (batch, shape) pairs it must
serve, and whether ``torch.export.export(model, example_inputs, example_kwargs, strict=False)`` captures it
whole. ``shape`` is one number per model: the token count for sequence models, the image side (or a
(height, width) pair) for vision models, the sample count for audio.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import onnx
import torch
from torch import nn

from models import audio, detection, sequence, vision
from models.onnx_export import export
from models.zoo import ModelCase


@dataclass
class ArchCase(ModelCase):
    """A :class:`~models.zoo.ModelCase` with the facts of its architecture.

    ``make_inputs(seed, batch=None, shape=None)`` makes fresh inputs for another seed, batch size or shape
    (by default the case's own ``batch`` and ``shape``); ``example_inputs`` equals ``make_inputs(0)``.
    ``other_shapes`` lists three (batch, shape) pairs the model must serve as well: batch 1, a larger batch,
    and another length or image size.
    """

    batch: int
    shape: Any
    other_shapes: list[tuple[int, Any]]
    exportable: bool
    description: str


@dataclass(frozen=True)
class _Arch:
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.Generator, int, Any], tuple]
    shape: Any
    other_shape: Any
    kind: str
    exportable: bool
    description: str
    large_batch: int = 4


_ARCHS: dict[str, _Arch] = {
    "mobilenet_v3_small": _Arch(
        vision.mobilenet_v3_small, vision.image_inputs, 224, 160, "depthwise-cnn", True,
        "MobileNetV3-Small: depthwise convs, hardswish, hardsigmoid squeeze-excitation, BatchNorm (2.5M)"),
    "regnet_y_400mf": _Arch(
        vision.regnet_y_400mf, vision.image_inputs, 224, 256, "grouped-cnn", True,
        "RegNetY-400MF: grouped 3x3 convs (width 8 groups), squeeze-excitation, BatchNorm (4.3M)"),
    "efficientnet_b0": _Arch(
        vision.efficientnet_b0, vision.image_inputs, 224, 256, "depthwise-cnn", True,
        "EfficientNet-B0: MBConv blocks with depthwise convs, SiLU, sigmoid squeeze-excitation (5.3M)"),
    "convnext_tiny": _Arch(
        vision.convnext_tiny, vision.image_inputs, 224, 256, "depthwise-cnn", True,
        "ConvNeXt-T: depthwise 7x7 convs, channels-last LayerNorm, GELU MLPs, layer scale (28.6M)"),
    "swin_t": _Arch(
        vision.swin_t, vision.image_inputs, 224, 256, "transformer", True,
        "Swin-T: shifted 7x7 window attention with relative position bias, patch merging (28.3M)"),
    "interpolate_net": _Arch(
        vision.interpolate_net, vision.image_inputs, 128, 100, "segmentation", True,
        "U-Net-like segmenter whose decoder resizes with F.interpolate(size=...) and scale_factor=2"),
    "lstm": _Arch(
        sequence.lstm, sequence.token_inputs(), 32, 128, "rnn", True,
        "Language model: embedding -> 2-layer nn.LSTM (hidden 256) -> vocabulary head"),
    "gru": _Arch(
        sequence.gru, sequence.token_inputs(), 32, 128, "rnn", True,
        "Language model: embedding -> 2-layer nn.GRU (hidden 256) -> vocabulary head"),
    "transformer_encoder": _Arch(
        sequence.transformer_encoder, sequence.token_inputs(), 32, 100, "transformer", True,
        "nn.TransformerEncoder: d_model 128, 4 heads, 4 layers, batch first, over token embeddings"),
    "mamba": _Arch(
        sequence.mamba, sequence.token_inputs(), 32, 64, "ssm", True,
        "transformers MambaModel (hidden 128, 4 layers): pure-torch selective scan"),
    "mistral": _Arch(
        sequence.mistral, sequence.token_inputs(), 32, 128, "decoder-llm", True,
        "transformers MistralModel (hidden 256, 4 layers, GQA 8/2 heads, 64-token sliding window), no cache"),
    "mistral_cache": _Arch(
        sequence.mistral_cache, sequence.token_inputs(), 32, 128, "decoder-llm", False,
        "mistral with the default use_cache=True: returns a DynamicCache, an output torch.export refuses"),
    "qwen2": _Arch(
        sequence.qwen2, sequence.token_inputs(), 32, 96, "decoder-llm", True,
        "transformers Qwen2Model (hidden 128, 2 layers, GQA 4/2 heads, biased q/k/v), no cache"),
    "t5_small": _Arch(
        sequence.t5_small, sequence.seq2seq_inputs, 32, 64, "transformer", True,
        "transformers T5Model (d_model 256, 2+2 layers): input_ids, attention_mask, decoder_input_ids"),
    "distilbert": _Arch(
        sequence.distilbert, sequence.token_inputs(), 32, 128, "transformer", True,
        "transformers DistilBertModel (dim 128, 2 layers, 4 heads)"),
    "detector": _Arch(
        detection.detector, vision.image_inputs, 256, (256, 320), "detector", False,
        "Two-stage detector: backbone, FPN, RPN, torch NMS loops, RoI-align by grid_sample, box head"),
    "db_text_detector": _Arch(
        detection.db_text_detector, vision.image_inputs, 640, (480, 640), "segmentation", True,
        "DB text detector: ResNet-18-vd, FPN/PAN, scale attention, sigmoid(50 (P - T)) (49 convs)",
        large_batch=2),
    "audio_cqt": _Arch(
        audio.audio_cqt, audio.waveform_inputs, audio.SAMPLE_RATE, 2 * audio.SAMPLE_RATE, "audio", True,
        "Constant-Q transform by 4115-tap Conv1d banks (72 bins), log magnitude, conv + GRU classifier"),
}

ARCHS: tuple[str, ...] = tuple(_ARCHS)


def build_arch(name: str, batch: int = 1, shape: Any = None, seed: int = 0) -> ArchCase:
    """Build architecture ``name`` in eval mode with weights seeded by ``seed``, and inputs of ``batch`` rows
    at ``shape`` (the architecture's own default when None). The global torch RNG state is left untouched."""
    if name not in _ARCHS:
        raise KeyError(f"unknown architecture {name!r}; expected one of {ARCHS}")
    arch = _ARCHS[name]
    default_batch = batch
    default_shape = arch.shape if shape is None else shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = arch.build()
    model.eval()

    def make_inputs(input_seed: int, batch: int | None = None, shape: Any = None) -> tuple:
        g = torch.Generator().manual_seed(input_seed)
        return arch.inputs(g, default_batch if batch is None else batch, default_shape if shape is None else shape)

    return ArchCase(
        name=name,
        model=model,
        example_inputs=make_inputs(0),
        example_kwargs={},
        make_inputs=make_inputs,
        kind=arch.kind,
        batch=batch,
        shape=default_shape,
        other_shapes=[(1, arch.shape), (arch.large_batch, arch.shape), (1, arch.other_shape)],
        exportable=arch.exportable,
        description=arch.description,
    )


def audio_onnx(path: str | os.PathLike | None = None, *, batch: int = 1, samples: int = audio.SAMPLE_RATE,
               seed: int = 0) -> onnx.ModelProto:
    """The classifier of ``build_arch("audio_cqt", seed=seed)`` in ONNX (opset 17): input "waveform" (batch
    axis dynamic, ``samples`` fixed), output "logits"; also saved at ``path`` if given."""
    case = build_arch("audio_cqt", batch=batch, shape=samples, seed=seed)
    return export(case.model, case.example_inputs, ["waveform"], ["logits"], path)


def db_onnx(path: str | os.PathLike | None = None, *, batch: int = 1, shape: int | tuple[int, int] = 640,
            seed: int = 0) -> onnx.ModelProto:
    """The DB text detector of ``build_arch("db_text_detector", seed=seed)`` in ONNX (opset 17): input
    "image" (batch axis dynamic, ``shape`` fixed), outputs "binary", "probability" and "threshold"; also
    saved at ``path`` if given."""
    case = build_arch("db_text_detector", batch=batch, shape=shape, seed=seed)
    return export(case.model, case.example_inputs, ["image"], ["binary", "probability", "threshold"], path)
