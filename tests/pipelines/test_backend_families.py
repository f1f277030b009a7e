"""The compile backend compiles what plain inductor compiles: graphs that run a vmap (Mamba's and Jamba's
associative scan under torch.compile) and index tables written with Python numbers (BEiT's relative positions).

Each model compiles at two shapes, with the plan applied (the report has converted graphs), and matches fp32.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import amppass

BF16_TOLERANCE = 2e-2  # relative L2 error of a few bf16 matrix products


class Scanned(nn.Module):
    """A gated linear recurrence run by ``associative_scan`` in its generic mode, which dynamo traces as a vmap."""

    def __init__(self):
        super().__init__()
        self.gate, self.value, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch._higher_order_ops.associative_scan import associative_scan

        def combine(left, right):
            return left[0] * right[0], right[0] * left[1] + right[1]

        _, states = associative_scan(combine, (torch.sigmoid(self.gate(x)), self.value(x)), dim=1,
                                     combine_mode="generic")
        return self.out(states)


class IndexTable(nn.Module):
    """A bias table read through an index buffer filled with Python numbers, as BEiT builds its relative positions."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(9, 4))
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.zeros(5, 5, dtype=torch.long)
        index[1:, 1:] = torch.arange(16).view(4, 4) % 6
        index[0, 0:] = 6
        index[0:, 0] = 7
        index[0, 0] = 8
        return self.proj(x + self.table[index].sum(1))


def _compiled_close(model: nn.Module, inputs: list[tuple], options: dict | None = None) -> None:
    """``model`` compiled with the amppass backend matches fp32 at each input, with every graph converted."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="amppass", options={"dtype": "bf16", "plan_for": "coverage",
                                                                 **(options or {})})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for args in inputs:
            ref = model(*args)
            ref = getattr(ref, "logits", ref)
            out = compiled(*args)
            out = getattr(out, "logits", out)
            error = float((out.float() - ref).norm() / ref.norm())
            assert error < BF16_TOLERANCE, (tuple(args[0].shape), error)
    info = amppass.report(compiled).info
    assert not info["unconverted"], info["unconverted"]
    assert any(row.precision == "bf16" for row in amppass.report(compiled).rows)
    torch._dynamo.reset()


def _seeded(cls: type, *args) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args).eval()


def test_a_vmap_in_the_graph_compiles():
    _compiled_close(_seeded(Scanned), [(torch.randn(2, 6, 8),), (torch.randn(3, 9, 8),)], {"compiler": "eager"})


def test_python_numbers_written_into_an_index_table_compile_with_freezing():
    _compiled_close(_seeded(IndexTable), [(torch.randn(2, 5, 4),), (torch.randn(3, 5, 4),)])


# -- the transformers families that failed ----------------------------------------------------------------------

def _mamba():
    transformers = pytest.importorskip("transformers")
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4))


def _jamba():
    transformers = pytest.importorskip("transformers")
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        use_mamba_kernels=False))


def _beit():
    transformers = pytest.importorskip("transformers")
    return transformers.BeitForImageClassification(transformers.BeitConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5, use_relative_position_bias=True))


def _ids(batch: int, length: int) -> tuple:
    return (torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length)),)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mamba", "jamba"])
def test_state_space_decoders_compile(family):
    _compiled_close(_seeded({"mamba": _mamba, "jamba": _jamba}[family]), [_ids(2, 12), _ids(3, 9)])


@pytest.mark.slow
def test_beit_compiles():
    images = [(torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(s)),) for s in (1, 2)]
    images[1] = (torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2)),)
    _compiled_close(_seeded(_beit), images)
