"""The chaos tool's own bookkeeping, without a swarm: restarts of peers that exited, lives from the event log."""

import json
import subprocess
import sys
import time

from p2pdiloco.ops.chaos import Chaos, ChaosPlan, Slot, lives_from_logs


def test_a_peer_that_exits_by_itself_is_restarted_and_its_exit_ends_that_life(tmp_path):
    chaos = Chaos(ChaosPlan(restart_after=(1.0, 2.0)), tmp_path, [])
    chaos.start = 0.0
    crashed, killed = Slot("crashed"), Slot("killed")
    for slot in (crashed, killed):
        slot.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
        slot.proc.wait()
        slot.spawns.append(100.0)
    killed.restart_at = 103.0  # the chaos tool killed it and already scheduled its restart
    chaos.slots = {"crashed": crashed, "killed": killed}
    chaos._restart_exited(now=110.0)
    assert 111.0 <= crashed.restart_at <= 112.0 and killed.restart_at == 103.0
    events = [json.loads(line) for line in chaos.events_path.read_text().splitlines()]
    assert [(e["event"], e["peer"], e["returncode"]) for e in events] == [("exit", "crashed", 1)]


def test_several_live_peers_are_offered_to_a_restarted_peer(tmp_path):
    chaos = Chaos(ChaosPlan(), tmp_path, [])
    chaos.address = "/ip4/127.0.0.1/tcp/1/p2p/bootstrap"
    assert chaos._live_addresses(exclude="x") == [chaos.address]  # nobody else yet: the meeting point
    for i in range(5):
        slot = chaos.slots.setdefault(f"p{i}", Slot(f"p{i}"))
        slot.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        slot.spawns.append(0.0)
        (tmp_path / f"p{i}.addrs").write_text(f"/ip4/127.0.0.1/tcp/{i + 2}/p2p/p{i}\n")
    try:
        offered = chaos._live_addresses(exclude="p0")
        assert len(offered) == 3 and len(set(offered)) == 3 and not any(a.endswith("/p0") for a in offered)
    finally:
        for slot in chaos.slots.values():
            slot.proc.kill()
            slot.proc.wait()


def test_lives_end_at_a_kill_or_an_exit(tmp_path):
    events = [dict(time=0, event="begin"), dict(time=0, event="spawn", peer="a"),
              dict(time=30, event="exit", peer="a", returncode=1), dict(time=35, event="spawn", peer="a"),
              dict(time=60, event="kill", peer="a"), dict(time=100, event="end")]
    (tmp_path / "chaos-events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "a.jsonl").write_text(json.dumps(dict(kind="start", time=10)) + "\n")
    lives = lives_from_logs(tmp_path)
    assert [(life.spawned, life.ended) for life in lives] == [(0, 30), (35, 60)]


def test_a_freeze_the_floor_refuses_holds_kills_back_until_it_lands(tmp_path):
    """Kills of joining peers could keep the trainers below the floor all run long, so no freeze would be drawn
    (a CI run of the short chaos test drew none): a refused freeze holds kills back until it lands, or a while."""
    plan = ChaosPlan(seconds=4.0, kill_every=0.2, freeze_every=0.2, add_every=0, freeze_precedence=10.0, seed=1)
    chaos = Chaos(plan, tmp_path, [])
    calls = []

    def freeze():
        calls.append(("freeze", time.time()))
        return time.time() >= chaos.start + 2.0  # refused for want of trainers for the first 2 s

    def kill(now):
        calls.append(("kill", time.time()))
        return True

    chaos._freeze, chaos._kill_in_phase = freeze, kill
    chaos.start = time.time()
    chaos._loop()
    first_refusal = next(t for what, t in calls if what == "freeze")
    landed = next(t for what, t in calls if what == "freeze" and t >= chaos.start + 2.0)
    assert not [t for what, t in calls if what == "kill" and first_refusal < t < landed], calls
    assert [t for what, t in calls if what == "kill" and t > landed], calls  # kills resume once it landed
