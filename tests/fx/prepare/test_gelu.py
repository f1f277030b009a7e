"""GPT-2's written-out tanh-GELU runs as one ``aten.gelu(approximate="tanh")`` in inference as in training
(:mod:`amppass.fx.prepare.gelu`): one low kernel computing the formula in fp32 inside, where the chain would run fp32 op
by op under amppass's plan, or low op by op under torch.autocast."""

from __future__ import annotations

import pytest
import torch

import amppass

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gpt2():
    config = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ids


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_inference_plans_run_the_written_out_gelu_as_one_low_op(gpt2, dtype):
    model, ids = gpt2
    fast = amppass.convert(model, (ids,), dtype=dtype, plan_for="coverage", example_kwargs={"use_cache": False})
    report = amppass.report(fast)
    gelus = [r for r in report.rows if r.op == "aten.gelu"]
    assert len(gelus) == 2 and all(r.precision == dtype for r in gelus)  # one per layer, low
    assert all("tanh approximation written out as" in r.reason for r in gelus)
    assert not [r for r in report.rows if r.op in ("aten.tanh", "aten.pow")]  # the chain is gone
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        got = fast(ids, use_cache=False).logits
        with torch.autocast("cpu", dtype=torch.bfloat16 if dtype == "bf16" else torch.float16):
            autocast = model(ids, use_cache=False).logits.float()
    # the same kind of error as autocast's on this CPU's kernels, whatever the CPU: no fixed constant
    assert _error(got, want) <= 2 * _error(autocast, want) + 1e-4


def test_the_fused_op_computes_the_chain_in_fp32_exactly_enough():
    from transformers.activations import NewGELUActivation

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.act = torch.nn.Linear(16, 64), NewGELUActivation()

        def forward(self, x):
            return self.act(self.up(x))

    torch.manual_seed(0)
    block, x = Block().eval(), 4 * torch.randn(8, 16)
    fast = amppass.convert(block, (x,), dtype="bf16", plan_for="coverage", keep_fp32=["linear"])
    # the linear kept fp32: the gelu reads its bf16 cast, so the only error is bf16 rounding of input and output
    with torch.no_grad():
        assert _error(fast(x), block(x)) < 2 * 2.0**-8
    assert [n.target for n in fast.graph.nodes if n.op == "call_function"
            and "gelu" in str(n.target)] == [torch.ops.aten.gelu.default]
