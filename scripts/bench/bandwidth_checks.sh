#!/usr/bin/env bash
# Issue 10's four peers with a core each, in one command, on a machine with cores to spare (the lent GPU machines
# have 16), as root, from the repository root:
#   bash scripts/bench/bandwidth_checks.sh [OUT_DIR] [VARIANTS] [MODEL]     (defaults: runs/bandwidth-checks, none, large;
#                                                                     ROUNDS sets the rounds, default 3)
# The command of docs/bandwidth.md's two-core runs ("Four peers on `large`, measured apart": 100 Mbit/s, 50 ms one
# way, H = 2, 3 rounds, --throttle 8), so its ratio to the link bound stands beside what four peers reached on two
# cores: 1.25-1.31× on an evening, 1.50× on a morning when the host was slower. Where `ip`, `tc` or `sysctl` does
# not run (the GPU machines lent so far), it unpacks .whl/testbed-tools.tar.xz (made here by
# scripts/setup/testbed_tools.sh) and puts its tools first on PATH.
# PYTHON names an interpreter with p2pdiloco's dependencies (scripts/setup/offline_site.sh packs them), default .venv's.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/bandwidth-checks}
VARIANTS=${2:-none}
MODEL=${3:-large}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
[ "$(id -u)" = 0 ] || { echo "the testbed needs root (network namespaces, veth, tc)" >&2; exit 1; }
if ! { ip -V && tc -V && sysctl -n kernel.ostype; } >/dev/null 2>&1; then
  [ -f .whl/testbed-tools.tar.xz ] || { echo "no ip/tc/sysctl here and no .whl/testbed-tools.tar.xz: run \
scripts/setup/testbed_tools.sh on a machine that has them, and carry .whl" >&2; exit 1; }
  tools=$(mktemp -d)
  trap 'rm -rf "$tools"' EXIT
  tar xJf .whl/testbed-tools.tar.xz -C "$tools"
  export PATH=$tools/bin:$PATH
fi
{ echo "cores: $(nproc)"; ip -V; $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"; } \
  | tee "$OUT/machine.txt"
$PY -c "import p2pdiloco.cli, p2pdiloco.ops.testbed, p2pdiloco.core.codec" || exit 1  # before minutes of peers
# the testbed itself first (seconds): its rate and delay applied as measured; netem is used where the kernel has it
if ! $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/integration/test_testbed.py \
    -k "rate_and_delay_are_applied or four_peers_at_their_link_rate" 2>&1 | tee "$OUT/testbed.txt"; then
  echo "the testbed does not work here: see $OUT/testbed.txt" >&2
  exit 1
fi
# the peers' logs and records in a folder of their own, packed into OUT at the end: OUT stays a few files
runs=$(mktemp -d)
status=0
$PY scripts/bench/bench_bandwidth.py --variants "$VARIANTS" --peers 4 --model "$MODEL" -H 2 --rounds "${ROUNDS:-3}" \
  --throttle 8 --batch-size 1 --no-curves --fresh --log-dir "$runs" 2>&1 | tee "$OUT/bench.txt" || status=$?
cp "$runs/report.json" "$OUT/report.json" 2>/dev/null || true
tar cJf "$OUT/runs.tar.xz" -C "$runs" . && rm -rf "$runs"
exit "$status"
