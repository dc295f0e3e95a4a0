"""A network testbed on one machine: N peers, each in its own network namespace, joined through a hub namespace by
veth links with a rate limit (tc tbf, both directions), one-way delay and packet loss.

Delay and loss: `netem` where the kernel has it, else a userspace delay line (p2pdiloco.ops.delayline) on a TUN
device in the hub; policy routing sends every packet entering the hub from a peer through it once. Addresses come
from 10.213.0.0/16 and live only inside namespaces this testbed creates; no namespace has a route out of them.
A private range, not the benchmarking one (198.18.0.0/15): libp2p's DHT keeps only public addresses in its WAN
table and only private ones in its LAN table, so with 198.18.x peers never learn each other's addresses and every
all-reduce between members that had not met fails ("routing: not found", measured). Everything it creates is named with its prefix and removed by name on exit.
Needs root; says so otherwise.

A peer can sit behind a NAT (`natted`), as most volunteers do: its namespace holds a private address
(192.168.i.2) behind a router namespace that masquerades its outgoing connections as the router's address and
forwards nothing inbound that the peer did not start (nftables: a masquerade rule and a stateful forward
filter). Others can answer it but never dial it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from p2pdiloco.ops.launcher import stop_tree, wait_for_file

# What a libp2p daemon a benchmark starts on the testbed is given: NAT port mapping, autonat and relays would
# probe interfaces beyond the testbed's (swarm.node.dht_kwargs turns them off the same way for peers)
NO_NAT_PROBING = dict(nat_port_map=False, auto_nat=False, use_relay=False, use_auto_relay=False)
TUN = "tbdelay"
FLOWS = [sys.executable, "-m", "p2pdiloco.ops.flows"]  # plain TCP between peers: the calibrations
ROUTE_TABLE = "100"


class TestbedError(RuntimeError):
    __test__ = False  # a name pytest would otherwise try to collect


@dataclass(frozen=True)
class Link:
    rate_mbit: float = 100.0
    delay_ms: float = 0.0  # one way: a round trip between two peers takes 2× this
    loss: float = 0.0  # share of packets dropped, 0..1

    def __post_init__(self):
        if not self.rate_mbit > 0 or self.delay_ms < 0 or not 0 <= self.loss < 1:
            raise TestbedError(f"bad link {self}: rate > 0, delay >= 0, loss in [0, 1)")


def loopback_bytes_sent() -> int:
    """Bytes sent on the loopback of the network namespace we run in (/proc/net/dev is per namespace): what a swarm
    on a private loopback puts on the wire, where nothing else uses it."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])
    raise RuntimeError("no loopback interface")


def sh(*args: str, check: bool = True, stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, input=stdin)
    if check and result.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def _exit_on_sigterm():
    """SIGTERM's default ends Python without running `finally` or `__exit__`: a benchmark stopped that way left
    its peers running and its namespaces behind. Within a testbed, SIGTERM exits like Ctrl-C does, through the
    cleanup (main thread only, where Python handles signals). The handler it replaces, or None where it put none."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def leave(signum, _frame):
        raise SystemExit(128 + signum)
    return signal.signal(signal.SIGTERM, leave) or signal.SIG_DFL  # None: one set outside Python, not ours to keep


def parse_counts(out: str) -> dict:
    """The delay line's last line, `received=3 dropped=0 ... late_max_ms=0.4`, as numbers."""
    lines = (out or "").strip().splitlines()
    pairs = [item.split("=", 1) for item in lines[-1].split()] if lines else []
    try:
        return {k: float(v) for k, v in pairs}
    except ValueError:  # not the counters (it died saying something else)
        return {}


def has_netem() -> bool:
    """Whether this kernel can add a netem qdisc (tried on a throwaway namespace's loopback)."""
    probe = "p2pdiloco-netem-probe"
    sh("ip", "netns", "add", probe)
    try:
        return sh("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                  check=False).returncode == 0
    finally:
        sh("ip", "netns", "del", probe, check=False)


@dataclass
class Testbed:
    __test__ = False  # a name pytest would otherwise try to collect
    peers: int
    link: Link = field(default_factory=Link)
    prefix: str = "p2pdt"
    seed: int = 0
    use_netem: Optional[bool] = None  # None: probe
    natted: frozenset = frozenset()  # indices of the peers behind a NAT
    rates: dict = field(default_factory=dict)  # peer index → its link's Mbit/s, where not `link`'s (a slow uplink)
    realtime_line: bool = True  # the delay line ahead of the peers for the CPU (see ops/delayline.py)
    line_tick_ms: float = 1.0  # the delay line wakes at most once per tick (0: for each packet)
    _delayline: Optional[subprocess.Popen] = None
    _on_sigterm: object = None  # the SIGTERM handler before ours, restored on exit
    delayline_counts: dict = field(default_factory=dict)  # the delay line's counters, once stopped
    created: list = field(default_factory=list)

    # ---- names and addresses --------------------------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def ns(self, i: int) -> str:
        return f"{self.prefix}-p{i}"

    def router(self, i: int) -> str:
        return f"{self.prefix}-nat{i}"

    @staticmethod
    def address(i: int) -> str:
        """Where peer i's traffic comes from, as the others see it (a natted peer's: its router's)."""
        return f"10.213.{i + 1}.2"

    def host_address(self, i: int) -> str:
        """The address on peer i's own interface: what it listens on (private behind a NAT)."""
        return f"192.168.{i + 1}.2" if i in self.natted else self.address(i)

    def exec_prefix(self, i: int) -> list[str]:
        """Run a command inside peer i's namespace: `[*tb.exec_prefix(i), 'python', ...]`."""
        return ["ip", "netns", "exec", self.ns(i)]

    def sysctl(self, setting: str) -> None:
        """`key=value` in every peer's namespace: an experiment's TCP setting (sockets live in the peers' namespaces;
        the hub only forwards)."""
        for i in range(self.peers):
            sh(*self.exec_prefix(i), "sysctl", "-qw", setting)

    def all_to_all_seconds(self, size: int, port: int = 5099) -> float:
        """Every peer sends `size` bytes of plain TCP to every other peer at once (p2pdiloco.ops.flows); the
        slowest peer's seconds until all its data arrived. What this testbed's links give a bare transport."""
        servers = [subprocess.Popen([*self.exec_prefix(i), *FLOWS, "serve", str(port), str(self.peers - 1)],
                                    stdout=subprocess.PIPE, text=True) for i in range(self.peers)]
        try:
            if any(s.stdout.readline().strip() != "ready" for s in servers):
                raise TestbedError("a flow server did not start")
            senders = [subprocess.Popen([*self.exec_prefix(i), *FLOWS, "send", str(size), str(port),
                                         *(self.address(j) for j in range(self.peers) if j != i)],
                                        stdout=subprocess.PIPE, text=True) for i in range(self.peers)]
            return max(float(p.communicate(timeout=600)[0]) for p in senders)
        finally:
            for s in servers:
                s.kill()
                s.wait()

    def duplex_seconds(self, size: int, trials: int, port: int = 5098) -> list[float]:
        """Peers 0 and 1 each send `size` bytes of plain TCP to the other at once, on one connection kept open for
        `trials` such exchanges 2 s apart: each trial's seconds. What a warm connection carries both ways."""
        server = subprocess.Popen([*self.exec_prefix(1), *FLOWS, "duplex-serve", str(port)], stdout=subprocess.PIPE,
                                  text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise TestbedError("the duplex server did not start")
            out = subprocess.run([*self.exec_prefix(0), *FLOWS, "duplex", str(size), str(trials), str(port),
                                  self.address(1)], stdout=subprocess.PIPE, text=True, timeout=600, check=True)
            return [float(s) for s in out.stdout.split()]
        finally:
            server.kill()
            server.wait()

    @staticmethod
    def role_arguments(parser: argparse.ArgumentParser, server: str, client: str) -> None:
        """The hidden flags `serve_and_ask` gives the two roles of a benchmark script."""
        parser.add_argument("--role", choices=[server, client], help=argparse.SUPPRESS)
        parser.add_argument("--address", help=argparse.SUPPRESS)  # ours on the testbed
        parser.add_argument("--address-file", type=Path, help=argparse.SUPPRESS)  # the server's: where it says
        parser.add_argument("--other", help=argparse.SUPPRESS)  # the client's: the server's multiaddr

    def serve_and_ask(self, serve: list[str], ask: list[str], timeout: float = 3600.0) -> list[dict]:
        """A server and a client across the testbed, for benchmarks (flags: `role_arguments`): `serve --address A
        --address-file FILE` runs in peer 0's namespace until it writes the address others reach it at to FILE;
        then `ask --address A --other ADDRESS` runs in peer 1's. Returns the JSON lines the client printed; the
        server's process tree is stopped."""
        with tempfile.TemporaryDirectory() as tmp:
            address_file = Path(tmp) / "address"
            server = subprocess.Popen([*self.exec_prefix(0), *serve, "--address", self.address(0),
                                       "--address-file", str(address_file)])
            try:
                other = wait_for_file(address_file, server, timeout=60)
                asked = subprocess.run([*self.exec_prefix(1), *ask, "--address", self.address(1), "--other", other],
                                       stdout=subprocess.PIPE, text=True, timeout=timeout)
            finally:
                stop_tree(server, grace=5.0)
        if asked.returncode != 0:
            raise TestbedError(f"the client exited with code {asked.returncode}: {asked.stdout[-2000:]}")
        return [json.loads(line) for line in asked.stdout.splitlines() if line.startswith("{")]

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        self._on_sigterm = _exit_on_sigterm()
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._on_sigterm is not None:
                signal.signal(signal.SIGTERM, self._on_sigterm)

    def start(self) -> None:
        if os.geteuid() != 0:
            raise TestbedError("the network testbed needs root (network namespaces, veth, tc); run it as root")
        for tool, package in (("ip", "iproute2"), ("tc", "iproute2")) + ((("nft", "nftables"),) if self.natted else ()):
            if shutil.which(tool) is None:
                raise TestbedError(f"the network testbed needs `{tool}` ({package})")
        if not set(self.natted) <= set(range(self.peers)):
            raise TestbedError(f"natted peers {sorted(self.natted)} are not among the {self.peers} peers")
        self.stop()  # leftovers of an earlier run with this prefix
        if self.use_netem is None:
            self.use_netem = has_netem()
        try:
            self._add_ns(self.hub)
            self._hub("sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._hub("sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
            self._hub("sysctl", "-qw", "net.ipv4.conf.default.rp_filter=0")
            for i in range(self.peers):
                self._add_peer(i)
            if not self.use_netem and (self.link.delay_ms or self.link.loss):
                self._start_delayline()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._delayline is not None:
            self._delayline.terminate()
            try:
                out, _ = self._delayline.communicate(timeout=5)
                self.delayline_counts = parse_counts(out)
            except subprocess.TimeoutExpired:
                self._delayline.kill()
                self._delayline.wait()
            self._delayline = None
        for name in self.namespaces():
            sh("ip", "netns", "del", name, check=False)  # removes its veth ends and the TUN device with it
        self.created.clear()

    def namespaces(self) -> list[str]:
        """The namespaces this testbed's names give (exactly: prefix `p2pdt` must not take `p2pdt-test-hub`)."""
        ours = re.compile(rf"{re.escape(self.prefix)}-(hub|p\d+|nat\d+)")
        listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
        return [line.split()[0] for line in listed if line.split() and ours.fullmatch(line.split()[0])]

    # ---- building -------------------------------------------------------------------------------------------
    def _add_ns(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.created.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _hub(self, *args: str) -> None:
        sh("ip", "netns", "exec", self.hub, *args)

    def _add_peer(self, i: int) -> None:
        """Peer i's namespace on its shaped link to the hub; a natted peer's router takes that place and the peer
        sits on a plain link behind it."""
        ns, hub_end, peer_end = self.ns(i), f"h{i}", f"v{i}"
        self._add_ns(ns)
        edge = self.router(i) if i in self.natted else ns  # the namespace on the hub's link
        if edge != ns:
            self._add_ns(edge)
        sh("ip", "link", "add", hub_end, "netns", self.hub, "type", "veth", "peer", "name", peer_end, "netns", edge)
        sh("ip", "-n", self.hub, "addr", "add", f"10.213.{i + 1}.1/24", "dev", hub_end)
        sh("ip", "-n", edge, "addr", "add", f"{self.address(i)}/24", "dev", peer_end)
        for where, dev in ((self.hub, hub_end), (edge, peer_end)):
            sh("ip", "-n", where, "link", "set", dev, "up")
            self._shape(where, dev, self.rates.get(i, self.link.rate_mbit))
        sh("ip", "-n", edge, "route", "add", "10.213.0.0/16", "via", f"10.213.{i + 1}.1")  # the hub: nothing else
        self._hub("sysctl", "-qw", f"net.ipv4.conf.{hub_end}.rp_filter=0")
        if edge != ns:
            self._add_nat(i, wan=peer_end)

    def _add_nat(self, i: int, wan: str) -> None:
        """Peer i behind its router: masqueraded on the way out, unreachable on the way in."""
        router, lan, inside = self.router(i), f"l{i}", f"v{i}"
        sh("ip", "link", "add", lan, "netns", router, "type", "veth", "peer", "name", inside, "netns", self.ns(i))
        sh("ip", "-n", router, "addr", "add", f"192.168.{i + 1}.1/24", "dev", lan)
        sh("ip", "-n", self.ns(i), "addr", "add", f"{self.host_address(i)}/24", "dev", inside)
        sh("ip", "-n", router, "link", "set", lan, "up")
        sh("ip", "-n", self.ns(i), "link", "set", inside, "up")
        sh("ip", "-n", self.ns(i), "route", "add", "10.213.0.0/16", "via", f"192.168.{i + 1}.1")
        sh("ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = (f"table ip p2pdt_nat {{\n"
                 f"  chain postrouting {{ type nat hook postrouting priority srcnat; oifname \"{wan}\" masquerade; }}\n"
                 f"  chain forward {{ type filter hook forward priority filter; policy drop;\n"
                 f"    iifname \"{lan}\" accept; ct state established,related accept; }}\n"
                 f"}}\n")
        sh("ip", "netns", "exec", router, "nft", "-f", "-", stdin=rules)

    def _shape(self, ns: str, dev: str, rate: float) -> None:
        """tbf on each direction at `rate` Mbit/s; its burst grows with the rate (a fixed 32 KB burst caps 1 Gbit/s
        at ~830)."""
        burst = max(32_000, int(rate * 1e6 / 8 / 250))
        tbf = ["tbf", "rate", f"{rate}mbit", "burst", str(burst), "latency", "100ms"]
        if self.use_netem and (self.link.delay_ms or self.link.loss):
            # half the delay on each side of the hub: one way crosses two such egresses
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem",
               "delay", f"{self.link.delay_ms / 2}ms", "loss", f"{self.link.loss * 50}%")
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def _start_delayline(self) -> None:
        self._delayline = subprocess.Popen(
            ["ip", "netns", "exec", self.hub, sys.executable, "-m", "p2pdiloco.ops.delayline", "--dev", TUN,
             "--delay-ms", str(self.link.delay_ms), "--loss", str(self.link.loss), "--seed", str(self.seed),
             "--tick-ms", str(self.line_tick_ms), *([] if self.realtime_line else ["--normal-priority"])],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = self._delayline.stdout.readline().strip()
        if ready != "ready":
            raise TestbedError(f"the delay line did not start: {ready}")
        # a queue that holds a burst while the line's processes catch up: a drop there would be the emulator's, not
        # the link's (500, the default, dropped 12 % of packets under 4 peers' all-to-all)
        self._hub("ip", "link", "set", TUN, "txqueuelen", "10000")
        self._hub("ip", "link", "set", TUN, "up")
        self._hub("sysctl", "-qw", f"net.ipv4.conf.{TUN}.rp_filter=0")
        self._hub("ip", "route", "add", "default", "dev", TUN, "table", ROUTE_TABLE)
        for i in range(self.peers):  # from a peer: through the delay line; from the delay line: the main table
            self._hub("ip", "rule", "add", "iif", f"h{i}", "lookup", ROUTE_TABLE)
