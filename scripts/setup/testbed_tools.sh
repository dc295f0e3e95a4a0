#!/usr/bin/env bash
# The network testbed's command-line tools (ip, tc, sysctl; nft where installed), packed with every library they
# load and this machine's dynamic loader, for a machine that lacks them (the GPU machines lent so far have root,
# network namespaces and /dev/net/tun, but no iproute2):
#   bash scripts/setup/testbed_tools.sh [OUT]                 (default .whl/testbed-tools.tar.xz)
# There: mkdir -p /tmp/tools && tar xJf testbed-tools.tar.xz -C /tmp/tools && export PATH=/tmp/tools/bin:$PATH
# Each bin/ entry starts its tool through the packed loader with the packed libraries: nothing is set in the
# environment, so what `ip netns exec` starts (a peer's Python) still loads that machine's own libraries.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-.whl/testbed-tools.tar.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/libexec" "$work/lib"
loader=""
for tool in ip tc sysctl nft; do
  path=$(command -v "$tool" || true)
  if [ -z "$path" ]; then
    [ "$tool" = nft ] && { echo "nft is not installed here: packed without it (the testbed's loss and NAT need it)" >&2; continue; }
    echo "$tool is not installed here: nothing to pack" >&2; exit 1
  fi
  cp -L "$path" "$work/libexec/$tool"
  # every library the tool loads, the loader itself included (`ldd` lists it with its path and no arrow)
  while read -r lib; do
    cp -Ln "$lib" "$work/lib/"
    case $lib in */ld-linux*) loader=$(basename "$lib") ;; esac
  done < <(ldd "$path" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
  cat > "$work/bin/$tool" <<EOF
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")/..
exec "\$here/lib/LOADER" --library-path "\$here/lib" "\$here/libexec/$tool" "\$@"
EOF
  chmod +x "$work/bin/$tool"
done
[ -n "$loader" ] || { echo "no dynamic loader found in ldd's output" >&2; exit 1; }
sed -i "s/LOADER/$loader/" "$work"/bin/*
"$work/bin/ip" -V >/dev/null && "$work/bin/tc" -V >/dev/null  # they start from the pack
mkdir -p "$(dirname "$OUT")"
tar cJf "$OUT" -C "$work" .
echo "$OUT: $(du -h "$OUT" | cut -f1) ($(ls "$work/bin" | tr '\n' ' '))"
