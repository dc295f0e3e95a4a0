#!/usr/bin/env bash
# Restart to first inner step, side by side: a supervised peer whose process is SIGKILLed (its supervisor forks the
# next life) against a peer started again by hand after a SIGKILL (`--restarts 0`: what a machine's restart does).
# One `tiny` peer alone, 1 thread; each line: the seconds of one life's start-up, then its phases (from the
# peer's `start` records). Run inside a loopback-only namespace:
#     unshare -n bash -c 'ip link set lo up && bash scripts/bench/bench_restart.sh [OUT_DIR]'
set -euo pipefail
cd "$(dirname "$0")/../.."
D=${1:-runs/bench-restart}
rm -rf "$D"
mkdir -p "$D"
J=(.venv/bin/p2pdiloco join --model tiny --threads 1 -H 20 --eval-every 0 --checkpoint-every 1 --log-dir "$D"
   --checkpoint-dir "$D/ck" --max-time 300)

"${J[@]}" --name supervised > "$D/supervised.out" 2>&1 &
supervisor=$!
for life in 1 2 3; do
  sleep 20
  if [ "$life" -lt 3 ]; then
    kill -9 "$(cat /proc/$supervisor/task/*/children | tr ' ' '\n' | head -1)"  # its current life
  fi
done
kill -TERM "$supervisor"
wait "$supervisor"

for life in 1 2 3; do
  "${J[@]}" --name cold --restarts 0 > "$D/cold$life.out" 2>&1 &
  peer=$!
  sleep 25
  if [ "$life" -lt 3 ]; then kill -9 "$peer"; wait "$peer" 2>/dev/null || true; sleep 1; else kill -TERM "$peer"; wait "$peer"; fi
done

for name in supervised cold; do
  echo "$name"
  grep '"start"' "$D/$name.jsonl" | .venv/bin/python -c "
import json, sys
for line in sys.stdin:
    phases = json.loads(line)['startup']
    print(f'  {sum(phases.values()):6.2f} s', phases)"
done
