"""A swarm of home volunteers: every trainer sits behind its own masquerading NAT that lets nothing in, so none
can reduce a part or lead a group. A public node running `p2pdiloco bootstrap --reduce` reduces for them; without
it they say why no island forms, and train on alone."""

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from p2pdiloco.ops.testbed import Link, Testbed
from p2pdiloco.runtime.schema import Resync, Round, of_kind, read_records
from p2pdiloco.swarm.rounds import NOBODY_REDUCES
from tests.integration.test_nat import connects, join, merged, wait_for, with_others

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400),
              pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (network namespaces)"),
              pytest.mark.skipif(shutil.which("nft") is None, reason="the NAT needs nftables (`nft`)")]

TRAINERS = (1, 2, 3)  # each behind its own NAT; peer 0 is the public node


def bootstrap(tb: Testbed, tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*tb.exec_prefix(0), sys.executable, "-m", "p2pdiloco.cli", "bootstrap", "--listen",
         f"/ip4/{tb.host_address(0)}/tcp/0", "--log-dir", str(tmp_path), "--run-id", "nat", *args],
        stdout=open(tmp_path / "node.out", "w"), stderr=subprocess.STDOUT)


def client(tmp_path, i: int, initial: list[str], run_id: str, rounds: int,
           compression: str = "int4") -> subprocess.Popen:
    """A client-mode trainer on loopback (the cases that need no NAT of their own)."""
    return subprocess.Popen(
        [sys.executable, "-m", "p2pdiloco.cli", "join", *initial, "--client-mode", "--name", f"p{i}", "--model", "tiny",
         "--threads", "1", "-H", "10", "--eval-every", "0", "--checkpoint-every", "0", "--compression", compression,
         "--log-dir", str(tmp_path), "--run-id", run_id, "--max-rounds", str(rounds)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_all(procs: list) -> list[int]:
    """Trainers first, then the node, in order; the exit codes."""
    codes = []
    for p in procs[1:] + procs[:1]:
        p.send_signal(signal.SIGTERM)
        codes.append(p.wait(timeout=60))
    return codes


def test_trainers_that_nobody_can_dial_merge_through_a_reducer_node_and_a_late_one_catches_up(tmp_path):
    """p1 and p2 start together; p3 joins once they have merged, and takes the state they hold through the
    node (one of them pushes it there: p2pdiloco.swarm.staterelay), then merges with them."""
    with Testbed(4, Link(rate_mbit=50), prefix="p2pdt-home", natted=frozenset(TRAINERS)) as tb:
        assert not connects(tb, 0, 1, tb.address(1)) and not connects(tb, 2, 1, tb.address(1))  # the NATs hold
        procs, codes = [bootstrap(tb, tmp_path, "--reduce")], []
        try:
            wait_for(lambda: (tmp_path / "bootstrap.addrs").exists(), 60, "the node's address")
            args = ["--initial-peers", (tmp_path / "bootstrap.addrs").read_text().split()[0], "--client-mode",
                    "--compression", "int4"]
            procs += [join(tb, i, tmp_path, *args) for i in TRAINERS[:2]]
            wait_for(lambda: all(with_others(tmp_path, f"p{i}") for i in TRAINERS[:2])
                     or any(p.poll() is not None for p in procs), 180, "a merged round of the first two")
            procs.append(join(tb, 3, tmp_path, *args))
            wait_for(lambda: with_others(tmp_path, "p3") or any(p.poll() is not None for p in procs), 180,
                     "a merged round of the late joiner")
            codes = stop_all(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    logs = {i: (tmp_path / f"p{i}.log").read_text() for i in TRAINERS}
    node_log = (tmp_path / "node.out").read_text()
    assert codes == [0, 0, 0, 0], ({i: text[-3000:] for i, text in logs.items()}, node_log[-3000:])
    assert all("reachable: no" in text and NOBODY_REDUCES not in text for text in logs.values())
    assert "reduced a part for" in node_log and "Traceback" not in node_log, node_log[-3000:]
    joined = [r for r in of_kind(read_records(tmp_path / "p3.jsonl"), Resync) if r.why == "joining"]
    assert joined and joined[0].version >= 1, logs[3][-3000:]  # the swarm's state, through the node
    assert any("to reducer node" in logs[i] and "pushed our state" in logs[i] for i in TRAINERS[:2])
    assert with_others(tmp_path, "p3"), logs[3][-3000:]
    digests = {}
    for i in TRAINERS:
        for r in merged(tmp_path, f"p{i}"):
            digests.setdefault(r.version, set()).add(r.digest)
    assert all(len(d) == 1 for d in digests.values()), digests  # every member of a round ends with the same Θ


@pytest.mark.slow  # 35 s: the default suite's budget
def test_without_a_reducer_node_they_say_why_no_island_forms_once_and_keep_training(tmp_path):
    with Testbed(3, Link(rate_mbit=50), prefix="p2pdt-home", natted=frozenset({1, 2})) as tb:
        procs, codes = [bootstrap(tb, tmp_path)], []
        try:
            wait_for(lambda: (tmp_path / "bootstrap.addrs").exists(), 60, "the node's address")
            address = ["--initial-peers", (tmp_path / "bootstrap.addrs").read_text().split()[0]]
            procs += [join(tb, i, tmp_path, *address, "--client-mode", "--compression", "int4") for i in (1, 2)]
            said = lambda i: NOBODY_REDUCES in ((tmp_path / f"p{i}.log").read_text()  # noqa: E731
                                                if (tmp_path / f"p{i}.log").exists() else "")
            wait_for(lambda: all(map(said, (1, 2))) or any(p.poll() is not None for p in procs), 200,
                     "both trainers to say why no island forms")
            wait_for(lambda: all(len(rounds(tmp_path, f"p{i}")) >= 2 for i in (1, 2)), 120, "rounds tried")
            codes = stop_all(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    logs = {i: (tmp_path / f"p{i}.log").read_text() for i in (1, 2)}
    assert codes == [0, 0, 0], logs
    assert all(text.count(NOBODY_REDUCES) == 1 for text in logs.values()), logs  # once, in one line
    for i in (1, 2):  # no round merged; inner steps went on between the tries, and their Δ waits for the next one
        tried = rounds(tmp_path, f"p{i}")
        assert not any(r.applied for r in tried) and tried[-1].tokens_trained > tried[0].tokens_trained


def rounds(tmp_path, name: str) -> list[Round]:
    path = tmp_path / f"{name}.jsonl"
    return of_kind(read_records(path), Round) if path.exists() else []


@pytest.mark.slow  # 40 s: the default suite's budget
def test_two_reducer_nodes_share_the_parts_and_the_swarm_outlives_one_of_them(tmp_path):
    """Two nodes (the second joins through the first) and two clients on loopback that know both: both nodes
    reduce a part of each round; node a is SIGKILLed, and the clients go on merging through b, bitwise-equal.
    (With one node only, a client-mode peer that lost it never found it again once it came back: it then
    trained alone. docs/internet.md says to run two.)"""
    def node(name: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", "bootstrap", "--reduce", "--name", name,
                                 "--listen", "/ip4/127.0.0.1/tcp/0", "--log-dir", str(tmp_path), "--run-id", "two",
                                 *args], stdout=open(tmp_path / f"{name}.out", "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)  # its DHT, averager and daemon die with it

    procs, codes = [node("a")], []
    try:
        wait_for(lambda: (tmp_path / "a.addrs").exists(), 60, "node a's address")
        a = ["--initial-peers", (tmp_path / "a.addrs").read_text().split()[0]]
        procs.append(node("b", *a))
        wait_for(lambda: (tmp_path / "b.addrs").exists(), 60, "node b's address")
        both = [*a, "--initial-peers", (tmp_path / "b.addrs").read_text().split()[0]]
        procs += [client(tmp_path, i, both, "two", rounds=8) for i in (1, 2)]
        wait_for(lambda: len(merged(tmp_path, "p1")) >= 3 or procs[2].poll() is not None, 120, "three merged rounds")
        shared = [(tmp_path / f"{n}.out").read_text().count("reduced a part for") for n in "ab"]
        killed_at = len(merged(tmp_path, "p1"))
        os.killpg(procs[0].pid, signal.SIGKILL)
        codes = [p.wait(timeout=180) for p in procs[2:]]
        procs[1].send_signal(signal.SIGINT)
        codes.append(procs[1].wait(timeout=60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0, 0]
    digests = {}
    for i in (1, 2):
        for r in merged(tmp_path, f"p{i}"):
            digests.setdefault(r.version, set()).add(r.digest)
    assert all(len(d) == 1 for d in digests.values()), digests
    # one reduction per node and round: more than the rounds means some rounds were shared
    assert min(shared) >= 1 and sum(shared) >= killed_at + 2, (shared, killed_at)
    assert len(merged(tmp_path, "p1")) >= killed_at + 2, "no round merged through node b after a died"


@pytest.mark.slow  # 90 s: the default suite's budget
def test_clients_find_their_only_node_again_after_it_restarts_and_merge_again(tmp_path):
    """The one node is SIGKILLed and restarted (its identity and port kept). Meanwhile the clients train alone (and
    say so once); then they ping their initial peer again (p2pdiloco.swarm.node.rejoin), reconcile, and merge."""
    with socket.socket() as s:  # a port the system hands out, kept for the node's second life
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def node() -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", "bootstrap", "--reduce", "--identity",
                                 str(tmp_path / "node.key"), "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--log-dir",
                                 str(tmp_path), "--run-id", "again"], stdout=open(tmp_path / "node.out", "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    procs, codes = [node()], []
    try:
        wait_for(lambda: (tmp_path / "bootstrap.addrs").exists(), 60, "the node's address")
        address = ["--initial-peers", (tmp_path / "bootstrap.addrs").read_text().split()[0]]
        procs += [client(tmp_path, i, address, "again", rounds=30) for i in (1, 2)]
        wait_for(lambda: len(merged(tmp_path, "p1")) >= 2 or procs[1].poll() is not None, 120, "two merged rounds")
        os.killpg(procs[0].pid, signal.SIGKILL)
        procs[0].wait()
        before = len(merged(tmp_path, "p1"))
        wait_for(lambda: NOBODY_REDUCES in (tmp_path / "p1.log").read_text() or procs[1].poll() is not None, 60,
                 "the clients to see the node gone")
        procs[0] = node()
        codes = [p.wait(timeout=240) for p in procs[1:]]
        procs[0].send_signal(signal.SIGINT)
        codes.append(procs[0].wait(timeout=60))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0, 0]
    after = merged(tmp_path, "p1")[before:]
    assert len(after) >= 2, [r.reason for r in rounds(tmp_path, "p1")]
    theirs = {r.version: r.digest for r in merged(tmp_path, "p2")}
    assert all(theirs.get(r.version, r.digest) == r.digest for r in after)  # merged together, equal again


@pytest.mark.slow  # 70 s: the default suite's budget
def test_a_reducer_node_reduces_by_the_rule_its_live_trainers_publish_not_the_first_it_met(tmp_path):
    """Trainers of `--compression none` merge through the node and leave; trainers of int4 come next and merge
    through the same node, which now reduces by their rule (it kept the first one, and they found no group)."""
    node = subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", "bootstrap", "--reduce", "--listen",
                             "/ip4/127.0.0.1/tcp/0", "--log-dir", str(tmp_path), "--run-id", "rules"],
                            stdout=open(tmp_path / "node.out", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    procs = [node]
    try:
        wait_for(lambda: (tmp_path / "bootstrap.addrs").exists(), 60, "the node's address")
        address = ["--initial-peers", (tmp_path / "bootstrap.addrs").read_text().split()[0]]
        first = [client(tmp_path, i, address, "rules", rounds=2, compression="none") for i in (1, 2)]
        procs += first
        assert [p.wait(timeout=180) for p in first] == [0, 0]
        then = [client(tmp_path, i, address, "rules", rounds=3) for i in (3, 4)]
        procs += then
        assert [p.wait(timeout=180) for p in then] == [0, 0]
        node.send_signal(signal.SIGINT)
        assert node.wait(timeout=60) == 0
    finally:
        for p in procs[1:]:
            if p.poll() is None:
                p.kill()
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
    assert len(merged(tmp_path, "p1")) >= 1, "the first trainers merged nothing through the node"
    assert len(merged(tmp_path, "p3")) >= 1 and len(merged(tmp_path, "p4")) >= 1, (tmp_path / "node.out").read_text()
    assert "which most live trainers now publish" in (tmp_path / "node.out").read_text()
