"""Shared multi-process swarm harness: port 0 everywhere, bounded waits, processes stopped by PID tree."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from p2pdiloco.ops import swarmreport
from p2pdiloco.ops.launcher import join_command, ranks_command, start_bootstrap, start_process, stop_tree
from p2pdiloco.runtime.lifeline import descendants
from p2pdiloco.runtime.schema import Record, read_records

# small and fast: every swarm test peer trains the tiny model with one thread
TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "64", "--threads", "1", "--sync-wait", "30"]


class LocalSwarm:
    def __init__(self, log_dir: Path, run_id: str):
        self.log_dir, self.run_id = log_dir, run_id
        self.procs: dict[str, subprocess.Popen] = {}
        self.address = None

    def start_bootstrap(self) -> str:
        self.procs["bootstrap"], self.address = start_bootstrap(self.log_dir, ["--run-id", self.run_id])
        return self.address

    def start_peer(self, name: str, *args: str, env: dict | None = None, via: str | None = None,
                   ranks: int = 1, launcher_flags: tuple[str, ...] = ()) -> subprocess.Popen:
        """`via`: join through this address instead of the bootstrap node's; `ranks`: one member of that many
        processes, started by torchrun (with `launcher_flags`)."""
        cmd = join_command(via or self.address, name, self.log_dir, *TINY, *args, run_id=self.run_id,
                           checkpoint_dir=self.log_dir / "checkpoints")
        if ranks > 1:  # python -m torch.distributed.run (torchrun) ... -m p2pdiloco.cli join ...
            cmd = ranks_command(ranks, cmd[3:], launcher_flags)
        self.procs[name] = start_process(cmd, self.log_dir / f"{name}.log", env=env)
        return self.procs[name]

    def wait(self, names, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name in names:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                self.procs[name].wait(remaining)
            except subprocess.TimeoutExpired:
                self.procs[name].send_signal(signal.SIGUSR1)  # a peer dumps its threads' stacks to its log
                time.sleep(1.0)
                raise AssertionError(f"{name} still running after {timeout:.0f} s; log:\n{self.log(name)[-6000:]}")

    def wait_clean(self, names, timeout: float) -> None:
        """Wait for `names` to finish, and fail with the log of any that did not exit cleanly."""
        self.wait(names, timeout)
        for name in names:
            assert self.procs[name].returncode == 0, self.log(name)[-3000:]

    def records(self, name: str, kind: str | None = None) -> list[Record]:
        return [r for r in read_records(self.log_dir / f"{name}.jsonl") if kind is None or r.kind == kind]

    def address_of(self, name: str) -> str:
        return (self.log_dir / f"{name}.addrs").read_text().split()[0]

    def wait_for(self, condition, timeout: float, what: str) -> None:
        wait_for(condition, timeout, what)

    def watch_status(self, via: str | None = None, interval: float = 1.0, extra: tuple[str, ...] = ()) -> None:
        """Start `p2pdiloco status --watch --json` through `via` (default: the bootstrap node): one process for the
        whole test, as each one-off call pays seconds of imports and DHT start-up on a loaded machine."""
        cmd = [sys.executable, "-m", "p2pdiloco.cli", "status", "--initial-peers", via or self.address,
               "--run-id", self.run_id, "--json", "--watch", "--interval", str(interval), *extra]
        self.procs["status"] = start_process(cmd, self.log_dir / "status.log")

    def status(self) -> dict | None:
        """The watcher's latest view of the swarm (None before its first)."""
        path = self.log_dir / "status.log"
        lines = path.read_text().splitlines() if path.exists() else []
        views = [json.loads(line) for line in lines[:-1] if line.startswith("{")]  # the last may be half written
        assert self.procs["status"].poll() is None, lines[-20:]
        return views[-1] if views else None

    def version(self, name: str) -> int:
        rounds = self.records(name, "round")
        return rounds[-1].version if rounds else -1

    def log(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def tree(self, name: str) -> dict[int, int]:
        return {self.procs[name].pid: 0, **descendants(self.procs[name].pid)}

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop_tree(proc, grace=10)


@contextmanager
def local_swarm(tmp_path: Path, run_id: str):
    swarm = LocalSwarm(tmp_path, run_id)
    try:
        swarm.start_bootstrap()
        yield swarm
    finally:
        swarm.stop_all()


def wait_for(condition, timeout: float, what: str, every: float = 0.5) -> None:
    """Until `condition()` holds, asked every `every` s; an AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def islands_disagreeing(swarm: LocalSwarm, names) -> dict:
    return swarmreport.islands_disagreeing(r for name in names for r in swarm.records(name, "round"))


def unresolved_forks(swarm: LocalSwarm, names, within_rounds: int, from_version: int = 0) -> list:
    rounds = {name: swarm.records(name, "round") for name in names}
    return swarmreport.unresolved_forks(rounds, within_rounds, from_version)


def digests_by_version(swarm: LocalSwarm, names) -> dict[int, set[str]]:
    """Every (version -> set of global-state digests) any of these peers reported after a round."""
    seen: dict[int, set[str]] = {}
    for name in names:
        for r in swarm.records(name, "round") + swarm.records(name, "resync"):
            seen.setdefault(r.version, set()).add(r.digest)
    return seen
