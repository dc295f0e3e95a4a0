#!/usr/bin/env bash
# Sets up (once) and runs the test suite. Swarm tests run inside a loopback-only network namespace when this
# machine allows it (root + unshare), so nothing any library defaults to can leave the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${P2PDILOCO_TEST_READY:-}" ]; then  # set-up, once, outside the namespace (it needs the registries)
  bash scripts/setup.sh
  # Debian packages some tests need, installed here as root: Chromium checks the report page, nftables builds the
  # testbed's NAT. Where that cannot be done, those tests are skipped and say why.
  debian_package() {  # command, package, what is skipped without it
    if ! command -v "$1" >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      { apt-get install -y -q "$2" || { apt-get update -q && apt-get install -y -q "$2"; }; } >/dev/null 2>&1 \
        || echo "could not install $2: $3 will be skipped" >&2
    fi
  }
  debian_package chromium chromium "the browser tests"
  debian_package nft nftables "the NAT tests"
  export P2PDILOCO_TEST_READY=1
  if [ -z "${P2PDILOCO_NETNS:-}" ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
    exec unshare -n bash -c 'ip link set lo up && P2PDILOCO_NETNS=1 exec bash scripts/test.sh "$@"' _ "$@"
  fi
fi
pytest=(.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15)  # the slowest tests: the budget is 15 min
if [ $# -gt 0 ]; then
  exec "${pytest[@]}" "$@"
fi
# The default suite in two phases. The in-process tests run on one worker per core (up to 4): they take one core
# each. The swarm tests then run one at a time: each already starts several processes, and their bounds assume
# the machine's cores are theirs.
workers=$(nproc); [ "$workers" -gt 4 ] && workers=4
rc=0
"${pytest[@]}" -n "$workers" -m "not slow and not swarm" || rc=$?
"${pytest[@]}" -m "swarm and not slow" || rc=$?
exit "$rc"
