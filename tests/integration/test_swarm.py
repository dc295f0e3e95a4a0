"""Multi-process swarms on loopback: bitwise agreement, learning, and a peer killed mid all-reduce."""

import signal
import time

import pytest

FAULTS_ENV = "P2PDILOCO_FAULT_PLAN"  # the hidden `join --fault-plan`, set through the environment
from p2pdiloco.config import OuterConfig
from p2pdiloco.protocol.island import Bounds, member_weights
from p2pdiloco.ops.swarmreport import val_by_version, val_rises
from tests.harness.swarm import alive, digests_by_version, islands_disagreeing, local_swarm, unresolved_forks

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]


# the wire formats, and the median of a round's bytes sent over a fp32 butterfly's: 20-bit codes out and 24-bit sums
# back are 44/64 of it (more when the peer also serves its state to one catching up); int4 codes out and 8-bit sums
# back 12/64 before the lossless stage takes its share off, plus libp2p's framing. The default format rides the same transport as
# int4 and runs in most other swarm tests (test_churn, test_chaos, test_decoupled, ...): opt-in here, for the
# suite's 15 minutes
WIRES = [pytest.param([], (0.55, 0.8), id="20-bit", marks=pytest.mark.slow),
         pytest.param(["--compression", "int4"], (0.08, 0.3), id="int4")]


@pytest.mark.parametrize("wire, median_ratio", WIRES)
def test_three_peers_stay_bitwise_equal_and_learn(tmp_path, wire, median_ratio):
    names = ["a", "b", "c"]
    with local_swarm(tmp_path, "bitwise") as swarm:
        for name in names:  # c keeps Θ and the momentum parked in a file: the same bits as the others
            parked = ["--global-state-on-disk"] if name == "c" else []
            # c takes a round more than a and b: its last is a solo merge after three-member ones (as a peer that
            # missed an island ends: CI once saw one raise the merged model's loss from 2.40 to 2.72)
            rounds = "6" if name == "c" else "5"
            swarm.start_peer(name, "-H", "15", "--max-rounds", rounds, "--bandwidth-mbps", "10", *wire, *parked)
        # c's averaging buffer lives in a file of its run's folder, mapped by the trainer and the forked averager
        # alike (hivemind would have copied real averaged tensors into /dev/shm); Θ's file comes after the fork
        assert mapping_processes(swarm, "c", tmp_path / "checkpoints" / "bitwise", within=120) >= 2
        swarm.wait_clean(names, timeout=400)
        assert "stays in memory" not in swarm.log("c")  # it did park them
        rounds = {name: swarm.records(name, "round") for name in names}
        # the hook ran: every merged round in a group was summed exactly by our reduce-scatter
        merged_in_group = [r for rs in rounds.values() for r in rs if r.applied and len(r.members) > 1]
        assert len(merged_in_group) >= 6, rounds
        for r in merged_in_group:  # every member applied tokens²/steps weights, from the gathered records, bounded
            # as the protocol bounds them: a member that trained 35 steps against others' 15 is capped at twice the
            # median weight (seen once in CI: [0.5, 0.25, 0.25], not tokens²/steps' [0.54, 0.23, 0.23]); the bounds
            # are a peer's defaults (the weight × norm bound cut one to 0.381 of 0.389 in CI)
            expected, _ = member_weights(r.member_tokens, r.member_steps, r.member_norms, r.member_versions, "tokens2",
                                         Bounds.of(OuterConfig()))
            assert r.weights == pytest.approx(expected)
        # traffic is measured on each peer's averager process, against a fp32 butterfly's bytes
        ratios = sorted(r.bytes_sent / r.allreduce_bytes_model for r in merged_in_group)
        assert median_ratio[0] < ratios[len(ratios) // 2] < median_ratio[1], ratios
        assert all(0 < r.codec_cpu_seconds < r.sync_seconds + 1 for r in merged_in_group)  # the codec's CPU, recorded
        # after every committed round, all peers at that version hold bit-identical global parameters
        for version, digests in digests_by_version(swarm, names).items():
            assert len(digests) == 1, f"peers disagree at version {version}: {digests}"
        assert islands_disagreeing(swarm, names) == {}
        # all-reduce deadlines follow the measured link: loopback is far faster than the declared 10 Mbit/s
        deadlines = [r.deadline_seconds for r in sorted(merged_in_group, key=lambda r: r.version)]
        assert deadlines[-1] < deadlines[0] / 2, deadlines
        summaries = [swarm.records(name, "summary")[-1] for name in names]
        final = {}
        for s in summaries:  # peers that end at the same version end bit-identical
            final.setdefault(s.version, set()).add(s.digest)
        assert all(len(d) == 1 for d in final.values()), summaries
        for s in summaries:
            # a fixed 2.0 was set when the loss started at ln 256 ≈ 5.5 (bytes: a bar at 64 % of it); the BPE
            # model starts near 4.3, where 2.0 asked for 47 % (missed once in CI: 2.333 against 2.283)
            assert s.final_val < 0.6 * s.initial_val, s
        # no round raised the merged model's validation loss beyond noise (issue 46: the demo's loss once rose), c's
        # solo merge neither: its Δ scaled by 1/3 (core.outer.solo_scale). Noise: 0.02 nats, where v5 spread over about
        # 0.07 in 23 runs at the defaults; unscaled, the solo merge raised it by 0.07-0.14 in 3 runs, 0.32 once in CI
        solo = [r for r in rounds["c"] if r.applied and r.reason == "solo"]
        assert solo, rounds["c"]
        val = val_by_version(swarm.records(name, "round") for name in names)
        assert len(val) >= 6 and val_rises(val, noise=0.02) == [], val


def mapping_processes(swarm, name: str, folder, within: float) -> int:
    """How many of a peer's processes map a file of `folder` shared (unnamed: `folder/#inode (deleted)`): once
    two do, or as many as do after `within` s."""
    deadline, found = time.monotonic() + within, 0
    while time.monotonic() < deadline:
        found = 0
        for pid in swarm.tree(name):
            try:
                maps = open(f"/proc/{pid}/maps").read().splitlines()
            except OSError:
                continue
            found += any(" rw-s " in line and f" {folder}/#" in line for line in maps)
        if found >= 2:
            return found
        time.sleep(0.5)
    return found


# opt-in (the suite's 15 minutes): in the default suite, test_chaos kills peers in their rounds (island forming or
# all-reduce) and checks that no island's members end a round apart and forks heal; test_lifeline that a SIGKILLed
# peer's helpers die; test_codes_transport and test_reducer_node that a member dying mid-stream fails the round for all
@pytest.mark.slow
def test_sigkill_during_allreduce_leaves_survivors_equal_and_training(tmp_path):
    names = ["a", "b", "c", "victim"]
    with local_swarm(tmp_path, "kill") as swarm:
        for name in names[:3]:
            swarm.start_peer(name, "-H", "12", "--max-rounds", "6")
        swarm.start_peer("victim", "-H", "12", "--max-rounds", "6", "--restarts", "0",  # a death, not a crash
                         env={FAULTS_ENV: "die_in_allreduce@1"})
        deadline = time.monotonic() + 300
        victim_tree = {}
        while swarm.procs["victim"].poll() is None and time.monotonic() < deadline:
            victim_tree.update(swarm.tree("victim"))  # snapshot its helpers (DHT, averager, p2pd) while alive
            time.sleep(0.2)
        assert swarm.procs["victim"].returncode == -signal.SIGKILL, swarm.log("victim")[-2000:]
        time.sleep(3)  # the lifeline polls every 0.25 s
        leftovers = [pid for pid in victim_tree if alive(pid)]
        assert not leftovers, f"processes of the killed peer still alive: {leftovers}"

        survivors = names[:3]
        swarm.wait_clean(survivors, timeout=300)
        # no survivor applied a mixed result: every island's members ended each round with one state (four
        # live peers may fork into two islands before the kill; such forks heal within two rounds)
        assert not islands_disagreeing(swarm, survivors)
        assert not unresolved_forks(swarm, survivors, within_rounds=2)
        # the kill hit the round at version 1; the survivors still merged together afterwards (with K=1 a
        # survivor that finds nobody ready within its grace window may also apply a round alone)
        later = [r for r in swarm.records("a", "round") if r.version >= 3 and r.applied]
        assert any(len(r.members) >= 2 for r in later), swarm.records("a", "round")
        assert not any("victim" in r.members for r in later)
