"""amppass.convert(mode="train", dtype="fp8"): which products train in fp8, training against bf16, checkpoints, targets.

A product trains in fp8 with e4m3 forward operands and e5m2 gradients (tests/fx/rewrite/test_fp8_train.py holds the
op's numerics); here, the conversion around it: the graph, the module tree and state dict of bf16 training, the
loss falling as bf16's does, two calls before one backward (contrastive losses) compiled as in eager mode, the
refusals.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import InputError
from amppass.fx.rewrite.fp8_train import fp8_train_linear
from tests.helpers.saved_memory import saved_bytes

FP8_OP = fp8_train_linear._opoverload
HISTORIES = ["mid.fp8_grad_amax_history", "mid.fp8_input_amax_history", "proj.fp8_grad_amax_history",
             "proj.fp8_input_amax_history"]  # the delayed recipe's state, after each module's own keys


class Conv1D(nn.Module):
    """transformers' ``Conv1D``: ``addmm(bias, x, W)`` with W stored in x out (GPT-2's every product)."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.1)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.proj, self.out = nn.Linear(32, 64), nn.Linear(64, 64), Conv1D(64, 64), \
            nn.Linear(64, 16)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + torch.relu(self.proj(torch.relu(self.mid(h))))
        return self.out(h)


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)  # the CPU target's "testing only" warning
    yield
    logging.disable(logging.NOTSET)


def _net() -> Net:
    torch.manual_seed(0)
    return Net().train()


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 16, generator=generator)
    return [(x, (x @ teacher).argmax(-1)) for x in (torch.randn(64, 32, generator=generator) for _ in range(steps))]


def _train(model: nn.Module, data) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for x, y in data:
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_the_middle_products_train_in_fp8_and_the_ends_stay_bf16_saying_why():
    net = _net()
    converted = amppass.convert(copy.deepcopy(net), (torch.randn(8, 32),), dtype="fp8", mode="train",
                                plan_for="coverage")
    for graph in (converted.train_graph, converted.eval_graph):
        fp8 = [n for n in graph.graph.nodes if n.target is FP8_OP]
        assert sorted(n.name for n in fp8) == ["addmm", "linear_1"]  # mid and proj (its weight transposed)
        assert all(n.args[1].op == "get_attr" or n.args[1].args[0].op == "get_attr" for n in fp8)  # fp32 master
    report = amppass.report(converted)
    rows = {row.name: row for row in report.fp8_rows()}
    assert "first fp8-capable product" in rows["linear"].reason
    assert "last fp8-capable product" in rows["linear_2"].reason
    assert rows["addmm"].evidence["fp8"]["gradient_format"] == "e5m2"
    assert "not needed" in report.info["fp8"]["loss_scaling"]
    assert [n for n, _ in converted.named_modules()] == [n for n, _ in net.named_modules()]
    assert list(converted.state_dict()) == list(net.state_dict())
    converted(torch.randn(8, 32)).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in converted.parameters())


def test_a_small_model_trains_in_fp8_as_far_as_in_bf16():
    """The loss falls, and the fp8 model's last losses are within a tenth of bf16's descent of bf16's."""
    data = _data(40)
    bf16 = _train(amppass.convert(_net(), (data[0][0],), mode="train", plan_for="coverage"), data)
    fp8 = _train(amppass.convert(_net(), (data[0][0],), dtype="fp8", mode="train", plan_for="coverage"), data)
    last = slice(-5, None)
    bf16_end, fp8_end = sum(bf16[last]) / 5, sum(fp8[last]) / 5
    assert fp8_end < 0.85 * fp8[0] and bf16_end < 0.85 * bf16[0]  # both fall by a quarter
    assert abs(fp8_end - bf16_end) <= 0.1 * (bf16[0] - bf16_end)


@pytest.mark.parametrize("recipe", ["dynamic", "delayed"])
def test_a_checkpoint_resumes_fp8_training_bit_for_bit(recipe):
    """Model and optimizer saved after 3 steps and loaded into a second conversion continue with the same losses
    and the same state, bit for bit: dynamic scales keep the original's keys (no amax history), delayed ones add
    each product's histories, three steps in."""
    data = _data(6)

    def converted() -> nn.Module:
        return amppass.convert(_net(), (data[0][0],), dtype="fp8", mode="train", plan_for="coverage",
                               fp8_recipe=recipe)

    first = converted()
    optimizer = torch.optim.AdamW(first.parameters(), lr=3e-3)
    for x, y in data[:3]:
        optimizer.zero_grad()
        nn.functional.cross_entropy(first(x).float(), y).backward()
        optimizer.step()
    checkpoint = copy.deepcopy({"model": first.state_dict(), "optimizer": optimizer.state_dict()})
    histories = [key for key in checkpoint["model"] if "amax" in key]
    assert histories == ([] if recipe == "dynamic" else HISTORIES)
    assert all(checkpoint["model"][k][:3].all() and not checkpoint["model"][k][3:].any() for k in histories)
    second = converted()
    second.load_state_dict(checkpoint["model"])
    resumed = torch.optim.AdamW(second.parameters(), lr=3e-3)
    resumed.load_state_dict(checkpoint["optimizer"])
    optimizer_state = {"first": optimizer, "second": resumed}
    for x, y in data[3:]:
        losses = {}
        for name, model in (("first", first), ("second", second)):
            loss = nn.functional.cross_entropy(model(x).float(), y)
            optimizer_state[name].zero_grad()
            loss.backward()
            optimizer_state[name].step()
            losses[name] = loss.item()
        assert losses["first"] == losses["second"]
    for key, value in first.state_dict().items():
        assert torch.equal(value, second.state_dict()[key]), key


def test_fp8_training_is_refused_on_a_gpu_below_compute_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    with pytest.raises(InputError, match=r"compute capability 8\.6.*8\.9.*dtype='bf16'"):
        amppass.convert(_net(), (torch.randn(8, 32),), dtype="fp8", mode="train", target="cuda")


def test_fp8_training_on_a_cpu_needs_coverage():
    with pytest.raises(InputError, match=r"plan_for='coverage'"):
        amppass.convert(_net(), (torch.randn(8, 32),), dtype="fp8", mode="train", target="cpu")


def _delayed(model: nn.Module | None = None, example: torch.Tensor | None = None) -> nn.Module:
    return amppass.convert(model or _net(), (torch.randn(8, 32) if example is None else example,), dtype="fp8",
                           mode="train", plan_for="coverage", fp8_recipe="delayed")


def test_delayed_scaling_keeps_each_products_histories_in_the_state_dict_recording_in_train_mode_only():
    converted = _delayed()
    state = converted.state_dict()
    assert [k for k in state if "amax" in k] == HISTORIES
    assert [k for k in state if "amax" not in k] == list(_net().state_dict())  # the original's keys, in order
    assert not any(state[k].any() for k in HISTORIES)  # the conversion's own example runs left them empty
    for graph in (converted.train_graph, converted.eval_graph):
        graph.graph.lint()
    x, y = _data(1)[0]
    nn.functional.cross_entropy(converted(x).float(), y).backward()
    after = {k: v.clone() for k, v in converted.state_dict().items() if "amax" in k}
    assert all(v[0] > 0 and not v[1:].any() for v in after.values())  # one step: one input and one gradient range
    converted.eval()
    out = converted(x)
    assert torch.isfinite(out).all()
    out.float().sum().backward()  # an eval call with gradients records nothing either
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in after.items())
    report = amppass.report(converted)
    assert report.info["fp8"]["recipe"] == "delayed" and report.info["fp8"]["history"] == 16
    assert "delayed, from the largest of an amax history of the last 16" in report.info["fp8"]["scales"]
    evidence = {row.name: row.evidence["fp8"] for row in report.fp8_rows()}
    assert evidence["addmm"]["input_scale"] == evidence["addmm"]["gradient_scale"] == "delayed (amax history of 16)"
    copied = copy.deepcopy(converted).train()
    nn.functional.cross_entropy(copied(x).float(), y).backward()
    assert copied.state_dict()["mid.fp8_input_amax_history"][1] > 0  # the copy recorded into its own history
    assert all(torch.equal(converted.state_dict()[k], v) for k, v in after.items())


def test_an_outlier_batch_beyond_the_delayed_range_gives_finite_outputs_and_gradients():
    """After steps on ordinary batches, a batch 10^4 times larger: its values beyond the histories' range are
    clamped to e4m3's largest finite value (not NaN), and its ranges go into the histories."""
    converted = _delayed()
    data = _data(4)
    for x, y in data[:3]:
        nn.functional.cross_entropy(converted(x).float(), y).backward()
    before = converted.state_dict()["mid.fp8_input_amax_history"][0].clone()
    converted.zero_grad()
    out = converted(data[3][0] * 1e4)
    out.float().square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in converted.parameters())
    assert converted.state_dict()["mid.fp8_input_amax_history"][0] > 1e3 * before


def test_two_views_before_one_backward_under_torch_compile_train_as_in_eager_mode():
    """A contrastive step as sentence-transformers' ``MultipleNegativesRankingLoss`` makes it: anchors and positives
    through the same converted model, one loss over both, one backward, an optimizer step; compiled
    (``backend="aot_eager"``, ``fullgraph=True``) and in eager mode, three steps give the same losses and the same
    parameters and histories, bit for bit."""
    converted = _delayed()
    eager = copy.deepcopy(converted)
    compiled = torch.compile(converted, backend="aot_eager", fullgraph=True)
    optimizers = [torch.optim.AdamW(model.parameters(), lr=3e-3) for model in (converted, eager)]
    for x, _ in _data(3):
        losses = []
        for model, optimizer in zip((compiled, eager), optimizers, strict=True):
            anchors, positives = model(x + 0.1 * x.flip(0)).float(), model(2 * x).float()
            loss = nn.functional.cross_entropy(anchors @ positives.T, torch.arange(len(x)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    state = converted.state_dict()
    assert all(state[k][:6].all() and not state[k][6:].any() for k in HISTORIES)  # two records a step
    for key, value in eager.state_dict().items():
        assert torch.equal(state[key], value), key


def test_multiple_negatives_ranking_loss_over_a_compiled_fp8_bert_trains_as_in_eager_mode():
    """sentence-transformers' own ``MultipleNegativesRankingLoss`` over a small random BERT converted to fp8 delayed
    training: anchors' and positives' mean-pooled embeddings from two calls, one backward, an optimizer step;
    compiled (``backend="aot_eager"``, ``fullgraph=True``) and in eager mode, three steps give the same losses,
    parameters and histories, bit for bit."""
    losses = pytest.importorskip("sentence_transformers.sentence_transformer.losses")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)  # no dropout: each run draws its own masks
    generator = torch.Generator().manual_seed(1)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(5, 64, (4, 8), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    converted = amppass.convert(transformers.BertModel(config, add_pooling_layer=False).train(),
                                example_kwargs=batch(), dtype="fp8", mode="train", plan_for="coverage",
                                fp8_recipe="delayed")
    eager = copy.deepcopy(converted)
    compiled = torch.compile(converted, backend="aot_eager", fullgraph=True)
    loss_fn = losses.MultipleNegativesRankingLoss(nn.Module())  # only its loss over the embeddings is called
    optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3) for model in (converted, eager)]
    for _ in range(3):
        anchors, positives = batch(), batch()
        step = []
        for model, optimizer in zip((compiled, eager), optimizers, strict=True):
            embeddings = [model(**features)[0].float().mean(1) for features in (anchors, positives)]
            loss = loss_fn.compute_loss_from_embeddings(embeddings, torch.arange(4))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step.append(loss.item())
        assert step[0] == step[1]
    state = converted.state_dict()
    histories = [key for key in state if "amax_history" in key]
    assert histories and all(state[k][:6].all() and not state[k][6:].any() for k in histories)
    for key, value in eager.state_dict().items():
        assert torch.equal(state[key], value), key


def test_an_unknown_fp8_recipe_or_one_outside_fp8_training_is_refused_naming_it():
    with pytest.raises(InputError, match=r"fp8_recipe='tensorwise' is not one of \('dynamic', 'delayed'\)"):
        amppass.convert(_net(), (torch.randn(8, 32),), dtype="fp8", mode="train", plan_for="coverage",
                        fp8_recipe="tensorwise")
    with pytest.raises(InputError, match=r"fp8_recipe='delayed' applies to fp8 training only.*mode='train'"):
        amppass.convert(_net().eval(), (torch.randn(8, 32),), dtype="fp8", plan_for="coverage", fp8_recipe="delayed")


class Block(nn.Module):
    """Products whose inputs nothing else saves for backward (GELU saves its input, LayerNorm its input and
    statistics): what fp8 saves of them is all the input memory they cost."""

    def __init__(self):
        super().__init__()
        self.inp, self.mid, self.norm = nn.Linear(32, 64), nn.Linear(64, 64), nn.LayerNorm(64)
        self.proj, self.out = Conv1D(64, 128), nn.Linear(128, 16)

    def forward(self, x):
        h = self.mid(nn.functional.gelu(self.inp(x)))
        return self.out(nn.functional.gelu(self.proj(self.norm(h))))


@pytest.mark.parametrize("recipe", ["dynamic", "delayed"])
def test_fp8_training_saves_the_e4m3_input_for_backward(recipe):
    """Against the bf16 conversion, each fp8 product saves its input in e4m3 (1 byte an element, not 2) and no
    bf16 copy of its weight (the fp32 master is the parameter), at the cost of its input's scale (and, delayed,
    the gradient's delayed range): 4 bytes each. Bytes as the benchmark counts them (benchmarks/fp8_train.py): each
    storage once, the model's parameters and buffers left out (held anyway)."""
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    bf16 = amppass.convert(Block().train(), (x,), mode="train", plan_for="coverage")
    fp8 = amppass.convert(Block().train(), (x,), dtype="fp8", mode="train", plan_for="coverage", fp8_recipe=recipe)
    products = [n for n in fp8.train_graph.graph.nodes if n.target is FP8_OP]
    assert [n.name for n in products] == ["linear_1", "addmm"]
    sizes = {"linear_1": (64, 64), "addmm": (64, 128)}  # (in, out) of mid and proj
    expected = sum(len(x) * n_in * (2 - 1) + n_in * n_out * 2 - 4 * (1 + (recipe == "delayed"))
                   for n_in, n_out in sizes.values())
    assert saved_bytes(bf16, x) - saved_bytes(fp8, x) == expected
