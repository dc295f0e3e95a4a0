"""How scripts/bench/bench_bandwidth.py scores a run's loss curve."""

from p2pdiloco.runtime.schema import Round, Start
from scripts.bench.bench_bandwidth import val_curve


def test_a_versions_loss_is_that_of_the_state_most_peers_hold(tmp_path):
    """At a run's end one peer merged alone after the others left: its state has the same version number as
    theirs, and is not the swarm's model (it moved val by +0.3 in a SparseLoCo run)."""
    for i in range(4):
        records = [Start(peer=f"p{i}", val_loss=5.5),
                   Round(peer=f"p{i}", version=1, applied=True, val_loss=2.5, digest="a1")]
        solo = i == 2
        records.append(Round(peer=f"p{i}", version=2, applied=True, val_loss=2.3 if solo else 1.9,
                             digest="s2" if solo else "a2"))
        (tmp_path / f"p{i}.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    assert val_curve(tmp_path) == [(0, 5.5), (1, 2.5), (2, 1.9)]
