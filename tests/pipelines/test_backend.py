"""torch.compile(backend="amppass"): the plan on every graph dynamo captures, graph breaks included."""

from __future__ import annotations

import copy
import importlib.metadata
import time
import tomllib

import pytest
import torch
from torch import nn

import amppass
from amppass.pipelines.backend import amppass_backend
from tests.helpers.paths import ROOT
from tests.helpers.shape_models import detector
from tests.helpers.small_models import Split


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def registered():
    """backend="amppass" as an installed amppass provides it: the entry point pyproject.toml declares."""
    from torch._dynamo.backends import registry

    value = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["torch_dynamo_backends"]
    point = importlib.metadata.EntryPoint(name="amppass", value=value["amppass"], group="torch_dynamo_backends")
    assert point.load() is amppass_backend
    registry._lazy_import()  # first: it reads the installed entry points, which the state restored below holds
    entry, function = registry._BACKENDS.get("amppass"), registry._COMPILER_FNS.pop("amppass", None)
    registry._BACKENDS["amppass"] = point
    yield
    # a lookup registers the loaded function and leaves _BACKENDS["amppass"] None: put back what was there, so
    # backend="amppass" resolves in the tests after this one
    registry._COMPILER_FNS.pop("amppass", None)
    registry._BACKENDS["amppass"] = entry if entry is not None or function is not None else point
    if function is not None:
        registry._COMPILER_FNS["amppass"] = function


def test_detector_with_nms_runs_every_shape_as_close_to_fp32_as_autocast(registered):
    case = detector()
    compiled = torch.compile(case.model, backend="amppass", options={"dtype": torch.bfloat16, "compiler": "eager",
                                                                         "plan_for": "coverage"})
    for args in [case.example, *case.calls.values()]:
        with torch.no_grad():
            boxes, scores = compiled(*args)
            ref_boxes, ref_scores = case.model(*args)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto_boxes, auto_scores = case.model(*args)
            raw, ref_raw = compiled.predict(*args), case.model.predict(*args)
        assert boxes.shape == ref_boxes.shape and scores.dtype == torch.float32
        assert rel(scores, ref_scores) <= 1.1 * rel(auto_scores, ref_scores) + 1e-6
        assert rel(boxes, ref_boxes) <= 1.1 * rel(auto_boxes, ref_boxes) + 1e-6
        assert rel(raw[0], ref_raw[0]) < 1e-2
    report = amppass.report(compiled)
    assert report.info["graphs"] >= 2 and report.info["compiler"] == "eager"
    convolutions = [r for r in report.rows if r.op in ("aten.conv2d", "aten.convolution")]
    assert convolutions and all(r.precision == "bf16" and r.name.startswith("g") for r in convolutions)
    assert {r.name.split(".")[0] for r in report.rows} == {f"g{i}" for i in range(report.info["graphs"])}


def test_inductor_matches_fp32_and_a_changed_weight_is_refreshed():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).eval()
    # frozen: compiles again
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", "plan_for": "coverage"})
    x = torch.randn(4, 16)
    with torch.no_grad():
        started = time.perf_counter()
        out = compiled(x)
        seconds = time.perf_counter() - started
        assert rel(out, model(x)) < 2e-2
        model[0].weight.mul_(-0.5)  # in place: its version counter moves
        after = compiled(x)
        assert torch.equal(compiled(x), after)  # refreshed once: the copies it wrote are not a change again
    assert rel(after, model(x)) < 2e-2 and rel(after, out) > 0.1
    info = amppass.report(compiled).info
    assert info["graph_plans"][0]["refreshes"] == 1 and info["compiler"] == "inductor"
    print(f"inductor: first call (dynamo + amppass + inductor) {seconds:.1f} s")


def test_eager_refreshes_weights_changed_in_place_or_replaced():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    compiled = torch.compile(model, backend=amppass_backend, options={"compiler": "eager", "plan_for": "coverage"})
    x = torch.randn(4, 16)
    with torch.no_grad():
        compiled(x)
        model[2].weight.add_(1.0)
        assert rel(compiled(x), model(x)) < 2e-2
        model[0].weight = nn.Parameter(torch.randn(32, 16))
        assert rel(compiled(x), model(x)) < 2e-2
    assert amppass.report(compiled).info["graph_plans"][0]["refreshes"] == 2


def test_train_mode_gradients_reach_the_models_fp32_parameters():
    torch.manual_seed(0)
    model = Split()
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", "mode": "train",
                                                                       "compiler": "eager", "plan_for": "coverage"})
    x = torch.randn(4, 16)
    compiled(x).square().mean().backward()
    reference = copy.deepcopy(model)
    reference.zero_grad()
    reference(x).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32, name
        assert rel(p.grad, q.grad) < 5e-2, name
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # the graphs read the stepped fp32 parameters
    with torch.no_grad():
        assert rel(compiled(x), model(x)) < 2e-2 and rel(compiled(x), reference(x)) > 1e-2
    assert amppass.report(compiled).info["mode"] == "train"


def test_calibration_reaches_the_graphs_its_batches_fit():
    torch.manual_seed(0)
    model = Split().eval()
    batches = [(torch.randn(4, 16),) for _ in range(2)]
    compiled = torch.compile(model, backend=amppass_backend,
                             options={"dtype": "fp16", "compiler": "eager", "calibration": batches,
                                      "plan_for": "coverage"})
    with torch.no_grad():
        assert rel(compiled(batches[0][0]), model(batches[0][0])) < 1e-2
    plans = amppass.report(compiled).info["graph_plans"]
    assert [p["calibrated"] for p in plans] == [True, False]


def test_a_compiled_function_reports_and_bad_options_name_the_fix():
    weight = nn.Linear(8, 8)

    def f(x):
        return weight(x).relu()

    compiled = torch.compile(f, backend=amppass_backend, options={"compiler": "eager", "plan_for": "coverage"})
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    assert [r.precision for r in amppass.report(compiled).rows if r.op == "aten.linear"] == ["bf16"]
    bad = torch.compile(nn.Linear(8, 8), backend=amppass_backend, options={"dtyp": "bf16"})
    with pytest.raises(Exception, match="unknown option.*dtyp"):
        bad(torch.randn(2, 8))
    with pytest.raises(amppass.InputError, match="not compiled with torch.compile"):
        amppass.report(torch.compile(nn.Linear(8, 8), backend="eager"))


def test_report_before_the_first_call_says_it_has_not_been_called(registered):
    """Dynamo converts on the first call: a report asked before it says so, and works after it."""
    compiled = torch.compile(nn.Linear(8, 8), backend="amppass", options={"compiler": "eager", "plan_for": "coverage"})
    with pytest.raises(amppass.InputError, match="has not been called yet"):
        amppass.report(compiled)
    with torch.no_grad():
        compiled(torch.randn(2, 8))
    assert [r.op for r in amppass.report(compiled).rows] == ["aten.linear"]


@pytest.mark.slow
def test_bert_base_against_autocast_with_inductor_freezing():
    """The backend's headline figure: latency and compile time of the backend against autocast + inductor freezing."""
    import torch._inductor.config as inductor

    from models import build

    case = build("bert", "base", batch=1, seq=128)
    x = case.example_inputs[0]

    def timed(fn, repeats=20):
        started = time.perf_counter()
        fn()
        first = time.perf_counter() - started
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return first, sorted(times)[repeats // 2]

    with torch.no_grad():
        with inductor.patch(freezing=True):
            baseline = torch.compile(copy.deepcopy(case.model))

            def autocast():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return baseline(x)

            auto_compile, auto_latency = timed(autocast)
        torch._dynamo.reset()
        ours = torch.compile(case.model, backend=amppass_backend, options={"dtype": "bf16", "plan_for": "coverage"})
        our_compile, our_latency = timed(lambda: ours(x))
        reference = case.model(x).last_hidden_state
        assert rel(ours(x).last_hidden_state, reference) <= 1.1 * rel(autocast().last_hidden_state, reference)
    print(f"BERT-base bf16 1x128: compile {our_compile:.1f} s vs {auto_compile:.1f} s, "
          f"latency {our_latency * 1e3:.1f} ms vs {auto_latency * 1e3:.1f} ms")
    assert our_latency <= auto_latency * 1.1 and our_compile <= auto_compile * 1.2


def test_a_graph_that_cannot_be_traced_runs_unconverted_with_a_warning(monkeypatch, caplog):
    from amppass.pipelines import backend

    def refuse(*args, **kwargs):
        raise amppass.CaptureError("graph 1 could not be traced to ATen ops (this test)")

    torch.manual_seed(0)
    model = Split().eval()
    compiled = torch.compile(model, backend=amppass_backend, options={"compiler": "eager", "plan_for": "coverage"})
    x = torch.randn(4, 16)
    real = backend.trace_aten
    calls = iter([real, refuse])
    monkeypatch.setattr(backend, "trace_aten", lambda *a, **k: next(calls)(*a, **k))
    with torch.no_grad():
        out = compiled(x)
        assert rel(out, model(x)) < 2e-2 and torch.equal(compiled(x), out)
    assert "graph 1 runs as dynamo traced it, in fp32" in caplog.text
    info = amppass.report(compiled).info
    assert info["graphs"] == 1 and info["unconverted"][0]["graph"] == 1


# -- every shape dynamo hands over: inductor's code follows dynamo's symbolic sizes ---------------------------

class PNet(nn.Module):
    """MTCNN's proposal net, a face detector's first stage: fully convolutional, run on every scale of an
    image pyramid (the sizes that once crashed inductor with ``expected size 17==14``)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 10, 3), nn.PReLU(10), nn.MaxPool2d(2, 2, ceil_mode=True),
                                  nn.Conv2d(10, 16, 3), nn.PReLU(16), nn.Conv2d(16, 32, 3), nn.PReLU(32))
        self.score, self.box = nn.Conv2d(32, 2, 1), nn.Conv2d(32, 4, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.score(h).softmax(1), self.box(h)


def seeded(build):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().eval()


def test_inductor_serves_every_image_size_of_a_pyramid():
    model = seeded(PNet)
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", "plan_for": "coverage"})
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():  # constants the graphs make are inference tensors: they have no version counter
        for shape in [(1, 3, 48, 40), (1, 3, 34, 30), (1, 3, 24, 18)]:  # not square: dynamo would tie H to W
            x = torch.randn(*shape, generator=generator)
            (score, box), (ref_score, ref_box) = compiled(x), model(x)
            assert score.shape == ref_score.shape and score.dtype == torch.float32, shape
            assert rel(score, ref_score) < 1e-2 and rel(box, ref_box) < 2e-2, shape
    report = amppass.report(compiled)
    plans = report.info["graph_plans"]
    # dynamo compiled the first size, then one graph with dynamic sizes: the third image ran on it (an odd
    # width would not: inductor's ceil-mode pooling guards the parity, and dynamo compiles again)
    assert len(plans) == 2 and "s" in plans[1]["inputs"] and report.info["compiler"] == "inductor"
    convolutions = [r for r in report.rows if r.op in ("aten.conv2d", "aten.convolution")]
    assert len(convolutions) == 10 and all(r.precision == "bf16" for r in convolutions)


def test_inductor_serves_every_sequence_length_of_bert():
    from transformers import BertConfig, BertModel

    model = seeded(lambda: BertModel(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=64,
                                                attn_implementation="sdpa")))
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", "plan_for": "coverage"})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for batch, length in [(2, 16), (2, 11), (2, 7)]:
            ids = torch.randint(1, 100, (batch, length), generator=generator)
            out, ref = compiled(ids).last_hidden_state, model(ids).last_hidden_state
            assert out.shape == ref.shape and rel(out, ref) < 2e-2, (batch, length)
    assert len(amppass.report(compiled).info["graph_plans"]) == 2


def test_inductor_trains_at_every_shape_and_updates_batch_statistics():
    def build():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(8, 5)).train()

    model, reference = seeded(build).train(), seeded(build).train()
    # dynamic from the first call; inductor's training graphs of this net keep height and width static (with
    # the inductor backend too), so each image size is a graph of its own and the batch a symbol in each
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", "mode": "train",
                                                                       "plan_for": "coverage"}, dynamic=True)
    generator = torch.Generator().manual_seed(1)
    for shape in [(2, 3, 16, 16), (3, 3, 20, 12)]:
        x = torch.randn(*shape, generator=generator)
        model.zero_grad()
        reference.zero_grad()
        compiled(x).square().mean().backward()
        reference(x).square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=False):
            assert p.grad.dtype == torch.float32 and rel(p.grad, q.grad) < 5e-2, (shape, name)
        assert rel(model[1].running_mean, reference[1].running_mean) < 1e-2, shape
    assert int(model[1].num_batches_tracked) == 2
    report = amppass.report(compiled)
    assert report.info["unconverted"] == [] and all("[s" in p["inputs"] for p in report.info["graph_plans"])
    assert {r.precision for r in report.rows if r.op == "aten.conv2d"} == {"bf16"}


def test_graph_breaks_serve_every_batch_with_inductor_and_calibrate_dynamic_graphs():
    model = seeded(Split)
    batches = [(torch.randn(4, 16, generator=torch.Generator().manual_seed(s)),) for s in range(2)]
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "fp16", "calibration": batches,
                                                                       "plan_for": "coverage"})
    with torch.no_grad():
        for batch in (4, 6, 9):
            x = torch.randn(batch, 16, generator=torch.Generator().manual_seed(batch))
            assert rel(compiled(x), model(x)) < 1e-2, batch
    plans = amppass.report(compiled).info["graph_plans"]
    # two graphs at batch 4, two with a dynamic batch; the batches fit the first graph of each pair: the
    # dynamic one reads its size input from them
    assert [p["calibrated"] for p in plans] == [True, False, True, False]
    assert "s" in plans[2]["inputs"]


@pytest.mark.parametrize("family,compiler", [
    ("llama", "inductor"), ("gpt2", "eager"), ("qwen2", "eager"),
    pytest.param("gpt2", "inductor", marks=pytest.mark.slow), pytest.param("qwen2", "inductor", marks=pytest.mark.slow),
])
def test_generate_through_the_backend_picks_fp32s_greedy_tokens(family, compiler):
    """Regression: the second decode step of ``generate()`` once crashed inductor (the cache length changed)."""
    from tests.helpers.decoders import agreeing_steps, decoder, greedy, prompt

    reference, model = decoder(family), decoder(family)
    model.forward = torch.compile(model.forward, backend=amppass_backend,
                                  options={"dtype": "bf16", "compiler": compiler, "plan_for": "coverage"})
    ids = prompt(seed=4)  # fp32's top-2 logits are apart at every step of this prompt (tests/helpers/decoders.py)
    assert agreeing_steps(greedy(reference, ids, 12), greedy(model, ids, 12)) >= 8
    plans = amppass.report(model.forward).info["graph_plans"]
    # the prompt, the first decode step, then every later step on one graph whose cache length is a symbol
    assert len(plans) == 3 and "cache" in plans[2]["inputs"] and ", s" in plans[2]["inputs"]


def _pyramid_heads() -> tuple[nn.Module, list[tuple]]:
    """models/detection.py's backbone, FPN and RPN heads: the convolutional part of its detector."""
    from models.detection import DetectorBackbone, RPNHead, TinyFPN

    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone, self.fpn, self.rpn = DetectorBackbone(), TinyFPN((32, 64, 128), 32), RPNHead(32, 3)

        def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
            return [t for pair in self.rpn(self.fpn(self.backbone(x))) for t in pair]

    shapes = [(1, 3, 64, 64), (1, 3, 56, 72), (1, 3, 72, 48), (2, 3, 48, 40), (3, 3, 68, 60)]
    return seeded(Heads), [(torch.randn(*s, generator=torch.Generator().manual_seed(i)),) for i, s in enumerate(shapes)]


def _bert_small() -> tuple[nn.Module, list[tuple]]:
    from models import build

    calls = [(2, 16), (2, 11), (3, 7), (1, 20), (4, 33)]
    return build("bert", "small").model, [build("bert", "small", batch=b, seq=s).make_inputs(i)
                                          for i, (b, s) in enumerate(calls)]


def _detector_nms() -> tuple[nn.Module, list[tuple]]:
    case = detector()
    return case.model, [case.example, *case.calls.values()]


@pytest.mark.slow
@pytest.mark.parametrize("build", [_pyramid_heads, _bert_small, _detector_nms], ids=lambda b: b.__name__[1:])
def test_inductor_at_every_shape_of_real_sized_architectures(build):
    """Every call of each model through inductor: within 1.5x autocast's error of fp32 (NMS-kept boxes included)."""
    from tests.helpers.numerics import rel_error

    model, calls = build()
    compiled = torch.compile(model, backend=amppass_backend, options={"dtype": "bf16", "plan_for": "coverage"})
    with torch.no_grad():
        for args in calls:
            out, ref = compiled(*args), model(*args)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                auto = model(*args)
            assert rel_error(out, ref) <= 1.5 * rel_error(auto, ref) + 1e-3, [a.shape for a in args]
    report = amppass.report(compiled)
    assert report.info["unconverted"] == [] and any("[s" in p["inputs"] for p in report.info["graph_plans"])


def test_state_reached_through_module_dicts_keeps_its_own_name():
    """Dynamo names a weight by the path it was read through; a model that reads a submodule through
    ``__dict__['_modules']`` (DonutSwin) gives sources the path must still follow, or two weights get one name,
    and the second placeholder was bound to the first weight (a shape error there; with equal shapes, a silently
    wrong result)."""
    from types import SimpleNamespace

    from amppass.fx.capture.dynamo_graph import lift_state, state_inputs

    def placeholder(name: str, source: str) -> torch.fx.Node:
        node = torch.fx.Graph().placeholder(name)
        node.meta["grapharg"] = SimpleNamespace(source=SimpleNamespace(name=source))
        return node

    block = "L['self']._modules['blocks']._modules['0'].__dict__['_modules']"
    nodes = [placeholder("a", f"{block}['intermediate']._modules['dense']._parameters['weight']"),
             placeholder("b", f"{block}['output']._modules['dense']._parameters['weight']"),
             placeholder("c", "L['self'].__dict__['_modules']['norm'].__dict__['_buffers']['running_mean']")]
    tensors = [nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4, 4)), torch.zeros(4)]
    assert state_inputs(nodes, tensors) == {0: "blocks.0.intermediate.dense.weight",
                                             1: "blocks.0.output.dense.weight", 2: "norm.running_mean"}

    # a name taken twice (any source the pattern misses) never binds the second tensor to the first's attribute
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    graph.output(graph.call_function(torch.add, (x, y)))
    traced = torch.fx.GraphModule(nn.Module(), graph)
    traced.meta["attributes"] = []
    lifted, users = lift_state(traced, nodes[:2], tensors[:2], {0: "dense.weight", 1: "dense.weight"})
    assert users == [] and torch.equal(lifted(), tensors[0] + tensors[1])
