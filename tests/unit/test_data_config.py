import os
from pathlib import Path

import numpy as np
import pytest
import torch

from p2pdiloco.config import ConfigError, InnerConfig, OuterConfig, PeerConfig, SwarmConfig
from p2pdiloco.training.data import BatchStream, DataError, load_corpus, split_corpus, stream_seed, validation_batches


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_builtin_corpus_is_megabytes_of_text_with_a_disjoint_validation_split(corpus):
    assert len(corpus.train) > 4_000_000 and len(corpus.val) > 200_000
    text = bytes(corpus.val[:2000].tolist()).decode("utf-8", errors="replace")
    assert sum(c.isalpha() for c in text) > 1000  # natural language, not noise
    # disjoint: no 64-token span of the validation split (one every 4,096 tokens) occurs in the training split
    train = bytes(corpus.train.astype(np.uint8))
    spans = [bytes(corpus.val[i:i + 64].astype(np.uint8)) for i in range(0, len(corpus.val) - 64, 4096)]
    assert len(spans) > 40 and sum(span in train for span in spans) <= len(spans) // 20  # plays repeat a few lines


def test_split_interleaves_every_twentieth_chunk():
    """Chunk i holds the value i: validation takes chunks 19, 39, 59 and 79, in order, and training every other
    one, so both halves span the whole corpus (the first 5 % would be one play, or one source file)."""
    size = 16384  # a small corpus is cut into 4 × VAL_EVERY chunks
    data = np.repeat(np.arange(80, dtype=np.uint8), size)
    c = split_corpus(data)
    assert np.array_equal(c.val, np.repeat(np.array([19, 39, 59, 79], dtype=np.uint8), size))
    assert np.array_equal(c.train, np.repeat(np.array([i for i in range(80) if i % 20 != 19], dtype=np.uint8), size))


def test_streams_of_two_peers_differ_and_are_reproducible(corpus):
    a1 = BatchStream(corpus.train, 4, 32, stream_seed("peer-a", "run"))
    a2 = BatchStream(corpus.train, 4, 32, stream_seed("peer-a", "run"))
    b = BatchStream(corpus.train, 4, 32, stream_seed("peer-b", "run"))
    xa1, xa2, xb = next(a1)[0], next(a2)[0], next(b)[0]
    assert torch.equal(xa1, xa2)
    assert not torch.equal(xa1, xb)
    resumed = BatchStream(corpus.train, 4, 32, stream_seed("peer-a", "run"), position=1)
    assert torch.equal(next(resumed)[0], next(a1)[0])


def test_targets_are_inputs_shifted_by_one(corpus):
    x, y = next(BatchStream(corpus.train, 2, 16, 0))
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_validation_batches_are_identical_everywhere(corpus):
    """A fixed function of the split alone (no seed, no peer): evenly spaced windows from its first token to its
    last, so two peers, or one peer before and after a restart, evaluate on the same tokens."""
    v1 = validation_batches(corpus.val, 2, 4, 32)
    assert [x.shape for x, _ in v1] == [(4, 32), (4, 32)]
    first, last = v1[0][0][0], v1[-1][1][-1]
    assert torch.equal(first, torch.from_numpy(corpus.val[:32].astype("int64")))
    assert torch.equal(last, torch.from_numpy(corpus.val[-33:-1].astype("int64")))  # the last window's targets
    torch.manual_seed(123)  # whatever the global generator's state
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(v1, validation_batches(corpus.val, 2, 4, 32)))


def test_user_data_path(tmp_path):
    (tmp_path / "a.txt").write_text("hello world. " * 30000)
    corpus = load_corpus(tmp_path)
    assert len(corpus.train) > 0 and len(corpus.val) > 0
    assert len(load_corpus(tmp_path / "a.txt").train) > 0
    (tmp_path / "tiny.txt").write_text("too short")
    with pytest.raises(DataError, match="at least"):
        load_corpus(tmp_path / "tiny.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        load_corpus(tmp_path / "empty")


def test_unreadable_data_is_a_clear_error_not_a_traceback(tmp_path):
    with pytest.raises(DataError, match="cannot read /proc/self/mem: "):
        load_corpus(Path("/proc/self/mem"))  # a file even root cannot read from offset 0
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="not a regular file"):  # reading it would block forever
        load_corpus(fifo)


@pytest.mark.parametrize("make, message", [
    (lambda: InnerConfig(steps=0), "steps must be a positive integer"),
    (lambda: InnerConfig(lr=-1.0), "lr must be a positive number"),
    (lambda: OuterConfig(momentum=1.0), "outer momentum must be in"),
    (lambda: OuterConfig(stale_factor=0.0), "stale factor must be in (0, 1]"),  # 0 would exclude every late member
    (lambda: OuterConfig(stale_factor=1.5), "stale factor must be in (0, 1]"),
    (lambda: SwarmConfig(quorum=5, max_island=4), "quorum (5) cannot exceed"),
    (lambda: SwarmConfig(run_id="has space"), "run id must be"),
    (lambda: SwarmConfig(initial_peers=("localhost:1234",)), "is not a multiaddr"),
    (lambda: PeerConfig(model="huge"), "--model huge: not a preset (tiny"),
    (lambda: PeerConfig(throttle=0.5), "throttle must be"),
    (lambda: PeerConfig(data="/does/not/exist"), "no such file"),
])
def test_config_errors_say_what_is_wrong(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert message in str(e.value)
