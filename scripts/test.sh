#!/usr/bin/env bash
# Sets up (once) and runs the test suite. Swarm tests run inside a loopback-only network namespace when this
# machine allows it (root + unshare), so nothing any library defaults to can leave the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# the report page is checked in headless Chromium: Debian's package, installed here (outside the namespace) as
# root; where that cannot be done, the browser tests are skipped and say why
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } >/dev/null 2>&1 \
    || echo "could not install chromium: the browser tests will be skipped" >&2
fi
run=(.venv/bin/python -m pytest -q -p no:cacheprovider "$@")
if [ -z "${P2PDILOCO_NETNS:-}" ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && P2PDILOCO_NETNS=1 exec "$@"' _ "${run[@]}"
fi
exec "${run[@]}"
