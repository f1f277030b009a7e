"""Benchmark section "gpu": amppass on a CUDA device (an H100 or H200), against what users run there.

Eight parts, each catching its own failure so that one broken part still leaves the others' rows (a failed
row says what raised):

1. **Inference** (bf16 and fp16): BERT-base (1x128, 32x128), GPT-2 124M (1x128, 32x128), ViT-B/16 (1 and 64
   images), ResNet-50 (1 and 128 images). Variants: ``fp32`` (TF32 off), ``autocast``, the ``.half()`` /
   ``.bfloat16()`` model (``all_low``), ``amppass`` (``amppass.convert``, default plan); compiled, bf16 and
   BERT only (compiles are slow): ``compile(autocast)`` (inductor) and ``amppass_compiled`` (the amppass
   backend). CUDA-event medians after
   warm-up, error against the fp32 and fp64 models, peak memory above the weights.
2. **Decoding**: a ~100M Llama generating 64 tokens from a 128-token prompt at batch 1 and 16: ``fp32``,
   ``autocast``, ``amppass``, ``amppass_compiled``.
3. **Training step**, fp16: GPT-2 124M (8x128 tokens) and ResNet-50 (32 images): ``fp32``, ``autocast`` +
   GradScaler, amppass train mode + LossScaler; median step time, peak memory, loss of 20 steps.
4. **Numerics and plans**: the plan's error measured on the CPU against the same plan run with CUDA kernels;
   what ``plan_for="speed"`` and ``dtype="auto"`` decide on the GPU, with the timing cache's fingerprint.
5. **Profile**: ViT-B/16 at 64 images in bf16, ``autocast`` against ``amppass``: the ops and kernels with the
   most device time per call, and how many of amppass's attention calls still take a mask (the first GPU runs
   had amppass at 21.2 ms against autocast's 8.7 ms here, with the same matrix products low).
6. to 8. **fp8** (:mod:`benchmarks.gpu_fp8`, on a device of compute capability 8.9 or later): ``torch._scaled_mm``
   e4m3 against bf16 for the zoo's product shapes at 4096 rows (goal 1.5x), BERT-base converted to fp8 against
   bf16, and the fp8 product's numerics on the CPU against the GPU.

Each part has a time budget (:data:`BUDGET_S`, about 6 minutes in all, so the whole section fits one
command on a lent GPU): rows it could not start in time say so. ``--quick`` runs every part with the small zoo and short
loops on whatever device there is (the CPU in CI),
to check the code; only ``--full`` on a GPU gives figures. TFLOP/s is the matrix-product work (2 x MACs of
every linear / matmul / conv / attention, torch's FlopCounterMode) over the median time.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import statistics
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

import amppass
from amppass.analysis.calibration import relative_error
from amppass.errors import first_line
from models import build

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

NOTES = (
    "Columns: `ms` median of the timed calls after warm-up (CUDA events on a GPU, the wall clock on a CPU); "
    "`vs_autocast` = autocast's time / this one's (above 1: faster); `vs_fp32` likewise against fp32 with TF32 "
    "off; `vs_all_low` against the `.half()`/`.bfloat16()` model; `tflops` = 2 x multiply-adds of the matrix "
    "products / time; `err_fp32` / `err_fp64` = ||out - ref|| / ||ref|| against the fp32 and fp64 models; "
    "`peak_MB` = peak allocated memory during the timed calls above what was allocated before them. A row "
    "with `failed` names what raised. fp8 parts: `ms_bf16`, `ms_scaled_mm`, `ms_fp8_linear` = the bf16 product, "
    "torch._scaled_mm alone on e4m3 operands, amppass::fp8_linear (the input quantized on every call, then "
    "_scaled_mm); `*_vs_bf16` = the bf16 time / that one (goal 1.5x for _scaled_mm at 4096 rows); "
    "`max_diff_bf16_steps` = the largest difference of the CPU's and the GPU's fp8 product in bf16 steps."
)


@dataclass(frozen=True)
class Point:
    """One model at one input size."""

    model: str
    batch: int
    seq: int = 128

    @property
    def label(self) -> str:
        return f"{self.model} {self.batch}x{self.seq}" if self.model in ("bert", "gpt2") else \
            f"{self.model} {self.batch}"


def points(quick: bool) -> list[Point]:
    if quick:  # a check of the code: one point (the compiled variants run on BERT's)
        return [Point("bert", 1, 16)]
    # the large batches first: where the time budget runs out, the batch-1 rows are the ones left out
    return [Point("bert", 32), Point("resnet", 128), Point("gpt2", 32), Point("vit", 64), Point("bert", 1),
            Point("gpt2", 1), Point("vit", 1), Point("resnet", 1)]


COMPILED = ("bert",)  # compiles cost 30-60 s each on a GPU: the compiled variants run on BERT's points alone
BUDGET_S = {"inference": 190.0, "decoding": 70.0, "training": 70.0, "numerics": 40.0,
            "profile": 20.0, "fp8_products": 30.0, "fp8_model": 45.0, "fp8_numerics": 10.0}  # about 8 minutes


class Budget:
    """Seconds a part may still start new work in; rows not started in time say so instead of running."""

    def __init__(self, seconds: float):
        self.until = time.perf_counter() + seconds

    def spent(self) -> bool:
        return time.perf_counter() > self.until


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def describe(where: torch.device) -> str:
    """The device in words, with what the timing cache's fingerprint records for it."""
    from amppass.targets.device import fingerprint

    found = fingerprint(where)
    if where.type != "cuda":
        return f"CPU {found.get('cpu')} (no CUDA device: quick check of the code only, not GPU figures)"
    return (f"{found['name']} (compute capability {found['capability']}, {found['sm_count']} SMs), CUDA "
            f"{found['cuda']}, driver {found['driver']}, cuBLASLt {found['cublas']}, cuDNN {found['cudnn']}, "
            f"torch {found['torch']}")


def timed(call: Callable[[], Any], where: torch.device, warmup: int, repeats: int) -> tuple[float, float]:
    """(median ms of ``repeats`` calls after ``warmup``, peak MB allocated during them above the start)."""
    for _ in range(warmup):
        call()
    samples = []
    if where.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        return statistics.median(samples), (torch.cuda.max_memory_allocated() - base) / 2**20
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        samples.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(samples), float("nan")


@contextlib.contextmanager
def no_tf32():
    """fp32 means fp32: TF32 matrix products off while inside."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        # cudnn's flags through its context manager: a process that froze them (torch's test utilities do) refuses
        # a plain assignment
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def _first_float(out: Any) -> torch.Tensor:
    if hasattr(out, "last_hidden_state"):
        return out.last_hidden_state
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return _first_float(out[0])
    return out


def _failed(base: dict[str, Any], err: BaseException) -> dict[str, Any]:
    traceback.print_exc()
    return {**base, "failed": f"{type(err).__name__}: {first_line(err)}"[:200]}


def _matmul_flops(model: torch.nn.Module, inputs: tuple) -> float:
    """Floating-point operations of the matrix products, convolutions and attention of one call (torch's
    FlopCounterMode: 2 x multiply-adds); 0 where it cannot count."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(*inputs)
        return float(counter.get_total_flops())
    except Exception:  # noqa: BLE001 - a column, never a reason to lose the row
        return 0.0


SKIPPED = "skipped: the part's time budget was spent (python -m benchmarks run --full --only gpu, alone, for it)"


def inference(quick: bool) -> list[dict[str, Any]]:
    """Part 1: every point, every dtype and variant (compiled ones in bf16, on BERT)."""
    where, rows, budget = device(), [], Budget(BUDGET_S["inference"])
    warmup, repeats = (1, 3) if quick else (5, 20)
    for point in points(quick):
        base = {"model": point.label}
        if budget.spent():
            rows.append({**base, "failed": SKIPPED})
            continue
        try:
            case = build(point.model, "small" if quick else "base", batch=point.batch, seq=point.seq)
            fp32 = copy.deepcopy(case.model).to(where).eval()
            inputs = tuple(t.to(where) for t in case.make_inputs(1))
            with torch.no_grad(), no_tf32():
                reference = _first_float(fp32(*inputs)).float()
                exact = _first_float(copy.deepcopy(fp32).double()(*(
                    t.double() if t.is_floating_point() else t for t in inputs))).double()
                fp32_ms, fp32_mb = timed(functools.partial(fp32, *inputs), where, warmup, repeats)
        except Exception as err:  # noqa: BLE001
            rows.append(_failed(base, err))
            continue
        flops = _matmul_flops(fp32, inputs)
        rows.append({**base, "variant": "fp32", "dtype": "fp32", "ms": fp32_ms, "vs_fp32": 1.0,
                     "tflops": flops / fp32_ms / 1e9 if flops else None,
                     "err_fp32": 0.0, "err_fp64": relative_error(reference, exact), "peak_MB": fp32_mb})
        # the quick run on a CPU checks the code in bf16 alone: fp16 takes the same path with the other dtype
        dtypes = {"bf16": DTYPES["bf16"]} if quick and where.type == "cpu" else DTYPES
        for name, dtype in dtypes.items():
            rows += _variants(point, base, fp32, inputs, name, dtype, reference, exact, flops, fp32_ms, quick,
                              warmup, repeats)
        del fp32
        if where.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _variants(point: Point, base: dict, fp32: torch.nn.Module, inputs: tuple, name: str, dtype: torch.dtype,
              reference: torch.Tensor, exact: torch.Tensor, flops: float, fp32_ms: float, quick: bool,
              warmup: int, repeats: int) -> list[dict[str, Any]]:
    where = inputs[0].device

    def autocast(model: Callable) -> Callable[[], Any]:
        def call() -> Any:
            with torch.autocast(where.type, dtype=dtype):
                return model(*inputs)
        return call

    def all_low() -> Callable[[], Any]:
        low = copy.deepcopy(fp32).to(dtype)
        cast = tuple(t.to(dtype) if t.is_floating_point() else t for t in inputs)
        return lambda: low(*cast)

    def converted() -> Callable[[], Any]:
        fast = amppass.convert(fp32, inputs, dtype)
        plans["amppass"] = plan_note(fast)
        return lambda: fast(*inputs)

    def compiled_autocast() -> Callable[[], Any]:
        return autocast(torch.compile(copy.deepcopy(fp32)))

    def compiled_amppass() -> Callable[[], Any]:
        model = torch.compile(copy.deepcopy(fp32), backend="amppass", options={"dtype": name})
        return lambda: model(*inputs)

    makers: dict[str, Callable[[], Callable[[], Any]]] = {
        "autocast": lambda: autocast(fp32), "all_low": all_low, "amppass": converted}
    compiles = name == "bf16" and point.model in COMPILED
    # the quick run on a CPU leaves the two compiles out (17 CPU s here): the compile section runs the backend
    left_out = compiles and quick and where.type == "cpu"
    if compiles and not left_out:
        makers.update({"compile(autocast)": compiled_autocast, "amppass_compiled": compiled_amppass})
    rows, times, plans = [], {}, {}
    for variant, make in makers.items():
        row = {**base, "variant": variant, "dtype": name}
        try:
            with torch.no_grad(), no_tf32():
                started = time.perf_counter()
                call = make()
                out = _first_float(call()).float()
                setup_s = time.perf_counter() - started
                ms, mb = timed(call, where, warmup, repeats)
        except Exception as err:  # noqa: BLE001
            rows.append(_failed(row, err))
            continue
        times[variant] = ms
        rows.append({**row, "ms": ms, "vs_fp32": fp32_ms / ms, "tflops": flops / ms / 1e9 if flops else None,
                     "err_fp32": relative_error(out, reference), "err_fp64": relative_error(out.double(), exact),
                     "peak_MB": mb, "setup_s": setup_s, **({"plan": plans[variant]} if variant in plans else {})})
    for row in rows:
        if "ms" in row:
            if "autocast" in times:
                row["vs_autocast"] = times["autocast"] / row["ms"]
            if "all_low" in times:
                row["vs_all_low"] = times["all_low"] / row["ms"]
    if left_out:
        rows += [{**base, "variant": variant, "dtype": name, "failed": "left out of --quick on a CPU (the compile "
                  "section runs the amppass backend)"} for variant in ("compile(autocast)", "amppass_compiled")]
    return rows


def plan_note(fast: torch.nn.Module) -> str:
    """What the speed plan kept in fp32 and why, in a few words: the whole model (timed slower converted), or the
    ops profitability timed slower low, with their counts."""
    from amppass.serving.fp32_original import Fp32Original, kept_because

    report = amppass.report(fast)
    if isinstance(fast, Fp32Original):
        return f"kept fp32: {kept_because(report.info)}"
    timed = collections.Counter(
        r.op.removeprefix("aten.") for r in report.rows if r.source == "profitability" and r.precision == "fp32"
    )
    if not timed:
        return "no op fp32 by timing"
    return "; ".join(f"{op} x{n}" for op, n in timed.most_common(4)) + " fp32 by timing"


def decoding(quick: bool) -> list[dict[str, Any]]:
    """Part 2: a ~100M Llama generating from a prompt, ms per decoded token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    where = device()
    layers, hidden, inter, vocab, prompt_len, new, batches = (
        (2, 64, 128, 1000, 8, 8, (1,)) if quick else (12, 768, 2048, 32000, 128, 64, (1, 16)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
            max_position_embeddings=512, attn_implementation="sdpa")).to(where).eval()
    rows, budget = [], Budget(BUDGET_S["decoding"])
    label = f"llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M"
    # every batch's eager variants first, then the compiled ones (a compile takes most of the budget): a budget
    # spent on compiling batch 1 skips batch 16's compile, not its eager rows
    jobs = [(batch, variant) for batch in batches for variant in ("fp32", "autocast", "amppass")]
    jobs += [(batch, "amppass_compiled") for batch in batches]
    prompts = {batch: torch.randint(1, vocab - 1, (batch, prompt_len),
                                    generator=torch.Generator().manual_seed(batch)).to(where) for batch in batches}
    references: dict[int, torch.Tensor] = {}
    times: dict[tuple[int, str], float] = {}
    for batch, variant in jobs:
        row = {"model": label, "batch": batch, "variant": variant}
        if budget.spent():
            rows.append({**row, "failed": SKIPPED})
            continue
        if quick and where.type == "cpu" and variant == "amppass_compiled":
            rows.append({**row, "failed": "left out of --quick on a CPU: it compiles again for every new length "
                                          "(minutes here) and checks no code the compiled inference rows do not"})
            continue
        try:
            with torch.no_grad(), no_tf32():
                call = _generation(model, prompts[batch], variant, new, vocab)
                tokens = call()
                ms, mb = timed(call, where, 1, 2 if quick else 3)
        except Exception as err:  # noqa: BLE001
            rows.append(_failed(row, err))
            continue
        reference = references.setdefault(batch, tokens)
        times[batch, variant] = ms
        same = float((tokens[:, prompt_len:] == reference[:, prompt_len:]).float().mean())
        rows.append({**row, "ms_per_token": ms / new, "tokens_as_fp32": same, "peak_MB": mb})
    for row in rows:
        if "ms_per_token" in row and (row["batch"], "autocast") in times:
            row["vs_autocast"] = times[row["batch"], "autocast"] / (row["ms_per_token"] * new)
    return sorted(rows, key=lambda r: r["batch"])  # stable: each batch's rows in the order above


def _generation(model: torch.nn.Module, ids: torch.Tensor, variant: str, new: int, vocab: int) -> Callable[[], Any]:
    """A call generating ``new`` tokens greedily from ``ids`` with ``variant`` of ``model``."""
    target, dtype = model, None
    if variant == "autocast":
        dtype = torch.bfloat16
    elif variant == "amppass":
        target = amppass.convert(model, (ids,), "bf16")
    elif variant == "amppass_compiled":
        target = copy.deepcopy(model)
        target.forward = torch.compile(target.forward, backend="amppass", options={"dtype": "bf16"})

    def call() -> Any:
        context = torch.autocast(ids.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with context:
            return target.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                   pad_token_id=vocab - 1)
    return call


def training(quick: bool) -> list[dict[str, Any]]:
    """Part 3: fp16 training steps, fp32 / autocast + GradScaler / amppass train mode + LossScaler."""
    where, rows, budget = device(), [], Budget(BUDGET_S["training"])
    steps = 4 if quick else 20
    for name in ("gpt2", "resnet"):
        if budget.spent():
            rows.append({"model": name, "failed": SKIPPED})
            continue
        try:
            model, batch, loss_of = _trainable(name, quick, where)
        except Exception as err:  # noqa: BLE001
            rows.append(_failed({"model": name}, err))
            continue
        for variant in ("fp32", "autocast+GradScaler", "amppass+LossScaler"):
            row = {"model": name, "variant": variant}
            try:
                row.update(_train_steps(model, batch, loss_of, variant, steps, where))
            except Exception as err:  # noqa: BLE001
                row = _failed(row, err)
            rows.append(row)
    return rows


def _trainable(name: str, quick: bool, where: torch.device):
    """(model in train mode, one batch, loss of the model's output) for a training benchmark."""
    generator = torch.Generator().manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000) if quick else GPT2Config()
        config.use_cache, config._attn_implementation = False, "sdpa"
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = GPT2LMHeadModel(config)
        ids = torch.randint(0, config.vocab_size, (2 if quick else 8, 32 if quick else 128), generator=generator)
        batch = (ids.to(where),)

        def loss_of(out: Any) -> torch.Tensor:
            logits = _first_float(out)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[0][:, 1:].flatten())
    else:
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1]) if quick else ResNetConfig()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = ResNetForImageClassification(config)
        hw = 32 if quick else 224
        images = torch.randn(4 if quick else 32, 3, hw, hw, generator=generator)
        labels = torch.randint(0, config.num_labels, (images.shape[0],), generator=generator)
        batch, targets = (images.to(where),), labels.to(where)

        def loss_of(out: Any) -> torch.Tensor:
            return F.cross_entropy(_first_float(out).float(), targets)
    return model.to(where).train(), batch, loss_of


def _train_steps(original: torch.nn.Module, batch: tuple, loss_of: Callable, variant: str, steps: int,
                 where: torch.device) -> dict[str, Any]:
    model = copy.deepcopy(original)
    if variant.startswith("amppass"):
        model = amppass.convert(model, batch, torch.float16, mode="train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = amppass.LossScaler() if variant.startswith("amppass") else \
        torch.amp.GradScaler(where.type) if variant.startswith("autocast") else None
    losses = []

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        context = torch.autocast(where.type, dtype=torch.float16) if variant.startswith("autocast") \
            else contextlib.nullcontext()
        with context:
            loss = loss_of(model(*batch))
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        losses.append(float(loss.detach()))

    with no_tf32():
        ms, mb = timed(step, where, 2, steps)
    return {"step_ms": ms, "peak_MB": mb, "loss_first": losses[2] if len(losses) > 2 else losses[0],
            "loss_last": losses[-1]}


def numerics(quick: bool) -> list[dict[str, Any]]:
    """Part 4: the CPU's judgement of a plan against the GPU's truth, and what the GPU's own plans decide."""
    where, rows, budget = device(), [], Budget(BUDGET_S["numerics"])
    for name in ("bert", "vit") if not quick else ("bert",):
        row: dict[str, Any] = {"model": name}
        if budget.spent():
            rows.append({**row, "failed": SKIPPED})
            continue
        try:
            case = build(name, "small" if quick else "base", batch=2, seq=128 if not quick else 16)
            inputs = case.make_inputs(1)
            with no_tf32():
                on_cpu = amppass.convert(case.model, case.example_inputs, "fp16", plan_for="coverage")
                with torch.no_grad():
                    row["plan_err_cpu"] = relative_error(_first_float(on_cpu(*inputs)).float(),
                                                         _first_float(case.model(*inputs)).float())
                    gpu_model = copy.deepcopy(case.model).to(where)
                    moved = on_cpu.to(where)  # a converted model does not deepcopy (its graph runs generated code)
                    gpu_inputs = tuple(t.to(where) for t in inputs)
                    row["plan_err_device"] = relative_error(_first_float(moved(*gpu_inputs)).float(),
                                                            _first_float(gpu_model(*gpu_inputs)).float())
                for plan_for in ("speed",):
                    fast = amppass.convert(gpu_model, tuple(t.to(where) for t in case.example_inputs), "auto",
                                           plan_for=plan_for)
                    info = amppass.report(fast).info
                    profit = info.get("profitability") or {}
                    low = sum(r.precision != "fp32" for r in amppass.report(fast).rows)
                    row.update({"auto_dtype": info.get("dtype"), "speed_nodes_low": low,
                                "speed_nodes_fp32_by_timing": profit.get("nodes_fp32"),
                                "timing": str(profit.get("timing"))})
        except Exception as err:  # noqa: BLE001
            row = _failed(row, err)
        rows.append(row)
    return rows


def profile(quick: bool) -> list[dict[str, Any]]:
    """Part 5: where ViT's time goes at its large batch, autocast against amppass in bf16: the kernels that take
    the most device time per call (the CPU's own time on a CPU), and how many attention calls keep a mask."""
    where, rows, budget = device(), [], Budget(BUDGET_S["profile"])
    point = Point("vit", 2 if quick else 64)
    variants = ("autocast", "amppass")
    if budget.spent():
        return [{"model": point.label, "variant": v, "failed": SKIPPED} for v in variants]
    try:
        case = build("vit", "small" if quick else "base", batch=point.batch)
        fp32 = copy.deepcopy(case.model).to(where).eval()
        inputs = tuple(t.to(where) for t in case.make_inputs(1))
        with no_tf32():
            fast = amppass.convert(fp32, inputs, torch.bfloat16)
    except Exception as err:  # noqa: BLE001
        return [_failed({"model": point.label, "variant": v}, err) for v in variants]

    def autocast() -> Any:
        with torch.autocast(where.type, dtype=torch.bfloat16):
            return fp32(*inputs)

    for variant, call in zip(variants, (autocast, lambda: fast(*inputs)), strict=False):
        base = {"model": point.label, "variant": variant}
        if budget.spent():
            rows.append({**base, "failed": SKIPPED})
            continue
        try:
            rows += _top_kernels(call, where, base, calls=2 if quick else 5)
        except Exception as err:  # noqa: BLE001
            rows.append(_failed(base, err))
    masked = sum("scaled_dot_product_attention" in r.op and "True everywhere" not in r.reason
                 for r in amppass.report(fast).rows)
    rows.append({"model": point.label, "variant": "amppass", "kernel": "attention calls given a mask",
                 "calls": masked})
    return rows


def _top_kernels(call: Callable[[], Any], where: torch.device, base: dict, calls: int,
                 shown: int = 8) -> list[dict[str, Any]]:
    """The ``shown`` ops or kernels with the most self time per call (device time on a GPU)."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if where.type == "cuda" else [])
    with torch.no_grad(), no_tf32():
        for _ in range(3):
            call()
        _sync(where)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(calls):
                call()
            _sync(where)
    key = "self_device_time_total" if where.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events)
    rows = [{**base, "kernel": "(all)", "ms": total / calls / 1e3}]
    rows += [{**base, "kernel": e.key[:70], "ms": getattr(e, key) / calls / 1e3, "calls": e.count / calls}
             for e in events[:shown] if getattr(e, key) > 0]
    return rows


def _sync(where: torch.device) -> None:
    if where.type == "cuda":
        torch.cuda.synchronize(where)


PARTS: dict[str, Callable[[bool], list[dict[str, Any]]]] = {
    "Inference, bf16 and fp16 (compiled variants in bf16)": inference,
    "Decoding with generate(), bf16": decoding,
    "Training step, fp16": training,
    "Numerics: the CPU's plan error against the device's, and the device's own plans": numerics,
    "Where ViT's time goes, bf16: the ops with the most self time per call": profile,
    "fp8 products: torch._scaled_mm (e4m3) and amppass::fp8_linear against bf16, the zoo's shapes": lambda quick:
        _fp8().products(quick),
    "fp8 whole model: BERT-base converted to fp8 against bf16 (plan_for='coverage')": lambda quick:
        _fp8().whole_model(quick),
    "fp8 numerics: the same fp8 product on the CPU and on the GPU": lambda quick: _fp8().numerics(quick),
}


def _fp8():
    """:mod:`benchmarks.gpu_fp8`, which reads this module's helpers (imported when its parts run)."""
    from . import gpu_fp8

    return gpu_fp8


def run(quick: bool) -> tuple[str, list[tuple[str, list[dict[str, Any]]]]]:
    """(the device in words, [(part title, rows)]); a part that fails whole is one row naming the error."""
    where = device()
    try:
        described = describe(where)
    except Exception as err:  # noqa: BLE001
        described = f"{where} ({type(err).__name__}: {err})"
    tables = []
    for title, part in PARTS.items():
        started = time.perf_counter()
        try:
            rows = part(quick)
        except Exception as err:  # noqa: BLE001 - one broken part must not lose the others' tables
            rows = [_failed({"part": title}, err)]
        tables.append((f"{title} ({time.perf_counter() - started:.0f} s)", rows))
    return described, tables
