"""A restarted peer never counts its work twice. Its newest checkpoint can be older than its last contribution:
that contribution carried the checkpoint's unmerged progress, and the island may have merged it after the peer
died. Restored, the peer must not rebase that progress onto a state that holds it already."""

import torch

from p2pdiloco.config import InnerConfig
from p2pdiloco.core.state import GlobalState, member_tag
from p2pdiloco.training import checkpoint
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.diloco import DiLoCo, SoloMerger
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model

TEXT = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def peer() -> DiLoCo:
    model = build_model("tiny", seed=0)
    cfg = InnerConfig(steps=3, batch_size=4, seq_len=16, warmup_steps=5)
    trainer = InnerTrainer(model, BatchStream(TEXT, 4, 16, seed=7), cfg, torch.device("cpu"))
    return DiLoCo(trainer, GlobalState(flat_params(model), lr=0.7, momentum=0.9), SoloMerger(), "p", "p")


def steps(d: DiLoCo, n: int) -> None:
    for _ in range(n):
        d.inner_step()


def save(d: DiLoCo, folder) -> None:
    meta, tensors = d.checkpoint_state()
    meta.update(model="tiny", n_params=d.state.params.numel())
    checkpoint.save(folder, meta, tensors)


def restore(folder) -> DiLoCo:
    d = peer()
    found = checkpoint.load_latest(folder, d.state.params.numel())
    d.restore_checkpoint_state(found.meta, found.tensors, checkpoint.last_contribution(folder))
    return d


def swarm_state(d: DiLoCo):
    """What a resync downloads from a live peer: the metadata and tensors of its global state."""
    metadata, tensors = d.state.snapshot()
    return metadata, [t.clone() for t in tensors]


def saved_then_contributed(folder) -> DiLoCo:
    """A peer at v1 saves with two unmerged steps, trains one more, and contributes all three from v1 (noted as
    a peer notes it): its checkpoint is older than its last contribution."""
    original = peer()
    steps(original, 3)
    original.contribute()
    original.wait(10)  # v1
    steps(original, 2)
    save(original, folder)
    steps(original, 1)
    original.contribute()
    checkpoint.note_contribution(folder, original.in_flight.contribution, original.trainer.total_steps)
    return original


def test_a_peer_killed_after_its_island_merged_what_its_checkpoint_holds_does_not_count_it_again(tmp_path):
    original = saved_then_contributed(tmp_path)
    original.wait(10)  # the island merges it (v2); the peer dies before its next checkpoint
    restored = restore(tmp_path)
    assert (restored.state.version, restored.unmerged_steps) == (1, 2)
    restored.adopt(*swarm_state(original))  # the restart's resync to the swarm's v2
    assert restored.state.key == original.state.key
    assert torch.equal(restored.local_params(), restored.state.params)  # nothing of the merged steps again
    assert restored.unmerged_steps == 0 and restored.unmerged_tokens == 0
    original.close()
    restored.close()


def others_merged_without_it(d: DiLoCo, merges: int):
    """The swarm's state after the others merged `merges` times from d's Θ, without d's contribution."""
    metadata, tensors = d.state.snapshot()
    others = GlobalState(tensors[0], lr=0.7, momentum=0.9)
    others.load(metadata, tensors)
    for _ in range(merges):
        others.apply(torch.full_like(tensors[0], 1e-3), ["q", "r"])
    metadata, tensors = others.snapshot()
    return metadata, [t.clone() for t in tensors]


def test_a_peer_killed_with_its_contribution_in_flight_counts_it_merged_if_the_swarms_state_names_it(tmp_path):
    """Its last life could not log the merge: the restart reads the members of the state's merges, and counts the
    contribution's inner-step seconds as merged (goodput), once; θ gives the steps up as before."""
    original = saved_then_contributed(tmp_path)
    seconds = original.in_flight.contribution.seconds
    original.wait(10)  # merged at v2, by an island naming "p"
    restored = restore(tmp_path)
    assert restored.merged_seconds == 0.0 and restored.unsettled["seconds"] == seconds > 0
    assert restored.state.merges == [(1, [member_tag("p")])]  # its checkpoint kept the merges its state named
    restored.adopt(*swarm_state(original))
    assert restored.merged_seconds == seconds and restored.unmerged_steps == 0
    assert torch.equal(restored.local_params(), restored.state.params)
    original.close()
    restored.close()


def test_a_merge_its_last_life_saw_and_counted_is_not_counted_again_on_restart(tmp_path):
    """Killed after its round merged but before its next checkpoint: the merge is noted beside the contribution
    (as the peer's round handler does, on a commit only), and the restart gives the steps up without counting
    their seconds a second time."""
    import dataclasses
    from types import SimpleNamespace

    from p2pdiloco.config import PeerConfig
    from p2pdiloco.parts.checkpoints import Checkpoints
    from p2pdiloco.protocol.outcomes import RolledBack

    checkpoints = Checkpoints(dataclasses.replace(PeerConfig(), checkpoint_dir=tmp_path),
                              SimpleNamespace(device=torch.device("cpu")), "p", None)
    folder = checkpoints.folder
    original = saved_then_contributed(folder)
    settled = original.wait(10)  # merged, and counted merged by this life
    checkpoints.note_merged(SimpleNamespace(outcome=RolledBack(reason="a failed round")))
    assert not checkpoint.last_contribution(folder).get("merged")
    checkpoints.note_merged(settled)
    assert checkpoint.last_contribution(folder)["merged"] is True
    restored = restore(folder)
    assert restored.unsettled["seconds"] == 0.0
    restored.adopt(*swarm_state(original))
    assert restored.merged_seconds == 0.0 and restored.unmerged_steps == 0
    assert torch.equal(restored.local_params(), restored.state.params)
    original.close()
    restored.close()


def test_a_peer_killed_with_its_contribution_in_flight_keeps_its_steps_if_two_merges_since_left_it_out(tmp_path):
    """Its island failed with it, and the others merged twice without it: the restart rebases what its checkpoint
    holds onto the swarm's state and contributes it again, once. One merge past is not enough to tell (that island
    may still be settling a fork): it is given up, as before."""
    original = saved_then_contributed(tmp_path)
    original.wait(10)
    at_v1 = restore(tmp_path)  # its Θ is the v1 the contribution left from
    saved = checkpoint.load_latest(tmp_path, at_v1.state.params.numel()).tensors
    progress = saved["local"] - saved["global"]
    for merges, kept in ((2, True), (1, False)):
        restored = restore(tmp_path)
        restored.adopt(*others_merged_without_it(at_v1, merges))
        assert restored.state.version == 1 + merges and restored.unsettled is None
        assert restored.unmerged_steps == (2 if kept else 0) and restored.merged_seconds == 0.0
        moved = restored.local_params() - restored.state.params
        assert torch.allclose(moved, progress if kept else torch.zeros_like(moved), atol=1e-6)
        if kept:
            steps(restored, 1)
            restored.contribute()
            assert restored.in_flight.contribution.steps == 3  # the checkpoint's two and one new, once
            restored.wait(10)
        restored.close()
    original.close()
    at_v1.close()


def test_a_peer_whose_last_contribution_was_not_merged_keeps_what_its_checkpoint_holds(tmp_path):
    original = saved_then_contributed(tmp_path)
    # killed with the round in flight; its island failed: the swarm is still at v1
    restored = restore(tmp_path)
    saved = checkpoint.load_latest(tmp_path, restored.state.params.numel()).tensors
    assert (restored.state.version, restored.unmerged_steps) == (1, 2)
    assert torch.equal(restored.local_params(), saved["local"])
    steps(restored, 1)
    restored.contribute()
    assert restored.in_flight.contribution.steps == 3  # the restored steps are contributed, once
    restored.wait(10)
    original.wait(10)
    original.close()
    restored.close()


def test_a_checkpoint_newer_than_the_last_contribution_is_whole(tmp_path):
    """The usual case: the contribution's outcome was applied before the checkpoint; a resync rebases the
    checkpoint's unmerged steps, which no island has seen."""
    original = peer()
    steps(original, 3)
    original.contribute()
    checkpoint.note_contribution(tmp_path, original.in_flight.contribution, original.trainer.total_steps)
    original.wait(10)
    steps(original, 2)
    save(original, tmp_path)
    restored = restore(tmp_path)
    assert restored.unsettled is None and restored.unmerged_steps == 2
    original.close()
    restored.close()


def test_a_checkpoint_written_with_a_round_in_flight_is_given_up_only_if_the_swarm_is_past_it(tmp_path):
    """--checkpoint-seconds writes while a round is in flight: θ then holds what the round carries and the steps
    since. Restored where the swarm went past the round's version (it may hold the round), all of it is given up;
    where it did not, all of it is contributed, once."""
    original = peer()
    steps(original, 3)
    original.contribute()
    original.wait(10)  # v1
    steps(original, 3)
    original.contribute()  # from v1, in flight ...
    steps(original, 1)
    assert original.can_checkpoint
    save(original, tmp_path)  # ... while we save
    original.wait(10)  # v2: it merged
    merged = restore(tmp_path)
    assert merged.unsettled["version"] == 1 and merged.unmerged_steps == 4
    merged.adopt(*swarm_state(original))
    assert torch.equal(merged.local_params(), merged.state.params) and merged.unmerged_steps == 0
    kept = restore(tmp_path)  # the island failed and nobody else merged: the swarm is at v1
    kept.contribute()
    assert kept.in_flight.contribution.steps == 4 and kept.unsettled is None
    for d in (original, merged, kept):
        d.wait(10)
        d.close()


def test_timed_checkpoints_by_default_take_under_2_percent_of_the_time_and_follow_the_flags(tmp_path):
    import dataclasses

    from p2pdiloco.config import PeerConfig
    from p2pdiloco.config import CHECKPOINT_FACTOR, CHECKPOINT_FLOOR
    from p2pdiloco.parts.checkpoints import Checkpoints

    def timed(**flags):
        from types import SimpleNamespace

        return Checkpoints(dataclasses.replace(PeerConfig(), checkpoint_dir=tmp_path, **flags),
                           SimpleNamespace(device=torch.device("cpu")), "p", None)

    default = timed()
    assert default.timed and default.interval() == CHECKPOINT_FLOOR == 30.0
    default.write_seconds = 4.0  # a large model's write: every 4 minutes, 1/60 of the time
    assert default.interval() == 240.0 and 1 / CHECKPOINT_FACTOR < 0.02
    assert not default.due()  # counted from the start
    default.saved_at -= 241.0
    assert default.due()
    assert not timed(checkpoint_every=0).timed  # "never" stays never
    assert timed(checkpoint_every=0, checkpoint_seconds=5.0).interval() == 5.0
    assert not timed(checkpoint_seconds=0.0).timed


def test_a_peer_that_left_with_its_round_in_flight_gives_its_steps_up_if_the_swarm_merged_past_it(tmp_path):
    """Leaving within its bound, a peer abandons the round in flight and saves: should that island still merge,
    its next start must not contribute the same steps again."""
    original = peer()
    steps(original, 3)
    original.contribute()
    original.wait(10)  # v1
    steps(original, 3)
    original.contribute()
    original.wait(10)
    finished = swarm_state(original)  # what the island made of it: v2 ...
    leaving = restore_at_v1_with_the_round_abandoned(tmp_path)
    assert leaving.unsettled["version"] == 1 and leaving.unmerged_steps == 3
    leaving.adopt(*finished)  # ... which the swarm holds when it comes back
    assert torch.equal(leaving.local_params(), leaving.state.params) and leaving.unmerged_steps == 0
    original.close()
    leaving.close()


def restore_at_v1_with_the_round_abandoned(folder) -> DiLoCo:
    """The same peer's twin, which abandoned its round from v1 while leaving and saved, then came back."""
    twin = peer()
    steps(twin, 3)
    twin.contribute()
    twin.wait(10)
    steps(twin, 3)
    twin.contribute()
    twin.abandon()
    save(twin, folder)
    twin.close()
    return restore(folder)
