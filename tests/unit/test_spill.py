"""A contribution's Δ kept for fork recovery: on disk between rounds, the same bits when read back."""

import logging

import pytest
import torch

from p2pdiloco.training.spill import OnDisk


def test_spilled_deltas_come_back_bit_for_bit_and_never_take_more_than_two_files(tmp_path):
    store = OnDisk(tmp_path)
    last = None
    for seed in range(5):  # rounds: the new Δ is written while the last merge's is still kept
        delta = torch.randn(10_001, generator=torch.Generator().manual_seed(seed))
        kept = store.put(delta)
        assert not kept.in_memory and len(list(tmp_path.iterdir())) <= 2
        assert torch.equal(kept.get(), delta)
        if last is not None:
            last.drop()
        last = kept
    last.drop()
    with pytest.raises(ValueError, match="dropped"):
        last.get()
    store.close()
    assert not list(tmp_path.iterdir())
    last.drop()  # twice, and after close: nothing to do


@pytest.mark.parametrize("how", ["whole", "as it is made"])
def test_a_delta_that_cannot_be_written_stays_in_memory_and_says_so(tmp_path, caplog, how):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    store = OnDisk(blocker / "fork-recovery")
    delta = torch.arange(100, dtype=torch.float32)
    with caplog.at_level(logging.WARNING):
        kept = store.put(delta) if how == "whole" else store.put_parts(lambda: iter(delta.split(30)), delta.numel())
        assert kept.in_memory and torch.equal(kept.get(), delta) and torch.equal(kept.parts(), delta)
    assert "keeps it in memory" in caplog.text
    store.close()


def test_a_truncated_file_is_an_error_not_a_wrong_delta(tmp_path):
    store = OnDisk(tmp_path)
    kept = store.put(torch.ones(1000))
    assert not kept.in_memory
    path = next(tmp_path.iterdir())
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(OSError, match="not the 4000 bytes"):
        kept.get()
    store.close()


def test_a_delta_written_as_it_is_made_reads_back_a_slice_at_a_time_bit_for_bit(tmp_path):
    store = OnDisk(tmp_path)
    delta = torch.randn(10_001, generator=torch.Generator().manual_seed(0))
    pieces = lambda: iter(delta.split(777))  # noqa: E731  (a parameter at a time, afresh at each call)
    kept = store.put_parts(pieces, delta.numel())
    assert not kept.in_memory and (tmp_path / "delta-0.f32").stat().st_size == 4 * delta.numel()
    parts = kept.parts()
    assert not isinstance(parts, torch.Tensor) and parts.numel() == delta.numel()
    assert torch.equal(parts[3:9000], delta[3:9000]) and torch.equal(parts[9000:], delta[9000:])
    assert torch.equal(kept.get(), delta)
    (tmp_path / "delta-0.f32").write_bytes(b"\0" * 100)  # cut short while a round ran: refused at once, by size
    with pytest.raises(OSError, match="not the 40004 bytes written"):
        kept.parts()
    kept.drop()
    with pytest.raises(ValueError, match="dropped"):
        kept.parts()
    store.close()
