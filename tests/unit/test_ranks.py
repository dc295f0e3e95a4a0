"""One member of several ranks (torchrun): two processes on gloo train as one peer with twice the batch. Rank 0's
writes of θ between steps (a round's rebase) reach rank 1, every rank ends with the same θ, and a write rank 0 did
not announce is caught rather than trained on."""

import dataclasses
import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from p2pdiloco.config import InnerConfig
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model
from p2pdiloco.training.ranks import Ranks, RanksDiverged, Strided, follow
from p2pdiloco.training.schedule import inner_lr

TEXT = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
CFG = InnerConfig(steps=3, batch_size=4, seq_len=16, warmup_steps=5)
SEED = 7


def trainer(rank: int, world: int, cfg: InnerConfig = CFG) -> InnerTrainer:
    ranks = Ranks(rank, world) if world > 1 else None
    stream = BatchStream(TEXT, cfg.batch_size, cfg.seq_len, seed=SEED if rank == 0 else 0)  # rank 1 learns it
    batches = Strided(stream, ranks) if ranks else stream
    return InnerTrainer(build_model("tiny", seed=rank), batches, cfg, torch.device("cpu"), ranks=ranks)


def nudge(model) -> None:
    """What a round's rebase does to θ between two steps, as far as the other ranks can tell."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)


def rank_main(rank: int, folder: str, announce: bool, accumulate: int, fsdp: bool = False) -> None:
    os.environ["WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    t = trainer(rank, 2, dataclasses.replace(CFG, accumulate=accumulate, fsdp=fsdp))
    try:
        if rank == 0:
            for _ in range(3):
                t.train_step()
            nudge(t.model)
            if announce:
                t.theta_written()
            for _ in range(2):
                t.train_step()
            theta = flat_params(t.model)  # sharded, rank 0 gathers θ whole: while the group is still there
            t.release_ranks()
        else:
            follow(t)  # leaves the group when rank 0 does
            if fsdp:  # a sharded member's θ is read whole on rank 0 only
                return
            theta = flat_params(t.model)
    except RanksDiverged:
        open(f"{folder}/diverged{rank}", "w").close()
        return
    torch.save(dict(theta=theta, steps=t.total_steps, tokens=t.tokens_per_step), f"{folder}/{rank}.pt")


def run_ranks(folder, announce: bool, accumulate: int = 1, fsdp: bool = False) -> None:
    context = multiprocessing.get_context("fork")  # no group in this process: the children make their own
    procs = [context.Process(target=rank_main, args=(r, str(folder), announce, accumulate, fsdp)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0


@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_ranks_train_as_one_member_with_twice_the_batch_and_take_rank_0s_writes_of_theta(tmp_path, accumulate):
    """With --accumulate 2 as well, each rank sums two micro-batches (DDP averages only the last's gradients,
    no_sync before): the member's step is over four batches."""
    run_ranks(tmp_path, announce=True, accumulate=accumulate)
    zero, one = (torch.load(tmp_path / f"{r}.pt") for r in range(2))
    assert torch.equal(zero["theta"], one["theta"])  # rank 1 began from another init: it took rank 0's θ
    member = 2 * accumulate * CFG.batch_size * CFG.seq_len  # the schedule runs on the member's tokens per step
    assert zero["steps"] == one["steps"] == 5 and zero["tokens"] == member

    # the same five steps in one process over both ranks' batches (rank r's micro-batch s: batch 2s + r)
    alone = trainer(0, 1)
    stream = BatchStream(TEXT, CFG.batch_size, CFG.seq_len, seed=SEED)
    alone.batches = iter([tuple(torch.cat(parts) for parts in zip(*(next(stream) for _ in range(2 * accumulate))))
                          for _ in range(5)])
    for step in range(5):
        if step == 3:
            nudge(alone.model)
        alone.train_step(lr=inner_lr(CFG, step * member, member))
    assert torch.allclose(zero["theta"], flat_params(alone.model), atol=1e-6 if accumulate == 1 else 2e-5)


def test_a_sharded_member_accumulates_micro_batches_as_one_process_over_all_of_them(tmp_path):
    """--fsdp with --accumulate 2: each micro-batch's gradients are reduce-scattered and summed in the shards."""
    run_ranks(tmp_path, announce=True, accumulate=2, fsdp=True)
    zero = torch.load(tmp_path / "0.pt")
    alone = trainer(0, 1)
    stream = BatchStream(TEXT, CFG.batch_size, CFG.seq_len, seed=SEED)
    alone.batches = iter([tuple(torch.cat(parts) for parts in zip(*(next(stream) for _ in range(4))))
                          for _ in range(5)])
    member = 4 * CFG.batch_size * CFG.seq_len
    for step in range(5):
        if step == 3:
            nudge(alone.model)
        alone.train_step(lr=inner_lr(CFG, step * member, member))
    assert zero["steps"] == 5 and zero["tokens"] == member
    assert torch.allclose(zero["theta"], flat_params(alone.model), atol=2e-5)


def test_a_write_of_theta_that_rank_0_did_not_announce_stops_the_member(tmp_path):
    run_ranks(tmp_path, announce=False)
    assert (tmp_path / "diverged0").exists() and (tmp_path / "diverged1").exists()
    assert not (tmp_path / "0.pt").exists()
