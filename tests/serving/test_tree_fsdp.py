"""A train-mode converted model under FSDP2 and DDP: two CPU processes (gloo) against one process.

``fully_shard`` on each block and then on the root (FSDP2's usual pattern), ``fully_shard`` on the root
only, and DistributedDataParallel each train the same converted fp16 GPT on halves of the batches one
process trains on whole, the last a batch of 1 per rank (a later plan, outlined into the module tree);
afterwards the held-out loss in eval mode must equal the single process's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import amppass
from models.char_gpt import char_gpt, held_out_loss, stdlib_corpus, train_steps
from tests.helpers.ddp_harness import WORLD_SIZE, run_ranks

STEPS, BATCH, BLOCK = 6, 8, 32
TIMEOUT_S = 400  # a run takes ~20 s on a quiet machine (a conversion and three trainings per rank)


def _model():
    net = char_gpt(layers=2, width=64, heads=4, block=BLOCK, dropout=0.0)
    return amppass.convert(net, (_batches()[0][:, :-1],), dtype=torch.float16, mode="train", plan_for="coverage")


def _batches() -> list[torch.Tensor]:
    """STEPS training batches, a last short one (a row per rank: each rank's batch of 1 is a shape the example's
    plan does not take), and one held-out batch, of BLOCK + 1 characters of the standard library's source."""
    corpus, generator = stdlib_corpus(200_000), torch.Generator().manual_seed(0)
    return ([corpus.batch(generator, BATCH, BLOCK) for _ in range(STEPS)] + [corpus.batch(generator, WORLD_SIZE, BLOCK)]
            + [corpus.batch(generator, 4 * BATCH, BLOCK, True)])


def _held_out(model) -> float:
    return held_out_loss(model, _batches()[-1])


def _train(model, rank: int | None) -> dict:
    """STEPS AdamW steps with LossScaler on this rank's half of each batch (the whole batch with no rank)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    scaler = amppass.LossScaler(init_scale=2.0**10)
    before = _held_out(model)
    train_steps(model, _batches()[:-1], opt, scaler, None if rank is None else (rank, WORLD_SIZE))
    return {"before": before, "after": _held_out(model)}


def _per_block(model):
    """FSDP2's usual pattern, blocks picked by class as wrap policies pick them."""
    blocks = [m for m in model.modules() if type(m).__name__ == "GPT2Block" and isinstance(m, GPT2Block)]
    assert len(blocks) == 2
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _unsharded_bytes(model) -> int:
    """Bytes of parameters held whole besides FSDP2's shards: by the flat graphs or anywhere in the tree."""
    from torch.distributed.tensor import DTensor

    held = [t for graph in (model.train_graph, model.eval_graph) for t in graph.parameters()] + list(model.parameters())
    return sum(t.numel() * t.element_size() for t in held if not t.is_meta and not isinstance(t, DTensor))


def _low_params(model) -> dict:
    """FSDP2 asked to gather fp16 parameters itself: refused, the plan's fp32 ops need fp32 weights."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    for block in model.transformer.h:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    try:
        model(_batches()[0][:, :-1])
    except amppass.InputError as err:
        return {"refused": str(err)}
    return {"refused": None}


def _rank_results(rank: int) -> dict:
    torch.set_num_threads(1)
    converted = _model()
    runs = {"fsdp2 per block": _per_block, "fsdp2 root only": fully_shard, "ddp": DistributedDataParallel}
    results, unsharded, checkpoint = {}, None, None
    for name, wrap in runs.items():
        model = wrap(copy.deepcopy(converted))
        if name == "fsdp2 per block":
            unsharded = _unsharded_bytes(model)
        results[name] = _train(model, rank)
        if name == "fsdp2 per block":
            checkpoint = _into_the_original(model, rank)
    return {**results, "fsdp2 fp16 params": _low_params(converted), "unsharded bytes": unsharded,
            "checkpoint": checkpoint}


def _into_the_original(model, rank: int) -> dict | None:
    """FSDP2's checkpoint path (torch.distributed.checkpoint's full state dict, gathered to rank 0) loaded
    strictly into a plain, unconverted model of the original's class: its keys and its fp32 held-out loss."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    plain = char_gpt(layers=2, width=64, heads=4, block=BLOCK, dropout=0.0)
    plain.load_state_dict(full, strict=True)
    return {"keys": list(full), "expected keys": list(plain.state_dict()), "held out": _held_out(plain)}


@pytest.fixture(scope="module")
def single() -> dict:
    return _train(_model(), None)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_rank_results, tmp_path_factory.mktemp("fsdp_train"), TIMEOUT_S)


@pytest.mark.parametrize("run", ["fsdp2 per block", "fsdp2 root only", "ddp"])
def test_sharded_training_matches_one_process_and_eval_reads_the_trained_weights(single, ranks, run):
    assert single["after"] < single["before"] - 0.1  # it learned something
    for rank in ranks:
        assert rank[run]["before"] == pytest.approx(single["before"], rel=1e-4)
        assert rank[run]["after"] == pytest.approx(single["after"], rel=2e-3), (run, rank[run], single)


def test_fsdp2_casting_parameters_itself_is_refused_with_what_to_do(ranks):
    for rank in ranks:
        refused = rank["fsdp2 fp16 params"]["refused"]
        assert refused and "param_dtype=torch.float16" in refused and "leave param_dtype unset" in refused


def test_sharding_leaves_no_whole_parameters_alive_on_a_rank(ranks):
    """The flat graphs pointed at the parameters FSDP2 replaced kept the whole model alive on every rank."""
    for rank in ranks:
        assert rank["unsharded bytes"] == 0


def test_fsdp2_s_full_checkpoint_loads_into_the_original_class(ranks):
    """``get_model_state_dict(full_state_dict=True)``, FSDP2's usual checkpoint, has the original's keys and
    loads strictly into an unconverted model, which then computes in fp32 what the converted one learned."""
    found = ranks[0]["checkpoint"]
    assert sorted(found["keys"]) == sorted(found["expected keys"])
    assert found["held out"] == pytest.approx(ranks[0]["fsdp2 per block"]["after"], rel=5e-3)
