"""Train mode runs its graph under autograd: an in-place write to a value saved for backward must not reach it.

DeBERTa-style masked softmax (SEW-D) fills the softmax output in place inside its own ``autograd.Function``,
which torch.export inlines into the train graph without the function's backward; the write then invalidated the
softmax output autograd saved ("modified by an inplace operation") on the first backward. Such a write to an
intermediate value nothing else aliases becomes its out-of-place op
(:func:`amppass.fx.prepare.aliasing.functional_writes`).
"""

from __future__ import annotations

import torch
from torch import nn

import amppass
from amppass.fx.capture.export import capture
from amppass.fx.prepare.aliasing import functional_writes


class MaskedSoftmax(torch.autograd.Function):
    """Softmax whose masked positions are zeroed in place, with its own backward (as DeBERTa's XSoftmax)."""

    @staticmethod
    def forward(ctx, scores, mask):
        probs = torch.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1)
        probs.masked_fill_(~mask, 0)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad):
        (probs,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, -1, probs.dtype), None


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        # no key bias: softmax is blind to it, so its gradient is rounding noise
        self.q, self.k, self.out = nn.Linear(16, 16), nn.Linear(16, 16, bias=False), nn.Linear(16, 4)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4.0
        return self.out(MaskedSoftmax.apply(scores, mask) @ x).sum(1)


def _case():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6, 6, dtype=torch.bool)
    mask[:, :, 4:] = False
    return Attention().train(), x, mask


def test_a_write_to_a_saved_value_becomes_out_of_place():
    model, x, mask = _case()
    gm = capture(model, (x, mask), train=True)
    writes = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.masked_fill_.Scalar]
    assert writes and functional_writes(gm) == writes
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.masked_fill_.Scalar]
    gm.graph.lint()


def test_the_masked_softmax_trains_with_fp32_s_gradients():
    model, x, mask = _case()
    fast = amppass.convert(model, (x, mask), dtype="bf16", mode="train", plan_for="coverage")
    fast(x, mask).pow(2).mean().backward()
    model(x, mask).pow(2).mean().backward()
    got, want = dict(fast.named_parameters()), dict(model.named_parameters())
    for name, parameter in want.items():
        cosine = torch.nn.functional.cosine_similarity(got[name].grad.flatten(), parameter.grad.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))
