"""The real path end to end, offline: a BPE trained and a dataset prepared through the CLI, two peers training a
transformers Llama on its memory-mapped shards, a peer with another dataset refused at join, and the merged
model exported to a folder that transformers loads with the peers' logits."""

import json
import signal
import subprocess
import sys

import pytest
import torch

from p2pdiloco.training import checkpoint
from tests.harness.swarm import local_swarm

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]


def cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2pdiloco.cli", *args], capture_output=True, text=True,
                          timeout=240, cwd=cwd)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    made = cli("tokenizer", "train", "builtin:shakespeare", "--vocab-size", "1024", "--out", str(root / "bpe"),
               "--max-documents", "12")
    assert made.returncode == 0, made.stderr
    made = cli("data", "prepare", "builtin:shakespeare", "--tokenizer", str(root / "bpe"), "--out", str(root / "ds"),
               "--shard-tokens", "200000", "--val-tokens", "50000")
    assert made.returncode == 0, made.stderr
    assert "MB/s" in made.stdout and (root / "ds" / "manifest.json").is_file()
    return root


def test_peers_train_a_llama_on_prepared_shards_and_its_export_gives_their_logits(prepared, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from p2pdiloco.training.data import load_data, validation_batches
    from p2pdiloco.training.export import load_exported
    from p2pdiloco.training.inner import evaluate
    from p2pdiloco.training.model import CausalLM

    data = ["--data", str(prepared / "ds"), "-H", "10", "--batch-size", "4", "--seq-len", "32", "--quorum", "2"]
    with local_swarm(tmp_path, "real") as swarm:
        # a and b train until the odd peer has been refused: it must find them live, and its start (20.9 s of
        # imports on a loaded machine) once outlasted their 6 rounds, so it found nobody and trained alone
        for name in "ab":
            swarm.start_peer(name, *data, "--max-rounds", "1000")
        swarm.wait_for(lambda: swarm.records("a", "start"), 120, "a to start")
        odd = swarm.start_peer("odd", "--max-rounds", "1")  # the built-in text, bytes: another tokenizer and data
        assert odd.wait(120) == 1, swarm.log("odd")[-3000:]
        swarm.wait_for(lambda: sum(r.applied for r in swarm.records("a", "round")) >= 6, 240, "a to merge 6 rounds")
        for name in "ab":  # each leaves with a checkpoint
            swarm.procs[name].send_signal(signal.SIGTERM)
        swarm.wait_clean("ab", 120)
    refusal = swarm.log("odd")
    assert "cannot merge with this swarm: this peer's data is" in refusal and "Traceback" not in refusal
    rounds = [r for r in swarm.records("a", "round") if r.applied]
    assert len(rounds) >= 6 and all(sorted(r.members) == ["a", "b"] for r in rounds)
    assert rounds[-1].val_bpb is not None and 0 < rounds[-1].val_bpb < rounds[-1].val_loss
    # the tokens merged into the global state, as every member counts them (the lr schedule's clock): each version's
    # merge as whichever peer applied it recorded it, summed
    merged = {r.version: r.tokens_merged for name in "ab" for r in swarm.records(name, "round") if r.applied}
    final = max((r for name in "ab" for r in swarm.records(name, "round") if r.applied), key=lambda r: r.version)
    assert sorted(merged) == list(range(1, final.version + 1)) and final.swarm_tokens == sum(merged.values()) > 0
    saved = checkpoint.list_checkpoints(tmp_path / "checkpoints" / "real" / "a")[0]
    meta = json.loads((saved / checkpoint.META).read_text())
    assert meta["stream_at"]["shard"] >= 0 and meta["stream_position"] >= 60 and meta["tokens"] > 0

    out = tmp_path / "hf"
    exported = cli("export", str(tmp_path / "checkpoints"), "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok("To be, or not to be", return_tensors="pt")["input_ids"]
    ours = load_exported(tmp_path / "checkpoints")
    peer = ours.checkpoint.parent.name  # the newest checkpoint: its peer's last version, written as it left
    assert ours.version == max(r.version for r in swarm.records(peer, "round") if r.applied)
    assert torch.equal(hf(input_ids=ids).logits, ours.model(ids))
    # and it is the global model the peer itself evaluated on leaving (not its local one): the same loss on the
    # same fixed validation windows, computed by transformers' model from the exported folder
    batches = validation_batches(load_data((str(prepared / "ds"),)).val, 8, 4, 32)
    exported_loss = evaluate(CausalLM(hf), batches, torch.device("cpu"))
    assert exported_loss == pytest.approx(swarm.records(peer, "summary")[-1].final_val, rel=1e-5)
    sampled = cli("sample", str(out), "--prompt", "ROMEO.", "--max-new-tokens", "12")
    assert sampled.returncode == 0 and sampled.stdout.startswith("ROMEO.") and len(sampled.stdout) > 10

    again = cli("export", str(tmp_path / "checkpoints"), "--out", str(out))
    assert again.returncode == 1 and "already holds a model" in again.stderr
    missing = cli("export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x"))
    assert missing.returncode == 1 and "no checkpoint there" in missing.stderr and "Traceback" not in missing.stderr
    (saved / checkpoint.TENSORS).write_bytes(b"damaged")
    damaged = cli("export", str(saved), "--out", str(tmp_path / "y"))
    assert damaged.returncode == 1 and "hash mismatch" in damaged.stderr and "Traceback" not in damaged.stderr
