"""A lying peer among honest ones (a test fault plan makes one peer hostile from its first round): it can cost
the honest peers at most one round, and what it sends never decides their merge."""

import signal
import sys

import pytest

from p2pdiloco.ops.launcher import start_process
from tests.harness.swarm import digests_by_version, local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]
HONEST = ["a", "b", "c"]
ROUNDS = 8  # the plain-hivemind stranger's test: rounds each honest peer is judged on
ARGS = ["-H", "10", "--max-rounds", "5", "--quorum", "2", "--eval-every", "0"]
INT4 = ["--compression", "int4"]


def run_with_a_liar(tmp_path, run_id: str, fault: str, *extra: str):
    with local_swarm(tmp_path, run_id) as swarm:
        for name in HONEST:
            swarm.start_peer(name, *ARGS, *extra)
        plan = fault if "@" in fault else f"{fault}@0"
        swarm.start_peer("liar", *ARGS, *extra, env={"P2PDILOCO_FAULT_PLAN": plan})
        swarm.wait_clean(HONEST, timeout=400)
        for version, states in digests_by_version(swarm, HONEST).items():
            assert len(states) == 1, f"honest peers disagree at version {version}: {states}"
        return ({name: swarm.records(name, "round") for name in HONEST}, swarm.records("liar", "start")[0].peer_id,
                swarm.records("liar", "round"))


def lost_rounds(rounds: dict[str, list]) -> dict[str, list]:
    """Each honest peer's rounds that merged nothing, less those it began after every other honest peer had ended
    its last round: with no honest partner left, a round can only merge alone and roll back, whatever the liar
    does (seen in CI: a peer that had waited for an island, --wait-for-island, did its 5th round alone)."""
    ends = {name: max(r.time for r in rs) for name, rs in rounds.items()}
    lost = {}
    for name, rs in rounds.items():
        others_done = max(t for other, t in ends.items() if other != name)
        lost[name] = [(r.round, r.reason) for r in rs if not r.applied and r.time - r.round_seconds < others_done]
    return lost


def assert_at_most_one_round_lost_to_the_liar(rounds: dict[str, list]) -> None:
    """Its data costs each honest peer one round at most. Matchmaking can also put one honest peer alone in a group
    the liar leads, which leaves the liar out and so merges nothing, while the other honest peers merge (seen in
    CI on 2026-11-26, the round after the liar had waited for an island): that is one more round, never its data
    merged, and counted apart."""
    for name, lost in lost_rounds(rounds).items():
        alone_with_it = [why for _, why in lost if "the island merged only us" in why]
        assert len(rounds[name]) == 5 and len(lost) - len(alone_with_it) <= 1 and len(alone_with_it) <= 1, lost


# Opt-in (the default suite stays under 15 minutes): the scaled liar below is blamed and left out the same way, a
# member that sends and serves nothing is test_swarm's killed one, and NaN cannot be packed (tests/unit/test_codec)
@pytest.mark.parametrize("wire", [pytest.param(INT4, marks=pytest.mark.slow),
                                  pytest.param(["--compression", "none"], marks=pytest.mark.slow)],
                         ids=["int4", "none"])
def test_a_peer_sending_nan_costs_the_honest_peers_at_most_one_round(tmp_path, wire):
    """Its codes cannot even be packed (int4, and the default 20-bit codes alike), so it never sends its parts nor
    serves its sum. The first round fails (or its parts are
    left out once the wait is over), its members blame it and turn it away at matchmaking; an island it leads
    leaves it out: it sends and reduces nothing there."""
    rounds, liar, its_rounds = run_with_a_liar(tmp_path, "nan", "hostile_nan", *wire)
    assert_at_most_one_round_lost_to_the_liar(rounds)
    for name, rs in rounds.items():
        assert not any(r.applied and "liar" in r.members for r in rs[1:])  # left out after the first round
    # blamed by every honest member: they turn it away at matchmaking, or leave it out if it leads
    assert not any(r.applied and len(r.members) > 1 for r in its_rounds), [(r.applied, r.reason) for r in its_rounds]
    later = [r for rs in rounds.values() for r in rs[1:]]
    assert all(liar in r.excluded or "liar" not in r.members for r in later)


# int4 in the default suite (41 s here): one liar end to end in CI, beside the plain hivemind stranger below; the
# default 20-bit codes take the same transport and claims check, so that one is opt-in (the 15-minute budget)
# slow (37 s): the default suite's budget. Its checks run in the default suite piece by piece: a member's codes
# and a reducer's sum held to the senders' claims (tests/unit/test_claims.py), the weight and influence caps
# (tests/unit/test_island_bounds.py); and a hostile stranger end to end, below
@pytest.mark.parametrize("wire", [
    pytest.param(INT4, marks=pytest.mark.slow),
    pytest.param(["--compression", "none"], marks=pytest.mark.slow),
], ids=["int4", "none"])
def test_a_scaled_liar_claiming_1000x_its_tokens_costs_the_honest_peers_at_most_one_round(tmp_path, wire):
    """×100 its Δ, 1000× its tokens, its honest block statistics claimed; no option set. Its weight is capped,
    and whoever reduces a part holds its codes to the maxima and norms it claimed (p2pdiloco.core.claims):
    honest reducers leave its part out of their sums and the others merge; the part it reduces itself holds its
    own codes, and every member refuses that sum (beyond its senders' claims), so that round rolls back. Either
    way its members blame it, and it is not merged again. Before the claims check it was merged in every
    round, and the honest loss went from 2.5 to 4.0 (int4) and 8.9 (fp32, on hivemind's all-reduce then) in
    bench_hostile."""
    rounds, liar, _ = run_with_a_liar(tmp_path, "scaled", "hostile_scaled", *wire)
    assert_at_most_one_round_lost_to_the_liar(rounds)
    for name, rs in rounds.items():
        assert not any(r.applied and "liar" in r.members and liar not in r.excluded for r in rs), \
            [(r.applied, r.members, r.excluded) for r in rs]
        first = next((r for r in rs if "liar" in r.members), None)
        if first is not None:
            assert "merge weight capped" in first.bounded[liar], first.bounded
    # its part left out by an honest reducer, or its sum refused by everyone: beyond its senders' claims, or (the
    # reducer's account, p2pdiloco.core.audit) its own share beyond its own
    reasons = [r.excluded.get(liar, "") + r.reason for rs in rounds.values() for r in rs]
    assert any("claimed" in why or "their claims allow" in why for why in reasons), reasons


@pytest.mark.slow  # opt-in option; bench_hostile measures it too (the default suite stays under 15 minutes)
def test_a_random_liar_claiming_1000x_its_tokens_is_left_out_by_a_robust_merge(tmp_path):
    """Noise of its Δ's spread, 1000× its tokens: within the claims it may make, so only --robust-merge's
    direction test leaves it out; the honest peers merge every round."""
    rounds, liar, _ = run_with_a_liar(tmp_path, "random", "hostile_random", *INT4, "--robust-merge")
    for name, rs in rounds.items():
        assert all(r.applied for r in rs), [(r.applied, r.reason) for r in rs]
        merged_it = [r for r in rs if "liar" in r.members and liar not in r.excluded]
        assert not merged_it, [(r.members, r.excluded) for r in merged_it]


@pytest.mark.slow  # 50 s; its parts in the default suite: test_averager_seams (turned away at matchmaking,
# hivemind's reducer RPC takes nothing), test_properties and test_remote_input (no record's bytes raise)
def test_a_plain_hivemind_averager_gathering_garbage_costs_the_honest_peers_at_most_one_round(tmp_path):
    """The stranger of issue 11 (tests/harness/rogue.py). Its record does not parse, so every island leaves it
    out, and an honest leader then turns it away at matchmaking; the fp32 parts it streams to hivemind's reducer
    RPC are refused unread (our rounds do not use it). Groups it leads itself the honest peers still join, and
    leave it out there. It asks all along (measured: in 4 of 12 rounds' groups) and the honest peers merge every
    round or all but one."""
    with local_swarm(tmp_path, "rogue") as swarm:
        rogue = start_process([sys.executable, "-m", "tests.harness.rogue", swarm.address, "rogue", "tiny", "120"],
                              tmp_path / "rogue.log")
        swarm.procs["rogue"] = rogue
        swarm.wait_for(lambda: "rogue up" in swarm.log("rogue"), 60, "the rogue averager")
        for name in HONEST:
            swarm.start_peer(name, "-H", "10", "--max-rounds", str(ROUNDS + 1), "--quorum", "2", "--eval-every", "0",
                             "--compression", "none")
        # every honest peer does ROUNDS rounds, then leaves: one that joined late would otherwise do its last round
        # after the others had left, and wait out the quorum window (60 s) alone (seen in CI: 117 s, not 56)
        swarm.wait_for(lambda: all(swarm.procs[n].poll() is not None or len(swarm.records(n, "round")) >= ROUNDS
                                   for n in HONEST), 400, f"{ROUNDS} rounds on every honest peer")
        for name in HONEST:
            if swarm.procs[name].poll() is None:
                swarm.procs[name].send_signal(signal.SIGTERM)  # a graceful leave
        swarm.wait_clean(HONEST, timeout=60)
        attempts = swarm.log("rogue").count("rogue ") - 1
    rejected = []  # reasons of records that did not parse (keyed by position: their ids cannot be trusted)
    for name in HONEST:
        rounds = swarm.records(name, "round")
        first = rounds[:ROUNDS]
        assert len(first) == ROUNDS and sum(not r.applied for r in first) <= 1, [(r.applied, r.reason) for r in rounds]
        assert not any(len(r.members) > 3 for r in rounds)  # its record never counted as a member's
        rejected += [why for r in rounds for position, why in r.excluded.items() if position.isdigit()]
    assert attempts >= 2, swarm.log("rogue")[-2000:]
    assert rejected, "the rogue never got into an island: this test showed nothing"


@pytest.mark.slow  # the driver's refusal runs in the default suite (tests/unit/test_reach.py)
def test_a_member_claiming_versions_it_never_made_cannot_hand_the_honest_peers_its_state(tmp_path):
    """After each round it holds a state of its own (its Θ and noise), 5 versions ahead of its last, which it
    publishes and serves. Honest peers that would catch up from it, or that are stale in an island it leads the
    versions of, refuse its state: further from theirs than the versions between explain (p2pdiloco.core.reach).
    Before, they took it: the liar replaced their model."""
    # from v2, once the honest peers have merged (a peer that has seen no merge has nothing to measure by)
    rounds, liar, its_rounds = run_with_a_liar(tmp_path, "ahead", "hostile_ahead@2")
    honest = {(r.version, r.digest) for rs in rounds.values() for r in rs}
    lies = {(r.version, r.digest) for r in its_rounds if r.version >= 7}
    assert lies and not honest & lies, sorted(lies)
    assert all(sum(r.applied for r in rs) >= 3 for rs in rounds.values()), \
        {name: [(r.applied, r.reason) for r in rs] for name, rs in rounds.items()}


@pytest.mark.slow  # 40 s each; in the default suite in-process, both wires (tests/unit/test_codes_transport.py)
@pytest.mark.parametrize("wire", [INT4, ["--compression", "none"]], ids=["int4", "none"])
def test_a_reducer_bending_its_sum_within_the_claims_costs_the_honest_peers_at_most_one_round(tmp_path, wire):
    """The part the liar reduces is served with the others' codes flipped: a sum their claims allow, which the sum
    check passed (docs/hostile.md had it as not covered). Its account of the part hides the difference in its own
    share, whose norm every member checks against the liar's claims (p2pdiloco.core.audit): every honest member
    refuses that round and blames it, and it is left out after."""
    rounds, liar, its_rounds = run_with_a_liar(tmp_path, "bender", "hostile_reducer", *wire)
    assert_at_most_one_round_lost_to_the_liar(rounds)
    reasons = [r.reason for rs in rounds.values() for r in rs if not r.applied]
    assert any("its own codes have a norm" in why for why in reasons), reasons
    for name, rs in rounds.items():  # after its first refused round, never merged with it again
        refused = [i for i, r in enumerate(rs) if "its own codes have a norm" in r.reason]
        later = rs[refused[0] + 1:] if refused else rs
        merged_with_it = [r for r in later if r.applied and "liar" in r.members and liar not in r.excluded]
        assert not merged_with_it, [(r.reason, r.members, r.excluded) for r in rs]
