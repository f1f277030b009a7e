"""A training loop: a small character GPT-2 trained with a converted fp16 graph and amppass.LossScaler.

The converted model keeps fp32 master parameters under the original's names; the loop is the one you would
write with ``torch.amp.GradScaler`` (scale, backward, unscale before clipping, step, update). The same model
trained in fp32 from the same weights on the same batches is the reference: the held-out losses must agree.
"""

from __future__ import annotations

import copy

import torch

import amppass
from models.char_gpt import char_gpt, held_out_loss, next_char_loss, stdlib_corpus

STEPS, BATCH, BLOCK = 20, 8, 32


def train(model: torch.nn.Module, batches: list[torch.Tensor], scaler: amppass.LossScaler | None) -> list[float]:
    """One AdamW step per batch (loss-scaled when ``scaler`` is given); the training losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = next_char_loss(model(batch[:, :-1]).logits, batch[:, 1:])
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)                    # gradients in true units before clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)                        # skipped if a gradient overflowed
            scaler.update()
        losses.append(loss.item())
    return losses


def main() -> None:
    corpus, generator = stdlib_corpus(200_000), torch.Generator().manual_seed(0)
    batches = [corpus.batch(generator, BATCH, BLOCK) for _ in range(STEPS)]
    held_out = corpus.batch(generator, 4 * BATCH, BLOCK, held_out=True)

    net = char_gpt(layers=2, width=64, heads=4, block=BLOCK, dropout=0.0)
    reference = copy.deepcopy(net)
    model = amppass.convert(net, (batches[0][:, :-1],), dtype=torch.float16, mode="train", plan_for="coverage")
    print(amppass.report(model).summary())

    before = held_out_loss(model, held_out)
    low = train(model, batches, amppass.LossScaler(init_scale=2.0**10))
    fp32 = train(reference, batches, None)
    after, after_fp32 = held_out_loss(model, held_out), held_out_loss(reference, held_out)
    print(f"training loss, first and last step: amppass fp16 {low[0]:.3f} -> {low[-1]:.3f}, "
          f"fp32 {fp32[0]:.3f} -> {fp32[-1]:.3f}")
    print(f"held-out loss: {before:.3f} before, {after:.3f} after (fp32: {after_fp32:.3f})")
    assert after < before - 0.5 and abs(after - after_fp32) < 0.03 * after_fp32
    assert list(model.state_dict()) == list(reference.state_dict())   # the original's keys, to save and resume


if __name__ == "__main__":
    main()
