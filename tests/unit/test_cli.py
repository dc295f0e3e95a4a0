import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from p2pdiloco.training import checkpoint
from p2pdiloco.cli import build_config, cli, swarm_options, train_options
from p2pdiloco.training.model import build_model

ROOT = Path(__file__).resolve().parents[2]
PROFILES = sorted((ROOT / "peers").glob("*.toml"))


@pytest.mark.parametrize("command", [[], ["join"], ["bootstrap"], ["swarm"], ["status"], ["report"], ["simulate"]])
def test_help_of_every_command(command):
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output


def test_help_does_not_import_torch_or_hivemind():
    code = "import sys; from p2pdiloco.cli import cli; print('torch' in sys.modules, 'hivemind' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("args, message", [
    (["join", "--no-such-flag"], "No such option"),
    (["join", "--inner-steps", "0"], "steps must be a positive integer"),
    (["join", "--initial-peers", "example.com:80"], "is not a multiaddr"),
    (["join", "--quorum", "9", "--max-island", "4"], "quorum (9) cannot exceed"),
    (["join", "--client-mode"], "--client-mode needs --initial-peers"),
    (["join", "--error-feedback-decay", "1.5"], "--error-feedback-decay must be in (0, 1]"),
    (["join", "--outer-momentum", "1"], "outer momentum must be in [0, 1)"),
    (["join", "--step-in-backward"], "--step-in-backward needs --grad-clip 0"),
    (["join", "--checkpoint-seconds", "-5"], "checkpoint seconds must be a number >= 0"),
    (["join", "--nproc", "0"], "0 is not in the range x>=1"),
    (["join", "--fsdp", "--inner-optimizer", "adamw8bit"], "--fsdp steps sharded parameters with torch's AdamW"),
])
def test_bad_flags_exit_nonzero_with_a_clear_message(args, message):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_nproc_inside_torchrun_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(cli, ["join", "--nproc", "2"])
    assert result.exit_code == 2 and "already one of torchrun's ranks" in result.output


def test_unreachable_initial_peer_fails_fast_and_clearly(tmp_path):
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWEBtXfqkCqYAic37BdvrUHGodu4Frq12EFaYar8u1Kp2d"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "join", "--initial-peers", dead, "--model", "tiny",
                           "--log-dir", str(tmp_path), "--connect-timeout", "10"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "could not join the swarm through" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert time.monotonic() - start < 60


def restartable_peer(tmp_path):
    """A peer `x` that ran one round alone and checkpointed: its command-line arguments, checkpoint folder and
    that first checkpoint."""
    common = ["--model", "tiny", "--name", "x", "--log-dir", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ck"),
              "--threads", "1", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0"]
    first = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "join", *common, "-H", "3", "--max-rounds", "1"],
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    folder = tmp_path / "ck" / "p2pdiloco" / "x"
    return common, folder, checkpoint.load_latest(folder, TINY_PARAMS)


TINY_PARAMS = sum(p.numel() for p in build_model("tiny", 0).parameters())
PEER_ID = "12D3KooWEBtXfqkCqYAic37BdvrUHGodu4Frq12EFaYar8u1Kp2d"


def test_a_restarted_peer_that_cannot_reach_the_swarm_says_so_and_leaves_its_checkpoint_as_it_was(tmp_path):
    """A restart reaches the swarm (its helper processes start, before the model is built) and only then trains
    from its checkpoint while it joins (the checks and the state download: tests/integration/test_churn.py). If the
    swarm cannot be reached, it says so clearly, and the checkpoint it would resume from is still the newest."""
    common, folder, saved = restartable_peer(tmp_path)
    dead = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}"
    again = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "join", *common, "--initial-peers", dead,
                            "--connect-timeout", "5"], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1, again.stderr[-2000:]
    assert "could not join the swarm through" in again.stderr and "Traceback" not in again.stderr
    newest = checkpoint.load_latest(folder, TINY_PARAMS)
    assert newest.path == saved.path and newest.meta["inner_step"] == saved.meta["inner_step"]


def descendant_names(pid: int) -> list[str]:
    """The command names of every live process below `pid` (the lifeline's own walk of /proc)."""
    from p2pdiloco.runtime.lifeline import descendants

    names = []
    for child in descendants(pid):
        try:
            names.append(Path(f"/proc/{child}/comm").read_text().strip())
        except OSError:  # gone meanwhile
            pass
    return names


def test_sigterm_while_a_restarted_peer_is_still_connecting_leaves_within_the_bound(tmp_path):
    """The initial peer accepts TCP and never answers, so connecting would take the whole --connect-timeout;
    a SIGTERM meanwhile still leaves within 10 s, its checkpoint as it was (the model is built, and training
    resumes, only once the helper processes run)."""
    common, folder, saved = restartable_peer(tmp_path)
    hole, held = socket.create_server(("127.0.0.1", 0)), []
    threading.Thread(target=lambda: held.extend(hole.accept() for _ in range(20)), daemon=True).start()
    address = f"/ip4/127.0.0.1/tcp/{hole.getsockname()[1]}/p2p/{PEER_ID}"
    log = tmp_path / "restart.log"
    with log.open("w") as out:
        peer = subprocess.Popen([sys.executable, "-m", "p2pdiloco.cli", "join", *common, "--initial-peers", address,
                                 "--connect-timeout", "60"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not any("p2pd" in name for name in descendant_names(peer.pid)) \
                and time.monotonic() < deadline:  # the DHT's daemon runs: connecting
            time.sleep(0.2)
        time.sleep(2.0)  # still connecting
        start = time.monotonic()
        peer.send_signal(signal.SIGTERM)
        peer.wait(60)
        assert time.monotonic() - start < 10.0, log.read_text()[-3000:]
    finally:
        peer.kill()
        hole.close()
    assert "asked to stop while connecting" in log.read_text(), log.read_text()[-3000:]
    newest = checkpoint.load_latest(folder, TINY_PARAMS)
    assert newest.path == saved.path and newest.meta["inner_step"] == saved.meta["inner_step"]


@pytest.mark.parametrize("profile", PROFILES, ids=[p.stem for p in PROFILES])
def test_every_profile_loads_and_flags_override_it(profile):
    captured = {}
    runner = CliRunner()

    @cli.command("probe-" + profile.stem)
    @swarm_options
    @train_options
    def probe(**options):
        captured["cfg"] = build_config(options)
        captured["options"] = options

    somewhere = "/ip4/10.0.0.1/tcp/31337/p2p/12D3KooWPeer"  # a client-mode profile needs a peer to join through
    result = runner.invoke(cli, ["probe-" + profile.stem, "--profile", str(profile), "--seed", "7",
                                 "--initial-peers", somewhere])
    assert result.exit_code == 0, result.output
    assert captured["cfg"].seed == 7
    import tomllib

    for key, value in tomllib.loads(profile.read_text()).items():
        got = captured["options"][key]
        got = list(got) if isinstance(got, tuple) else str(got) if isinstance(got, Path) else got  # paths as written
        assert got == value, key


def test_profile_with_unknown_key_is_rejected(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('modle = "tiny"\n')
    result = CliRunner().invoke(cli, ["join", "--profile", str(bad)])
    assert result.exit_code == 2 and "unknown keys: modle" in result.output


NEWEST = """
import json, sys
from p2pdiloco.training import checkpoint
found = checkpoint.load_latest(__import__("pathlib").Path(sys.argv[1]), int(sys.argv[2]))
print(json.dumps(dict(path=found.path.name, sha=found.meta["sha256"])))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare to mount a small tmpfs: a real full disk")
def test_a_full_disk_while_checkpointing_is_one_clear_line_and_loses_nothing_saved(tmp_path):
    """A 40 MB tmpfs holds the tokenized text (10.6 MB, kept under the checkpoint folder) and one 19 MB checkpoint of
    the tiny model: the first stay saves one, the second stay's checkpoint runs out of space. The second peer says so in one line and exits 1; the first checkpoint is whole."""
    disk = tmp_path / "disk"
    disk.mkdir()
    folder = disk / "p2pdiloco" / "x"
    join = [sys.executable, "-m", "p2pdiloco.cli", "join", "--model", "tiny", "--name", "x", "--log-dir",
            str(tmp_path), "--checkpoint-dir", str(disk), "--threads", "1", "--batch-size", "4", "--seq-len", "32",
            "--eval-every", "0", "-H", "3", "--max-rounds", "1"]
    newest = [sys.executable, "-c", NEWEST, str(folder), str(TINY_PARAMS)]
    script = " ; ".join([f"mount -t tmpfs -o size=40m tmpfs {disk} || exit 99",
                         f"{shlex.join(join)} > /dev/null 2>&1; echo first=$?",
                         f"{shlex.join(newest)}",
                         f"{shlex.join(join)} 2> {tmp_path / 'second.err'} > /dev/null; echo second=$?",
                         f"{shlex.join(newest)}",
                         f"ls -a {folder}"])
    out = subprocess.run(["unshare", "-m", "bash", "-c", script], capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert lines[0] == "first=0" and lines[2] == "second=1", out.stdout + out.stderr
    before, after = json.loads(lines[1]), json.loads(lines[3])
    assert before == after  # the checkpoint saved before the disk filled up is still the newest, still whole
    assert not [name for name in lines[4:] if name.startswith(".tmp-")]  # the failed write left nothing
    err = (tmp_path / "second.err").read_text()
    assert f"could not write a checkpoint to {folder}" in err and "No space left on device" in err
    assert f"the newest saved one, {before['path']}, is kept" in err and "Traceback" not in err
    assert "free space there or give --checkpoint-dir another disk" in err


MALFORMED_PEERS = [
    ("/ip4/999.1.1.1/tcp/1/p2p/" + PEER_ID, "not a valid multiaddr"),
    ("/ip4/127.0.0.1/tcp/1/p2p/notapeerid", "not a valid multiaddr"),
    ("/bogus/thing", "not a valid multiaddr"),
    ("/ip4/127.0.0.1/tcp/1", "no /p2p/PEER_ID part"),
]


@pytest.mark.parametrize("address, message", MALFORMED_PEERS)
def test_a_malformed_initial_peer_is_named_with_what_is_wrong(address, message):
    from p2pdiloco.config import SwarmConfig
    from p2pdiloco.swarm.node import SwarmConnectError, check_addresses

    with pytest.raises(SwarmConnectError, match=re.escape(f"--initial-peers {address}: {message}")):
        check_addresses(SwarmConfig(initial_peers=(address,)))


def test_a_malformed_initial_peer_is_refused_before_any_daemon_starts(tmp_path):
    """End to end, one of the cases above (a process each costs seconds of imports)."""
    address, message = MALFORMED_PEERS[-1]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "p2pdiloco.cli", "join", "--initial-peers", address, "--model",
                           "tiny", "--log-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and f"--initial-peers {address}: {message}" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Daemon" not in proc.stderr
    assert time.monotonic() - start < 30


def test_a_peer_that_has_left_ignores_sigterm_while_its_interpreter_exits(monkeypatch):
    """Python puts the default action back for its handled signals as it exits: a launcher's SIGTERM in that window
    killed a peer that had left cleanly (CI: exit -15 after "done after 9 rounds"). Once `run_peer` returns, the
    peer ignores SIGINT and SIGTERM, which stay ignored through the exit."""
    import faulthandler
    import os
    import signal
    import time

    from p2pdiloco import peer as peer_module

    class Finished:
        def __init__(self, cfg, life=None):
            self.asked = 0

        def request_stop(self, *_):
            self.asked += 1

        def run(self):
            os.kill(os.getpid(), signal.SIGTERM)  # while it runs, a SIGTERM is a leave
            deadline = time.monotonic() + 5
            while not self.asked and time.monotonic() < deadline:
                time.sleep(0.01)
            assert self.asked == 1
            return {}

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(peer_module, "Peer", Finished)
    try:
        assert peer_module.run_peer(None) == {}
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN and signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        faulthandler.unregister(signal.SIGUSR1)  # run_peer registers the stack dump; not this process's to keep


def test_a_first_ctrl_c_asks_the_peer_to_leave_after_its_step_and_a_second_leaves_at_once(monkeypatch, caplog):
    """The first SIGINT sets the stop (the peer finishes its step, its round and its checkpoint); the second
    raises KeyboardInterrupt in the main thread, which `join` turns into exit status 130, without a traceback."""
    import logging
    import threading
    from types import SimpleNamespace

    from click.testing import CliRunner

    from p2pdiloco import peer as peer_module
    from p2pdiloco.cli import cli

    stub = SimpleNamespace(stop=threading.Event())
    with caplog.at_level(logging.INFO):
        peer_module.Peer.request_stop(stub)
    assert stub.stop.is_set() and "Ctrl-C again to leave at once" in caplog.text
    with pytest.raises(KeyboardInterrupt):
        peer_module.Peer.request_stop(stub)

    def interrupted(cfg, life=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(peer_module, "run_peer", interrupted)
    # --restarts 0: no supervisor, which would fork this test process
    result = CliRunner().invoke(cli, ["join", "--model", "tiny", "--eval-every", "0", "--restarts", "0"])
    assert result.exit_code == 130 and "Traceback" not in result.output


def test_join_help_lists_its_options_by_config_section():
    result = CliRunner().invoke(cli, ["join", "--help"])
    assert result.exit_code == 0
    sections, current = {}, None
    for line in result.output.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
        elif current and line.startswith("  --"):
            sections.setdefault(current, []).append(line.split()[0])
    assert list(sections) == ["Model, data and the run", "Inner steps", "Outer step", "Meeting the swarm",
                              "Rounds, islands and the wire", "Other options"]
    assert "--model" in sections["Model, data and the run"] and "--log-dir" in sections["Model, data and the run"]
    assert "--inner-lr" in sections["Inner steps"] and "--outer-lr" in sections["Outer step"]
    assert "--initial-peers" in sections["Meeting the swarm"]
    assert "--compression" in sections["Rounds, islands and the wire"]
    assert sections["Other options"] == ["--profile", "--nproc", "--restarts"] and "-h, --help" in result.output
    listed = [option for options in sections.values() for option in options]
    assert len(listed) == len(set(listed)) > 60


def test_an_unhandled_error_in_a_peer_is_a_crash_that_a_supervisor_restarts(monkeypatch):
    """Not a one-line error for the user (exit 1, left alone) but sysexits' EX_SOFTWARE, with its traceback."""
    from p2pdiloco import peer as peer_module
    from p2pdiloco.runtime.supervise import EXIT_CRASH

    def broken(cfg, life=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(peer_module, "run_peer", broken)
    result = CliRunner().invoke(cli, ["join", "--model", "tiny", "--restarts", "0"])
    assert result.exit_code == EXIT_CRASH == 70


@pytest.mark.parametrize("tokenizer", ["tok.json", "./missing"])
def test_a_tokenizer_that_cannot_load_is_one_clear_line_not_a_crash_to_restart(tmp_path, monkeypatch, tokenizer):
    """A bad --tokenizer is found as the peer prepares its data, after the supervisor forked it: a crash there
    was restarted five times, each with its traceback."""
    from p2pdiloco import peer as peer_module
    from p2pdiloco.training.tokenizer import load_tokenizer

    (tmp_path / "tok.json").write_text('{"not": "a tokenizer"}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(peer_module, "run_peer", lambda cfg, life=None: load_tokenizer(cfg.tokenizer))
    result = CliRunner().invoke(cli, ["join", "--model", "tiny", "--tokenizer", tokenizer, "--restarts", "0"])
    assert result.exit_code == 1, result.output
    assert f"--tokenizer {tokenizer}" in result.output and "Traceback" not in result.output
