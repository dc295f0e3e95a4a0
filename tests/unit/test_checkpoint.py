"""Checkpoints: atomic write, keep-K, verification, fallback past damaged ones."""

import pytest
import torch

from p2pdiloco.training import checkpoint
from p2pdiloco.core.exact import digest
from tests.harness.memory import PeakGrowth

N = 1000


def state(version: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed + version)
    tensors = {k: torch.randn(N, generator=g) for k in ("global", "momentum", "local")}
    meta = dict(version=version, inner_step=10 * version,
                digest=digest(torch.cat([tensors["global"], tensors["momentum"]])))
    return meta, tensors


def test_round_trip_and_only_the_newest_k_are_kept(tmp_path):
    for version in range(1, 6):
        checkpoint.save(tmp_path, *state(version), keep=3)
    kept = checkpoint.list_checkpoints(tmp_path)
    assert [p.name[:9] for p in kept] == ["v00000005", "v00000004", "v00000003"]
    found = checkpoint.load_latest(tmp_path, N)
    meta, tensors = state(5)
    assert found.meta["version"] == 5 and all(torch.equal(found.tensors[k], tensors[k]) for k in tensors)


def test_the_newest_metadata_is_read_without_its_tensors(tmp_path):
    """How a peer decides between a warm and a cold start before its helper processes fork."""
    assert checkpoint.latest_meta(tmp_path) is None
    checkpoint.save(tmp_path, *state(1))
    newest = checkpoint.save(tmp_path, *state(2))
    (newest / checkpoint.TENSORS).unlink()  # the tensors are not read
    assert checkpoint.latest_meta(tmp_path)["version"] == 2
    (newest / checkpoint.META).write_text("{not json")
    assert checkpoint.latest_meta(tmp_path) is None  # unreadable: a cold start, which falls back to version 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "missing"])
def test_damaged_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, damage):
    checkpoint.save(tmp_path, *state(1))
    newest = checkpoint.save(tmp_path, *state(2))
    tensors_file, meta_file = newest / checkpoint.TENSORS, newest / checkpoint.META
    if damage == "truncate":
        tensors_file.write_bytes(tensors_file.read_bytes()[:-100])
    elif damage == "flip":
        data = bytearray(tensors_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tensors_file.write_bytes(bytes(data))
    elif damage == "meta":
        meta_file.write_text("{not json")
    else:
        tensors_file.unlink()
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load_one(newest, N)
    assert str(newest) in str(e.value)
    reports = []
    found = checkpoint.load_latest(tmp_path, N, report=reports.append)
    assert found.meta["version"] == 1 and len(reports) == 1 and "damaged" in reports[0]
    assert newest.exists()  # nothing is deleted: the user can inspect it


def test_interrupted_write_leaves_the_previous_checkpoints_intact(tmp_path):
    checkpoint.save(tmp_path, *state(1))
    meta, tensors = state(2)
    tensors["bad"] = "not a tensor"  # fails inside the write, after the temporary folder exists
    with pytest.raises(Exception):
        checkpoint.save(tmp_path, meta, tensors)
    assert [p.name[:9] for p in checkpoint.list_checkpoints(tmp_path)] == ["v00000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    path = checkpoint.save(tmp_path, *state(1))
    with pytest.raises(checkpoint.CheckpointError, match="does not match this model"):
        checkpoint.load_one(path, N + 1)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (scripts/bench/gpu_checks.sh runs it)")


@pytest.mark.parametrize("optimizer, device", [("adamw", "cpu"), ("adamw8bit", "cpu"),
                                               pytest.param("adamw", "cuda", marks=CUDA),
                                               pytest.param("adamw8bit", "cuda", marks=CUDA)])
def test_a_peer_restored_from_disk_goes_on_exactly_where_it_stopped(tmp_path, optimizer, device):
    """Θ, momentum, version, θ, the inner optimizer's state (AdamW's moments, or bitsandbytes' 8-bit moments
    with their quantization maps and block maxima) and step, the data stream's position and the unmerged
    counters all survive the disk: the restored peer's next inner steps are bit-identical to the original's."""
    from p2pdiloco.config import InnerConfig
    from p2pdiloco.training.data import BatchStream
    from p2pdiloco.training.diloco import DiLoCo, SoloMerger
    from p2pdiloco.training.inner import InnerTrainer, flat_params
    from p2pdiloco.training.model import build_model
    from p2pdiloco.core.state import GlobalState

    text = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)

    def peer(stream_seed):
        model = build_model("tiny", seed=0).to(device)
        cfg = InnerConfig(steps=3, batch_size=4, seq_len=16, warmup_steps=5, optimizer=optimizer)
        trainer = InnerTrainer(model, BatchStream(text, 4, 16, seed=stream_seed), cfg, torch.device(device))
        return DiLoCo(trainer, GlobalState(flat_params(model), lr=0.7, momentum=0.9), SoloMerger(), "p", "p")

    original = peer(stream_seed=7)
    for _ in range(2):  # two merged rounds (momentum is non-zero), then two unmerged steps
        for _ in range(3):
            original.inner_step()
        original.contribute()
        original.wait(10)
    original.inner_step()
    original.inner_step()
    meta, tensors = original.checkpoint_state()
    meta.update(model="tiny", n_params=original.state.params.numel())
    checkpoint.save(tmp_path, meta, tensors)

    restored = peer(stream_seed=0)  # restarted under another peer id: the checkpoint's seed wins
    found = checkpoint.load_latest(tmp_path, original.state.params.numel())
    if optimizer == "adamw8bit":  # most of the state really is 8-bit (tensors under 4096 elements stay fp32)
        kept = [t for k, t in found.tensors.items() if k.endswith(".state1")]
        assert sum(t.numel() for t in kept if t.dtype == torch.uint8) > 0.9 * original.state.params.numel()
    assert restored.restore_checkpoint_state(found.meta, found.tensors) is None
    assert restored.state.key == original.state.key and restored.state.version == 2
    assert torch.equal(restored.state.outer.momentum_buffer, original.state.outer.momentum_buffer)
    assert (restored.unmerged_steps, restored.unmerged_tokens) == (2, original.unmerged_tokens)
    for _ in range(3):  # same batches, same AdamW moments and bias correction, same warm-up lr
        assert restored.inner_step()[0] == original.inner_step()[0]
    assert torch.equal(restored.local_params(), original.local_params())
    restored.contribute()
    original.contribute()
    assert torch.equal(restored.in_flight.contribution.delta, original.in_flight.contribution.delta)
    assert restored.in_flight.contribution.steps == 5
    for d in (original, restored):
        d.wait(10)
        d.close()
    assert restored.state.key == original.state.key


def test_a_checkpoint_written_before_inner_state_keeps_its_adamw_moments():
    """Format-1 checkpoints kept AdamW's moments as flat fp32 `adam.{i}.*` and no step: they must still
    restore, with the step taken from the checkpoint's inner step."""
    from p2pdiloco.config import InnerConfig
    from p2pdiloco.training.inner import make_optimizer, restore_optimizer_state

    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    old = {f"adam.{i}.{key}": torch.full((p.numel(),), float(i + 1)) for i, p in enumerate(params)
           for key in ("exp_avg", "exp_avg_sq")}
    optimizer = make_optimizer(params, InnerConfig())
    restore_optimizer_state(optimizer, params, old, {}, step=17)
    for i, p in enumerate(params):
        state = optimizer.state[p]
        assert float(state["step"]) == 17.0 and state["exp_avg"].shape == p.shape
        assert torch.equal(state["exp_avg_sq"], torch.full(p.shape, float(i + 1)))


def test_a_checkpoint_is_written_without_a_copy_of_the_model(tmp_path):
    """θ is written a parameter at a time and the inner optimizer's state from where it lives: the process's
    resident memory grows by far less than one model-sized vector while a checkpoint is made (a flat copy of θ
    alone would be 4 bytes per parameter; from a GPU, θ and AdamW's moments were copied to the host whole)."""
    from p2pdiloco.config import InnerConfig
    from p2pdiloco.core.state import GlobalState
    from p2pdiloco.training.diloco import DiLoCo, SoloMerger
    from p2pdiloco.training.inner import InnerTrainer, flat_params
    from p2pdiloco.training.model import build_model
    from tests.unit.test_decoupled import random_batches

    grew = PeakGrowth()
    model = build_model("base", seed=0)
    trainer = InnerTrainer(model, random_batches(0), InnerConfig(steps=1, batch_size=2, seq_len=8), torch.device("cpu"))
    d = DiLoCo(trainer, GlobalState(flat_params(model), lr=0.7, momentum=0.9), SoloMerger(), "p", "p")
    d.inner_step()  # AdamW's moments exist
    model_bytes = 4 * d.state.params.numel()
    with grew:
        meta, tensors = d.checkpoint_state()
        checkpoint.save(tmp_path, dict(meta, model="base"), tensors)
    assert grew.bytes < model_bytes / 4, f"peak grew by {grew.bytes / 1e6:.1f} MB ({model_bytes / 1e6:.1f} MB of θ)"
    found = checkpoint.load_latest(tmp_path, d.state.params.numel())
    assert torch.equal(found.tensors["local"], d.local_params())
