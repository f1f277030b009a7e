"""amppass on a CUDA device: convert, the compile backend, generate(), train mode with LossScaler,
dtype="auto" and profitability, each against fp32 (TF32 off) on the same GPU.

Every test needs CUDA and skips cleanly without it; ``pytest -m cuda`` runs them on a GPU machine
(``scripts/gpu_check`` does, beside the ``gpu`` benchmark section).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amppass
from amppass.analysis.calibration import relative_error
from amppass.serving.fp32_original import Fp32Original
from amppass.targets import device as device_facts
from models import build
from tests.helpers.decoders import agreeing_steps, decoder, greedy, prompt

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU)")]


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 references without TF32, so the comparison measures amppass's precision, not the GPU's default."""
    if not torch.cuda.is_available():
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _on_cuda(name: str, batch: int = 2, seq: int = 16):
    case = build(name, batch=batch, seq=seq)
    model = copy.deepcopy(case.model).cuda()
    return case, model, tuple(t.cuda() for t in case.example_inputs)


def _error(fast, model, inputs) -> float:
    with torch.no_grad():
        out, ref = fast(*inputs), model(*inputs)
    out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    ref = ref.last_hidden_state if hasattr(ref, "last_hidden_state") else ref
    return relative_error(out, ref)


def _matrix_rows(report) -> list:
    """The report's rows of matrix products (linear, addmm, convolutions): op names are "aten.<op>"."""
    return [r for r in report.rows if r.op.removeprefix("aten.").startswith(("linear", "conv", "addmm"))]


@pytest.mark.parametrize("name", ["bert", "vit", "resnet"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_convert_on_cuda_runs_low_and_stays_close_to_fp32(name, dtype):
    case, model, inputs = _on_cuda(name)
    fast = amppass.convert(model, inputs, dtype, plan_for="coverage")
    report = amppass.report(fast)
    assert report.info["target"]["name"] == "cuda"
    assert any(r.precision in ("bf16", "fp16") for r in _matrix_rows(report))
    assert next(fast.parameters()).device.type == "cuda"
    assert _error(fast, model, inputs) < (3e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_a_model_converted_on_the_cpu_follows_fp32_after_to_cuda(mode):
    case = build("bert", batch=2, seq=16)
    model = copy.deepcopy(case.model).train(mode == "train")
    fast = amppass.convert(model, case.example_inputs, "bf16", mode=mode, plan_for="coverage").to("cuda")
    reference = copy.deepcopy(case.model).cuda().eval()
    fast.eval()
    assert _error(fast, reference, tuple(t.cuda() for t in case.example_inputs)) < 3e-2


def test_a_later_plan_of_a_model_moved_to_cuda_is_captured_on_the_cpu_and_runs_on_cuda():
    from tests.helpers.small_models import Positions

    class Branching(Positions):
        def forward(self, x):
            y = super().forward(x)
            return y * 2 if x.shape[1] > 10 else y  # a longer input takes another plan

    torch.manual_seed(0)
    model = Branching().eval()
    fast = amppass.convert(model, (torch.randn(2, 8, 16),), "bf16", plan_for="coverage").to("cuda")
    x = torch.randn(2, 12, 16)
    out = fast(x.cuda())
    assert out.device.type == "cuda" and len(fast.converted.plans) == 2
    assert relative_error(out.cpu(), model(x)) < 3e-2
    assert next(model.parameters()).device.type == "cpu"  # the original stays where it was


@pytest.mark.parametrize("seq", [16, 24])
def test_the_compile_backend_on_cuda_serves_two_shapes(seq):
    case, model, _ = _on_cuda("bert", seq=seq)
    compiled = torch.compile(copy.deepcopy(model), backend="amppass", options={"dtype": "bf16"})
    inputs = tuple(t.cuda() for t in case.make_inputs(3))
    assert _error(compiled, model, inputs) < 3e-2
    assert amppass.report(compiled).info["dtype"] == "bf16"


def test_a_converted_decoder_generates_fp32s_tokens_on_cuda():
    model = decoder("llama").cuda()
    fast = amppass.convert(model, (prompt().cuda(),), "bf16", plan_for="coverage")
    ids = prompt(seed=4).cuda()
    assert agreeing_steps(greedy(model, ids, 12), greedy(fast, ids, 12)) >= 8


def test_train_mode_with_the_loss_scaler_follows_fp32_on_cuda():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten(),
                        nn.Linear(16 * 16 * 16, 10)).cuda().train()
    reference = copy.deepcopy(net)
    x, y = torch.randn(8, 3, 16, 16, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    fast = amppass.convert(net, (x,), torch.float16, mode="train")
    scaler = amppass.LossScaler()
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fast, reference)]
    losses = []
    for _ in range(5):
        for model, optimizer in zip((fast, reference), optimizers, strict=False):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if model is fast:
                scaler.scale(loss).backward()
                assert all(p.grad.dtype == torch.float32 for p in fast.parameters() if p.grad is not None)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
            losses.append(float(loss))
    low, fp32 = losses[0::2], losses[1::2]
    assert low[-1] < low[0]
    assert max(abs(a - b) / b for a, b in zip(low, fp32, strict=False)) < 2e-2


def test_dtype_auto_on_cuda_picks_a_native_low_dtype_and_says_why():
    _, model, inputs = _on_cuda("bert")
    fast = amppass.convert(model, inputs, "auto", plan_for="coverage")
    assert amppass.report(fast).info["dtype"] in ("fp16", "bf16")


def test_profitability_on_cuda_times_kernels_on_the_gpu_and_keeps_big_matmuls_low():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.GELU(), nn.Linear(4096, 2048)).cuda().eval()
    x = torch.randn(256, 2048, device="cuda")
    fast = amppass.convert(model, (x,), "bf16", plan_for="speed")
    info = amppass.report(fast).info
    # the whole-model comparison times the kernels (a synchronized clock), not their launches
    assert not isinstance(fast, Fp32Original), info.get("whole_model")
    found = device_facts.fingerprint(torch.device("cuda"))
    assert found["sm_count"] > 0 and found["cuda"] and found["name"]
    rows = _matrix_rows(amppass.report(fast))
    assert rows and all(r.precision == "bf16" for r in rows), info.get("profitability")
    assert _error(fast, model, (x,)) < 3e-2



def test_a_converted_vit_runs_on_the_flash_kernel_alone():
    """torch.export writes ViT's unpadded attention mask out; flash attention takes no mask, so a converted graph
    that kept it would find no kernel with flash the only backend allowed (amppass.fx.prepare.masks drops it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    case, model, inputs = _on_cuda("vit", batch=4)
    fast = amppass.convert(model.eval(), inputs, torch.bfloat16, plan_for="coverage")
    with torch.no_grad():
        want = model(*inputs).last_hidden_state  # fp32: flash attention takes no fp32, so outside the context
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            got = fast(*inputs).last_hidden_state
    assert relative_error(got, want) < 0.05
