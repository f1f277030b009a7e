"""Small architectures whose captured graphs do not serve every shape at once, for the shape tests and benchmark.

Each entry of :data:`ARCHITECTURES` is ``(name, builder)``; ``builder()`` returns a :class:`ShapeCase`: an
eval-mode model with seeded random weights, the example it is converted with, and three more calls it must
serve (batch 1, a larger batch, another length or image size). Nothing is downloaded: transformers models
come from small configs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ShapeCase:
    """A model, the inputs it is converted with, and the other calls it must serve (label -> args)."""

    model: nn.Module
    example: tuple
    calls: dict[str, tuple] = field(default_factory=dict)
    compile_only: bool = False  # data-dependent control flow: torch.compile reaches it, torch.export does not


def _seeded(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().eval()


def _floats(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _tokens(batch: int, length: int, vocab: int = 500, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


class Recurrent(nn.Module):
    """An embedding-free sequence classifier: an RNN over features, a linear head on every step."""

    def __init__(self, cell: type[nn.Module], bidirectional: bool = False):
        super().__init__()
        self.rnn = cell(16, 32, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(64 if bidirectional else 32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class Encoder(nn.Module):
    """nn.TransformerEncoder (its eval fast path included) with a linear head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


class Upsampler(nn.Module):
    """Convolutions around F.interpolate: the output size follows the input's."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.up = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.down(x))
        return self.up(F.interpolate(h, size=x.shape[-2:], mode="bilinear", align_corners=False))


class Detector(nn.Module):
    """A tiny one-stage detector: a conv backbone, per-cell boxes and scores, then greedy NMS in Python.

    The NMS loop runs as long as boxes remain, so its trip count depends on the data: torch.export
    cannot capture it whole, torch.compile breaks the graph around it.
    """

    def __init__(self, iou: float = 0.5, keep: int = 20):
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        self.boxes = nn.Conv2d(32, 4, 1)
        self.scores = nn.Conv2d(32, 1, 1)
        nn.init.normal_(self.scores.weight, std=0.3)  # scores spread apart, as a trained head's are: a stable order
        self.iou, self.keep = iou, keep

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(*self.predict(images))

    def predict(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Boxes (x0, y0, x1, y1) and scores for every cell of the feature map."""
        features = self.backbone(images)
        n, _, h, w = features.shape
        ys, xs = torch.meshgrid(torch.arange(h, dtype=images.dtype), torch.arange(w, dtype=images.dtype), indexing="ij")
        centres = torch.stack([xs, ys], -1).reshape(1, h * w, 2) * 4.0 + 2.0
        deltas = self.boxes(features).flatten(2).transpose(1, 2)
        sizes = torch.exp(deltas[..., 2:].clamp(max=3.0)) * 4.0
        boxes = torch.cat([centres + deltas[..., :2] - sizes / 2, centres + deltas[..., :2] + sizes / 2], -1)
        return boxes, torch.sigmoid(self.scores(features).flatten(1))

    def select(self, boxes: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best boxes of each image after non-maximum suppression."""
        kept_boxes, kept_scores = [], []
        for b in range(boxes.shape[0]):
            keep = _nms(boxes[b], scores[b], self.iou)[: self.keep]
            kept_boxes.append(boxes[b][keep])
            kept_scores.append(scores[b][keep])
        return torch.stack(kept_boxes), torch.stack(kept_scores)


def _nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> torch.Tensor:
    """Greedy non-maximum suppression: indices of kept boxes, best first."""
    order = scores.argsort(descending=True)
    kept = []
    while order.numel() > 0:
        best = order[0]
        kept.append(best)
        rest = order[1:]
        top_left = torch.maximum(boxes[best, :2], boxes[rest, :2])
        bottom_right = torch.minimum(boxes[best, 2:], boxes[rest, 2:])
        inter = (bottom_right - top_left).clamp(min=0).prod(-1)
        area = (boxes[:, 2:] - boxes[:, :2]).prod(-1)
        iou = inter / (area[best] + area[rest] - inter)
        order = rest[iou <= threshold]
    return torch.stack(kept)


def lstm() -> ShapeCase:
    return ShapeCase(_seeded(lambda: Recurrent(nn.LSTM)), (_floats(2, 40, 16),), {
        "batch 1": (_floats(1, 40, 16, seed=2),), "batch 6": (_floats(6, 40, 16, seed=3),),
        "length 17": (_floats(2, 17, 16, seed=4),)})


def gru() -> ShapeCase:
    return ShapeCase(_seeded(lambda: Recurrent(nn.GRU, bidirectional=True)), (_floats(2, 24, 16),), {
        "batch 1": (_floats(1, 24, 16, seed=2),), "batch 6": (_floats(6, 24, 16, seed=3),),
        "length 9": (_floats(2, 9, 16, seed=4),)})


def transformer_encoder() -> ShapeCase:
    return ShapeCase(_seeded(Encoder), (_floats(1, 10, 32),), {
        "batch 2": (_floats(2, 10, 32, seed=2),), "batch 8": (_floats(8, 10, 32, seed=3),),
        "length 23": (_floats(1, 23, 32, seed=4),)})


def interpolate() -> ShapeCase:
    return ShapeCase(_seeded(Upsampler), (_floats(2, 3, 32, 32),), {
        "batch 1": (_floats(1, 3, 32, 32, seed=2),), "batch 5": (_floats(5, 3, 32, 32, seed=3),),
        "size 40x24": (_floats(2, 3, 40, 24, seed=4),)})


def mamba() -> ShapeCase:
    from transformers import MambaConfig, MambaModel

    config = MambaConfig(vocab_size=500, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                         conv_kernel=4, use_cache=False)
    return ShapeCase(_seeded(lambda: MambaModel(config)), (_tokens(2, 12),), {
        "batch 1": (_tokens(1, 12, seed=2),), "batch 4": (_tokens(4, 12, seed=3),),
        "length 20": (_tokens(2, 20, seed=4),)})


def convnext() -> ShapeCase:
    from transformers import ConvNextConfig, ConvNextModel

    config = ConvNextConfig(num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=32)
    return ShapeCase(_seeded(lambda: ConvNextModel(config)), (_floats(1, 3, 32, 32),), {
        "batch 2": (_floats(2, 3, 32, 32, seed=2),), "batch 6": (_floats(6, 3, 32, 32, seed=3),),
        "size 48": (_floats(1, 3, 48, 48, seed=4),)})


def swin() -> ShapeCase:
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    return ShapeCase(_seeded(lambda: SwinModel(config)), (_floats(2, 3, 32, 32),), {
        "batch 1": (_floats(1, 3, 32, 32, seed=2),), "batch 4": (_floats(4, 3, 32, 32, seed=3),),
        "size 48": (_floats(2, 3, 48, 48, seed=4),)})


def _decoder(config_class: str, model_class: str) -> Callable[[], ShapeCase]:
    def build() -> ShapeCase:
        import transformers

        config = getattr(transformers, config_class)(
            vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, use_cache=True)
        return ShapeCase(_seeded(lambda: getattr(transformers, model_class)(config)), (_tokens(2, 12),), {
            "batch 1": (_tokens(1, 12, seed=2),), "batch 4": (_tokens(4, 12, seed=3),),
            "length 30": (_tokens(2, 30, seed=4),)})

    return build


def gpt2_long_example() -> ShapeCase:
    """GPT-2 converted with an 8x128 example and called with short sequences."""
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=500, n_positions=256, n_embd=64, n_layer=2, n_head=4, use_cache=False)
    return ShapeCase(_seeded(lambda: GPT2Model(config)), (_tokens(8, 128),), {
        "1x16": (_tokens(1, 16, seed=2),), "batch 3": (_tokens(3, 128, seed=3),),
        "8x1": (_tokens(8, 1, seed=4),)})


def detector() -> ShapeCase:
    return ShapeCase(_seeded(Detector), (_floats(1, 3, 32, 32),), {
        "batch 2": (_floats(2, 3, 32, 32, seed=2),), "batch 3": (_floats(3, 3, 32, 32, seed=3),),
        "size 48": (_floats(1, 3, 48, 48, seed=4),)}, compile_only=True)


ARCHITECTURES: list[tuple[str, Callable[[], ShapeCase]]] = [
    ("lstm", lstm),
    ("gru", gru),
    ("transformer_encoder", transformer_encoder),
    ("interpolate", interpolate),
    ("mamba", mamba),
    ("convnext", convnext),
    ("swin", swin),
    ("qwen2_cache", _decoder("Qwen2Config", "Qwen2ForCausalLM")),
    ("mistral_cache", _decoder("MistralConfig", "MistralForCausalLM")),
    ("gpt2_8x128", gpt2_long_example),
    ("detector_nms", detector),
]
