"""A volunteer behind a NAT: in its own network namespace behind a masquerading router that lets nothing in, it
joins in client mode, fetches the state from peers that accept connections, and contributes to merged rounds."""

import os
import shutil
import signal
import subprocess
import sys

import pytest

from p2pdiloco.ops.testbed import Link, Testbed
from p2pdiloco.runtime.schema import Resync, Round, of_kind, read_records
from tests.harness.swarm import wait_for

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300),
              pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (network namespaces)"),
              pytest.mark.skipif(shutil.which("nft") is None, reason="the NAT needs nftables (`nft`)")]

PROBE = """
import socket, sys
if sys.argv[1] == "listen":
    s = socket.socket(); s.bind((sys.argv[2], 5003)); s.listen(1); print("up", flush=True); s.accept()[0].close()
else:
    try:
        socket.create_connection((sys.argv[2], 5003), timeout=3).close(); print("connected")
    except OSError as e:
        print(type(e).__name__)
"""


def connects(tb: Testbed, client: int, server: int, address: str) -> bool:
    listener = subprocess.Popen([*tb.exec_prefix(server), sys.executable, "-c", PROBE, "listen",
                                 tb.host_address(server)], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        out = subprocess.run([*tb.exec_prefix(client), sys.executable, "-c", PROBE, "dial", address],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        return out == "connected"
    finally:
        listener.kill()
        listener.wait()


def join(tb: Testbed, i: int, tmp_path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*tb.exec_prefix(i), sys.executable, "-m", "p2pdiloco.cli", "join", "--listen",
         f"/ip4/{tb.host_address(i)}/tcp/0", "--name", f"p{i}", "--model", "tiny", "--threads", "1", "-H", "10",
         "--eval-every", "0", "--checkpoint-every", "0", "--log-dir", str(tmp_path), "--run-id", "nat", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def applied(tmp_path, name: str) -> list[Round]:
    path = tmp_path / f"{name}.jsonl"
    return [r for r in of_kind(read_records(path), Round) if r.applied] if path.exists() else []


def merged(tmp_path, name: str) -> list[Round]:
    path = tmp_path / f"{name}.jsonl"
    rounds = of_kind(read_records(path), Round) if path.exists() else []
    return [r for r in rounds if r.applied and len(r.members) > 1]


def with_others(tmp_path, name: str) -> list[Round]:
    return [r for r in merged(tmp_path, name) if name in r.members]


@pytest.mark.parametrize("compression", [
    # both slow (42 s each): the default suite's budget. There, test_home_volunteers runs NAT'd clients end to end
    # (through a reducer node), test_churn a late join from public donors, test_codes_transport a client's part
    pytest.param("none", marks=pytest.mark.slow),
    pytest.param("int4", marks=pytest.mark.slow),
])
def test_a_peer_behind_a_nat_joins_in_client_mode_fetches_state_and_contributes_to_merged_rounds(tmp_path, compression):
    wire = ["--compression", compression]
    with Testbed(3, Link(rate_mbit=50), prefix="p2pdt-nat", natted=frozenset({2})) as tb:
        # the NAT is real: p2 reaches the others, nobody reaches p2, at its router's address or its own
        assert connects(tb, 2, 0, tb.address(0))
        assert not connects(tb, 0, 2, tb.address(2)) and not connects(tb, 0, 2, tb.host_address(2))
        procs, codes = [], []
        try:
            procs.append(join(tb, 0, tmp_path, *wire))
            wait_for(lambda: (tmp_path / "p0.addrs").exists(), 60, "p0's address")
            address = ["--initial-peers", (tmp_path / "p0.addrs").read_text().split()[0]]
            procs.append(join(tb, 1, tmp_path, *address, *wire))
            wait_for(lambda: applied(tmp_path, "p0"), 120, "a first round of the public peers")
            procs.append(join(tb, 2, tmp_path, *address, *wire, "--client-mode"))
            # until the client has merged two rounds with the others: on a loaded machine a round's matchmaking can
            # miss ("could not find a group"), so a fixed count of rounds would make this a test of the machine's load
            wait_for(lambda: len(with_others(tmp_path, "p2")) >= 2 or procs[2].poll() is not None, 200,
                     "two merged rounds with the client")
            for p in (procs[2], *procs[:2]):  # the client leaves first, then the public peers, in order
                p.send_signal(signal.SIGTERM)
                codes.append(p.wait(timeout=60))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert "p2pdt-nat" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    logs = {i: (tmp_path / f"p{i}.log").read_text()[-3000:] for i in range(3)}
    assert codes == [0, 0, 0], logs
    joined = [r for r in of_kind(read_records(tmp_path / "p2.jsonl"), Resync) if r.why == "joining"]
    assert joined and joined[0].version >= 1, logs[2]  # the state came from the public peers, not from scratch
    with_client = with_others(tmp_path, "p2")
    assert len(with_client) >= 2, ([r.reason for r in of_kind(read_records(tmp_path / "p2.jsonl"), Round)], logs[2])
    # every member of a round ends with the same global state: the client's digests are the public peers'
    digests = {}
    for name in ("p0", "p1", "p2"):
        for r in merged(tmp_path, name):
            digests.setdefault(r.version, set()).add(r.digest)
    assert all(len(d) == 1 for d in digests.values()), digests
    public = {r.version for name in ("p0", "p1") for r in merged(tmp_path, name) if "p2" in r.members}
    assert public & {r.version for r in with_client}, "the public peers never merged the client's contribution"
