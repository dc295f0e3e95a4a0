"""`join --fragments P`: peers merge their model as P fragments, each in rounds of its own (docs/fragments.md).
Each fragment's members hold its Θ bit for bit, `status --fragments` shows each peer's fragments' versions, and a
restart resumes every fragment from the peer's checkpoint (written in the whole model's format:
tests/unit/test_fragments.py checks that `export` can read it and that a peer of one fragment refuses it)."""

import pytest

from tests.harness.swarm import local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(420)]

ARGS = ["-H", "6", "--fragments", "2", "--quorum", "2", "--compression", "int4", "--eval-every", "0"]


def digests_by_fragment(rounds) -> dict:
    seen: dict[tuple[int, int], set] = {}
    for r in rounds:
        if r.applied:
            seen.setdefault((r.fragment, r.version), set()).add(r.digest)
    return seen


def test_peers_merge_their_fragments_bitwise_equal_and_a_restart_resumes_each(tmp_path):
    names = ["a", "b"]
    with local_swarm(tmp_path, "streamed") as swarm:
        swarm.watch_status(extra=("--fragments", "2"))
        for name in names:
            swarm.start_peer(name, *ARGS, "--max-rounds", "2")

        def merged_both():  # the status view: every peer, with each fragment's version
            view = swarm.status()
            return view and len(view["peers"]) == 2 and all(p["versions"] and None not in p["versions"]
                                                            and min(p["versions"]) >= 1 for p in view["peers"])
        swarm.wait_for(merged_both, 120, "status showing both peers with both fragments merged")
        swarm.wait_clean(names, timeout=300)
        rounds = [r for name in names for r in swarm.records(name, "round")]
        assert {r.fragment for r in rounds} == {0, 1}  # each round merged one fragment
        together = [r for r in rounds if r.applied and len(r.members) == 2]
        assert {r.fragment for r in together} == {0, 1}, [(r.fragment, r.members, r.reason) for r in rounds]
        for key, digests in digests_by_fragment(rounds).items():  # a fragment's members hold its Θ bit for bit
            assert len(digests) == 1, (key, digests)
        summaries = {name: swarm.records(name, "summary")[-1] for name in names}
        assert all(s.version >= 4 for s in summaries.values())  # 2 rounds of each of the 2 fragments, at least

        swarm.start_peer("a", *ARGS, "--max-rounds", "1", "--quorum", "1")  # alone now: rounds merge solo
        swarm.wait_clean(["a"], timeout=200)
        restored = swarm.records("a", "restore")[-1]
        assert restored.version == summaries["a"].version  # every fragment's version came back
        after = [r for r in swarm.records("a", "round") if r.time > restored.time]
        assert {r.fragment for r in after if r.applied} == {0, 1}
