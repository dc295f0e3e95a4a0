"""Can peers behind NATs be dialled through a libp2p circuit relay with the installed hivemind? (docs/multi-machine.md)

    sudo .venv/bin/python scripts/probes/probe_relays.py [--size-mb 32]

Testbed of 3 hosts: host 0 is public and runs a hivemind DHT node with relay service (reachability forced public:
with autonat off, libp2p never offers relays otherwise); hosts 1 and 2 each sit behind their own NAT. Host 2 listens
on nothing and takes a relay slot (no_listen + auto-relay), as hivemind's own relay test sets it up. Then host 1
dials host 2 by peer id: a DHT ping, then a binary stream of --size-mb. Run once with host 1 public and once with
host 1 behind a NAT (relayed too). Prints what worked. Bare hivemind: no p2pdiloco code is in the path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

HYGIENE = dict(start=True, use_ipfs=False, nat_port_map=False, auto_nat=False)
RELAYED = dict(host_maddrs=[], no_listen=True, use_relay=True, use_auto_relay=True, client_mode=False)


async def _ping(_dht, node, target: str):
    from hivemind.p2p import PeerID

    return await node.protocol.call_ping(PeerID.from_base58(target))


def node(role: str, address: str, out: str, size: int, peers: list[str]) -> None:
    """One DHT node; roles: relay, target (relayed, serves `size` bytes), dialer (public if `address`)."""
    import hivemind
    from hivemind.p2p import PeerID

    if role == "relay":
        dht = hivemind.DHT(host_maddrs=[f"/ip4/{address}/tcp/0"], use_relay=True, force_reachability="public",
                           **HYGIENE)
    elif address:
        dht = hivemind.DHT(initial_peers=peers, host_maddrs=[f"/ip4/{address}/tcp/0"], use_relay=False, **HYGIENE)
    else:
        dht = hivemind.DHT(initial_peers=peers, **RELAYED, **HYGIENE)

    async def serve(_info, _reader, writer):
        writer.write(b"x" * size)
        await writer.drain()
        writer.close()

    async def main() -> dict:
        p2p = await dht.replicate_p2p()
        if role == "target":
            await p2p.add_binary_stream_handler("probe", serve)
        if role != "dialer":
            info = dict(id=str(dht.peer_id), maddrs=[] if role == "target" else
                        [str(m) for m in dht.get_visible_maddrs()])
            Path(out).write_text(json.dumps(info))
            await asyncio.sleep(600)  # killed by the driver
        target = json.loads(Path(out).read_text())["id"]
        start, ping = time.monotonic(), None
        while ping is None and time.monotonic() - start < 60:
            ping = dht.run_coroutine(partial(_ping, target=target))
            await asyncio.sleep(0 if ping else 2)
        result = dict(ping_after_s=round(time.monotonic() - start, 1) if ping else None)
        start = time.monotonic()
        try:
            _, reader, _ = await p2p.call_binary_stream_handler(PeerID.from_base58(target), "probe")
            got = 0
            while chunk := await reader.read(1 << 20):
                got += len(chunk)
            result.update(stream_bytes=got, stream_s=round(time.monotonic() - start, 2))
        except Exception as e:  # what the daemon says is the finding
            result.update(stream_error=f"{type(e).__name__}: {e}")
        return result

    result = asyncio.run(main())
    print(json.dumps(result), flush=True)
    dht.shutdown()


def probe(dialer_natted: bool, size: int, tmp: Path) -> dict:
    from p2pdiloco.ops.launcher import stop_tree
    from p2pdiloco.ops.testbed import Testbed

    natted = frozenset({1, 2} if dialer_natted else {2})
    me = [sys.executable, __file__, "--node"]
    with Testbed(3, prefix="p2pdt-rp", natted=natted) as tb:
        procs = []
        try:
            relay_out, target_out = tmp / "relay.json", tmp / "target.json"
            for f in (relay_out, target_out):
                f.unlink(missing_ok=True)
            procs.append(subprocess.Popen([*tb.exec_prefix(0), *me, "relay", tb.host_address(0), str(relay_out),
                                           str(size)]))
            wait(relay_out)
            relay = json.loads(relay_out.read_text())["maddrs"]
            procs.append(subprocess.Popen([*tb.exec_prefix(2), *me, "target", "", str(target_out), str(size),
                                           *relay]))
            wait(target_out)
            dialer = subprocess.run([*tb.exec_prefix(1), *me, "dialer", "" if dialer_natted else tb.host_address(1),
                                     str(target_out), str(size), *relay], capture_output=True, text=True,
                                    timeout=240)
            lines = [line for line in dialer.stdout.splitlines() if line.startswith("{")]
            return json.loads(lines[-1]) if lines else dict(error=dialer.stderr[-2000:])
        finally:
            for p in procs:
                stop_tree(p, grace=5)


def wait(path: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{path.name} never appeared: a node did not start")
        time.sleep(0.3)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--node":
        role, address, out, size, *peers = sys.argv[2:]
        node(role, address, out, int(size), peers)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=32)
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("the testbed needs root (network namespaces)")
    with tempfile.TemporaryDirectory(prefix="probe-relays-") as tmp:
        for dialer_natted in (False, True):
            what = "a relayed peer dials" if dialer_natted else "a public peer dials"
            print(f"{what} a relayed peer: {probe(dialer_natted, args.size_mb << 20, Path(tmp))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
