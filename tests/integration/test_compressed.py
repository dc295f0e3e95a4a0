"""Compressed rounds (packed int4 codes over p2pdiloco's own reduce-scatter) stay exact and verified: a member
killed mid-round makes the others roll back. (Members ending bitwise equal with ~1/8 of a fp32 all-reduce's bytes:
test_swarm's test_three_peers_stay_bitwise_equal_and_learn[int4].)"""

import pytest

from tests.harness.swarm import digests_by_version, islands_disagreeing, local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
FAULTS_ENV = "P2PDILOCO_FAULT_PLAN"


# opt-in (the suite's 15 minutes): the default wire format rides the same transport, and test_swarm's SIGKILL mid
# all-reduce runs on it
@pytest.mark.slow
def test_a_member_killed_mid_compressed_round_makes_the_others_roll_back_not_split(tmp_path):
    names = ["a", "b", "victim"]
    with local_swarm(tmp_path, "int4kill") as swarm:
        for name in names[:2]:
            swarm.start_peer(name, "-H", "12", "--max-rounds", "5", "--compression", "int4")
        swarm.start_peer("victim", "-H", "12", "--max-rounds", "5", "--compression", "int4", "--restarts", "0",
                         env={FAULTS_ENV: "die_in_allreduce@1"})  # a death, not a crash: no supervisor
        swarm.wait_clean(names[:2], timeout=500)
        assert swarm.procs["victim"].wait(30) == -9, swarm.log("victim")[-2000:]  # died as planned, mid-round
        survivors = [r for name in names[:2] for r in swarm.records(name, "round")]
        # the round the victim died in: the survivors could not get its part, so they rolled back together
        assert any(not r.applied and "all-reduce failed" in r.reason for r in survivors), survivors
        assert islands_disagreeing(swarm, names[:2]) == {}
        for version, digests in digests_by_version(swarm, names[:2]).items():
            assert len(digests) == 1, f"survivors disagree at version {version}: {digests}"


# Opt-in (the default suite stays under 15 minutes): test_swarm's int4 swarm runs the same transport end to end, and
# top-k's codes and parts are checked in tests/unit/test_codec.py and test_codes_transport.py
@pytest.mark.slow
def test_top_k_rounds_with_2_bit_codes_stay_bitwise_equal_on_a_sliver_of_the_bytes(tmp_path):
    names = ["a", "b", "c"]
    with local_swarm(tmp_path, "topk") as swarm:
        for name in names:
            swarm.start_peer(name, "-H", "15", "--max-rounds", "4", "--compression", "int2", "--topk", "0.02")
        swarm.wait_clean(names, timeout=400)
        merged = [r for name in names for r in swarm.records(name, "round") if r.applied and len(r.members) > 1]
        assert len(merged) >= 4, [r.reason for name in names for r in swarm.records(name, "round")]
        for version, digests in digests_by_version(swarm, names).items():
            assert len(digests) == 1, f"peers disagree at version {version}: {digests}"
        ratios = sorted(r.bytes_sent / r.allreduce_bytes_model for r in merged)
        assert ratios[len(ratios) // 2] < 0.05, ratios  # vs the fp32 butterfly: ~0.3 bits out, ~1 bit back


# opt-in (the default suite took 15:05 on a slow day with it): tests/unit/test_codec.py checks the update a member
# alone merges; this checks the merger hands it on
@pytest.mark.slow
def test_a_top_k_peer_alone_merges_what_its_codes_would_carry_not_its_whole_update(tmp_path):
    """Alone in the swarm (a quorum of 1), a round merges the peer's own update, as the wire would have carried it:
    2 % of each block under top-k, so Θ moves only there (the rest rides along in error feedback). Merging its
    whole Δ at an outer lr tuned for 2 % of it moved a SparseLoCo run's val from 1.97 to 2.30 in one round."""
    import torch
    from p2pdiloco.training import checkpoint
    from p2pdiloco.training.inner import flat_params
    from p2pdiloco.training.model import build_model

    with local_swarm(tmp_path, "alone") as swarm:
        swarm.start_peer("alone", "-H", "5", "--max-rounds", "1", "--compression", "int2", "--topk", "0.02",
                         "--outer-momentum", "0", "--outer-lr", "1")
        swarm.wait_clean(["alone"], timeout=120)
        [solo] = [r for r in swarm.records("alone", "round") if r.applied]
        assert solo.outcome == "solo"
    start = flat_params(build_model("tiny", 0))
    found = checkpoint.load_latest(tmp_path / "checkpoints" / "alone" / "alone", start.numel())
    assert found.meta["version"] == 1
    moved = int(torch.count_nonzero(found.tensors["global"] != start))
    assert 0 < moved <= 0.03 * start.numel(), f"{moved} of {start.numel()} parameters moved"
