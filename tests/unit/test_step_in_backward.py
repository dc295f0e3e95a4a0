"""--step-in-backward: the inner optimizer steps each parameter inside the backward pass, as soon as its
gradient is complete, so the whole model's gradients are never held at once (docs/hardware.md)."""

import pytest
import torch

from p2pdiloco.config import ConfigError, InnerConfig
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.inner import InnerTrainer, flat_params, optimizer_state
from p2pdiloco.training.model import build_model

TEXT = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def trainer(optimizer: str, in_backward: bool) -> tuple[InnerTrainer, list]:
    """A trainer, and how many of its parameters hold a gradient each time one's gradient is complete."""
    model = build_model("tiny", seed=0)
    params, held = list(model.parameters()), []
    for p in params:  # registered before the trainer's hooks: runs first, while this gradient is still there
        p.register_post_accumulate_grad_hook(lambda _: held.append(sum(q.grad is not None for q in params)))
    cfg = InnerConfig(steps=3, batch_size=4, seq_len=16, warmup_steps=2, grad_clip=0, optimizer=optimizer,
                      step_in_backward=in_backward)
    return InnerTrainer(model, BatchStream(TEXT, 4, 16, seed=1), cfg, torch.device("cpu")), held


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_stepping_in_the_backward_pass_gives_the_same_bits_and_never_holds_every_gradient(optimizer):
    (fused, held_fused), (plain, held_plain) = trainer(optimizer, True), trainer(optimizer, False)
    for _ in range(4):  # past the warm-up: the lr changes between steps
        assert torch.equal(fused.train_step(), plain.train_step())
    assert torch.equal(flat_params(fused.model), flat_params(plain.model))
    fused_state, fused_scalars = optimizer_state(fused.optimizer, fused.model.parameters())
    plain_state, plain_scalars = optimizer_state(plain.optimizer, plain.model.parameters())
    assert fused_scalars == plain_scalars and fused_state.keys() == plain_state.keys()
    assert all(torch.equal(fused_state[k], plain_state[k]) for k in plain_state)  # a checkpoint cannot tell them apart
    n = len(list(plain.model.parameters()))
    assert max(held_fused) == 1 and max(held_plain) == n  # one gradient at a time, against all of them
    assert all(p.grad is None for p in fused.model.parameters())


def test_stepping_in_the_backward_pass_refuses_gradient_clipping():
    with pytest.raises(ConfigError, match="needs --grad-clip 0"):
        InnerConfig(step_in_backward=True)
