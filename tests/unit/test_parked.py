"""Θ and the outer momentum parked in a file (`--global-state-on-disk`): the same bits, out of memory between uses."""

import dataclasses
import errno
import logging
import mmap
import os

import torch

from p2pdiloco.config import InnerConfig, PeerConfig
from p2pdiloco.core.consensus import sketch
from p2pdiloco.core.state import GlobalState
from p2pdiloco.parts.workload import parking_folder, parks_global_state
from p2pdiloco.runtime.paging import machine_memory_bytes
from p2pdiloco.training import checkpoint
from p2pdiloco.training.diloco import DiLoCo, SoloMerger
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model
from p2pdiloco.training.parked import Held, Parked, global_vectors
from tests.harness.memory import PeakGrowth
from tests.unit.test_decoupled import random_batches

MB = 1 << 20


def test_parked_vectors_keep_their_values_and_leave_the_process_when_paged_out(tmp_path):
    n = 4 * MB  # 16 MB per vector
    parked = Parked(n, tmp_path)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing to clean up, even after a kill
    assert torch.count_nonzero(parked.momentum) == 0  # the outer momentum starts at zero
    parked.theta.copy_(torch.arange(n, dtype=torch.float32))
    parked.momentum.fill_(0.5)
    assert parked.resident_bytes() >= 2 * 4 * n  # written: in memory
    parked.let_go()
    assert parked.resident_bytes() < MB
    assert torch.equal(parked.theta, torch.arange(n, dtype=torch.float32))  # read back from the page cache
    assert parked.resident_bytes() >= 4 * n  # Θ is back, the momentum is not
    assert bool((parked.momentum == 0.5).all())
    parked.let_go()
    parked.theta[:].add_(1)  # both back in memory, then a range of each let go: whole pages inside it only
    parked.momentum.add_(1)
    parked.let_go(slice(1000, n - 1000))
    assert 0 < parked.resident_bytes() <= 4 * mmap.PAGESIZE
    assert torch.equal(parked.theta, torch.arange(n, dtype=torch.float32) + 1)
    assert bool((parked.momentum == 1.5).all())


def make_peer(storage: str, folder, model_name: str = "tiny"):
    model = build_model(model_name, seed=0)
    trainer = InnerTrainer(model, random_batches(0), InnerConfig(steps=3, batch_size=4, seq_len=16, warmup_steps=0),
                           torch.device("cpu"))
    vectors = global_vectors(sum(p.numel() for p in model.parameters()), folder if storage == "parked" else None)
    theta = flat_params(model, out=vectors.theta)
    state = GlobalState(theta, lr=0.7, momentum=0.9, storage=(theta, vectors.momentum), let_go=vectors.let_go)
    return DiLoCo(trainer, state, SoloMerger(), "me", "me"), vectors


def test_a_peer_whose_global_state_is_parked_trains_bit_for_bit_like_one_holding_it(tmp_path):
    """Θ and the momentum are paged out a part at a time as each pass over them (Δ, the rebase, the outer step)
    goes, so they are never all in memory at once; they stay those of a peer holding them, and so does θ."""
    held, in_memory = make_peer("memory", tmp_path)
    parked, vectors = make_peer("parked", tmp_path)
    assert isinstance(in_memory, Held) and isinstance(vectors, Parked)
    assert parked.state.params.data_ptr() == vectors.theta.data_ptr()  # Θ lives in the file, not in a copy
    for _ in range(3):
        for d in (held, parked):
            for _ in range(3):
                d.inner_step()
            d.contribute()
        assert vectors.resident_bytes() < MB / 2  # Δ made (what is left: pages two small tensors share)
        for d in (held, parked):
            d.wait(10)
        assert vectors.resident_bytes() < MB / 2  # θ rebased, the outer step applied, θ rebased again
    assert parked.state.version == 3 and parked.state.key == held.state.key
    assert torch.count_nonzero(parked.state.outer.momentum_buffer) > 0
    assert torch.equal(parked.local_params(), held.local_params())


def test_the_passes_after_a_round_hold_a_chunk_of_a_parked_state_at_a_time(tmp_path):
    """After a round the peer hashes Θ and the momentum (the digest), sketches Θ and may checkpoint both: each
    pass lets every chunk go once done, so the peer's peak resident memory grows by a chunk, not by the 8 bytes
    per parameter of the two vectors (the round's end was a GPU peer's peak before: 2.5 GB of host memory for
    the 100M model against 1.3 GB while training)."""
    grew = PeakGrowth()
    d, vectors = make_peer("parked", tmp_path, "base")  # 11 M parameters: 89 MB of Θ and momentum, 6 chunks
    d.inner_step()
    d.contribute()
    d.wait(10)  # a round: the momentum is not zero
    mapped = 2 * 4 * d.state.params.numel()
    held = []
    let_go = d.state.let_go
    d.state.let_go = lambda part: (held.append(vectors.resident_bytes()), let_go(part))
    sketch(d.state.params, let_go=d.state.let_go)
    assert len(held) > 5 and max(held) < mapped / 8  # Θ sketched a chunk at a time
    d.state.let_go = let_go
    vectors.let_go()
    with grew:
        d.state._digest = None  # hashed again, as after every round
        assert d.state.digest
        meta, tensors = d.checkpoint_state()
        checkpoint.save(tmp_path / "checkpoints", dict(meta, model="base"), tensors)
    assert grew.bytes < mapped / 3, f"peak grew by {grew.bytes / MB:.0f} MB ({mapped / MB:.0f} MB parked)"
    found = checkpoint.load_latest(tmp_path / "checkpoints", d.state.params.numel())
    assert torch.equal(found.tensors["momentum"], d.state.outer.momentum_buffer)


def test_a_folder_that_cannot_hold_the_state_keeps_it_in_memory_and_says_so(tmp_path, caplog, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with caplog.at_level(logging.WARNING):
        assert isinstance(global_vectors(1000, not_a_folder), Held)
    assert "stays in memory" in caplog.text

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)  # a full disk, found before any page is written
    vectors = global_vectors(1000, tmp_path / "state")
    assert isinstance(vectors, Held) and torch.count_nonzero(vectors.momentum) == 0
    assert list((tmp_path / "state").iterdir()) == []


def test_evaluating_a_parked_global_state_lets_each_modules_pages_go_once_it_ran(tmp_path):
    """The validation of Θ reads it in place through views; on a parked state each module's slice is paged out
    once the module has run, so at most a block's pages are in the process at once. Before, the whole of Θ
    came in and stayed until the next pass (4 B/param: a `large` peer's peak, as it left after its final
    evaluation). The loss is that of Θ held in memory, bit for bit."""
    from p2pdiloco.training.inner import evaluate

    held, _ = make_peer("memory", tmp_path, "base")
    parked, vectors = make_peer("parked", tmp_path, "base")
    vectors.let_go()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g))
               for _ in range(2)]
    most = [0]
    parked.trainer.model.register_forward_hook(lambda *_: most.__setitem__(0, max(most[0], vectors.resident_bytes())))
    for block in parked.trainer.model.modules():  # sampled after every module, before its pages go
        block.register_forward_pre_hook(lambda *_: most.__setitem__(0, max(most[0], vectors.resident_bytes())))
    theta_bytes = 4 * parked.state.params.numel()
    loss = evaluate(parked.trainer.model, batches, torch.device("cpu"), params=parked.state.params,
                    let_go=parked.state.let_go)
    assert loss == evaluate(held.trainer.model, batches, torch.device("cpu"), params=held.state.params)
    assert most[0] < theta_bytes / 4, f"{most[0] / MB:.0f} MB of Θ's {theta_bytes / MB:.0f} MB resident at once"
    assert vectors.resident_bytes() < theta_bytes / 4


def test_the_state_is_parked_by_default_only_where_it_is_large_for_the_machine():
    gb = 1 << 30
    assert parks_global_state(None, 1_000_000_000, 1, 24 * gb)  # a 1B model's 8 GB on a volunteer's 24 GB
    assert not parks_global_state(None, 1_000_000_000, 1, 256 * gb)  # a server holds it without a thought
    assert not parks_global_state(None, 10_000_000, 1, 24 * gb)  # the demo's: no disk traffic for 80 MB
    assert parks_global_state(None, 210_000_000, 1, 24 * gb) and not parks_global_state(None, 190_000_000, 1, 24 * gb)
    assert not parks_global_state(None, 1_000_000_000, 8, 24 * gb)  # fragments do not run on it yet
    assert parks_global_state(True, 10_000_000, 1, 256 * gb) and not parks_global_state(False, 10**9, 1, gb)


def test_the_machines_memory_is_its_containers_limit_where_that_is_lower(tmp_path):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = tmp_path / "memory.max"
    assert machine_memory_bytes(tmp_path / "absent") == physical
    limit.write_text("max\n")  # cgroup v2: no limit
    assert machine_memory_bytes(limit) == physical
    limit.write_text(f"{1 << 30}\n")
    assert machine_memory_bytes(limit) == min(physical, 1 << 30)
    limit.write_text(f"{physical * 2}\n")
    assert machine_memory_bytes(limit) == physical


def test_a_peers_parking_folder_follows_the_default_and_the_flag(tmp_path):
    cfg = PeerConfig(checkpoint_dir=tmp_path)
    run = tmp_path / cfg.swarm.run_id
    assert parking_folder(cfg, 1000) is None
    assert parking_folder(cfg, 10**13) == run  # 80 TB of state: larger than a sixteenth of any machine here
    assert parking_folder(cfg.replace(global_state_on_disk=False), 10**13) is None
    assert parking_folder(cfg.replace(global_state_on_disk=True), 1000) == run
    streamed = cfg.replace(swarm=dataclasses.replace(cfg.swarm, fragments=2))
    assert parking_folder(streamed, 10**13) is None
