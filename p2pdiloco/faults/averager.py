"""Faults of the averager's process: dying mid all-reduce or mid state transfer, and serving state slowly. Like
every module outside swarm/, it does not import hivemind: it overrides our own methods, whose requests and contexts
it only passes on or reads as swarm.statefetch does."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
from collections import Counter
from typing import Optional

from p2pdiloco.faults.plan import FaultPlan
from p2pdiloco.faults.reducer import BendingReduction
from p2pdiloco.swarm.averager import ExactAverager
from p2pdiloco.swarm.statefetch import parse_part_request

logger = logging.getLogger(__name__)
SLOW_PART_SECONDS = 0.2  # `slow_sharing`: each part of our state this late


class FaultyAverager(ExactAverager):
    """`die_in_allreduce`, `die_while_sharing`, `slow_sharing` and `hostile_reducer` (p2pdiloco.faults.plan)."""

    def __init__(self, plan: FaultPlan, *args, **kwargs):
        self.plan = plan
        self._parts_served = Counter()  # by (requester, version, digest): parts of a state we sent it
        if plan.version_of("partition_until"):  # until then, islands only with peers of the same fault
            kwargs["initial_group_bits"] = "1"
        super().__init__(*args, **kwargs)
        if plan.version_of("hostile_reducer") is not None:  # the exchange's seam for the reductions it serves
            self._codes.reduction_type = functools.partial(BendingReduction, hide="own")

    async def _codes_round(self, island, plan, group_info, my_index: int, started: float):
        own = island.members[my_index]
        if own is not None and self.plan.due("die_in_allreduce", own.version):
            asyncio.get_running_loop().call_later(0.05, die)  # once our codes are on their way
        return await super()._codes_round(island, plan, group_info, my_index, started)

    async def _serve_part(self, request, context):
        await self._maybe_die_while_sharing(request, context)
        transfer = transfer_of(request, context)
        async for message in super()._serve_part(request, context):
            if self.plan.version_of("slow_sharing") is not None:
                await asyncio.sleep(SLOW_PART_SECONDS)  # after the snapshot is taken: late on the wire only
            yield message
            if message.HasField("tensor_part"):
                self._parts_served[transfer] += 1

    async def _maybe_die_while_sharing(self, request, context) -> None:
        """Die with a part request in flight; aimed at peers, once one got a part of this state from us (on
        loopback a whole part arrives in one message, so only a request we never answer reliably breaks a
        transfer midway)."""
        die_from, targets = self.plan.version_of("die_while_sharing"), self.plan.targets_of("die_while_sharing")
        transfer = transfer_of(request, context)
        if die_from is None or transfer is None or transfer[1] < die_from:
            return
        if targets and (transfer[0] not in targets or not self._parts_served[transfer]):
            return
        logger.warning(f"fault plan: dying while sharing state with {transfer[0]}")
        await asyncio.sleep(0.1)
        die()


# hivemind names a servicer's RPCs after its class ("ExactAverager.rpc_codes_push"): under its own name this
# subclass would speak to nobody. It keeps the production class's name, and so its protocol.
FaultyAverager.__name__ = FaultyAverager.__qualname__ = ExactAverager.__name__


def die() -> None:
    """SIGKILL the whole peer: its host process first, then this averager process."""
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def transfer_of(request, context) -> Optional[tuple[str, int, str]]:
    """(requester, version, digest) of a part request (hivemind's DownloadData), None if malformed."""
    try:
        version, digest, _, _ = parse_part_request(request.metadata)
    except ValueError:
        return None
    return str(context.remote_id), version, digest
