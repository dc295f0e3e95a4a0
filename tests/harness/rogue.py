"""A stranger that speaks hivemind's averaging protocol and nothing of p2pdiloco's: a plain DecentralizedAverager
that only names its class like ours (hivemind names its RPC handlers after the class, so this is all it takes to
reach our islands), asks to join the run's islands again and again and gathers random bytes. Issue 11 measured
such a peer getting into 34 of its 35 rounds and cutting the honest peers' merged rounds to 9 of 105.

    python -m tests.harness.rogue BOOTSTRAP_ADDRESS RUN_ID MODEL SECONDS

It averages tensors of the honest peers' shapes (so hivemind's matchmaking takes it) and prints one line per
attempt: `rogue ATTEMPT grouped|failed` (after `rogue up`).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from hivemind import DHT, DecentralizedAverager

# only to find the run's islands and their buffer size, as anyone reading p2pdiloco's source could
from p2pdiloco.config import OuterConfig, SwarmConfig
from p2pdiloco.swarm.averager import AVERAGED_CHUNK
from p2pdiloco.swarm.wiring import averager_prefix
from p2pdiloco.training.model import build_model


class ExactAverager(DecentralizedAverager):
    """p2pdiloco's averager's name, none of its code."""


def main() -> int:
    address, run_id, model, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    swarm = SwarmConfig(run_id=run_id)
    with torch.device("meta"):
        n_params = sum(p.numel() for p in build_model(model, 0).parameters())
    dht = DHT(initial_peers=[address], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], nat_port_map=False,
              auto_nat=False, use_relay=False)
    buffer = torch.randn(n_params)  # in the honest peers' chunks: hivemind's
    # leaders take only followers whose tensors hash the same
    averager = ExactAverager(list(buffer.split(AVERAGED_CHUNK)), dht, start=True,
                             prefix=averager_prefix(swarm, OuterConfig()), min_group_size=2,
                             target_group_size=swarm.max_island, min_matchmaking_time=2.0, request_timeout=1.0,
                             allreduce_timeout=5.0)  # back to asking soon: as persistent as it can be
    print("rogue up", flush=True)
    deadline, attempt = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        attempt += 1
        try:
            grouped = averager.step(gather=os.urandom(48), timeout=10, allow_retries=False) is not None
        except Exception:  # whatever the honest peers do to it
            grouped = False
        print(f"rogue {attempt} {'grouped' if grouped else 'failed'}", flush=True)
    averager.shutdown()
    dht.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
