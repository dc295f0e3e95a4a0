#!/usr/bin/env bash
# Mutation testing of the pure layers (p2pdiloco/core/ and p2pdiloco/protocol/) against their fast unit tests,
# with mutmut (its settings: [tool.mutmut] in pyproject.toml). Long (over an hour on 2 cores): run it before a
# release and for an issue's note, not in CI. How to read what it writes: docs/testing.md.
#   bash scripts/bench/mutation.sh [OUT]        (default runs/mutation: survivors.txt, the surviving mutants' diffs,
#                                          and summary.txt, the counts and the score; mutants/ keeps mutmut's cache)
# MAX_CHILDREN sets how many mutants run at once (default: the cores). Inside a loopback-only network namespace
# where this machine allows it, as the test suite is.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/mutation}
bash scripts/setup.sh
.venv/bin/python -c "import mutmut" 2>/dev/null || .venv/bin/python -m pip -q install -e ".[mutation]"
mkdir -p "$OUT"
# the fuzz test of remote records runs 300 rounds, not 3,000: every surviving mutant of the parser reruns it
export P2PDILOCO_FUZZ_ROUNDS=${P2PDILOCO_FUZZ_ROUNDS:-300}
run=(.venv/bin/mutmut run --max-children "${MAX_CHILDREN:-$(nproc)}")
if [ -z "${P2PDILOCO_NETNS:-}" ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
  unshare -n bash -c 'ip link set lo up && P2PDILOCO_NETNS=1 "$@"' _ "${run[@]}" > "$OUT/run.log" 2>&1 || true
else
  "${run[@]}" > "$OUT/run.log" 2>&1 || true
fi
.venv/bin/python scripts/bench/mutation_report.py "$OUT"
