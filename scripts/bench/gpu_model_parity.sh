#!/usr/bin/env bash
# The GPU figures of issues 45 and 46 in one call, on a machine with a CUDA device (run from the repository root):
#   bash scripts/bench/gpu_model_parity.sh [OUT_DIR]
# 1. bench_model.py on the GPU: the Llama presets' shapes against the byte GPT they replaced, at equal parameter
#    count (SwiGLU widths rounded to 64), tokens/s and host memory, batch 32 × 512, bf16 autocast, fused AdamW;
#    a profile of 3 steps of each model; then the peak memory on a small and a large prepared dataset;
# 2. the parity benchmark's GPU rows (issue 46): the `135m` preset (SmolLM-135M's shape, ~110 M parameters at an
#    8k vocabulary) on DATA, data-parallel against 4 learners at H = 100 on int4, one seed, 400 steps each of
#    8 × 512 tokens (6.5 M tokens a row).
# Each part is bounded by its own timeout (MODEL_SECONDS, PARITY_SECONDS), so what ran comes back from a machine
# lent for minutes. It needs a CUDA build of torch (PYTHON, default .venv/bin/python; for a machine without a
# package index, scripts/setup/offline_site.sh packs the other dependencies) and a prepared dataset in DATA
# (default runs/corpora/docs-en-8k: scripts/corpus.sh, then `p2pdiloco data prepare`; docs/data.md).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/gpu-model-parity}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-runs/corpora/docs-en-8k}
mkdir -p "$OUT"
$PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; \
print(torch.__version__, torch.cuda.get_device_name())" || exit 1
status=0
timeout "${MODEL_SECONDS:-230}" $PY scripts/bench/bench_model.py --device cuda --sizes small medium large \
  --batch-size 32 --seq-len 512 --steps 10 --repeats 1 --profile-dir "$OUT" --json "$OUT/bench-model-gpu.json" \
  2>&1 | tee "$OUT/bench-model.txt" || { echo "bench_model failed or ran out of time" >&2; status=1; }
timeout "${PARITY_SECONDS:-300}" $PY scripts/bench/bench_parity.py --device cuda --model 135m --data "$DATA" \
  --rows dp,H100-int4 --seeds 0 --steps 400 --batch-size 8 --seq-len 512 --eval-every 100 --eval-batches 16 \
  --threads 8 --out "$OUT/parity-135m.json" 2>&1 | tee "$OUT/parity.txt" || { echo "parity failed or ran out of time" >&2; status=1; }
exit $status
