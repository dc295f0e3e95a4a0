"""Decoupled rounds without a network: background rounds, delayed application, weights, RDA, grace window."""

import gc
import threading

import pytest
import torch

from p2pdiloco.config import InnerConfig
from p2pdiloco.training.diloco import DiLoCo, SoloMerger, train
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model, rda_segments
from p2pdiloco.training.spill import OnDisk
from p2pdiloco.core.outer import OuterOptimizer, merge_weights, rda_reference, solo_scale, weighted_merge
from p2pdiloco.protocol.outcomes import Committed, RolledBack, Solo
from p2pdiloco.protocol.remote import Member
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.timing import GracePolicy, RoundClock
from tests.unit.test_exact import exact_merge


def random_batches(seed=0, batch=4, seq=16):
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 256, (batch, seq + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def make_diloco(merger, seed=0, keep=None):
    torch.manual_seed(seed)
    model = build_model("tiny", seed=0)
    cfg = InnerConfig(steps=4, batch_size=4, seq_len=16, warmup_steps=0)
    trainer = InnerTrainer(model, random_batches(seed), cfg, torch.device("cpu"))
    state = GlobalState(flat_params(model), lr=0.7, momentum=0.9)
    return DiLoCo(trainer, state, merger, peer="me", name="me", keep=keep)


def member(peer, version, digest, tokens, steps) -> Member:
    return Member(peer=peer, name=peer, version=version, digest=digest, tokens=tokens, steps=steps, budget=0.0)


class HeldMerger:
    """Holds every round until released: stands for a slow island forming and a slow all-reduce."""

    def __init__(self, outcome=None):
        self.release, self.entered = threading.Event(), threading.Event()
        self.outcome = outcome

    def merge(self, c):
        self.entered.set()
        assert self.release.wait(30)
        return self.outcome(c) if self.outcome else Solo.of(c)


def test_training_goes_on_while_the_round_is_in_flight_and_the_merge_is_rebased():
    merger = HeldMerger()
    d = make_diloco(merger)
    theta0 = d.state.params.clone()
    for _ in range(4):
        d.inner_step()
    d.contribute()
    delta, snapshot = d.in_flight.contribution.delta.clone(), d.local_params()
    assert merger.entered.wait(10)
    for _ in range(3):  # the round is held: inner steps do not wait for it
        d.inner_step()
        assert d.poll() is None
    assert d.unmerged_tokens == 7 * d.trainer.tokens_per_step
    before_apply = d.local_params()
    merger.release.set()
    settled = d.wait(10)
    assert settled.applied and settled.steps_in_flight == 3
    expected = OuterOptimizer(theta0.clone(), 0.7, 0.9)
    expected.step(delta)
    assert torch.equal(d.state.params, expected.params)  # Θ ← outer(Θ, Δ_S)
    # θ keeps the 3 in-flight steps, moved onto the new Θ: θ = Θ_new + (θ_before_apply − θ_S)
    assert d.unmerged_tokens == 3 * d.trainer.tokens_per_step and d.state.version == 1
    in_flight_progress = before_apply - snapshot
    assert in_flight_progress.abs().max() > 0
    assert torch.allclose(d.local_params(), d.state.params + in_flight_progress, rtol=0, atol=1e-6)
    # no snapshot of θ is kept in flight: θ_S is rebuilt as Θ_S − Δ, the same bits on every run
    assert torch.equal(d.local_params(), before_apply.sub(theta0).add(delta).add(d.state.params))


def test_no_gradients_are_held_between_inner_steps_where_rounds_and_checkpoints_come_and_go():
    d = make_diloco(SoloMerger())
    d.inner_step()
    assert all(p.grad is None for p in d.trainer.model.parameters())  # 4 bytes per parameter, freed at once


def test_rolled_back_round_changes_nothing_and_its_tokens_ride_along():
    merger = HeldMerger(outcome=lambda c: RolledBack(reason="no island"))
    d = make_diloco(merger)
    for _ in range(4):
        d.inner_step()
    d.contribute()
    merger.release.set()
    d.inner_step()
    theta_before, global_before = d.local_params(), d.state.params.clone()
    settled = d.wait(10)
    assert not settled.applied
    assert torch.equal(d.local_params(), theta_before) and torch.equal(d.state.params, global_before)
    assert d.unmerged_tokens == 5 * d.trainer.tokens_per_step and d.unmerged_steps == 5
    assert d.merged_seconds == 0.0 and d.unmerged_seconds > 0  # nothing reached Θ: no goodput yet
    # the next contribution covers both rounds' steps, measured from the unchanged Θ
    d.contribute()
    c = d.in_flight.contribution
    assert c.steps == 5 and torch.equal(c.delta, global_before - theta_before)
    d.close()


def test_a_commit_adds_the_tokens_its_merge_counted_to_theta_not_the_members_claims():
    def with_a_liar(c):
        liar = member("liar", c.version, c.digest, 1000 * c.tokens, c.steps)
        return Committed(reason="ok", merged=c.delta.clone(), members=[c.member, liar], weights=[0.5, 0.5],
                         merged_tokens=3 * c.tokens)

    merger = HeldMerger(outcome=with_a_liar)
    d = make_diloco(merger)
    for _ in range(4):
        d.inner_step()
    d.contribute()
    merger.release.set()
    assert d.wait(10).applied
    assert d.state.tokens == 3 * 4 * d.trainer.tokens_per_step and d.state.last_members == ["me", "liar"]
    d.close()


class ScriptedMerger:
    """Each round's outcome from the next function of a script."""

    def __init__(self, *outcomes):
        self.outcomes, self.deltas = list(outcomes), []

    def merge(self, c):
        self.deltas.append(c.delta.clone())
        return self.outcomes.pop(0)(c)


def three_members(c):
    others = [member(p, c.version, c.digest, c.tokens, c.steps) for p in ("b", "c")]
    return Committed(reason="ok", merged=c.delta.clone(), members=[c.member, *others], weights=[1 / 3] * 3,
                     merged_tokens=3 * c.tokens)


def test_a_solo_merge_after_three_member_merges_steps_a_third_of_its_delta_until_it_has_been_alone_a_while(caplog):
    """Issue 46: in the three-peer swarm a peer's solo merge after three-member ones raised the merged model's loss
    (CI: 2.40 to 2.72); its Δ now counts as one of the latest islands' three members (core.outer.solo_scale)."""
    caplog.set_level("INFO", logger="p2pdiloco.training.diloco")
    d = make_diloco(ScriptedMerger(three_members, *[Solo.of] * 9))
    expected = OuterOptimizer(d.state.params.clone(), 0.7, 0.9)
    scales = []
    for _ in range(10):
        for _ in range(4):
            d.inner_step()
        d.contribute()
        latest = d.state.island_sizes()  # outcomes are applied by this thread, in `wait`
        assert d.wait(10).applied
        scales.append(solo_scale(latest) if d.state.last_members == ["me"] else 1.0)
        expected.step(d.merger.deltas[-1], scale=scales[-1])
        assert torch.equal(d.state.params, expected.params)
    # the three-member merge at 1; solos at 1/3 while it is among the latest 8 merges, then at 1 (alone a while)
    assert scales == [1.0] + [1 / 3] * 8 + [1.0], scales
    said = [r.getMessage() for r in caplog.records if "merged alone" in r.getMessage()]
    assert len(said) == 8 and "merges of up to 3 members" in said[0] and "(× 0.333)" in said[0], said
    d.close()


def test_the_solo_scale_is_one_over_the_largest_of_the_latest_islands():
    assert solo_scale([]) == 1.0 and solo_scale([1, 1]) == 1.0  # a learner alone, as it always stepped
    assert solo_scale([3, 1, 2]) == pytest.approx(1 / 3) and solo_scale([0]) == 1.0
    state = GlobalState(torch.zeros(4), lr=1.0, momentum=0.0)
    state.apply(torch.ones(4), ["a", "b", "c", "d"])
    state.apply(torch.ones(4), ["a"], scale=solo_scale(state.island_sizes()))
    assert state.island_sizes() == [4, 1] and torch.equal(state.params, torch.full((4,), -1.25))


def test_a_merger_that_raises_costs_one_round_never_the_peer_even_when_waited_for():
    def broken(c):
        raise RuntimeError("bug in the merger")

    d = make_diloco(HeldMerger(outcome=broken))
    for _ in range(4):
        d.inner_step()
    d.contribute()
    d.merger.release.set()
    theta_before = d.local_params()
    settled = d.wait(10)  # leaving (and sync mode) wait for the round instead of polling it
    assert not settled.applied and "bug in the merger" in settled.outcome.reason
    assert torch.equal(d.local_params(), theta_before) and d.unmerged_steps == 4
    with pytest.raises(TimeoutError):  # a round that never settles is reported, not waited out forever
        d.merger.release.clear()
        d.contribute()
        d.wait(0.2)
    d.merger.release.set()
    d.close()


def test_eager_in_flight_steps_start_from_the_estimated_next_global_model_and_keep_their_progress():
    merger = HeldMerger()
    d = make_diloco(merger)
    d.eager = True
    for _ in range(4):
        d.inner_step()
    global_before = [t.clone() for t in d.state.outer.state_tensors()]
    d.contribute()
    delta = d.in_flight.contribution.delta.clone()
    # no merge seen yet: the estimate is our own Δ, which is exactly what a round of one applies
    assert torch.equal(d.local_params(), d.state.outer.lookahead(delta))
    # the estimate moves θ only: Θ and the outer momentum wait for the round's outcome
    assert all(torch.equal(a, b) for a, b in zip(global_before, d.state.outer.state_tensors()))
    theta0 = global_before[0]
    for _ in range(2):
        d.inner_step()
    in_flight_progress = d.local_params() - d.in_flight.origin
    merger.release.set()
    assert d.wait(10).applied
    assert torch.allclose(d.local_params(), d.state.params + in_flight_progress, atol=1e-6)
    assert d.last_merged is not None and d.last_weight == 1.0

    # after a merge of two with shares 1/4 (ours) and 3/4, the estimate mixes our fresh Δ with that merge
    merged = torch.full_like(theta0, 1e-3)
    merger.outcome = lambda c: Committed(merged=merged, weights=[0.25, 0.75], members=[
        member(peer="me", version=1, digest="a", tokens=c.tokens, steps=c.steps),
        member(peer="other", version=1, digest="a", tokens=3 * c.tokens, steps=c.steps)])
    d.contribute()
    d.wait(10)
    assert torch.equal(d.last_merged, merged) and d.last_weight == 0.25
    merger.release.clear()
    d.inner_step()
    d.contribute()
    fresh = d.in_flight.contribution.delta
    assert torch.equal(d.local_params(), d.state.outer.lookahead(fresh * 0.25 + merged * 0.75))
    merger.release.set()
    d.wait(10)
    d.close()


def test_an_eager_peer_whose_round_is_rolled_back_or_abandoned_keeps_all_its_local_progress():
    for outcome_of_round in ("rolled back", "abandoned"):
        merger = HeldMerger(outcome=lambda c: RolledBack(reason="no island"))
        d = make_diloco(merger)
        d.eager = True
        theta0 = d.state.params.clone()
        for _ in range(4):
            d.inner_step()
        snapshot = d.local_params()
        d.contribute()
        d.inner_step()
        in_flight_progress = d.local_params() - d.in_flight.origin
        if outcome_of_round == "rolled back":
            merger.release.set()
            assert not d.wait(10).applied
        else:
            d.abandon()
            merger.release.set()
        assert torch.equal(d.state.params, theta0)
        assert torch.allclose(d.local_params(), snapshot + in_flight_progress, atol=1e-6)
        assert d.unmerged_steps == 5  # the next contribution carries all five steps from the unchanged Θ
        d.close()


def test_outer_lookahead_is_the_step_without_taking_it():
    g = torch.Generator().manual_seed(1)
    params, delta = torch.randn(1000, generator=g), torch.randn(1000, generator=g) * 1e-2
    opt = OuterOptimizer(params.clone(), 0.7, 0.9)
    opt.step(torch.randn(1000, generator=g) * 1e-2)  # some momentum
    before = [t.clone() for t in opt.state_tensors()]
    ahead = opt.lookahead(delta)
    assert all(torch.equal(a, b) for a, b in zip(before, opt.state_tensors()))
    opt.step(delta)
    assert torch.equal(ahead, opt.params)  # bit for bit: the same ops in the same order


def test_stale_contribution_adopts_the_groups_newer_state_and_keeps_in_flight_steps():
    donor = make_diloco(SoloMerger(), seed=1)
    for _ in range(3):
        donor.inner_step()
    donor.contribute()
    donor.wait(10)  # the donor is now one version ahead
    newer = donor.state.snapshot()
    merger = HeldMerger(outcome=lambda c: Committed(merged=c.delta, members=[
        member(peer="me", version=0, digest="a", tokens=c.tokens, steps=c.steps),
        member(peer="donor", version=1, digest="b", tokens=1, steps=1)], state=newer))
    d = make_diloco(merger)
    for _ in range(2):
        d.inner_step()
    snapshot = d.local_params()
    d.contribute()
    merger.release.set()
    d.inner_step()
    before_apply = d.local_params()
    assert d.wait(10).applied
    assert d.state.version == 1 and torch.equal(d.state.params, newer[1][0])
    assert torch.allclose(d.local_params(), newer[1][0] + (before_apply - snapshot), atol=1e-6)
    assert d.unmerged_steps == 1


def test_a_stale_member_that_could_not_fetch_the_groups_result_does_not_claim_to_hold_it():
    """Its Δ was merged into the group's newer state, so its tokens are no longer unmerged; but its own copy
    of Θ is unchanged until it catches up, so the round must not be reported as applied."""
    merger = HeldMerger(outcome=lambda c: Committed(merged=c.delta, stale=True, members=[
        member(peer="me", version=0, digest="a", tokens=c.tokens, steps=c.steps),
        member(peer="newer", version=3, digest="b", tokens=1, steps=1)], weights=[0.5, 0.5]))
    d = make_diloco(merger)
    for _ in range(3):
        d.inner_step()
    d.contribute()
    global_before = d.state.params.clone()
    merger.release.set()
    settled = d.wait(10)
    assert not settled.applied and settled.outcome.committed
    assert torch.equal(d.state.params, global_before) and d.state.version == 0
    assert d.unmerged_steps == 0 and d.last_merge is None  # counted as merged (it is, elsewhere), once
    # it still learns how far the merge would move its own state: the bound on states it downloads later
    assert len(d.state.reach.moves) == 1 and d.state.reach.moves[0][0] > 0
    d.close()


def test_train_loop_with_one_peer_never_blocks_and_applies_its_own_updates():
    d = make_diloco(SoloMerger())
    rounds, step_seconds, contributed = [], [], []
    train(d, steps_per_round=4, should_leave=lambda: len(rounds) >= 3, on_round=rounds.append,
          on_step=lambda loss, seconds: step_seconds.append(seconds), on_contribute=contributed.append)
    assert [r.applied for r in rounds] == [True, True, True] and d.state.version == 3
    assert [c.steps for c in contributed] == [4, 4, 4]
    # goodput bookkeeping: every step's time is either merged or still unmerged, never both or neither
    assert d.merged_seconds == pytest.approx(sum(c.seconds for c in contributed))
    assert d.merged_seconds + d.unmerged_seconds == pytest.approx(sum(step_seconds))
    d.close()



class SlowSolo:
    """Merges alone after `seconds`: a round that takes a while, as over a slow link."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def merge(self, c):
        import time

        time.sleep(self.seconds)
        return Solo.of(c)


@pytest.mark.parametrize("synchronous", [True, False], ids=["sync", "decoupled"])
def test_the_train_loop_steps_while_a_round_runs_only_when_decoupled(synchronous):
    """--mode sync waits for each round before the next inner step; the default trains on meanwhile (and its
    next contribution carries the steps taken in flight)."""
    d = make_diloco(SlowSolo(0.3))
    rounds, in_flight, contributed = [], [], []
    train(d, steps_per_round=4, should_leave=lambda: len(rounds) >= 3, on_round=rounds.append,
          on_step=lambda loss, seconds: in_flight.append(d.in_flight is not None), on_contribute=contributed.append,
          synchronous=synchronous)
    assert [r.applied for r in rounds] == [True] * 3 and d.state.version == 3
    if synchronous:
        assert not any(in_flight) and [c.steps for c in contributed] == [4, 4, 4]
    else:
        assert sum(in_flight) >= 3 and all(c.steps >= 4 for c in contributed)
    d.close()


def test_round_seconds_sizes_each_round_by_time_not_by_steps():
    """--round-seconds 0.2: a contribution when 0.2 s have passed since the last, however many steps that was
    (steps_per_round is never reached)."""
    import time

    d = make_diloco(SoloMerger())
    rounds, contributed, at = [], [], []

    def contribute(c):
        contributed.append(c)
        at.append(time.monotonic())

    started = time.monotonic()
    train(d, steps_per_round=10 ** 9, should_leave=lambda: len(rounds) >= 3 or time.monotonic() - started > 20,
          on_round=rounds.append, on_contribute=contribute, round_seconds=0.2)
    gaps = [b - a for a, b in zip([started, *at], at)]
    assert len(contributed) == 3 and all(g >= 0.2 for g in gaps), gaps
    assert all(c.steps >= 1 for c in contributed) and d.state.version == 3
    d.close()

def test_island_of_three_merges_with_tokens_squared_over_steps_weights():
    tokens, steps = [1000, 2000, 4000], [10, 10, 20]  # 100, 200, 200 tokens per step
    # hand computation: 1000²/10 = 1e5, 2000²/10 = 4e5, 4000²/20 = 8e5  →  1/13, 4/13, 8/13
    weights = merge_weights(tokens, steps, "tokens2")
    assert weights == pytest.approx([1 / 13, 4 / 13, 8 / 13])
    g = torch.Generator().manual_seed(3)
    deltas = [torch.randn(40_000, generator=g) * 1e-3 for _ in range(3)]
    merged = exact_merge(deltas, weights)
    hand = (deltas[0] * 1 + deltas[1] * 4 + deltas[2] * 8) / 13
    assert (merged - hand).norm() / hand.norm() < 1e-5
    assert merge_weights(tokens, steps, "tokens") == pytest.approx([1 / 7, 2 / 7, 4 / 7])
    assert merge_weights(tokens, steps, "uniform") == pytest.approx([1 / 3] * 3)


def test_rda_keeps_the_norm_that_a_plain_mean_of_orthogonal_updates_shrinks():
    model = build_model("tiny", seed=0)
    segments = rda_segments(model)
    n = sum(p.numel() for p in model.parameters())
    assert segments and segments[0][0] > 0  # the embeddings come first and keep the plain mean
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(n, generator=g) for _ in range(4)]
    weights = [0.25] * 4
    rda, mean = rda_reference(deltas, weights, segments), weighted_merge(deltas, weights)
    start, end = segments[5]
    member_norm = sum(x[start:end].norm() for x in deltas) / 4
    assert mean[start:end].norm() < 0.6 * member_norm  # ~1/√4: the outer lr would need retuning
    assert rda[start:end].norm() == pytest.approx(float(member_norm), rel=1e-4)
    assert torch.equal(rda[: segments[0][0]], mean[: segments[0][0]])  # embeddings: plain weighted mean


def test_grace_window_adapts_when_step_time_changes():
    clock, policy = RoundClock(), GracePolicy(gamma=0.5, floor=1.0, cap=100.0)
    for _ in range(20):
        clock.step.update(0.5)
    clock.quorum.update(1.0)
    clock.sync.update(2.0)
    fast = clock.grace(overlap_steps=20, policy=policy)
    assert fast == pytest.approx(0.5 * (20 * 0.5 - 1.0 - 2.0))
    for _ in range(20):
        clock.step.update(1.5)  # the machine got 3x slower: more slack to wait for island members
    slow = clock.grace(overlap_steps=20, policy=policy)
    assert slow > 2.5 * fast
    for _ in range(20):
        clock.sync.update(40.0)  # the network got slow: no slack left, hivemind's floor
    assert clock.grace(overlap_steps=20, policy=policy) == policy.floor


def test_allreduce_budget_follows_the_measured_link_not_the_declared_one():
    clock = RoundClock()
    declared = 100e6 / 8
    first = clock.allreduce_budget(50e6, declared)
    assert first == pytest.approx(3.0 + 3 * 4.0)
    for _ in range(10):
        clock.throughput.update(1e6)  # measured: 8 Mbit/s
    assert clock.allreduce_budget(50e6, declared) == pytest.approx(3.0 + 3 * 50.0, rel=0.05)


@pytest.mark.parametrize("on_disk", [False, True], ids=["in-memory", "on-disk"])
def test_adopting_a_fork_that_lacks_our_merge_restores_our_work_for_the_next_contribution(tmp_path, on_disk):
    d = make_diloco(SoloMerger(), keep=OnDisk(tmp_path) if on_disk else None)
    theta0 = d.state.params.clone()
    for _ in range(3):
        d.inner_step()
    d.contribute()
    own_delta = d.in_flight.contribution.delta.clone()
    d.wait(10)  # our island (of one) merged: version 1 on our side of the fork
    # on disk, the merged Δ waits in a file, not in memory, until a lost fork needs it
    assert d.last_merge.delta.in_memory != on_disk and len(list(tmp_path.iterdir())) == on_disk
    d.inner_step()
    ours, local_now = d.state.params.clone(), d.local_params()
    other = GlobalState(theta0 - 0.01, lr=0.7, momentum=0.9)  # the other island's version 1
    other.apply(torch.full_like(theta0, 1e-3), ["x"])
    metadata, tensors = other.snapshot()
    assert metadata["version"] == 1 and [1, d.state.digest] not in metadata["history"]
    d.adopt(metadata, tensors)
    assert d.unmerged_steps == 4 and d.recovered_tokens == 3 * d.trainer.tokens_per_step
    assert d.merged_seconds == 0.0  # the lost merge's step time no longer counts as goodput
    expected = other.params + (local_now - ours) - own_delta
    assert torch.allclose(d.local_params(), expected, atol=1e-6)
    d.keep.close()
    assert d.last_merge is None and not list(tmp_path.iterdir())  # read back once, then removed
    # a state that descends from our merge keeps it: nothing is restored, nothing counted twice
    d2 = make_diloco(SoloMerger())
    d2.inner_step()
    d2.contribute()
    d2.wait(10)
    descendant = GlobalState(d2.state.params.clone(), lr=0.7, momentum=0.9)
    descendant.load(*d2.state.snapshot())
    descendant.apply(torch.zeros_like(theta0), ["y"])
    d2.adopt(*descendant.snapshot())
    assert d2.unmerged_steps == 0 and d2.recovered_tokens == 0


class BufferedMerger(HeldMerger):
    """As the swarm's merger does: copies Δ into its own (averaging) buffer, lets go of Δ, merges from the buffer."""

    def merge(self, c):
        buffer = c.delta.clone()
        self.entered.set()
        assert self.release.wait(30)
        return Solo(reason="solo", merged=buffer, members=[c.member], weights=[1.0])


def model_sized_tensors(n: int) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) in (torch.Tensor, torch.nn.Parameter) and o.numel() == n)


def test_while_a_round_runs_its_delta_waits_on_disk_and_comes_back_bit_for_bit_when_applied(tmp_path):
    """With a folder for it, the trainer lets its Δ go once written: only the merger's buffer holds one during the
    round (4 bytes per parameter less at the peak, which comes in a backward pass while a round runs). Applying
    the outcome reads it back, and θ and Θ end the same, bit for bit, as with Δ kept in memory."""
    ends = []
    for keep in (None, OnDisk(tmp_path)):
        merger = BufferedMerger()
        d = make_diloco(merger, keep=keep)
        n = d.state.params.numel()
        for _ in range(3):
            d.inner_step()
        before = model_sized_tensors(n)
        d.contribute()
        assert merger.entered.wait(10)
        assert d.in_flight.kept.in_memory == (keep is None)  # waits for the write, if any
        assert model_sized_tensors(n) == before + (2 if keep is None else 1)  # + the buffer (and Δ, in memory)
        d.inner_step()  # a step while the round is in flight: its progress is rebased
        merger.release.set()
        assert d.wait(10).applied
        ends.append((d.local_params(), d.state.params.clone()))
        d.close()
    assert all(torch.equal(a, b) for a, b in zip(*ends))


@pytest.mark.parametrize("damage", ["removed", "truncated", "fails halfway"])
def test_a_delta_that_cannot_be_read_back_costs_local_progress_only(tmp_path, caplog, monkeypatch, damage):
    """Its file removed or cut while the round ran, or a read error after some parameters were rebased (a disk
    failing mid-pass: none of them can be trusted then): the merge still applies (Θ is the group's), θ becomes Θ'
    (the steps in flight are given up), no tokens are left unmerged, and the log says so; the peer goes on."""
    from p2pdiloco.training import spill

    merger = BufferedMerger()
    d = make_diloco(merger, keep=OnDisk(tmp_path))
    for _ in range(3):
        d.inner_step()
    d.contribute()
    assert merger.entered.wait(10) and not d.in_flight.kept.in_memory
    (spilled,) = tmp_path.iterdir()
    reads = []
    if damage == "removed":
        spilled.unlink()
    elif damage == "truncated":
        spilled.write_bytes(spilled.read_bytes()[:100])
    else:
        def failing(self, part, read=spill.FileParts.__getitem__):
            reads.append(part)
            if len(reads) > 3:
                raise OSError("I/O error")
            return read(self, part)

        monkeypatch.setattr(spill.FileParts, "__getitem__", failing)
    d.inner_step()
    merger.release.set()
    settled = d.wait(10)
    assert settled.applied and d.state.version == 1
    assert torch.equal(d.local_params(), d.state.params) and d.unmerged_tokens == 0 and d.unmerged_steps == 0
    assert "could not read back the round's Δ" in caplog.text
    assert damage != "fails halfway" or len(reads) > 3  # it failed after some parameters were rebased
    d.inner_step()
    assert d.unmerged_steps == 1
    d.close()


def test_a_snapshot_for_sharing_is_made_in_shared_memory_and_does_not_move_with_the_state():
    """Handed to the averager process, a shared snapshot travels as a handle: no second copy of Θ and momentum."""
    from p2pdiloco.core.state import GlobalState

    state = GlobalState(torch.randn(1000), 0.7, 0.9)
    meta, (params, momentum) = state.snapshot(shared=True)
    assert params.is_shared() and momentum.is_shared() and meta["version"] == 0
    before = params.clone()
    state.apply(torch.full((1000,), 1e-2), ["me"])
    assert torch.equal(params, before) and not torch.equal(state.params, before)
    assert not any(t.is_shared() for t in state.snapshot()[1])  # the plain snapshot stays private


def test_with_no_step_in_flight_the_rebase_leaves_theta_exactly_on_the_new_global_model():
    """Synchronous rounds: θ_S rebuilt as Θ_S − Δ gives a progress of exactly 0, so θ = Θ' bit for bit; and
    the pseudo-gradient taken parameter by parameter has the bits of the flat formula."""
    from p2pdiloco.core.outer import pseudo_gradient
    from p2pdiloco.training.diloco import pseudo_gradient_of

    d = make_diloco(SoloMerger())
    for _ in range(3):
        d.inner_step()
    assert torch.equal(pseudo_gradient_of(d.trainer.model, d.state.params),
                       pseudo_gradient(d.state.params, flat_params(d.trainer.model)))
    for _ in range(2):  # the second round starts from a θ that the first rebase wrote
        d.contribute()
        assert d.wait(10).applied
        assert torch.equal(d.local_params(), d.state.params)
        d.inner_step()
    d.close()


# in a fresh process, with glibc's mmap threshold fixed (mallopt(3)) so that every temporary over 128 kB is mapped
# while it lives and unmapped when freed: with the threshold glibc moves by itself, how much freed heap the
# round's temporaries reuse varies from run to run (4.5-25 MB measured for the same round, 25 in one CI run), and
# the peak would measure the allocator rather than what the round holds at once
ROUND_ON_DISK = """
import sys, torch
from pathlib import Path
from p2pdiloco.config import InnerConfig
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.outcomes import Solo, copy_parts
from p2pdiloco.training.diloco import DiLoCo
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model
from p2pdiloco.training.spill import OnDisk
from tests.harness.memory import PeakGrowth
from tests.unit.test_decoupled import random_batches

model = build_model("base", seed=0)
state = GlobalState(flat_params(model), lr=0.7, momentum=0.9)
buffer = torch.zeros(state.params.numel())  # the averaging buffer, there before the round

class CopyingMerger:  # as the swarm's merger does: Δ copied into its buffer
    def merge(self, c):
        copy_parts(c.kept.parts(), buffer)
        return Solo(reason="solo", merged=buffer, members=[c.member], weights=[1.0])

cfg = InnerConfig(steps=1, batch_size=2, seq_len=8)
d = DiLoCo(InnerTrainer(model, random_batches(0), cfg, torch.device("cpu")), state, CopyingMerger(), "me", "me",
           keep=OnDisk(Path(sys.argv[1])))
d.inner_step()  # AdamW's moments exist
d.contribute()  # and the outer momentum, once a round wrote it
assert d.wait(30).applied
d.inner_step()
with PeakGrowth() as grew:
    d.contribute()
    assert d.wait(30).applied
d.close()
print(grew.bytes, 4 * state.params.numel())
"""


def test_a_round_on_disk_never_holds_a_model_sized_delta_in_the_trainer(tmp_path):
    """Δ is written to its file as it is made, a parameter at a time, and read back the same way: into the merger's
    buffer (as the swarm's merger does) and when the outcome is applied. The process's peak resident memory over a
    whole round then grows by less than half of Δ's 4 bytes per parameter (before: a model-sized Δ at each)."""
    from tests.harness.memory import PeakGrowth, fresh_python

    PeakGrowth()  # skips here where the kernel cannot reset the peak
    out = fresh_python(ROUND_ON_DISK, str(tmp_path), env={"MALLOC_MMAP_THRESHOLD_": str(128 << 10)})
    grew, model_bytes = map(int, out.split()[-2:])
    assert grew < model_bytes / 2, f"peak grew by {grew / 1e6:.1f} MB ({model_bytes / 1e6:.1f} MB of Δ)"
