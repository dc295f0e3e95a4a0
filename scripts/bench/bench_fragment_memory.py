"""What a peer's P fragments hold beside the global state it built: resident memory before `Streams` is built, after,
and once every fragment's momentum is written (as its first outer steps do), for one model preset, one process.

    python scripts/bench/bench_fragment_memory.py medium

For a before/after: run it with PYTHONPATH set to a checkout of the other commit (the script's own folder comes
first on sys.path, not the current directory)."""
import resource, sys, torch
torch.set_num_threads(1)
from p2pdiloco.config import InnerConfig
from p2pdiloco.core.fragments import Stagger
from p2pdiloco.core.state import GlobalState
from p2pdiloco.training.diloco import SoloMerger
from p2pdiloco.training.fragments import Streams
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model
model = build_model(sys.argv[1], seed=0)
n = sum(p.numel() for p in model.parameters())
trainer = InnerTrainer(model, iter(()), InnerConfig(batch_size=1, seq_len=16, warmup_steps=0), torch.device("cpu"))
theta = flat_params(model)
state = GlobalState(theta, lr=0.7, momentum=0.6, storage=(theta, torch.zeros_like(theta)))
import gc as _gc, os as _os
_gc.collect()
before = int(open("/proc/self/statm").read().split()[1]) * _os.sysconf("SC_PAGE_SIZE") / 1024
streams = Streams(trainer, state, lambda i, clock, s: SoloMerger(), Stagger(8, 64), "me", "me")
import gc, os
def rss():
    gc.collect()
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
after = rss()
for part in streams.parts:  # what the first outer steps write: every fragment's momentum
    part.state.outer.momentum_buffer.fill_(1.0)
used = rss()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(f"{sys.argv[1]}: {n/1e6:.1f} M params; RSS before Streams {before/1024:.0f} MB (peak), after {after:.0f} MB, with every momentum written {used:.0f} MB; peak {peak:.0f} MB")
