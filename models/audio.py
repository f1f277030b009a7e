"""An audio classifier of the kind exported from TensorFlow front ends: a constant-Q transform computed by long
fixed 1-D convolutions, log magnitude, per-utterance normalisation, and a small conv + GRU classifier.

Weights of the classifier are random (callers seed the global RNG; :func:`models.arch.build_arch` does);
the filter banks are fixed complex exponentials under Hann windows and need no seed.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from models.blocks import ConvBNAct
from models.zoo import _randomize_batchnorm

SAMPLE_RATE = 16000


def waveform_inputs(g: torch.Generator, batch: int, samples: int) -> tuple[torch.Tensor]:
    """Synthetic recordings (batch, samples) at 16 kHz: three tones each (log-uniform 100 Hz - 4 kHz,
    amplitude 0.05-0.15, random phase) plus white noise of standard deviation 0.005."""
    t = torch.arange(samples) / SAMPLE_RATE
    freqs = 100 * 40 ** torch.rand(batch, 3, 1, generator=g)
    amps = 0.05 + 0.1 * torch.rand(batch, 3, 1, generator=g)
    phases = 2 * math.pi * torch.rand(batch, 3, 1, generator=g)
    tones = (amps * torch.sin(2 * math.pi * freqs * t + phases)).sum(1)
    return (tones + 0.005 * torch.randn(batch, samples, generator=g),)


class ConstantQ(nn.Module):
    """Constant-Q magnitude spectrogram (batch, bins, frames) from waveforms (batch, samples).

    Bin k has centre frequency ``fmin * 2^(k / bins_per_octave)`` and a Hann-windowed complex exponential
    kernel of ``ceil(Q * sample_rate / f_k)`` samples, Q = 1 / (2^(1 / bins_per_octave) - 1), scaled so a
    unit sinusoid at f_k has magnitude 0.5. All kernels are centred in one odd length (that of the lowest
    bin: 4115 samples for the defaults) and applied as two ``nn.Conv1d`` (real and imaginary parts) with
    stride ``hop`` over the zero-padded signal; the magnitude is ``sqrt(re^2 + im^2)``.
    """

    def __init__(self, sample_rate: int = SAMPLE_RATE, fmin: float = 65.41, bins: int = 72,
                 bins_per_octave: int = 12, hop: int = 256):
        super().__init__()
        q = 1 / (2 ** (1 / bins_per_octave) - 1)
        freqs = fmin * 2 ** (torch.arange(bins, dtype=torch.float64) / bins_per_octave)
        lengths = [math.ceil(q * sample_rate / f) for f in freqs.tolist()]
        size = lengths[0] | 1
        kernels = torch.zeros(bins, size, dtype=torch.complex128)
        for k, (f, length) in enumerate(zip(freqs.tolist(), lengths, strict=False)):
            window = torch.hann_window(length, periodic=False, dtype=torch.float64)
            t = (torch.arange(length, dtype=torch.float64) - (length - 1) / 2) / sample_rate
            start = (size - length) // 2
            kernels[k, start:start + length] = window * torch.exp(2j * math.pi * f * t) / window.sum()
        self.padding = size // 2
        self.real = nn.Conv1d(1, bins, size, stride=hop, bias=False)
        self.imag = nn.Conv1d(1, bins, size, stride=hop, bias=False)
        with torch.no_grad():
            self.real.weight.copy_(kernels.real[:, None])
            self.imag.weight.copy_(kernels.imag[:, None])
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        x = F.pad(waveform[:, None], (self.padding, self.padding))
        re, im = self.real(x), self.imag(x)
        return torch.sqrt(re * re + im * im)


class AudioCQTClassifier(nn.Module):
    """Constant-Q spectrogram -> ``log(magnitude + 1e-6)`` -> per-utterance mean/std normalisation -> three
    3x3 conv-BN-ReLU layers (two 2x2 max pools) -> mean over frequency -> GRU over frames -> linear head on
    the last step."""

    def __init__(self, num_classes: int = 10, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.cqt = ConstantQ()
        self.features = nn.Sequential(ConvBNAct(1, 16), nn.MaxPool2d(2), ConvBNAct(16, 32), nn.MaxPool2d(2),
                                      ConvBNAct(32, 64))
        self.gru = nn.GRU(64, 64, batch_first=True)
        self.head = nn.Linear(64, num_classes)

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        spec = torch.log(self.cqt(waveform) + self.eps)
        mean = spec.mean((1, 2), keepdim=True)
        std = spec.std((1, 2), keepdim=True)
        x = self.features(((spec - mean) / (std + 1e-5))[:, None])
        steps, _ = self.gru(x.mean(2).transpose(1, 2))
        return self.head(steps[:, -1])


def audio_cqt() -> nn.Module:
    model = AudioCQTClassifier()
    _randomize_batchnorm(model)
    return model


