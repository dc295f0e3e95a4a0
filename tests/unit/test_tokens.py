"""The real-model path, offline: a BPE trained here, token shards prepared from text, JSONL and Parquet, a
Llama built by transformers, its export, the run-wide window order and the swarm's learning-rate schedule."""

import json
import math

import numpy as np
import pytest
import torch

from p2pdiloco.config import ConfigError, InnerConfig, PeerConfig
from p2pdiloco.protocol.compat import mismatch
from p2pdiloco.protocol.remote import PeerRecord
from p2pdiloco.training import tokenizer as tokenizers
from p2pdiloco.training.data import (BatchStream, Source, WindowOrder, builtin_corpus_dir, load_data,
                                     order_seed, read_text, stream_seed, text_files)
from p2pdiloco.training.model import ModelError, build_model, config_fingerprint, resolve_config
from p2pdiloco.training.prepare import Plan, prepare
from p2pdiloco.training.schedule import inner_lr
from p2pdiloco.training.shards import MANIFEST, DataError, open_dataset


@pytest.fixture(scope="module")
def texts():
    """Eight plays of the built-in corpus (~1 MB), one document each."""
    return [read_text(f) for f in text_files(builtin_corpus_dir())[:8]]


@pytest.fixture(scope="module")
def bpe(texts, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    tokenizers.train_bpe(texts, 1024).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def dataset(texts, bpe, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "text").mkdir()
    for i, t in enumerate(texts[:4]):
        (root / "text" / f"{i}.md").write_text(t)
    with (root / "docs.jsonl").open("w") as f:
        for t in texts[4:6]:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": texts[6:8]}), root / "docs.parquet")
    sources = (str(root / "text"), str(root / "docs.jsonl"), str(root / "docs.parquet"))
    out = root / "prepared"
    prepare(Plan(sources=sources, tokenizer=str(bpe), out=out, shard_tokens=50_000, val_tokens=40_000))
    return out


def test_a_bpe_trained_here_round_trips_text_and_counts_its_bytes_exactly(texts, bpe):
    tok = tokenizers.load_tokenizer(str(bpe))
    ids = next(tokenizers.encode_batch(tok, [texts[0]]))
    assert tok.decode(ids) == texts[0]
    assert len(ids) < len(texts[0].encode()) / 2  # subwords: far fewer ids than bytes
    assert tokenizers.token_bytes(tok)[np.array(ids)].sum() == len(texts[0].encode())
    assert tokenizers.fingerprint(tok) == tokenizers.fingerprint(tokenizers.load_tokenizer(str(bpe / "tokenizer.json")))
    byte_tok = tokenizers.load_tokenizer("bytes")
    assert next(tokenizers.encode_batch(byte_tok, ["añ"])) == list("añ".encode())


def test_shards_from_text_jsonl_and_parquet_hold_every_document_once(texts, bpe, dataset):
    data = open_dataset(dataset)
    manifest = data.manifest
    assert manifest["documents"] == 8 and manifest["dtype"] == "<u2" and len(data.train) >= 3
    tok = tokenizers.load_tokenizer(str(bpe))
    eos = tokenizers.eos_id(tok)
    train, val = np.concatenate([np.asarray(s) for s in data.train]), np.asarray(data.val)
    assert manifest["train_tokens"] == len(train) and manifest["val"]["tokens"] == len(val)
    expected = [len(ids) + 1 for ids in tokenizers.encode_batch(tok, texts)]
    assert len(train) + len(val) == sum(expected)  # every document, once, with its end-of-text mark
    assert int((train == eos).sum()) + int((val == eos).sum()) == 8
    # document 0 went to validation (every 20th piece, from the first), up to the validation budget
    assert len(val) == min(expected[0], 40_000) == manifest["val"]["tokens"]
    assert tok.decode(val[:50].tolist()) == tok.decode(next(tokenizers.encode_batch(tok, [texts[0]]))[:50])
    assert manifest["tokenizer"]["sha256"] == tokenizers.fingerprint(tok)


def test_an_interrupted_prepare_leaves_no_dataset_and_resumes_to_the_same_shards(texts, bpe, dataset, tmp_path):
    sources = open_dataset(dataset).manifest["sources"]
    out = tmp_path / "again"
    plan = Plan(sources=tuple(sources), tokenizer=str(bpe), out=out, shard_tokens=50_000, val_tokens=40_000)
    seen = []

    def interrupt(n):
        seen.append(n)
        if len(seen) == 6:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(plan, on_bytes=interrupt)
    assert not (out / MANIFEST).exists() and list(out.glob("train-*.bin"))  # some shards sealed, no manifest
    with pytest.raises(DataError, match="unfinished prepare"):
        load_data((str(out),))
    resumed = prepare(plan)
    first = json.loads((dataset / MANIFEST).read_text())
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in first["shards"]]
    assert resumed["val"]["sha256"] == first["val"]["sha256"]
    with pytest.raises(DataError, match="already holds a prepared dataset"):
        prepare(plan)


def test_bad_data_gets_one_line(dataset, bpe, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(dataset, copy)
    shard = copy / "train-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="train-00001.bin: its sha256 does not match the manifest"):
        load_data((str(copy),))
    (tmp_path / "small.txt").write_text("too little text " * 100)
    with pytest.raises(DataError, match="too little text for a dataset"):
        prepare(Plan(sources=(str(tmp_path / "small.txt"),), tokenizer=str(bpe), out=tmp_path / "small"))
    (tmp_path / "table.xlsx").write_bytes(b"x")
    with pytest.raises(DataError, match="unsupported source format"):
        prepare(Plan(sources=(str(tmp_path / "table.xlsx"),), tokenizer="bytes", out=tmp_path / "x"))
    with pytest.raises(DataError, match="the hub could not provide it"):
        prepare(Plan(sources=("someone/some-dataset",), tokenizer="bytes", out=tmp_path / "hub"))
    with pytest.raises(tokenizers.TokenizerError, match="the hub could not provide it"):
        tokenizers.load_tokenizer("someone/some-tokenizer")
    with pytest.raises(DataError, match="not the tokenizer"):
        load_data((str(dataset),), tokenizer="bytes")


def test_models_are_presets_configs_or_folders_and_a_mismatch_is_one_line(bpe, tmp_path):
    config = resolve_config("tiny", vocab_size=1024)
    assert config.model_type == "llama" and config.vocab_size == 1024 and config.num_key_value_heads == 2
    assert config.tie_word_embeddings and config.num_attention_heads == 4
    config.save_pretrained(str(tmp_path / "mine"))
    assert config_fingerprint(resolve_config(str(tmp_path / "mine"), 1024)) == config_fingerprint(config)
    assert config_fingerprint(resolve_config(str(tmp_path / "mine" / "config.json"), 1000)) == config_fingerprint(config)
    with pytest.raises(ModelError, match="the tokenizer has 5000 ids but the model only 1024 embeddings"):
        resolve_config(str(tmp_path / "mine"), vocab_size=5000)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelError, match="transformers cannot read it"):
        resolve_config(str(tmp_path / "broken"), 256)
    with pytest.raises(ModelError, match="the hub could not provide it"):
        resolve_config("someone/some-model", 256)
    with pytest.raises(ConfigError, match="--model huge: not a preset"):
        PeerConfig(model="huge")


def test_the_model_is_built_by_transformers_identically_everywhere_and_its_export_gives_its_logits(bpe, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    config = resolve_config("tiny", vocab_size=1024)
    a, b = build_model(config, seed=3), build_model(config, seed=3)
    assert isinstance(a.hf, LlamaForCausalLM)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    a.hf.save_pretrained(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 1024, (2, 16))
    assert torch.equal(loaded(input_ids=tokens).logits, a.eval()(tokens))


def test_windows_follow_one_run_wide_order_and_a_restart_resumes_at_its_shard_and_offset(dataset):
    data = load_data((str(dataset),))
    stream = BatchStream(data.sources, 4, 64, stream_seed("peer", "run"), run_seed=order_seed("run"))
    for _ in range(5):
        next(stream)
    where = stream.where()
    resumed = BatchStream(data.sources, 4, 64, stream_seed("peer", "run"), position=5, run_seed=order_seed("run"))
    assert resumed.where() == where
    x, y = next(stream)
    assert torch.equal(next(resumed)[0], x) and torch.equal(x[:, 1:], y[:, :-1])
    shard = data.sources[0].shards[where["shard"]]
    assert np.array_equal(x[0].numpy(), shard[where["offset"]:where["offset"] + 64])


def test_a_window_order_is_a_permutation():
    shards = [np.arange(1001), np.arange(333), np.arange(50)]
    order = WindowOrder(shards, seq_len=10, seed=12345)
    seen = {order.where(i) for i in range(order.size)}
    assert len(seen) == order.size == 100 + 33 + 4
    assert all(off + 11 <= len(shards[s]) for s, off in seen)


def duplicate_rate(peers: int, draws: int, windows: int, segment: int) -> float:
    """The fraction of drawn windows that another peer (or the same one) drew too."""
    shard = np.arange(windows * 8 + 1)
    stream_of = [BatchStream([Source((shard,))], 8, 8, stream_seed(f"peer-{i}", "run"), run_seed=order_seed("run"),
                             segment=segment) for i in range(peers)]
    counts: dict[tuple, int] = {}
    for stream in stream_of:
        for position in range(draws // 8):
            for source, index in stream.draws_at(position):
                key = stream.orders[source].where(index)
                counts[key] = counts.get(key, 0) + 1
    drawn = sum(counts.values())
    return (drawn - len(counts)) / drawn


@pytest.mark.parametrize("peers, fraction", [(8, 0.02), (16, 0.01), (4, 0.1), (2, 0.25)])
def test_the_duplicate_window_rate_stays_under_the_stated_bound(peers, fraction):
    """The swarm draws f = peers × fraction of the windows; about f/2 of what it draws is drawn twice (segments
    land independently). The stated bound is f. A single walk from each peer's own start broke it: two peers
    that start close repeat each other's windows for the whole run (0.47 for two peers at a quarter each)."""
    windows = 100_000
    rate = duplicate_rate(peers, int(windows * fraction), windows, segment=256)
    f = peers * fraction
    assert 0.25 * f <= rate <= f, (rate, f / 2)  # and not vacuously low: the draws do overlap


def test_the_learning_rate_follows_the_swarms_tokens_whatever_the_peers_own_steps():
    cfg = InnerConfig(lr=1e-3, warmup_steps=10, lr_schedule="cosine", total_tokens=1_000_000, min_lr_ratio=0.1)
    tps = 1000
    assert inner_lr(cfg, 0, tps) == pytest.approx(1e-4)  # the first step, as a step-counted warm-up's
    assert inner_lr(cfg, 9_000, tps) == pytest.approx(1e-3)
    assert inner_lr(cfg, 10_000 + (1_000_000 - 10_000) // 2, tps) == pytest.approx(0.55e-3)
    assert inner_lr(cfg, 2_000_000, tps) == pytest.approx(1e-4)
    wsd = InnerConfig(lr=1e-3, warmup_steps=0, lr_schedule="wsd", total_tokens=1_000_000, decay_fraction=0.2)
    assert inner_lr(wsd, 800_000, tps) == 1e-3 and inner_lr(wsd, 900_000, tps) == pytest.approx(0.55e-3)
    with pytest.raises(ConfigError, match="needs --total-tokens"):
        InnerConfig(lr_schedule="wsd")


def test_a_joiner_trains_at_the_swarms_learning_rate(tmp_path):
    from p2pdiloco.core.state import GlobalState
    from p2pdiloco.training.diloco import DiLoCo
    from p2pdiloco.training.inner import InnerTrainer, flat_params

    cfg = InnerConfig(lr=1e-3, warmup_steps=100, batch_size=2, seq_len=8, lr_schedule="cosine",
                      total_tokens=50_000)
    text = np.random.default_rng(0).integers(0, 256, 10_000).astype(np.uint16)

    def peer():
        model = build_model("tiny", seed=0)
        trainer = InnerTrainer(model, BatchStream(text, 2, 8, 1), cfg, torch.device("cpu"))
        return DiLoCo(trainer, GlobalState(flat_params(model), 0.7, 0.9), None, "p", "p")

    veteran, joiner = peer(), peer()
    veteran.state.apply(torch.zeros(veteran.state.params.numel()), ["a", "b"], tokens=20_000)
    joiner.adopt(*veteran.state.snapshot())
    assert joiner.state.tokens == 20_000 and joiner.swarm_tokens == veteran.swarm_tokens
    joiner.inner_step(), veteran.inner_step()
    lr = joiner.trainer.optimizer.param_groups[0]["lr"]
    assert lr == veteran.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(inner_lr(cfg, 20_000, 16))
    assert lr < inner_lr(cfg, 9_000, 16)  # past the peak: not the start of a fresh warm-up
    assert inner_lr(cfg, 0, 16) < lr


def test_another_tokenizer_dataset_or_model_config_is_refused_at_join_with_its_name():
    fingerprints = dict(model_config="a" * 16, tokenizer="b" * 16, data="c" * 16)
    swarm = [PeerRecord(peer=p, name=p, version=3, digest="abcdef",
                        settings=PeerConfig().merge_settings(1000, fingerprints)) for p in "xy"]
    assert mismatch(PeerConfig().merge_settings(1000, fingerprints), swarm) is None
    for key in fingerprints:
        ours = PeerConfig().merge_settings(1000, dict(fingerprints, **{key: "d" * 16}))
        assert f"this peer's {key} is 'dddddddddddddddd' but the swarm's is" in mismatch(ours, swarm)


def test_bits_per_byte_of_bytes_is_the_loss_over_ln_2():
    from p2pdiloco.training.data import bits_per_byte_factor, validation_batches

    data = load_data()
    batches = validation_batches(data.val, 2, 4, 64)
    eos = tokenizers.eos_id(data.tokenizer)
    has_eos = any(bool((y == eos).any()) for _, y in batches)
    assert bits_per_byte_factor(batches, data.tokenizer) == pytest.approx(1 / math.log(2), rel=0.02 if has_eos else 1e-9)


def test_prepared_datasets_mix_by_weight_and_only_with_one_tokenizer(dataset, bpe, tmp_path):
    (tmp_path / "t.txt").write_text(read_text(text_files(builtin_corpus_dir())[9]))
    other = tmp_path / "other"
    prepare(Plan(sources=(str(tmp_path / "t.txt"),), tokenizer=str(bpe), out=other, val_tokens=5_000))
    one = open_dataset(other)  # one long document: cut for the split, the validation shard at its budget
    assert len(one.val) == 5_000 and len(one.train) == 1 and len(one.train[0]) > 50_000
    mixed = load_data((str(dataset), f"{other}:0.25"))
    assert [s.weight for s in mixed.sources] == [1.0, 0.25] and "mixed 1:0.25" in mixed.description
    stream = BatchStream(mixed.sources, 8, 32, stream_seed("p", "run"), run_seed=order_seed("run"))
    picks = [source for position in range(400) for source, _ in stream.draws_at(position)]
    assert abs(picks.count(1) / len(picks) - 0.2) < 0.02  # 0.25 of 1.25
    assert np.array_equal(mixed.val, open_dataset(dataset).val[:])  # the first dataset's validation shard
    bytes_cut = tmp_path / "bytes-cut"
    prepare(Plan(sources=(str(tmp_path / "t.txt"),), tokenizer="bytes", out=bytes_cut, val_tokens=5_000))
    with pytest.raises(DataError, match="cut by another tokenizer"):
        load_data((str(dataset), str(bytes_cut)))
    with pytest.raises(ConfigError, match="must be a weight"):
        PeerConfig(data=(f"{dataset}:lots",))


def test_init_from_starts_every_peer_from_the_same_pretrained_weights(tmp_path):
    pretrained = build_model(resolve_config("tiny", vocab_size=300), seed=11)
    pretrained.hf.save_pretrained(str(tmp_path / "pre"))
    config = resolve_config("small", vocab_size=300, init_from=str(tmp_path / "pre"))  # its config wins
    assert config.hidden_size == 128 and config_fingerprint(config) == config_fingerprint(pretrained.hf.config)
    loaded = build_model(config, seed=0, init_from=str(tmp_path / "pre"))
    assert all(torch.equal(p, q) for p, q in zip(loaded.parameters(), pretrained.parameters()))
    with pytest.raises(ModelError, match="the tokenizer has 1000 ids but the model only 320"):
        resolve_config("tiny", vocab_size=1000, init_from=str(tmp_path / "pre"))


def test_a_presets_residual_writers_start_smaller_by_depth():
    model = build_model(resolve_config("base", vocab_size=320), seed=0)  # 6 layers
    stds = {name.rsplit(".", 2)[-2]: float(p.std()) for name, p in model.named_parameters() if "layers.0." in name}
    assert stds["q_proj"] == pytest.approx(0.02, rel=0.05)
    for writer in ("o_proj", "down_proj"):
        assert stds[writer] == pytest.approx(0.02 / (2 * 6) ** 0.5, rel=0.05), writer


def test_validation_takes_every_twentieth_piece_from_the_first(tmp_path):
    """45 short documents, a piece each: validation holds documents 0, 20 and 40, in order, and training the 42
    others, so the validation split spans the corpus (its first 5 % would be one source's opening)."""
    docs = tmp_path / "docs.jsonl"
    texts = [f"document {i:03d}: " + "word " * (400 + i) for i in range(45)]
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare(Plan(sources=(str(docs),), tokenizer="bytes", out=tmp_path / "out", shard_tokens=4096,
                 val_tokens=1 << 20))
    data = open_dataset(tmp_path / "out")
    eos = 256
    val = np.asarray(data.val)
    held = [bytes(d[:-1].tolist()).decode() for d in np.split(val, np.flatnonzero(val == eos) + 1) if len(d)]
    assert held == [texts[0], texts[20], texts[40]]
    train = np.concatenate([np.asarray(s) for s in data.train])
    assert int((train == eos).sum()) == 42 and b"document 020" not in bytes(train[train < 256].astype(np.uint8))


def test_text_is_tokenized_once_and_read_back_at_a_restart_unless_its_cache_is_cut(texts, tmp_path, monkeypatch):
    import p2pdiloco.training.data as data_module

    (tmp_path / "t.txt").write_text(texts[0] + texts[1])
    cache = tmp_path / "cache"
    first = load_data((str(tmp_path / "t.txt"),), token_cache=cache)
    (kept,) = cache.glob("*.npy")

    def no_tokenizing(*_args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(data_module.tokenizers, "encode_batch", no_tokenizing)
    again = load_data((str(tmp_path / "t.txt"),), token_cache=cache)
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    assert again.fingerprint == first.fingerprint
    (tmp_path / "t.txt").write_text(texts[1] + texts[0])  # other text: its own tokens, not these
    with pytest.raises(AssertionError, match="tokenized again"):
        load_data((str(tmp_path / "t.txt"),), token_cache=cache)
    monkeypatch.undo()
    kept.write_bytes(kept.read_bytes()[:1000])  # cut by a kill or a full disk: tokenized again
    (tmp_path / "t.txt").write_text(texts[0] + texts[1])
    assert np.array_equal(load_data((str(tmp_path / "t.txt"),), token_cache=cache).train, first.train)
