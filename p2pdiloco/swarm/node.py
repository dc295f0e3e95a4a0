"""DHT lifetime: start a node with network hygiene, report addresses, fail clearly on unreachable peers."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from hivemind import DHT

from p2pdiloco.config import SwarmConfig
from p2pdiloco.swarm.auth import ENV as SWARM_KEY_ENV, SwarmKeyAuthorizer, SwarmKeyError, load_swarm_key
from p2pdiloco.swarm.signing import Identity, IdentityError


STOP_WAIT = 2.0  # seconds the DHT and averager processes get to stop before they are terminated: a leave
# has 10 s in all, 4 of which the round in flight may take


class SwarmConnectError(RuntimeError):
    """Could not join the swarm; the message says which peers were tried."""


def dht_kwargs(cfg: SwarmConfig) -> dict:
    """NAT port mapping, autonat and relays probe real interfaces: off unless the user asks for them."""
    kwargs = dict(
        host_maddrs=list(cfg.listen),
        nat_port_map=cfg.nat_traversal,
        auto_nat=cfg.nat_traversal,
        use_relay=cfg.nat_traversal,
        use_auto_relay=cfg.nat_traversal,
        # a read our node's copy answered (a round's poll, a beat) would otherwise schedule hivemind's refresh of
        # that cached copy: a search of the swarm a second later for a newer one, which our polls and beats do not
        # need (they fetch every copy themselves where their own is not current; docs/bandwidth.md)
        cache_refresh_before_expiry=0,
    )
    if cfg.announce:
        kwargs["announce_maddrs"] = list(cfg.announce)
    return kwargs


def identity_of(cfg: SwarmConfig) -> Identity:
    """The identity `--identity` names (made there if missing), or a fresh one."""
    try:
        return Identity.at(cfg.identity)
    except IdentityError as e:
        raise SwarmConnectError(str(e)) from None


def start_dht(cfg: SwarmConfig, identity: Identity, client_mode: bool = False,
              leaving: Callable[[], bool] = lambda: False) -> DHT:
    """Start (and bootstrap) a DHT node in a background process, bounded by `cfg.connect_timeout`, and by
    `leaving()`: a peer asked to stop while it connects leaves at once (its lifeline takes down what the start
    spawned). Its peer id is `identity`'s, which signs its records and checks everyone's. A client
    (`client_mode`) asks others and serves nothing: onlookers such as `p2pdiloco status`, and peers that nobody
    can dial (`cfg.client_mode`)."""
    check_addresses(cfg)
    with identity.file() as identity_path:
        return _start(cfg, dict(dht_kwargs(cfg), client_mode=client_mode or cfg.client_mode,
                                identity_path=identity_path, record_validators=[identity.validator()],
                                # hivemind asks the swarm whether a kept identity is in use already; a fresh one
                                # cannot be (the ask starts a daemon of its own: seconds off every start)
                                check_if_identity_free=identity.path is not None), leaving)


def _start(cfg: SwarmConfig, kwargs: dict, leaving: Callable[[], bool]) -> DHT:
    try:
        key = load_swarm_key(cfg.swarm_key_file)
    except SwarmKeyError as e:
        raise SwarmConnectError(str(e)) from None
    if key is not None:
        kwargs["authorizer"] = SwarmKeyAuthorizer(key)
    initial = list(cfg.initial_peers) or None
    future = concurrent.futures.Future()
    # a daemon thread, not a pool's: the interpreter's exit must not wait for a start we gave up on
    threading.Thread(target=_into, args=(future, _without_sigint, DHT), daemon=True, name="dht-start", kwargs=dict(
        initial_peers=initial, start=True, startup_timeout=cfg.connect_timeout, shutdown_timeout=STOP_WAIT,
        **kwargs)).start()
    deadline = time.monotonic() + cfg.connect_timeout + 5
    while not future.done() and time.monotonic() < deadline and not leaving():
        concurrent.futures.wait([future], timeout=0.1)
    if not future.done():
        why = "asked to stop while connecting" if leaving() else f"no answer within {cfg.connect_timeout:.0f} s"
        raise SwarmConnectError(_unreachable(cfg, why))
    try:
        dht = future.result()
    except Exception as e:  # hivemind raises several types here (P2PDaemonError, ValueError, ...)
        raise SwarmConnectError(_unreachable(cfg, f"{type(e).__name__}: {e}")) from None
    if initial and not _has_neighbours(dht):
        dht.shutdown()
        raise SwarmConnectError(_unreachable(cfg, "no initial peer answered"))
    return dht


def _into(future: concurrent.futures.Future, make, *args, **kwargs) -> None:
    try:
        future.set_result(make(*args, **kwargs))
    except BaseException as e:
        future.set_exception(e)


def check_addresses(cfg: SwarmConfig) -> None:
    """Every address parses, and an initial peer names its peer id: said before any daemon starts."""
    from hivemind.utils.multiaddr import Multiaddr

    for flag, addresses in (("--initial-peers", cfg.initial_peers), ("--listen", cfg.listen),
                            ("--announce", cfg.announce)):
        for address in addresses:
            try:
                protocols = [p.name for p in Multiaddr(address).protocols()]
            except Exception as e:  # the parser raises several types
                raise SwarmConnectError(f"{flag} {address}: not a valid multiaddr ({e})") from None
            if flag == "--initial-peers" and "p2p" not in protocols:
                raise SwarmConnectError(f"{flag} {address}: no /p2p/PEER_ID part; give the whole address a live "
                                        f"peer printed, e.g. /ip4/1.2.3.4/tcp/31337/p2p/Qm...")


def _without_sigint(make, *args, **kwargs):
    """Run `make` in this (helper) thread with SIGINT blocked: the processes it spawns inherit the mask
    through fork and exec. That keeps a terminal's Ctrl-C, sent to the whole process group, away from the
    DHT's process, its p2pd and torch's shared-memory manager (started with the first shared tensor, here):
    had the manager died with it, the peer would abort at exit. The peer itself takes the Ctrl-C and shuts
    them down in order."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    return make(*args, **kwargs)


async def _count_neighbours(_dht, node) -> int:  # runs inside the DHT process (must be picklable)
    return len(node.protocol.routing_table.uid_to_peer_id)


def _has_neighbours(dht: DHT) -> bool:
    return dht.run_coroutine(_count_neighbours) > 0


async def _ping_all(_dht, node, peers: list[str]) -> int:  # runs inside the DHT process (must be picklable)
    from hivemind.p2p import PeerID

    for peer in peers:
        await node.protocol.call_ping(PeerID.from_base58(peer))  # one that answers goes back in the routing table
    return len(node.protocol.routing_table.uid_to_peer_id)


def rejoin(dht: DHT, initial_peers: Sequence[str]) -> int:
    """Ping our initial peers again; our neighbours after. A DHT node forgets a peer that stopped answering and
    never asks it again: a client whose only public peers were a node that restarted would stay alone for good
    (measured: docs/internet.md). Its daemon still knows their addresses, so a ping finds them back."""
    ids = [address.rsplit("/p2p/", 1)[1] for address in initial_peers if "/p2p/" in address]
    return dht.run_coroutine(functools.partial(_ping_all, peers=ids)) if ids else 0


def _unreachable(cfg: SwarmConfig, why: str) -> str:
    peers = ", ".join(cfg.initial_peers) if cfg.initial_peers else "(none)"
    key = "this swarm's key" if cfg.swarm_key_file or os.environ.get(SWARM_KEY_ENV) else "--swarm-key-file"
    return (f"could not join the swarm through {peers}: {why}. Check that the address is a live peer's and, if "
            f"the swarm requires a key, that you pass {key}")


def visible_addresses(dht: DHT) -> list[str]:
    return [str(addr) for addr in dht.get_visible_maddrs()]


def write_addresses(dht: DHT, path: Path) -> None:
    """Write this peer's multiaddrs atomically, one per line, for launchers and other peers to read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(visible_addresses(dht)) + "\n")
    tmp.replace(path)


def peer_id(dht: DHT) -> str:
    return dht.peer_id.to_base58()


def shutdown(dht: Optional[DHT]) -> None:
    if dht is not None and dht.is_alive():
        dht.shutdown()
