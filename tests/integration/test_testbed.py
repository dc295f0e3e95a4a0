"""The network testbed applies what it promises (measured through it) and removes everything it created."""

import os
import signal
import statistics
import subprocess
import sys

import pytest

from p2pdiloco.ops.testbed import Link, Testbed, TestbedError
from p2pdiloco.runtime.schema import Round, of_kind, read_records

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180),
              pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (network namespaces)")]

SERVER = """
import socket, sys
kind, host = sys.argv[1], sys.argv[2]
if kind == "tcp":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((host, 5001)); s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    total = 0
    while True:
        d = c.recv(1 << 16)
        if not d: break
        if d == b"p": c.sendall(b"q"); continue
        total += len(d)
    c.sendall(str(total).encode())
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((host, 5002)); s.settimeout(3.0)
    print("listening", flush=True)
    n = 0
    try:
        while True:
            s.recv(64); n += 1
    except socket.timeout:
        print(n, flush=True)
"""

CLIENT = """
import json, socket, sys, time
kind, host = sys.argv[1], sys.argv[2]
if kind == "tcp":
    c = socket.create_connection((host, 5001), timeout=20); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(7):
        t = time.monotonic(); c.sendall(b"p"); c.recv(1); rtts.append(time.monotonic() - t)
    c.sendall(b"x" * (1 << 20))  # warm up the window
    data = b"x" * (6 << 20); t = time.monotonic(); c.sendall(data); c.shutdown(socket.SHUT_WR); c.recv(100)
    print(json.dumps(dict(rtts=rtts, mbit=len(data) * 8 / (time.monotonic() - t) / 1e6)))
else:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(2000):
        s.sendto(b"x" * 32, (host, 5002)); time.sleep(0.0005)
"""


def measure(tb: Testbed, kind: str) -> str:
    server = subprocess.Popen([*tb.exec_prefix(1), sys.executable, "-c", SERVER, kind, tb.address(1)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        client = subprocess.run([*tb.exec_prefix(0), sys.executable, "-c", CLIENT, kind, tb.address(1)],
                                capture_output=True, text=True, timeout=90)
        assert client.returncode == 0, client.stderr
        return client.stdout if kind == "tcp" else server.communicate(timeout=20)[0]
    finally:
        server.kill()
        server.wait()


def test_rate_and_delay_are_applied_as_measured_through_the_testbed():
    import json

    with Testbed(2, Link(rate_mbit=20, delay_ms=30), prefix="p2pdt-test") as tb:
        result = json.loads(measure(tb, "tcp"))
        assert len(tb.namespaces()) == 3
    rtt_ms = 1000 * statistics.median(result["rtts"])
    assert 58 <= rtt_ms <= 90, rtt_ms  # 2 × 30 ms one way, plus the delay line's and Python's time
    assert 12 <= result["mbit"] <= 21, result["mbit"]  # tbf at 20 Mbit/s (TCP over a 60 ms RTT gets most of it)
    assert tb.namespaces() == [] and tb._delayline is None
    counts = tb.delayline_counts  # read when it stopped: every packet crossed it, and how late it went out
    assert counts["sent"] >= 100 and counts["dropped"] == 0 and 0 <= counts["late_max_ms"] < 1000, counts


def test_all_to_all_flows_are_held_to_each_peers_link_rate():
    """The benchmarks' calibration: 3 peers each send 1 MB to both others at once over 20 Mbit/s links, so each
    sends and receives 2 MB, at least 0.8 s at link rate. The upper bound only catches a pathological slowdown:
    on 2 loaded cores the senders' start and TCP's ramp-up took 2.02× the bound once in CI."""
    with Testbed(3, Link(rate_mbit=20), prefix="p2pdt-test") as tb:
        seconds = tb.all_to_all_seconds(1_000_000)
    bound = 2_000_000 / (20e6 / 8)
    assert bound <= seconds <= 3 * bound, seconds


def test_one_connection_kept_open_carries_both_ways_at_link_rate():
    """The probe's calibration for libp2p (one connection between two peers, used both ways at once): 1 MB each
    way over 20 Mbit/s links, at least 0.4 s a trial, twice on the same connection."""
    with Testbed(2, Link(rate_mbit=20), prefix="p2pdt-test") as tb:
        seconds = tb.duplex_seconds(1_000_000, trials=2)
    bound = 1_000_000 / (20e6 / 8)
    assert len(seconds) == 2 and all(bound <= s <= 3 * bound for s in seconds), seconds


def test_the_delay_line_carries_four_peers_at_their_link_rate():
    """Every packet of 4 peers' all-to-all (4 MB to each other peer over 100 Mbit/s, at least 0.96 s) crosses the
    userspace delay line, and the line keeps up within a bound that only catches a pathological slowdown. Whether it
    is ever the bottleneck (bare links against the line, side by side) is `scripts/bench/bench_delayline.py`'s to
    measure: a 1.1 bound on that ratio here failed once on loaded cores (1.331 against 1.201 s)."""
    with Testbed(4, Link(rate_mbit=100, delay_ms=2), prefix="p2pdt-test") as tb:
        seconds = tb.all_to_all_seconds(4_000_000)
    bound = 3 * 4_000_000 / (100e6 / 8)
    counts = tb.delayline_counts
    assert bound <= seconds <= 3 * bound, seconds
    assert counts["received"] >= 12 * 4_000_000 // 65_536, counts  # 48 MB, in packets of at most 64 KB (TSO)


def test_loss_is_applied_and_the_testbed_cleans_up_after_itself():
    with Testbed(2, Link(rate_mbit=50, loss=0.2), prefix="p2pdt-test", seed=1) as tb:
        received = int(measure(tb, "udp").split()[-1])
        delayline = tb._delayline
    assert 0.70 <= received / 2000 <= 0.90, received
    assert 0.1 <= tb.delayline_counts["dropped"] / tb.delayline_counts["received"] <= 0.3, tb.delayline_counts
    assert delayline.poll() is not None  # the delay line was stopped
    assert tb.namespaces() == []
    assert "p2pdt-test" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_bad_links_are_refused():
    for bad in (dict(rate_mbit=0), dict(delay_ms=-1), dict(loss=1.0)):
        with pytest.raises(TestbedError):
            Link(**bad)


# opt-in (the suite's 15 minutes): test_nat's peers meet on separate hosts of this testbed and merge, and
# test_swarm runs int4 rounds on the same transport
@pytest.mark.slow
def test_peers_on_separate_hosts_behind_slow_links_merge_compressed_rounds_and_stay_equal(tmp_path):
    """Three peers, each in its own namespace behind 20 Mbit/s links with 20 ms one way: members that never met
    before the round still reach each other (libp2p learns their addresses), and int4 rounds stay exact.
    The first peer stays until the two joiners are done: on busy cores it once ran its rounds out before they
    had started, and the test saw one merged round instead of a swarm."""
    import time

    def join(i: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen(
            [*tb.exec_prefix(i), sys.executable, "-m", "p2pdiloco.cli", "join", "--listen",
             f"/ip4/{tb.address(i)}/tcp/0", "--name", f"p{i}", *extra, "--model", "tiny", "--threads", "1",
             "-H", "10", "--compression", "int4", "--eval-every", "0",
             "--checkpoint-every", "0", "--log-dir", str(tmp_path), "--run-id", "hosts"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    with Testbed(3, Link(rate_mbit=20, delay_ms=20), prefix="p2pdt-swarm") as tb:
        procs = []
        try:
            procs.append(join(0))
            deadline = time.monotonic() + 60
            while not (tmp_path / "p0.addrs").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            initial = ["--initial-peers", (tmp_path / "p0.addrs").read_text().split()[0]]
            procs += [join(i, *initial, "--max-rounds", "3") for i in (1, 2)]
            codes = [p.wait(timeout=150) for p in procs[1:]]
            procs[0].send_signal(signal.SIGTERM)  # it leaves gracefully
            codes.insert(0, procs[0].wait(timeout=60))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert codes == [0, 0, 0], [(tmp_path / f"p{i}.log").read_text()[-2000:] for i in range(3)]
    rounds = [r for i in range(3) for r in of_kind(read_records(tmp_path / f"p{i}.jsonl"), Round)]
    merged = [r for r in rounds if r.applied and len(r.members) > 1]
    assert len(merged) >= 4, [r.reason for r in rounds]
    by_version = {}
    for r in merged:
        by_version.setdefault(r.version, set()).add(r.digest)
    assert all(len(d) == 1 for d in by_version.values()), by_version


def test_a_testbed_removes_only_its_own_namespaces():
    with Testbed(1, prefix="p2pdt-other") as other:
        with Testbed(1, prefix="p2pdt"):
            pass
        assert sorted(other.namespaces()) == ["p2pdt-other-hub", "p2pdt-other-p0"]


def test_sigterm_to_a_process_holding_a_testbed_removes_its_namespaces_and_delay_line():
    """SIGTERM's default would end Python without its cleanup: a benchmark stopped so left everything behind."""
    holder = subprocess.Popen([sys.executable, "-c", (
        "import time\n"
        "from p2pdiloco.ops.testbed import Link, Testbed\n"
        "with Testbed(2, Link(rate_mbit=50, delay_ms=5), prefix='p2pdt-term') as tb:\n"
        "    print(tb._delayline.pid, flush=True)\n"
        "    time.sleep(120)\n")], stdout=subprocess.PIPE, text=True)
    try:
        delayline = int(holder.stdout.readline())
        assert Testbed(2, prefix="p2pdt-term").namespaces()
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(30) == 128 + signal.SIGTERM
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert Testbed(2, prefix="p2pdt-term").namespaces() == []
    with pytest.raises(ProcessLookupError):
        os.kill(delayline, 0)


SPIN = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"


def test_the_delay_line_sends_on_time_while_every_core_is_busy():
    """A benchmark's peers keep the cores busy. The line must still send each packet when it is due, or it adds
    delay the link does not have: at normal priority, with 4 peers on `large` sharing 2 cores, half the packets
    went out over 5 ms late (up to 360 ms). Here two spinning processes per core stand in for the peers."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        with Testbed(2, Link(rate_mbit=50, delay_ms=10), prefix="p2pdt-test") as tb:
            measure(tb, "tcp")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
    counts = tb.delayline_counts
    assert counts["realtime"] == 1, counts
    assert counts["late_over_5ms"] <= 0.01 * counts["sent"], counts  # normal priority: 3.4-6.4 % (measured)
