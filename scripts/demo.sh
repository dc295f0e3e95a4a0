#!/usr/bin/env bash
# Sets up (once) and runs a local demo swarm: a bootstrap node plus 3 training peers on the built-in corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/p2pdiloco swarm --peers 3 --log-dir runs/demo "$@" -- \
  --profile peers/demo-cpu.toml
