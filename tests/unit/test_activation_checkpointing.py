"""--activation-checkpointing: each block's activations are recomputed in the backward pass instead of kept
from the forward pass; the same bits, a fraction of the memory held between the two passes."""

import pytest
import torch

from p2pdiloco.config import ConfigError, InnerConfig
from p2pdiloco.training.data import BatchStream
from p2pdiloco.training.inner import InnerTrainer, flat_params
from p2pdiloco.training.model import build_model

TEXT = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)


def trainer(recompute: bool, **overrides) -> InnerTrainer:
    cfg = InnerConfig(steps=3, batch_size=4, seq_len=32, warmup_steps=2, activation_checkpointing=recompute,
                      **overrides)
    return InnerTrainer(build_model("tiny", seed=0), BatchStream(TEXT, 4, 32, seed=1), cfg,
                        torch.device("cpu"))


@pytest.mark.parametrize("overrides", [{}, dict(step_in_backward=True, grad_clip=0)], ids=["plain", "in-backward"])
def test_recomputing_activations_gives_the_same_bits(overrides):
    recomputed, kept = trainer(True, **overrides), trainer(False, **overrides)
    for _ in range(4):  # past the warm-up
        assert torch.equal(recomputed.train_step(), kept.train_step())
    assert torch.equal(flat_params(recomputed.model), flat_params(kept.model))


def saved_for_backward(t: InnerTrainer) -> int:
    """Bytes the forward pass keeps for the backward pass (what a checkpointed block saves inside itself is
    dropped by its own hooks, which sit inside ours)."""
    saved = []

    def pack(x):
        saved.append(x.numel() * x.element_size())
        return x

    inputs, targets = next(t.batches)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = t.model(inputs, targets)
    loss.backward()
    return sum(saved)


def test_recomputing_activations_keeps_a_fraction_of_them_between_the_passes():
    kept, recomputed = saved_for_backward(trainer(False)), saved_for_backward(trainer(True))
    assert recomputed < kept / 4, (recomputed, kept)


def test_a_model_that_cannot_recompute_its_blocks_is_refused():
    with pytest.raises(ConfigError, match="cannot recompute"):
        InnerTrainer(torch.nn.Linear(2, 2), iter(()), InnerConfig(activation_checkpointing=True), torch.device("cpu"))
