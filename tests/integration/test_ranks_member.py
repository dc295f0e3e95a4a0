"""A member of two ranks under torchrun (gloo on CPU) merges with a peer of one: the swarm sees one member that
trains on twice the batch, and every process of both ends with the same model (DDP). Relaunched with its model
sharded over the ranks (--fsdp), the member resumes from its checkpoint. A restart with another number of ranks,
and a sharded member's own checkpoint (a file per rank), are tests/unit/test_sharded.py's and test_rank_shards.py's."""

import os
import signal
import time
from pathlib import Path

import pytest

from p2pdiloco.runtime.lifeline import descendants
from tests.harness.swarm import islands_disagreeing, local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
BATCH, SEQ = 8, 64  # the harness's


def test_a_member_of_two_torchrun_ranks_merges_as_one_peer_with_twice_the_tokens_and_resumes_sharded(tmp_path):
    with local_swarm(tmp_path, "ranks") as swarm:
        # quorum 2: torchrun starts slower than a lone process, and the box's first rounds would otherwise merge
        # alone before the laptop is up (seen in CI: all 4 solo)
        swarm.start_peer("box", "-H", "5", "--max-rounds", "4", "--quorum", "2", ranks=2)
        swarm.start_peer("laptop", "-H", "5", "--max-rounds", "4", "--quorum", "2")
        swarm.wait_clean(["box", "laptop"], timeout=400)
        left_at = swarm.records("box", "summary")[-1].version
        # the same member again, launched by `join --nproc 2` (which becomes torchrun), its model now sharded over
        # its ranks (FSDP2) and rank 0's θ parked: the DDP checkpoint's whole θ and moments are dealt out to the
        # shards, and its leaving checkpoint gathers them
        swarm.start_peer("box", "-H", "5", "--max-rounds", "1", "--fsdp", "--global-state-on-disk", "--nproc", "2")
        swarm.wait_clean(["box"], timeout=200)
    restored = swarm.records("box", "restore")
    assert restored and restored[-1].version == left_at
    assert swarm.records("box", "round")[-1].version > left_at
    assert [c.why for c in swarm.records("box", "checkpoint") if c.time > restored[-1].time][-1] == "leaving"
    # the sharded member's checkpoints keep the moments as its ranks hold them: a file each (rank 0 never gathers
    # them), the whole of θ and Θ beside them
    saved = Path(swarm.records("box", "checkpoint")[-1].path)
    assert sorted(p.name for p in (saved / "inner-shards").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    contributions = swarm.records("box", "contribute")
    assert contributions[-1].time > restored[-1].time  # one of the sharded member's
    assert all(c.tokens == 2 * BATCH * SEQ * c.steps for c in contributions)
    assert all(c.tokens == BATCH * SEQ * c.steps for c in swarm.records("laptop", "contribute"))
    merged = [r for r in swarm.records("box", "round") if r.applied and len(r.members) == 2]
    assert merged, swarm.records("box", "round")
    assert not islands_disagreeing(swarm, ["box", "laptop"])  # both members of each island hold one Θ
    # rank 1 trained every step rank 0 did (it left only once both held the same θ, else both exit non-zero), then
    # held half of θ in the second launch
    steps = swarm.records("box", "summary")[0].tokens // (2 * BATCH * SEQ)
    follower_log = (swarm.log_dir / "box-rank1.log").read_text()
    assert f"trained {steps} steps beside rank 0" in follower_log
    assert "(FSDP2)" in follower_log.split(f"trained {steps} steps beside rank 0")[1]


def rank_process(launcher_pid: int, rank: int) -> int:
    """The pid of one rank among torchrun's children (by the RANK it was given)."""
    for pid in descendants(launcher_pid):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} under {launcher_pid}")


# opt-in (about 90 s): a rank's death ends its member as any peer's death does; tests/unit/test_ranks.py covers the
# lockstep, and test_kill_loss.py a peer killed mid-round and restarted from its checkpoint
@pytest.mark.slow
def test_a_rank_killed_mid_round_ends_its_member_and_a_new_launch_resumes_it_from_its_checkpoint(tmp_path):
    args = ["-H", "5", "--max-time", "240", "--checkpoint-every", "1"]
    with local_swarm(tmp_path, "rankkill") as swarm:
        box = swarm.start_peer("box", *args, ranks=2)
        swarm.start_peer("laptop", *args)
        swarm.wait_for(lambda: any(r.applied and len(r.members) == 2 for r in swarm.records("box", "round")), 150,
                       "box and laptop to merge")
        count = len(swarm.records("box", "contribute"))
        swarm.wait_for(lambda: len(swarm.records("box", "contribute")) > count, 60, "box's next contribution")
        os.kill(rank_process(box.pid, 1), signal.SIGKILL)  # its round is in flight
        killed = time.time()
        box.wait(60)  # rank 0 fails at its next collective, and torchrun ends the member
        assert box.returncode != 0
        box = swarm.start_peer("box", *args, ranks=2)  # its supervisor launches it again
        swarm.wait_for(lambda: [r for r in swarm.records("box", "restore") if r.time > killed], 120,
                       "the member to resume from its checkpoint")
        swarm.wait_for(lambda: any(r.applied and len(r.members) == 2 and r.time > killed
                                   for r in swarm.records("box", "round")), 150, "box to merge again")
        for name in ("box", "laptop"):
            swarm.procs[name].send_signal(signal.SIGTERM)
        swarm.wait(["box", "laptop"], timeout=90)
    assert not islands_disagreeing(swarm, ["box", "laptop"])  # no island ended a round split by the death
    assert swarm.procs["laptop"].returncode == 0
    # SIGTERM to torchrun: rank 0 left as a peer does (torchrun itself exits 1, re-raising the signal)
    assert [r.why for r in swarm.records("box", "checkpoint")][-1] == "leaving" and swarm.records("box", "summary")
