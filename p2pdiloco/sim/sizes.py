"""How long the network takes, from sizes: the model's parameters, the wire format's bits, the island's size, and
the learners' links (bandwidth and one-way latency). A measured time given in the parameters (sim_vs_chaos)
stands in for the computed one."""

from __future__ import annotations

from p2pdiloco.core import codec
from p2pdiloco.sim.params import SimParams

STATE_BYTES_PER_PARAM = 8  # a downloaded global state: Θ and the outer momentum, fp32


def _bytes_per_s(p: SimParams) -> float:
    return p.bandwidth_gbit * 1e9 / 8


def _latency(p: SimParams) -> float:
    return p.latency_ms / 1000.0


def allreduce_seconds(p: SimParams, members: int) -> float:
    """An island's exact all-reduce: each member sends its codes of the others' parts and the sums of its own part
    (packed to `codec.sum_width`), and receives as much (full duplex), in two exchanges of a round trip each."""
    if members <= 1:
        return 0.0  # alone, there is nobody to sync with
    if p.sync_seconds is not None:
        return p.sync_seconds
    bits = codec.BITS[p.compression]
    share = (members - 1) / members * p.model_params
    sent = share * (bits + codec.sum_width(bits, members)) / 8
    return sent / _bytes_per_s(p) + 4 * _latency(p)


def central_seconds(p: SimParams) -> float:
    """The ideal central synchronizer's round trip: the learner's codes up, the merged update down (at the wire's
    bits: a sum would take more), no matchmaking."""
    if p.sync_seconds is not None:
        return p.sync_seconds
    bits = codec.BITS[p.compression]
    return 2 * p.model_params * bits / 8 / _bytes_per_s(p) + 2 * _latency(p)


def download_seconds(p: SimParams) -> float:
    """A restarted learner fetches the newest global state (Θ and momentum): one request, then the bytes."""
    return p.model_params * STATE_BYTES_PER_PARAM / _bytes_per_s(p) + 2 * _latency(p)


def join_seconds(p: SimParams) -> float:
    """Finding an island and joining it: three round trips (read the records, ask the leader, be accepted). It is
    the grace window's floor, as hivemind's matchmaking time is a peer's."""
    if p.join_seconds is not None:
        return p.join_seconds
    return 6 * _latency(p)
