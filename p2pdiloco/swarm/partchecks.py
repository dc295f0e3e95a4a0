"""What the fp32 all-reduce parts we reduce may hold: checked one streamed message at a time, before hivemind
sums it (hivemind adds each message in as it arrives, so a part cannot be judged whole and then left out).

Each message must be what p2pdiloco.core.exact sends: finite integers within ±limit, at weight 1. Its body
values must also stay within what their sender claimed (p2pdiloco.core.claims), which needs to know where in
the buffer a message lies: hivemind cuts the buffer into parts of `part_size_bytes` and hands each reducer a
contiguous run of them, in order. We lay the same buffer out with hivemind's own TensorPartContainer (on
meta tensors: no memory) to find where our run begins (hivemind==1.1.12; its tests drive the same class).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES, TensorPartContainer
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import averaging_pb2

from p2pdiloco.core.claims import Claims, claims_in_codes


def reducer_start(tensor_sizes: Sequence[int], fractions: Sequence[float], index: int,
                  part_size_bytes: int = DEFAULT_PART_SIZE_BYTES) -> tuple[int, int]:
    """(first element of reducer `index`'s share of the flat buffer, elements per streamed part). Parts are cut
    from each tensor in turn; every tensor but the last is a whole number of parts (`check_layout`)."""
    container = TensorPartContainer([torch.empty(n, device="meta") for n in tensor_sizes], fractions,
                                    part_size_bytes=part_size_bytes)
    per_part = part_size_bytes // 4  # fp32, no compression
    return sum(container.num_parts_by_peer[:index]) * per_part, per_part


def check_layout(tensor_sizes: Sequence[int], part_size_bytes: int = DEFAULT_PART_SIZE_BYTES) -> None:
    """Parts lie at multiples of the part size only if every tensor but the last is cut into whole parts."""
    per_part = part_size_bytes // 4
    if any(n % per_part for n in tensor_sizes[:-1]):
        raise ValueError(f"averaged tensors must be whole multiples of {per_part} elements but the last")


def claims_for(plan, senders: Sequence[int], peer_ids: Sequence, scales: torch.Tensor, limit: int,
               maxima: bool = True) -> dict[str, Claims]:
    """Sender peer id → its claims in code units, for the plan's included `senders` (group indices)."""
    return {str(peer_ids[i]): claims_in_codes(plan.maxabs[i], plan.clipped[i], plan.norms[i], plan.weights[i],
                                              scales, limit, maxima) for i in senders}


@dataclass
class ExactPartCheck:
    """One group's fp32 parts as we reduce them: each sender's messages, in order, checked one by one."""

    limit: int
    n_elements: int = 0  # the body; past it lies the checksum tail (limbs and markers), held to ±limit only
    start: int = 0  # our share's first element
    part_elements: int = DEFAULT_PART_SIZE_BYTES // 4
    claims: dict = field(default_factory=dict)  # sender → Claims; a sender without them gets the basic checks

    def why_not(self, message: averaging_pb2.AveragingData, sender: str, index: int) -> str:
        """Why message `index` of `sender`'s stream is not what an honest member sends, or ""."""
        problem, values = basic_problem(message, self.limit)
        if problem or values is None:
            return problem
        claims: Optional[Claims] = self.claims.get(sender)
        offset = self.start + index * self.part_elements
        if claims is None or offset >= self.n_elements:
            return ""
        return claims.why_not(values[: self.n_elements - offset], offset)


def basic_problem(message: averaging_pb2.AveragingData, limit: int) -> tuple[str, Optional[torch.Tensor]]:
    """(why a message is not what p2pdiloco.core.exact sends, or ""; its values): every value an integer within
    ±limit (the codes; the checksum tail's limbs and markers fit too), at weight 1 (hivemind weighs the mean by
    what each sender claims)."""
    if message.weight != 1.0:
        return f"weight {message.weight}, not 1", None
    if not message.HasField("tensor_part"):
        return "", None
    try:
        values = deserialize_torch_tensor(message.tensor_part)
    except Exception as e:  # bytes that make no tensor
        return f"undecodable ({type(e).__name__})", None
    if values.dtype != torch.float32:
        return f"dtype {values.dtype}, not float32", None
    if not bool(torch.isfinite(values).all()):
        return "non-finite values", None
    if values.numel() and float(values.abs().max()) > limit:
        return f"values beyond ±{limit}", None
    if not torch.equal(values, values.round()):
        return "values that are not integers", None
    return "", values.reshape(-1)
