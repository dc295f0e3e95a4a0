#!/usr/bin/env bash
# Every GPU check of issue 13 in one command, on a machine with a CUDA device (run from the repository root):
#   bash scripts/gpu_checks.sh [OUT_DIR]
# 1. the CUDA tests (bf16 inner steps, pinned staging, 8-bit AdamW resumed bit-exactly on the GPU, a CPU peer
#    and a GPU peer bitwise-equal after merged rounds), inside a loopback-only network namespace;
# 2. one GPU peer of the ~100M `large` model: tokens/s and peak host and device memory, AdamW vs AdamW8bit;
# 3. compute utilization of 2 GPU peers in one swarm;
# 4. 4 peers vs 1 at equal wall-clock with a core per peer (scripts/bench_swarm_vs_solo.py).
# It needs a CUDA build of torch in .venv (scripts/setup.sh installs the CPU one: pip install torch first).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-checks}
mkdir -p "$OUT"
PY=.venv/bin/python
$PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.cuda.get_device_name())"
NS="unshare -n bash -c"
$NS "ip link set lo up && P2PDILOCO_NETNS=1 $PY -m pytest -q -p no:cacheprovider -rs \
  tests/unit/test_cuda.py tests/unit/test_checkpoint.py tests/integration/test_mixed_hardware.py" | tee "$OUT/tests.txt"
$NS "ip link set lo up && $PY scripts/bench_memory.py --models large --optimizers adamw,adamw8bit --device cuda \
  --batch-size 32 --seq-len 512 --inner-steps 50 --rounds 3 --peers 1 --threads 4 --out $OUT/memory-gpu.json" \
  | tee "$OUT/memory-gpu.txt"
$NS "ip link set lo up && $PY scripts/bench_memory.py --models large --optimizers adamw --device cuda \
  --batch-size 32 --seq-len 512 --inner-steps 50 --rounds 3 --peers 2 --threads 4 --out $OUT/two-gpu-peers.json" \
  | tee "$OUT/two-gpu-peers.txt"
$NS "ip link set lo up && $PY scripts/bench_swarm_vs_solo.py --seconds 180 --peers 4 --model small" \
  | tee "$OUT/swarm-vs-solo.txt"
