"""A member of two ranks under torchrun (gloo on CPU) merges with a peer of one: the swarm sees one member that
trains on twice the batch, and every process of both ends with the same model. Restarted with one rank, the
member resumes from its checkpoint."""

import pytest

from tests.harness.swarm import islands_disagreeing, local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
BATCH, SEQ = 8, 64  # the harness's


def test_a_member_of_two_torchrun_ranks_merges_as_one_peer_with_twice_the_tokens_and_resumes_with_one(tmp_path):
    with local_swarm(tmp_path, "ranks") as swarm:
        swarm.start_peer("box", "-H", "5", "--max-rounds", "4", ranks=2)
        swarm.start_peer("laptop", "-H", "5", "--max-rounds", "4")
        swarm.wait_clean(["box", "laptop"], timeout=400)
        left_at = swarm.records("box", "summary")[-1].version
        swarm.start_peer("box", "-H", "5", "--max-rounds", "1")  # the same member, now one process
        swarm.wait_clean(["box"], timeout=200)
    restored = swarm.records("box", "restore")
    assert restored and restored[-1].version == left_at
    assert swarm.records("box", "round")[-1].version > left_at
    contributions = [c for c in swarm.records("box", "contribute") if c.time < restored[-1].time]
    assert contributions and all(c.tokens == 2 * BATCH * SEQ * c.steps for c in contributions)
    assert all(c.tokens == BATCH * SEQ * c.steps for c in swarm.records("laptop", "contribute"))
    merged = [r for r in swarm.records("box", "round") if r.applied and len(r.members) == 2]
    assert merged, swarm.records("box", "round")
    assert not islands_disagreeing(swarm, ["box", "laptop"])  # both members of each island hold one Θ
    # rank 1 trained every step rank 0 did, and left only once both held the same θ (else both exit non-zero)
    steps = swarm.records("box", "summary")[0].tokens // (2 * BATCH * SEQ)
    assert f"trained {steps} steps beside rank 0" in (swarm.log_dir / "box-rank1.log").read_text()
