"""Checkpoints written off the training thread: it pays a copy of θ and the inner optimizer's state, and the file
holds the step it was taken at, whatever training (or a round) does while the writer works."""

import dataclasses
from types import SimpleNamespace

import torch

from p2pdiloco.config import PeerConfig
from p2pdiloco.parts.checkpoints import Checkpoints
from p2pdiloco.training import checkpoint
from tests.unit.test_restore_once import peer, steps


class Records:
    def __init__(self):
        self.written = []

    def write(self, record):
        self.written.append(record)


def checkpoints(folder, d, **flags) -> Checkpoints:
    data = SimpleNamespace(tokenizer_fingerprint="t", fingerprint="f",
                           tokenizer=SimpleNamespace(save_pretrained=lambda path: None))
    workload = SimpleNamespace(n_params=d.state.params.numel(), model_config=SimpleNamespace(to_dict=dict), data=data,
                               device=torch.device("cpu"))
    cfg = dataclasses.replace(PeerConfig(), checkpoint_dir=folder, **flags)
    return Checkpoints(cfg, workload, "p", Records())


def saved(c: Checkpoints, d):
    found = checkpoint.load_latest(c.folder, d.state.params.numel())
    return found.meta, found.tensors


def test_a_background_checkpoint_holds_the_step_it_was_taken_at_while_training_goes_on(tmp_path):
    d = peer()
    steps(d, 2)
    theta, c = d.local_params().clone(), checkpoints(tmp_path, d, checkpoint_background=True)
    with d.state.lock:  # the writer waits for Θ until training has moved on: it must not read θ live
        c.save(d, "timed")
        assert c.writing is not None
        steps(d, 3)
    c.collect(wait=True)
    meta, tensors = saved(c, d)
    assert meta["inner_step"] == 2 and torch.equal(tensors["local"], theta)
    assert not torch.equal(d.local_params(), theta)  # training did move on meanwhile
    assert [r.why for r in c.metrics.written] == ["timed"] and c.writing is None
    d.close()


def test_a_round_that_lands_before_the_writer_holds_theta_makes_it_write_again_at_the_next_step(tmp_path):
    """θ and the counters were copied at version 0; a Θ of version 1 beside them would resume wrongly."""
    d = peer()
    steps(d, 3)
    c = checkpoints(tmp_path, d, checkpoint_background=True)
    with d.state.lock:
        c.save(d, "timed")
        d.contribute()
        d.wait(10)  # the round lands: Θ changes
    c.collect(wait=True)
    assert d.state.version == 1
    assert checkpoint.list_checkpoints(c.folder) == [] and not list(c.folder.iterdir() if c.folder.exists() else [])
    assert c.metrics.written == [] and c.due()  # nothing reported as saved, and due again
    c.save(d, "timed", wait=True)
    meta, tensors = saved(c, d)
    assert meta["version"] == 1 and torch.equal(tensors["global"], d.state.params)
    d.close()


def test_written_inline_on_a_cpu_by_default_and_a_start_clears_what_a_killed_write_left(tmp_path):
    d = peer()
    steps(d, 2)
    c = checkpoints(tmp_path, d)
    assert not c.background and checkpoints(tmp_path, d, checkpoint_background=True).background
    c.save(d, "timed")
    assert c.writing is None and len(checkpoint.list_checkpoints(c.folder)) == 1
    cut = c.folder / ".tmp-killed"
    cut.mkdir()
    (cut / checkpoint.TENSORS).write_bytes(b"\0" * 1024)
    restarted = peer()
    checkpoints(tmp_path, restarted).resume(restarted)
    assert not cut.exists() and restarted.trainer.total_steps == 2
    for x in (d, restarted):
        x.close()


def test_ranks_that_cannot_stage_their_parts_are_one_logged_line_and_the_saved_checkpoints_stay(tmp_path, caplog):
    """A sharded member's ranks write their parts of the optimizer's state on the training thread, before the rest
    of the checkpoint: a disk that refuses them is the same one line as any refused write, nothing is left beside
    the checkpoints, and the next save goes through once the disk takes it again."""
    d = peer()
    steps(d, 2)
    c = checkpoints(tmp_path, d)
    c.save(d, "timed")
    kept = checkpoint.list_checkpoints(c.folder)
    moments = d.trainer.checkpoint_moments

    def refused(into):
        (into / "__0_0.distcp").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    d.trainer.checkpoint_moments = lambda: ({checkpoint.SHARDS: checkpoint.ToStage(refused)}, {})
    steps(d, 1)
    c.save(d, "timed")
    assert c.error and "No space left on device" in c.error and kept[0].name in c.error and "\n" not in c.error
    assert [r.message for r in caplog.records if r.levelname == "ERROR"] == [f"p: {c.error}"]
    assert checkpoint.list_checkpoints(c.folder) == kept and sorted(p.name for p in c.folder.iterdir()) == \
        sorted(p.name for p in kept)  # and no staged folder left
    assert [r.why for r in c.metrics.written] == ["timed"]

    d.trainer.checkpoint_moments = moments
    c.save(d, "timed")
    assert c.error is None and len(checkpoint.list_checkpoints(c.folder)) == 2
    d.close()
