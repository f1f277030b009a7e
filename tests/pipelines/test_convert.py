"""amppass.convert on the model zoo and on hand-built modules: numerics, structure, validity, safety."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import amppass
from amppass.analysis.record import META_KEY
from amppass.serving.fp32_parameters import stored_parameters
from models import ZOO, build

DTYPES = [torch.float16, torch.bfloat16]


def first(output):
    return output if isinstance(output, torch.Tensor) else output[0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


@pytest.fixture(scope="module", params=ZOO)
def case(request):
    return build(request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_zoo_matches_fp32_as_well_as_autocast(case, dtype):
    before = copy.deepcopy(case.model.state_dict())
    fast = amppass.convert(case.model, case.example_inputs, dtype, plan_for="coverage")
    fast.graph.lint()
    inputs = case.make_inputs(3)
    with torch.no_grad():
        ref = first(case.model(*inputs))
        out = first(fast(*inputs))
        with torch.autocast("cpu", dtype=dtype):
            auto = first(case.model(*inputs))
    assert out.dtype == torch.float32, "keep_io_types: outputs come back fp32"
    assert torch.isfinite(out).all()
    ours, theirs = rel_err(out, ref), rel_err(auto, ref)
    assert ours <= theirs * 1.05 + 1e-6, f"amppass {ours:.3e} vs autocast {theirs:.3e}"
    # the caller's model is untouched: same tensors, same values, same dtypes
    after = case.model.state_dict()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)


@pytest.mark.parametrize("name", ["bert", "cnn", "llama"])
def test_heavy_ops_low_layer_norm_fp32_and_one_cast_per_value(name):
    case = build(name)
    fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")
    seen_casts = set()
    for node in fast.graph.nodes:
        meta = node.meta.get(META_KEY, {})
        op = node.target
        if op in (torch.ops.aten.linear.default, torch.ops.aten.conv2d.default, torch.ops.aten.convolution.default):
            assert meta["precision"] == "low", node.name
        if op is torch.ops.aten.layer_norm.default:
            assert meta["precision"] == "fp32", node.name
        if op is torch.ops.aten.batch_norm.default:  # eval batch norm: low input, its statistics read in fp32
            assert meta["precision"] == "low" and not meta["casts_in"], node.name
            assert all(fast.get_parameter(a.target).dtype == torch.float32 if "running" not in a.target else
                       fast.get_buffer(a.target).dtype == torch.float32 for a in node.args[1:5]), node.name
        if op is torch.ops.aten._to_copy.default and meta.get("cast"):
            key = (node.args[0], node.kwargs["dtype"])
            assert key not in seen_casts, f"two casts of {key}"
            seen_casts.add(key)
            # inference pre-casts weights: no cast of a weight remains in the graph
            assert node.args[0].op != "get_attr", f"{node.name} casts a weight on every call"
        if meta.get("cast"):
            assert node.args[0].meta.get(META_KEY, {}).get("cast") is None or node.kwargs["dtype"] != torch.float32


def test_weight_bytes_about_half():
    cnn = build("cnn")
    report = amppass.report(amppass.convert(cnn.model, cnn.example_inputs, torch.bfloat16, plan_for="coverage"))
    assert report.info["weight_bytes_after"] <= 0.55 * report.info["weight_bytes_before"]
    bert = build("bert")
    tables = amppass.convert(bert.model, bert.example_inputs, torch.bfloat16, low_weight_tables=True,
                             plan_for="coverage")
    info = amppass.report(tables).info
    assert info["weight_bytes_after"] <= 0.55 * info["weight_bytes_before"]
    weights = [t for _, t in stored_parameters(tables)] + [b for b in tables.buffers() if b.is_floating_point()]
    assert all(t.dtype == torch.bfloat16 for t in weights if t.dim() == 2 and t.shape[0] > 500)


def test_softmax_and_sum_accumulate_in_fp32_without_casting_their_input():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            h = self.proj(x)
            return F.softmax(h, dim=-1) + h.sum(dim=-1, keepdim=True)

    x = torch.randn(4, 16)
    fast = amppass.convert(Net(), (x,), torch.float16, plan_for="coverage")
    nodes = {n.target: n for n in fast.graph.nodes if n.op == "call_function"}
    softmax = nodes[torch.ops.aten.softmax.int]
    assert softmax.kwargs.get("dtype") == torch.float32
    assert softmax.args[0].target is torch.ops.aten.linear.default, "input is used as it is, not cast first"
    assert softmax.meta[META_KEY]["precision"] == "fp32-accumulate"


def test_symbolic_trace_without_example_inputs():
    for name in ("mlp", "cnn"):
        case = build(name)
        fast = amppass.convert(case.model, dtype="bf16", plan_for="coverage")
        with torch.no_grad():
            out, ref = fast(*case.make_inputs(2)), case.model(*case.make_inputs(2))
        assert out.dtype == torch.float32
        assert rel_err(out, ref) < 2e-2
        rows = amppass.report(fast).rows
        assert any(r.op == "aten.linear" and r.precision == "bf16" for r in rows)


def test_attention_mask_is_saturated_not_turned_into_inf():
    class Attn(nn.Module):
        def forward(self, q, mask):
            bias = (1.0 - mask) * torch.finfo(torch.float32).min
            return F.scaled_dot_product_attention(q, q, q, attn_mask=bias)

    q = torch.randn(1, 2, 8, 16)
    mask = torch.ones(1, 1, 8, 8)
    mask[..., 0, :] = 0.0  # a fully masked row: -inf in fp16 would give NaN
    fast = amppass.convert(Attn(), (q, mask), torch.float16, plan_for="coverage")
    out = fast(q, mask)
    ref = Attn()(q, mask)
    assert torch.isfinite(out).all()
    assert rel_err(out[..., 1:, :], ref[..., 1:, :]) < 1e-2


def test_dynamic_batch_from_a_batch_of_one():
    case = build("bert", batch=1)
    fast = amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")
    bigger = build("bert", batch=3, seq=24).make_inputs(5)
    with torch.no_grad():
        assert rel_err(first(fast(*bigger)), first(case.model(*bigger))) < 2e-2


def test_convert_is_idempotent():
    case = build("mlp")
    fast = amppass.convert(case.model, case.example_inputs, torch.float16, plan_for="coverage")
    code = fast.code
    again = amppass.convert(fast, case.example_inputs, torch.float16, plan_for="coverage")
    assert again is fast and again.code == code


def test_overrides_keep_fp32_and_force_low():
    case = build("bert")
    fast = amppass.convert(case.model, case.example_inputs, torch.float16, keep_fp32=["linear_1", "gelu"],
                           force_low=["layer_norm"], plan_for="coverage")
    rows = {r.name: r for r in amppass.report(fast).rows}
    assert rows["linear_1"].precision == "fp32" and rows["linear_1"].source == "override"
    assert rows["linear_2"].precision == "fp16"
    assert all(r.precision == "fp32" and r.source == "override" for r in rows.values() if r.op == "aten.gelu")
    assert all(r.precision == "fp16" and r.source == "override" for r in rows.values() if r.op == "aten.layer_norm")
    with pytest.raises(amppass.InputError, match="matches no node"):
        amppass.convert(case.model, case.example_inputs, torch.float16, keep_fp32=["no_such_op"], plan_for="coverage")


def test_report_rows_and_json():
    case = build("cnn")
    report = amppass.report(amppass.convert(case.model, case.example_inputs, torch.float16, plan_for="coverage"))
    assert report.rows and all(r.reason and r.source for r in report.rows)
    data = __import__("json").loads(report.to_json())
    assert data["schema_version"] == 1 and len(data["rows"]) == len(report.rows)
    assert "casts inserted" in report.summary()


@pytest.mark.parametrize("dtype", ["fp32", "int8", torch.float32, 3])
def test_bad_dtype(dtype):
    with pytest.raises(amppass.InputError, match="dtype"):
        amppass.convert(build("mlp").model, dtype=dtype, plan_for="coverage")


def test_untraceable_module_names_the_cause_and_the_fix():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    with pytest.raises(amppass.CaptureError, match="example_inputs"):
        amppass.convert(DataDependent(), dtype="bf16", plan_for="coverage")
    with pytest.raises(amppass.CaptureError, match="torch.export could not capture DataDependent"):
        amppass.convert(DataDependent(), (torch.randn(3),), dtype="bf16", dynamic_shapes=None, plan_for="coverage")


def test_not_a_module():
    with pytest.raises(amppass.InputError, match="torch.nn.Module"):
        amppass.convert(lambda x: x, dtype="bf16", plan_for="coverage")


def test_training_flag_restored():
    case = build("cnn")
    case.model.train()
    amppass.convert(case.model, case.example_inputs, torch.bfloat16, plan_for="coverage")
    assert case.model.training and all(m.training for m in case.model.modules())


def test_report_rejects_unconverted_modules():
    with pytest.raises(amppass.InputError, match="amppass.convert"):
        amppass.report(fx.symbolic_trace(build("mlp").model))
    with pytest.raises(amppass.InputError):
        amppass.report(42)


class FloatBetween(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.sigmoid(self.a(x).float()))


def test_model_cast_to_fp32_runs_what_reads_it_in_fp32_as_autocast_does():
    fast = amppass.convert(FloatBetween(), dtype="bf16", plan_for="coverage")
    rows = {r.op: r for r in amppass.report(fast).rows}
    assert rows["aten.sigmoid"].precision == "fp32" and rows["aten.linear"].precision == "bf16"
    assert "explicit cast to fp32" in rows["aten._to_copy"].reason
    assert fast(torch.randn(2, 8)).dtype == torch.float32


def test_model_cast_to_fp32_forced_low_is_retargeted():
    fast = amppass.convert(FloatBetween(), dtype="bf16", plan_for="coverage", force_low=["_to_copy", "sigmoid"])
    casts = [n for n in fast.graph.nodes if n.op == "call_method"]
    assert [(n.target, n.args[1]) for n in casts] == [("to", torch.bfloat16)]
    assert fast(torch.randn(2, 8)).dtype == torch.float32


class UpDown(nn.Module):
    """Linear up, an element-wise ``middle``, linear down."""

    def __init__(self, middle):
        super().__init__()
        self.up, self.down, self.middle = nn.Linear(16, 64), nn.Linear(64, 16), middle

    def forward(self, x):
        return self.down(self.middle(self.up(x)))


def test_a_cube_stays_low_under_bf16_only():
    """A cube: bf16 has fp32's range so x**3 follows; fp16 keeps it fp32 (it leaves fp16's range at |x| > 40)."""
    model, x = UpDown(lambda h: h + 0.1 * torch.pow(h, 3.0)), torch.randn(4, 16)
    for dtype, precision in ((torch.bfloat16, "low"), (torch.float16, "fp32")):
        fast = amppass.convert(model, (x,), dtype, plan_for="coverage")
        pows = [n for n in fast.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar]
        assert [n.meta[META_KEY]["precision"] for n in pows] == [precision]
        with torch.no_grad():
            error = float((fast(x) - model(x)).norm() / model(x).norm())
        assert error < (2e-2 if dtype == torch.bfloat16 else 3e-3)


def test_gpt2_gelu_runs_low_as_one_op_in_both_dtypes():
    """GPT-2's tanh GELU cubes its input; written out, its chain becomes one aten.gelu(approximate='tanh'),
    which computes the cube in fp32 inside the kernel, so it runs low in fp16 too, with no cast around it."""
    model = UpDown(lambda h: 0.5 * h * (1.0 + torch.tanh(0.79788456 * (h + 0.044715 * torch.pow(h, 3.0)))))
    x = torch.randn(4, 16)
    for dtype in (torch.bfloat16, torch.float16):
        fast = amppass.convert(model, (x,), dtype, plan_for="coverage")
        gelus = [n for n in fast.graph.nodes if n.target is torch.ops.aten.gelu.default]
        assert [n.meta[META_KEY]["precision"] for n in gelus] == ["low"]
        assert not [n for n in fast.graph.nodes if n.target is torch.ops.aten.pow.Tensor_Scalar]
        with torch.no_grad():
            error = float((fast(x) - model(x)).norm() / model(x).norm())
        assert error < (2e-2 if dtype == torch.bfloat16 else 3e-3)
        casts = [n for n in fast.graph.nodes if n.meta.get(META_KEY, {}).get("cast")]
        assert len(casts) == 2, "only the input and the output are cast: the GELU runs low throughout"


def test_a_conversion_inside_a_callers_dispatch_mode_is_not_seen_by_it():
    """Lightning counts FLOPs around its model summary's forward, which is where a routed model converts: the
    counter sees the converted model's call, never the conversion's traced (symbolic) or timed ops."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(8, 16)
    with FlopCounterMode(display=False) as counter:
        fast = amppass.convert(model, (x,), "bf16", plan_for="coverage")
    assert counter.get_total_flops() == 0
    with FlopCounterMode(display=False) as counter:
        fast(x)
    assert counter.get_total_flops() == 2 * 8 * (16 * 32 + 32 * 4)


# -- what the model is when it is converted: its mode, its weights' dtype, its device -------------------------

class _Dropping(nn.Module):
    """A layer and a dropout: train mode changes what it computes."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name.startswith("amppass")]


def test_a_model_in_train_mode_converted_without_mode_is_told_and_refuses_training(caplog):
    torch.manual_seed(0)
    model, x = _Dropping(), torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="amppass"):
        fast = amppass.convert(model, (x,), "bf16", plan_for="coverage")
    said = [m for m in _warnings(caplog) if "train mode" in m]
    assert len(said) == 1 and "_Dropping is in train mode" in said[0] and "given no mode=" in said[0]
    assert "mode='train'" in said[0] and "model.eval()" in said[0]
    assert model.training and not fast.training, "the caller's model keeps its mode; the eval graph comes back in eval"
    with torch.no_grad():  # it serves: the eval graph, dropout off
        assert rel_err(fast(x), model.eval()(x)) < 2e-2
    model.train()
    fast.train()
    with pytest.raises(amppass.InputError, match=r"_Dropping was converted for inference \(amppass\.convert without "
                                                 r"mode=, from a model in train mode\).*mode='train'.*\.eval\(\)"):
        fast(x).sum().backward()
    with torch.no_grad():
        fast(x)  # train mode without gradients is not training: it runs
    fast.eval()
    fast(x)


@pytest.mark.parametrize("how", ["eval", "mode"])
def test_a_model_whose_mode_is_said_is_converted_without_a_word(how, caplog):
    model, x = _Dropping(), torch.randn(4, 8)
    with caplog.at_level("WARNING", logger="amppass"):
        if how == "eval":
            fast = amppass.convert(model.eval(), (x,), "bf16", plan_for="coverage")
        else:
            fast = amppass.convert(model, (x,), "bf16", plan_for="coverage", mode="inference")
    assert not [m for m in _warnings(caplog) if "train mode" in m]
    fast.train()
    fast(x).sum()  # not refused: the caller said what it converted for


def test_weights_amppass_cannot_plan_from_are_refused_before_anything_runs():
    model = _Dropping().eval()
    with pytest.raises(amppass.InputError, match=r"the model is on the 'meta' device \(fc\.weight") as caught:
        amppass.convert(copy.deepcopy(model).to("meta"), (torch.randn(4, 8),), "bf16")
    assert "target=" not in str(caught.value), "the user passed no target"
    half = copy.deepcopy(model).half()
    with pytest.raises(amppass.InputError, match=r"already float16 \(fc\.weight: 2 of 2 floating parameters\).*"
                                                 r"copy\.deepcopy\(model\)\.float\(\)"):
        amppass.convert(half, (torch.randn(4, 8).half(),), "fp16")
    assert all(p.dtype == torch.float16 for p in half.parameters()), "the caller's model is unchanged"
    with pytest.raises(amppass.InputError, match=r"the example holds bfloat16 tensors and the model's weights are "
                                                 r"float32.*x\.to\(torch\.float32\)"):
        amppass.convert(model, (torch.randn(4, 8).bfloat16(),), "bf16")


class _Widening(nn.Module):
    """A model whose own code takes any floating input (it casts it to its weights' dtype)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x.to(self.fc.weight.dtype))


def test_an_example_of_another_dtype_that_the_model_itself_takes_converts():
    torch.manual_seed(0)
    model, x = _Widening().eval(), torch.randn(4, 8)
    fast = amppass.convert(model, (x.half(),), "bf16", plan_for="coverage")
    with torch.no_grad():
        assert rel_err(fast(x.half()), model(x.half())) < 2e-2


def test_a_model_whose_library_put_its_layers_in_eval_is_not_taken_for_training(caplog):
    """A SentenceTransformer is in train mode around a from_pretrained model in eval: it is not being trained."""
    torch.manual_seed(0)
    model, x = nn.Sequential(_Dropping().eval()), torch.randn(4, 8)
    assert model.training
    with caplog.at_level("WARNING", logger="amppass"):
        fast = amppass.convert(model, (x,), "bf16", plan_for="coverage")
    assert not [m for m in _warnings(caplog) if "train mode" in m]
    fast(x).sum()
