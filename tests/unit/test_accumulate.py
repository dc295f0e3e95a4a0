"""--accumulate: an inner step sums the gradients of several micro-batches, so a peer with little memory takes
the steps of a larger batch (the lever docs/parity.md measured on the gap to data-parallel)."""

import pytest
import torch

from p2pdiloco.config import ConfigError, InnerConfig
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model

SEQ = 16


def windows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def trainer(batches: list, batch_size: int, accumulate: int) -> InnerTrainer:
    cfg = InnerConfig(batch_size=batch_size, accumulate=accumulate, seq_len=SEQ, warmup_steps=0, lr=1e-2)
    return InnerTrainer(build_model("tiny", seed=0), iter(batches), cfg, torch.device("cpu"))


def test_four_micro_batches_step_as_one_batch_four_times_as_large():
    steps = [windows(8, seed) for seed in range(3)]
    whole = trainer(steps, batch_size=8, accumulate=1)
    micro = trainer([(x[i:i + 2], y[i:i + 2]) for x, y in steps for i in range(0, 8, 2)], batch_size=2, accumulate=4)
    one = trainer([(x[:2], y[:2]) for x, y in steps], batch_size=2, accumulate=1)
    grads = {}
    for name, t in (("whole", whole), ("micro", micro)):  # the gradient the step takes: the last one accumulated
        p = next(t.model.parameters())
        p.register_post_accumulate_grad_hook(lambda q, name=name: grads.__setitem__(name, q.grad.clone()))
    assert micro.tokens_per_step == whole.tokens_per_step == 8 * SEQ == 4 * one.tokens_per_step
    for _ in range(3):
        loss_whole, loss_micro, _ = whole.train_step(), micro.train_step(), one.train_step()
        assert float(loss_micro) == pytest.approx(float(loss_whole), rel=1e-5)  # the mean of equal micro-batches
        gap = (grads["micro"] - grads["whole"]).norm() / grads["whole"].norm()
        assert gap < 1e-3  # the mean gradient, not the micro-batches' sum
    a, b, c = flat_params(whole.model), flat_params(micro.model), flat_params(one.model)
    # float sums apart (AdamW's normalization magnifies them where a gradient is near 0): 2e-5 of the distance to
    # the model a quarter of the batch trains
    assert (a - b).norm() < 1e-3 * (a - c).norm()
    assert micro.total_steps == 3


def test_accumulation_is_refused_where_the_step_happens_inside_the_backward_pass():
    with pytest.raises(ConfigError, match="--step-in-backward"):
        InnerConfig(step_in_backward=True, grad_clip=0, accumulate=2)
    with pytest.raises(ConfigError, match="accumulate must be a positive integer"):
        InnerConfig(accumulate=0)
