"""The averager's freed messages leave the process (runtime.heap): without the setting glibc keeps them."""

import platform
import subprocess
import sys
import textwrap

import pytest

# ~1 MB messages made and freed by two threads, as a round's packed codes and sums are, after a large block was
# freed (which raises glibc's dynamic threshold past them); the last one of each batch stays, as a sum still
# served does, pinning the heap below it
CHURN = textwrap.dedent("""
    import sys, threading
    from p2pdiloco.runtime.heap import return_large_frees
    def rss_mb():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
    if sys.argv[1] == "set":
        assert return_large_frees()
    big = b"x" * (8 << 20)
    del big
    before = rss_mb()
    def churn():
        held = [b"y" * ((1 << 20) + i) for i in range(200)]
        return held[-1]
    kept = []
    worker = threading.Thread(target=lambda: kept.append(churn()))
    worker.start()
    worker.join()
    kept.append(churn())
    print(rss_mb() - before)
""")


def grown_mb(setting: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHURN, setting], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's setting (and /proc/self/status)")
def test_messages_freed_after_a_round_leave_the_process():
    assert grown_mb("default") > 200  # glibc's heaps kept the freed messages: 400 MB made, 2 MB still used
    assert grown_mb("set") < 20
