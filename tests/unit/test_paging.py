"""The averaging buffer in a file (`--global-state-on-disk`): shared with the forked averager as it is, and let
go a chunk at a time by every pass over it, the host's and the averager's, with the same bits as in memory."""

import contextlib
import os

import pytest
import torch
from hivemind.averaging.averager import compute_schema_hash

from p2pdiloco.core import codec, exact
from p2pdiloco.protocol.outcomes import Contribution, Solo
from p2pdiloco.core.state import GlobalState
from p2pdiloco.protocol.round import FormIsland
from p2pdiloco.runtime.paging import FileVectors, PagedStore
from p2pdiloco.protocol.merge import BodyStatistics, encode_piece as _encode_piece, land_piece as _land_piece
from p2pdiloco.swarm.averager import AVERAGED_CHUNK, ExactAverager, _paged_buffer, hivemind_schema
from tests.harness.merger import fake_merger

MB = 1 << 20


def test_file_vectors_keep_what_a_forked_child_wrote_after_both_let_their_pages_go(tmp_path):
    vectors = FileVectors(MB, 1, tmp_path, prefix="averaging-")
    buffer = vectors.vectors[0]
    assert list(tmp_path.iterdir()) == []  # unlinked at once
    buffer.fill_(1.0)
    vectors.let_go()
    assert vectors.resident_bytes() < 64 * 1024
    child = os.fork()
    if child == 0:  # the averager's side: it lands a sum and lets its pages go (numpy: torch's thread pool
        buffer.numpy()[: MB // 2] = 3.0  # does not survive a fork)
        vectors.let_go()
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    assert bool((buffer[: MB // 2] == 3.0).all()) and bool((buffer[MB // 2:] == 1.0).all())


def test_hivemind_gets_the_buffers_shapes_without_its_memory_and_hashes_them_as_before(tmp_path):
    """hivemind moves its averaged tensors into /dev/shm (share_memory_, its file_system strategy): handed the
    buffer's views, it copied a buffer kept in a file into memory. Its tensors now only describe the buffer, with
    the schema hash peers of earlier versions had (they meet in matchmaking only if the hashes agree)."""
    n = 3 * MB + 5
    vectors = FileVectors(n, 1, tmp_path, prefix="averaging-")
    buffer, at = vectors.vectors[0], vectors.vectors[0].data_ptr()
    schema = hivemind_schema(buffer)
    assert compute_schema_hash(schema) == compute_schema_hash(list(torch.zeros(n).split(AVERAGED_CHUNK)))
    assert sum(t.numel() for t in schema) == n
    # hivemind's default strategy, where a share copies (HIVEMIND_MEMORY_SHARING_STRATEGY can still choose it)
    with sharing_strategy("file_system"):
        for tensor in schema:  # what hivemind's __init__ does to them
            tensor.share_memory_()
        assert buffer.data_ptr() == at and len({t.untyped_storage().data_ptr() for t in schema}) == 1
        buffer.split(AVERAGED_CHUNK)[0].share_memory_()  # what it did before: the buffer copied, the file left behind
        assert buffer.data_ptr() != at


@contextlib.contextmanager
def sharing_strategy(name: str):
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy(name)
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)


def test_a_folder_that_cannot_hold_the_buffer_keeps_it_in_memory_and_says_so(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _paged_buffer(1000, blocker / "sub") is None  # a file where the folder should be
    assert "stays in memory" in caplog.text
    assert _paged_buffer(1000, None) is None


class RecordingAverager:
    """The averager's side of the host's load pass: its buffer in a file, and how much of it was in our memory
    whenever the pass let a chunk go."""

    def __init__(self, n: int, folder, wire):
        self.file = FileVectors(n, 1, folder, prefix="averaging-")
        self.wire, self.resident = wire, []

    @contextlib.contextmanager
    def buffer(self):
        yield self.file.vectors[0]

    def wire_format(self, group_size: int):
        return self.wire

    def let_go(self, part: slice) -> None:
        self.resident.append(self.file.resident_bytes())
        self.file.let_go(part)


WIRES = [codec.DenseFormat(codec.BITS["none"], 1), codec.DenseFormat(4, 1), codec.DenseFormat(2, 1),
         codec.TopKFormat(2, 1, 0.0156)]


def assert_let_go_a_chunk_at_a_time(resident: list, n: int) -> None:
    """`resident`: the buffer's bytes in our memory at each let-go of a pass over n elements: one let-go per chunk
    of exact.blockwise, never more than that chunk resident (and the pages at its ends)."""
    assert len(resident) == -(-n // exact._CHUNK), resident
    assert max(resident) <= 4 * exact._CHUNK + 8192, resident


@pytest.mark.parametrize("wire", WIRES, ids=["20-bit", "int4", "int2", "top-k"])
def test_the_hosts_load_pass_holds_a_chunk_of_the_buffer_at_a_time_and_gathers_the_whole_vectors_statistics(
        tmp_path, wire):
    n = 10 * MB + 12345  # 40 MB: several chunks and a short last block
    delta = torch.randn(n) * 1e-3
    residual = torch.randn(n) * 1e-5
    averager = RecordingAverager(n, tmp_path, wire)
    feedback = codec.ErrorFeedback()
    feedback.residual = residual
    merger = fake_merger(n, averager, feedback=feedback, bits=wire.bits)
    c = Contribution.of(delta, tokens=10, steps=2, version=3, peer="me", name="me", digest="d")
    record = merger._load_buffer(c, FormIsland(1.0, 2.0, 3.0, 4.0))

    assert_let_go_a_chunk_at_a_time(averager.resident, n)
    assert averager.file.resident_bytes() < 2 * 4096  # nothing of it left with us (the pages at its ends)
    sent = delta + residual  # what error feedback sends: Δ and what earlier rounds' codes dropped
    assert torch.equal(averager.file.vectors[0], sent)
    whole = BodyStatistics.of(sent, wire)
    assert record["maxabs"] == whole.statistic.numpy().tobytes()
    assert record["block_norms"] == whole.norms.numpy().tobytes()


def test_the_averager_lets_each_piece_of_the_buffer_go_once_coded_and_once_its_sum_landed(tmp_path):
    n, piece = 4 * MB, MB
    averager = ExactAverager.__new__(ExactAverager)  # the buffer's state only: no DHT, no process
    averager._paged = FileVectors(n, 1, tmp_path, prefix="averaging-")
    averager._parent_pid = None
    buffer = averager._paged.vectors[0]
    buffer.copy_(torch.randn(n) * 1e-3)
    scales = codec.agreed_scales([codec.block_maxabs(buffer).double()], 4)
    averager._paged.let_go()
    fmt = codec.DenseFormat(4, 1)
    encode = averager._paged_after(lambda a, b: _encode_piece(buffer, 1.0, scales, 4, fmt, a, b))
    land = averager._paged_after(lambda a, b, total, left_out: _land_piece(buffer, scales, {"me": 1.0}, a, b,
                                                                            total, left_out))
    totals = {}
    for start in range(0, n, piece):
        totals[start] = encode(start, start + piece)[0]
        assert averager._paged.resident_bytes() < 2 * 4096  # read, coded, let go
    for start, total in totals.items():
        land(start, start + piece, total.to(torch.int64), frozenset())
        assert averager._paged.resident_bytes() < 2 * 4096  # written, let go: the sum is in the file
    expected = codec.dequantize(torch.cat(list(totals.values())).to(torch.int64), scales)
    assert torch.equal(buffer, expected)


def test_the_outer_step_lets_each_chunk_of_a_file_backed_merged_update_go_once_read(tmp_path):
    n = 10 * MB + 3
    update = FileVectors(n, 1, tmp_path, prefix="averaging-")
    merged = update.vectors[0]
    merged.copy_(torch.randn(n) * 1e-3)
    update.let_go()
    resident = []

    def release(part: slice) -> None:
        resident.append(update.resident_bytes())
        update.let_go(part)

    start = torch.randn(n)
    paged, held = GlobalState(start.clone(), lr=0.7, momentum=0.9), GlobalState(start.clone(), lr=0.7, momentum=0.9)
    paged.apply(merged, ["a", "b"], release)
    assert max(resident) <= (4 << 22) + 8192 and update.resident_bytes() < 2 * 4096, resident
    held.apply(merged.clone(), ["a", "b"])
    assert torch.equal(paged.params, held.params) and paged.digest == held.digest


class RecordingStore(PagedStore):
    """A file-backed store that notes how much of its vector was in our memory whenever a pass let a chunk go."""

    def __init__(self, folder):
        super().__init__(folder, "residual-", "the residual")
        self.resident = []

    def let_go(self, view: torch.Tensor) -> None:
        self.resident.append(self.files[0].resident_bytes())
        super().let_go(view)


@pytest.mark.parametrize("wire", [WIRES[1], *(pytest.param(w, marks=pytest.mark.slow) for w in WIRES[2:])],
                         ids=["int4", "int2", "top-k"])  # int2 and top-k pass the same code: 7 s kept out of CI
def test_error_feedbacks_residual_in_a_file_holds_a_chunk_at_a_time_with_the_same_bits_as_in_memory(tmp_path, wire):
    n = 6 * MB + 12345  # 24 MB: a chunk and a half, so each pass lets one go while it holds the next
    store = RecordingStore(tmp_path)
    paged, held = codec.ErrorFeedback(store=store), codec.ErrorFeedback()
    chunk_bytes = 4 << 22  # exact.blockwise's chunk: 16 MB

    def passed() -> None:  # each pass held at most a chunk of the residual, and left none of it with us
        assert max(store.resident) <= chunk_bytes + 8192 and store.files[0].resident_bytes() < 2 * 4096, store.resident
        store.resident.clear()

    for weight in (1.0, 0.5):  # a round that makes the residual, then one that carries it
        delta = torch.randn(n) * 1e-3
        sent = {}
        for feedback in (paged, held):
            sent[id(feedback)] = piece = delta.clone()
            feedback.compensate_(piece)  # the host's load pass
        assert torch.equal(*sent.values())
        scales = codec.agreed_scales([wire.block_statistic(sent[id(held)]).double()], wire.bits)
        for feedback in (paged, held):
            feedback.record_encoded(delta, weight, scales, wire.bits, wire)
        passed()  # before comparing: reading the residual whole faults it all back in
        assert torch.equal(paged.residual, held.residual) and held.residual.abs().max() > 0
        store.files[0].let_go()  # what the comparison read back: a peer reads it only in its passes
    delta = torch.randn(n) * 1e-3
    merged = paged.alone(delta, wire.bits, wire)  # a solo round
    passed()
    assert torch.equal(merged, held.alone(delta, wire.bits, wire)) and torch.equal(paged.residual, held.residual)
    assert len(store.files) == 1  # made once, overwritten in place


def test_a_store_that_cannot_use_its_folder_keeps_vectors_in_memory_says_so_and_never_zeroes_them(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = PagedStore(blocker / "sub", "residual-", "the residual")
    vector = store.empty(3 * MB)
    assert "cannot keep the residual" in caplog.text and "stays in memory" in caplog.text
    vector.copy_(torch.arange(3 * MB, dtype=torch.float32))
    store.let_go(vector[MB:])  # a pass's release is a no-op on memory: MADV_DONTNEED would zero private pages
    assert torch.equal(vector, torch.arange(3 * MB, dtype=torch.float32))


@pytest.mark.parametrize("wire, feedback", [(WIRES[0], False), (WIRES[1], True)], ids=["20-bit", "int4"])
def test_a_solo_update_is_made_in_the_averaging_buffer_a_chunk_at_a_time(tmp_path, wire, feedback):
    """Alone, a peer merges its own Δ (or what its int4 codes would carry): written into the buffer, each chunk let
    go once done, with the bits of the update made in memory; no model-sized copy."""
    n = 6 * MB + 12345
    delta = torch.randn(n) * 1e-3
    averager = RecordingAverager(n, tmp_path, wire)
    held = codec.ErrorFeedback()
    merger = fake_merger(n, averager, feedback=codec.ErrorFeedback() if feedback else None, bits=wire.bits)
    c = Contribution.of(delta, tokens=10, steps=2, version=3, peer="me", name="me", digest="d")
    outcome = merger._solo(c, Solo.own(c))

    assert_let_go_a_chunk_at_a_time(averager.resident, n)
    assert averager.file.resident_bytes() < 2 * 4096
    merged = outcome.merged
    assert merged.data_ptr() == averager.file.vectors[0].data_ptr()  # the buffer itself, not a copy
    assert outcome.let_go == averager.let_go  # the outer step lets each chunk go again once read
    expected = held.alone(delta, wire.bits, wire) if feedback else delta
    assert torch.equal(merged, expected)
    if feedback:
        assert torch.equal(merger.feedback.residual, held.residual)
