"""An attention mask the captured graph fixes leaves ``scaled_dot_product_attention`` (:mod:`amppass.fx.prepare.masks`):
an all-true one is dropped and a square causal one becomes ``is_causal``, so SDPA may use its fused kernels on
CUDA. Masks that depend on an input, a buffer or a size, float masks, and masks that would broadcast the scores
wider are kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amppass
from amppass.fx.prepare.masks import fold_constant_masks

transformers = pytest.importorskip("transformers")


def _sdpa_calls(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]


def _mask_of(node: torch.fx.Node):
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _graph_of(converted: torch.nn.Module) -> torch.fx.GraphModule:
    return next(m for m in converted.modules() if isinstance(m, torch.fx.GraphModule))


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_vit_converted_runs_attention_without_the_all_true_mask_export_writes_out():
    config = transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    intermediate_size=128, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = transformers.ViTModel(config).eval()
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    exported = torch.export.export(model, (pixels,)).module()
    assert all(_mask_of(n) is not None for n in _sdpa_calls(exported))  # the trap: export writes the mask out

    fast = amppass.convert(model, (pixels,), dtype="bf16", plan_for="coverage")
    gm = _graph_of(fast)
    gm.graph.lint()
    calls = _sdpa_calls(gm)
    assert len(calls) == 2 and all(_mask_of(n) is None for n in calls)
    assert not [n for n in gm.graph.nodes if n.target == torch.ops.aten.ge.Scalar]  # the mask's ops are gone
    rows = [r for r in amppass.report(fast).rows if r.op == "aten.scaled_dot_product_attention"]
    assert rows and all("True everywhere" in r.reason for r in rows)
    with torch.no_grad():
        want = model(pixels).last_hidden_state
        got = fast(pixels).last_hidden_state
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = model(pixels).last_hidden_state.float()
        other = torch.randn(5, 3, 32, 32)  # another batch size runs the same folded graph
        assert _error(fast(other).last_hidden_state, model(other).last_hidden_state) < 0.05
    assert _error(got, want) <= 2 * _error(autocast, want) + 1e-4


def test_bert_without_padding_runs_attention_without_a_mask_at_every_length():
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    fast = amppass.convert(model, (torch.randint(0, 50, (2, 8)),), dtype="bf16", plan_for="coverage")
    calls = _sdpa_calls(_graph_of(fast))
    assert calls and all(_mask_of(n) is None for n in calls)  # arange(S) + 0 >= 0: True for every S
    with torch.no_grad():
        for length in (3, 8, 13):  # lengths the dynamic graph serves
            ids = torch.randint(0, 50, (2, length))
            assert _error(fast(ids).last_hidden_state, model(ids).last_hidden_state) < 0.05


def test_a_padding_mask_from_the_inputs_is_kept():
    config = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=50)
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 50, (2, 8))
    padding = torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    fast = amppass.convert(model, (ids,), dtype="bf16", plan_for="coverage",
                           example_kwargs={"attention_mask": padding})
    calls = _sdpa_calls(_graph_of(fast))
    assert calls and all(_mask_of(n) is not None for n in calls)


class _Attention(torch.nn.Module):
    """One attention call whose mask is built from ``arange`` at a fixed length, as transformers writes masks."""

    def __init__(self, kind: str, length: int = 6):
        super().__init__()
        self.kind, self.length = kind, length
        self.register_buffer("stored", torch.ones(length, length, dtype=torch.bool))

    def forward(self, q, k, v):
        rows = torch.arange(self.length, device=q.device)[:, None]
        cols = torch.arange(self.length, device=q.device)[None, :]
        mask = {"all": cols >= 0, "causal": cols <= rows, "window": (cols <= rows) & (rows - cols < 2),
                "stored": self.stored, "float": torch.zeros(self.length, self.length, device=q.device)}[self.kind]
        if self.kind == "all":
            mask = mask.expand(self.length, self.length)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class _IndexMask(torch.nn.Module):
    """A mask of the key index against a bound, at whatever length the call has (a symbolic size)."""

    def __init__(self, shift: int, bound: int):
        super().__init__()
        self.shift, self.bound = shift, bound

    def forward(self, q, k, v):
        keys = torch.arange(k.shape[-2], device=q.device) + self.shift
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(keys >= self.bound)[None, :])


@pytest.mark.parametrize("shift, bound, proven", [(0, 0, True), (2, 1, True), (0, 1, False), (-1, 0, False)])
def test_an_index_mask_is_dropped_only_where_its_bound_holds_at_every_length(shift, bound, proven):
    module, inputs = _IndexMask(shift, bound), _qkv()
    length = torch.export.Dim("length", min=2, max=64)
    shapes = ({2: length}, {2: length}, {2: length})
    gm = torch.export.export(module, inputs, dynamic_shapes=shapes).module()
    assert fold_constant_masks(gm) == proven
    for size in (2, 6, 11):
        q, k, v = _qkv(size)
        torch.testing.assert_close(gm(q, k, v), module(q, k, v), rtol=1e-5, atol=1e-6)


def _qkv(length: int = 6):
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 3, length, 8, generator=generator) for _ in range(3))


@pytest.mark.parametrize("kind, expect", [("all", "dropped"), ("causal", "causal"), ("window", "kept"),
                                          ("stored", "kept"), ("float", "kept")])
def test_fold_keeps_exactly_the_attention_it_was_given(kind, expect):
    module, inputs = _Attention(kind), _qkv()
    gm = torch.export.export(module, inputs).module()
    want = module(*inputs)
    assert fold_constant_masks(gm) == (expect != "kept")
    gm.graph.lint()
    (call,) = _sdpa_calls(gm)
    assert (_mask_of(call) is None) == (expect != "kept")
    assert bool(call.kwargs.get("is_causal", False)) == (expect == "causal")
    torch.testing.assert_close(gm(*inputs), want, rtol=1e-5, atol=1e-6)



def test_a_mask_whose_shape_the_graph_does_not_record_is_kept():
    module, inputs = _Attention("all"), _qkv()
    gm = torch.export.export(module, inputs).module()
    (call,) = _sdpa_calls(gm)
    del _mask_of(call).meta["val"]  # without it, whether the mask widens the scores cannot be told
    assert fold_constant_masks(gm) == 0 and _mask_of(call) is not None
