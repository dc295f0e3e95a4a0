"""A sharded member's checkpoint keeps the inner optimizer's state as its ranks hold it: each rank writes its own
part (torch.distributed.checkpoint), so rank 0 never gathers the moments whole. The files go into the checkpoint
atomically with the rest and are verified on load; the same member resumes from them bit for bit, and a single
process re-shards them on load (resumes with fewer ranks)."""

import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from p2pdiloco.core.exact import digest
from p2pdiloco.training import checkpoint
from p2pdiloco.training.checkpoint import SHARDS, CheckpointError, RankShards, ToStage
from p2pdiloco.training.diloco import restore_trainer, trainer_checkpoint
from p2pdiloco.training.inner import InnerTrainer, flat_params, load_flat_params, optimizer_state
from p2pdiloco.training.model import build_model
from p2pdiloco.training.ranks import follow
from p2pdiloco.training.schedule import inner_lr
from p2pdiloco.training.sharded import whole_moments, written_by_every_rank
from tests.unit.test_ranks import CFG
from tests.unit.test_sharded import MEMBER, member_trainer, pairs, two_ranks

N = 64


def state(value: float) -> tuple[dict, dict]:
    meta = dict(version=1, inner_step=3, digest=None)
    tensors = {"global": torch.full((N,), value), "momentum": torch.zeros(N), "local": torch.full((N,), -value)}
    return meta, tensors


def written(value: float, folder: Path, meta: dict, tensors: dict) -> Path:
    moments = {"inner.0.exp_avg": torch.full((N,), value), "inner.0.step": torch.tensor(3.0)}
    meta = dict(meta, digest=digest(tensors["global"], tensors["momentum"]))
    entry = ToStage(lambda into: dcp.save(moments, checkpoint_id=into, no_dist=True))
    return checkpoint.save(folder, meta, dict(tensors, **{SHARDS: entry}), keep=3)


def test_the_ranks_files_go_into_the_checkpoint_whole_and_are_verified_on_load(tmp_path):
    older = written(1.0, tmp_path, *state(1.0))
    meta, tensors = state(2.0)
    newer = written(2.0, tmp_path, dict(meta, inner_step=4), tensors)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # staged, then moved in
    found = checkpoint.load_latest(tmp_path, N)
    assert found.path == newer and isinstance(found.tensors[SHARDS], RankShards)
    assert set(found.meta["shards_sha256"]) == {p.name for p in (newer / SHARDS).iterdir()}
    assert torch.equal(whole_moments(found.tensors[SHARDS].path, [(N,)])["inner.0.exp_avg"], torch.full((N,), 2.0))

    # a rank's file damaged: that checkpoint is skipped, the older one loads
    part = next(p for p in (newer / SHARDS).iterdir() if p.suffix == ".distcp")
    part.write_bytes(part.read_bytes()[:-8])
    reports = []
    assert checkpoint.load_latest(tmp_path, N, report=reports.append).path == older
    assert "hash mismatch" in reports[0]
    part.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        checkpoint.load_one(newer, N)

    # a checkpoint's own files (restored, not yet dealt out to the ranks) saved again are copied, not taken
    again = checkpoint.save(tmp_path, dict(state(1.0)[0], version=2, digest=digest(
        torch.full((N,), 1.0), torch.zeros(N))), dict(state(1.0)[1], **{SHARDS: RankShards(older / SHARDS)}))
    assert checkpoint.load_one(older, N).tensors[SHARDS].path == older / SHARDS
    assert torch.equal(whole_moments(again / SHARDS, [(N,)])["inner.0.exp_avg"], torch.full((N,), 1.0))


def test_ranks_that_fail_to_write_their_parts_leave_nothing_behind(tmp_path):
    def fail(into: Path) -> None:
        (into / "__0_0.distcp").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    meta, tensors = state(1.0)
    meta["digest"] = digest(tensors["global"], tensors["momentum"])
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space"):
        checkpoint.save(tmp_path, meta, dict(tensors, **{SHARDS: ToStage(fail)}))
    assert list(tmp_path.iterdir()) == []


def rank_main(rank: int, folder: str) -> None:
    os.environ["WORLD_SIZE"] = "2"
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    torch.set_num_threads(1)
    t, _ = member_trainer(rank, folder)
    if rank != 0:
        follow(t)
        return
    for _ in range(3):
        t.train_step()
    # a write the disk refuses (here: a folder under a file) fails on every rank alike: one error on rank 0, and
    # both ranks go on in step (rank 1 would otherwise die in follow(), or the next collective hang)
    (Path(folder) / "a-file").write_text("")
    try:
        t.lockstep.save_shards(t, Path(folder) / "a-file" / "shards")
    except checkpoint.CheckpointWriteError as e:
        Path(folder, "refused.txt").write_text(str(e))
    meta, tensors = trainer_checkpoint(t)
    assert isinstance(tensors[SHARDS], ToStage)
    staged = checkpoint.stage(tensors, Path(folder) / "checkpoints")[SHARDS]  # each rank writes its part
    gathered = {k: v.clone() for k, v in t.optimizer_state()[0].items()}  # whole (the step is the live tensor)
    saved = dict(theta=flat_params(t.model).clone(), scalars=meta["inner_scalars"], moments=gathered,
                 folder=str(staged.path))
    for _ in range(2):
        t.train_step()
    went_on = flat_params(t.model).clone()

    # back to step 3 from the files: each rank reads its own part at the next step
    load_flat_params(t.model, saved["theta"])
    t.theta_written()
    t.restore_optimizer_state({SHARDS: staged}, saved["scalars"], step=3)
    t.total_steps, t.batches.position = 3, 3
    for _ in range(2):
        t.train_step()
    resumed = flat_params(t.model).clone()

    # parts that pass the checkpoint's checks but that a rank cannot read (written wrong, or by another torch's
    # format): both ranks train on from θ with fresh moments, and rank 0 says so in one line
    cut = cut_short(Path(saved["folder"]), Path(folder) / "cut", "__1_0.distcp")
    lines = logged(Path(folder) / "afresh.log")
    t.restore_optimizer_state({SHARDS: RankShards(cut)}, saved["scalars"], step=3)
    t.train_step()
    step_after = float(t.optimizer_state()[0]["inner.0.step"])
    t.release_ranks()
    logging.getLogger("p2pdiloco").removeHandler(lines)
    torch.save(dict(saved, went_on=went_on, resumed=resumed, step_after=step_after, cut=str(cut)), f"{folder}/0.pt")


def cut_short(folder: Path, into: Path, name: str) -> Path:
    """A copy of a rank's files with `name` cut short under metadata that still reads."""
    shutil.copytree(folder, into)
    (into / name).write_bytes((into / name).read_bytes()[:16])
    return into


def logged(path: Path) -> logging.Handler:
    handler = logging.FileHandler(path)
    logging.getLogger("p2pdiloco").addHandler(handler)
    return handler


def test_a_sharded_member_writes_its_moments_a_file_per_rank_and_resumes_from_them_with_any_ranks(tmp_path):
    two_ranks(rank_main, tmp_path)
    zero = torch.load(tmp_path / "0.pt")
    folder = Path(zero["folder"])
    refused = (tmp_path / "refused.txt").read_text()
    assert "a rank could not write its part of the optimizer state" in refused and "\n" not in refused, refused

    # each rank wrote its own part, about half of the moments (a tensor's rows split in two)
    parts = sorted(p for p in folder.iterdir() if p.suffix == ".distcp")
    assert [p.name for p in parts] == ["__0_0.distcp", "__1_0.distcp"]
    whole_bytes = sum(v.numel() * v.element_size() for v in zero["moments"].values())
    assert all(p.stat().st_size <= 0.56 * whole_bytes for p in parts), ([p.stat().st_size for p in parts], whole_bytes)

    # read whole in one process, they are the moments rank 0 gathered, bit for bit
    whole = whole_moments(folder, [tuple(p.shape) for p in build_model("tiny", seed=0).parameters()])
    assert whole.keys() == zero["moments"].keys()
    assert all(torch.equal(whole[name], zero["moments"][name]) for name in whole)

    # the member resumed from them as it went on
    assert torch.equal(zero["resumed"], zero["went_on"])

    # and one process resumes from them too (re-sharded on load), as the member went on, over both ranks' batches
    alone = InnerTrainer(build_model("tiny", seed=5), pairs(3, 2), CFG, torch.device("cpu"))
    load_flat_params(alone.model, zero["theta"])
    alone.restore_optimizer_state({SHARDS: RankShards(folder)}, zero["scalars"], step=3)
    assert optimizer_state(alone.optimizer, alone.trained.parameters())[0].keys() == whole.keys()
    for step in (3, 4):
        alone.train_step(lr=inner_lr(CFG, step * MEMBER, MEMBER))
    assert torch.allclose(flat_params(alone.model), zero["went_on"], atol=1e-6)

    # the parts a rank could not read: the member trained on with fresh moments (AdamW's first step again), and
    # rank 0 said why in one line
    assert zero["step_after"] == 1.0, zero["step_after"]
    said = (tmp_path / "afresh.log").read_text().strip()
    assert "could not be read" in said and "moments start afresh" in said and "\n" not in said, said
    # and so does one process resuming from them: θ is the checkpoint's, the note says what was lost
    alone = InnerTrainer(build_model("tiny", seed=5), pairs(3, 2), CFG, torch.device("cpu"))
    meta = dict(inner_optimizer=CFG.optimizer, inner_scalars=zero["scalars"], inner_step=3)
    note = restore_trainer(alone, meta, {"local": zero["theta"], SHARDS: RankShards(Path(zero["cut"]))})
    assert "could not be read" in note and "start afresh" in note and not alone.optimizer.state, note
    assert torch.equal(flat_params(alone.model), zero["theta"]) and alone.total_steps == 3


def test_a_rank_whose_part_is_not_on_rank_0s_disk_fails_the_write_in_one_line(tmp_path):
    dcp.save({"inner.0.exp_avg": torch.ones(N)}, checkpoint_id=tmp_path, no_dist=True)  # one rank's file of two
    with pytest.raises(checkpoint.CheckpointWriteError, match="1 of the member's 2 ranks .* share the checkpoint"):
        written_by_every_rank(tmp_path, 2)
    written_by_every_rank(tmp_path, 1)


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_crafted_metadata_is_refused_in_one_line_and_runs_nothing(tmp_path):
    folder = tmp_path / "shards"
    dcp.save({"inner.0.exp_avg": torch.ones(N), "inner.0.step": torch.tensor(3.0)}, checkpoint_id=folder,
             no_dist=True)
    assert whole_moments(folder, [(N,)])["inner.0.step"] == 3.0  # the real thing reads

    with pytest.raises(CheckpointError, match="does not fit this model"):  # another model's: no tensor made
        whole_moments(folder, [(N + 1,)])
    with pytest.raises(CheckpointError, match="does not fit this model"):
        whole_moments(folder, [])

    real = (folder / ".metadata").read_bytes()
    metadata = pickle.loads(real)  # (ours, in the test)
    for info in metadata.storage_data.values():
        info.relative_path = "../elsewhere.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="outside its folder"):
        whole_moments(folder, [(N,)])

    (folder / ".metadata").write_bytes(real)
    part = next(folder.glob("*.distcp"))
    part.write_bytes(part.read_bytes()[:16])  # a file cut short under metadata that reads
    with pytest.raises(CheckpointError, match="could not be read"):
        whole_moments(folder, [(N,)])

    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match="unreadable metadata .*posix.system"):
        whole_moments(folder, [(N,)])
    assert not marker.exists()
