"""Benchmark section "generate": per-token decode latency of a Llama decoder under ``generate()``.

A ~100M-parameter Llama config with random weights (hidden 768, 12 layers, vocabulary 16k with tied
embeddings: 97M parameters), a 32-token prompt, 64 new tokens, greedy, at batch 1 and 8. Variants, each a
model of the same weights:

- ``fp32``: the model as built.
- ``autocast``: ``generate`` under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
- ``compile(autocast)``: the same, with ``model.forward = torch.compile(model.forward)`` (inductor).
- ``amppass``: ``amppass.convert(model, (prompt,), "bf16")`` (the default plan), whose ``generate`` runs the
  converted graphs (:mod:`amppass.serving.generation`).
- ``amppass compiled``: ``model.forward = torch.compile(model.forward, backend="amppass", options={"dtype":
  "bf16", "plan_for": "coverage"})`` (inductor, freezing).

A stopping criterion stamps the clock after every step, so one ``generate`` call gives the prefill time (the
first step) and each decode step's. The variants are timed interleaved (:func:`benchmarks.latency.
time_interleaved`: one call of each per round, the order rotated), so load from other processes hits them
alike; the first round warms every variant up (compiles included). Quick mode: a 2-layer config, prompt 8,
8 new tokens, batch 1, ``amppass compiled`` with the amppass backend's ``compiler="eager"`` (dynamo without inductor)
and no ``compile(autocast)`` (dynamo's trace of the decoder alone takes ~6 CPU s here), to check that it runs.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

import amppass

from .latency import time_interleaved

NOTES = (
    "Columns: `decode_ms_per_token` = median over the timed rounds of the median decode step (every step "
    "after the prefill) of one `generate` call; `prefill_ms` the same for the first step; `generate_ms` the "
    "median whole call; `vs_autocast` / `vs_compile_autocast` = that variant's decode step time / this one's "
    "(above 1: this one decodes faster); `tokens_as_fp32` = share of the generated tokens equal to fp32's "
    "greedy tokens (random weights: near-tied logits can part the sequences, autocast's as amppass's); "
    "`setup_s` = the conversion (amppass) plus the first `generate` call (dynamo and inductor compiles). "
    "All under `torch.inference_mode()`."
)


@dataclass(frozen=True)
class Setting:
    """The decoder and the generation lengths of one mode."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    prompt: int
    new_tokens: int
    batches: tuple[int, ...]
    compiler: str = "inductor"  # of the compiled variants
    compiled_baseline: bool = True  # whether compile(autocast) runs


def setting(quick: bool) -> Setting:
    if quick:
        return Setting(layers=2, hidden=64, intermediate=128, heads=4, vocab=1000, prompt=8, new_tokens=8,
                       batches=(1,), compiler="eager", compiled_baseline=False)
    return Setting(layers=12, hidden=768, intermediate=2048, heads=12, vocab=16000, prompt=32, new_tokens=64,
                   batches=(1, 8))


def decoder(point: Setting) -> torch.nn.Module:
    """The Llama of ``point`` with seeded random weights, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=point.vocab, hidden_size=point.hidden, intermediate_size=point.intermediate,
                         num_hidden_layers=point.layers, num_attention_heads=point.heads,
                         num_key_value_heads=point.heads, max_position_embeddings=1024, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


class _Clock:
    """A stopping criterion that never stops: it stamps the time after every generated token."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@dataclass
class _Run:
    """One variant: how it generates, and what its timed calls measured."""

    generate: Callable[..., torch.Tensor]
    setup_s: float = 0.0
    prefill: list[float] | None = None
    decode: list[float] | None = None
    tokens: torch.Tensor | None = None


def _variants(model: torch.nn.Module, prompt: torch.Tensor, point: Setting) -> dict[str, _Run]:
    def autocast(target: torch.nn.Module) -> Callable[..., torch.Tensor]:
        def run(*args: Any, **kwargs: Any) -> torch.Tensor:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return target.generate(*args, **kwargs)
        return run

    found = {"fp32": _Run(model.generate), "autocast": _Run(autocast(model))}
    if point.compiled_baseline:
        compiled_autocast = copy.deepcopy(model)
        compiled_autocast.forward = torch.compile(compiled_autocast.forward, backend=point.compiler)
        found["compile(autocast)"] = _Run(autocast(compiled_autocast))
    started = time.perf_counter()
    converted = amppass.convert(model, (prompt,), "bf16")
    found["amppass"] = _Run(converted.generate, setup_s=time.perf_counter() - started)
    compiled = copy.deepcopy(model)
    compiled.forward = torch.compile(compiled.forward, backend="amppass",
                                     options={"dtype": "bf16", "compiler": point.compiler, "plan_for": "coverage"})
    found["amppass compiled"] = _Run(compiled.generate)
    return found


def measure(point: Setting, batch: int, warmup: int, repeats: int) -> list[dict[str, Any]]:
    """One row per variant at ``batch``: decode and prefill step times, ratios, tokens against fp32's."""
    model = decoder(point)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, point.vocab, (batch, point.prompt), generator=generator)
    options = dict(max_new_tokens=point.new_tokens, min_new_tokens=point.new_tokens, do_sample=False,
                   pad_token_id=0)
    with torch.inference_mode():
        runs = _variants(model, prompt, point)
        calls = {}
        for name, run in runs.items():
            calls[name] = _timed_call(run, prompt, options)
        for name, run in runs.items():  # setup: compiles happen in the first call
            started = time.perf_counter()
            calls[name]()
            run.setup_s += time.perf_counter() - started
        for _ in range(warmup):
            for call in calls.values():
                call()
        for run in runs.values():
            run.prefill, run.decode = [], []
        samples = time_interleaved(calls, warmup=0, repeats=repeats)
    decode = {name: statistics.median(run.decode) for name, run in runs.items()}
    reference = runs["fp32"].tokens
    parameters = sum(p.numel() for p in model.parameters())
    rows = []
    for name, run in runs.items():
        rows.append({
            "model": f"llama {parameters / 1e6:.3g}M", "batch": batch, "variant": name,
            "decode_ms_per_token": decode[name] * 1e3,
            "prefill_ms": statistics.median(run.prefill) * 1e3,
            "generate_ms": statistics.median(samples[name]) * 1e3,
            "vs_autocast": decode["autocast"] / decode[name],
            "vs_compile_autocast": decode["compile(autocast)"] / decode[name] if point.compiled_baseline else None,
            "tokens_as_fp32": float((run.tokens == reference).float().mean()),
            "setup_s": run.setup_s,
        })
    return rows


def _timed_call(run: _Run, prompt: torch.Tensor, options: dict[str, Any]) -> Callable[[], None]:
    """A call that generates and records its prefill and median decode step into ``run``."""
    from transformers import StoppingCriteriaList

    def call() -> None:
        clock = _Clock()
        started = time.perf_counter()
        out = run.generate(prompt, stopping_criteria=StoppingCriteriaList([clock]), **options)
        steps = [b - a for a, b in zip([started] + clock.stamps, clock.stamps, strict=False)]
        if run.prefill is not None:
            run.prefill.append(steps[0])
            run.decode.append(statistics.median(steps[1:]))
        run.tokens = out[:, prompt.shape[1]:]

    return call


def run(quick: bool) -> list[dict[str, Any]]:
    """Every batch of the mode, one row per (batch, variant); dynamo's caches are reset around each batch."""
    point = setting(quick)
    warmup, repeats = (0, 2) if quick else (1, 5)  # rounds; every round is one generate call per variant
    rows: list[dict[str, Any]] = []
    # both compiled variants compile the same forward code (its own graphs for each model instance, under
    # autocast or not): room for all of them, so that neither falls back to running uncompiled
    with torch._dynamo.config.patch(recompile_limit=64, accumulated_recompile_limit=512):
        for batch in point.batches:
            torch._dynamo.reset()
            rows += measure(point, batch, warmup, repeats)
        torch._dynamo.reset()
    return rows


def title(quick: bool) -> str:
    point = setting(quick)
    return (f"Llama ({point.layers} layers, hidden {point.hidden}, vocabulary {point.vocab}), prompt {point.prompt}, "
            f"{point.new_tokens} new tokens, greedy, batch {' and '.join(map(str, point.batches))}, compiled by "
            f"{point.compiler}{'' if point.compiled_baseline else ', no compile(autocast) (--quick)'}")
