"""The train-mode converted model as the original's module tree: module hooks, checkpoints, memory.

Quick, single-process checks; ``tests/serving/test_tree_fsdp.py`` (slow) runs FSDP2 and DDP on two processes.
"""

from __future__ import annotations

import collections
import copy
import gc
import io
import itertools
import pickle
import weakref

import pytest
import torch
from torch import nn

import amppass
from amppass.errors import InputError
from amppass.serving.fp32_original import keep_original
from models.char_gpt import char_gpt, next_char_loss, stdlib_corpus, train_steps

BATCH, BLOCK = 4, 16

# deep copies of a converted model copy torch's pytree specs, which trips torch's own deprecation notice
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated:FutureWarning")


def _gpt(dropout: float = 0.0) -> nn.Module:
    return char_gpt(layers=2, width=32, heads=2, block=BLOCK, dropout=dropout)


def _batch(seed: int) -> torch.Tensor:
    return stdlib_corpus(100_000).batch(torch.Generator().manual_seed(seed), BATCH, BLOCK)


def _convert(model: nn.Module, dtype=torch.float16) -> nn.Module:
    return amppass.convert(model, (_batch(0)[:, :-1],), dtype=dtype, mode="train", plan_for="coverage")


@pytest.fixture(scope="module")
def original() -> nn.Module:
    return _gpt()


@pytest.fixture(scope="module")
def converted(original) -> nn.Module:
    return _convert(original)


# ---------------------------------------------------------------- module calls, as FSDP2 needs them


def test_blocks_are_called_as_modules_and_read_their_parameters_at_call_time(converted):
    """FSDP2 swaps a block's parameters in its pre-forward hook: the block must be called, and read them then."""
    block = converted.transformer.h[0]
    calls, x = [], _batch(1)[:, :-1]
    scaled = nn.Parameter(block.ln_1.weight.detach() * 3)

    def swap(module, args):
        calls.append(module.training)
        module.ln_1._parameters["weight"], swap.kept = scaled, module.ln_1._parameters["weight"]

    def restore(module, args, output):
        module.ln_1._parameters["weight"] = swap.kept

    handles = [block.register_forward_pre_hook(swap), block.register_forward_hook(restore)]
    try:
        converted.eval()
        with torch.no_grad():
            swapped = converted(x).logits
        handles += []
    finally:
        for handle in handles:
            handle.remove()
    with torch.no_grad():
        plain = converted(x).logits
        block.ln_1.weight.mul_(3)
        expected = converted(x).logits
        block.ln_1.weight.div_(3)
    converted.train()
    assert calls == [False]
    assert not torch.equal(swapped, plain)
    torch.testing.assert_close(swapped, expected)


def test_eval_reads_parameters_replaced_on_the_modules(converted):
    """FSDP2 (and load_state_dict(assign=True)) put new tensor objects on the modules: eval must read them."""
    model, x = copy.deepcopy(converted), _batch(2)[:, :-1]
    head = model.transformer.h[1].mlp.c_proj
    head.weight = nn.Parameter(torch.zeros_like(head.weight))
    head.bias = nn.Parameter(torch.zeros_like(head.bias))
    reference = _gpt()
    reference.load_state_dict(model.state_dict())
    model.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=2e-2, atol=2e-2)
    assert model.outlined


def test_parts_are_instances_of_the_original_classes_with_their_plain_attributes(original, converted):
    """Wrap policies pick modules by class (``isinstance(m, Block)``, accelerate's class names): every module
    of the converted tree is an instance of its original's class, under its name, holding no tensor twice."""
    for name, module in original.named_modules():
        part = converted.get_submodule(name) if name else None
        if part is None:
            continue
        assert isinstance(part, type(module)) and type(part).__name__ == type(module).__name__, name
        leaked = [k for k, v in vars(part).items() if isinstance(v, torch.Tensor)]
        assert not leaked, (name, leaked)
    assert converted.lm_head.in_features == original.lm_head.in_features
    assert isinstance(converted.transformer.h, nn.ModuleList) and len(converted.transformer.h) == 2
    assert [type(b) for b in converted.transformer.h] == [type(converted.transformer.h[0])] * 2
    first = converted.transformer.h[:1]  # a slice: the same parts in a plain container
    assert type(first) is nn.ModuleList and first[0] is converted.transformer.h[0] and converted.transformer.h[-1]


def test_init_by_class_reaches_the_tensors_the_graphs_read(original, converted):
    """``model.apply(init)`` with isinstance checks (how training scripts initialise) changes what the
    converted model computes exactly as it changes the original."""

    def init(module):
        if isinstance(module, nn.LayerNorm):
            nn.init.constant_(module.weight, 0.5)
            nn.init.constant_(module.bias, 0.1)

    model, reference, x = copy.deepcopy(converted), copy.deepcopy(original), _batch(3)[:, :-1]
    model.apply(init), reference.apply(init)
    model.eval(), reference.eval()
    with torch.no_grad():
        ours, theirs, before = model(x).logits, reference(x).logits, original.eval()(x).logits
    original.train()
    assert not torch.allclose(theirs, before, atol=1e-2)
    torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


def _saved_and_grads(model, batch) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd saved for one step's backward, and the gradients by parameter name."""
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = next_char_loss(model(batch[:, :-1]).logits, batch[:, 1:])
    loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}
    return sum(saved), grads


def test_activation_checkpointing_by_class_wraps_the_blocks_keeping_gradients_and_checkpoint_keys(original, converted):
    """torch's ``apply_activation_checkpointing(check_fn=isinstance ...)``, the usual companion of FSDP2, finds
    the converted blocks: less is saved for backward, gradients are the same, state_dict keys the original's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    block = type(original.transformer.h[0])
    wrapped = copy.deepcopy(converted)
    apply_activation_checkpointing(wrapped, check_fn=lambda module: isinstance(module, block))
    assert all(isinstance(b, CheckpointWrapper) for b in wrapped.transformer.h)
    batch = _batch(4)
    plain_bytes, plain = _saved_and_grads(converted, batch)
    wrapped_bytes, grads = _saved_and_grads(wrapped, batch)
    assert wrapped_bytes < 0.7 * plain_bytes, (wrapped_bytes, plain_bytes)
    assert list(grads) == list(plain)
    for name in plain:
        torch.testing.assert_close(grads[name], plain[name], rtol=0, atol=0)
    assert list(wrapped.state_dict()) == list(original.state_dict())


def test_a_batch_of_one_runs_its_later_plan_in_the_module_tree(original):
    """The capture keeps batches of 1 apart (``size()[0] != 1``): such a call gets a later plan, which runs
    in the same module tree, so hooks (FSDP2's) fire and gradients reach the tree's parameters."""
    converted, x = _convert(original), _batch(5)
    calls = []
    converted.transformer.h[1].register_forward_pre_hook(lambda module, args: calls.append(module.training))
    reference = copy.deepcopy(original)
    for rows in (1, 1):  # the second call reuses the plan outlined by the first
        converted.zero_grad(), reference.zero_grad()
        next_char_loss(converted(x[:rows, :-1]).logits, x[:rows, 1:]).backward()
        next_char_loss(reference(x[:rows, :-1]).logits, x[:rows, 1:]).backward()
        for (name, ours), theirs in zip(converted.named_parameters(), reference.parameters(), strict=False):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=5e-2, atol=5e-3, msg=name)
    assert calls == [True, True] and converted._made == 1


def test_between_calls_only_the_tree_holds_the_state(converted):
    """The flat graphs hold meta-device stand-ins, so after FSDP2 replaces the tree's parameters by shards
    nothing else keeps the whole ones alive; a deep copy, ``.to()`` and ``load_state_dict`` keep it so."""
    model = copy.deepcopy(converted).to(torch.float64).to(torch.float32)
    model.load_state_dict(converted.state_dict())
    for graph in (model.train_graph, model.eval_graph):
        assert all(t.is_meta for t in itertools.chain(graph.parameters(), graph.buffers()))
    assert not any(t.is_meta for t in model.parameters())
    x = _batch(6)[:, :-1]
    model.eval(), converted.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, converted(x).logits)
    converted.train()


# ---------------------------------------------------------------- checkpoints


def test_state_dict_and_parameter_names_are_the_originals_tied_weights_included(original, converted):
    assert list(converted.state_dict()) == list(original.state_dict())
    assert [n for n, _ in converted.named_parameters()] == [n for n, _ in original.named_parameters()]
    assert [n for n, _ in converted.named_buffers()] == [n for n, _ in original.named_buffers()]
    assert converted.transformer.wte.weight is converted.lm_head.weight
    original.load_state_dict(converted.state_dict(), strict=True)  # writes checkpoints the original loads
    converted.load_state_dict(original.state_dict(), strict=True)  # and loads the original's


def test_loading_with_assign_keeps_tied_weights_tied(original, converted):
    model = copy.deepcopy(converted)
    state = {k: v.clone() for k, v in _gpt().state_dict().items()}  # two tensors for the tied pair
    model.load_state_dict(state, assign=True)
    assert model.transformer.wte.weight is model.lm_head.weight
    assert len(list(model.parameters())) == len(list(original.parameters()))


def _steps(model, opt, scaler, seeds) -> list[float]:
    return train_steps(model, [_batch(seed) for seed in seeds], opt, scaler)


def test_a_training_checkpoint_resumes_bit_identically():
    """Model, AdamW and LossScaler state (and the RNG, for dropout) saved mid-run, loaded into a new model."""
    converted = _convert(_gpt(dropout=0.1))

    def fresh():
        model = copy.deepcopy(converted)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), amppass.LossScaler(init_scale=2.0**12)

    torch.manual_seed(5)
    model, opt, scaler = fresh()
    straight = _steps(model, opt, scaler, range(6))
    final = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(5)
    model, opt, scaler = fresh()
    first = _steps(model, opt, scaler, range(3))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "scaler": scaler.state_dict(),
                "rng": torch.get_rng_state()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    model, opt, scaler = fresh()
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    scaler.load_state_dict(checkpoint["scaler"])
    torch.set_rng_state(checkpoint["rng"])
    resumed = first + _steps(model, opt, scaler, range(3, 6))
    assert resumed == straight
    for key, value in model.state_dict().items():
        assert torch.equal(value, final[key]), key


# ---------------------------------------------------------------- memory


def _saved_bytes(run) -> dict[torch.dtype, int]:
    """Bytes autograd holds for backward after one forward, each storage counted once, by dtype."""
    seen: dict[int, tuple[torch.dtype, int]] = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = (tensor.dtype, tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    by_dtype: dict[torch.dtype, int] = collections.Counter()
    for dtype, size in seen.values():
        by_dtype[dtype] += size
    return by_dtype


def test_fp16_training_saves_no_more_for_backward_than_autocast(original, converted):
    x = torch.randint(0, 128, (8, BLOCK))
    with torch.autocast("cpu", dtype=torch.float16):
        autocast = _saved_bytes(lambda: original(x).logits)
    ours = _saved_bytes(lambda: converted(x).logits)
    assert sum(ours.values()) <= sum(autocast.values()), (ours, autocast)


def test_gpt2_tanh_gelu_runs_low_as_one_op_with_the_reason_and_saved_bytes_in_the_report(converted):
    report = amppass.report(converted)
    gelus = [r for r in report.rows if r.op == "aten.gelu"]
    assert len(gelus) == 2 and all(r.precision == "fp16" for r in gelus)
    assert all("tanh approximation" in r.evidence["fused"] and r.evidence["saved_bytes"] > 0 for r in gelus)
    assert not [r for r in report.rows if r.op in ("aten.pow", "aten.tanh")]
    backward = report.info["backward"]
    assert backward["saved_bytes"] == sum(backward["saved_bytes_by_dtype"].values()) > 0


def test_what_users_read_names_the_fusion_and_the_bytes_saved_for_backward(converted):
    """The terminal table and the HTML page show reasons and the summary, not evidence: the fused GELU's
    reason says it replaced the model's own ops, and the summary gives the bytes saved for backward."""
    report = amppass.report(converted)
    gelus = [r for r in report.rows if r.op == "aten.gelu"]
    assert gelus and all("tanh approximation written out as" in r.reason for r in gelus)
    saved = report.info["backward"]["saved_bytes"]
    assert f"saved for backward by one forward on the example: {saved:,} bytes (" in report.summary()
    page = report.to_html()
    assert "tanh approximation written out as" in page and "saved for backward" in page


def test_fused_gelu_computes_what_the_written_out_chain_computes(original, converted):
    x = _batch(3)[:, :-1]
    converted.eval(), original.eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(x).logits, original(x).logits, rtol=1e-2, atol=1e-2)
    converted.train(), original.train()


def test_drop_original_releases_the_callers_model_and_its_weights():
    def convert():
        model = _gpt()
        return _convert(model), weakref.ref(model), [weakref.ref(p) for p in model.parameters()]

    converted, model, params = convert()
    gc.collect()
    assert model() is not None  # held for conversions of new shapes
    converted.drop_original()
    gc.collect()
    assert model() is None and all(p() is None for p in params)


@pytest.mark.parametrize("kind", ["inference", "kept", "traced"])
def test_every_converted_module_has_drop_original(kind):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(2, 8)
    if kind == "kept":
        converted = keep_original(model, {"whole_model": {}})
    elif kind == "traced":  # no example inputs: symbolically traced
        converted = amppass.convert(model, dtype=torch.bfloat16)
        assert isinstance(converted, torch.fx.GraphModule) and amppass.report(converted).rows
    else:
        converted = amppass.convert(model, (x,), dtype=torch.bfloat16, plan_for="coverage")
    ref = weakref.ref(model)
    del model
    converted.drop_original()
    gc.collect()
    assert ref() is None
    assert converted(x).shape == (2, 8)


def test_copy_copy_shares_the_state_and_pickling_names_the_checkpoint_fix(tmp_path):
    """copy.copy went through __reduce__ and raised the torch.save message."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).train()
    x = torch.randn(4, 8)
    converted = amppass.convert(original, (x,), dtype=torch.bfloat16, mode="train", plan_for="coverage")
    shallow = copy.copy(converted)
    assert shallow is not converted and type(shallow) is type(converted) and shallow.training
    assert shallow[0].weight is converted[0].weight  # shared, as copy.copy of any nn.Module shares them
    torch.testing.assert_close(shallow(x), converted(x), rtol=0, atol=0)
    shallow(x).sum().backward()
    assert converted[0].weight.grad is not None
    for save in (pickle.dumps, lambda m: torch.save(m, tmp_path / "m.pt")):
        with pytest.raises(InputError, match=r"torch.save/pickle cannot pickle") as caught:
            save(converted)
        assert "torch.save(model.state_dict(), path)" in str(caught.value) and "copy.deepcopy" in str(caught.value)


class _SelfNamed(nn.Module):
    """transformers' BertAttention: a submodule called ``self``, then one that reads its output."""

    def __init__(self):
        super().__init__()
        self.self = nn.Linear(16, 16)
        self.output = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))

    def forward(self, x):
        return self.output(self.self(x))


def test_a_submodule_called_self_runs_in_the_outlined_tree():
    """The unflattened parent's code named the submodule's result ``self``, rebinding its own ``self``: every
    call of a converted BERT in train mode raised AttributeError ('Tensor' object has no attribute 'output')."""
    torch.manual_seed(0)
    original = nn.Sequential(nn.Linear(8, 16), _SelfNamed(), nn.Linear(16, 4)).train()
    x = torch.randn(4, 8)
    converted = amppass.convert(original, (x,), dtype=torch.bfloat16, mode="train", plan_for="coverage")
    assert converted.outlined
    for mode in (True, False):
        original.train(mode), converted.train(mode)
        ours, theirs = converted(x), original(x)
        assert torch.allclose(ours, theirs, rtol=0.05, atol=0.05), (mode, (ours - theirs).abs().max())
    converted.train()
    converted(x).sum().backward()
    assert converted[1].self.weight.grad is not None


class _WithFlag(nn.Module):
    """A model taking a non-tensor keyword, as decoders take ``use_cache=False``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2)])

    def forward(self, x, use_cache: bool = True):
        for block in self.blocks:
            x = x + block(x)
        return x * 2 if use_cache else x


def test_a_non_tensor_keyword_input_does_not_cost_the_module_tree():
    """Export bakes ``use_cache=False`` in as a constant, so the re-export has one input fewer than the
    capture's guards: that was taken for "a dimension became fixed", and a Llama ran as one graph, so
    FSDP2 could not wrap its blocks."""
    torch.manual_seed(0)
    original = _WithFlag().train()
    x = torch.randn(4, 16)
    converted = amppass.convert(original, (x,), example_kwargs={"use_cache": False}, dtype=torch.bfloat16,
                                mode="train", plan_for="coverage")
    assert converted.outlined
    calls = []
    converted.blocks[1].register_forward_pre_hook(lambda module, args: calls.append(1))
    out = converted(x, use_cache=False)
    assert calls == [1] and torch.allclose(out, original(x, use_cache=False), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_decoder_whose_rewrite_holds_constants_trains_and_evaluates_in_the_outlined_tree(name):
    """Export lifts the constants the rewrite made inside attention to buffers of the unflattened block; the
    tree did not hold them, so a converted Llama in train mode raised AttributeError ('lifted_tensor_0') on
    its first call."""
    from tests.helpers.decoders import decoder, prompt

    torch.manual_seed(0)
    original = decoder(name).train()
    ids = prompt(length=12, batch=2)
    converted = amppass.convert(original, (ids,), dtype=torch.bfloat16, mode="train", plan_for="coverage")
    assert converted.outlined
    logits = converted(ids).logits
    next_char_loss(logits[:, :-1], ids[:, 1:]).backward()
    assert all(p.grad is not None for p in converted.parameters())
    converted.eval(), original.eval()
    with torch.no_grad():
        ours, theirs = converted(ids).logits, original(ids).logits
    original.train()
    assert (ours - theirs).norm() <= 2e-2 * theirs.norm(), (ours - theirs).norm() / theirs.norm()


def test_transformers_gradient_checkpointing_set_before_converting_still_recomputes():
    """``gradient_checkpointing_enable()`` on the original: the parts are instances of its decoder-layer class
    and hold its flag, so transformers' own checkpointing wraps them: less is saved, gradients are the same."""
    from tests.helpers.decoders import decoder, prompt

    ids = prompt(length=8, batch=2)
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        original = decoder("llama").train()
        if checkpointing:
            original.gradient_checkpointing_enable()
        model = amppass.convert(original, (ids,), dtype=torch.bfloat16, mode="train", plan_for="coverage")
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t, saved=saved: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
            logits = model(ids).logits
        logits.float().sum().backward()
        results.append((sum(saved), {n: p.grad for n, p in model.named_parameters()}))
    (plain, grads), (checkpointed, again) = results
    assert checkpointed < 0.6 * plain, (checkpointed, plain)
    for name, grad in grads.items():
        torch.testing.assert_close(again[name], grad, rtol=0, atol=0)


class CachedBias(nn.Module):
    """timm's LeViT and EfficientFormer attention: eval calls cache a tensor per device in a dict, and the class's
    own ``train()`` reads the dict to empty it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bias = nn.Parameter(torch.zeros(8))
        self.bias_cache: dict[str, torch.Tensor] = {}

    def train(self, mode: bool = True):
        super().train(mode)
        if mode and self.bias_cache:
            self.bias_cache = {}
        return self

    def forward(self, x):
        if self.training:
            return self.fc(x) + self.bias
        key = str(x.device)
        if key not in self.bias_cache:
            self.bias_cache[key] = self.bias * 1
        return self.fc(x) + self.bias_cache[key]


def test_a_cache_of_tensors_comes_as_an_empty_cache_the_class_refills():
    model = nn.Sequential(CachedBias(), nn.ReLU(), nn.Linear(8, 2)).train()
    model.eval()(torch.randn(4, 8))  # the original's cache now holds a tensor
    model.train()
    model[0].bias_cache["cpu"] = torch.ones(8)
    fast = amppass.convert(model, (torch.randn(4, 8),), "bf16", mode="train", plan_for="coverage")
    part = fast[0]
    assert isinstance(part, CachedBias) and part.bias_cache == {}  # its own, empty: never the original's tensors
    fast.eval()(torch.randn(4, 8))
    fast.train()  # the class's own train() reads the cache
    fast(torch.randn(4, 8)).sum().backward()
    assert model[0].bias_cache["cpu"].equal(torch.ones(8))
