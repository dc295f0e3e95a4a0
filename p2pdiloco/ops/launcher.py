"""Local swarm launcher: a bootstrap node plus N peers as processes, stopped by PID, never by name."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from p2pdiloco.ops import swarmreport
from p2pdiloco.runtime.lifeline import descendants, kill_snapshot, remove_shared_memory
from p2pdiloco.runtime.schema import Round, Summary, of_kind, read_records


class LaunchError(RuntimeError):
    pass


def peer_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2pdiloco.cli", *args]


def join_command(via: str | list[str], name: str, log_dir: Path, *args: str, run_id: Optional[str] = None,
                 checkpoint_dir: Optional[Path] = None) -> list[str]:
    """`p2pdiloco join` for one local peer: through `via` (one address or several: any live one will do), its
    log, metrics and address files in `log_dir`."""
    initial = [a for address in ([via] if isinstance(via, str) else via) for a in ("--initial-peers", address)]
    run = ["--run-id", run_id] if run_id else []
    checkpoints = ["--checkpoint-dir", str(checkpoint_dir)] if checkpoint_dir else []
    return peer_command("join", *initial, *run, "--log-dir", str(log_dir), *checkpoints, "--name", name, *args)


def ranks_command(nproc: int, cli_args: list[str], launcher_flags: tuple[str, ...] = ()) -> list[str]:
    """`p2pdiloco <cli_args>` as one member of `nproc` local processes: torchrun (torch.distributed.run) starts them,
    and they meet on the loopback (--standalone)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            *launcher_flags, "-m", "p2pdiloco.cli", *cli_args]


def without_option(args: list[str], flag: str) -> list[str]:
    """`args` without `flag` and its value (`--flag V` or `--flag=V`)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def start_process(args: list[str], log_file: Path, env: Optional[dict] = None) -> subprocess.Popen:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        if proc.poll() is not None:
            raise LaunchError(f"process exited with code {proc.returncode} before writing {path}")
        time.sleep(0.1)
    raise LaunchError(f"{path} did not appear within {timeout:.0f} s")


def stop_tree(proc: subprocess.Popen, grace: float = 15.0, already_signalled: bool = False) -> None:
    """SIGTERM the process (it leaves gracefully), then SIGKILL whatever of its tree is left.
    `already_signalled`: the caller sent SIGTERM itself (a second one makes a peer leave at once)."""
    if proc.poll() is not None:
        return
    tree = descendants(proc.pid)
    if not already_signalled:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        tree.update(descendants(proc.pid))
        proc.kill()
        proc.wait()
    kill_snapshot(tree)
    remove_shared_memory([proc.pid, *tree])  # a killed peer's torch_shm_manager could not unlink them


def start_bootstrap(log_dir: Path, run_args: list[str]) -> tuple[subprocess.Popen, str]:
    (log_dir / "bootstrap.addrs").unlink(missing_ok=True)  # a previous node's: it must not be read as ours
    proc = start_process(peer_command("bootstrap", "--log-dir", str(log_dir), *run_args), log_dir / "bootstrap.log")
    return proc, wait_for_file(log_dir / "bootstrap.addrs", proc, timeout=60)


def run_local_swarm(n_peers: int, log_dir: Path, join_args: list[str], stagger: float = 1.0,
                    per_peer_args: Optional[dict[int, list[str]]] = None, resume: bool = False) -> dict:
    """`per_peer_args[i]` are appended to peer i's command line (e.g. a throttle for one slow peer).
    Checkpoints go to LOG_DIR/checkpoints unless the join arguments say otherwise; without `resume` a
    previous local swarm's checkpoints there are removed first, so each launch starts fresh."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for stale in (*log_dir.glob("*.addrs"), *log_dir.glob("*.jsonl")):
        stale.unlink()
    if not any(a == "--checkpoint-dir" or a.startswith("--checkpoint-dir=") for a in join_args):
        join_args = [*join_args, "--checkpoint-dir", str(log_dir / "checkpoints")]
        if not resume:
            shutil.rmtree(log_dir / "checkpoints", ignore_errors=True)
    run_args = _run_id_args(join_args)
    procs: dict[str, subprocess.Popen] = {}
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # a SIGTERM must not orphan the swarm
    try:
        procs["bootstrap"], address = start_bootstrap(log_dir, run_args)
        print(f"bootstrap node at {address}  (logs: {log_dir})", flush=True)
        for i in range(n_peers):
            name = f"peer{i}"
            procs[name] = start_process(join_command(address, name, log_dir, *join_args,
                                                     *(per_peer_args or {}).get(i, [])), log_dir / f"{name}.log")
            print(f"started {name} (pid {procs[name].pid}), log {log_dir / (name + '.log')}", flush=True)
            time.sleep(stagger)
        _follow(procs, log_dir, n_peers)
    except KeyboardInterrupt:
        print("\nstopping the swarm...", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in procs.values():
            stop_tree(proc)
    summaries = collect_summaries(log_dir, n_peers)
    print_summary(summaries)
    print_val_by_version(log_dir, n_peers)
    print_report(log_dir)
    return summaries


def print_val_by_version(log_dir: Path, n_peers: int) -> None:
    """The merged model's validation loss at each version, and every round that raised it."""
    val = swarmreport.val_by_version(read_records(log_dir / f"peer{i}.jsonl") for i in range(n_peers))
    if not val:
        return
    rises = swarmreport.val_rises(val)
    verdict = "fell at every round" if not rises else "rose at " + ", ".join(
        f"v{v} ({a:.4f} -> {b:.4f})" for v, a, b in rises)
    print("validation loss of the merged model by version: " + " -> ".join(f"{x:.4f}" for x in val.values()) +
          f" ({verdict})", flush=True)


def print_report(log_dir: Path) -> None:
    """Write the run's report (LOG_DIR/report) and say where; a run whose report fails is still a run."""
    from p2pdiloco.ops.report import ReportError, write_report

    try:
        made = write_report([log_dir], log_dir / "report")
    except (ReportError, ImportError, OSError) as e:
        print(f"no report: {e}", flush=True)
        return
    print(f"report: {made.html} (and {len(made.pngs)} PNGs beside it)", flush=True)


def _raise_interrupt(*_args):
    raise KeyboardInterrupt


def _run_id_args(join_args: list[str]) -> list[str]:
    for i, arg in enumerate(join_args):
        if arg == "--run-id" and i + 1 < len(join_args):
            return ["--run-id", join_args[i + 1]]
        if arg.startswith("--run-id="):
            return [arg]
    return []


def _follow(procs: dict, log_dir: Path, n_peers: int) -> None:
    """Print each peer's round lines as they land, until every training peer has exited."""
    seen: dict[str, int] = {}
    trainers = [name for name in procs if name != "bootstrap"]
    while any(procs[name].poll() is None for name in trainers):
        time.sleep(1.0)
        for name in trainers:
            records = of_kind(read_records(log_dir / f"{name}.jsonl"), Round)
            for r in records[seen.get(name, 0):]:
                val = f"{r.val_loss:.4f}" if r.val_loss is not None else "  -   "
                print(f"{name:>7} round {r.round:>3} v{r.version:<3} island {r.island} "
                      f"loss {r.loss:.4f} val {val} consensus {r.consensus_distance:.3g} "
                      f"{'merged' if r.applied else r.reason}", flush=True)
            seen[name] = len(records)


def collect_summaries(log_dir: Path, n_peers: int) -> dict[str, Optional[Summary]]:
    summaries = {}
    for i in range(n_peers):
        found = of_kind(read_records(log_dir / f"peer{i}.jsonl"), Summary)
        summaries[f"peer{i}"] = found[-1] if found else None
    return summaries


def print_summary(summaries: dict[str, Optional[Summary]]) -> None:
    print("\npeer      rounds  version  val loss before -> after   compute/wall  state digest")
    for name, s in summaries.items():
        if s is None:
            print(f"{name:<9} (no summary: see its log)")
        else:
            before = "-" if s.initial_val is None else f"{s.initial_val:.4f}"
            print(f"{name:<9} {s.rounds:>6}  {s.version:>7}  {before:>8} -> {s.final_val:.4f}"
                  f"     {100 * s.utilization:>10.0f}%  {s.digest}")
    print(json.dumps({k: v and v.final_val for k, v in summaries.items()}))
