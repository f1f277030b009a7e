"""amppass.fx.capture.export: what capture() refuses, the GraphModule it returns (its own module tree, the caller's
tensors, outputs equal to the model's, guards and applied Functions in its meta, no dtype asserts), the mode it
captures in and restores, keyword values fixed in the graph, the errors that name the fix, and the spatial sizes
of image inputs kept static unless dynamic_shapes= asks. Which other dimensions stay dynamic is left to the
capture's own tests (tests/fx/capture/test_fidelity.py, tests/serving)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import fx, nn
from torch.export import Dim

from amppass.errors import CaptureError, InputError
from amppass.fx.capture.export import (
    CAPTURE_LOCK,
    auto_dims,
    capture,
    capture_program,
    capturing,
    size_one_dynamic,
    without_dtype_asserts,
)
from amppass.fx.capture.function_backward import FUNCTIONS_KEY
from amppass.fx.capture.guards import GUARDS_KEY, ShapeGuards
from tests.helpers.small_models import Flagged


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.drop, self.fc2 = nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow: the symbolic tracer cannot follow it
            return x * 2
        return x


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model, inputs, kwargs, message", [
    ("not a module", (X,), None, "model must be a torch.nn.Module, got str; pass the module object itself"),
    (MLP(), {"x": X}, None, "example_inputs is a dict; pass positional inputs as a tuple, e.g. example_inputs=(x,)"),
    (MLP(), (X,), [X], "example_kwargs must be a dict of keyword inputs, got list"),
])
def test_bad_arguments_are_refused_naming_the_fix(model, inputs, kwargs, message):
    with pytest.raises(InputError) as raised:
        capture(model, inputs, kwargs)
    assert str(raised.value).startswith(message)


def test_an_exported_capture_computes_what_the_model_does_on_its_own_modules():
    model = MLP()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gm = capture(model, (X,), note_fixed_dims=False)
    assert isinstance(gm, fx.GraphModule)
    assert torch.equal(gm(X), model.eval()(X))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # the caller's tensors, not copies; its own module objects, so replacing a weight leaves the caller's alone
    assert gm.get_parameter("fc1.weight") is model.fc1.weight
    gm.get_submodule("fc1").register_parameter("weight", nn.Parameter(torch.zeros(8, 4)))
    assert model.fc1.weight.abs().sum() > 0


def test_a_capture_keeps_its_guards_and_applied_functions_and_drops_dtype_asserts():
    gm = capture(MLP(), (X,), note_fixed_dims=False)
    guards = gm.meta[GUARDS_KEY]
    assert isinstance(guards, ShapeGuards) and [spec.name for spec in guards.inputs] == ["x"]
    assert guards.inputs[0].dtype is torch.float32 and guards.mismatch((X,), {}) is None
    assert gm.meta[FUNCTIONS_KEY] == []
    assert not any(n.target is torch.ops.aten._assert_tensor_metadata.default for n in gm.graph.nodes)


@pytest.mark.parametrize("train", [False, True])
def test_captured_in_the_mode_asked_and_the_models_flags_restored(train):
    model = MLP().train()
    model.fc1.eval()  # a flag the user set on one submodule
    gm = capture(model, (X,), train=train, note_fixed_dims=False)
    assert model.training and model.drop.training and not model.fc1.training
    torch.manual_seed(3)
    first = gm(X)
    torch.manual_seed(4)
    second = gm(X)
    # captured in train mode the dropout draws a new mask each call; in eval mode it is gone
    assert torch.equal(first, second) is not train
    if not train:
        assert torch.equal(first, MLP().eval()(X))


def test_without_examples_the_model_is_traced_symbolically():
    model = MLP()
    gm = capture(model)
    assert model.training  # restored after a trace in eval mode
    assert GUARDS_KEY not in gm.meta  # a trace has no guards: it takes any shape
    assert torch.equal(gm(X), model.eval()(X)) and gm.get_parameter("fc2.bias") is model.fc2.bias


def test_a_trace_that_fails_says_to_pass_example_inputs():
    with pytest.raises(CaptureError) as raised:
        capture(Branchy())
    message = str(raised.value)
    assert message.startswith("torch.fx.symbolic_trace could not trace Branchy: ")
    assert "Pass example_inputs so amppass captures it with torch.export instead" in message


def test_an_export_that_fails_on_an_example_the_model_runs_names_the_ways_out():
    with pytest.raises(CaptureError) as raised:
        capture(Branchy(), (X,), note_fixed_dims=False)
    message = str(raised.value)
    assert message.startswith("torch.export could not capture Branchy: ")
    assert "use torch.cond" in message and "backend='amppass'" in message


def test_an_example_the_model_refuses_is_named_in_its_terms():
    with pytest.raises(CaptureError) as raised:
        capture(MLP(), (torch.randn(3, 5),), note_fixed_dims=False)
    assert str(raised.value) == "input 'x' of shape [3, 5] does not fit MLP: linear (fc1) takes [*, 4]"


def test_plain_keyword_values_are_fixed_in_the_graph_and_its_guards():
    model = Flagged()
    gm = capture(model, (X,), {"double": True}, note_fixed_dims=False)
    guards = gm.meta[GUARDS_KEY]
    assert guards.fixed == {"double": True}
    assert torch.equal(gm(X), model(X, double=True))  # the graph takes x alone
    assert guards.mismatch((X,), {"double": True}) is None
    assert str(guards.mismatch((X,), {"double": False})) == "input double is False, the plan takes True"


@pytest.mark.parametrize("inputs", [X, [X], (X,)], ids=["tensor", "list", "tuple"])
def test_one_input_may_be_given_bare_or_in_a_list(inputs):
    gm = capture(MLP(), inputs, note_fixed_dims=False)
    assert torch.equal(gm(X), MLP().eval()(X))


def test_auto_dims_name_every_dimension_of_every_tensor_input():
    assert auto_dims(Flagged(), (X,), {}) == {"x": {0: Dim.AUTO, 1: Dim.AUTO}}

    class Nested(nn.Module):
        def forward(self, x, pair, scale=1.0):
            return x + pair[0] * pair[1] * scale

    found = auto_dims(Nested(), (X, (X, torch.ones(4))), {"scale": 2.0})
    assert found == {"x": {0: Dim.AUTO, 1: Dim.AUTO}, "pair": ({0: Dim.AUTO, 1: Dim.AUTO}, {0: Dim.AUTO}),
                     "scale": None}

    class Variadic(nn.Module):
        def forward(self, *xs):
            return xs[0]

    assert auto_dims(Variadic(), (X,), {}) is None  # export cannot name what *xs holds
    assert auto_dims(MLP(), (X, X), {}) is None  # does not bind to forward()


def test_capture_program_prepares_a_program_exported_elsewhere():
    program = torch.export.export(MLP().eval(), (X,))
    gm = capture_program(program)
    assert isinstance(gm.meta[GUARDS_KEY], ShapeGuards) and torch.equal(gm(X), MLP().eval()(X))


def test_without_dtype_asserts_erases_exports_metadata_checks():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch.ops.aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    graph.output(graph.call_function(torch.ops.aten.relu.default, (x,)))
    gm = without_dtype_asserts(fx.GraphModule(nn.Module(), graph))
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_function", "output"]
    assert torch.equal(gm(X.half()), X.half().relu())  # an fp16 input no longer trips the fp32 assert


def test_size_one_dynamic_patches_torch_config_only_inside():
    config = torch.fx.experimental._config
    before = config.backed_size_oblivious
    with size_one_dynamic(True):
        assert config.backed_size_oblivious is True
    assert config.backed_size_oblivious == before


def test_capturing_holds_the_lock_and_the_mode():
    model = MLP().train()
    seen = []
    with capturing(model, train=False):
        assert not model.training
        other = threading.Thread(target=lambda: seen.append(CAPTURE_LOCK.acquire(timeout=0.05)))
        other.start()
        other.join()
    assert seen == [False] and model.training  # another thread waits while one captures


class Windowed(nn.Module):
    """A convolution, then a window partition over the image's height and width (as a Swin net's attention)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc = nn.Conv2d(3, 4, 1), nn.Linear(4 * 2 * 2, 4)

    def forward(self, x):
        y = self.conv(x)
        b, c, h, w = y.shape
        windows = y.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * 4)
        return self.fc(windows)


class Signal(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


def test_an_image_inputs_spatial_sizes_stay_static_by_default_and_its_batch_dynamic(caplog):
    image = torch.randn(2, 3, 8, 8)
    with caplog.at_level("INFO", logger="amppass.fx.capture.export"):
        gm = capture(Windowed(), (image,))
    dims = gm.meta[GUARDS_KEY].inputs[0].dims
    assert isinstance(dims[0], str) and dims[1:] == (3, 8, 8)
    other = torch.randn(5, 3, 8, 8)
    assert torch.equal(gm(other), Windowed().eval()(other))  # another batch runs in the same graph
    said = [r for r in caplog.records if "spatial sizes are kept" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"  # a default, not a failure: no warning
    assert "x's" in said[0].getMessage() and "Conv2d" in said[0].getMessage()
    assert "dynamic_shapes=" in said[0].getMessage()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # the kept sizes are not "fixed by export"


def test_dynamic_shapes_keeps_an_image_inputs_spatial_sizes_dynamic_when_asked():
    image = torch.randn(2, 3, 8, 8)
    gm = capture(Windowed(), (image,), dynamic_shapes={"x": {0: Dim.AUTO, 2: Dim.AUTO, 3: Dim.AUTO}},
                 note_fixed_dims=False)
    dims = gm.meta[GUARDS_KEY].inputs[0].dims
    assert all(isinstance(dims[d], str) for d in (0, 2, 3)) and dims[1] == 3
    larger = torch.randn(1, 3, 12, 16)
    assert torch.equal(gm(larger), Windowed().eval()(larger))


def test_a_sequence_input_of_a_conv1d_keeps_its_length_dynamic():
    gm = capture(Signal(), (torch.randn(2, 3, 10),), note_fixed_dims=False)
    dims = gm.meta[GUARDS_KEY].inputs[0].dims
    assert isinstance(dims[0], str) and isinstance(dims[2], str)
