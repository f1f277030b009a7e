"""The training benchmarks say what an amppass row trained in, read from the warning of profitability's device
rule (the CPU's flags are injected, so the checks hold on any CPU)."""

import torch
from torch import nn

import amppass
from benchmarks.train_common import threads, watched
from tests.helpers.load import avx2_cpu, native_bf16_cpu

X = (torch.randn(4, 8),)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 2))


def test_the_default_plan_on_an_avx2_cpu_is_named_fp32_with_the_devices_reason(monkeypatch):
    avx2_cpu(monkeypatch)
    with watched() as rule:
        amppass.convert(net(), X, "bf16", mode="train")
    trained = rule.trained("bf16")
    assert trained.startswith("fp32: kept by the device rule (this CPU has none of ") and "bf16" in trained, trained
    assert rule.trained("bf16", "another thread") == "bf16"  # read per thread: interleaved variants


def test_coverage_and_a_native_cpu_are_named_by_their_dtype(monkeypatch):
    avx2_cpu(monkeypatch)
    with watched() as rule:
        converted = amppass.convert(net(), X, "bf16", mode="train", plan_for="coverage")
    assert rule.trained("bf16") == "bf16" and amppass.report(converted).counts().get("bf16", 0) > 0
    native_bf16_cpu(monkeypatch)
    with watched() as rule:
        amppass.convert(net(), X, "bf16", mode="train")
    assert rule.trained("bf16") == "bf16"


def test_a_compiled_variant_is_read_at_its_first_call(monkeypatch):
    """The compile backend applies the rule when dynamo hands it the graph: at the first call."""
    avx2_cpu(monkeypatch)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(net(), backend="amppass", options={"mode": "train", "dtype": "fp16",
                                                                    "compiler": "eager"})
        with watched() as rule:
            compiled(*X).sum().backward()
        assert rule.trained("fp16").startswith("fp32: kept by the device rule")
    finally:
        torch._dynamo.reset()


def test_a_quick_run_trains_on_one_thread_and_gives_the_threads_back():
    before = torch.get_num_threads()
    with threads(True):
        assert torch.get_num_threads() == 1
    with threads(False):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
