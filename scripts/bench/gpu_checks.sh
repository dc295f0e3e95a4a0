#!/usr/bin/env bash
# Every GPU check of issue 13 in one command, on a machine with a CUDA device (run from the repository root):
#   bash scripts/bench/gpu_checks.sh [OUT_DIR] [STEPS]      (STEPS: which of 1-7 below, default 1234567;
#   SWARM_SECONDS sets step 4's seconds per run, default 180; steps may run at once, each as its own call with
#   its own STEPS, as on 2026-11-26 to 28: `bash scripts/bench/gpu_checks.sh OUT 1 & bash scripts/bench/gpu_checks.sh OUT 5`)
# 1. the CUDA tests (bf16 inner steps, pinned staging, 8-bit AdamW resumed bit-exactly on the GPU, a CPU peer
#    and a GPU peer bitwise-equal after merged rounds), inside a loopback-only network namespace;
# 2. one GPU peer (solo rounds) of the ~100M `large` model, and of `tiny` for the slope per parameter: tokens/s
#    and peak host and device memory, AdamW with Θ and the outer momentum in memory and parked on disk
#    (--global-state-on-disk), 8-bit AdamW parked; a memory timeline of each run;
# 3. compute utilization of 2 GPU peers in one swarm;
# 4. 4 peers vs 1 at equal wall-clock with a core per peer (scripts/bench/bench_swarm_vs_solo.py);
# 5. the GPU host-memory goal (12 B/param) in real rounds: two GPU peers, state parked, every round merged in an
#    island of two, `tiny` and `large` with exact rounds and AdamW, `large` with int4 rounds and 8-bit AdamW (the
#    configurations of docs/hardware.md's 2026-11-27 H200 table, for a before/after on the same settings);
# 6. the same as 5's exact rounds for `xl` (~300M), where the processes' fixed cost weighs a third as much per
#    parameter as at 100M (3 rounds of H = 30, a checkpoint at the second: ~5 GB a peer on disk);
# 7. the floor: one process's host memory with torch, CUDA and `large`'s inner steps, none of DiLoCo's state
#    (scripts/probes/cuda_floor.py): the part of step 5's figures no change of ours can take off. Run it alone (PSS
#    splits the libraries' pages among every process that maps them), before the others, as on 2026-11-28.
# It needs a CUDA build of torch in .venv (scripts/setup.sh installs the CPU one: pip install torch first), or
# PYTHON naming an interpreter that has one and p2pdiloco's dependencies (on its path or PYTHONPATH; for a machine
# without a package index, scripts/setup/offline_site.sh packs them).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/gpu-checks}
STEPS=${2:-1234567}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
$PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print(torch.cuda.get_device_name())"
# every dependency a peer imports, before anything starts (a site folder built before a dependency was added
# failed every step, each after minutes)
$PY -c "import p2pdiloco.cli, p2pdiloco.swarm, p2pdiloco.core.codec, bitsandbytes" || exit 1
# step N NAME COMMAND: runs COMMAND (in a loopback-only network namespace) if N is among STEPS, its output also in
# OUT/NAME.txt; a failed step is reported and the next ones still run, and the script's status is the worst
status=0
netns="unshare -n"
$netns true 2>/dev/null || { netns=""; echo "warning: no network namespace here (unshare -n refused); peers still \
listen on 127.0.0.1 only and hivemind's NAT probes are off" >&2; }
step() {
  [[ $STEPS == *$1* ]] || return 0
  $netns bash -c "{ [ -z '$netns' ] || ip link set lo up 2>/dev/null || $PY scripts/setup/lo_up.py; } && $3" 2>&1 | tee "$OUT/$2.txt" || { echo "step $1 ($2) failed" >&2; status=1; }
}
step 1 tests "P2PDILOCO_NETNS=1 $PY -m pytest -q -p no:cacheprovider -rA \
  tests/unit/test_cuda.py tests/unit/test_checkpoint.py tests/unit/test_parked.py tests/integration/test_mixed_hardware.py"
# tiny beside large: the slope between them is what each further parameter costs, the CUDA libraries' fixed
# resident pages apart; the timelines say which moment of a round the peak is
GPU_PEER="--device cuda --batch-size 32 --seq-len 512 --inner-steps 50 --rounds 3 --peers 1 --threads 4"
# each call's timelines in a folder of its own, packed into one archive at its end: the machines that lend a GPU
# return a limited number of files (on 2026-11-28 the timelines were left behind)
TL="timeline-$STEPS"
mkdir -p "$OUT/$TL"
step 2 memory-gpu "$PY scripts/bench/bench_memory.py --models tiny,large --optimizers adamw --variants plain,on-disk \
  $GPU_PEER --timeline $OUT/$TL/mem --out $OUT/memory-gpu.json && \
  $PY scripts/bench/bench_memory.py --models tiny,large --optimizers adamw8bit --variants on-disk $GPU_PEER \
  --timeline $OUT/$TL/mem --out $OUT/memory-gpu-8bit.json"
step 3 two-gpu-peers "$PY scripts/bench/bench_memory.py --models large --optimizers adamw --device cuda \
  --batch-size 32 --seq-len 512 --inner-steps 50 --rounds 3 --peers 2 --threads 4 --out $OUT/two-gpu-peers.json"
step 4 swarm-vs-solo "$PY scripts/bench/bench_swarm_vs_solo.py --seconds ${SWARM_SECONDS:-180} --peers 4 --model small --device cpu"
GPU_ROUNDS="--device cuda --seq-len 512 --inner-steps 50 --rounds 4 --peers 2 --threads 4 --variants on-disk"
step 5 memory-gpu-rounds "$PY scripts/bench/bench_memory.py --models tiny,large --optimizers adamw --compression none \
  --batch-size 32 $GPU_ROUNDS --timeline $OUT/$TL/rounds --out $OUT/memory-gpu-rounds.json && \
  $PY scripts/bench/bench_memory.py --models large --optimizers adamw8bit --compression int4 --batch-size 16 $GPU_ROUNDS \
  --timeline $OUT/$TL/rounds-int4 --out $OUT/memory-gpu-rounds-int4.json"
step 6 memory-gpu-rounds-xl "$PY scripts/bench/bench_memory.py --models xl --optimizers adamw --compression none \
  --batch-size 32 --device cuda --seq-len 512 --inner-steps 30 --rounds 3 --checkpoint-every 2 --peers 2 --threads 4 \
  --variants on-disk --timeline $OUT/$TL/rounds-xl --out $OUT/memory-gpu-rounds-xl.json"
step 7 cuda-floor "$PY scripts/probes/cuda_floor.py --model large --out $OUT/cuda-floor.json"
tar czf "$OUT/$TL.tar.gz" -C "$OUT" "$TL" && rm -rf "${OUT:?}/$TL"
exit $status
