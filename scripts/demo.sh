#!/usr/bin/env bash
# Sets up (once) and runs a local demo swarm: a bootstrap node plus 3 peers training a small Llama on the built-in
# corpus, cut by a BPE tokenizer trained on it (once, offline); then exports the merged model and prints a sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
p2pdiloco=.venv/bin/p2pdiloco
data=runs/demo-data
[ -f "$data/tokenizer/tokenizer.json" ] || $p2pdiloco tokenizer train builtin:shakespeare --vocab-size 4096 \
  --out "$data/tokenizer"
[ -f "$data/shakespeare/manifest.json" ] || $p2pdiloco data prepare builtin:shakespeare \
  --tokenizer "$data/tokenizer" --out "$data/shakespeare" --shard-tokens 500000
$p2pdiloco swarm --peers 3 --log-dir runs/demo "$@" -- --profile peers/demo-cpu.toml --data "$data/shakespeare"
# the merged model's validation loss must fall at every round (the swarm command printed it by version)
.venv/bin/python -m p2pdiloco.ops.swarmreport --falling runs/demo
rm -rf runs/demo/model
$p2pdiloco export runs/demo/checkpoints --out runs/demo/model
echo "a sample of the merged model, loaded by transformers from its exported folder:"
$p2pdiloco sample runs/demo/model --prompt "ROMEO." --max-new-tokens 80
