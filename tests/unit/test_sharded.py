"""A member of two ranks with --fsdp (FSDP2 on gloo): each rank holds half of θ and of the AdamW moments, yet the
member trains as one process would on both ranks' batches; rank 0 reads θ and the optimizer's state whole (its
copy of θ parked in a file, as --global-state-on-disk keeps it), its writes of θ reach the shards, and a checkpoint
a single process wrote resumes the member (re-sharded on load)."""

import dataclasses
import multiprocessing
import os
from pathlib import Path

import torch
import torch.distributed as dist

from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.inner import InnerTrainer, flat_params, load_flat_params, optimizer_state
from p2pdiloco.training.model import build_model
from p2pdiloco.training.parked import parked_parameters
from p2pdiloco.training.ranks import Ranks, Strided, follow
from p2pdiloco.training.schedule import inner_lr
from tests.unit.test_ranks import CFG, SEED, TEXT, nudge

SHARDED = dataclasses.replace(CFG, fsdp=True)
MEMBER = 2 * CFG.batch_size * CFG.seq_len  # the member's tokens per step: the schedule's clock


def member_trainer(rank: int, folder: str) -> tuple[InnerTrainer, object]:
    """Rank 0's mirror of θ parked in a file, as --global-state-on-disk parks it (parts.held)."""
    stream = BatchStream(TEXT, CFG.batch_size, CFG.seq_len, seed=SEED if rank == 0 else 0)  # rank 1 learns it
    ranks, model = Ranks(rank, 2), build_model("tiny", seed=rank)
    parked = parked_parameters(model, Path(folder) / "park") if rank == 0 else None
    return InnerTrainer(model, Strided(stream, ranks), SHARDED, torch.device("cpu"), ranks=ranks,
                        let_go_of_model=parked.let_go if parked else lambda: None), parked


def pairs(first: int, count: int):
    """What the member's steps first … first+count−1 read, as one process's batches: step s is batches 2s, 2s+1."""
    stream = BatchStream(TEXT, CFG.batch_size, CFG.seq_len, seed=SEED)
    stream.position = 2 * first
    return iter([tuple(torch.cat(parts) for parts in zip(*(next(stream) for _ in range(2)))) for _ in range(count)])


def rank_main(rank: int, folder: str) -> None:
    os.environ["WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    t, parked = member_trainer(rank, folder)
    held = dict(theta=sum(p.to_local().numel() for p in t.trained.parameters()))
    if rank != 0:
        follow(t)
        held["moments"] = sum(s["exp_avg"].to_local().numel() for s in t.optimizer.state.values())
        torch.save(held, f"{folder}/held{rank}.pt")
        return
    for _ in range(3):
        t.train_step()
    nudge(t.model)  # what a round's rebase does to θ
    t.theta_written()
    for _ in range(2):
        t.train_step()
    trained = dict(theta=flat_params(t.model).clone(), moments=t.optimizer_state()[0])
    held["moments"] = sum(s["exp_avg"].to_local().numel() for s in t.optimizer.state.values())
    # a restart from what a single process saved (another θ, other moments) at the member's step 5
    saved = torch.load(f"{folder}/saved.pt")
    load_flat_params(t.model, saved["theta"])
    t.theta_written()
    t.restore_optimizer_state(saved["moments"], saved["scalars"], step=5)
    t.total_steps = 5
    t.train_step()
    held["mirror_resident"] = parked.resident_bytes()  # the shards took the restored θ: its pages went
    t.train_step()
    resumed = flat_params(t.model).clone()
    t.release_ranks()
    torch.save(dict(trained=trained, resumed=resumed, steps=t.total_steps, n=resumed.numel(), **held),
               f"{folder}/0.pt")


def two_ranks(rank_main, folder, timeout: float = 180) -> None:
    """`rank_main(rank, folder)` in two processes, forked (no group in this process: the children make their own),
    each of which must exit 0."""
    context = multiprocessing.get_context("fork")
    procs = [context.Process(target=rank_main, args=(r, str(folder))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0


def one_process() -> InnerTrainer:
    return InnerTrainer(build_model("tiny", seed=0), iter(()), CFG, torch.device("cpu"))


def test_a_sharded_member_holds_half_of_theta_per_rank_and_trains_resumes_as_one_process_would(tmp_path):
    # a single process's checkpoint at step 5 (trained on other data: nothing like the member's state)
    other = InnerTrainer(build_model("tiny", seed=3), BatchStream(TEXT, 2 * CFG.batch_size, CFG.seq_len, seed=11),
                         CFG, torch.device("cpu"))
    for _ in range(5):
        other.train_step()
    moments, scalars = optimizer_state(other.optimizer, other.trained.parameters())
    torch.save(dict(theta=flat_params(other.model), moments=moments, scalars=scalars), tmp_path / "saved.pt")

    two_ranks(rank_main, tmp_path)
    zero, one = torch.load(tmp_path / "0.pt"), torch.load(tmp_path / "held1.pt")

    # each rank holds about half of θ and of the moments (a tensor's rows split in two)
    assert zero["theta"] + one["theta"] == zero["n"] and max(zero["theta"], one["theta"]) <= 0.52 * zero["n"]
    assert zero["moments"] + one["moments"] == zero["n"] and max(zero["moments"], one["moments"]) <= 0.52 * zero["n"]
    assert zero["mirror_resident"] <= 0.05 * 4 * zero["n"]  # rank 0's parked θ, once the shards took it

    # the same five steps in one process over both ranks' batches, with the same write of θ after the third
    alone = one_process()
    alone.batches = pairs(0, 5)
    for step in range(5):
        if step == 3:
            nudge(alone.model)
        alone.train_step(lr=inner_lr(CFG, step * MEMBER, MEMBER))
    assert torch.allclose(zero["trained"]["theta"], flat_params(alone.model), atol=1e-6)
    whole, _ = optimizer_state(alone.optimizer, alone.trained.parameters())
    assert whole.keys() == zero["trained"]["moments"].keys()
    for name, value in whole.items():  # rank 0 read the moments whole, as one process holds them
        assert torch.allclose(zero["trained"]["moments"][name], value, atol=1e-7), name

    # resumed from the single process's checkpoint: the member's next two steps are the single process's
    for step in (5, 6):
        other.batches = pairs(step, 1)
        other.train_step(lr=inner_lr(CFG, step * MEMBER, MEMBER))
    assert zero["steps"] == 7
    assert torch.allclose(zero["resumed"], flat_params(other.model), atol=1e-6)
