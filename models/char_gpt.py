"""A character-level GPT-2 and real text to train it on: the Python standard library's own source.

Nothing is downloaded: the text is every ``.py`` file of the running interpreter's standard library (tests
and site-packages left out, files in sorted order; about 13 M characters on CPython 3.11), and the model is
``transformers.GPT2LMHeadModel`` built from a config with seeded random weights. Its embedding is tied to
its output layer, as GPT-2's is.
"""

from __future__ import annotations

import functools
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

VOCAB = 128  # ASCII; any other character reads as 0
HELD_OUT = 0.05  # the text's last 5% is never trained on


@dataclass(frozen=True)
class Corpus:
    """The standard library's text as character ids, split into a training and a held-out part."""

    train: torch.Tensor
    held_out: torch.Tensor

    def batch(self, generator: torch.Generator, batch: int, block: int, held_out: bool = False) -> torch.Tensor:
        """``batch`` random windows of ``block + 1`` characters (inputs and next-character targets)."""
        text = self.held_out if held_out else self.train
        starts = torch.randint(0, len(text) - block - 1, (batch,), generator=generator)
        return torch.stack([text[s:s + block + 1] for s in starts.tolist()])


@functools.lru_cache(maxsize=2)
def stdlib_corpus(limit: int | None = None) -> Corpus:
    """The standard library's ``.py`` files as one text of ids (first ``limit`` characters if given)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "test", "tests"} & set(p.parts))
    chunks, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        chunks.append(text)
        size += len(text)
        if limit is not None and size >= limit:
            break
    data = "".join(chunks)[:limit].encode("ascii", errors="replace")
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)
    ids[ids >= VOCAB] = 0
    cut = int(len(ids) * (1 - HELD_OUT))
    return Corpus(ids[:cut], ids[cut:])


def char_gpt(layers: int = 4, width: int = 256, heads: int = 8, block: int = 256, dropout: float = 0.1,
             seed: int = 0) -> nn.Module:
    """A GPT-2 language model over :data:`VOCAB` characters, tied embedding and output weights, in train mode."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=block, n_embd=width, n_layer=layers, n_head=heads,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0,
                        eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).train()


def next_char_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per character) of the next-character predictions, in fp32."""
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def held_out_loss(model: nn.Module, batch: torch.Tensor) -> float:
    """:func:`next_char_loss` of a batch of character ids in eval mode without gradients; the model is in train mode
    after."""
    model.eval()
    with torch.no_grad():
        loss = next_char_loss(model(batch[:, :-1]).logits, batch[:, 1:]).item()
    model.train()
    return loss


def train_steps(model: nn.Module, batches: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer, scaler: Any,
                part: tuple[int, int] | None = None) -> list[float]:
    """One loss-scaled optimizer step per batch of character ids (inputs all but the last, targets all but the
    first), on chunk ``rank`` of ``world`` of each batch when ``part=(rank, world)``; the training losses."""
    losses = []
    for batch in batches:
        if part is not None:
            batch = batch.chunk(part[1])[part[0]]
        optimizer.zero_grad()
        loss = next_char_loss(model(batch[:, :-1]).logits, batch[:, 1:])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses
