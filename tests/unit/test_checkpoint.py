"""Checkpoints: atomic write, keep-K, verification, fallback past damaged ones."""

import pytest
import torch

from p2pdiloco import checkpoint
from p2pdiloco.exact import digest

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
