"""Whether a joining peer can merge with the swarm: the settings every member of an island must share, compared
at join time, so a mismatch is refused with a message naming the setting instead of failing round after round.

Peers with another codec or merge rule would never even meet in an island (they look for groups under another
key), and one with another model would be rejected from every island it met; either way it would train alone
without knowing why.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from p2pdiloco.protocol.remote import WIRE_VERSION, PeerRecord


def mismatch(mine: dict[str, str], others: Sequence[PeerRecord]) -> Optional[str]:
    """Why we cannot merge with the live peers (the first setting where we differ from most of them), or None."""
    published = [r.settings for r in others if r.settings]
    if not published:
        return None
    for key in sorted(set(mine) | {k for s in published for k in s}):
        swarm_value, count = Counter(s.get(key, "(not set)") for s in published).most_common(1)[0]
        ours = mine.get(key, "(not set)")
        if ours != swarm_value:
            return (f"this peer's {key} is {ours!r} but the swarm's is {swarm_value!r} ({count} of "
                    f"{len(published)} live peers): join with the swarm's {key}, or start another swarm with "
                    f"another --run-id")
    return None


def wire_mismatch(other_wires: Counter, live: int) -> Optional[str]:
    """Why we cannot merge where most live peers speak another wire version (`other_wires`: version → peers;
    `live`: the peers of our version), naming both versions, or None. Another version's records and parts may
    mean other things, so nothing else of theirs is read."""
    if not other_wires:
        return None
    theirs, count = other_wires.most_common(1)[0]
    if count <= live:
        return None
    said = "an unreadable version" if theirs < 0 else f"wire version {theirs}"
    hint = "upgrade p2pdiloco" if theirs > WIRE_VERSION else "the swarm runs an older p2pdiloco: run the same release"
    total = sum(other_wires.values()) + live
    return (f"this peer speaks wire version {WIRE_VERSION} but {count} of {total} live peers speak {said}: "
            f"{hint}, or start another swarm with another --run-id")
