"""The Llama presets against the byte-level GPT they replaced, side by side in one run, each in fresh processes:

- speed and host memory: inner steps (AdamW, batch × seq_len tokens) of the GPT and of a Llama with the same
  width, depth and heads, its SwiGLU width chosen so the parameter counts match. Tokens per second of compute
  (the median of the timed steps), and the process's peak resident memory (VmHWM) whole and per parameter.
  The GPT is the code the project trained until 2026-11-28 (p2pdiloco/training/model.py then), kept here only
  as this baseline.
- dataset size: a process that opens a prepared dataset (hashing every shard), draws batches from it and trains
  steps of a small model, on a small and on a large dataset of random tokens; its peak resident memory.

    python scripts/bench/bench_model.py [--sizes small medium] [--device cpu|cuda] [--json OUT] [--profile-dir DIR]

Run alone on the machine: the timings share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"small": (256, 4, 4), "medium": (512, 8, 8), "large": (768, 14, 12)}  # the GPT's (width, depth, heads)


# ---- the baseline: the byte-level GPT as it was ------------------------------------------------------------
def legacy_gpt(width: int, depth: int, heads: int, vocab: int = 256, positions: int = 1024, recompute: bool = False):
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(width), nn.RMSNorm(width)
            self.qkv = nn.Linear(width, 3 * width, bias=False)
            self.proj = nn.Linear(width, width, bias=False)
            self.up = nn.Linear(width, 4 * width, bias=False)
            self.down = nn.Linear(4 * width, width, bias=False)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.pos = nn.Embedding(vocab, width), nn.Embedding(positions, width)
            self.blocks = nn.ModuleList(Block() for _ in range(depth))
            self.norm = nn.RMSNorm(width)

        def forward(self, tokens, targets):
            x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
            logits = self.norm(x) @ self.embed.weight.T
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    torch.manual_seed(0)
    return GPT()


def matched_llama(width: int, depth: int, heads: int, n_params: int):
    """A Llama of the GPT's width, depth and heads (bytes: 257 ids, padded to 320 rows) whose SwiGLU width makes
    its parameter count the GPT's, rounded to a multiple of 64 (within 0.5 %). Unrounded (2,070 for `large`), the
    bf16 matrix products miss the GPU's tensor-core kernels: on an H200 on 2026-11-28 that Llama ran at 0.27-0.34
    of the GPT's tokens/s, the suspected cause, not yet measured apart."""
    from p2pdiloco.config import ModelShape
    from p2pdiloco.training.model import build_model, preset_config

    probe = ModelShape(hidden=width, layers=depth, heads=heads, kv_heads=heads, intermediate=0)
    rest = probe.n_params(320)
    intermediate = max(64, round((n_params - rest) / (3 * width * depth) / 64) * 64)
    shape = ModelShape(hidden=width, layers=depth, heads=heads, kv_heads=heads, intermediate=intermediate)
    return build_model(preset_config(shape, 257), seed=0)


def status(field: str) -> int:
    """A /proc/self/status figure in bytes: VmHWM (peak resident), RssAnon (private), RssFile (mapped files)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    return status("VmHWM")


# ---- workers (one fresh process each) -----------------------------------------------------------------------
def blocks(model) -> list:
    """The model's repeated blocks: the GPT's, or the Llama's decoder layers."""
    return list(model.blocks) if hasattr(model, "blocks") else list(model.hf.model.layers)


def speed_worker(kind: str, size: str, device: str, batch: int, seq_len: int, steps: int, recompute: bool,
                 profile_dir: str = "", compiled: bool = False) -> dict:
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    width, depth, heads = SHAPES[size]
    gpt = legacy_gpt(width, depth, heads, recompute=recompute)
    n_gpt = sum(p.numel() for p in gpt.parameters())
    model = gpt if kind == "gpt" else matched_llama(width, depth, heads, n_gpt)
    if kind != "gpt":
        del gpt
        model.checkpoint_blocks = recompute  # transformers' own, per decoder layer
    model = model.to(device)
    if compiled:  # each block compiled on its own (torch.compile; the first step pays, untimed)
        for block in blocks(model):
            block.compile()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda" or None)
    data = torch.randint(0, 256, (steps + 2, batch, seq_len + 1))

    def one_step(i: int) -> float:
        x, y = data[i % len(data), :, :-1].to(device), data[i % len(data), :, 1:].to(device)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times = [one_step(i) for i in range(steps + 2)]
    step = statistics.median(times[2:])  # the first steps pay for allocations and kernel choices
    if profile_dir:  # where the time goes, by operator: 3 more steps (after the timed ones, not counted in them)
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            for i in range(3):
                one_step(i)
        key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        Path(profile_dir, f"profile-{kind}-{size}-{device}.txt").write_text(
            prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))
    peak = peak_rss()
    return dict(kind=kind, size=size, device=device, recompute=recompute, compiled=compiled, params=n_params,
                tokens_per_s=batch * seq_len / step,
                host_peak_bytes=peak, host_bytes_per_param=peak / n_params,
                device_peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None)


def dataset_worker(folder: str, batches: int) -> dict:
    import torch

    from p2pdiloco.config import InnerConfig
    from p2pdiloco.training.data import BatchStream, load_data, order_seed, stream_seed
    from p2pdiloco.training.inner import InnerTrainer
    from p2pdiloco.training.model import build_model, resolve_config

    torch.set_num_threads(1)
    started = time.monotonic()
    data = load_data((folder,))
    opened = time.monotonic() - started
    stream = BatchStream(data.sources, 16, 128, stream_seed("peer", "bench"), run_seed=order_seed("bench"))
    model = build_model(resolve_config("tiny", len(data.tokenizer)), seed=0)
    trainer = InnerTrainer(model, stream, InnerConfig(batch_size=16, seq_len=128), torch.device("cpu"))
    for _ in range(batches):
        trainer.train_step()
    tokens = sum(len(s) for s in data.sources[0].shards)
    return dict(tokens=tokens, open_seconds=opened, host_peak_bytes=peak_rss(), anonymous_bytes=status("RssAnon"),
                file_bytes=status("RssFile"), batches=batches)


def write_random_dataset(folder: Path, tokens: int, shard_tokens: int) -> None:
    """A valid prepared dataset of random ids (the bytes tokenizer's): as a peer sees it, without the prepare."""
    import numpy as np

    from p2pdiloco.training import tokenizer as tokenizers
    from p2pdiloco.runtime.files import sha256_file
    from p2pdiloco.training.shards import FORMAT, MANIFEST, TOKENIZER_DIR

    folder.mkdir(parents=True)
    tok = tokenizers.byte_tokenizer()
    rng = np.random.default_rng(0)
    shards = []
    for i, start in enumerate(range(0, tokens, shard_tokens)):
        name = f"train-{i:05d}.bin"
        rng.integers(0, 257, min(shard_tokens, tokens - start), dtype=np.uint16).tofile(folder / name)
        shards.append(dict(file=name, tokens=min(shard_tokens, tokens - start), sha256=sha256_file(folder / name)))
    rng.integers(0, 257, 100_000, dtype=np.uint16).tofile(folder / "val.bin")
    manifest = dict(format=FORMAT, dtype="<u2", shards=shards,
                    val=dict(file="val.bin", tokens=100_000, sha256=sha256_file(folder / "val.bin"), bytes=100_000),
                    tokenizer=dict(sha256=tokenizers.fingerprint(tok), vocab_size=257, eos_id=256, source="bytes"))
    tok.save_pretrained(str(folder / TOKENIZER_DIR))
    (folder / MANIFEST).write_text(json.dumps(manifest))


# ---- the driver ---------------------------------------------------------------------------------------------
def run_worker(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                         filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))))
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"], choices=list(SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--recompute", action="store_true",
                        help="Both models recompute each block's activations in the backward pass.")
    parser.add_argument("--compile", action="store_true",
                        help="Both models compile each block (torch.compile); the untimed first steps compile.")
    parser.add_argument("--no-datasets", action="store_true", help="Leave out the dataset-size part.")
    parser.add_argument("--repeats", type=int, default=2, help="Alternating runs of each model; the best is kept.")
    parser.add_argument("--small-tokens", type=int, default=10_000_000)
    parser.add_argument("--large-tokens", type=int, default=1_000_000_000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile-dir", type=Path,
                        help="Also profile 3 steps of each model (after the timed ones): a table per model here.")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        kind, *rest = a.worker
        result = dataset_worker(rest[0], int(rest[1])) if kind == "dataset" else speed_worker(
            kind, rest[0], rest[1], int(rest[2]), int(rest[3]), int(rest[4]), rest[5] == "1", rest[6], rest[7] == "1")
        print(json.dumps(result))
        return
    rows = []
    for size in a.sizes:
        best = {}
        for _ in range(a.repeats):
            for kind in ("gpt", "llama"):
                r = run_worker(kind, size, a.device, str(a.batch_size), str(a.seq_len), str(a.steps),
                               str(int(a.recompute)), str(a.profile_dir or ""), str(int(a.compile)))
                if kind not in best or r["tokens_per_s"] > best[kind]["tokens_per_s"]:
                    best[kind] = dict(r, host_peak_bytes=min(r["host_peak_bytes"],
                                                             best.get(kind, r)["host_peak_bytes"]))
        g, l = best["gpt"], best["llama"]
        rows.append(dict(size=size, gpt=g, llama=l, speed_ratio=l["tokens_per_s"] / g["tokens_per_s"],
                         host_ratio=l["host_peak_bytes"] / g["host_peak_bytes"]))
        mode = " recompute" * a.recompute + " compiled" * a.compile
        print(f"{size:<7} {a.device}{mode}: params GPT {g['params'] / 1e6:.2f}M, Llama {l['params'] / 1e6:.2f}M | tokens/s "
              f"GPT {g['tokens_per_s']:.0f}, Llama {l['tokens_per_s']:.0f} (x{rows[-1]['speed_ratio']:.3f}) | host "
              f"peak GPT {g['host_peak_bytes'] / 1e9:.3f} GB ({g['host_bytes_per_param']:.1f} B/param), Llama "
              f"{l['host_peak_bytes'] / 1e9:.3f} GB ({l['host_bytes_per_param']:.1f} B/param) "
              f"(x{rows[-1]['host_ratio']:.3f})", flush=True)
    sizes, ratio = {}, None
    with tempfile.TemporaryDirectory(dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as tmp:
        if a.no_datasets:
            tmp = None
        for label, tokens in (("small", a.small_tokens), ("large", a.large_tokens)) if tmp else ():
            write_random_dataset(Path(tmp) / label, tokens, shard_tokens=min(tokens, 1 << 26))
            sizes[label] = run_worker("dataset", str(Path(tmp) / label), "50")
    if sizes:
        ratio = sizes["large"]["host_peak_bytes"] / sizes["small"]["host_peak_bytes"]
        s, l = sizes["small"], sizes["large"]
        print(f"dataset: peak {s['host_peak_bytes'] / 1e9:.3f} GB on {s['tokens'] / 1e6:.0f}M tokens, "
              f"{l['host_peak_bytes'] / 1e9:.3f} GB on {l['tokens'] / 1e6:.0f}M (x{ratio:.3f}); at the end anonymous "
              f"{s['anonymous_bytes'] / 1e9:.3f} and {l['anonymous_bytes'] / 1e9:.3f} GB, mapped files "
              f"{s['file_bytes'] / 1e9:.3f} and {l['file_bytes'] / 1e9:.3f} GB; opening (hashing) took "
              f"{s['open_seconds']:.1f} and {l['open_seconds']:.1f} s")
    if a.json:
        a.json.write_text(json.dumps(dict(models=rows, datasets=sizes, dataset_ratio=ratio, argv=sys.argv[1:],
                                          date=time.strftime("%Y-%m-%d")), indent=1))


if __name__ == "__main__":
    main()
