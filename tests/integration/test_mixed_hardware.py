"""A CPU peer and a GPU peer in one island end every round bitwise-equal: the exact integer sums and the outer
step, correctly rounded fp32 on the CPU of every peer, do not depend on where the inner steps ran. Skipped
where torch sees no CUDA device; scripts/bench/gpu_checks.sh runs it on a GPU machine."""

import pytest
import torch

from tests.harness.swarm import digests_by_version, local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device here (scripts/bench/gpu_checks.sh runs it)")]


# Both contribute every 2 s (time-budgeted H), so the faster one brings more tokens and adds more; quorum 2, so
# neither merges alone however far apart they start (on a 16-core GPU machine the CPU peer once did all its rounds
# before the GPU peer had imported bitsandbytes and started CUDA).
ARGS = ["--round-seconds", "2", "--quorum", "2", "--max-time", "40"]


@pytest.mark.parametrize("compression", ["none", "int4"])
def test_a_cpu_peer_and_a_gpu_peer_merge_and_hold_bitwise_equal_states(tmp_path, compression):
    with local_swarm(tmp_path, f"mixed-{compression}") as swarm:
        swarm.start_peer("cpu", "--device", "cpu", *ARGS, "--compression", compression)
        swarm.start_peer("gpu", "--device", "cuda", "--inner-optimizer", "adamw8bit", *ARGS,
                         "--compression", compression)
        swarm.wait_clean(["cpu", "gpu"], timeout=500)
        joint = {name: [r for r in swarm.records(name, "round") if r.applied and len(r.members) == 2]
                 for name in ("cpu", "gpu")}
        assert all(len(rs) >= 4 for rs in joint.values()), \
            [(r.applied, r.reason) for name in ("cpu", "gpu") for r in swarm.records(name, "round")]
        for version, digests in digests_by_version(swarm, ["cpu", "gpu"]).items():
            assert len(digests) == 1, f"the CPU and GPU peers disagree at version {version}: {digests}"
        for r in joint["gpu"]:  # the same seconds: whoever trained more tokens adds more to the merge, w·|Δ|
            more = max(range(2), key=lambda i: r.member_tokens[i])
            if r.member_tokens[more] < 1.5 * r.member_tokens[1 - more]:
                continue  # about as fast: noise could order them either way
            adds = [w * n for w, n in zip(r.weights, r.member_norms)]
            assert adds[more] > adds[1 - more], (r.member_tokens, r.member_norms, r.weights, r.bounded)
        print("per joint round: tokens, |Δ|, weights, bounds:",
              *[(r.member_tokens, r.member_norms, r.weights, r.bounded) for r in joint["gpu"]], sep="\n")
        summary = swarm.records("gpu", "summary")[-1]
        assert summary.device_peak_bytes and summary.final_val < summary.initial_val
