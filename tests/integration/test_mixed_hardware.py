"""A CPU peer and a GPU peer in one island end every round bitwise-equal: the exact integer sums and the outer
step, correctly rounded fp32 on the CPU of every peer, do not depend on where the inner steps ran. Skipped
where torch sees no CUDA device; scripts/gpu_checks.sh runs it on a GPU machine."""

import pytest
import torch

from tests.harness.swarm import digests_by_version, local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device here (scripts/gpu_checks.sh runs it)")]


@pytest.mark.parametrize("compression", ["none", "int4"])
def test_a_cpu_peer_and_a_gpu_peer_merge_and_hold_bitwise_equal_states(tmp_path, compression):
    with local_swarm(tmp_path, f"mixed-{compression}") as swarm:
        swarm.start_peer("cpu", "--device", "cpu", "-H", "15", "--max-rounds", "4", "--compression", compression)
        swarm.start_peer("gpu", "--device", "cuda", "--inner-optimizer", "adamw8bit", "-H", "15",
                         "--max-rounds", "4", "--compression", compression)
        swarm.wait_clean(["cpu", "gpu"], timeout=500)
        both = [r for name in ("cpu", "gpu") for r in swarm.records(name, "round")
                if r.applied and len(r.members) == 2]
        assert len(both) >= 4, [r.reason for name in ("cpu", "gpu") for r in swarm.records(name, "round")]
        for version, digests in digests_by_version(swarm, ["cpu", "gpu"]).items():
            assert len(digests) == 1, f"the CPU and GPU peers disagree at version {version}: {digests}"
        summary = swarm.records("gpu", "summary")[-1]
        assert summary.device_peak_bytes and summary.final_val < summary.initial_val
