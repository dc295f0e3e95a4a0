"""scripts/setup/testbed_tools.sh packs the testbed's tools so that they run where iproute2 is missing: checked here with
this machine's own copies hidden (bind-mounted over), in a throwaway mount and network namespace."""

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="hiding the system's tools needs root (mount namespaces)"),
              pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None,
                                 reason="nothing to pack: this machine has no iproute2")]

# inside `unshare -m -n`: the system's tools hidden, the packed ones first on PATH; a veth pair with a tbf qdisc
# and a sysctl, as the testbed makes them. Then the system's copies of the libraries ip and tc load hidden too
# (all but the C and maths libraries, which the shell itself needs): the wrappers must start the tools through
# the pack's loader with the pack's libraries, not find them on this machine.
HIDDEN_AND_USED = """
set -e
libdir=$(dirname "$(readlink -f "$(ldd "$(command -v ip)" | awk '/libc.so/ {{print $3}}')")")
needed=$(ldd "$(command -v ip)" "$(command -v tc)" | awk '$2 == "=>" {{print $1}}' | sort -u)
for tool in ip tc sysctl; do
  for path in $(which -a $tool); do mount --bind /dev/null "$(readlink -f "$path")"; done
done
export PATH={bin}:$PATH
ip link set lo up
ip link add tta type veth peer name ttb
ip link set tta up
tc qdisc add dev tta root tbf rate 100mbit burst 32kbit latency 400ms
tc qdisc show dev tta
sysctl -qw net.ipv4.ip_forward=1
sysctl -n net.ipv4.ip_forward
which ip tc sysctl
for name in $needed; do
  case $name in libc.so*|libm.so*|libtinfo*) continue;; esac
  mount --bind /dev/null "$libdir/$name"
done
ip -V
tc -V
"""


def test_the_packed_tools_build_a_link_where_the_system_has_none(tmp_path):
    archive = tmp_path / "tools.tar.xz"
    subprocess.run(["bash", str(ROOT / "scripts/setup/testbed_tools.sh"), str(archive)], check=True, capture_output=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "tools", filter="tar")
    tools = tmp_path / "tools"
    bin_dir = tools / "bin"
    script = HIDDEN_AND_USED.format(bin=bin_dir, lib=tools / "lib")
    out = subprocess.run(["unshare", "-m", "-n", "bash", "-c", script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split("\n")
    assert any(line.startswith("qdisc tbf") and "rate 100Mbit" in line for line in lines), out.stdout
    assert "1" in lines, out.stdout  # the forwarding sysctl, read back
    assert [line for line in lines if line.startswith("/")] == [str(bin_dir / t) for t in ("ip", "tc", "sysctl")]
    assert [line.split(",")[0] for line in lines if "utility" in line] == ["ip utility", "tc utility"], out.stdout
