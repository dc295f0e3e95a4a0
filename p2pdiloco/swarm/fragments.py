"""A fragment's rounds over hivemind: fragment i of P is a swarm of its own within the run. It has its own run id
(fragment 0 the run's), and so its own records, its own island prefix (matchmaking never puts two fragments in
one group) and its own state donors, served by its own averager with a buffer of the fragment's size. The P
averagers of a peer hold the model's size between them, as one averager does with P = 1, and P = 1 is the run
itself."""

from __future__ import annotations

import dataclasses

from p2pdiloco.config import SwarmConfig


def fragment_config(cfg: SwarmConfig, i: int, p: int) -> SwarmConfig:
    """Fragment i's swarm settings: the run's, under the fragment's run id: the run's own for fragment 0, so that
    a peer of another P meets its records and the checks at join refuse the mismatch (the settings carry P), and
    `RUN_fIofP` for the others."""
    if not 0 <= i < p:
        raise ValueError(f"fragment {i} of {p}")
    return cfg if i == 0 else dataclasses.replace(cfg, run_id=f"{cfg.run_id}_f{i}of{p}")
