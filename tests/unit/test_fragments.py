"""Streaming fragments: the split (core.fragments) and a peer's fragments over one trainer (training.fragments):
balanced for every preset, P = 1 bit for bit today's DiLoCo, each fragment's rounds committing or rolling back
on their own."""

import pytest
import torch

from p2pdiloco.config import MODEL_PRESETS
from p2pdiloco.core.fragments import Stagger, imbalance, split
from p2pdiloco.training.diloco import SoloMerger
from p2pdiloco.training.fragments import Streams
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


def test_the_stagger_spreads_first_rounds_over_h_and_p_1_leaves_every_h():
    assert [Stagger(4, 100).first(i) for i in range(4)] == [25, 50, 75, 100]
    assert Stagger(1, 100).first(0) == 100
    s = Stagger(4, 100)
    assert not s.due(0, 24, False) and s.due(0, 25, False) and not s.due(0, 99, True) and s.due(0, 100, True)
    with pytest.raises(ValueError):
        Stagger(4, 100, in_flight=0)


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
    streams = Streams(base.trainer, base.state, lambda i, clock: SoloMerger(), Stagger(1, 4), "me", "me")
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
    streams = Streams(base.trainer, base.state, lambda i, clock: FailingMerger() if i == 1 else SoloMerger(),
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
    streams = Streams(base.trainer, base.state, lambda i, clock: SoloMerger(), Stagger(4, 4), "me", "me")
    seconds = sum(streams.inner_step()[1] for _ in range(3))
    assert sum(p.unmerged_seconds for p in streams.parts) == pytest.approx(seconds)
    assert all(p.unmerged_tokens == 3 * base.trainer.tokens_per_step for p in streams.parts)
    assert streams.swarm_tokens == 3 * base.trainer.tokens_per_step
