"""A SwarmMerger built through its constructor from fakes: no DHT, no averager process, no network."""

import dataclasses
import threading
from typing import Optional

from p2pdiloco.config import OuterConfig, SwarmConfig
from p2pdiloco.core import codec
from p2pdiloco.protocol.timing import RoundClock
from p2pdiloco.swarm.rounds import SwarmMerger
from p2pdiloco.swarm.wiring import MergeSettings


def fake_merger(n: int, averager=None, heartbeat=None, fetcher=None, feedback: Optional[codec.ErrorFeedback] = None,
                why_not_adopt=lambda metadata, tensors, corroborated: None, bits: int = codec.BITS["none"],
                peer: str = "me", stop: Optional[threading.Event] = None, **swarm) -> SwarmMerger:
    compression = next(name for name, b in codec.BITS.items() if b == bits)
    cfg = dataclasses.replace(SwarmConfig(), compression=compression, **swarm)
    settings = MergeSettings(cfg, OuterConfig(), n, (), overlap_steps=10, peer=peer)
    return SwarmMerger(settings, None, averager, heartbeat, fetcher, feedback, why_not_adopt,
                       stop or threading.Event(), RoundClock())
