"""Streaming fragments: the split (core.fragments) and a peer's fragments over one trainer (training.fragments):
balanced for every preset, P = 1 bit for bit today's DiLoCo, each fragment's rounds committing or rolling back
on their own."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from p2pdiloco.config import MODEL_PRESETS, SwarmConfig
from p2pdiloco.core.fragments import Fragment, Piece, Stagger, fragment_overlap, imbalance, split
from p2pdiloco.protocol.outcomes import Solo
from p2pdiloco.training.diloco import SoloMerger
from p2pdiloco.training.fragments import Streams, train_streams
from p2pdiloco.training.inner import flat_params
from p2pdiloco.training.model import resolve_config
from tests.unit.test_decoupled import make_diloco


def preset_shapes(name):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(resolve_config(name, 32000))
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_every_presets_fragments_are_balanced_and_cover_each_element_once(preset):
    shapes = preset_shapes(preset)
    total = sum(torch.Size(s).numel() for _, s in shapes)
    for p in (2, 8, 24):
        fragments = split(shapes, p)
        assert len(fragments) == p and imbalance(fragments) <= 1.5, (preset, p, imbalance(fragments))
        for f in fragments:
            starts = [(piece.index, piece.start) for piece in f.pieces]
            assert starts == sorted(starts)  # layout order inside a fragment
        runs = sorted((piece.flat.start, piece.flat.stop) for f in fragments for piece in f.pieces)
        assert runs[0][0] == 0 and runs[-1][1] == total  # the pieces tile the flat vector: each element once
        assert all(stop == next_start for (_, stop), (next_start, _) in zip(runs, runs[1:]))
    assert split(shapes, 8) == split(list(shapes), 8)  # every peer computes the same split


def test_a_tensor_larger_than_half_a_fragment_is_cut_in_whole_rows():
    shapes = [("embed", (1000, 8)), ("a", (10, 8)), ("b", (8,))]
    fragments = split(shapes, 4)
    embed = [piece for f in fragments for piece in f.pieces if piece.name == "embed"]
    assert len(embed) > 1 and all(piece.start % 8 == 0 and piece.stop % 8 == 0 for piece in embed)
    assert imbalance(fragments) <= 1.5  # whole tensors: one fragment would hold 8,000 of 8,088 elements
    with pytest.raises(ValueError, match="at least 1"):
        split(shapes, 0)


def test_a_small_split_worked_by_hand():
    """50 elements in 2 fragments: pieces of at most ceil(50 / 2 / 2) = 13, so the 10×4 embedding is cut into
    ceil(40 / 13) = 4 blocks of whole rows, at rows 10·b // 4 = 0, 2, 5, 7 (sizes 8, 12, 8, 12); the largest
    pieces go first, each to the lightest fragment (the lower index on a tie); an empty tensor holds no piece but
    its place in the layout; a scalar is one element."""
    shapes = [("embed", (10, 4)), ("empty", (0, 4)), ("a", (3, 2)), ("b", (4,)), ("scale", ())]
    f0, f1 = split(shapes, 2)
    assert [(q.name, q.index, q.offset, q.start, q.stop) for q in f0.pieces] == [
        ("embed", 0, 0, 0, 8), ("embed", 0, 0, 8, 20), ("a", 2, 40, 0, 6)]
    assert [(q.name, q.index, q.offset, q.start, q.stop) for q in f1.pieces] == [
        ("embed", 0, 0, 20, 28), ("embed", 0, 0, 28, 40), ("b", 3, 46, 0, 4), ("scale", 4, 50, 0, 1)]
    assert (f0.index, f1.index, f0.size, f1.size) == (0, 1, 26, 25)
    assert [(q.name, s) for q, s in f1.slices()] == [("embed", slice(0, 8)), ("embed", slice(8, 20)),
                                                     ("b", slice(20, 24)), ("scale", slice(24, 25))]
    assert f1.pieces[2].flat == slice(46, 50) and f1.pieces[2].size == 4
    # at P = 16 and 17 pieces hold at most ceil(51 / 32) = 2: the embedding's 10 rows, a's 3, b's 2 halves and
    # the scalar make 16 pieces, enough for 16 fragments and not for 17
    assert [f.size for f in split(shapes, 16)] == [4] * 10 + [2] * 5 + [1]
    with pytest.raises(ValueError, match="17 is more than the model's 16 pieces"):
        split(shapes, 17)
    assert [f.size for f in split([("w", (4,))], 4)] == [1, 1, 1, 1]  # pieces of one element where 4 ≤ 2·P
    # a tensor of one row is never cut (pieces of at most 15 here): the vector beside it is, in two halves
    row, vector = split([("w", (1, 30)), ("v", (30,))], 2)
    assert [(q.name, q.start, q.stop) for q in row.pieces] == [("w", 0, 30)]
    assert [(q.name, q.start, q.stop) for q in vector.pieces] == [("v", 0, 15), ("v", 15, 30)]


def test_the_stagger_spreads_first_rounds_over_h_and_p_1_leaves_every_h():
    assert [Stagger(4, 100).first(i) for i in range(4)] == [25, 50, 75, 100]
    assert Stagger(1, 100).first(0) == 100
    s = Stagger(4, 100)
    assert not s.due(0, 24, False) and s.due(0, 25, False) and not s.due(0, 99, True) and s.due(0, 100, True)
    assert Stagger(8, 4).first(0) == 1  # never before the first step
    Stagger(1, 1, in_flight=1)  # the least of each is allowed
    for fragments, h, in_flight in ((0, 100, 2), (4, 0, 2), (4, 100, 0)):
        with pytest.raises(ValueError, match="must be at least 1"):
            Stagger(fragments, h, in_flight)


def test_imbalance_is_the_largest_fragment_over_the_mean_and_only_fragments_join_an_island_early():
    two = split([("w", (12, 1))], 2)
    assert [f.size for f in two] == [6, 6] and imbalance(two) == 1.0
    lopsided = (Fragment(0, (Piece("w", 0, 0, 0, 9),)), Fragment(1, (Piece("w", 0, 0, 9, 12),)))
    assert imbalance(lopsided) == 1.5  # 9 against a mean of 6
    assert not Stagger(1, 100).joins_early(100)  # P = 1: its round is due at H, there is nothing to go along with
    assert Stagger(2, 100).joins_early(50) and not Stagger(2, 100).joins_early(49)


def test_a_fragments_grace_window_is_tau_fragment_periods_and_p_1_keeps_h():
    assert fragment_overlap(96, 1, 2) == 96  # P = 1: the next contribution's due step, as before fragments
    assert fragment_overlap(96, 8, 2) == 24 and fragment_overlap(96, 8, 1) == 12 and fragment_overlap(96, 2, 1) == 48
    assert fragment_overlap(4, 8, 1) == 1  # never under one step
    assert fragment_overlap(100, 3, 1) == 33  # whole steps, rounded down


def drive(step, contribute, wait, rounds=3, h=4, in_flight=2):
    """h steps, a round out, `in_flight` steps while it runs, its outcome applied: `rounds` times."""
    for _ in range(rounds):
        for _ in range(h):
            step()
        contribute()
        for _ in range(in_flight):
            step()
        wait()


def test_one_fragment_is_bit_for_bit_todays_diloco():
    plain = make_diloco(SoloMerger())
    drive(plain.inner_step, plain.contribute, lambda: plain.wait(10))
    base = make_diloco(SoloMerger())
    streams = Streams(base.trainer, base.state, lambda i, clock, state: SoloMerger(), Stagger(1, 4), "me", "me")
    drive(streams.inner_step, lambda: streams.contribute(0), lambda: streams.wait(0, 10))
    part = streams.parts[0]
    assert torch.equal(flat_params(base.trainer.model), flat_params(plain.trainer.model))
    assert torch.equal(part.state.params, plain.state.params) and torch.equal(streams.global_params(),
                                                                              plain.state.params)
    assert torch.equal(part.state.outer.momentum_buffer, plain.state.outer.momentum_buffer)
    assert (part.state.version, part.state.digest) == (plain.state.version, plain.state.digest) == (3, part.state.digest)
    assert (part.unmerged_tokens, part.unmerged_steps) == (plain.unmerged_tokens, plain.unmerged_steps)


class FailingMerger:
    """A round that dies mid-way (its island's peer killed, say): the merger raises."""

    def merge(self, c):
        raise ConnectionError("the island's peer is gone")


def test_each_fragment_commits_or_rolls_back_alone():
    base = make_diloco(SoloMerger())
    theta0 = base.state.params.clone()
    streams = Streams(base.trainer, base.state, lambda i, clock, state: FailingMerger() if i == 1 else SoloMerger(),
                      Stagger(4, 4, in_flight=4), "me", "me")
    for _ in range(8):  # two periods of H = 4: every fragment due twice
        streams.inner_step()
        for i in streams.due():
            streams.contribute(i)
        for i in list(streams.in_flight):
            streams.wait(i, 10)
    assert streams.versions == [2, 0, 2, 2]
    failed = streams.parts[1]
    assert failed.unmerged_steps == 8 and streams.parts[0].unmerged_steps < 4  # its tokens wait for the next round
    held = streams.fragments[1]
    for piece, own in held.slices():  # its Θ never moved; θ kept all its progress
        assert torch.equal(failed.state.params[own], theta0[piece.flat])
    local = flat_params(base.trainer.model)
    assert not torch.equal(local[held.pieces[0].flat], theta0[held.pieces[0].flat])
    for i in (0, 2, 3):  # the others merged: their Θ parts moved, and are what the whole Θ holds
        fragment = streams.fragments[i]
        piece, own = next(iter(fragment.slices()))
        assert not torch.equal(streams.parts[i].state.params[own], theta0[piece.flat])
        assert torch.equal(streams.global_params()[piece.flat], streams.parts[i].state.params[own])


def test_fragments_time_and_tokens_add_up_to_the_steps():
    base = make_diloco(SoloMerger())
    streams = Streams(base.trainer, base.state, lambda i, clock, state: SoloMerger(), Stagger(4, 4), "me", "me")
    seconds = sum(streams.inner_step()[1] for _ in range(3))
    assert sum(p.unmerged_seconds for p in streams.parts) == pytest.approx(seconds)
    assert all(p.unmerged_tokens == 3 * base.trainer.tokens_per_step for p in streams.parts)
    assert streams.swarm_tokens == 3 * base.trainer.tokens_per_step


def streams_on_a_stream(p=3, h=4, seed=0):
    from p2pdiloco.config import InnerConfig
    from p2pdiloco.core.state import GlobalState
    from p2pdiloco.training.data import BatchStream
    from p2pdiloco.training.inner import InnerTrainer
    from p2pdiloco.training.model import build_model
    text = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    model = build_model("tiny", seed=0)
    trainer = InnerTrainer(model, BatchStream(text, 4, 16, seed=1), InnerConfig(batch_size=4, seq_len=16,
                                                                              warmup_steps=0), torch.device("cpu"))
    state = GlobalState(flat_params(model), lr=0.7, momentum=0.9)
    return Streams(trainer, state, lambda i, clock, state: SoloMerger(), Stagger(p, h), "me", "me")


def test_the_fragments_keep_their_states_in_the_global_states_own_two_vectors():
    """No second copy of Θ and the momentum beside the fragments' (8 bytes per parameter, issue 50): each
    fragment's Θ and momentum are slices of the vectors the peer built, and the model's layout still reads whole."""
    base = make_diloco(SoloMerger())
    theta, momentum = base.state.outer.state_tensors()
    before = theta.clone()
    streams = Streams(base.trainer, base.state, lambda i, clock, state: SoloMerger(), Stagger(4, 4), "me", "me")
    for vector, of_part in ((theta, lambda s: s.params), (momentum, lambda s: s.outer.momentum_buffer)):
        views = [of_part(part.state) for part in streams.parts]
        assert all(v.untyped_storage().data_ptr() == vector.untyped_storage().data_ptr() for v in views)
        assert sum(v.numel() for v in views) == vector.numel()
    assert torch.equal(streams.global_params(), before) and not torch.equal(theta, before)  # laid out anew
    assert all(torch.equal(part.state.params, torch.cat([before[p.flat] for p in f.pieces]))
               for f, part in zip(streams.fragments, streams.parts))


def lockstep(streams, steps):
    for _ in range(steps):
        streams.inner_step()
        for i in streams.due():
            streams.contribute(i)
            streams.wait(i, 10)


def test_a_checkpoint_of_fragments_resumes_bit_for_bit_and_is_a_whole_models_for_export(tmp_path):
    from p2pdiloco.training import checkpoint
    ran = streams_on_a_stream()
    lockstep(ran, 7)  # the fragments at different versions, each with unmerged steps
    assert len(set(ran.versions)) > 1
    meta, tensors = ran.checkpoint_state()
    path = checkpoint.save(tmp_path, meta, tensors)
    found = checkpoint.load_one(path, ran.global_params().numel())  # Θ whole: its digest checked as any other's
    assert torch.equal(found.tensors["global"], ran.global_params())
    lockstep(ran, 9)

    resumed = streams_on_a_stream()
    resumed.restore_checkpoint_state(found.meta, found.tensors)
    assert resumed.versions == [part["version"] for part in found.meta["fragments"]["parts"]]
    lockstep(resumed, 9)
    assert resumed.versions == ran.versions
    assert torch.equal(resumed.global_params(), ran.global_params())
    assert torch.equal(flat_params(resumed.trainer.model), flat_params(ran.trainer.model))
    assert [p.unmerged_steps for p in resumed.parts] == [p.unmerged_steps for p in ran.parts]

    with pytest.raises(checkpoint.CheckpointError, match="fragments are"):
        streams_on_a_stream(p=2).restore_checkpoint_state(found.meta, found.tensors)
    found.tensors["global"][0] += 1.0  # fragment 0's part no longer hashes to its digest
    with pytest.raises(checkpoint.CheckpointError, match="fragment 0"):
        streams_on_a_stream().restore_checkpoint_state(found.meta, found.tensors)


class CountingMerger:
    """Solo rounds that note how many of the peer's fragments are in flight at once, and when each left."""

    def __init__(self, i, board):
        self.i, self.board = i, board

    def merge(self, c):
        with self.board["lock"]:
            self.board["now"] += 1
            self.board["most"] = max(self.board["most"], self.board["now"])
            self.board["left"].append((self.i, self.board["streams"].trainer.total_steps))
        time.sleep(0.1)  # a round outlasts a few steps: rounds overlap, and τ has to hold them back
        with self.board["lock"]:
            self.board["now"] -= 1
        return Solo.of(c)


def test_the_training_loop_staggers_the_fragments_rounds_with_at_most_tau_in_flight():
    base = make_diloco(SoloMerger())
    board = dict(lock=threading.Lock(), now=0, most=0, left=[])
    streams = Streams(base.trainer, base.state, lambda i, clock, state: CountingMerger(i, board),
                      Stagger(4, 8, in_flight=2), "me", "me")
    board["streams"] = streams
    steps = iter(range(60))
    rounds = []
    train_streams(streams, lambda: next(steps, None) is None, on_round=lambda i, s: rounds.append((i, s)))
    assert board["most"] <= 2 and streams.in_flight == []
    firsts = {}
    for i, at in board["left"]:
        firsts.setdefault(i, at)
    assert all(firsts[i] >= Stagger(4, 8).first(i) for i in range(4)), firsts
    for i in range(4):  # a fragment's rounds are H steps apart at least
        times = [at for j, at in board["left"] if j == i]
        assert len(times) >= 3 and all(b - a >= 8 for a, b in zip(times, times[1:]))
    assert len(rounds) == len(board["left"]) and all(s.outcome.committed for _, s in rounds)


class Gate:
    """A round held until its gate opens."""

    def __init__(self):
        self.open = threading.Event()

    def merge(self, c):
        assert self.open.wait(30)
        return Solo.of(c)


def test_a_fragment_held_back_by_tau_goes_before_the_others_next_rounds():
    base = make_diloco(SoloMerger())
    gates = [Gate() for _ in range(4)]
    streams = Streams(base.trainer, base.state, lambda i, clock, state: gates[i], Stagger(4, 8, in_flight=2), "me", "me")
    for step in range(1, 13):
        streams.inner_step()
        for i in streams.due():
            streams.contribute(i)
        if step == 4:
            assert streams.in_flight == [0, 1]  # left at steps 2 and 4; 2 and 3 are due at 6 and 8: τ holds them
    assert streams.due() == [] and streams.in_flight == [0, 1]
    gates[0].open.set()
    streams.wait(0, 10)
    # fragment 0 is due again (10 steps since its round), but 2 has waited longest (6 steps past due), then 3
    assert streams.due() == [2]
    for gate in gates:
        gate.open.set()


def test_a_peers_checkpoints_of_fragments_resume_fragments_and_a_peer_of_one_fragment_refuses_them(tmp_path):
    from p2pdiloco.config import ConfigError
    from tests.unit.test_background_checkpoint import checkpoints
    ran = streams_on_a_stream(p=2)
    lockstep(ran, 5)
    saving = checkpoints(tmp_path, SimpleNamespace(state=SimpleNamespace(params=ran.global_params())),
                         swarm=SwarmConfig(fragments=2))
    saving.save(ran, "timed", wait=True)
    resumed = streams_on_a_stream(p=2)
    saving.resume(resumed)
    assert resumed.versions == ran.versions and torch.equal(resumed.global_params(), ran.global_params())
    assert saving.metrics.written[-1].version == sum(ran.versions)
    whole = make_diloco(SoloMerger())
    with pytest.raises(ConfigError, match="was saved with --fragments 2"):
        checkpoints(tmp_path, whole).resume(whole)


@pytest.mark.parametrize("flags, said", [
    (dict(inner=dict(fsdp=True)), "--fsdp"), (dict(swarm=dict(mode="sync")), "--mode sync"),
    (dict(inner=dict(round_seconds=30.0)), "--round-seconds"), (dict(global_state_on_disk=True), "--global-state-on-disk"),
    (dict(outer=dict(rda=True)), "--rda"), (dict(inner=dict(steps=4)), "more than -H 4")])
def test_what_fragments_do_not_run_with_is_refused_in_one_line(flags, said):
    import dataclasses
    from p2pdiloco.config import ConfigError, InnerConfig, OuterConfig, PeerConfig
    parts = dict(inner=InnerConfig(**flags.pop("inner", {})), outer=OuterConfig(**flags.pop("outer", {})),
                 swarm=SwarmConfig(fragments=8, **flags.pop("swarm", {})))
    with pytest.raises(ConfigError, match=said.replace("-", r"\-")):
        dataclasses.replace(PeerConfig(), **parts, **flags)
    assert dataclasses.replace(PeerConfig(), swarm=SwarmConfig(fragments=8)).swarm.fragments == 8
    with pytest.raises(ConfigError, match="fragments must be a positive integer"):
        SwarmConfig(fragments=0)


def test_fragment_0_keeps_the_runs_id_so_a_peer_of_another_p_meets_it_and_is_refused():
    from p2pdiloco.protocol.compat import mismatch
    from p2pdiloco.protocol.remote import PeerRecord
    from p2pdiloco.swarm.fragments import fragment_config
    run = SwarmConfig(run_id="run")
    assert [fragment_config(run, i, 3).run_id for i in range(3)] == ["run", "run_f1of3", "run_f2of3"]
    assert fragment_config(run, 0, 1) is run
    with pytest.raises(ValueError):
        fragment_config(run, 3, 3)
    import dataclasses
    from p2pdiloco.config import PeerConfig
    from p2pdiloco.parts.workload import Workload
    from p2pdiloco.training.model import resolve_config
    shapes = SimpleNamespace(n_params=100, model_config=resolve_config("tiny", 257), segments=[],
                             data=SimpleNamespace(tokenizer_fingerprint="t" * 16, fingerprint="f" * 16))

    def published(fragments):  # the settings a peer publishes and checks at join (parts.workload)
        return Workload.settings(shapes, dataclasses.replace(PeerConfig(), swarm=SwarmConfig(fragments=fragments)))
    whole, fragmented = published(1), published(8)
    assert "fragments" not in whole and fragmented["fragments"].startswith("8:")
    seen = [PeerRecord("x", "x", 1, "d", settings=fragmented)]
    assert "fragments" in mismatch(whole, seen) and mismatch(fragmented, seen) is None
    assert "fragments" in mismatch(fragmented, [PeerRecord("y", "y", 1, "d", settings=whole)])


def test_a_fragment_not_ready_sends_no_round_and_the_others_go_on():
    base = make_diloco(SoloMerger())
    streams = Streams(base.trainer, base.state, lambda i, clock, state: SoloMerger(), Stagger(3, 3), "me", "me")
    steps = iter(range(12))
    rounds = []
    train_streams(streams, lambda: next(steps, None) is None, on_round=lambda i, s: rounds.append(i),
                  ready=lambda i: i != 1)  # fragment 1 has done its rounds (--max-rounds), say
    assert 1 not in rounds and {0, 2} <= set(rounds)
    assert streams.versions[1] == 0 and streams.parts[1].unmerged_steps == 12


def test_a_fragment_goes_along_with_its_peers_island_once_it_has_half_a_round_of_steps():
    """A peer restarted out of phase with the swarm would look for each fragment's islands at its own steps, where
    nobody else is; where the others are looking for an island for fragment i, i goes with half a round or more
    (after every overdue fragment, and within τ)."""
    base = make_diloco(SoloMerger())
    gates = [Gate() for _ in range(4)]
    streams = Streams(base.trainer, base.state, lambda i, clock, state: gates[i], Stagger(4, 8, in_flight=2), "me", "me")
    for _ in range(3):
        streams.inner_step()
    assert streams.due(looking=lambda i: i == 3) == [0]  # 0 is due at 2; 3 has 3 steps, under H/2
    streams.inner_step()
    assert streams.due(looking=lambda i: i == 3) == [0, 1]  # overdue first (1 is due at 4); τ: no room for 3
    streams.contribute(0)
    assert streams.due(looking=lambda i: i == 3) == [1]
    assert streams.due(allowed=lambda i: i != 1, looking=lambda i: i == 3) == [3]  # early, 4 steps in
    assert streams.due(allowed=lambda i: i != 1) == []  # nobody looking: 3 waits for its step 8
    for gate in gates:
        gate.open.set()


def test_a_peer_of_p_fragments_gives_its_free_heap_back_once_a_period_not_after_every_fragments_round():
    """A heap trim walks every arena whatever one fragment's round freed: 0.4 % of the training thread at P = 8."""
    from p2pdiloco.config import PeerConfig
    from p2pdiloco.parts.streamed import StreamedStay

    parks = []
    tensors = SimpleNamespace(park=lambda give_back=True: parks.append(give_back))
    lanes = [SimpleNamespace(log=SimpleNamespace(settled=lambda s: None, merged_rounds=0, round=lambda *a: None),
                             membership=SimpleNamespace(publish=lambda: None, own_sketch=[]))
             for _ in range(4)]
    checkpoints = SimpleNamespace(note_merged=lambda settled, fragment: None)
    stay = StreamedStay(PeerConfig(checkpoint_every=0, eval_every=0), threading.Event(), None, tensors, None, lanes,
                        checkpoints, None, "x", None, lambda: None)
    for i in [0, 1, 2, 3, 0, 1, 2, 3]:
        stay._on_round(i, SimpleNamespace(applied=True))
    assert parks == [False, False, False, True] * 2
    stay._on_round(0, None)  # nothing settled: nothing parked
    assert len(parks) == 8
